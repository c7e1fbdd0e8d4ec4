"""PaddlePaddle's FlashMask columns: `flashmask(mask, q_len, operands=...)`.

`paddle.nn.functional.flashmask_attention(q, k, v, startend_row_indices, causal=...)` masks,
in each key column `j`, at most one run of rows below the diagonal (the lower-left triangle,
rows `i >= j`) and one above it (the upper-right triangle, rows `i < j`). Its
`startend_row_indices` is int32 `[B, H, S, n]`, the values `r1..rn` per column:

| causal | n | masked rows of column j |
|---|---|---|
| True  | 1 | `[LTS, S)` below the diagonal; above it, everything (causal) |
| True  | 2 | `[LTS, LTE)` below; everything above |
| False | 2 | `[LTS, S)` below; `[0, UTE)` above (values `LTS, UTE`) |
| False | 4 | `[LTS, LTE)` below; `[UTS, UTE)` above (values `LTS, LTE, UTS, UTE`) |

So a mask fits when, in every column, the allowed rows below the diagonal are the rows from
the diagonal down minus one run, and likewise above it: causal, sliding windows, documents,
prefix-LM and the global tokens of one side all do; a column whose allowed rows break into
more pieces does not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from maskc.formats._tiles import distinct, line_intervals, require_static
from maskc.language.arguments import MasksLike
from maskc.language.errors import MaskValueError
from maskc.lowering.compile import compile as compile_mask


@dataclasses.dataclass(frozen=True)
class FlashMask:
  """A mask as FlashMask's column-wise row ranges.

  Attributes:
    startend_row_indices: int32 `[B, H, S, n]` (`n` in 1, 2, 4; B and H are 1 for a mask
      without batch or heads): per key column, the bounds of its masked rows (module
      docstring), as `flashmask_attention` takes them.
    causal: the `causal` flag to pass with them.

  The dense mask back from the fields (column j, rows i; True: attend):

      lower, upper = i >= j, i < j
      causal, n = True, 1:  attend = lower & ~(i >= r1)
      causal, n = True, 2:  attend = lower & ~((r1 <= i) & (i < r2))
      causal, n = False, 2: attend = ~(lower & (i >= r1)) & ~(upper & (i < r2))
      causal, n = False, 4: attend = ~(lower & (r1 <= i) & (i < r2))
                                     & ~(upper & (r3 <= i) & (i < r4))
  """
  startend_row_indices: np.ndarray
  causal: bool


def _fit(s: int, lower: list[tuple[int, int]], upper: list[tuple[int, int]], j: int
         ) -> tuple[tuple[int, int], tuple[int, int]] | None:
  """Column j's masked runs `(lower [LTS, LTE), upper [UTS, UTE))` when its allowed rows are
  `[j, S)` and `[0, j)` each minus at most one run; else None."""
  def masked(allowed: list[tuple[int, int]], lo: int, hi: int, empty: tuple[int, int]):
    if not allowed:
      return (lo, hi) if lo < hi else empty
    if len(allowed) == 1:
      a, b = allowed[0]
      if a == lo:
        return (b, hi) if b < hi else empty
      if b == hi:
        return (lo, a)
      return None
    if len(allowed) == 2 and allowed[0][0] == lo and allowed[1][1] == hi:
      return (allowed[0][1], allowed[1][0])
    return None

  low = masked(lower, j, s, (s, s))
  up = masked(upper, 0, j, (0, 0))
  return None if low is None or up is None else (low, up)


def flashmask(mask: MasksLike, q_len: int, *, operands: Mapping[str, Any] | None = None,
              causal: bool | None = None) -> FlashMask:
  """FlashMask's `startend_row_indices` (and `causal` flag) for a mask.

  Args:
    mask: mask text, a Mask, or a sequence of them (one per head); `kv_len = q_len`, row i
      and column j the positions i and j.
    q_len: the sequence length S.
    operands: static operand values (`[L]` or `[B, L]`).
    causal: ask for the causal (True) or bidirectional (False) form; None: the smallest
      that is exact (causal with 1 or 2 values, else bidirectional with 2 or 4).

  Returns:
    A `FlashMask`, exact: decoding it gives the mask, position by position.

  Raises:
    MaskValueError: a column whose allowed rows are not the rows from the diagonal down
      and those above it, each minus one run (naming the column and its runs); `causal=True`
      for a mask that allows a row above the diagonal; traced operands.

  >>> import maskc
  >>> fm = maskc.formats.flashmask("sliding(3)", 6)
  >>> fm.causal, fm.startend_row_indices[0, 0, :, 0].tolist()
  (True, [3, 4, 5, 6, 6, 6])
  """
  bm = compile_mask(mask, q_len, q_offset=0, operands=operands)
  require_static(bm, "flashmask")
  s = q_len
  heads = distinct(bm)
  nb = bm.batch or 1
  values = np.zeros((nb, len(heads), s, 4), np.int64)
  any_upper = False
  for u in sorted(set(heads)):
    for b in range(nb):
      line, lo, hi = line_intervals(bm, u, b, columns=True)
      bounds = np.searchsorted(line, np.arange(s + 1))
      for j in range(s):
        runs = list(zip(lo[bounds[j]:bounds[j + 1]].tolist(), hi[bounds[j]:bounds[j + 1]].tolist()))
        lower = [(max(a, j), z) for a, z in runs if z > j]
        upper = [(a, min(z, j)) for a, z in runs if a < j]
        fit = _fit(s, lower, upper, j)
        if fit is None:
          head = f" of head {heads.index(u)}" if bm.heads else ""
          where = f" in batch row {b}" if bm.batch else ""
          raise MaskValueError(
              f"column {j}{head}{where} allows rows {runs}: FlashMask holds, per column, the rows "
              f"from the diagonal down and those above it, each minus one run",
              hint="Masks that fit: causal, sliding windows, documents, prefix-LM, global tokens.")
        (lts, lte), (uts, ute) = fit
        any_upper |= upper != []
        for h, hu in enumerate(heads):
          if hu == u:
            values[b, h, j] = (lts, lte, uts, ute)
  if causal and any_upper:
    j = int(np.argmax((values[..., 2] != 0) | (values[..., 3] != np.arange(s))) % s)
    raise MaskValueError(f"causal=True, but column {j} allows a row above the diagonal",
                         hint="Use causal=False (or None).")
  use_causal = not any_upper if causal is None else bool(causal)
  if use_causal:
    # the whole upper triangle is masked by the causal flag: [UTS, UTE) = [0, j)
    n = 1 if (values[..., 1] == s).all() else 2
    out = values[..., :n]
  else:
    upper_from_zero = (values[..., 2] == 0).all()
    lower_to_end = (values[..., 1] == s).all()
    if upper_from_zero and lower_to_end:
      out = values[..., [0, 3]]
    else:
      out = values
  return FlashMask(startend_row_indices=out.astype(np.int32), causal=use_causal)
