"""The dynamic lowering path: traced operands or offset, under `jit`.

The same range analysis as the static path, over the whole tile grid in
jax.numpy, with shapes from the lengths and tile sizes only. Ambiguous PARTIAL
tiles are refined in rounds of a fixed number of tiles inside a `while_loop`, so
the cost follows their number; `refine_budget` caps it, leaving any beyond
PARTIAL (sound).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maskc import _ir as ir
from maskc._analysis import PARTIAL, Analyzer, Tables
from maskc._bind import Shape
from maskc._tile_geometry import TileGeometry
from maskc._tile_refine import (EVAL_CHUNK, ITEM_BYTES, MEMORY_BUDGET, PIECE_CHUNK,
                                 Budget, evaluate_tiles, subdivide)
from maskc._tiles import runs_from_grid


def _dynamic_grid(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None, refine: bool,
                  budget: int | None, memory: Budget):
  nb = batch or 1
  memory.charge(nb * geo.nq * geo.nk * ITEM_BYTES, "the traced analysis of the tile grid")
  i = jnp.arange(geo.nq)[None, :, None]
  j = jnp.arange(geo.nk)[None, None, :]
  q_lo = i * geo.bq + geo.shape.q_offset
  q_hi = jnp.minimum((i + 1) * geo.bq, geo.shape.q_len) - 1 + geo.shape.q_offset
  k_lo = j * geo.bk
  k_hi = jnp.minimum((j + 1) * geo.bk, geo.shape.kv_len) - 1
  dense = True
  if geo.qa is not None:  # explicit positions: per-tile hulls, `[B', nq, 1]`
    q_lo, q_hi = geo.qa.tmin[:, :, None], geo.qa.tmax[:, :, None]
    dense = geo.qa.dense_tiles[:, :, None]
  if geo.ka is not None:
    k_lo, k_hi = geo.ka.tmin[:, None, :], geo.ka.tmax[:, None, :]
    dense = dense & geo.ka.dense_tiles[:, None, :]
  b = jnp.arange(nb)[:, None, None] if batch else 0
  t = Analyzer(jnp, tables, q_lo, q_hi, k_lo, k_hi, b, geo.pos_ok).truth(m)
  full_shape = (nb, geo.nq, geo.nk)
  state = jnp.broadcast_to(jnp.asarray(t.state, jnp.int8), full_shape)
  if not refine:
    return state
  certain = jnp.broadcast_to(jnp.asarray(t.certain, bool) & dense, full_shape)
  ambiguous = ((state == PARTIAL) & ~certain).reshape(-1)
  total = ambiguous.size
  tiles = geo.nq * geo.nk

  def coords(idx):
    tb, rest = jnp.divmod(idx, tiles)
    ti, tj = jnp.divmod(rest, geo.nk)
    return (tb if batch else 0), ti, tj

  def rounds(decide, chunk, budget_tiles):
    """Applies `decide` to the ambiguous tiles, `chunk` at a time, in a while_loop."""
    chunk = max(1, min(total, chunk))
    limit = -(-total // chunk) if budget_tiles is None else max(0, -(-int(budget_tiles) // chunk))

    def body(carry):
      flat_state, todo, left, n = carry
      (idx,) = jnp.nonzero(todo, size=chunk, fill_value=total)
      valid = idx < total
      new, unresolved = decide(*coords(jnp.where(valid, idx, 0)))
      # Padding entries carry the out-of-bounds index `total` and are dropped: writing
      # them to a real tile would put its old value back over the real update.
      flat_state = flat_state.at[idx].set(new.astype(flat_state.dtype), mode="drop")
      todo = todo.at[idx].set(False, mode="drop")
      left = left.at[idx].set(unresolved, mode="drop")
      return flat_state, todo, left, n + 1

    def more(carry):
      return jnp.logical_and(carry[1].any(), carry[3] < limit)

    return body, more

  def by_analysis(b, i, j):
    out, amb = subdivide(m, geo, tables, jnp, b, i, j, 4)
    if max(geo.bq, geo.bk) >= 16:
      out16, amb16 = subdivide(m, geo, tables, jnp, b, i, j, 16)
      out = jnp.where(amb, out16, out)
      amb = amb & amb16
    return out, amb

  def by_evaluation(b, i, j):
    return evaluate_tiles(m, geo, tables, jnp, b, i, j), jnp.zeros(i.shape, bool)

  flat = state.reshape(-1)
  none_left = jnp.zeros_like(ambiguous)
  # Cost follows the number of ambiguous tiles: finer analysis first, then evaluation.
  body, more = rounds(by_analysis, max(1, min(PIECE_CHUNK, memory.items(ITEM_BYTES)) // 256),
                     None)
  flat, _, left, _ = jax.lax.while_loop(more, body, (flat, ambiguous, none_left, 0))
  body, more = rounds(by_evaluation, EVAL_CHUNK // (geo.bq * geo.bk), budget)
  flat, _, _, _ = jax.lax.while_loop(more, body, (flat, left, none_left, 0))
  return flat.reshape(full_shape)


def compile_dynamic(masks, shape: Shape, operands: dict, batch: int | None, block_q: int,
                    block_kv: int, refine: list[bool], budget: int | None,
                    memory: Budget | None = None):
  """Per-q-tile and per-key-tile runs `[B, U, n, R]` of the masks, traced."""
  geo = TileGeometry(shape, block_q, block_kv, xp=jnp)
  memory = memory or Budget(MEMORY_BUDGET)
  tables = Tables(jnp, operands)
  for name, a in operands.items():
    if a.ndim == 2:  # per-token: sparse tables of log2(L) levels
      memory.charge(a.size * 8 * max(1, a.shape[-1].bit_length()), f"the tables of `{name}`")
  grid = jnp.stack([_dynamic_grid(m, geo, tables, batch, ref, budget, memory)
                    for m, ref in zip(masks, refine)], axis=1)
  return runs_from_grid(jnp, grid), runs_from_grid(jnp, jnp.swapaxes(grid, -1, -2))
