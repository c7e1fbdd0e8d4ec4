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

In YAML, quote mask text that starts with `&`, `*`, `!`, `|`, `>`, `%` or `@`, or
holds `: ` (YAML reads those itself). In TOML, quote definition keys with brackets
(`"streaming(w)" = "sliding(w) | sink(4)"`) and write a layer list as `[[layers]]`
tables with `mask = "..."`, whose key paths then read `layers[3].mask` as in errors.

This module is the schema, the loaded `MaskConfig` and `load_config`, which reads
each section with the module for it: `params` (parameters), `operands`
(declarations, and the check that the masks read what is declared), `texts` (mask
text parsed with the definitions in scope, errors moved back into the config),
`layers` (lists, patterns, per-head entries) and `context_parallel`. Reading
files, with their size and depth bounds, lives in `maskc.config.files`;
`MaskSpec` and `mask_field` (mask text as a field of a model's own config class)
in `maskc.config.mask_spec`; `ConfigError` with the other errors in
`maskc.language.errors`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
import numpy as np

from maskc.config.context_parallel import (
  ContextParallel as ContextParallel,
  read_context_parallel,
)
from maskc.config.files import read_config
from maskc.config.layers import check_heads, read_entry, read_layers
from maskc.config.mask_spec import Layer
from maskc.config.operands import OperandDecl as OperandDecl, check_operands, read_operands
from maskc.config.params import read_params, unused_params
from maskc.config.texts import MaskTexts
from maskc.config.where import Where, did_you_mean, shown
from maskc.language import ir
from maskc.language.errors import ConfigError, OperandError, Unbound, short_repr
from maskc.lowering.compile import compile as compile_mask

if TYPE_CHECKING:
  from maskc.compiled.blockmap import BlockMap

_TOP_KEYS = ("num_layers", "num_heads", "params", "definitions", "default", "layers",
             "operands", "context_parallel")
_MAX_COUNT = 100_000  # layers or heads: a bound, so a typo cannot allocate without limit


class ConfigWarning(UserWarning):
  """A config declares something no mask uses: an operand or a parameter."""


# ----------------------------------------------------------------------------- the result


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
                         unbound=[Unbound(d.name, "operand", d.kind) for d in missing])
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


def _load(data: Any, where: Where, caller: dict[str, Any]) -> tuple[MaskConfig, list[str]]:
  """Reads one config's plain data into a `MaskConfig`, checking it on the way; returns it
  with the warnings to give."""
  if not isinstance(data, Mapping):
    raise where.error(f"a mask config is a mapping of keys, got {type(data).__name__}",
                      where.root, hint=f"Its keys are {', '.join(_TOP_KEYS)}.")
  for key in data:
    if key not in _TOP_KEYS:
      raise where.error(f"unknown key `{shown(key)}`", where.path(str(key)),
                        hint=did_you_mean(str(key), _TOP_KEYS)
                        + f"A mask config's keys are {', '.join(_TOP_KEYS)}.")
  num_layers = _count(data, "num_layers", where)
  num_heads = _count(data, "num_heads", where)
  params = read_params(data, caller, where)
  declared = read_operands(data, params, where)
  texts = MaskTexts(where, params)
  texts.read_definitions(data.get("definitions"))
  for name in texts.defined:
    if name in params.values:
      raise where.error(f"`{name}` is both a parameter and a definition", params.where(name),
                        hint="Rename one of them.")
    if name in declared:
      raise where.error(f"`{name}` is both an operand and a definition", declared[name].path,
                        hint="Rename one of them.")
  default = None
  if data.get("default") is not None:
    default = read_entry(texts, data["default"], where.path("default"))
  layers = read_layers(texts, data.get("layers"), num_layers)
  if any(e is None for e, _ in layers) and default is None:
    i = next(i for i, (e, _) in enumerate(layers) if e is None)
    raise where.error(f"layer {i} has no mask and the config gives no default",
                      layers[i][1] or where.path("default"),
                      hint="Add `default: causal` (or the mask these layers use).")
  # a layer without a mask has the default, which is there (checked above)
  masks = tuple(cast(Layer, default) if e is None else e for e, _ in layers)
  check_heads(where, masks, layers, num_heads)
  decls, warned = check_operands(texts, declared, where)
  warned += unused_params(params, texts.texts, where)
  config = MaskConfig(layers=masks, operands=decls, params=tuple(sorted(params.values.items())),
                      num_heads=num_heads, definitions=texts.definitions, source=where.file,
                      context_parallel=read_context_parallel(data, where))
  return config, warned


def _count(data: Mapping[str, Any], key: str, where: Where) -> int | None:
  """`num_layers` or `num_heads`: a positive integer, or None when not given."""
  value = data.get(key)
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_COUNT:
    raise where.error(f"{key} must be a positive integer up to {_MAX_COUNT}, got "
                      f"{short_repr(value)}", where.path(key))
  return value


def load_config(config: Any, /, *, section: str | None = None, **params: Any) -> MaskConfig:
  """Loads and checks the attention masks of a model config.

  Args:
    config: a path to a `.yaml`/`.yml` (needs PyYAML: `pip install -e ".[yaml]"`),
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
  result, warned = _load(data, Where(file, root), dict(params))
  for message in warned:
    warnings.warn(message, ConfigWarning, stacklevel=2)
  return result


jax.tree_util.register_static(MaskConfig)
