"""Deciding tiles PARTIAL in two parts of an `&` / `|` by a few sampled pairs, and reading
operands for them through their runs.

Where both parts are exactly mixed in a tile, one sampled pair of the other value proves
the whole mask PARTIAL there, with no analysis (`sampled_mixed`). Also the operand
reads (`Tables.reads`) evaluate those pairs without writing an operand out.
"""

from __future__ import annotations

import numpy as np

from maskc.language import ir
from maskc.lowering.grid.forms import Array
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget
from maskc.lowering.tuning import NODE_BYTES, SAMPLE_BYTES, SAMPLE_CHUNK, SAMPLE_GROUP
from maskc.semantics.evaluate import Env, evaluate_mask
from maskc.semantics.ranges import Tables


def _tile_corners(geo: TileGeometry, i: Array, j: Array) -> tuple[Array, Array, Array, Array]:
  """The first and last row and column `(r0, r1, c0, c1)` of tiles `(i, j)`."""
  r0, c0 = i * geo.bq, j * geo.bk
  return (r0, np.minimum(r0 + geo.bq, geo.shape.q_len) - 1, c0,
          np.minimum(c0 + geo.bk, geo.shape.kv_len) - 1)


def diagonal_pairs(geo: TileGeometry, i: Array, j: Array) -> tuple[Array, Array, Array]:
  """`(row, column, on)`: the first pair `q == k` of each tile `(i, j)` and whether the
  diagonal crosses it at all (consecutive positions only: `geo.positions` is False)."""
  r0, r1, c0, c1 = _tile_corners(geo, i, j)
  off = geo.shape.q_offset
  p = np.maximum(r0 + off, c0)
  return p - off, p, p <= np.minimum(r1 + off, c1)


def sampled_mixed(m: ir.Mask, geo: TileGeometry, tables: Tables, b: Array | int, i: Array,
                  j: Array, union: bool, budget: Budget) -> Array:
  """Which tiles `(b, i, j)`, PARTIAL in two exactly mixed parts, hold a true pair of the
  `&` of them (a false one of the `|`) among a few sampled pairs: then the tile is mixed.

  Both parts mixed put a false pair in the `&` (a true one in the `|`): one sampled
  pair of the other value decides the tile PARTIAL, with no pieces and no analysis
  of sub-rectangles. Without explicit positions, the first sample of an `&` is where
  the tile's rows and columns meet on the diagonal `q == k`, true for `causal &
  document(seg)`'s diagonal tiles, the common case (thousands of them for short
  documents); then the corners of the tiles not decided yet. An `|` samples
  the corners first: a band in it (`causal & chunk(8192) | bidirectional(img)`)
  holds on the diagonal, its false pairs lie at corners off it. Pairs are
  evaluated with operands read without writing them out (`Tables.reads`), a bounded
  chunk of tiles at a time.
  """
  per_tile = SAMPLE_BYTES + SAMPLE_GROUP * NODE_BYTES * ir.expanded_size(m, 1 << 12)
  chunk = max(1, min(SAMPLE_CHUNK, budget.items(per_tile)))
  budget.charge(min(i.size, chunk) * per_tile, "sampling pairs of tiles")
  out = [_sampled_chunk(m, geo, tables, b if isinstance(b, (int, np.integer)) else b[s:s + chunk],
                        i[s:s + chunk], j[s:s + chunk], union)
         for s in range(0, i.size, chunk)]
  return np.concatenate(out) if out else np.zeros(0, bool)


def _sampled_chunk(m: ir.Mask, geo: TileGeometry, tables: Tables, b: Array | int, i: Array,
                   j: Array, union: bool) -> Array:
  """`sampled_mixed` of one chunk."""
  r0, r1, c0, c1 = _tile_corners(geo, i, j)
  samples = [(r0, c0), (r0, c1), (r1, c0), (r1, c1)]
  if not geo.positions:
    row, col, on = diagonal_pairs(geo, i, j)
    diagonal = (np.where(on, row, r0), np.where(on, col, c0))
    samples = samples + [diagonal] if union else [diagonal] + samples
  reads = tables.reads()
  proved = np.zeros(i.shape, bool)
  split = SAMPLE_GROUP if union else 1
  for group in (samples[:split], samples[split:]):
    todo = np.flatnonzero(~proved)
    if not (todo.size and group):
      break
    rows = np.concatenate([r[todo] for r, _ in group])
    cols = np.concatenate([c[todo] for _, c in group])
    bb = b if isinstance(b, (int, np.integer)) else np.tile(b[todo], len(group))
    v = evaluate_mask(m, Env(np, geo.q_at(bb, rows), geo.k_at(bb, cols), reads, bb))
    proof = ~v if union else v
    proved[todo] = proof.reshape(len(group), todo.size).any(axis=0)
  return proved
