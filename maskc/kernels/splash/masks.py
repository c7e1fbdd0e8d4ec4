"""A bound maskc mask as JAX splash's own `Mask`: `as_splash_mask`.

`maskc.ComputableMask` (what `Mask.bind` returns) is a plain lazy, sliceable mask: the
compiler imports no kernel. Splash's mask API (`MultiHeadMask`, `process_mask`,
`LogicalAnd` / `LogicalOr`) takes instances of its `Mask` class, so this adapter wraps
a bound mask in one: tiles are sliced from the bound mask, and a mask of positions and
scalars also hands splash `q_sequence` and `mask_function` to evaluate it in the kernel.
tokamax's copy of splash has its own `Mask` class: `as_tokamax_mask`
(`maskc.kernels.splash.tokamax_kernel.as_tokamax`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as _splash

from maskc.language.errors import MaskValueError


def adapters(base: Any, name: str) -> tuple[type, type]:
  """The two adapter classes of a bound mask for a splash `Mask` class `base` (JAX's, or
  tokamax's copy of it): one slicing tiles from the mask, hashable by value; and one that
  also hands splash `q_sequence` and `mask_function`. `name` is the function that makes
  them, shown in their repr."""

  class BoundMask(base):
    """A bound maskc mask as a splash `Mask`: tiles sliced from it, hashable by value."""

    def __init__(self, cm: Any) -> None:
      self.cm = cm

    @property
    def shape(self) -> tuple[int, ...]:
      return tuple(self.cm.shape)

    def __getitem__(self, idx: Any) -> np.ndarray:
      return np.asarray(self.cm[idx])

    def __eq__(self, other: object) -> bool:
      if not isinstance(other, BoundMask):
        return NotImplemented
      return bool(self.cm == other.cm)

    def __hash__(self) -> int:
      return hash((BoundMask, self.cm))

    def __repr__(self) -> str:
      return f"{name}({self.cm!r})"

  class ComputableBoundMask(BoundMask):
    """A bound mask splash can evaluate in its kernel (`q_sequence`, `mask_function`)."""

    @property
    def q_sequence(self) -> np.ndarray:
      return np.asarray(self.cm.q_sequence)

    @property
    def mask_function(self) -> Callable[[Any, Any], Any]:
      fn: Callable[[Any, Any], Any] = self.cm.mask_function
      return fn

  return BoundMask, ComputableBoundMask


def adapted(cm: Any, classes: tuple[type, type], name: str) -> Any:
  """`cm` in the adapter class of `classes` (`adapters`) that fits it; a `MaskValueError`
  naming `name` where `cm` is no bound mask."""
  if not all(hasattr(cm, a) for a in ("bound", "shape", "__getitem__")):
    raise MaskValueError(f"{name} takes a bound mask, got {type(cm).__name__}",
                         hint="Bind the mask first: `maskc.parse(text).bind(q_len, kv_len, ...)`.")
  # A mask that reads operand arrays has no `mask_function` (the property raises).
  bound, computable = classes
  return computable(cm) if hasattr(cm, "mask_function") else bound(cm)


_SPLASH = adapters(_splash.Mask, "as_splash_mask")


def as_splash_mask(cm: Any) -> _splash.Mask:
  """A bound mask (`maskc.ComputableMask`) as a JAX splash `Mask`.

  Hands a maskc mask to JAX's splash attention wherever it takes a splash mask
  (`MultiHeadMask`, `process_mask`, `make_splash_mha`, and `&` / `|` with splash's own
  masks): splash slices tiles from it, and a mask of positions and scalars also gives
  splash `q_sequence` and `mask_function` to evaluate it in the kernel. maskc's own
  splash backends need none of this: they build the `MaskInfo` from the compiled map
  (`maskc.kernels.splash.mask_info`).

  Args:
    cm: a `ComputableMask` (`maskc.parse(text).bind(q_len, kv_len, ...)`); one with a
      batch axis gives a 3-D splash mask (splash's own masks are 2-D).

  Returns:
    A splash `Mask` equal to `cm` everywhere, hashable by value (splash caches its
    `process_mask` on the mask).

  Raises:
    MaskValueError: `cm` is no bound mask.

  >>> import maskc
  >>> from maskc.kernels.splash import as_splash_mask
  >>> m = as_splash_mask(maskc.parse("causal").bind(4))
  >>> m[1:3, :].astype(int).tolist()
  [[1, 1, 0, 0], [1, 1, 1, 0]]
  """
  out: _splash.Mask = adapted(cm, _SPLASH, "as_splash_mask")
  return out
