"""Model configs: `load_config` in every format, its checks and errors, MaskSpec, the example.

Layer masks are compared with hand-written builder expressions; errors are
checked for their class, the file, the key path and the caret's column inside
the offending expression.
"""

import dataclasses
import json
import pathlib
import pickle
import sys
import warnings

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import given, settings

import maskc
from maskc.language import ir

ROOT = pathlib.Path(__file__).resolve().parents[1]

LLAMA4 = {"num_layers": 8, "params": {"C": 8192}, "default": "causal",
          "layers": {"pattern": ["causal & chunk(C)", "causal & chunk(C)",
                                 "causal & chunk(C)", None]}}
LLAMA4_YAML = """\
# Llama 4: three chunked layers, then one global layer.
num_layers: 8
params: {C: 8192}
default: causal
layers:
  pattern: [causal & chunk(C), causal & chunk(C), causal & chunk(C), null]
"""
LLAMA4_TOML = """\
num_layers = 8
default = "causal"
[params]
C = 8192
[layers]
pattern = ["causal & chunk(C)", "causal & chunk(C)", "causal & chunk(C)", "causal"]
"""

GEMMA3 = {"num_layers": 26, "params": {"W": 1024},
          "definitions": {"local": "sliding(W)", "global_": "causal"},
          "layers": {"pattern": ["local"] * 5 + ["global_"]}}
GEMMA3_YAML = """\
# Gemma 3: five sliding-window layers, then one global layer.
num_layers: 26
params:
  W: 1024
definitions:
  local: sliding(W)
  global_: causal
layers:
  pattern: [local, local, local, local, local, global_]
"""
GEMMA3_TOML = """\
num_layers = 26
params = { W = 1024 }
[definitions]
local = "sliding(W)"
global_ = "causal"
[layers]
pattern = ["local", "local", "local", "local", "local", "global_"]
"""


def write(tmp_path, name, text):
  path = tmp_path / name
  path.write_text(text)
  return path


def load_as(fmt, tmp_path, data, yaml_text=None, toml_text=None, **params):
  """Loads one config written as a dict, JSON, TOML or YAML."""
  if fmt == "dict":
    return maskc.load_config(data, **params)
  if fmt == "json":
    return maskc.load_config(write(tmp_path, "c.json", json.dumps(data)), **params)
  if fmt == "toml":
    return maskc.load_config(write(tmp_path, "c.toml", toml_text), **params)
  return maskc.load_config(write(tmp_path, "c.yaml", yaml_text), **params)


def error_of(config, *, exc=maskc.MaskError, **params) -> maskc.MaskError:
  with pytest.raises(exc) as info:
    maskc.load_config(config, **params)
  return info.value


def caret_column(err) -> int:
  """The 1-based column of the first `^` in the rendered error."""
  for line in str(err).splitlines():
    if line.strip() and set(line.strip()) == {"^"}:
      return line.index("^") - 1  # the quoted line is indented by two spaces
  raise AssertionError(f"no caret line in:\n{err}")


def quoted_line(err) -> str:
  lines = str(err).splitlines()
  for i, line in enumerate(lines):
    if line.strip() and set(line.strip()) == {"^"}:
      return lines[i - 1][2:]
  raise AssertionError(f"no caret line in:\n{err}")


# ----------------------------------------------------------------------------- round trips

FORMATS = ["dict", "json", "toml", "yaml"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_llama4_pattern(fmt, tmp_path):
  cfg = load_as(fmt, tmp_path, LLAMA4, LLAMA4_YAML, LLAMA4_TOML)
  chunked, causal = maskc.causal() & maskc.chunk(8192), maskc.causal()
  assert cfg.num_layers == 8
  assert [cfg.mask(i) for i in range(8)] == [chunked] * 3 + [causal] + [chunked] * 3 + [causal]
  assert cfg.mask(-1) == causal
  assert str(cfg.mask(0)) == "causal & chunk(8192)"
  assert cfg.operands == ()
  assert cfg.groups() == {chunked: (0, 1, 2, 4, 5, 6), causal: (3, 7)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemma3_pattern_cut_to_num_layers(fmt, tmp_path):
  cfg = load_as(fmt, tmp_path, GEMMA3, GEMMA3_YAML, GEMMA3_TOML)
  global_layers = {5, 11, 17, 23}
  for i in range(26):
    m = cfg.mask(i)
    assert isinstance(m, ir.Call) and m.name == ("global_" if i in global_layers else "local")
    assert ir.expand(m) == (maskc.causal() if i in global_layers else maskc.sliding(1024))
  assert str(cfg.mask(0)) == "local = sliding(1024)\nlocal"
  assert cfg.definitions == "local = sliding(W)\nglobal_ = causal"


def test_formats_agree(tmp_path):
  loaded = [load_as(f, tmp_path, GEMMA3, GEMMA3_YAML, GEMMA3_TOML) for f in FORMATS]
  assert all(c == loaded[0] for c in loaded)
  assert loaded[1].source.endswith("c.json") and loaded[0].source is None


def test_caller_overrides_params(tmp_path):
  cfg = load_as("yaml", tmp_path, None, GEMMA3_YAML, W=512)
  assert ir.expand(cfg.mask(0)) == maskc.sliding(512)
  assert dict(cfg.params) == {"W": 512}
  cfg = maskc.load_config(LLAMA4, C=4)
  assert cfg.mask(0) == maskc.causal() & maskc.chunk(4)
  # A parameter the file leaves free is bound by the caller.
  free = {"num_layers": 2, "layers": ["causal & chunk(C)", "causal"]}
  assert maskc.load_config(free, C=16).mask(0) == maskc.causal() & maskc.chunk(16)


def test_list_layers_default_heads_and_overrides():
  cfg = maskc.load_config({
      "num_heads": 2, "params": {"W": 4}, "default": "causal",
      "definitions": "streaming(w) = sliding(w) | sink(2)\nlocal = causal & chunk(8)",
      "layers": ["local", {"mask": "streaming(W)"}, None,
                 {"heads": ["causal", "sliding(W)"]}]})
  assert cfg.num_layers == 4 and cfg.num_heads == 2
  assert ir.expand(cfg.mask(0)) == maskc.causal() & maskc.chunk(8)
  assert ir.expand(cfg.mask(1)) == maskc.sliding(4) | maskc.sink(2)
  assert cfg.mask(2) == maskc.causal()
  assert cfg.mask(3) == (maskc.causal(), maskc.sliding(4))
  cfg = maskc.load_config({"num_layers": 6, "default": "causal",
                           "layers": {"overrides": {"0": "full", 5: "sliding(3)"}}})
  assert [str(cfg.mask(i)) for i in range(6)] == ["full"] + ["causal"] * 4 + ["sliding(3)"]
  cfg = maskc.load_config({"num_layers": 3, "default": {"heads": ["causal", "full"]}})
  assert cfg.mask(2) == (maskc.causal(), maskc.full())


def test_layer_text_may_hold_its_own_definitions():
  cfg = maskc.load_config({"definitions": {"local": "causal & chunk(8)"},
                           "layers": ["w = sliding(2)\nlocal | w", "~full | causal"]})
  local, w = cfg.mask(0).items
  assert ir.expand(local) == maskc.causal() & maskc.chunk(8) and ir.expand(w) == maskc.sliding(2)
  # A mask that starts with an operator does not continue the definitions above it.
  assert str(cfg.mask(1)) == "~full | causal"


def test_operands_declared_and_kinds_inferred():
  cfg = maskc.load_config({
      "operands": {"seg": {"kind": "token", "dtype": "int32"}, "img": "per-token",
                   "n": {"kind": "scalar", "doc": "prompt length"}, "anc": "pairwise"},
      "layers": ["causal & document(seg) | bidirectional(img)", "causal | prefix(n)",
                 "anc[q, k]"]})
  assert cfg.operands == (maskc.OperandDecl("anc", "pair", "bool"),
                          maskc.OperandDecl("img", "token", "bool"),
                          maskc.OperandDecl("n", "scalar", "int32"),
                          maskc.OperandDecl("seg", "token", "int32"))
  assert cfg.operands[1].shape == "[L] or [B, L]"


def test_section_of_a_larger_file(tmp_path):
  text = "model:\n  d_model: 32\n  attention:\n    num_layers: 2\n    layers: [causal, full]\n"
  cfg = maskc.load_config(write(tmp_path, "m.yml", text), section="model.attention")
  assert cfg.mask(1) == maskc.full()
  err = error_of({"model": {"attention": {"num_layers": 2, "layer": []}}},
                 section="model.attention", exc=maskc.ConfigError)
  assert err.path == "model.attention.layer" and "(model.attention.layer)" in str(err)
  err = error_of({"m": [1]}, section="m", exc=maskc.ConfigError)
  assert "a mask config is a mapping of keys, got list (m)" in str(err)
  err = error_of({"model": {}}, section="model.attention", exc=maskc.ConfigError)
  assert "no section `attention`" in str(err) and err.path == "model"


def test_str_summarizes_layers():
  text = str(maskc.load_config(LLAMA4))
  assert "layers 0-2, 4-6: causal & chunk(8192)" in text and "layers 3, 7: causal" in text


# ----------------------------------------------------------------------------- compile


def test_identical_layers_share_one_blockmap():
  cfg = maskc.load_config(GEMMA3, W=64)
  bms = cfg.compile(256, block_q=32, block_kv=32)
  assert len(bms) == 26
  assert all(bms[i] is bms[0] for i in range(26) if i % 6 != 5)
  assert all(bms[i] is bms[5] for i in (11, 17, 23))
  assert bms[0] is not bms[5]
  assert len({id(b) for b in bms}) == 2
  np.testing.assert_array_equal(
      bms[0].grid, maskc.compile(maskc.sliding(64), 256, block_q=32, block_kv=32).grid)
  np.testing.assert_array_equal(bms[5].to_dense(), np.tril(np.ones((256, 256), bool)))


def test_compile_with_operands_and_heads():
  cfg = maskc.load_config({"operands": {"seg": "token"}, "default": "causal & document(seg)",
                           "layers": [None, {"heads": ["causal & document(seg)", "causal"]},
                                      None]})
  seg = np.repeat(np.arange(4), 16)
  bms = cfg.compile(64, block_q=16, block_kv=16, operands={"seg": seg, "unused": 1})
  assert bms[0] is bms[2] and bms[0] is not bms[1]
  assert bms[1].heads == 2
  np.testing.assert_array_equal(bms[0].to_dense(), (seg[:, None] == seg[None]) &
                                np.tril(np.ones((64, 64), bool)))
  with pytest.raises(maskc.OperandError, match=r"missing operand `seg` \(token"):
    cfg.compile(64, block_q=16, block_kv=16)


def test_compile_under_jit():
  cfg = maskc.load_config({"operands": {"seg": "token"}, "num_layers": 3,
                           "default": "causal & document(seg)"})

  @jax.jit
  def grids(seg):
    return [bm.grid for bm in cfg.compile(32, block_q=8, block_kv=8, operands={"seg": seg})]

  seg = np.repeat(np.arange(2), 16)
  out = grids(seg)
  np.testing.assert_array_equal(out[0], cfg.compile(32, block_q=8, block_kv=8,
                                                    operands={"seg": seg})[0].grid)


def test_mask_index_errors():
  cfg = maskc.load_config(LLAMA4)
  with pytest.raises(maskc.ConfigError, match="layer 8 is out of range for 8 layers"):
    cfg.mask(8)
  with pytest.raises(maskc.ConfigError, match="must be an int"):
    cfg.mask("0")


# ----------------------------------------------------------------------------- errors in text

BAD_LAYER_YAML = """\
num_layers: 4
params: {C: 8192}
definitions:
  local: causal & chunk(C)
layers:
  - local
  - local
  - local
  - mask: causal & lokal
"""


def test_unknown_name_in_a_layer_names_file_key_and_column(tmp_path):
  path = write(tmp_path, "model.yaml", BAD_LAYER_YAML)
  err = error_of(path, exc=maskc.MaskNameError)
  text = str(err)
  assert "unknown mask `lokal`" in text
  assert f"({path}: layers[3].mask, line 1, column 10)" in text
  assert quoted_line(err) == "causal & lokal" and caret_column(err) == 10
  assert "Did you mean `local`?" in text
  assert err.path == "layers[3].mask" and err.file == str(path)


def test_syntax_error_in_a_layer(tmp_path):
  path = write(tmp_path, "model.yaml", BAD_LAYER_YAML.replace("causal & lokal",
                                                              "causal & chunk(C"))
  err = error_of(path, exc=maskc.MaskSyntaxError)
  assert "unexpected end of the mask" in str(err)
  assert f"({path}: layers[3].mask, line 1, column 16)" in str(err)
  assert quoted_line(err) == "causal & chunk(C" and caret_column(err) == 16


def test_error_on_a_later_line_of_a_layer():
  err = error_of({"layers": ["causal", {"heads": ["causal", "w = sliding(2)\nw & chnk(4)"]}]},
                 exc=maskc.MaskNameError)
  assert "(layers[1].heads[1], line 2, column 5)" in str(err)
  assert quoted_line(err) == "w & chnk(4)" and caret_column(err) == 5


def test_error_in_a_pattern_entry_and_default():
  err = error_of({"num_layers": 4, "layers": {"pattern": ["causal", "sliding(0)"]}},
                 exc=maskc.MaskValueError)
  assert "got sliding(0) (layers.pattern[1], line 1, column 1)" in str(err)
  err = error_of({"num_layers": 1, "default": "causal ^^ full"}, exc=maskc.MaskSyntaxError)
  assert "(default, line 1, column 9)" in str(err) and caret_column(err) == 9


def test_error_in_a_definition(tmp_path):
  text = ("num_layers: 2\ndefinitions:\n  local: causal & chunk(8)\n"
          "  streaming(w): sliding(w) | snk(4)\nlayers: [local, causal]\n")
  path = write(tmp_path, "defs.yaml", text)
  err = error_of(path, exc=maskc.MaskNameError)
  assert f'({path}: definitions["streaming(w)"], line 1, column 14)' in str(err)
  assert quoted_line(err) == "sliding(w) | snk(4)" and caret_column(err) == 14
  assert err.path == 'definitions["streaming(w)"]'


def test_error_in_a_definitions_text_block():
  err = error_of({"definitions": "a = causal\nb = a & & full\nc = full", "layers": ["a"]},
                 exc=maskc.MaskSyntaxError)
  assert "(definitions, line 2, column 9)" in str(err)
  assert quoted_line(err) == "b = a & & full" and caret_column(err) == 9
  err = error_of({"definitions": "a = causal\ncausal", "layers": ["a"]},
                 exc=maskc.MaskSyntaxError)
  assert "only the last line may be a mask" in str(err) and "(definitions, line 2" in str(err)


def test_unused_broken_definition_is_still_an_error():
  err = error_of({"definitions": {"good": "causal", "bad": "q // Z == 0"}, "layers": ["good"]},
                 exc=maskc.MaskTypeError)
  assert "(definitions.bad, line 1, column 6)" in str(err) and caret_column(err) == 6
  assert "Set `Z` under `params:`" in str(err)


def test_unbound_parameter_says_how_to_bind_it():
  err = error_of({"definitions": {"local": "causal & chunk(C)"}, "layers": ["local"]},
                 exc=maskc.MaskTypeError)
  assert "(definitions.local, line 1, column 16)" in str(err)
  assert ("Divide by a literal or a parameter bound at parse time. Set `C` under `params:` or "
          "pass `load_config(..., C=8192)`.\nThe mask at layers[0] uses this definition."
          in str(err))
  assert "maskc.parse(" not in str(err)  # the config's terms, not Python's
  assert "The mask at layers[0] uses this definition." in str(err)


def test_recursive_and_duplicate_definitions():
  err = error_of({"definitions": "a = b\nb = a", "layers": ["a"]}, exc=maskc.MaskRecursionError)
  assert "recursive definition" in str(err) and "(definitions, line" in str(err)
  err = error_of({"definitions": {"a": "causal"}, "layers": ["a = full\na"]},
                 exc=maskc.MaskNameError)
  assert "defined twice" in str(err) and "(layers[0], line 1, column 1)" in str(err)


def test_bad_definition_name():
  err = error_of({"definitions": {"f(1)": "causal"}, "layers": ["causal"]},
                 exc=maskc.MaskSyntaxError)
  assert 'definitions["f(1)"]' in str(err) and quoted_line(err) == "f(1)"
  err = error_of({"definitions": {"1x": "causal"}, "layers": ["causal"]},
                 exc=maskc.ConfigError)
  assert "is not a name" in str(err)
  err = error_of({"definitions": {"a": 3}, "layers": ["causal"]}, exc=maskc.ConfigError)
  assert "definition `a` must be mask text" in str(err) and "(definitions.a)" in str(err)


# ----------------------------------------------------------------------------- operands


def test_undeclared_operand_points_at_its_use(tmp_path):
  path = write(tmp_path, "ops.json", json.dumps(
      {"num_layers": 2, "layers": ["causal", "causal & document(seg)"]}))
  err = error_of(path, exc=maskc.ConfigError)
  assert "reads operand `seg` as a token operand, but the config does not declare it" in str(err)
  assert f"({path}: layers[1], line 1, column 19)" in str(err) and caret_column(err) == 19
  assert "operands: {seg: {kind: token, dtype: int32}}" in str(err)


def test_free_integer_name_becomes_an_undeclared_operand():
  err = error_of({"definitions": {"win": "sliding(W)"}, "layers": ["win"]},
                 exc=maskc.ConfigError)
  assert "operand `W` as a scalar operand" in str(err)
  assert "(definitions.win, line 1, column 9)" in str(err)
  assert "set it under `params:`" in str(err)


def test_the_caret_survives_a_named_mask_parsed_before_elsewhere():
  # `sliding(W)` expanded once from another text: expansions are cached whatever their spans.
  maskc.parse("sliding(W) | sink(2)")
  test_free_integer_name_becomes_an_undeclared_operand()


def test_operand_kind_mismatch():
  err = error_of({"operands": {"seg": "scalar"}, "layers": ["causal", "document(seg)"]},
                 exc=maskc.ConfigError)
  assert "declared as a scalar operand (operands.seg) but the mask reads it as a token" in str(err)
  assert "(layers[1], line 1, column 10)" in str(err)


def test_unused_operand_and_params_warn():
  with pytest.warns(maskc.ConfigWarning, match=r"operand `img` is declared \(operands.img\)"):
    cfg = maskc.load_config({"operands": {"img": "token"}, "layers": ["causal"]})
  assert cfg.operands == (maskc.OperandDecl("img", "token", "int32"),)
  with pytest.warns(maskc.ConfigWarning, match=r"parameter `C` \(params.C\) is not used"):
    maskc.load_config({"params": {"C": 3}, "layers": ["causal"]})
  with pytest.warns(maskc.ConfigWarning, match="parameter `Z` passed to load_config"):
    maskc.load_config(LLAMA4, Z=3)


@pytest.mark.parametrize("operands, message, path", [
    ({"seg": "segment"}, "unknown kind 'segment'", "operands.seg"),
    ({"seg": {"kind": "blob"}}, "unknown kind 'blob'", "operands.seg.kind"),
    ({"seg": {"dtype": "int32"}}, "needs a kind", "operands.seg"),
    ({"seg": {"kind": "token", "shape": 3}}, "unknown key `shape`", "operands.seg.shape"),
    ({"seg": {"kind": "token", "dtype": "float32"}}, "operands hold integers or booleans",
     "operands.seg.dtype"),
    ({"seg": {"kind": "token", "dtype": "nonsense"}}, "has dtype 'nonsense'",
     "operands.seg.dtype"),
    ({"seg": 3}, "must be a kind or a mapping", "operands.seg"),
    ({"seg": {"kind": ["token"]}}, "unknown kind ['token']", "operands.seg.kind"),
    ({"seg": {"kind": "token", "dtype": ["i4"]}}, "has dtype ['i4']", "operands.seg.dtype"),
    ({"q": "token"}, "reserved", "operands.q"),
    ({"causal": "token"}, "would hide the prelude mask", "operands.causal"),
    (["seg"], "operands must be a mapping", "operands"),
])
def test_bad_operand_declarations(operands, message, path):
  err = error_of({"operands": operands, "layers": ["causal & document(seg)"]},
                 exc=maskc.ConfigError)
  assert message in str(err) and err.path == path and f"({path})" in str(err)


def test_a_misspelled_operand_gets_a_did_you_mean_from_the_declared_ones():
  err = error_of({"layers": ["sliding(8) | bidirectional(image)"], "operands": {"img": "token"}},
                 exc=maskc.ConfigError)
  assert "reads operand `image`" in str(err) and err.hint.startswith("Did you mean `img`? ")


@pytest.mark.parametrize("config, path, guess", [
    ({"operands": {"seg": {"kind": "tokn"}}}, "operands.seg.kind", "token"),
    ({"operands": {"seg": "scaler"}}, "operands.seg", "scalar"),
    ({"operands": {"seg": {"knd": "token"}}}, "operands.seg.knd", "kind"),
    ({"layers": [{"mask": "causal"}, {"heds": ["causal"]}]}, "layers[1].heds", "heads"),
    ({"num_layers": 2, "layers": {"patern": ["causal"]}}, "layers.patern", "pattern"),
])
def test_misspelled_keys_and_kinds_get_a_did_you_mean(config, path, guess):
  config = {"layers": ["causal & document(seg)"], **config}
  err = error_of(config, exc=maskc.ConfigError)
  assert err.path == path and err.hint.startswith(f"Did you mean `{guess}`? "), err


# ----------------------------------------------------------------------------- structure


@pytest.mark.parametrize("config, message, path", [
    ({"num_layer": 4, "default": "causal"}, "unknown key `num_layer`", "num_layer"),
    ({"num_layers": 0, "default": "causal"}, "num_layers must be a positive integer", "num_layers"),
    ({"num_layers": 10**9, "default": "causal"}, "up to 100000", "num_layers"),
    ({"num_layers": True, "default": "causal"}, "must be a positive integer", "num_layers"),
    ({"num_heads": "2", "layers": ["causal"]}, "num_heads must be a positive", "num_heads"),
    ({"default": "causal"}, "neither `layers` nor `num_layers`", None),
    ({"num_layers": 3, "layers": ["causal"]}, "layers lists 1 layers but num_layers is 3",
     "layers"),
    ({"layers": []}, "empty list", "layers"),
    ({"layers": "causal"}, "layers must be a list", "layers"),
    ({"layers": {"pattern": ["causal"]}}, "a layer pattern needs num_layers", "layers"),
    ({"num_layers": 2, "layers": {"pattern": []}}, "pattern must be a non-empty list",
     "layers.pattern"),
    ({"num_layers": 2, "layers": {"patern": ["causal"]}}, "unknown key `patern`",
     "layers.patern"),
    ({"num_layers": 2, "default": "causal", "layers": {"overrides": {"2": "full"}}},
     "override key '2' is not a layer number in 0..1", 'layers.overrides["2"]'),
    ({"num_layers": 2, "default": "causal", "layers": {"overrides": {1.5: "full"}}},
     "override key 1.5 is not a layer number", "layers.overrides[\"1.5\"]"),
    ({"num_layers": 2, "default": "causal", "layers": {"overrides": ["full"]}},
     "overrides must map", "layers.overrides"),
    ({"num_layers": 2, "layers": [None, "causal"]}, "layer 0 has no mask", "layers[0]"),
    ({"num_layers": 2}, "layer 0 has no mask", "default"),
    ({"layers": [3]}, "a layer entry is mask text", "layers[0]"),
    ({"layers": [""]}, "the mask text is empty", "layers[0]"),
    ({"layers": [{"mask": 7}]}, "expected mask text, got int 7", "layers[0].mask"),
    ({"layers": [{"mask": "causal", "heads": ["full"]}]}, "exactly one of `mask` and `heads`",
     "layers[0]"),
    ({"layers": [{"mask": "causal", "window": 3}]}, "unknown key `window`", "layers[0].window"),
    ({"layers": [{"heads": "causal"}]}, "heads must be a non-empty list", "layers[0].heads"),
    ({"num_heads": 2, "layers": [{"heads": ["causal"] * 3}]},
     "lists 3 head masks but num_heads is 2", "layers[0].heads"),
    ({"layers": [{"heads": ["causal"] * 2}, {"heads": ["causal"] * 3}]},
     "lists 3 head masks but layers[0].heads lists 2", "layers[1].heads"),
    ({"params": [1], "layers": ["causal"]}, "params must be a mapping", "params"),
    ({"params": {"C": "big"}, "layers": ["chunk(C)"]}, "parameter `C` must be an integer",
     "params.C"),
    ({"params": {"C": True}, "layers": ["chunk(C)"]}, "must be an integer", "params.C"),
    ({"params": {"k": 3}, "layers": ["causal"]}, "reserved", "params.k"),
    ({"params": {"chunk": 3}, "layers": ["causal"]}, "would hide the prelude", "params.chunk"),
    ({"params": {"seg": 3}, "operands": {"seg": "token"}, "layers": ["causal"]},
     "both a parameter and an operand", "operands.seg"),
    ({"params": {"a": 3}, "definitions": {"a": "causal"}, "layers": ["a"]},
     "both a parameter and a definition", "params.a"),
    ({"operands": {"a": "token"}, "definitions": {"a": "causal"}, "layers": ["a"]},
     "both an operand and a definition", "operands.a"),
    ({"definitions": ["a = causal"], "layers": ["causal"]}, "definitions must be a mapping",
     "definitions"),
    ([1, 2], "a config is a file path or a mapping, got list", None),
])
def test_structural_errors(config, message, path):
  err = error_of(config, exc=maskc.ConfigError)
  assert message in str(err)
  assert err.path == path
  if path:
    assert f"({path})" in str(err)


def test_structural_error_in_a_file_names_it(tmp_path):
  path = write(tmp_path, "cfg.toml", "num_layers = 3\nlayers = [\"causal\"]\n")
  err = error_of(path, exc=maskc.ConfigError)
  assert str(err).startswith(f"layers lists 1 layers but num_layers is 3 ({path}: layers)")
  assert err.file == str(path)


def test_caller_param_errors():
  err = error_of(LLAMA4, exc=maskc.ConfigError, causal=3)
  assert "would hide the prelude mask `causal`" in str(err)
  assert "(load_config(causal=...))" in str(err)
  err = error_of(LLAMA4, exc=maskc.ConfigError, C=[1])
  assert "parameter `C` must be an int, a mask or an operand name, got list" in str(err)
  assert err.path == "load_config(C=...)"
  assert maskc.load_config(LLAMA4, C=np.int64(16)).mask(0) == maskc.causal() & maskc.chunk(16)


# ----------------------------------------------------------------------------- files


@pytest.mark.parametrize("name, text, message, line, column", [
    ("bad.json", '{"num_layers": 2,\n "layers": ["causal" "full"]}', "invalid JSON", 2, 22),
    ("bad.toml", 'num_layers = 2\nlayers = ["causal",\n', "invalid TOML", 2, 20),
    ("bad2.toml", 'num_layers = 2\nlayers = "causal\n', "invalid TOML", 2, 17),
    ("bad.yaml", "num_layers: 2\nlayers: [causal, full\n", "invalid YAML", 3, 1),
    ("bad2.yaml", "num_layers: 1\ndefault: *causal\n", "invalid YAML", 2, 10),
])
def test_file_syntax_errors_have_a_caret(tmp_path, name, text, message, line, column):
  path = write(tmp_path, name, text)
  err = error_of(path, exc=maskc.ConfigError)
  assert message in str(err) and f"({path}, line {line}, column {column})" in str(err)


YAML_ERRORS = [  # text, what the hint says
    ("num_layers: 2\nlayers:\n  - causal\n - full\n", "Check the indentation"),
    ("num_layers: 2\nparams:\n  C: 8\n   W: 4\n", "Check the indentation"),
    ("num_layers: 2\nparams:\n    C: 8\n  W: 4\n", "Check the indentation"),
    ("num_layers: 2\n  default: causal\n", "Check the indentation"),
    ("num_layers: 2\nparams:\n\tC: 8\n", "spaces only: replace the tabs"),
    ("num_layers: 1\ndefault: causal: x\n", "A value that holds `: `"),
    ("num_layers: 1\ndefault: *causal\n", "YAML reads `*`"),
    ("num_layers: 1\ndefault: & causal\n", "YAML reads `&`"),
    ("num_layers: 1\ndefault: !causal\n", "YAML reads `!`"),
    ("num_layers: 1\ndefault: | causal\n", "YAML reads `|`"),
    ("num_layers: 1\ndefault: > causal\n", "YAML reads `>`"),
    ("num_layers: 1\ndefault: @causal\n", "YAML reads `@`"),
    ("num_layers: 2\nlayers: [causal, full\n", "Close the bracket"),
    ("num_layers: 1\ndefault: \"causal\n", "Close the quote"),
]


@pytest.mark.parametrize("text,hint", YAML_ERRORS)
def test_yaml_errors_get_the_hint_for_what_went_wrong(tmp_path, text, hint):
  pytest.importorskip("yaml")
  err = error_of(write(tmp_path, "m.yaml", text), exc=maskc.ConfigError)
  assert "invalid YAML" in str(err) and hint in err.hint, err
  if "indentation" in hint or "tabs" in hint:
    assert "Quote" not in err.hint and "quote" not in err.hint  # not about quoting at all


@pytest.mark.parametrize("text,hint", YAML_ERRORS)
def test_yaml_hints_read_pyyamls_own_parser_too(text, hint):
  """PyYAML without libyaml words its errors differently; the hint is the same."""
  yaml = pytest.importorskip("yaml")
  from maskc.config.files import _yaml_hint
  with pytest.raises(yaml.MarkedYAMLError) as info:
    yaml.load(text, Loader=yaml.SafeLoader)  # the pure-Python parser
  assert hint in (_yaml_hint(info.value, text) or ""), info.value


def test_yaml_needs_pyyaml(tmp_path, monkeypatch):
  path = write(tmp_path, "m.yaml", LLAMA4_YAML)
  monkeypatch.setitem(sys.modules, "yaml", None)
  err = error_of(path, exc=maskc.ConfigError)
  assert "needs PyYAML" in str(err) and 'pip install -e ".[yaml]"' in str(err)
  assert maskc.load_config(LLAMA4).num_layers == 8  # dicts need no YAML


def test_file_errors(tmp_path):
  err = error_of(tmp_path / "absent.yaml", exc=maskc.ConfigError)
  assert "cannot read the config file" in str(err) and "absent.yaml" in str(err)
  err = error_of(write(tmp_path, "m.ini", "x"), exc=maskc.ConfigError)
  assert "cannot tell the format" in str(err)
  err = error_of(42, exc=maskc.ConfigError)
  assert "a file path or a mapping, got int" in str(err)


# ----------------------------------------------------------------------------- bounds

SHORT_ERROR = 1500  # characters: what an error quotes is bounded, whatever the config holds


def config_text(fmt: str, depth: int) -> str:
  """A config whose `layers` value is `depth` nested lists: `depth + 1` containers in all."""
  lists = "[" * depth + "]" * depth  # flow style in YAML
  return {"json": f'{{"layers": {lists}}}', "yaml": f"layers: {lists}\n",
          "toml": f"layers = {lists}\n"}[fmt]


def load_text(tmp_path, fmt: str, text: str):
  return maskc.load_config(write(tmp_path, f"c.{fmt}", text))


@pytest.mark.parametrize("fmt", ["json", "yaml", "toml"])
@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deeply_nested_files_are_config_errors(tmp_path, fmt, depth):
  from maskc.config.files import MAX_CONFIG_DEPTH
  if fmt == "yaml":
    pytest.importorskip("yaml")
  with pytest.raises(maskc.ConfigError) as info:
    load_text(tmp_path, fmt, config_text(fmt, depth))
  err = info.value
  assert f"nests deeper than {MAX_CONFIG_DEPTH} levels" in err.message
  assert err.line == 1 and len(str(err)) < SHORT_ERROR


@pytest.mark.parametrize("text", [
    "layers:\n" + "".join(" " * i + "- \n" for i in range(1, 400)),  # block style
    "layers:\n" + "".join(" " * i + f"k{i}:\n" for i in range(1, 400)),
    "a: " + "{b: " * 300 + "1" + "}" * 300,
])
def test_deep_block_yaml_is_a_config_error(tmp_path, text):
  pytest.importorskip("yaml")
  with pytest.raises(maskc.ConfigError, match="nests deeper than 64") as info:
    load_text(tmp_path, "yaml", text)
  assert len(str(info.value)) < SHORT_ERROR


@pytest.mark.parametrize("text", [
    ".".join(["a"] * 20_000) + " = 1\n",
    ".".join(['"a"'] * 200) + " = 1\n",
    "[" + ".".join(["t"] * 500) + "]\nx = 1\n",
    "x = " + "{a = " * 200 + "1" + "}" * 200 + "\n",
])
def test_deep_toml_keys_and_tables_are_config_errors(tmp_path, text):
  with pytest.raises(maskc.ConfigError, match="nests deeper than 64") as info:
    load_text(tmp_path, "toml", text)
  assert len(str(info.value)) < SHORT_ERROR


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["json", "yaml", "toml", "dict"]), st.integers(1, 120))
def test_depth_law(fmt, depth):
  """Law: a config with `depth + 1` nested containers is refused for its depth iff that
  exceeds MAX_CONFIG_DEPTH, the same in every format; otherwise a shallower check answers."""
  from maskc.config.files import MAX_CONFIG_DEPTH
  if fmt == "yaml":
    pytest.importorskip("yaml")
  import tempfile
  try:
    if fmt == "dict":
      lists: list = []
      for _ in range(depth - 1):
        lists = [lists]
      maskc.load_config({"layers": lists})
    else:
      with tempfile.TemporaryDirectory() as d:
        load_text(pathlib.Path(d), fmt, config_text(fmt, depth))
  except maskc.ConfigError as e:
    assert ("nests deeper" in e.message) == (depth + 1 > MAX_CONFIG_DEPTH), e.message
    assert len(str(e)) < SHORT_ERROR


def test_oversized_file_is_refused_before_parsing(tmp_path):
  pytest.importorskip("yaml")
  from maskc.config.files import MAX_CONFIG_BYTES
  text = "num_layers: 1\ndefault: causal\n" + "# padding\n" * (MAX_CONFIG_BYTES // 10)
  err = error_of(write(tmp_path, "big.yaml", text), exc=maskc.ConfigError)
  assert f"larger than {MAX_CONFIG_BYTES} bytes" in err.message and len(str(err)) < SHORT_ERROR
  ok = "num_layers: 1\ndefault: causal\n" + "# padding\n" * (MAX_CONFIG_BYTES // 20)
  assert maskc.load_config(write(tmp_path, "ok.yaml", ok)).num_layers == 1


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_too_many_values_is_a_config_error(tmp_path, fmt):
  from maskc.config.files import MAX_CONFIG_NODES
  if fmt == "yaml":
    pytest.importorskip("yaml")
  text = '{"layers": [' + ", ".join(["1"] * (MAX_CONFIG_NODES + 10)) + "]}"
  with pytest.raises(maskc.ConfigError, match=f"more than {MAX_CONFIG_NODES} values") as info:
    load_text(tmp_path, fmt, text)
  assert len(str(info.value)) < SHORT_ERROR


BILLION_LAUGHS = """\
a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
layers: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""


def test_billion_laughs_yaml_is_refused_with_a_short_message(tmp_path):
  pytest.importorskip("yaml")
  from maskc.config.files import MAX_CONFIG_NODES
  err = error_of(write(tmp_path, "laughs.yaml", BILLION_LAUGHS), exc=maskc.ConfigError)
  assert f"more than {MAX_CONFIG_NODES} values" in err.message and "alias" in err.message
  assert err.line is not None and len(str(err)) < SHORT_ERROR
  # A few aliases stay fine: they are a YAML feature.
  text = "definitions: {local: &l causal & chunk(8)}\nlayers: [*l, *l, causal]\n"
  cfg = maskc.load_config(write(tmp_path, "ok.yaml", text))
  assert cfg.mask(0) == cfg.mask(1) and cfg.num_layers == 3


def test_shared_and_cyclic_dicts_are_bounded():
  from maskc.config.files import MAX_CONFIG_NODES
  laughs: object = ["causal"] * 9
  for _ in range(8):
    laughs = [laughs] * 9
  err = error_of({"layers": laughs}, exc=maskc.ConfigError)
  assert f"more than {MAX_CONFIG_NODES} values" in err.message and len(str(err)) < SHORT_ERROR
  cyclic: dict = {"num_layers": 2}
  cyclic["layers"] = [cyclic]
  err = error_of(cyclic, exc=maskc.ConfigError)
  assert "nests deeper" in err.message and len(str(err)) < SHORT_ERROR


@pytest.mark.parametrize("name, text", [
    ("n.json", '{"num_layers": ' + "9" * 5000 + "}"),
    ("n.toml", "num_layers = " + "9" * 5000),
    ("n.yaml", "num_layers: " + "9" * 5000),
])
def test_integers_too_long_to_convert_are_config_errors(tmp_path, name, text):
  if name.endswith("yaml"):
    pytest.importorskip("yaml")
  err = error_of(write(tmp_path, name, text), exc=maskc.ConfigError)
  assert "invalid" in err.message and len(str(err)) < SHORT_ERROR


def test_yaml_tags_never_run(tmp_path):
  pytest.importorskip("yaml")
  marker = tmp_path / "ran"
  for tag in ("!!python/object/apply:builtins.open", "!!python/object/new:builtins.open",
              "!!python/name:builtins.open"):
    text = f"num_layers: 1\ndefault: causal\nlayers: {tag} [{str(marker)!r}, w]\n"
    err = error_of(write(tmp_path, "tag.yaml", text), exc=maskc.ConfigError)
    # the safe loader knows no Python tag: refused where it stands, nothing constructed
    assert err.message == ("invalid YAML: could not determine a constructor for the tag "
                           f"'tag:yaml.org,2002:{tag[2:]}'")
    assert (err.line, err.column) == (3, 9) and caret_column(err) == 9
  assert not marker.exists()


@pytest.mark.parametrize("config", [
    {"num_layers": "x" * 1_000_000},
    {"layers": [list(range(100_000))]},
    {"x" * 1_000_000: 1},
    {"layers": {"pattern": "causal" * 100_000}},
    {"operands": {"seg": {"kind": "t" * 100_000}}, "layers": ["causal"]},
    {"layers": ["chunk(C)"], "params": {"C": 10**5000}},
    {"layers": [{"heads": 10**5000}]},
])
def test_errors_quote_values_briefly(config):
  err = error_of(config)
  assert len(str(err)) < SHORT_ERROR


def test_mask_text_error_in_a_huge_layer_is_short():
  err = error_of({"layers": ["causal & " * 10_000 + "lokal"]})
  assert isinstance(err, maskc.MaskNameError) and len(str(err)) < SHORT_ERROR
  assert "lokal" in str(err)


def test_loaded_config_passes_through():
  cfg = maskc.load_config(LLAMA4)
  assert maskc.load_config(cfg) is cfg
  with pytest.raises(maskc.ConfigError, match="cannot take new parameters"):
    maskc.load_config(cfg, C=3)


def test_config_is_hashable_and_static():
  a, b = maskc.load_config(GEMMA3), maskc.load_config(GEMMA3)
  assert a == b and hash(a) == hash(b) and a != maskc.load_config(GEMMA3, W=8)
  assert jax.tree_util.tree_leaves({"masks": a, "x": 1}) == [1]


# ----------------------------------------------------------------------------- dataclass fields


def test_mask_spec():
  spec = maskc.MaskSpec("causal & chunk(C)", C=8192)
  assert spec.mask == maskc.causal() & maskc.chunk(8192)
  assert spec == maskc.MaskSpec("causal & chunk(C)", {"C": 8192})
  assert hash(spec) == hash(maskc.MaskSpec("causal & chunk(C)", C=8192))
  assert spec != maskc.MaskSpec("causal & chunk(C)", C=4)
  assert str(spec) == "causal & chunk(C)" and spec.params == (("C", 8192),)
  assert pickle.loads(pickle.dumps(spec)) == spec
  assert maskc.MaskSpec.coerce(spec) is spec
  assert maskc.MaskSpec(maskc.sliding(4)).mask == maskc.sliding(4)
  heads = maskc.MaskSpec(["causal", "document(seg)"])
  assert heads.mask == (maskc.causal(), maskc.document("seg"))
  assert [o.name for o in heads.operands] == ["seg"]
  assert heads.compile(32, block_q=16, block_kv=16, operands={"seg": np.zeros(32, int)}).heads == 2
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.text = "full"
  with pytest.raises(maskc.MaskNameError, match="unknown mask `casual`"):
    maskc.MaskSpec("casual")
  with pytest.raises(maskc.MaskTypeError):
    maskc.MaskSpec(3)
  # Static under jit: no leaves, and usable as a static argument.
  assert jax.tree_util.tree_leaves([spec]) == []
  f = jax.jit(lambda x, s: x + len(s.operands), static_argnums=1)
  assert int(f(1, heads)) == 2 and int(f(1, spec)) == 1


def test_mask_field_on_plain_dataclasses():
  @dataclasses.dataclass(frozen=True)
  class Attention:
    heads: int = 2
    mask: maskc.MaskSpec = maskc.mask_field("causal & chunk(C)", C=64)

  a = Attention()
  assert a.mask == maskc.MaskSpec("causal & chunk(C)", C=64)
  b = Attention(mask="sliding(C)")
  assert isinstance(b.mask, maskc.MaskSpec) and b.mask.mask == maskc.sliding(64)
  assert Attention(mask="sliding(C)") == b and hash(Attention(mask="sliding(C)")) == hash(b)
  assert dataclasses.replace(b, heads=4).mask is b.mask
  assert Attention(mask=maskc.MaskSpec("full")).mask.mask == maskc.full()
  with pytest.raises(dataclasses.FrozenInstanceError):
    b.mask = "full"
  with pytest.raises(maskc.MaskNameError) as info:
    Attention(mask="causal & lokal")
  assert "(Attention.mask, line 1, column 10)" in str(info.value)

  @dataclasses.dataclass
  class Block:
    mask: maskc.MaskSpec = maskc.mask_field()
    other: int = 0

  with pytest.raises(TypeError):
    Block()  # no default: the field is required
  blk = Block(["causal", "full"])
  assert blk.mask.mask == (maskc.causal(), maskc.full())
  blk.mask = "sliding(3)"  # assignment on a mutable dataclass is checked too
  assert blk.mask.mask == maskc.sliding(3)
  with pytest.raises(maskc.MaskSyntaxError):
    blk.mask = "causal &"
  with pytest.raises(maskc.MaskNameError):
    maskc.mask_field("nonsense_mask")  # a bad default fails when the class is defined


# ----------------------------------------------------------------------------- the example


def test_example_config_in_every_format(tmp_path):
  """examples/llama4.yaml (the masks of examples/nnx_decoder.py) loads the same from YAML,
  JSON, TOML and a mapping."""
  yaml = pytest.importorskip("yaml")
  example = ROOT / "examples" / "llama4.yaml"
  data = yaml.safe_load(example.read_text())
  from_yaml = maskc.load_config(example)
  assert maskc.load_config(data) == from_yaml
  assert maskc.load_config(write(tmp_path, "t.json", json.dumps(data))) == from_yaml
  toml = """\
num_layers = 4
num_heads = 4
params = { C = 16, W = 8 }
operands.seg = { kind = "token", dtype = "int32" }
[definitions]
packed = "causal & document(seg)"
local = "packed & chunk(C)"
[layers]
pattern = ["local", "local", "local", "packed"]
overrides."1" = { heads = ["local", "local", "sliding(W) & document(seg)",
                           "sliding(W) & document(seg)"] }
"""
  assert maskc.load_config(write(tmp_path, "t.toml", toml)) == from_yaml
  assert from_yaml.operands == (maskc.OperandDecl("seg", "token", "int32"),)
  assert isinstance(from_yaml.mask(1), tuple) and from_yaml.mask(0) == from_yaml.mask(2)


# ----------------------------------------------------------------------------- fuzz

_leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.floats(allow_nan=False),
                  st.sampled_from(["causal", "local", "sliding(W)", "document(seg)", "token",
                                   "scalar", "int32", "float32", "causal &", "chunk(C)", "",
                                   "streaming(w)", "1", "-1", "q", "pattern", "heads"]))
_junk = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(st.sampled_from(
        ["pattern", "overrides", "mask", "heads", "kind", "dtype", "seg", "local", "W", "C",
         "streaming(w)", "0", "1"]), st.integers(0, 3)), inner, max_size=4)), max_leaves=12)
_configs = st.dictionaries(
    st.sampled_from(["num_layers", "num_heads", "params", "definitions", "default", "layers",
                     "operands"]), _junk, max_size=6)


@settings(max_examples=60, deadline=None)
@given(_configs)
def test_fuzzed_configs_raise_only_mask_errors(config):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", maskc.ConfigWarning)
    try:
      cfg = maskc.load_config(config)
    except maskc.MaskError:
      return
  assert all(isinstance(m, (maskc.Mask, tuple)) for m in cfg.masks)
  hash(cfg)


_doc_leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 40),
                      st.sampled_from(["causal", "sliding(W)", "&a", "*a", "[", "{", "- x"]))
_documents = st.recursive(_doc_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["layers", "pattern", "mask",
                                                                  "num_layers", "x"]), inner,
                                                  max_size=4)), max_leaves=30)


@settings(max_examples=60, deadline=None)
@given(_documents, st.sampled_from(["json", "yaml", "toml"]), st.integers(0, 3),
       st.binary(max_size=40))
def test_fuzzed_files_raise_only_short_mask_errors(doc, fmt, cut, junk):
  """Any text a config file may hold, cut and spliced with random bytes, loads or raises a
  short MaskError."""
  import tempfile
  yaml = pytest.importorskip("yaml")
  if fmt == "json":
    text = json.dumps({"layers": doc})
  elif fmt == "yaml":
    text = yaml.safe_dump({"layers": doc})
  else:
    text = f"layers = {json.dumps(doc)}\n"
  text = text[:len(text) - cut] + junk.decode("latin-1")
  with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
    warnings.simplefilter("ignore", maskc.ConfigWarning)
    try:
      maskc.load_config(write(pathlib.Path(d), f"c.{fmt}", text))
    except maskc.MaskError as e:
      assert len(str(e)) < SHORT_ERROR


def test_schema_example_in_the_docstring_loads():
  yaml = pytest.importorskip("yaml")
  import maskc.config.model as module
  text = module.__doc__.split("```yaml\n")[1].split("```")[0]
  cfg = maskc.load_config(yaml.safe_load(text))  # warnings are errors in the test suite
  assert str(cfg.mask(3)) == "causal | prefix(prompt_len)"
  assert ir.expand(cfg.mask(1)) == maskc.causal() & maskc.chunk(8192) & maskc.document("seg")
  assert [d.name for d in cfg.operands] == ["prompt_len", "seg"]


# ----------------------------------------------------------------------------- context_parallel

CP = {"num_layers": 2, "layers": ["causal", "sliding(4)"],
      "context_parallel": {"layout": "zigzag", "strategy": "ring"}}
CP_YAML = """\
num_layers: 2
layers: [causal, sliding(4)]
context_parallel:
  layout: zigzag
  strategy: ring
"""
CP_TOML = """\
num_layers = 2
layers = ["causal", "sliding(4)"]

[context_parallel]
layout = "zigzag"
strategy = "ring"
"""


@pytest.mark.parametrize("fmt", FORMATS)
def test_context_parallel_is_read_in_every_format(fmt, tmp_path):
  if fmt == "yaml":
    pytest.importorskip("yaml")
  cfg = load_as(fmt, tmp_path, CP, CP_YAML, CP_TOML)
  assert cfg.context_parallel.layout == "zigzag"
  assert cfg.context_parallel.strategy == "ring"
  assert cfg.context_parallel.kwargs() == {"layout": "zigzag", "strategy": "ring"}
  assert "context parallel: layout zigzag, strategy ring" in str(cfg)


def test_context_parallel_is_optional_and_its_keys_default_to_sharded_attentions():
  cfg = maskc.load_config({"num_layers": 1, "layers": ["causal"]})
  assert cfg.context_parallel is None
  cfg = maskc.load_config({"num_layers": 1, "layers": ["causal"],
                           "context_parallel": {"strategy": "ring"}})
  assert cfg.context_parallel.kwargs() == {"layout": "contiguous", "strategy": "ring"}
  import inspect
  sig = inspect.signature(maskc.sharded_attention).parameters
  empty = maskc.load_config({"num_layers": 1, "layers": ["causal"], "context_parallel": {}})
  for key, value in empty.context_parallel.kwargs().items():
    assert sig[key].default == value


def test_context_parallel_kwargs_drive_sharded_attention():
  """The config's keywords are accepted by sharded_attention (one device, one shard)."""
  import jax.numpy as jnp
  from jax.sharding import Mesh
  cfg = maskc.load_config({"num_layers": 1, "layers": ["causal"],
                           "context_parallel": {"layout": "zigzag", "strategy": "ring"}})
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1), ("context",))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 32, 2, 4)), jnp.float32)
  out = maskc.sharded_attention(x, x, x, cfg.mask(0), mesh=mesh, seq_axis="context",
                                backend="xla", **cfg.context_parallel.kwargs())
  xs = np.asarray(x, np.float64)
  s = np.einsum("bqhd,bkhd->bhqk", xs, xs) / 2.0
  s = np.where(np.tril(np.ones((32, 32), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  want = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), xs)
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value, path, words", [
    ("zigzag", "context_parallel", ["must be a mapping", "layout: zigzag"]),
    ({"layot": "zigzag"}, "context_parallel.layot", ["unknown key `layot`", "`layout`?"]),
    ({"layout": "zigzog"}, "context_parallel.layout", ["'zigzog'", "`zigzag`?"]),
    ({"layout": 3}, "context_parallel.layout", ["3 is not one of", "contiguous | zigzag"]),
    ({"strategy": "rings"}, "context_parallel.strategy", ["'rings'", "`ring`?"]),
    ({"strategy": None}, "context_parallel.strategy", ["None is not one of",
                                                        "all_gather | ring"]),
])
def test_context_parallel_errors_name_the_key_and_hint(value, path, words):
  err = error_of({"num_layers": 1, "layers": ["causal"], "context_parallel": value},
                 exc=maskc.ConfigError)
  assert err.path == path
  for w in words:
    assert w in str(err), str(err)


def test_context_parallel_error_names_the_file(tmp_path):
  pytest.importorskip("yaml")
  path = write(tmp_path, "m.yaml", CP_YAML.replace("strategy: ring", "strategy: tree"))
  err = error_of(path, exc=maskc.ConfigError)
  assert err.file == str(path) and err.path == "context_parallel.strategy"
  assert f"{path}: context_parallel.strategy" in str(err)


def test_unknown_top_key_suggests_context_parallel():
  err = error_of({"num_layers": 1, "layers": ["causal"], "context_paralel": {}},
                 exc=maskc.ConfigError)
  assert "`context_parallel`?" in str(err)
