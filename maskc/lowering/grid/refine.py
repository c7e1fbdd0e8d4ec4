"""Deciding single tiles the whole-tile analysis leaves ambiguous, within a memory budget.

Both lowering paths use these, in NumPy (static path) or jax.numpy (traced path,
`xp=jnp`): finer analysis over a tile's parts (equal sub-rectangles, or the traced
path's operand pieces), and, as a last resort, evaluating the mask on the tile's
positions in bounded chunks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from maskc.language import ir
from maskc.language.errors import MaskLimitError
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.tuning import EVAL_CHUNK, ITEM_BYTES, NODE_BYTES
from maskc.semantics.evaluate import Env, evaluate_mask
from maskc.semantics.ranges import EMPTY, FULL, PARTIAL, Analyzer, Tables, reduce_many


class Budget:
  """The memory a lowering may use; `charge` raises `MaskLimitError` before going over.

  `held` counts what earlier steps keep alive for later ones (the decided
  rectangles of tiles, say): every later charge and chunk size is net of it, so
  the limit bounds the sum of what lives at once, not each step alone.
  """

  def __init__(self, limit: int) -> None:
    self.limit = limit
    self.held = 0

  def charge(self, nbytes: int, what: str) -> None:
    """Raises unless `nbytes` more than `held` fit in the limit."""
    if self.held + nbytes > self.limit:
      beside = f" beside {self.held / 2**20:,.1f} MiB it holds" if self.held else ""
      raise MaskLimitError(
          f"lowering needs about {nbytes / 2**20:,.1f} MiB for {what}{beside}, over the "
          f"memory budget of {self.limit / 2**20:,.1f} MiB",
          hint="Use larger tiles (block_q, block_kv), fewer or shorter operand runs, or raise "
               "`memory_budget=` in maskc.compile.")

  def hold(self, nbytes: int, what: str) -> None:
    """Charges `nbytes` that stay alive until the lowering ends."""
    self.charge(nbytes, what)
    self.held += nbytes

  def items(self, per_item: int, beside: int = 0) -> int:
    """How many items of `per_item` bytes fit beside `held` and `beside` bytes (at least 1)."""
    return max(1, (self.limit - self.held - beside) // max(1, per_item))


def analysis_bytes(m: ir.Mask) -> int:
  """Working memory per rectangle of one pass of the analysis over `m`, an upper bound.

  The analysis keeps a few arrays per node of the mask (interval ends, flags) until
  the pass ends: measured by tracemalloc at 100-250 bytes per rectangle for masks of
  7-24 nodes, under this bound (`tests/test_memory_budget.py` checks the peaks).
  """
  return ITEM_BYTES + NODE_BYTES * ir.expanded_size(m, 1 << 12)


def part_verdicts(xp: Any, t: Any, real: Any) -> Any:
  """Per tile, from its parts' truths `[n, a, b]` (`real`: which parts exist): (state, mixed).

  A FULL part (or a certain PARTIAL one) witnesses a true position, an EMPTY one a
  false position; a tile with both (`mixed`) is PARTIAL for sure. A tile is FULL
  (EMPTY) when every real part is. One OR-reduction of bit flags per part: one
  pass in NumPy, one kernel under `jit` instead of four.
  """
  shape = real.shape
  state = xp.broadcast_to(xp.asarray(t.state, xp.int8), shape)
  certain = xp.broadcast_to(xp.asarray(t.certain, bool), shape) & (state == PARTIAL)

  def flag(x: Any, bit: Any) -> Any:
    return x.astype(xp.int8) * xp.int8(bit)

  bits = (flag((state == FULL) | certain, 1) | flag((state == EMPTY) | certain, 2) |
          flag(state != FULL, 4) | flag(state != EMPTY, 8))
  bits = xp.bitwise_or.reduce(xp.where(real, bits, xp.int8(0)), axis=(1, 2))
  out = xp.where(bits & 4 == 0, FULL, xp.where(bits & 8 == 0, EMPTY, PARTIAL)).astype(xp.int8)
  return out, bits & 3 == 3


def decide_parts(m: ir.Mask, geo: TileGeometry, tables: Tables, xp: Any, b: Any, ql: Any, qh: Any,
                 kl: Any, kh: Any, *, ok: Any = True, spans: dict[str, int] | None = None,
                 known: dict[Any, Any] | None = None) -> Any:
  """States of tiles from the analysis of their parts, and whether each stays ambiguous.

  Parts are position rectangles `[ql, qh] x [kl, kh]`, arrays broadcastable to
  `[n, a, b]` (tile, q part, k part); a part with `qh < ql` or `kh < kl` does not
  exist. Both kinds of refinement are this: equal sub-rectangles (`subdivide`) and
  the traced path's operand pieces, whose reads are passed in `known` (see
  `Analyzer`). Tiles where `ok` (or `geo.pos_ok`) is False are left PARTIAL and
  ambiguous.

  Args:
    b: batch row of each part (broadcastable) or 0.
    ok: per tile, whether its parts' bounds are its positions (bool or `[n]`).
    spans, known: passed to `Analyzer` (traced path).
  """
  real = (qh >= ql) & (kh >= kl)
  t = Analyzer(xp, tables, ql, xp.maximum(qh, ql), kl, xp.maximum(kh, kl), b, geo.pos_ok,
               spans=spans, known=known).truth(m)
  out, mixed = part_verdicts(xp, t, real)
  if geo.pos_ok is not True:  # positions that left the integer type: the bounds wrapped
    ok = xp.logical_and(ok, geo.pos_ok)
  if ok is True:
    return out, (out == PARTIAL) & ~mixed
  ok = xp.broadcast_to(xp.asarray(ok), out.shape)
  out = xp.where(ok, out, PARTIAL).astype(xp.int8)
  return out, ((out == PARTIAL) & ~mixed) | ~ok


def subdivide(m: ir.Mask, geo: TileGeometry, tables: Tables, xp: Any, b: Any, i: Any, j: Any,
              parts: int, *, spans: bool = False) -> Any:
  """Decides tiles `(b, i, j)` from their `parts × parts` sub-rectangles, without evaluating.

  A sub-rectangle that is FULL (or certainly PARTIAL) witnesses a true
  position, one that is EMPTY (or certainly PARTIAL) a false one. Returns the
  tiles' states and whether each is still ambiguous (no witness of one kind).
  Tiles whose positions are not dense (see `Axis`) are left PARTIAL and ambiguous.

  Args:
    xp: `numpy` (static path) or `jax.numpy` (traced path).
    spans: traced path, default positions only: every sub-rectangle spans at most
      `ceil(block / parts)` tokens per axis, so reads along an axis are read
      directly (`Analyzer(spans=...)`) instead of through range tables.
  """
  n = i.shape[0]
  sub = xp.arange(parts)
  bt = b if not np.isscalar(b) else 0
  dense_q, dense_k = geo.dense_q(bt, i), geo.dense_k(bt, j)
  dense = True if dense_q is True and dense_k is True else (
      xp.asarray(dense_q) & xp.asarray(dense_k))
  q_shift = geo.q_start(bt, i) - i * geo.bq   # position - row, on dense tiles
  k_shift = geo.k_start(bt, j) - j * geo.bk
  q0 = i * geo.bq
  q_len = xp.minimum(geo.bq, geo.shape.q_len - q0)
  k0 = j * geo.bk
  k_len = xp.minimum(geo.bk, geo.shape.kv_len - k0)
  # sub-rectangle bounds, [n, parts] per axis; empty ones (tile smaller than parts) do not exist
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
  bb = xp.broadcast_to(b[:, None, None], shape) if not np.isscalar(b) else 0
  span = {"q": -(-geo.bq // parts), "k": -(-geo.bk // parts)} if spans else None
  return decide_parts(m, geo, tables, xp, bb, ql, qh, kl, kh, ok=dense, spans=span)


def evaluate_tiles(m: ir.Mask, geo: TileGeometry, tables: Tables, xp: Any, b: Any, i: Any, j: Any
    ) -> Any:
  """Exact states of tiles `(b, i, j)` by evaluating them, `EVAL_CHUNK` elements at a time.

  Under `jit` the caller passes one chunk (`len(i) <= EVAL_CHUNK // tile size`),
  which traces one evaluation. Whether a tile has a true and a false element is
  one reduction (`reduce_many`: one kernel under `jit`, not six).
  """
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
    v = xp.asarray(evaluate_mask(m, Env(xp, q, k, tables.reads(), bb)), bool)
    has_true, has_false = reduce_many(xp, [(v & valid, "or"), (~v & valid, "or")], (1, 2))
    out.append(xp.where(~has_false, FULL, xp.where(~has_true, EMPTY, PARTIAL)).astype(xp.int8))
  return xp.concatenate(out) if out else xp.zeros(0, xp.int8)
