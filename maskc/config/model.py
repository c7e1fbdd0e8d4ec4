"""Model configs: which mask each attention layer uses, written in YAML, JSON, TOML or a dict.

A model config names its masks once, says which layer uses which (an explicit
list or a repeating pattern, optionally per head), binds the parameters, and
declares the runtime operands the model will pass. `load_config` checks all of
it before any model runs: every expression parses with the file's definitions
in scope, every operand read is declared (and every declared one read), and the
layer count matches. Errors name the file and the key path (`layers[3].mask`),
and for text the line, column and a caret inside that expression.

The schema (every key optional except what the layers need):

```yaml
num_layers: 8                 # required with a `pattern`, checked against a list
num_heads: 2                  # optional; per-head lists must have this many masks
params: {C: 8192, W: 4096}    # integers for free names; callers may override them
definitions:                  # shared by every mask below (or one text block)
  local: causal & chunk(C) & document(seg)
  streaming(w): sliding(w) | sink(4)
default: causal | prefix(prompt_len)  # the mask of layers given as null or not listed
layers:                       # a pattern repeated (and cut) to num_layers ...
  pattern: [local, local, local, null]
  overrides: {0: streaming(W)}        # ... with single layers replaced
# layers: [local, {mask: causal}, {heads: [causal, "sliding(W)"]}, null]   # ... or a list
operands:                     # runtime inputs: kind token | scalar | pair, and a dtype
  seg: {kind: token, dtype: int32}
  prompt_len: scalar
context_parallel:             # optional: how maskc.sharded_attention splits the sequence
  layout: zigzag              # contiguous | zigzag | balanced
  strategy: ring              # all_gather | ring
```

A layer entry is mask text, `{mask: text}`, `{heads: [text, ...]}` (one mask
per head) or null (the default). Mask text is a program of the mask language:
it may hold its own definitions before its last line.

In YAML, quote mask text that starts with `~`, `&`, `*`, `|` or `!` (YAML reads
those itself). In TOML, quote definition keys with brackets (`"streaming(w)" =
"sliding(w) | sink(4)"`) and write a layer list as `[[layers]]` tables with
`mask = "..."`, whose key paths then read `layers[3].mask` as in errors.

This module is the schema and its loader. Reading files, with their size and
depth bounds, lives in `maskc.config.files`; `MaskSpec` and `mask_field` (mask
text as a field of a model's own config class) in `maskc.config.mask_spec`;
`ConfigError` with the other errors in `maskc.language.errors`.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
import numpy as np

from maskc.config.files import key_path, read_config
from maskc.config.mask_spec import Layer
from maskc.language import ir
from maskc.language.errors import (
  ConfigError,
  MaskError,
  MaskTypeError,
  MaskValueError,
  OperandError,
  Span,
  config_where,
  short_repr,
)
from maskc.language.parse import BUILTINS, RESERVED, _Program, nearest, parse_tree, prelude
from maskc.lowering.compile import compile as compile_mask

if TYPE_CHECKING:
  from maskc.compiled.blockmap import BlockMap

_TOP_KEYS = ("num_layers", "num_heads", "params", "definitions", "default", "layers",
             "operands", "context_parallel")
# `context_parallel:` keys and their values (those of `maskc.sharded_attention`).
_CP_CHOICES = {"layout": ("contiguous", "zigzag", "balanced"),
               "strategy": ("all_gather", "ring")}
_KINDS = {"token": "token", "per_token": "token", "per-token": "token", "scalar": "scalar",
          "pair": "pair", "pairwise": "pair"}
_SHAPES = {"token": "[L] or [B, L]", "scalar": "[] or [B]", "pair": "[Lq, Lk] or [B, Lq, Lk]"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_COUNT = 100_000  # layers or heads: a bound, so a typo cannot allocate without limit


class ConfigWarning(UserWarning):
  """A config declares something no mask uses: an operand or a parameter."""


# ----------------------------------------------------------------------------- the result


@dataclasses.dataclass(frozen=True)
class OperandDecl:
  """A runtime operand a config's masks read, as declared under `operands:`.

  Attributes:
    name: the operand's name in the mask text.
    kind: "token" (shape `[L]` or `[B, L]`), "scalar" (`[]` or `[B]`) or "pair"
      (`[Lq, Lk]` or `[B, Lq, Lk]`).
    dtype: a NumPy dtype name, `int32` or `bool` when not declared.
  """
  name: str
  kind: str
  dtype: str

  @property
  def shape(self) -> str:
    """The accepted shapes, as text."""
    return _SHAPES[self.kind]


@dataclasses.dataclass(frozen=True)
class ContextParallel:
  """How a config's model splits its sequence over a mesh axis, as `context_parallel:` says.

  Attributes:
    layout: `"contiguous"`, `"zigzag"` or `"balanced"` (see `maskc.balance`).
    strategy: `"all_gather"` or `"ring"` (see `maskc.sharded_attention`).

  >>> import maskc
  >>> cfg = maskc.load_config({"num_layers": 1, "layers": ["causal"],
  ...                          "context_parallel": {"layout": "zigzag", "strategy": "ring"}})
  >>> cfg.context_parallel.kwargs()
  {'layout': 'zigzag', 'strategy': 'ring'}
  """
  layout: str = "contiguous"
  strategy: str = "all_gather"

  def kwargs(self) -> dict[str, str]:
    """The keywords to pass to `maskc.sharded_attention` (`**cfg.context_parallel.kwargs()`)."""
    return {"layout": self.layout, "strategy": self.strategy}


@dataclasses.dataclass(frozen=True, eq=True)
class MaskConfig:
  """The masks of a model's attention layers, loaded and checked by `load_config`.

  Attributes:
    layers: per layer, a Mask or a tuple of Masks (one per head). Equal layers
      hold equal masks, so they compile once.
    operands: the declared runtime operands, sorted by name.
    params: the parameter values the masks were parsed with, sorted by name.
    num_heads: the head count of per-head layers, when given.
    definitions: the shared definitions, as mask-language text.
    context_parallel: the `context_parallel:` entry (layout and strategy for
      `maskc.sharded_attention`), or None when the config has none.
    source: the file the config came from, or None.

  >>> import maskc
  >>> cfg = maskc.load_config({"num_layers": 4, "params": {"C": 8192},
  ...                          "layers": {"pattern": ["causal & chunk(C)"] * 3 + ["causal"]}})
  >>> str(cfg.mask(0)), str(cfg.mask(3))
  ('causal & chunk(8192)', 'causal')
  """
  layers: tuple[Layer, ...]
  operands: tuple[OperandDecl, ...] = ()
  params: tuple[tuple[str, Any], ...] = ()
  num_heads: int | None = None
  definitions: str = ""
  source: str | None = dataclasses.field(default=None, compare=False)
  context_parallel: ContextParallel | None = None

  @property
  def num_layers(self) -> int:
    return len(self.layers)

  def mask(self, layer: int) -> Layer:
    """The mask of `layer` (negative counts from the end): a Mask, or a tuple per head."""
    n = self.num_layers
    if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool):
      raise ConfigError(f"a layer index must be an int, got {short_repr(layer)}",
                        file=self.source)
    if not -n <= layer < n:
      raise ConfigError(f"layer {layer} is out of range for {n} layers", file=self.source,
                        hint=f"Layers are numbered 0 to {n - 1}.")
    return self.layers[layer]

  @property
  def masks(self) -> tuple[Layer, ...]:
    """Every layer's mask, in order."""
    return self.layers

  def groups(self) -> dict[Layer, tuple[int, ...]]:
    """The distinct layer masks, each with the layers that use it, in first-use order."""
    out: dict[Layer, list[int]] = {}
    for i, m in enumerate(self.layers):
      out.setdefault(m, []).append(i)
    return {m: tuple(v) for m, v in out.items()}

  def compile(self, q_len: int, kv_len: int | None = None, *, block_q: int = 128,
              block_kv: int = 128, q_offset: int | None = None,
              operands: Mapping[str, Any] | None = None, exact: bool = False,
              refine_budget: int | None = None) -> list[BlockMap]:
    """Lowers every distinct layer mask once, for one shape and tiling.

    Args:
      q_len, kv_len, block_q, block_kv, q_offset, exact, refine_budget: as in
        `maskc.compile`.
      operands: values for the declared operands; static (NumPy) or traced (under jit).

    Returns:
      A list with one `BlockMap` per layer; layers with equal masks share one
      BlockMap object (`bms[0] is bms[1]`). Per-head layers give a BlockMap with
      a head dimension.

    Raises:
      OperandError: a declared operand is missing or misshapen.
    """
    operands = dict(operands or {})
    missing = [d for d in self.operands if d.name not in operands]
    if missing:
      names = ", ".join(f"`{d.name}` ({d.kind}, shape {d.shape}, {d.dtype})" for d in missing)
      raise OperandError(f"missing operand{'s' if len(missing) > 1 else ''} {names}",
                         source=self.source,
                         hint="Pass operands={" + ", ".join(f"'{d.name}': ..." for d in missing)
                         + "}.")
    done: dict[Layer, Any] = {}
    out = []
    for m in self.layers:
      if m not in done:
        done[m] = compile_mask(m if isinstance(m, ir.Mask) else list(m), q_len, kv_len,
                               block_q=block_q, block_kv=block_kv, q_offset=q_offset,
                               operands=operands, exact=exact, refine_budget=refine_budget)
      out.append(done[m])
    return out

  def __str__(self) -> str:
    lines = [f"MaskConfig({self.source or 'dict'}): {self.num_layers} layers"]
    for m, idx in self.groups().items():
      lines.append(f"  layer{'s' if len(idx) > 1 else ''} {_ranges(idx)}: {_one_line(m)}")
    if self.operands:
      lines.append("  operands: " + ", ".join(f"{d.name} ({d.kind} {d.dtype})"
                                              for d in self.operands))
    if self.context_parallel is not None:
      cp = self.context_parallel
      lines.append(f"  context parallel: layout {cp.layout}, strategy {cp.strategy}")
    return "\n".join(lines)


def _one_line(m: Layer) -> str:
  if isinstance(m, ir.Mask):
    return str(m).splitlines()[-1]
  return "heads [" + ", ".join(_one_line(h) for h in m) + "]"


def _ranges(idx: Sequence[int]) -> str:
  parts: list[str] = []
  start: int | None = idx[0]
  for a, b in zip(idx, list(idx[1:]) + [None]):
    if b != a + 1:
      parts.append(str(start) if start == a else f"{start}-{a}")
      start = b
  return ", ".join(parts)


# ----------------------------------------------------------------------------- loading


def _shown(key: Any) -> str:
  """A config key as an error quotes it: short keys as they are, long ones cut."""
  text = str(key) if isinstance(key, str) else short_repr(key, 60)
  return text if len(text) <= 60 else text[:57] + "..."


@dataclasses.dataclass(frozen=True)
class _Segment:
  """A piece of a synthesized program that came from one place in the config."""
  start: int
  text: str
  path: str


@dataclasses.dataclass
class _Parsed:
  mask: ir.Mask
  program: str
  segments: list[_Segment]
  path: str


class _Loader:
  """Reads one config's plain data into a `MaskConfig`, checking it on the way."""

  def __init__(self, data: Any, file: str | None, root: str, caller: dict[str, Any]):
    self.data, self.file, self.root, self.caller = data, file, root, caller
    self.warnings: list[str] = []
    self.texts: list[str] = []  # every mask text read, to find which params are used
    self.parsed: dict[str, _Parsed] = {}
    self.defined: set[str] = set()

  def error(self, message: str, path: str, hint: str | None = None) -> ConfigError:
    return ConfigError(message, path=path or None, file=self.file, hint=hint)

  def path(self, key: Any) -> str:
    return key_path(self.root, key)

  # -------------------------------------------------------------------- top level

  def load(self) -> MaskConfig:
    data = self.data
    if not isinstance(data, Mapping):
      raise self.error(f"a mask config is a mapping of keys, got {type(data).__name__}",
                       self.root, hint=f"Its keys are {', '.join(_TOP_KEYS)}.")
    for key in data:
      if key not in _TOP_KEYS:
        guess = nearest(str(key), _TOP_KEYS)
        raise self.error(f"unknown key `{_shown(key)}`", self.path(str(key)),
                         hint=(f"Did you mean `{guess}`? " if guess else "")
                         + f"A mask config's keys are {', '.join(_TOP_KEYS)}.")
    num_layers = self.count("num_layers")
    num_heads = self.count("num_heads")
    self.params = self.read_params()
    self.operand_decls = self.read_operands()
    self.definitions, self.def_segments = self.read_definitions()
    self.check_names()
    default = None
    if data.get("default") is not None:
      default = self.entry(data["default"], self.path("default"))
    layers = self.read_layers(num_layers)
    if any(e is None for e, _ in layers) and default is None:
      i = next(i for i, (e, _) in enumerate(layers) if e is None)
      raise self.error(f"layer {i} has no mask and the config gives no default",
                       layers[i][1] or self.path("default"),
                       hint="Add `default: causal` (or the mask these layers use).")
    # a layer without a mask has the default, which is there (checked above)
    masks = tuple(cast(Layer, default) if e is None else e for e, _ in layers)
    self.check_heads(masks, layers, num_heads)
    decls = self.check_operands()
    self.check_params_used()
    return MaskConfig(layers=masks, operands=decls, params=tuple(sorted(self.params.items())),
                      num_heads=num_heads, definitions=self.definitions, source=self.file,
                      context_parallel=self.read_context_parallel())

  def read_context_parallel(self) -> ContextParallel | None:
    """The `context_parallel:` entry: a mapping of `layout` and `strategy`, each optional."""
    if "context_parallel" not in self.data:
      return None
    raw = self.data["context_parallel"]
    base = self.path("context_parallel")
    example = "context_parallel: {layout: zigzag, strategy: ring}"
    if not isinstance(raw, Mapping):
      raise self.error(f"context_parallel must be a mapping of layout and strategy, got "
                       f"{short_repr(raw)}", base, hint=example)
    values = {}
    for key, value in raw.items():
      p = key_path(base, str(key))
      if key not in _CP_CHOICES:
        guess = nearest(str(key), tuple(_CP_CHOICES))
        raise self.error(f"unknown key `{_shown(key)}` in context_parallel", p,
                         hint=(f"Did you mean `{guess}`? " if guess else "")
                         + "context_parallel has `layout` and `strategy`.")
      choices = _CP_CHOICES[key]
      if not isinstance(value, str) or value not in choices:
        guess = nearest(value, choices) if isinstance(value, str) else None
        raise self.error(f"context_parallel {key} {short_repr(value)} is not one of "
                         f"{', '.join(choices)}", p,
                         hint=(f"Did you mean `{guess}`? " if guess else "")
                         + f"{key}: {' | '.join(choices)}.")
      values[key] = value
    return ContextParallel(**values)

  def count(self, key: str) -> int | None:
    value = self.data.get(key)
    if value is None:
      return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_COUNT:
      raise self.error(f"{key} must be a positive integer up to {_MAX_COUNT}, got "
                       f"{short_repr(value)}", self.path(key))
    return value

  # -------------------------------------------------------------------- params

  def check_name(self, name: Any, path: str, what: str) -> None:
    if not isinstance(name, str) or not name.isidentifier():
      raise self.error(f"{what} name {short_repr(name)} is not a name", path,
                       hint="Names are letters, digits and `_`, not starting with a digit.")
    if name in RESERVED or name in BUILTINS:
      raise self.error(f"{what} name `{name}` is reserved in the mask language", path,
                       hint="Choose another name.")
    if name in prelude():
      raise self.error(f"{what} name `{name}` would hide the prelude mask `{name}`", path,
                       hint="Choose another name.")

  def read_params(self) -> dict[str, Any]:
    raw = self.data.get("params")
    if raw is None:
      raw = {}
    if not isinstance(raw, Mapping):
      raise self.error(f"params must be a mapping of names to integers, got "
                       f"{type(raw).__name__}", self.path("params"),
                       hint="params: {C: 8192}")
    base = self.path("params")
    params: dict[str, Any] = {}
    self.config_params: dict[str, str] = {}
    for name, value in raw.items():
      p = key_path(base, name)
      self.check_name(name, p, "parameter")
      if isinstance(value, bool) or not isinstance(value, int):
        raise self.error(f"parameter `{name}` must be an integer, got {short_repr(value)}", p,
                         hint="Masks belong under `definitions:`; operands under `operands:`.")
      params[name] = value
      self.config_params[name] = p
    for name, value in self.caller.items():
      where = f"load_config({name}=...)"
      self.check_name(name, where, "parameter")
      if not isinstance(value, (int, str, ir.Node)):
        try:
          value = operator.index(value)  # NumPy integers
        except TypeError:
          raise self.error(f"parameter `{name}` must be an int, a mask or an operand name, got "
                           f"{type(value).__name__} {short_repr(value)}", where) from None
      params[name] = value
    return params

  # -------------------------------------------------------------------- operands

  def read_operands(self) -> dict[str, tuple[str, str | None, str]]:
    """Declared operands by name: (kind, dtype or None, key path)."""
    raw = self.data.get("operands")
    if raw is None:
      return {}
    base = self.path("operands")
    if not isinstance(raw, Mapping):
      raise self.error(f"operands must be a mapping of names to kinds, got "
                       f"{type(raw).__name__}", base,
                       hint="operands: {seg: {kind: token, dtype: int32}, prompt_len: scalar}")
    out = {}
    for name, spec in raw.items():
      p = key_path(base, name)
      self.check_name(name, p, "operand")
      if name in self.params:
        raise self.error(f"`{name}` is both a parameter and an operand", p,
                         hint="A parameter is fixed when the config loads; an operand is an "
                              "array the model passes. Keep one.")
      dtype = None
      kind_path = p
      if isinstance(spec, str):
        kind = spec
      elif isinstance(spec, Mapping):
        for key in spec:
          if key not in ("kind", "dtype", "doc"):
            raise self.error(f"unknown key `{_shown(key)}` in operand `{name}`",
                             key_path(p, str(key)),
                             hint="An operand has `kind`, `dtype` and `doc`.")
        if "kind" not in spec:
          raise self.error(f"operand `{name}` needs a kind", p,
                           hint="kind: token (per token), scalar or pair (pairwise).")
        kind, dtype, kind_path = spec["kind"], spec.get("dtype"), key_path(p, "kind")
      else:
        raise self.error(f"operand `{name}` must be a kind or a mapping, got "
                         f"{short_repr(spec)}", p, hint=f"{name}: {{kind: token, dtype: int32}}")
      if not isinstance(kind, str) or kind not in _KINDS:
        raise self.error(f"operand `{name}` has unknown kind {short_repr(kind)}", kind_path,
                         hint="Kinds are token (per token, [L] or [B, L]), scalar ([] or [B]) "
                              "and pair (pairwise, [Lq, Lk] or [B, Lq, Lk]).")
      if dtype is not None:
        try:
          dt = np.dtype(dtype) if isinstance(dtype, str) else None
        except (TypeError, ValueError, SyntaxError):
          dt = None
        if dt is None or not (np.issubdtype(dt, np.integer) or dt == np.bool_):
          raise self.error(f"operand `{name}` has dtype {short_repr(dtype)}; operands hold "
                           f"integers or booleans", key_path(p, "dtype"),
                           hint="dtype: int32 or dtype: bool.")
        dtype = dt.name
      out[name] = (_KINDS[kind], dtype, p)
    return out

  # -------------------------------------------------------------------- definitions

  def read_definitions(self) -> tuple[str, list[_Segment]]:
    raw = self.data.get("definitions")
    base = self.path("definitions")
    if raw is None:
      return "", []
    if isinstance(raw, str):
      text, segments = raw, [_Segment(0, raw, base)]
    elif isinstance(raw, Mapping):
      parts, segments, pos = [], [], 0
      for lhs, body in raw.items():
        p = key_path(base, str(lhs))
        if not isinstance(lhs, str) or not _NAME.match(lhs.strip()):
          raise self.error(f"definition name {short_repr(lhs)} is not a name or `name(params)`", p)
        if not isinstance(body, str) or not body.strip():
          raise self.error(f"definition `{lhs}` must be mask text, got {short_repr(body)}", p,
                           hint=f"{lhs}: causal & chunk(C)")
        line = f"{lhs} = {body}"
        segments.append(_Segment(pos, lhs, p))
        segments.append(_Segment(pos + len(lhs) + 3, body, p))
        parts.append(line)
        pos += len(line) + 1
      text = "\n".join(parts)
    else:
      raise self.error(f"definitions must be a mapping or a text block, got "
                       f"{type(raw).__name__}", base,
                       hint="definitions: {local: causal & chunk(C)}")
    self.texts.append(text)
    if text.strip():
      try:
        program = _Program(text, prelude(), dict(self.params))
        program.program(parse_tree(text), library_only=True)
      except RecursionError:
        raise self.error("the definitions nest too deeply to process", base) from None
      except MaskError as e:
        raise self.relocate(e, text, segments, base) from None
      self.defined = set(program.done)
    return text, segments

  def check_names(self) -> None:
    for name in self.defined:
      if name in self.params:
        raise self.error(f"`{name}` is both a parameter and a definition",
                         self.config_params.get(name, f"load_config({name}=...)"),
                         hint="Rename one of them.")
      if name in self.operand_decls:
        raise self.error(f"`{name}` is both an operand and a definition",
                         self.operand_decls[name][2], hint="Rename one of them.")

  # -------------------------------------------------------------------- mask text

  def expr(self, text: Any, path: str) -> ir.Mask:
    if not isinstance(text, str):
      raise self.error(f"expected mask text, got {type(text).__name__} {short_repr(text)}", path,
                       hint="Write the mask as a string: \"causal & chunk(C)\".")
    if not text.strip():
      raise self.error("the mask text is empty", path, hint="Write a mask, e.g. `causal`.")
    if text in self.parsed:
      return self.parsed[text].mask
    self.texts.append(text)
    if self.definitions.strip():
      glue = "\n;\n"  # `;` ends the definitions even if the mask starts with an operator
      program = self.definitions + glue + text
      segments = self.def_segments + [_Segment(len(self.definitions) + len(glue), text, path)]
    else:
      program, segments = text, [_Segment(0, text, path)]
    try:
      mask = _Program(program, prelude(), dict(self.params)).program(parse_tree(program))
    except RecursionError:
      raise self.error("the mask is too deeply nested to process", path) from None
    except MaskError as e:
      raise self.relocate(e, program, segments, path) from None
    self.parsed[text] = _Parsed(mask, program, segments, path)
    return mask

  def relocate(self, err: MaskError, program: str, segments: list[_Segment], path: str,
               name_hint: bool = True) -> MaskError:
    """`err` with its span moved from the synthesized program into the config text."""
    span, where = err.span, path
    if span is not None and span.text == program and segments:
      seg = segments[0]
      for s in segments:
        if s.start <= span.start:
          seg = s
      rel = min(span.start - seg.start, len(seg.text))
      rel_end = max(rel + 1, min(span.end - seg.start, len(seg.text)))
      line = seg.text.count("\n", 0, rel) + 1
      column = rel - (seg.text.rfind("\n", 0, rel) + 1) + 1
      span, where = Span(line, column, rel, rel_end, seg.text), seg.path
      word = seg.text[rel:rel_end]
      # A free name where an integer belongs became a scalar operand: say how to bind it.
      if (name_hint and isinstance(err, (MaskTypeError, MaskValueError))
          and _NAME.fullmatch(word) and not self.known(word)):
        extra = (f"`{word}` is not a parameter, a definition or a declared operand: set it "
                 f"under `params:` or pass `load_config(..., {word}=...)`.")
        err.hint = f"{err.hint}\n{extra}" if err.hint else extra
    if where != path:  # the error sits in a definition: say which mask reached it
      extra = f"The mask at {path} uses this definition."
      err.hint = f"{err.hint}\n{extra}" if err.hint else extra
    err.span = span
    err.path, err.file = where or None, self.file
    if span is None:
      err.message = f"{err.message} ({config_where(self.file, where)})"
    err.with_source(config_where(self.file, where))
    return err

  def known(self, name: str) -> bool:
    return (name in self.params or name in self.defined or name in prelude()
            or name in self.operand_decls or name in RESERVED or name in BUILTINS)

  # -------------------------------------------------------------------- layers

  def entry(self, value: Any, path: str) -> Layer | None:
    if value is None:
      return None
    if isinstance(value, str):
      return self.expr(value, path)
    if isinstance(value, Mapping):
      for key in value:
        if key not in ("mask", "heads"):
          raise self.error(f"unknown key `{_shown(key)}` in a layer entry",
                           key_path(path, str(key)),
                           hint="A layer entry has `mask: text` or `heads: [text, ...]`.")
      if ("mask" in value) == ("heads" in value):
        raise self.error("a layer entry needs exactly one of `mask` and `heads`", path,
                         hint="{mask: causal} or {heads: [causal, \"sliding(128)\"]}")
      if "mask" in value:
        return self.expr(value["mask"], key_path(path, "mask"))
      heads = value["heads"]
      hp = key_path(path, "heads")
      if isinstance(heads, str) or not isinstance(heads, Sequence) or not heads:
        raise self.error(f"heads must be a non-empty list of mask texts, got "
                         f"{short_repr(heads)}", hp)
      return tuple(self.expr(h, key_path(hp, i)) for i, h in enumerate(heads))
    raise self.error(f"a layer entry is mask text, {{mask: ...}}, {{heads: [...]}} or null, "
                     f"got {type(value).__name__} {short_repr(value)}", path)

  def read_layers(self, num_layers: int | None) -> list[tuple[Layer | None, str]]:
    raw = self.data.get("layers")
    base = self.path("layers")
    if raw is None:
      if num_layers is None:
        raise self.error("the config gives neither `layers` nor `num_layers`", self.root,
                         hint="Add `num_layers: N` (every layer takes `default`) or a "
                              "`layers` list.")
      return [(None, "") for _ in range(num_layers)]
    if isinstance(raw, Sequence) and not isinstance(raw, str):
      if not raw:
        raise self.error("layers is an empty list", base)
      if num_layers is not None and len(raw) != num_layers:
        raise self.error(f"layers lists {len(raw)} layers but num_layers is {num_layers}", base,
                         hint="List one entry per layer, or use `layers: {pattern: [...]}` to "
                              "repeat a pattern.")
      return [(self.entry(v, key_path(base, i)), key_path(base, i)) for i, v in enumerate(raw)]
    if not isinstance(raw, Mapping):
      raise self.error(f"layers must be a list or {{pattern: [...]}}, got {type(raw).__name__}",
                       base)
    for key in raw:
      if key not in ("pattern", "overrides"):
        raise self.error(f"unknown key `{_shown(key)}` in layers", key_path(base, str(key)),
                         hint="layers: {pattern: [...], overrides: {0: ...}}")
    if num_layers is None:
      raise self.error("a layer pattern needs num_layers", base,
                       hint="Add `num_layers: N`; the pattern repeats to fill N layers.")
    out: list[tuple[Layer | None, str]] = [(None, "") for _ in range(num_layers)]
    pattern = raw.get("pattern")
    if pattern is not None:
      pp = key_path(base, "pattern")
      if isinstance(pattern, str) or not isinstance(pattern, Sequence) or not pattern:
        raise self.error(f"pattern must be a non-empty list of layer entries, got "
                         f"{short_repr(pattern)}", pp,
                         hint="pattern: [local, local, local, causal]")
      entries = [(self.entry(v, key_path(pp, i)), key_path(pp, i)) for i, v in enumerate(pattern)]
      out = [entries[i % len(entries)] for i in range(num_layers)]
    overrides = raw.get("overrides")
    if overrides is not None:
      op = key_path(base, "overrides")
      if not isinstance(overrides, Mapping):
        raise self.error(f"overrides must map layer numbers to entries, got "
                         f"{short_repr(overrides)}", op, hint="overrides: {0: causal}")
      for key, v in overrides.items():
        kp = key_path(op, str(key))
        i = key if isinstance(key, int) and not isinstance(key, bool) else (
            int(key) if isinstance(key, str) and key.strip().isdigit() else None)
        if i is None or not 0 <= i < num_layers:
          raise self.error(f"override key {short_repr(key)} is not a layer number in "
                           f"0..{num_layers - 1}", kp)
        out[i] = (self.entry(v, kp), kp)
    return out

  def check_heads(self, masks: tuple[Layer, ...], layers: list[tuple[Layer | None, str]],
                  num_heads: int | None) -> None:
    seen = None
    for (_, path), m in zip(layers, masks):
      if isinstance(m, tuple):
        path = path or self.path("default")
        n = len(m)
        if num_heads is not None and n != num_heads:
          raise self.error(f"the entry lists {n} head masks"
                           f" but num_heads is {num_heads}", key_path(path, "heads"),
                           hint="Give one mask per head.")
        if seen is not None and n != seen[0]:
          raise self.error(f"this entry lists {n} head masks but {seen[1]} lists {seen[0]}",
                           key_path(path, "heads"), hint="Give every per-head layer the same "
                                                     "number of heads, or set num_heads.")
        seen = seen or (n, key_path(path, "heads"))

  # -------------------------------------------------------------------- operand checks

  def check_operands(self) -> tuple[OperandDecl, ...]:
    used: dict[str, bool] = {}
    for parsed in self.parsed.values():
      for spec in parsed.mask.operands:
        decl = self.operand_decls.get(spec.name)
        if decl is None:
          raise self.operand_error(
              parsed, spec.name, f"the mask reads operand `{spec.name}` as a {spec.kind} "
              f"operand, but the config does not declare it",
              hint=(f"Declare it: `operands: {{{spec.name}: {{kind: {spec.kind}, dtype: "
                    f"{'bool' if spec.boolean else 'int32'}}}}}`. If `{spec.name}` is a "
                    f"parameter, set it under `params:` or pass "
                    f"`load_config(..., {spec.name}=...)`."))
        kind, _, p = decl
        if kind != spec.kind:
          raise self.operand_error(
              parsed, spec.name, f"operand `{spec.name}` is declared as a {kind} operand "
              f"({p}) but the mask reads it as a {spec.kind} operand",
              hint=f"Declare `{spec.name}` with kind: {spec.kind}, or index it as a {kind} "
                   f"operand.")
        used[spec.name] = used.get(spec.name, False) or spec.boolean
    out = []
    for name, (kind, dtype, p) in sorted(self.operand_decls.items()):
      if name not in used:
        self.warnings.append(f"operand `{name}` is declared ({config_where(self.file, p)}) but no "
                             f"layer's mask reads it")
      out.append(OperandDecl(name, kind, dtype or ("bool" if used.get(name) else "int32")))
    return tuple(out)

  def operand_error(self, parsed: _Parsed, name: str, message: str, hint: str) -> MaskError:
    span = None
    for into_calls in (False, True):
      for n in ir.walk(parsed.mask, into_calls=into_calls):
        nm = getattr(n, "name", None) if isinstance(n, (ir.Operand, ir.Scalar)) else (
            n.operand.name if isinstance(n, (ir.Read, ir.PairRead)) else None)
        s = getattr(n, "span", None)
        if nm == name and s is not None and s.text == parsed.program:
          span = s if span is None or s.start < span.start else span
      if span is not None:
        break
    err = ConfigError(message, path=parsed.path, file=self.file, span=span, hint=hint)
    if span is None:
      return err
    return self.relocate(err, parsed.program, parsed.segments, parsed.path, name_hint=False)

  def check_params_used(self) -> None:
    words = set()
    for t in self.texts:
      words.update(_NAME.findall(re.sub(r"#[^\n]*", "", t)))
    for name in self.params:
      if name in words:
        continue
      where = self.config_params.get(name)
      if where is not None and name not in self.caller:
        self.warnings.append(f"parameter `{name}` ({config_where(self.file, where)}) is not "
                             f"used by any mask")
      else:
        self.warnings.append(f"parameter `{name}` passed to load_config is not used by any "
                             f"mask of {self.file or 'the config'}")


def load_config(config: Any, /, *, section: str | None = None, **params: Any) -> MaskConfig:
  """Loads and checks the attention masks of a model config.

  Args:
    config: a path to a `.yaml`/`.yml` (needs PyYAML: `pip install 'maskc[yaml]'`),
      `.json` or `.toml` file, or a mapping with the same keys (see the schema in
      `maskc.config.model`'s docstring).
    section: a dotted key path to the mask config inside a larger file
      (`section="model.attention"`).
    **params: parameter values; they override the config's `params:`. Ints,
      masks, or strings to rename an operand, as in `maskc.parse`.

  Returns:
    A `MaskConfig`: `config.mask(i)` per layer, `config.compile(q_len, ...)` for
    BlockMaps, `config.operands` for the runtime inputs.

  Raises:
    ConfigError: a malformed config (a wrong key, type or count, an undeclared
      or misused operand), naming the file and the key path.
    MaskError: mask text that does not parse or check, with the key path and a
      caret inside that text.

  Warns:
    ConfigWarning: a declared operand or a parameter that no mask uses.

  >>> import maskc
  >>> cfg = maskc.load_config({"num_layers": 6, "params": {"W": 512},
  ...                          "definitions": {"local": "sliding(W)"},
  ...                          "layers": {"pattern": ["local"] * 5 + ["causal"]}}, W=1024)
  >>> [str(cfg.mask(i)).splitlines()[-1] for i in (0, 5)], str(cfg.mask(0)).splitlines()[0]
  (['local', 'causal'], 'local = sliding(1024)')
  """
  if isinstance(config, MaskConfig):
    if params or section:
      raise ConfigError("a loaded MaskConfig cannot take new parameters or a section",
                        file=config.source, hint="Load the file again with the parameters.")
    return config
  data, file, root = read_config(config, section)
  loader = _Loader(data, file, root, dict(params))
  result = loader.load()
  for message in loader.warnings:
    warnings.warn(message, ConfigWarning, stacklevel=2)
  return result


jax.tree_util.register_static(MaskConfig)
