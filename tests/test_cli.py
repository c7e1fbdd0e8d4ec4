"""The `maskc` command line: `check`, `dense`, parameters, hints in command-line terms, and the
operand-value syntax."""

import numpy as np
import pytest

import maskc
from maskc.cli import commands as cli
from maskc.cli.args import CLI
from maskc.cli.operands import MAX_OPERAND_ITEMS, parse_operand_value
from maskc.language.errors import Unbound


def run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


# ----------------------------------------------------------------------------- check


def test_check_prints_canonical_simplified_and_operands(capsys):
  code, out, err = run(capsys, "check", "causal & chunk(8192) | bidirectional(img)")
  assert code == 0 and err == ""
  lines = out.splitlines()
  assert lines[0] == "canonical:  causal & chunk(8192) | bidirectional(img)"
  assert lines[1] == "simplified: bidirectional(img) | causal & chunk(8192)"
  assert lines[2] == "operands:"
  assert lines[3].split()[:3] == ["img", "per-token,", "boolean"]
  assert "[L] or [B, L]" in lines[3]


def test_check_normalizes_the_text(capsys):
  code, out, _ = run(capsys, "check", "(chunk( 8_192 )&causal)")
  assert code == 0
  assert "canonical:  chunk(8192) & causal" in out
  assert "simplified: causal & chunk(8192)" in out
  assert "operands:   none" in out


def test_check_lists_every_operand_kind(capsys):
  code, out, _ = run(capsys, "check", "document(seg) & k < kv_len & anc[q, k]")
  assert code == 0
  rows = {line.split()[0]: line for line in out.splitlines()[3:]}
  assert set(rows) == {"anc", "kv_len", "seg"}
  assert "pairwise, boolean" in rows["anc"] and "[Lq, Lk] or [B, Lq, Lk]" in rows["anc"]
  assert "scalar" in rows["kv_len"] and "[] or [B]" in rows["kv_len"]
  # `seg` is compared, not read as a truth value: per-token, with no `boolean`
  assert rows["seg"].split() == ["seg", "per-token", "shape", "[L]", "or", "[B,", "L]"]
  assert out.splitlines()[3:] == [
      "  anc     pairwise, boolean     shape [Lq, Lk] or [B, Lq, Lk]",
      "  kv_len  scalar                shape [] or [B]",
      "  seg     per-token             shape [L] or [B, L]"]


def test_check_program_with_definitions(capsys):
  code, out, _ = run(capsys, "check", "local = causal & chunk(8)\nlocal | sink(4)")
  assert code == 0
  assert out.startswith("canonical:\n  local = causal & chunk(8)\n  local | sink(4)\n")


@pytest.mark.parametrize("text,column", [
    ("causal & chunk(0) | bidirectional(img)", 10),
    ("causal & | chunk(4)", 10),
    ("causl & chunk(4)", 1),
    ("causal & (sliding(4) | sink(-1))", 24),
])
def test_check_bad_expression_shows_a_caret(capsys, text, column):
  code, out, err = run(capsys, "check", text)
  assert code == 1 and out == ""
  assert err.startswith("maskc check: error: ")
  lines = err.splitlines()
  i = lines.index(f"  {text}")
  caret = lines[i + 1]
  assert caret.lstrip().startswith("^")
  assert caret.index("^") - 2 == column - 1
  assert f"column {column}" in lines[0]


def test_check_suggests_the_nearest_name(capsys):
  _, _, err = run(capsys, "check", "causl & chunk(4)")
  assert "Did you mean `causal`?" in err


def test_usage_errors_exit_2(capsys):
  with pytest.raises(SystemExit) as info:
    cli.main([])
  assert info.value.code == 2
  with pytest.raises(SystemExit) as info:
    cli.main(["frobnicate", "causal"])
  assert info.value.code == 2
  with pytest.raises(SystemExit) as info:
    cli.main(["dense", "causal"])  # --q-len is required
  assert info.value.code == 2
  with pytest.raises(SystemExit) as info:
    cli.main(["dense", "causal", "--q-len", "four"])
  assert info.value.code == 2
  capsys.readouterr()


def test_help_and_version(capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(["--help"])
  assert info.value.code == 0
  out = capsys.readouterr().out
  assert "check" in out and "dense" in out
  with pytest.raises(SystemExit) as info:
    cli.main(["--version"])
  assert info.value.code == 0
  assert maskc.__version__ in capsys.readouterr().out


def test_subcommands_are_registered_by_function():
  assert cli.SUBCOMMANDS[:2] == [cli._add_check, cli._add_dense]
  parser = cli.build_parser()
  args = parser.parse_args(["check", "causal"])
  assert args.command == "check" and callable(args.run)


# ----------------------------------------------------------------------------- dense


def grid(out: str, on="#", off=".") -> np.ndarray:
  """The drawn mask back as a bool array, from the rows after the two header lines."""
  rows = [line.split()[1] for line in out.splitlines()
          if line.split() and line.split()[0].lstrip("-").isdigit()
          and len(line.split()) == 2 and set(line.split()[1]) <= {on, off}]
  return np.array([[c == on for c in row] for row in rows], dtype=bool)


def test_dense_demo(capsys):
  img = "0,0,0,1,1,1,1,1,0,0,0,0"
  code, out, err = run(capsys, "dense", "causal & chunk(4) | bidirectional(img)", "--q-len", "12",
                       "--operand", f"img={img}", "--ascii")
  assert code == 0, err
  expected = maskc.materialize("causal & chunk(4) | bidirectional(img)", 12,
                               operands={"img": np.array(img.split(","), dtype=int)})
  np.testing.assert_array_equal(grid(out), expected)
  lines = out.splitlines()
  assert lines[0] == "causal & chunk(4) | bidirectional(img)"
  assert "q_len=12 kv_len=12 q_offset=0" in lines[1]
  assert lines[2].split() == ["q\\k", "0", "10"]
  assert lines[3].strip() == "012345678901"
  assert lines[4].split()[0] == "0" and lines[-2].split()[0] == "11"
  assert lines[-1] == f"allowed: {int(expected.sum())} of 144 ({100 * expected.sum() / 144:.1f}%)"


def test_dense_unicode_art(capsys):
  code, out, _ = run(capsys, "dense", "causal", "--q-len", "3")
  assert code == 0
  assert "█··" in out and "███" in out


def test_dense_rectangular_with_offset(capsys):
  code, out, _ = run(capsys, "dense", "sliding(3) | sink(1)", "--q-len", "4", "--kv-len", "25",
                     "--offset", "10", "--ascii")
  assert code == 0
  np.testing.assert_array_equal(grid(out), maskc.materialize("sliding(3) | sink(1)", 4, 25,
                                                             q_offset=10))
  rows = [line.split()[0] for line in out.splitlines()[4:-1]]
  assert rows == ["10", "11", "12", "13"]  # rows are labelled with their q positions
  assert out.splitlines()[2].split() == ["q\\k", "0", "10", "20"]


def test_dense_default_offset_is_bottom_right(capsys):
  code, out, _ = run(capsys, "dense", "causal", "--q-len", "2", "--kv-len", "6", "--ascii")
  assert code == 0
  assert "q_offset=4" in out
  np.testing.assert_array_equal(grid(out), maskc.materialize("causal", 2, 6))


def test_dense_scalar_and_repeat_operands(capsys):
  code, out, err = run(capsys, "dense", "causal & document(seg) & k < n", "--q-len", "8",
                       "--operand", "seg=0*3,1*5", "--operand", "n=6", "--ascii")
  assert code == 0, err
  expected = maskc.materialize("causal & document(seg) & k < n", 8,
                               operands={"seg": np.array([0, 0, 0, 1, 1, 1, 1, 1]), "n": 6})
  np.testing.assert_array_equal(grid(out), expected)


def test_dense_operand_from_npy(capsys, tmp_path):
  seg = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]], dtype=np.int32)
  path = tmp_path / "seg.npy"
  np.save(path, seg)
  code, out, err = run(capsys, "dense", "causal & document(seg)", "--q-len", "5",
                       "--operand", f"seg=@{path}", "--ascii")
  assert code == 0, err
  assert "batch 0:" in out and "batch 1:" in out
  drawn = grid(out)
  np.testing.assert_array_equal(drawn.reshape(2, 5, 5),
                                maskc.materialize("causal & document(seg)", 5,
                                                  operands={"seg": seg}))


def test_dense_refuses_large_masks(capsys):
  code, out, err = run(capsys, "dense", "causal", "--q-len", "257", "--kv-len", "257")
  assert code == 1 and out == ""
  assert "too large" in err and "256 x 512" in err
  code, _, err = run(capsys, "dense", "causal", "--q-len", "10", "--kv-len", "513")
  assert code == 1 and "too large" in err
  code, _, _ = run(capsys, "dense", "causal", "--q-len", "256", "--kv-len", "512", "--ascii")
  assert code == 0


@pytest.mark.parametrize("argv,needle", [
    (["--q-len", "0"], "--q-len must be at least 1"),
    (["--q-len", "4", "--kv-len", "-2"], "--kv-len must be at least 1"),
    (["--q-len", "4", "--operand", "img"], "NAME=VALUES"),
    (["--q-len", "4", "--operand", "3x=1"], "NAME=VALUES"),
    (["--q-len", "4", "--operand", "img=1,,2"], "operand `img`: item 2"),
    (["--q-len", "4", "--operand", "img=1,2", "--operand", "img=3"], "given twice"),
    (["--q-len", "4", "--operand", "img=a,b"], "cannot read item 1"),
    (["--q-len", "4"], "missing operand `img`"),
    (["--q-len", "4", "--operand", "img=1,1"], "`img` has length 2"),
    (["--q-len", "4", "--operand", "img=@/nonexistent/img.npy"], "no such operand file"),
])
def test_dense_bad_input(capsys, argv, needle):
  code, out, err = run(capsys, "dense", "causal | bidirectional(img)", *argv)
  assert code == 1
  assert needle in err, err
  assert err.startswith("maskc dense: error: ")


def test_dense_bad_expression(capsys):
  code, _, err = run(capsys, "dense", "causal & chunk(0)", "--q-len", "4")
  assert code == 1 and "chunk(0)" in err and "^" in err


def test_dense_notes_unused_operands(capsys):
  code, out, err = run(capsys, "dense", "causal", "--q-len", "3", "--operand", "imgg=1,0,1")
  assert code == 0
  assert "does not read operand `imgg`" in err


# ----------------------------------------------------------------------------- parameters


def test_check_binds_parameters(capsys):
  code, out, err = run(capsys, "check", "causal & chunk(C) | sliding(W)", "--param", "C=8_192",
                       "--param", "W=64")
  assert code == 0 and err == ""
  assert "canonical:  causal & chunk(8192) | sliding(64)" in out
  assert "operands:   none" in out


def test_dense_and_show_bind_parameters(capsys):
  code, out, _ = run(capsys, "dense", "causal & chunk(C)", "--param", "C=3", "--q-len", "6",
                     "--ascii")
  assert code == 0
  rows = [line.split()[-1] for line in out.splitlines()[4:10]]
  q, k = np.arange(6)[:, None], np.arange(6)[None, :]
  assert rows == ["".join("#" if v else "." for v in row) for row in (k <= q) & (q // 3 == k // 3)]
  code, out, _ = run(capsys, "show", "causal & chunk(C)", "--param", "C=8", "--q-len", "32",
                     "--ascii")
  assert code == 0 and "causal & chunk(8)" in out


def test_an_unbound_parameter_is_hinted_in_cli_terms(capsys):
  code, _, err = run(capsys, "check", "causal & chunk(C)")
  assert code == 1
  assert "Bind `C`: `--param C=8192`." in err
  assert "maskc.parse(" not in err  # Python advice means nothing on a command line


def test_a_missing_operand_is_hinted_in_cli_terms(capsys):
  code, _, err = run(capsys, "dense", "causal & document(seg)", "--q-len", "8")
  assert code == 1
  assert "missing operand `seg` (token, shape [L] or [B, L])" in err
  assert "Pass `seg`: `--operand seg=...`." in err and "operands={" not in err
  code, _, err = run(capsys, "show", "sliding(W)", "--q-len", "8")
  assert code == 1
  assert "`--operand W=...`, or bind `W` when parsing: `--param W=...`" in err


def test_a_misspelled_operand_gets_a_did_you_mean(capsys):
  code, _, err = run(capsys, "dense", "causal & document(seg)", "--q-len", "8",
                     "--operand", "segs=0*4,1*4")
  assert code == 1 and "`segs` is given but not read: did you mean `seg`?" in err


def test_the_python_api_keeps_python_advice():
  with pytest.raises(maskc.MaskTypeError) as info:
    maskc.parse("causal & chunk(C)")
  err = info.value
  assert err.unbound == (Unbound("C", "param", example=8192),)
  assert "`maskc.parse(text, C=8192)`" in str(err)
  assert "`--param C=8192`" in err.render(CLI) and "maskc.parse(" not in err.render(CLI)


@pytest.mark.parametrize("item,needle", [
    ("C", "--param takes NAME=VALUE"), ("3C=4", "--param takes NAME=VALUE"),
    ("C=big", "parameter `C` must be an integer, got 'big'"),
])
def test_bad_parameters(capsys, item, needle):
  code, _, err = run(capsys, "check", "chunk(C)", "--param", item)
  assert code == 1 and needle in err
  code, _, err = run(capsys, "check", "chunk(C)", "--param", "C=1", "--param", "C=2")
  assert code == 1 and "parameter `C` is given twice" in err


def test_an_unused_parameter_is_noted(capsys):
  code, _, err = run(capsys, "check", "sliding(W)  # w", "--param", "w=3")
  assert code == 0 and "does not use parameter `w`" in err


# ----------------------------------------------------------------------------- operand values


@pytest.mark.parametrize("text,expected", [
    ("0,0,1,1", [0, 0, 1, 1]),
    (" 3 , -1 ,2 ", [3, -1, 2]),
    ("0*3,1*2,0", [0, 0, 0, 1, 1, 0]),
    ("7*1", [7]),
    ("-2*2,5*0,4", [-2, -2, 4]),
    ("0 * 2, 1", [0, 0, 1]),
])
def test_parse_operand_arrays(text, expected):
  value = parse_operand_value(text)
  assert isinstance(value, np.ndarray) and value.dtype == np.int64
  np.testing.assert_array_equal(value, expected)


@pytest.mark.parametrize("text,expected", [("5", 5), (" -3 ", -3), ("0", 0), ("+4", 4)])
def test_parse_operand_scalars(text, expected):
  value = parse_operand_value(text)
  assert value == expected and isinstance(value, int)


@pytest.mark.parametrize("text,needle", [
    ("", "empty"),
    ("  ", "empty"),
    ("1,", "item 2"),
    (",1", "item 1"),
    ("1,,2", "item 2"),
    ("1.5", "cannot read item 1"),
    ("a", "cannot read item 1"),
    ("1*-2", "cannot be negative"),
    ("1*2*3", "cannot read item 1"),
    ("*3", "cannot read item 1"),
    ("1:4", "cannot read item 1"),
    ("@", "must be followed by a file path"),
    (f"1*{MAX_OPERAND_ITEMS + 1}", "more than"),
    (f"1*{MAX_OPERAND_ITEMS // 2 + 1},0*{MAX_OPERAND_ITEMS // 2 + 1}", "more than"),
])
def test_parse_operand_errors(text, needle):
  with pytest.raises(maskc.MaskValueError) as info:
    parse_operand_value(text)
  assert needle in str(info.value), str(info.value)


def test_parse_operand_from_files(tmp_path):
  pair = np.eye(3, dtype=bool)
  np.save(tmp_path / "pair.npy", pair)
  np.testing.assert_array_equal(parse_operand_value(f"@{tmp_path / 'pair.npy'}"), pair)
  np.savez(tmp_path / "many.npz", a=pair, b=pair)
  with pytest.raises(maskc.MaskValueError, match="several arrays"):
    parse_operand_value(f"@{tmp_path / 'many.npz'}")
  (tmp_path / "junk.npy").write_bytes(b"not an array")
  with pytest.raises(maskc.MaskValueError, match="cannot load"):
    parse_operand_value(f"@{tmp_path / 'junk.npy'}")
  with pytest.raises(maskc.MaskValueError, match="no such operand file"):
    parse_operand_value(f"@{tmp_path / 'missing.npy'}")
  np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
  with pytest.raises(maskc.MaskValueError, match="cannot load"):
    parse_operand_value(f"@{tmp_path / 'obj.npy'}")
