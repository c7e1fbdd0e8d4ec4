"""A pairwise operand read through blocks aligned with the tiles: any and all per block, from
one blocked pass over its values.

A pairwise read `a[(q + s) // r, (k + t) // c]` on tiles `block_q x block_kv` whose rows
start where the index does (`(q_offset + s) % r == 0`, `block_q % r == 0`, and the same for
keys) reads one block of `block_q // r` rows by `block_kv // c` columns of `a` per tile. A
rectangle of whole tiles then reads a rectangle of whole blocks, and its verdict follows
from how many of those blocks hold a nonzero (`any`) and how many hold only nonzeros
(`all`): none any, EMPTY; every one all, FULL; otherwise PARTIAL, and certainly mixed.
Those two counts per block come from one pass over the operand's bytes (a sum of
its rows per row block, then of the columns), and two small prefix tables over blocks
answer any rectangle of them at once. Nothing of the size of the operand is allocated: the
2-D prefix counts of the general read (`Tables.prefix`, one int32 per entry: 256 MiB for an
8K x 8K operand) are never built.

A rectangle whose index interval is not whole blocks (a tile split by refinement) gets no
verdict here (PARTIAL, uncertain: sound); refinement then evaluates the tile.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class BlockAxis:
  """The blocks along one axis of a pairwise operand of `length` entries: boundaries at
  `origin + j * size` (one block per tile line), up to `end` (the last index read, plus one).
  Only blocks inside the operand are counted: a read whose index leaves it (a guarded
  read, `k >= P & a[q, k - P]`) reads its clipped ends there, which no block describes."""
  origin: int
  size: int
  end: int
  length: int

  @property
  def first(self) -> int:
    """The first boundary at or after index 0."""
    behind = max(0, -self.origin)  # indices before 0 the first blocks would start at
    return self.origin + -(-behind // self.size) * self.size

  @property
  def stop(self) -> int:
    """One past the last index counted: the end read, inside the operand."""
    return max(self.first, min(self.end, self.length))

  @property
  def count(self) -> int:
    return -(-(self.stop - self.first) // self.size)

  def blocks(self, xp: ModuleType, lo: Any, hi: Any) -> tuple[Any, Any, Any]:
    """`(first block, one past the last, aligned)` of index intervals `[lo, hi]`: aligned where
    the interval is whole blocks inside the operand."""
    start = lo - self.first
    stop = hi + 1 - self.first
    aligned = ((start >= 0) & (start % self.size == 0) & (hi < self.stop) &
               ((stop % self.size == 0) | (hi == self.stop - 1)) & (stop > start))
    u0 = xp.clip(start // self.size, 0, self.count)
    u1 = xp.clip(-(-stop // self.size), 0, self.count)
    return u0, u1, aligned


def block_counts(xp: ModuleType, a: Any, rows: BlockAxis, cols: BlockAxis) -> Any:
  """Nonzeros per block of `a` (`[B, Q, K]`): `[B, rows.count, cols.count]` int32.

  One pass over the operand's values (bytes, for a boolean one): the rows of each row block
  summed, then the columns of each column block of that (a block-th of the size)."""
  a = a[:, rows.first:rows.stop, cols.first:cols.stop]
  nz = a if a.dtype == bool else a != 0
  if xp is np:  # sum the bytes of a boolean array: a pass at memory speed
    nz = nz.view(np.uint8)
  acc = np.uint16 if rows.size < 1 << 16 else np.uint32
  by_rows = _block_sum(xp, nz, 1, rows, acc)
  return _block_sum(xp, by_rows, 2, cols, np.int32)


def _block_sum(xp: ModuleType, a: Any, axis: int, blocks: BlockAxis, dtype: Any) -> Any:
  """`a` summed over each block of `blocks` along `axis` (its whole blocks by a reshape, the
  shorter last one apart)."""
  n = a.shape[axis]
  whole = n // blocks.size * blocks.size
  parts = []
  if whole:
    head = a[:, :whole] if axis == 1 else a[:, :, :whole]
    shape = head.shape[:axis] + (whole // blocks.size, blocks.size) + head.shape[axis + 1:]
    parts.append(head.reshape(shape).sum(axis=axis + 1, dtype=dtype))
  if whole < n:
    tail = a[:, whole:] if axis == 1 else a[:, :, whole:]
    parts.append(tail.sum(axis=axis, keepdims=True, dtype=dtype))
  if not parts:  # no index of this axis inside the operand
    shape = a.shape[:axis] + (0,) + a.shape[axis + 1:]
    return xp.zeros(shape, dtype)
  return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=axis)


class PairBlocks:
  """Block verdicts of one aligned pairwise read: prefix counts, over blocks, of the blocks
  that hold a nonzero and of those that hold only nonzeros.

  Args:
    xp: numpy or jax.numpy.
    a: the operand, `[B', Q, K]` (its own dtype: bool or integers).
    rows, cols: its blocks along each axis (`BlockAxis`).
  """

  def __init__(self, xp: ModuleType, a: Any, rows: BlockAxis, cols: BlockAxis):
    self.xp, self.rows, self.cols = xp, rows, cols
    counts = block_counts(xp, a, rows, cols)
    r = xp.minimum((xp.arange(rows.count) + 1) * rows.size, rows.stop - rows.first) - \
        xp.arange(rows.count) * rows.size
    c = xp.minimum((xp.arange(cols.count) + 1) * cols.size, cols.stop - cols.first) - \
        xp.arange(cols.count) * cols.size
    area = r[:, None] * c[None, :]
    self.counts, self.area = counts, area
    self.any = _prefix2(xp, counts > 0)
    self.all = _prefix2(xp, counts == area)

  def per_tile(self, n_rows: int, n_cols: int) -> bool:
    """Whether block `(i, j)` is exactly what tile `(i, j)` of a grid of `n_rows x n_cols`
    tiles reads: no block skipped before the operand starts, one per tile line."""
    return (self.rows.first == self.rows.origin and self.cols.first == self.cols.origin and
            self.rows.count == n_rows and self.cols.count == n_cols and
            self.rows.end <= self.rows.length and self.cols.end <= self.cols.length)

  def tile_states(self) -> Any:
    """Per block `[B', U, V]` int8: EMPTY (0), PARTIAL (1) or FULL (2), read from its counts:
    the tiles' exact states where `per_tile`."""
    xp = self.xp
    return xp.where(self.counts == 0, 0, xp.where(self.counts == self.area, 2, 1)).astype(
        xp.int8)

  def nbytes(self) -> int:
    return int(self.any.nbytes + self.all.nbytes)

  def verdict(self, b: Any, q_lo: Any, q_hi: Any, k_lo: Any, k_hi: Any) -> tuple[Any, Any]:
    """`(state, certain)` over rectangles of index intervals `[q_lo, q_hi] x [k_lo, k_hi]` of
    batch rows `b`: EMPTY (0) where no block holds a nonzero, FULL (2) where every block holds
    only nonzeros, PARTIAL (1) otherwise, certain (mixed) where the rectangle is whole blocks;
    PARTIAL and uncertain where it is not."""
    xp = self.xp
    u0, u1, q_ok = self.rows.blocks(xp, q_lo, q_hi)
    v0, v1, k_ok = self.cols.blocks(xp, k_lo, k_hi)
    n_any = _rect(self.any, b, u0, u1, v0, v1)
    n_all = _rect(self.all, b, u0, u1, v0, v1)
    aligned = q_ok & k_ok
    state = xp.where(n_any == 0, 0, xp.where(n_all == (u1 - u0) * (v1 - v0), 2, 1))
    return xp.where(aligned, state, 1).astype(xp.int8), aligned


def _prefix2(xp: ModuleType, flags: Any) -> Any:
  """2-D prefix counts of `flags` (`[B, U, V]`): `[B, U + 1, V + 1]` int32."""
  c = xp.cumsum(xp.cumsum(flags.astype(xp.int32), axis=1), axis=2)
  return xp.pad(c, [(0, 0), (1, 0), (1, 0)])


def _rect(p: Any, b: Any, u0: Any, u1: Any, v0: Any, v1: Any) -> Any:
  return p[b, u1, v1] - p[b, u0, v1] - p[b, u1, v0] + p[b, u0, v0]
