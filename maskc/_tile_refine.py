"""Deciding single tiles the whole-tile analysis leaves ambiguous, within a memory budget.

Both lowering paths use these: finer analysis over a tile's sub-rectangles, and,
as a last resort, evaluating the mask on the tile's positions in bounded chunks.
"""

from __future__ import annotations

import numpy as np

from maskc import _ir as ir
from maskc._analysis import EMPTY, FULL, PARTIAL, Analyzer, Tables
from maskc._errors import MaskLimitError
from maskc._evaluate import Env, evaluate_mask
from maskc._tile_geometry import TileGeometry

EVAL_CHUNK = 1 << 18  # elements evaluated at once when refining tiles
PIECE_CHUNK = 1 << 16  # rectangles analysed at once when refining tiles
MEMORY_BUDGET = 256 << 20  # default bytes a lowering may allocate beyond its operands
ITEM_BYTES = 256  # working memory per rectangle analysed at once (intervals, flags, indices)


class Budget:
  """The memory a lowering may use; `charge` raises `MaskLimitError` before going over."""

  def __init__(self, limit: int):
    self.limit = limit

  def charge(self, nbytes: int, what: str) -> None:
    if nbytes > self.limit:
      raise MaskLimitError(
          f"lowering needs about {nbytes / 2**20:,.1f} MiB for {what}, over the memory budget "
          f"of {self.limit / 2**20:,.1f} MiB",
          hint="Use larger tiles (block_q, block_kv), fewer or shorter operand runs, or raise "
               "`memory_budget=` in maskc.compile.")

  def items(self, per_item: int) -> int:
    """How many items of `per_item` bytes fit in the budget (at least 1)."""
    return max(1, self.limit // max(1, per_item))


def evaluate_tiles(m: ir.Mask, geo: TileGeometry, tables: Tables, xp, b, i, j):
  """Exact states of tiles `(b, i, j)` by evaluating them, in chunks."""
  bq, bk = geo.bq, geo.bk
  per_chunk = max(1, EVAL_CHUNK // (bq * bk))
  out = []
  for s in range(0, len(i), per_chunk):
    ii, jj = i[s:s + per_chunk], j[s:s + per_chunk]
    rows = ii[:, None, None] * bq + xp.arange(bq)[None, :, None]
    cols = jj[:, None, None] * bk + xp.arange(bk)[None, None, :]
    valid = (rows < geo.shape.q_len) & (cols < geo.shape.kv_len)
    bb = b[s:s + per_chunk][:, None, None] if not np.isscalar(b) else 0
    q = geo.q_at(bb, xp.minimum(rows, geo.shape.q_len - 1))
    k = geo.k_at(bb, xp.minimum(cols, geo.shape.kv_len - 1))
    v = evaluate_mask(m, Env(xp, q, k, tables.arrays, bb))
    any_ = xp.any(v & valid, axis=(1, 2))
    all_ = xp.all(v | ~valid, axis=(1, 2))
    out.append(xp.where(all_, FULL, xp.where(any_, PARTIAL, EMPTY)).astype(xp.int8))
  return xp.concatenate(out) if out else xp.zeros(0, xp.int8)


def subdivide(m: ir.Mask, geo: TileGeometry, tables: Tables, xp, b, i, j, parts: int):
  """Decides tiles `(b, i, j)` from their `parts × parts` sub-rectangles, without evaluating.

  A sub-rectangle that is FULL (or certainly PARTIAL) witnesses a true
  position, one that is EMPTY (or certainly PARTIAL) a false one. Returns the
  tiles' states and whether each is still ambiguous (no witness of one kind).
  Tiles whose positions are not dense (see `Axis`) are left PARTIAL and ambiguous.
  """
  n = i.shape[0]
  sub = xp.arange(parts)
  bt = b if not np.isscalar(b) else 0
  dense = xp.asarray(geo.dense_q(bt, i)) & xp.asarray(geo.dense_k(bt, j))
  q_shift = geo.q_start(bt, i) - i * geo.bq   # position - row, on dense tiles
  k_shift = geo.k_start(bt, j) - j * geo.bk
  q0 = i * geo.bq
  q_len = xp.minimum(geo.bq, geo.shape.q_len - q0)
  k0 = j * geo.bk
  k_len = xp.minimum(geo.bk, geo.shape.kv_len - k0)
  # sub-rectangle bounds, [n, parts] per axis; empty ones (tile smaller than parts) are dropped
  q_lo = q0[:, None] + (sub[None, :] * q_len[:, None]) // parts
  q_hi = q0[:, None] + ((sub[None, :] + 1) * q_len[:, None]) // parts - 1
  k_lo = k0[:, None] + (sub[None, :] * k_len[:, None]) // parts
  k_hi = k0[:, None] + ((sub[None, :] + 1) * k_len[:, None]) // parts - 1
  shape = (n, parts, parts)
  q_shift = xp.broadcast_to(xp.asarray(q_shift), (n,))[:, None, None]
  k_shift = xp.broadcast_to(xp.asarray(k_shift), (n,))[:, None, None]
  ql = xp.broadcast_to(q_lo[:, :, None], shape) + q_shift
  qh = xp.broadcast_to(q_hi[:, :, None], shape) + q_shift
  kl = xp.broadcast_to(k_lo[:, None, :], shape) + k_shift
  kh = xp.broadcast_to(k_hi[:, None, :], shape) + k_shift
  real = (qh >= ql) & (kh >= kl)
  bb = xp.broadcast_to(b[:, None, None], shape) if not np.isscalar(b) else 0
  t = Analyzer(xp, tables, ql, xp.maximum(qh, ql), kl, xp.maximum(kh, kl), bb,
               geo.pos_ok).truth(m)
  state = xp.broadcast_to(xp.asarray(t.state), shape)
  certain = xp.broadcast_to(xp.asarray(t.certain, bool), shape) & (state == PARTIAL)
  has_true = xp.any(real & ((state == FULL) | certain), axis=(1, 2))
  has_false = xp.any(real & ((state == EMPTY) | certain), axis=(1, 2))
  all_full = xp.all(~real | (state == FULL), axis=(1, 2))
  all_empty = xp.all(~real | (state == EMPTY), axis=(1, 2))
  out = xp.where(all_full, FULL, xp.where(all_empty, EMPTY, PARTIAL)).astype(xp.int8)
  out = xp.where(dense, out, PARTIAL).astype(xp.int8)
  ambiguous = ((out == PARTIAL) & ~(has_true & has_false)) | ~dense
  return out, ambiguous
