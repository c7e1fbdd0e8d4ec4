"""What the bridge's functions share: masks from their arguments, operands as NumPy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import maskc

MaskArg = maskc.Mask | str | Sequence[maskc.Mask | str]


def masks_of(mask: MaskArg, params: Mapping[str, Any]) -> tuple[list[maskc.Mask], bool]:
  """The masks of `mask` (text parsed with `params`), and whether it is a per-head list."""
  def one(m: Any) -> maskc.Mask:
    if isinstance(m, str):
      return maskc.parse(m, **params)
    if isinstance(m, maskc.Mask):
      if params:
        raise maskc.MaskTypeError(
            f"parameters {sorted(params)} were given with a Mask object; they bind names in "
            f"mask text only", hint="Pass the mask as text, or leave the parameters out.")
      return m
    raise maskc.MaskTypeError(f"expected a mask, mask text or a list of them (one per head), "
                              f"got {type(m).__name__}",
                              hint='Pass "causal & sliding(W)", maskc.causal(), or a list.')

  if isinstance(mask, (str, maskc.Mask)):
    return [one(mask)], False
  if isinstance(mask, Sequence) and len(mask) > 0:
    return [one(m) for m in mask], True
  raise maskc.MaskTypeError(f"expected a mask, mask text or a non-empty list of them (one per "
                            f"head), got {mask!r}")


def numpy_operands(operands: Mapping[str, Any] | None) -> dict[str, Any]:
  """Operand values as NumPy arrays (torch tensors and jax arrays copied to the host)."""
  out: dict[str, Any] = {}
  for name, value in (operands or {}).items():
    if _is_torch_tensor(value):
      value = value.detach().cpu().numpy()
    elif not isinstance(value, (int, np.integer)):
      value = np.asarray(value)
    out[name] = value
  return out


def _is_torch_tensor(x: Any) -> bool:
  return any(c.__module__ == "torch" and c.__name__ == "Tensor" for c in type(x).__mro__)
