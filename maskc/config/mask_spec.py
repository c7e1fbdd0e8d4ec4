"""`MaskSpec` and `mask_field`: mask text as a checked, hashable field of a model config.

A model's own config dataclass holds its attention mask as text plus
parameters; `MaskSpec` parses and checks it when built, so a bad mask fails
when the config is made, not when the model runs, and stays static under
`jax.jit`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax

from maskc.language import ir
from maskc.language.errors import MaskError, MaskTypeError, short_repr
from maskc.language.parse import parse
from maskc.lowering.compile import compile as compile_mask

if TYPE_CHECKING:
  from maskc.compiled.blockmap import BlockMap

Layer = ir.Mask | tuple[ir.Mask, ...]


@dataclasses.dataclass(frozen=True, init=False)
class MaskSpec:
  """Mask text with its parameters, parsed and checked when built: a model-config field.

  Frozen and hashable, so it can be a static field of a flax or plain dataclass
  and a `jax.jit` static argument; registered with JAX as a static pytree node
  (no leaves). A sequence of texts is a per-head mask.

  Attributes:
    text: the mask text, or a tuple of texts (one per head).
    params: the parameter values, as sorted (name, value) pairs.

  >>> import maskc
  >>> spec = maskc.MaskSpec("causal & chunk(C)", C=8192)
  >>> spec.mask == maskc.causal() & maskc.chunk(8192), spec == maskc.MaskSpec(spec.text, C=8192)
  (True, True)
  """
  text: str | tuple[str, ...]
  params: tuple[tuple[str, Any], ...]
  if TYPE_CHECKING:  # set in __init__, not a field: equality and hashing read the text
    _mask: Layer

  def __init__(self, text: Any, params: Mapping[str, Any] | None = None, /, **kw_params: Any):
    merged = dict(params or {})
    merged.update(kw_params)
    if isinstance(text, MaskSpec):
      merged = {**dict(text.params), **merged}
      text = text.text
    if isinstance(text, ir.Mask):
      text = str(text)
    elif not isinstance(text, str):
      if not isinstance(text, Sequence) or not text:
        raise MaskTypeError(f"a MaskSpec holds mask text or a list of texts (one per head), "
                            f"got {type(text).__name__} {short_repr(text)}")
      text = tuple(str(t) if isinstance(t, ir.Mask) else t for t in text)
    object.__setattr__(self, "text", text)
    object.__setattr__(self, "params", tuple(sorted(merged.items())))
    mask: Layer
    if isinstance(text, str):
      mask = parse(text, **merged)
    else:
      mask = tuple(parse(t, **merged) for t in text)
    object.__setattr__(self, "_mask", mask)

  @property
  def mask(self) -> Layer:
    """The parsed mask, or a tuple of masks for a per-head spec."""
    return self._mask

  @property
  def operands(self) -> tuple[ir.OperandSpec, ...]:
    """The runtime operands the mask (all heads) reads, sorted by name."""
    masks = (self._mask,) if isinstance(self._mask, ir.Mask) else self._mask
    return tuple(sorted({s for m in masks for s in m.operands}, key=lambda s: s.name))

  def compile(self, q_len: int, kv_len: int | None = None, **kw: Any) -> BlockMap:
    """`maskc.compile` of this mask; keywords as there."""
    m = self._mask
    return compile_mask(m if isinstance(m, ir.Mask) else list(m), q_len, kv_len, **kw)

  @classmethod
  def coerce(cls, value: Any) -> MaskSpec:
    """`value` as a MaskSpec: a MaskSpec, mask text, a Mask, or a list of them per head."""
    return value if isinstance(value, MaskSpec) else cls(value)

  def __reduce__(self) -> tuple[Callable[..., MaskSpec], tuple[Any, ...]]:
    return (_spec_from, (self.text, self.params))

  def __str__(self) -> str:
    return self.text if isinstance(self.text, str) else "[" + ", ".join(self.text) + "]"


def _spec_from(text: str | tuple[str, ...], params: tuple[tuple[str, Any], ...]) -> MaskSpec:
  return MaskSpec(text, dict(params))


class _MaskField:
  """The descriptor behind `mask_field`: turns what is assigned into a checked MaskSpec."""

  def __init__(self, default: Any, params: dict[str, Any]) -> None:
    self.default = None if default is dataclasses.MISSING else MaskSpec(default, params)
    self.params = params
    self.name = self.attr = "?"

  def __set_name__(self, owner: type, name: str) -> None:
    self.name, self.attr = name, f"_maskc_field_{name}"

  def __get__(self, obj: Any, owner: type | None = None) -> MaskSpec:
    if obj is None:
      if self.default is None:
        raise AttributeError(self.name)  # dataclasses reads this as "no default"
      return self.default
    try:
      spec: MaskSpec = obj.__dict__[self.attr]
    except KeyError:
      raise AttributeError(self.name) from None
    return spec

  def __set__(self, obj: Any, value: Any) -> None:
    try:
      spec = value if isinstance(value, MaskSpec) else MaskSpec(value, self.params)
    except MaskError as e:
      raise e.with_source(f"{type(obj).__name__}.{self.name}") from None
    obj.__dict__[self.attr] = spec


def mask_field(default: Any = dataclasses.MISSING, **params: Any) -> Any:
  """A dataclass field holding a `MaskSpec`, checked whenever the dataclass is built.

  Assign it as the field's default (`attn: maskc.MaskSpec = maskc.mask_field("causal")`).
  Mask text given to the constructor (`Model(attn="sliding(W)")`) is parsed with
  `params` right away, so a bad mask fails when the config is made, not when the
  model runs. Works with plain and frozen dataclasses (not `slots=True`).

  Args:
    default: the default mask text (or Mask, or list of texts per head); omit it to
      make the field required.
    **params: parameter values for the field's masks.

  >>> import dataclasses, maskc
  >>> @dataclasses.dataclass(frozen=True)
  ... class Attn:
  ...   mask: maskc.MaskSpec = maskc.mask_field("causal & chunk(C)", C=64)
  >>> str(Attn(mask="sliding(C)").mask.mask)
  'sliding(64)'
  """
  return _MaskField(default, dict(params))


jax.tree_util.register_static(MaskSpec)
