"""Checks of the arguments public functions take, shared by every stage.

`maskc.compile`, `maskc.materialize`, `maskc.balance`, `maskc.equivalent` and the
others check their integer arguments and read their mask arguments the same way, with
the same errors: the checks live here, at the lowest stage they fit (they need only the
IR, the parser and the errors), and every stage above imports them.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from maskc.language import ir
from maskc.language.errors import MaskTypeError, MaskValueError
from maskc.language.parse import parse

MaskLike = ir.Mask | str
MasksLike = MaskLike | Sequence[MaskLike]  # one mask, or one per head (`maskc.MaskLike`)


def integer(name: str, value: Any, *, minimum: int | None = None) -> int:
  """`value` as a Python int (NumPy integers too), at least `minimum` when given.

  Raises:
    MaskTypeError: `value` is not an integer (a float, a string, None, ...).
    MaskValueError: `value` is below `minimum`, shown as `name=value`.

  >>> integer("block_q", 128, minimum=1)
  128
  """
  try:
    v = operator.index(value)
  except TypeError:
    raise MaskTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
  if minimum is not None and v < minimum:
    bound = "positive" if minimum == 1 else f">= {minimum}"
    raise MaskValueError(f"{name} must be {bound}, got {name}={v}")
  return v


def as_mask(mask: Any) -> ir.Mask:
  """A `Mask` from a mask or its text.

  Raises:
    MaskTypeError: `mask` is neither (with a hint on how to write one).
  """
  if isinstance(mask, ir.Mask):
    return mask
  if isinstance(mask, str):
    return parse(mask)
  raise MaskTypeError(f"expected a mask or mask text, got {type(mask).__name__}",
                      hint='Pass `maskc.parse("causal")`, `maskc.causal()` or "causal".')


def as_masks(mask: Any) -> tuple[list[ir.Mask], bool]:
  """`(masks, per_head)`: one mask (`per_head` False), or a non-empty sequence of them, one
  per head (`per_head` True).

  Raises:
    MaskTypeError: neither a mask, mask text, nor a non-empty sequence of them.
  """
  if isinstance(mask, (ir.Mask, str)):
    return [as_mask(mask)], False
  if isinstance(mask, Sequence) and mask:
    return [as_mask(m) for m in mask], True
  raise MaskTypeError(f"expected a mask, mask text or a sequence of them, got {mask!r}")
