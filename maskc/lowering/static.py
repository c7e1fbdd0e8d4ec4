"""The static lowering path: every operand a NumPy value.

Five ways to the same runs, chosen per mask:

- A mask without operands that has a *diagonal period* (`causal`, `sliding(w)`,
  `chunk(n)`, `(q - k) % 4 == 0`: see `maskc.analysis.diagonal_period`) has the same tile
  states one period further down the diagonal. One period of rows is classified,
  over a grid moved along the diagonal so that it reaches every column the
  repeats need, and repeated; the same for columns. Cost: one period plus the
  output.
- A mask that reads one position only (`g[k]`, `valid[k] & k < n`, `sink(4)`)
  has the same state in every tile across its axis: one line of tiles decides
  it. Cost: the tiles of one axis plus the output.
- `x[q + s] == x[k + t]` where each value of x is one run (sorted documents;
  `bidirectional(img)`): each line's tiles follow from binary searches over the
  runs the lines read (`maskc.lowering.closed_forms.equal_reads`). Cost: the lines plus the output.
- An `&` or `|` whose operand-free items have such a period, some of whose items
  read one position only, or are lowered in parts themselves
  (`causal & chunk(8192) | bidirectional(img)`, `local(64, 64) | g[q] | g[k]`):
  the parts are lowered apart, each its own way, and their runs combined; a part
  of `k` alone is spliced into each row's runs where they meet it, never written
  out for every row. Only tiles where two parts are PARTIAL are decided again,
  for the whole mask.
- Any other mask: rectangles of tiles are classified by range analysis and the
  PARTIAL ones split in two dimensions, first where an operand changes (between
  such cuts every read is constant, so the analysis is as sharp as without
  operands), then in halves, until each is decided, a single tile, or a strip of
  tiles the operand pieces prove PARTIAL throughout. Cost: the tiles on the
  mask's boundary plus the operand runs, times a logarithm.

None allocates the tile grid or any `q_len × kv_len` array. The decided
rectangles give the per-q-tile runs at once and the per-key-tile runs for the
backward pass on demand.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple, cast

import numpy as np

from maskc.analysis.diagonal_period import diagonal_period
from maskc.analysis.diagonal_truth import true_on_diagonal
from maskc.analysis.linear import exact_band
from maskc.arrays.ragged import ranges
from maskc.compiled.tiles import Runs
from maskc.language import ir
from maskc.lowering.closed_forms.axis_reads import bare_reads_only, read_tile_states
from maskc.lowering.closed_forms.band_runs import (
  BandRuns,
  Intervals,
  band_fits,
  clipped_pieces,
  keyed_band_runs,
  met_bounds_pieces,
)
from maskc.lowering.closed_forms.equal_reads import (
  equal_read_bounds,
  equal_read_runs,
  equal_reads_where,
  unique_runs,
)
from maskc.lowering.closed_forms.pattern_lines import spliced_pattern
from maskc.lowering.closed_forms.tile_cover import tile_cover
from maskc.lowering.closed_forms.widened_band import widened_bounds
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget, analysis_bytes, evaluate_tiles, subdivide
from maskc.lowering.grid.run_lists import (
  FlatRuns,
  LineRuns,
  expand_in_order,
  expand_leaves,
  interleaved,
  keyed,
  lines_of,
  marked,
  meeting_mask,
  merge_keyed,
  merge_runs,
  on_lines,
  on_lines_mask,
  overlapping,
  pack_keyed,
  pack_runs,
  split_keys,
  stack_runs,
  unpacked,
)
from maskc.lowering.rules import enabled, took
from maskc.lowering.tuning import (
  COMBINE_CHUNK,
  COMBINE_RUN_BYTES,
  DECIDED_TILE_BYTES,
  EVAL_CHUNK,
  EXPANDED_RUN_BYTES,
  FEW_RECTS,
  LEAF_CHUNK,
  MEMORY_BUDGET,
  MET_LINE_BYTES,
  MIN_ROUND,
  NODE_BYTES,
  PIECE_BYTES,
  PIECE_CHUNK,
  RECT_BYTES,
  SAMPLE_BYTES,
  SAMPLE_CHUNK,
  SAMPLE_GROUP,
  SIDE_PARTS,
  SMALL_COVER,
  SPLICE_SORTED_AFTER,
  STRIP_PARTS,
  WAITING_PIECE_BYTES,
  WHOLE_AFTER,
)
from maskc.semantics.bind import Shape
from maskc.semantics.evaluate import Env, evaluate_mask
from maskc.semantics.operand_runs import Pieces, RunForm, RunTable, line_pieces, reads_at
from maskc.semantics.ranges import EMPTY, FULL, PARTIAL, Analyzer, Tables


def _combine_pieces(item, n_items: int, state, certain):
  """Per item, from its pieces' states: (state, has a true and a false position in every tile).

  Also returns whether each item holds a true and a false position somewhere
  (`mixed`), which decides single tiles.
  """
  state = np.broadcast_to(np.asarray(state, np.int8), item.shape)
  certain = np.broadcast_to(np.asarray(certain, bool), item.shape) & (state == PARTIAL)
  count = np.bincount(item, minlength=n_items)
  full = np.bincount(item, weights=state == FULL, minlength=n_items)
  empty = np.bincount(item, weights=state == EMPTY, minlength=n_items)
  sure = np.bincount(item, weights=certain, minlength=n_items)
  out = np.where(full == count, FULL, np.where(empty == count, EMPTY, PARTIAL)).astype(np.int8)
  # A piece spans its item's whole run along the other axis: a FULL piece puts a
  # true position in every tile of the run, an EMPTY piece a false one.
  uniform = (full > 0) & (empty > 0)
  mixed = (full + sure > 0) & (empty + sure > 0)
  return out, uniform, mixed


def _decide_by_pieces(m: ir.Mask, geo: TileGeometry, tables: Tables, b, i, j, pieces, nb: int):
  """States of tiles `(b, i, j)` from their operand pieces; and whether each stays ambiguous."""
  row_pieces, col_pieces = pieces
  bb = b if not np.isscalar(b) else np.zeros_like(i)
  fq, fk = bb * geo.nq + i, bb * geo.nk + j
  item, qlo, qhi = row_pieces.expand(fq)
  nk = col_pieces.count[fk][item]
  item2 = np.repeat(item, nk)
  offset = np.arange(item2.size) - np.repeat(np.cumsum(nk) - nk, nk)
  kp = col_pieces.first[fk][item2] + offset
  ql, qh = np.repeat(qlo, nk), np.repeat(qhi, nk)
  t = Analyzer(np, tables, ql, qh, col_pieces.lo[kp], col_pieces.hi[kp],
               bb[item2] if nb > 1 else 0).truth(m)
  out, _, mixed = _combine_pieces(item2, i.size, t.state, t.certain)
  dense = np.asarray(geo.dense_q(bb, i)) & np.asarray(geo.dense_k(bb, j))
  out = np.where(dense, out, PARTIAL).astype(np.int8)
  return out, ((out == PARTIAL) & ~mixed) | ~dense


def _decide_tiles(m: ir.Mask, geo: TileGeometry, tables: Tables, b, i, j, budget: Budget,
                  pieces=None, nb: int = 1, evaluate: bool = True, beside: int = 0):
  """Exact states of ambiguous tiles: by finer analysis where it suffices, else by evaluation.

  Finer analysis first cuts tiles at their operands' changes (exact for prelude
  masks), then into 4 x 4 and 16 x 16 sub-rectangles; tiles still undecided are
  evaluated. Every step works in chunks that fit the memory budget beside `beside`
  bytes the caller holds. Without `evaluate`, only the pieces: tiles they leave
  undecided stay PARTIAL.
  """
  out = np.full(i.shape, PARTIAL, np.int8)
  todo = np.ones(i.shape, bool)
  chunk_items = min(PIECE_CHUNK, budget.items(analysis_bytes(m) + PIECE_BYTES, beside))
  if pieces is not None:
    per_tile = max(1, int(pieces[0].count.max()) * int(pieces[1].count.max()))
    step = max(1, chunk_items // per_tile)
    for s0 in range(0, i.size, step):
      sl = slice(s0, s0 + step)
      state, ambiguous = _decide_by_pieces(m, geo, tables, b[sl] if not np.isscalar(b) else 0,
                                           i[sl], j[sl], pieces, nb)
      out[sl] = state
      todo[sl] = ambiguous
  for parts in (4, 16):
    if not evaluate or not todo.any() or parts > max(geo.bq, geo.bk):
      break
    idx = np.flatnonzero(todo)
    step = max(1, chunk_items // (parts * parts))
    for s0 in range(0, idx.size, step):
      sub = idx[s0:s0 + step]
      bb = b[sub] if not np.isscalar(b) else 0
      state, ambiguous = subdivide(m, geo, tables, np, bb, i[sub], j[sub], parts)
      out[sub] = state
      todo[sub] = ambiguous
  idx = np.flatnonzero(todo)
  if idx.size and evaluate:
    budget.charge(min(EVAL_CHUNK, geo.bq * geo.bk) * 64, "evaluating a tile")
    out[idx] = evaluate_tiles(m, geo, tables, np, b[idx] if not np.isscalar(b) else 0, i[idx],
                               j[idx])
  return out


def _leaves(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None, budget: Budget,
            pieces: tuple[Pieces, Pieces] | None, hints: tuple[_Hints, _Hints],
            start: tuple[np.ndarray, ...] | None = None):
  """The non-EMPTY decided rectangles of tiles `(b, i0, i1, j0, j1, state, ambiguous)`.

  With the EMPTY ones left out, they tile the grid (or the rectangles
  `start = (b, i0, i1, j0, j1)` when given).

  Each batch row starts as one rectangle of the whole grid; PARTIAL rectangles
  are split, a bounded chunk at a time, until each is decided, a single tile, or
  a strip that the pieces prove PARTIAL in every tile. Splits go first to the
  `hints` (tile boundaries where an operand changes: between them every operand
  read along the axis is constant, so the analysis is as sharp as for a mask
  without operands), then halve both sides. The work follows the tiles on the
  mask's boundary, and the leaves serve the forward and the backward runs alike.

  A strip one tile high (wide) whose row (column) is cut by its operands is
  analysed piece by piece: all pieces FULL or EMPTY decide it; a FULL and an
  EMPTY piece put a true and a false position in every one of its tiles, which
  makes every tile PARTIAL with no further split.
  """
  nb = batch or 1
  work = analysis_bytes(m)
  per_rect, per_piece = work + RECT_BYTES, work + PIECE_BYTES
  zeros = np.zeros(nb, np.int64)
  pending = [start or (np.arange(nb, dtype=np.int64), zeros, zeros + geo.nq, zeros, zeros + geo.nk)]
  done = []
  held = _nbytes(pending[0])  # what `pending` and `done` hold
  while pending:
    rect = pending.pop()
    if not rect[0].size:
      continue
    # a round has room for `MIN_ROUND` rectangles, or the budget is over: rounds of a few
    # would crawl through the rest of the work only to fail later
    chunk = max(min(LEAF_CHUNK, budget.items(per_rect, held)), MIN_ROUND)
    if rect[0].size > chunk:  # split the work, not the rectangles: bounded memory per step
      pending.append(tuple(x[chunk:] for x in rect))
      rect = tuple(x[:chunk] for x in rect)
    budget.charge(held + rect[0].size * per_rect, "analysing rectangles of tiles")
    b, i0, i1, j0, j1 = rect
    ql, qh = geo.q_bounds(i0, i1, b)
    kl, kh = geo.k_bounds(j0, j1, b)
    t = Analyzer(np, tables, ql, qh, kl, kh, b if batch else 0).truth(m)
    state = np.array(np.broadcast_to(np.asarray(t.state, np.int8), b.shape))
    certain = np.array(np.broadcast_to(np.asarray(t.certain, bool), b.shape))
    tall, wide = i1 - i0, j1 - j0
    uniform = np.zeros(b.shape, bool)
    for along_rows in (True, False):
      if pieces is None or not pieces[0 if along_rows else 1].cut:
        continue
      line_pieces_ = pieces[0 if along_rows else 1]
      line, n_lines = (i0, geo.nq) if along_rows else (j0, geo.nk)
      thin = (tall if along_rows else wide) == 1
      sel = np.flatnonzero((state == PARTIAL) & thin &
                           (line_pieces_.count[b * n_lines + line] > 1))
      if not sel.size:
        continue
      max_pieces = budget.items(per_piece, held + rect[0].size * RECT_BYTES)
      st, uni, mixed = _strip_pieces(m, geo, tables, batch, along_rows, line_pieces_, b[sel],
                                     i0[sel], i1[sel], j0[sel], j1[sel], max_pieces)
      dense = np.asarray(geo.dense_q(b[sel], i0[sel]) if along_rows else
                         geo.dense_k(b[sel], j0[sel]), bool)
      state[sel] = st
      uniform[sel] |= uni & dense & (st == PARTIAL)
      certain[sel] |= mixed & dense
    single = (tall == 1) & (wide == 1)
    if geo.positions:  # certainty needs real positions: dense tiles
      certain &= np.asarray(geo.dense_q(b, i0), bool) & np.asarray(geo.dense_k(b, j0), bool)
    fin = (state != PARTIAL) | single | uniform
    kept = fin & (state != EMPTY)  # EMPTY leaves hold no runs: only counted
    done.append(tuple(x[kept] for x in (b, i0, i1, j0, j1, state)) +
                ((state[kept] == PARTIAL) & ~certain[kept] & ~uniform[kept],))
    held += _nbytes(done[-1])
    split = ~fin
    if split.any():
      pending.append(_split(tuple(x[split] for x in rect), hints, geo.nq, geo.nk))
      held += _nbytes(pending[-1])
    held -= _nbytes(rect)
  if not done:
    return [np.zeros(0, np.int64)] * 5 + [np.zeros(0, np.int8), np.zeros(0, bool)]
  budget.charge(2 * held, "the decided rectangles of tiles")  # the parts and their concatenation
  return [np.concatenate(x) for x in zip(*done)]


def _nbytes(arrays) -> int:
  return sum(x.nbytes for x in arrays)


def _hold_leaves(leaves, budget: Budget):
  """`leaves`, held in `budget` for as long as the lowering keeps them."""
  budget.hold(_nbytes(leaves), "the decided rectangles of tiles")
  return leaves


def _split(rect, hints: tuple[_Hints, _Hints], nq: int, nk: int):
  """Children of rectangles: each side with hints cut at its median hint, the other sides
  halved when the rectangle has no hints at all.

  Both sides are cut at once, so a sorted operand's off-diagonal quarters are
  decided (EMPTY) a level after they appear: the work follows the tiles on the
  mask's boundary times a logarithm. (Cutting at every hint at once makes
  rectangles of cells that are mostly off the diagonal: four times the work for
  many short documents, for a few rounds less.)

  A strip one tile thick and at least `STRIP_PARTS` long, without hints, is cut
  into `STRIP_PARTS` equal parts instead: a boundary crosses it at few places,
  so most parts are decided at once, and the rounds (each a pass of the analysis
  over the mask) drop by a factor of three. `causal`'s period, one row of tiles
  over every column, takes 6 rounds instead of 14 at 1M tokens.

  In a round of at most `FEW_RECTS` rectangles, whose cost is mostly fixed,
  rectangles without hints are cut into `SIDE_PARTS` x `SIDE_PARTS` instead of
  halved: a boundary is followed down to single tiles in half the rounds, for
  more rectangles analysed per round (`causal & chunk(8192)`'s period at 1M
  tokens, 64 rows of tiles by 16K columns: 7 rounds instead of 11).
  """
  b, i0, i1, j0, j1 = rect
  cut_q, n_q = _median_hint(hints[0], b, i0, i1, nq)
  cut_k, n_k = _median_hint(hints[1], b, j0, j1, nk)
  hinted = (n_q > 0) | (n_k > 0)
  tall, wide = i1 - i0, j1 - j0
  strip = ~hinted & ((tall == 1) ^ (wide == 1)) & (np.maximum(tall, wide) >= STRIP_PARTS)
  if strip.any():
    rest = ~strip
    others = tuple(x[rest] for x in rect)
    return tuple(np.concatenate(x) for x in zip(
        _split(others, hints, nq, nk) if rest.any() else others,
        _cut_strips(tuple(x[strip] for x in rect), STRIP_PARTS)))
  ways = SIDE_PARTS if b.size <= FEW_RECTS else 2
  q = _side_cuts(i0, i1, cut_q, n_q > 0, ~hinted, ways)
  k = _side_cuts(j0, j1, cut_k, n_k > 0, ~hinted, ways)
  # every combination of the sides' parts; empty parts (no cut there) are dropped
  parts = [(b, q[u], q[u + 1], k[v], k[v + 1]) for u in range(ways) for v in range(ways)]
  out = [np.concatenate(x) for x in zip(*parts)]
  keep = (out[2] > out[1]) & (out[4] > out[3])
  return tuple(x[keep] for x in out)


def _side_cuts(lo, hi, hint, hinted, free, ways: int):
  """`ways + 1` cut points of each side: `lo, hint, ..., hint, hi` where it has a hint, `ways`
  equal parts where the rectangle has no hints, else the side whole (repeated cuts make
  empty parts)."""
  t = np.arange(ways + 1)[:, None]
  equal = lo + (hi - lo) * t // ways
  at_hint = np.where(t == 0, lo, np.where(t == ways, hi, hint))
  whole = np.where(t == 0, lo, hi)
  return np.where(hinted, at_hint, np.where(free, equal, whole))


def _cut_strips(rect, parts: int):
  """Strips of tiles one tile thick, each cut along its length into `parts` equal parts."""
  b, i0, i1, j0, j1 = rect
  rows = i1 - i0 > 1  # a column of tiles: cut its rows
  lo, hi = np.where(rows, i0, j0), np.where(rows, i1, j1)
  cuts = lo + (hi - lo) * np.arange(parts + 1)[:, None] // parts
  a, z = cuts[:-1].reshape(-1), cuts[1:].reshape(-1)
  rows, b, i0, i1, j0, j1 = (np.tile(x, parts) for x in (rows, b, i0, i1, j0, j1))
  return (b, np.where(rows, a, i0), np.where(rows, z, i1), np.where(rows, j0, a),
          np.where(rows, j1, z))


def _median_hint(hints: _Hints, b, lo, hi, n: int):
  """The median hint strictly inside `(lo, hi)` of batch row `b`, and how many there are."""
  if not hints.at.size:
    return hi, np.zeros(b.shape, np.int64)
  base = b * (n + 1)
  first = hints.upto[base + lo]     # hints at or before lo
  last = hints.upto[base + hi - 1]  # hints before hi (hi > lo >= 0)
  count = last - first
  mid = hints.at[np.clip((first + last) // 2, 0, hints.at.size - 1)] - base
  return np.where(count > 0, mid, hi), count


class _Hints(NamedTuple):
  """Sorted flat tile boundaries `b * (n + 1) + t` (`at`), and how many lie at or before
  each boundary (`upto`, `[nb * (n + 1)]`): counting them is a gather, not a search."""
  at: np.ndarray
  upto: np.ndarray

  @classmethod
  def of(cls, bounds: np.ndarray, size: int) -> _Hints:
    """From flat boundaries (in `[0, size)`, repeats allowed)."""
    marked = np.bincount(bounds, minlength=size).astype(bool)
    return cls(np.flatnonzero(marked), np.cumsum(marked, dtype=np.int32))


NO_HINTS = _Hints(np.zeros(0, np.int64), np.zeros(0, np.int32))


def _split_hints(m: ir.Mask, geo: TileGeometry, tables: Tables, nb: int, along_rows: bool,
                 budget: Budget) -> _Hints:
  """The flat tile boundaries `b * (n + 1) + t` where an operand read along the axis changes.

  A change at a tile's first row gives the boundary before it; one inside a tile
  the boundaries on both sides, so that the tile becomes a strip of its own. None
  for an axis with explicit positions (the reads change in position space there).
  """
  axis_pos = geo.qa if along_rows else geo.ka
  n, block = (geo.nq, geo.bq) if along_rows else (geo.nk, geo.bk)
  length = geo.shape.q_len if along_rows else geo.shape.kv_len
  origin = geo.shape.q_offset if along_rows else 0
  reads = reads_at(m, "q" if along_rows else "k")
  if axis_pos is not None or not reads:
    return NO_HINTS
  budget.charge(nb * (n + 1) * 12, "the operand changes' tile boundaries")
  out = []
  for name, shift in reads:
    t = tables.run_table(name)
    budget.charge(t.starts.size * 8 * (4 + (nb if t.batch == 1 else 1)),
                  f"the changes of operand `{name}`")
    row = t.starts // t.length
    rows = t.starts - row * t.length - shift - origin  # the row (column) reading the change
    keep = (rows > 0) & (rows < length) & (t.starts % t.length != 0)
    row, rows = row[keep], rows[keep]
    tile, inside = rows // block, rows % block != 0
    bounds = np.concatenate([tile, (tile + 1)[inside]])
    owner = np.concatenate([row, row[inside]])
    if t.batch == 1 and nb > 1:
      owner = np.repeat(np.arange(nb, dtype=np.int64), bounds.size)
      bounds = np.tile(bounds, nb)
    out.append(owner * (n + 1) + bounds)
  return _Hints.of(np.concatenate(out), nb * (n + 1))


def _strip_pieces(m, geo: TileGeometry, tables: Tables, batch, along_rows: bool, pieces: Pieces,
                  b, i0, i1, j0, j1, max_pieces: int):
  """(state, uniform, mixed) of strips one tile thick, from the pieces of their line, with at
  most about `max_pieces` pieces analysed at once."""
  n_lines = geo.nq if along_rows else geo.nk
  line = i0 if along_rows else j0
  flat = b * n_lines + line
  ends = np.cumsum(pieces.count[flat])
  out = []
  s0 = 0
  while s0 < flat.size:  # strips of at most `max_pieces` pieces (at least one strip)
    before = ends[s0 - 1] if s0 else 0  # pieces of the strips before s0
    s1 = max(s0 + 1, int(np.searchsorted(ends, before + max_pieces, "right")))
    sl = slice(s0, s1)
    item, plo, phi = pieces.expand(flat[sl])
    if along_rows:
      kl, kh = geo.k_bounds(j0[sl][item], j1[sl][item], b[sl][item])
      ql, qh = plo, phi
    else:
      ql, qh = geo.q_bounds(i0[sl][item], i1[sl][item], b[sl][item])
      kl, kh = plo, phi
    t = Analyzer(np, tables, ql, qh, kl, kh, b[sl][item] if batch else 0).truth(m)
    out.append(_combine_pieces(item, s1 - s0, t.state, t.certain))
    s0 = s1
  return tuple(np.concatenate(x) for x in zip(*out)) if len(out) > 1 else out[0]


class _StaticRuns:
  """The runs of one mask along rows now and along columns on demand, from one set of leaves.

  Backward passes need the per-key-tile runs; a forward-only user never pays for
  packing them. Ambiguous single tiles are decided once, for both.
  """

  def __init__(self, m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None,
               refine: bool, budget: Budget | None = None):
    self.m, self.geo, self.batch = m, geo, batch
    self.budget = budget or Budget(MEMORY_BUDGET)
    nb = batch or 1
    self.pieces = _line_pieces(m, geo, tables, batch, self.budget)
    hints = (_split_hints(m, geo, tables, nb, True, self.budget),
             _split_hints(m, geo, tables, nb, False, self.budget))
    # the analysis starts from the rectangles where the operands allow true positions
    start = tile_cover(m, geo, tables, nb, self.budget) if enabled("tile_cover") else None
    if start is not None:
      took("tile_cover")
      start = _small_as_tiles(start)
    self.leaves = _hold_leaves(_decided_leaves(m, geo, tables, batch, refine, self.budget,
                                               self.pieces, hints, start), self.budget)

  def merged(self, along_rows: bool) -> LineRuns:
    """The runs as sorted, merged `(b, line, a, z, state)` arrays."""
    _, i0, i1, j0, j1, _ = self.leaves
    runs = int(((i1 - i0) if along_rows else (j1 - j0)).sum())
    # the leaves sorted (a copy), their runs, and the runs sorted (a copy and the order)
    self.budget.charge(_nbytes(self.leaves) + runs * EXPANDED_RUN_BYTES, "the packed runs")
    n_lines = self.geo.nq if along_rows else self.geo.nk
    return merge_runs(*expand_in_order(self.leaves, along_rows, n_lines), in_order=True)

  def runs(self, along_rows: bool) -> Runs:
    return pack_runs(*self.merged(along_rows), self.batch or 1,
                     self.geo.nq if along_rows else self.geo.nk)


def _small_as_tiles(rects):
  """Rectangles `(b, i0, i1, j0, j1)` with the small ones cut into their single tiles.

  Many short documents cover a thin band of one to three tiles per row: rounds of
  halving would reach their single tiles anyway, one round per halving.
  """
  b, i0, i1, j0, j1 = rects
  h, w = i1 - i0, j1 - j0
  small = h * w <= SMALL_COVER
  if not small.any():
    return rects
  n = (h * w)[small]
  item = np.flatnonzero(small)[np.repeat(np.arange(n.size), n)]
  k = ranges(np.zeros(n.size, np.int64), n)
  i = i0[item] + k // w[item]
  j = j0[item] + k % w[item]
  big = ~small
  return (np.concatenate([b[big], b[item]]), np.concatenate([i0[big], i]),
          np.concatenate([i1[big], i + 1]), np.concatenate([j0[big], j]),
          np.concatenate([j1[big], j + 1]))


def _decided_leaves(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None,
                    refine: bool, budget: Budget, pieces: tuple[Pieces, Pieces] | None = None,
                    hints: tuple[_Hints, _Hints] | None = None, start=None):
  """The non-EMPTY leaves `(b, i0, i1, j0, j1, state)` of the grid (or of rectangles `start`).

  Ambiguous single tiles are decided exactly when `refine`; otherwise they stay PARTIAL.
  A caller that keeps the leaves holds them in the budget (`_hold_leaves`).
  """
  return _leaves_and_exactness(m, geo, tables, batch, refine, budget, pieces, hints, start)[0]


def _leaves_and_exactness(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None,
                          refine: bool, budget: Budget,
                          pieces: tuple[Pieces, Pieces] | None = None,
                          hints: tuple[_Hints, _Hints] | None = None, start=None):
  """`_decided_leaves`, and whether they are exact: every PARTIAL leaf proven mixed in each
  of its tiles (refined, or no ambiguous one left), as FULL and EMPTY leaves always are."""
  if hints is None:
    hints = (NO_HINTS, NO_HINTS)
  leaves = _leaves(m, geo, tables, batch, budget, pieces, hints, start)
  b, i0, i1, j0, j1, state, ambiguous = leaves
  held = _nbytes(leaves)
  if refine and ambiguous.any():
    idx = np.flatnonzero(ambiguous)  # single tiles
    state[idx] = _decide_tiles(m, geo, tables, b[idx] if batch else 0, i0[idx], j0[idx],
                               budget, pieces, batch or 1, beside=held + idx.nbytes)
  keep = state != EMPTY
  budget.charge(held + _nbytes(leaves[:6]), "the decided rectangles of tiles")
  exact = refine or not ambiguous.any()
  return tuple(x[keep] for x in (b, i0, i1, j0, j1, state)), exact


class _AxisRuns:
  """The runs of a mask that reads one position only (`g[k]`, `valid[k]`, `g[q]`).

  Such a mask has the same state in every tile of a column of tiles (of a row,
  for `q`): a vector of states over the tiles of its axis decides it, found on
  a virtual grid one tile thick. Along the lines of its own axis (q tile rows of
  a `q` mask) each line is one run over the whole span. Across them every line
  repeats the same runs, a *pattern*: `_CombinedRuns` splices it into the other
  parts' runs without writing it out line by line, so `local(64, 64) | g[q] |
  g[k]` costs its output, not a pass of the analysis over every g column of
  every row.
  """

  def __init__(self, m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None,
               refine: bool, budget: Budget):
    (self.axis,) = ir.positions_of(m)
    self.m, self.geo, self.batch, self.budget = m, geo, batch, budget
    shape = geo.shape
    if self.axis == "q":
      line = TileGeometry(Shape.of(shape.q_len, 1, shape.q_offset), geo.bq, 1)
    else:
      line = TileGeometry(Shape.of(1, shape.kv_len, shape.q_offset), 1, geo.bk)
    nb = batch or 1
    n = line.nq if self.axis == "q" else line.nk
    budget.charge(nb * n * 8 * 8, "the tiles of one axis")
    b = np.repeat(np.arange(nb, dtype=np.int64), n)
    t = np.tile(np.arange(n, dtype=np.int64), nb)
    bare = bare_reads_only(m)
    if bare:  # from the operands' runs: exact, no analysis
      tokens, block, offset = ((shape.q_len, geo.bq, shape.q_offset) if self.axis == "q" else
                               (shape.kv_len, geo.bk, 0))
      state = read_tile_states(m, tokens, block, offset, nb, tables, _RunReads(tables),
                               budget).reshape(-1)
      a, z, self.exact = t, t + 1, True
    else:  # every tile of the line at once: one round of the analysis, ambiguous ones refined
      one = np.zeros_like(t)
      start = (b, t, t + 1, one, one + 1) if self.axis == "q" else (b, one, one + 1, t, t + 1)
      (b, i0, i1, j0, j1, state), self.exact = _leaves_and_exactness(
          m, line, tables, batch, refine, budget, start=start)
      a, z = (i0, i1) if self.axis == "q" else (j0, j1)
    # (b, a, z, state): the pattern of each batch row, sorted and merged
    self.pattern = tuple(x for i, x in enumerate(merge_runs(b, np.zeros_like(b), a, z, state,
                                                            in_order=bare)) if i != 1)

  def pattern_along(self, along_rows: bool) -> bool:
    """Whether the runs along these lines are the pattern, the same on every line."""
    return (self.axis == "k") == along_rows

  def merged(self, along_rows: bool) -> LineRuns:
    """The runs as sorted, merged `(b, line, a, z, state)` arrays."""
    geo = self.geo
    n_lines, n_span = (geo.nq, geo.nk) if along_rows else (geo.nk, geo.nq)
    b, a, z, state = self.pattern
    if not self.pattern_along(along_rows):  # each run of lines: one run over the span
      n = z - a
      item = np.repeat(np.arange(n.size), n)
      line = (a - (np.cumsum(n) - n))[item] + np.arange(item.size)
      self.budget.charge(item.size * 48, "the packed runs")
      return b[item], line, np.zeros_like(line), np.full_like(line, n_span), state[item]
    # every line repeats its batch row's pattern
    nb = self.batch or 1
    count = np.bincount(b, minlength=nb)
    self.budget.charge(int(count.sum()) * n_lines * 48, "the packed runs")
    first = np.cumsum(count) - count
    p = np.concatenate([np.tile(np.arange(f, f + c), n_lines) for f, c in zip(first, count)])
    line = np.concatenate([np.repeat(np.arange(n_lines), c) for c in count])
    return b[p], line, a[p], z[p], state[p]

  def runs(self, along_rows: bool) -> Runs:
    return pack_runs(*self.merged(along_rows), self.batch or 1,
                     self.geo.nq if along_rows else self.geo.nk)


class _EqualRuns:
  """The runs of `x[q + s] == x[k + t]` where each value of x is one run of its batch row
  (sorted segment ids; the ids of an image mask's runs): found by binary searches over
  the runs each line reads, exactly, with no analysis
  (`maskc.lowering.closed_forms.equal_reads`)."""

  def __init__(self, table: RunTable, shifts: tuple[int, int], on: np.ndarray | None,
               geo: TileGeometry, batch: int | None, budget: Budget):
    self.table, self.shifts, self.on, self.geo, self.batch = table, shifts, on, geo, batch
    self.budget = budget
    self._lines: dict = {}  # the runs each line reads, for both directions
    self._widened: dict = {}  # bounds of a band widened by these reads (`widened`)

  @classmethod
  def of(cls, m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None,
         budget: Budget) -> _EqualRuns | None:
    """The equal reads of `m` (`maskc.lowering.closed_forms.equal_reads.equal_reads_where`),
    where they apply."""
    found = None if geo.positions or not enabled("equal_reads") else equal_reads_where(m)
    if found is None:
      return None
    name, s, t, w = found
    table = tables.run_table(name)
    if not unique_runs(table):
      return None
    on = None
    if w is not None:  # `& w[q + s]`: w must be constant on x's runs
      w_table = tables.run_table(w)
      if not (w_table.starts is table.starts or np.array_equal(w_table.starts, table.starts)):
        return None
      on = w_table.values != 0
    return cls(table, (s, t), on, geo, batch, budget)

  def _lines_runs(self, along_rows: bool):
    """The runs as sorted, merged `(flat line, a, z, state)` arrays."""
    nb = self.batch or 1
    geo = self.geo
    tokens = self.table.length if self.on is None else 2 * self.table.length  # runs read
    self.budget.charge(nb * (geo.nq + geo.nk + min(geo.nq + geo.nk, tokens)) * 6 * 8,
                       "the runs of equal reads")
    return equal_read_runs(self.table, geo, nb, *self.shifts, along_rows, self.on, self._lines)

  def bounds(self, along_rows: bool) -> np.ndarray | None:
    """The tiles as a band's bounds per flat line
    (`maskc.lowering.closed_forms.equal_reads.equal_read_bounds`), where no truth read stands
    beside the equal reads; else None."""
    if self.on is not None:
      return None
    nb, geo = self.batch or 1, self.geo
    self.budget.charge(nb * (geo.nq + geo.nk) * 6 * 8, "the runs of equal reads")
    return equal_read_bounds(self.table, geo, nb, *self.shifts, along_rows, self._lines)

  def widened(self, intervals: Intervals, along_rows: bool):
    """The bounds of `intervals | self` per line, where they are a band's
    (`maskc.lowering.closed_forms.widened_band`); else None. Remembered: a spread that cannot
    use them in closed form asks again."""
    if not enabled("widened_band"):
      return None
    key = (intervals.lo, intervals.hi, intervals.chunk, along_rows)
    if key not in self._widened:
      geo = self.geo
      self.budget.charge((self.table.batch * (geo.nq + geo.nk) + self.table.values.size) *
                         12 * 8, "a band widened by equal reads")
      self._widened[key] = widened_bounds(geo, intervals, self.table, self.shifts, self.on,
                                          along_rows, self._lines)
    if self._widened[key] is not None:
      took("widened_band")
    return self._widened[key]

  def flat(self, along_rows: bool) -> FlatRuns:
    """The runs as sorted, merged flat runs (`keyed`), from their flat lines directly."""
    f, a, z, state = self._lines_runs(along_rows)
    base = f * ((self.geo.nk if along_rows else self.geo.nq) + 1)
    return base + a, base + z, state

  def runs(self, along_rows: bool) -> Runs:
    n_lines, n_span = (self.geo.nq, self.geo.nk) if along_rows else (self.geo.nk, self.geo.nq)
    return pack_keyed(*self.flat(along_rows), self.batch or 1, n_lines, n_span)


class _PeriodicRuns:
  """The runs of a mask without operands that has a diagonal period
  (`maskc.analysis.diagonal_period`).

  With `T = lcm(P, bq, bk)`, tile `(i + T / bq, j + T / bk)` has the state of tile
  `(i, j)` wherever both are whole tiles, so one period of rows is classified over
  enough columns to the left (a grid moved along the diagonal by a multiple of
  `T`) and repeated down the grid; likewise one period of columns. The last row
  and column of tiles, when cut short by the lengths, are classified directly.
  Work and memory follow one period plus the output, not the grid.
  """

  def __init__(self, m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None,
               refine: bool, budget: Budget, period: int):
    self.m, self.geo, self.tables, self.batch, self.refine = m, geo, tables, batch, refine
    self.budget = budget
    step = math.lcm(period, geo.bq, geo.bk)
    self.step, self.tq, self.tk = step, step // geo.bq, step // geo.bk
    self.nq, self.nk = geo.shape.q_len // geo.bq, geo.shape.kv_len // geo.bk  # whole tiles
    edges = []
    if self.nq < geo.nq:
      edges.append((self.nq, geo.nq, 0, geo.nk))
    if self.nk < geo.nk and self.nq:
      edges.append((0, self.nq, self.nk, geo.nk))
    self.edges = None
    if edges:
      start = tuple(np.asarray(x, np.int64) for x in zip(*([(0,) + e for e in edges])))
      self.edges = _hold_leaves(self._decided(geo, start), budget)

  @staticmethod
  def worth(geo: TileGeometry, period: int) -> bool:
    """Whether a period spans at most a quarter of the grid, and the moved grids stay far
    from the integer limits (positions near them take the general path's overflow checks)."""
    step = math.lcm(period, geo.bq, geo.bk)
    shape = geo.shape
    return ((step // geo.bq) * 4 <= shape.q_len // geo.bq and
            (step // geo.bk) * 4 <= shape.kv_len // geo.bk and
            abs(shape.q_offset) + 2 * (shape.q_len + shape.kv_len + step) < 1 << 62)

  def _decided(self, geo: TileGeometry, start=None):
    """Leaves of `geo` (or of rectangles `start`), ambiguous tiles refined, EMPTY ones dropped."""
    return _decided_leaves(self.m, geo, self.tables, None, self.refine, self.budget, start=start)

  def _merged_row(self, along_rows: bool) -> LineRuns:
    """The runs of one batch row as sorted, merged `(b, line, a, z, state)` arrays."""
    geo, shape = self.geo, self.geo.shape
    n_lines, n_span = (self.nq, self.nk) if along_rows else (self.nk, self.nq)
    t_line, t_span = (self.tq, self.tk) if along_rows else (self.tk, self.tq)
    parts = []
    if n_lines and n_span:
      reps = -(-n_lines // t_line) - 1  # repeats after the first period
      base_lines = min(t_line, n_lines)
      if along_rows:  # one period of rows, over the columns that reach `reps` periods left
        virtual = Shape.of(base_lines * geo.bq, (n_span + reps * t_span) * geo.bk,
                           shape.q_offset + reps * self.step)
      else:  # one period of columns, over the rows that reach `reps` periods up
        virtual = Shape.of((n_span + reps * t_span) * geo.bq, base_lines * geo.bk,
                           shape.q_offset - reps * self.step)
      leaves = self._decided(TileGeometry(virtual, geo.bq, geo.bk))
      _, line, a, z, st = merge_runs(*expand_in_order(leaves, along_rows, base_lines),
                                      in_order=True)
      self.budget.charge(line.size * (reps + 1) * 48, "the repeated runs")
      t = np.arange(reps + 1, dtype=np.int64)[:, None]
      line = line[None, :] + t * t_line
      shift = (reps - t) * t_span
      a = np.maximum(a[None, :] - shift, 0)
      z = np.minimum(z[None, :] - shift, n_span)
      keep = (line < n_lines) & (z > a)
      st = np.broadcast_to(st[None, :], keep.shape)
      parts.append((np.zeros(int(keep.sum()), np.int64), line[keep], a[keep], z[keep], st[keep]))
    if self.edges is not None:
      parts.append(expand_leaves(self.edges, along_rows))
    if not parts:
      b, line, a, z = (np.zeros(0, np.int64) for _ in range(4))
      parts.append((b, line, a, z, np.zeros(0, np.int8)))
    # The repeats come line by line, each line's runs in order: only the edges need a sort.
    b, line, a, z, st = (np.concatenate(x) for x in zip(*parts))
    return merge_runs(b, line, a, z, st, in_order=self.edges is None)

  def merged(self, along_rows: bool) -> LineRuns:
    """The runs of every batch row as sorted, merged `(b, line, a, z, state)` arrays."""
    one = self._merged_row(along_rows)
    nb = self.batch or 1
    if nb == 1:
      return one
    b = np.repeat(np.arange(nb, dtype=np.int64), one[0].size)
    line, a, z, state = (np.tile(x, nb) for x in one[1:])
    return b, line, a, z, state

  def runs(self, along_rows: bool) -> Runs:
    runs = pack_runs(*self._merged_row(along_rows), 1,
                     self.geo.nq if along_rows else self.geo.nk)
    nb = self.batch or 1
    return Runs(*(np.repeat(x, nb, axis=0) for x in runs)) if nb > 1 else runs


def _line_pieces(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None,
                 budget: Budget) -> tuple[Pieces, Pieces] | None:
  """The row and column pieces of the grid's lines; None with batched positions.

  Pieces are cut in position space, the same for every batch row: not with
  batched positions, whose ambiguous tiles are refined without them.
  """
  if geo.batched_positions:
    return None
  return (_pieces(m, geo, tables, batch, True, budget),
          _pieces(m, geo, tables, batch, False, budget))


def _pieces(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None, along_rows: bool,
            budget: Budget, lines: np.ndarray | None = None) -> Pieces:
  """Each q tile row (or k tile column) cut at the changes of the operands read along it.

  `lines`: only these flat lines `b * n_lines + line` (sorted, distinct); the others
  then have no pieces, and must not be asked for.
  """
  nb = batch or 1
  n = geo.nq if along_rows else geo.nk
  t = np.arange(n) if lines is None else lines % n
  lo, hi = geo.q_bounds(t, t + 1) if along_rows else geo.k_bounds(t, t + 1)
  lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
  reads = reads_at(m, "q" if along_rows else "k")
  for name, _ in reads:
    budget.charge(tables.size(name) * 2 + lo.size * (nb if lines is None else 1) * 64,
                  f"the runs of operand `{name}`")
    tables.run_table(name)
  found = {n: tables.run_table(n) for n, _ in reads}
  if lines is None:
    return line_pieces(found, reads, nb, lo, hi)
  some = line_pieces(found, reads, nb, lo, hi, rows=lines // n)
  first, count = np.zeros(nb * n, np.int64), np.zeros(nb * n, np.int64)
  first[lines], count[lines] = some.first, some.count
  return Pieces(some.lo, some.hi, first, count)


class _Backward:
  """Computes the per-key-tile runs of a static map once, when a backward pass first asks.

  The compiler's memo, handed to the `BlockMap` as a function: the map never changes.
  """

  def __init__(self, per_mask: list[_StaticRuns]):
    self.per_mask = per_mask
    self.runs: Runs | None = None

  def __call__(self) -> Runs:
    if self.runs is None:
      self.runs = stack_runs([r.runs(along_rows=False) for r in self.per_mask])
      self.per_mask = []
    return self.runs


def _periodic(m: ir.Mask, geo: TileGeometry) -> int | None:
  """The diagonal period of an operand-free mask, where repeating it pays; else None."""
  if m.operands or geo.positions or not enabled("periodic"):
    return None
  period = diagonal_period(m)
  return period if period is not None and _PeriodicRuns.worth(geo, period) else None


def _parts(m: ir.Mask, geo: TileGeometry) -> list[ir.Mask] | None:
  """The parts of an `&` / `|` lowered apart, or None to lower it whole.

  Parts: its items that read one position only, joined per axis (`g[q]`, `g[k]`,
  `valid[k]`, `sink(4)`: see `_AxisRuns`); its operand-free items joined, where
  they have a diagonal period worth repeating (else those that have one); each
  other item that is itself lowered in parts (`document(seg) & (causal |
  bidirectional(img))`, `causal | prefix(4096)`); the other items joined. At
  least one part must be periodic (or a band of an `&`: `maskc.lowering.closed_forms.band_runs`), in
  parts itself or of one axis: otherwise splitting saves nothing.
  """
  while isinstance(m, ir.Call):
    m = ir.expand(m)
  split = ir.operand_free_split(m)
  if split is None or geo.positions or not enabled("parts"):
    return None
  free, rest, join = split
  axis_items = {a: [x for x in free + rest if ir.positions_of(x) == {a}] for a in "qk"}
  free, rest = ([x for x in items if len(ir.positions_of(x)) != 1] for items in (free, rest))
  periodic = []
  if free and (_periodic(ir.joined(free, join), geo) is not None or
               (join is ir.and_ and _clip_band(ir.joined(free, join), geo) is not None)):
    periodic, free = free, []
  elif free:
    some = [x for x in free if _periodic(x, geo) is not None]
    if some and _periodic(ir.joined(some, join), geo) is not None:
      periodic, free = some, [x for x in free if not any(x is y for y in some)]
  items = rest + free
  in_parts = [_parts(x, geo) is not None for x in items]
  nested = [x for x, y in zip(items, in_parts) if y]
  others = [x for x, y in zip(items, in_parts) if not y]
  axes = [ir.joined(axis_items[a], join) for a in "qk" if axis_items[a]]
  parts = ([ir.joined(periodic, join)] if periodic else []) + nested + (
      [ir.joined(others, join)] if others else []) + axes
  return parts if (periodic or nested or axes) and len(parts) > 1 else None


def _one_axis(m: ir.Mask, geo: TileGeometry) -> bool:
  """Whether `m` reads one position only (`g[k]`, `valid[k] & k < n`, `sink(4)`): lowered as
  `_AxisRuns`."""
  return not geo.positions and len(ir.positions_of(m)) == 1 and enabled("one_axis")


def _parts_pay(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None) -> bool:
  """Whether lowering `m` in parts (`_parts`) beats lowering it whole, where a part needs
  range analysis (parts that need none always pay: `_unanalysed`).

  An `&` lowered whole prunes its operand items by its periodic ones, and
  combining the parts' runs costs a pass over every square's runs. Measured at 1M
  tokens, 128-tiles, for `causal & seg[q] <= seg[k] + 1 & seg[k] <= seg[q]`:
  documents of 50-200 tokens (more than one change per four tile rows) lower 1.4
  times faster whole, documents of 1K-8K 1.5 times faster in parts. An `|` cannot
  prune that way: in parts always (images: 2-2.5 times faster).
  """
  if not isinstance(m, ir.And):
    return True
  nb = batch or 1
  changes = sum(tables.run_table(name).starts.size - nb for name in {n for n, _ in
                                                                       reads_at(m, "q")})
  return changes <= WHOLE_AFTER * nb * geo.nq


def _unanalysed(m: ir.Mask, geo: TileGeometry, tables: Tables, join) -> bool:
  """Whether `m`, a part of an `&` / `|` (`join`), is lowered without range analysis over
  the grid: by its period, along one axis, as equal reads of runs (`_runs_of_mask`), as
  a band of an `&`, or in parts that all are (`causal | bidirectional(img)` in
  `document(seg) & (causal | bidirectional(img))`)."""
  while isinstance(m, ir.Call):
    m = ir.expand(m)
  if (_periodic(m, geo) is not None or _one_axis(m, geo) or
      (join is ir.and_ and _clip_band(m, geo) is not None) or
      _EqualRuns.of(m, geo, tables, None, Budget(0)) is not None):
    return True
  parts = _parts(m, geo)
  inner = ir.and_ if isinstance(m, ir.And) else ir.or_
  return parts is not None and all(_unanalysed(x, geo, tables, inner) for x in parts)


def _runs_of_mask(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None, refine: bool,
                  budget: Budget):
  """How one mask's runs are computed: by its diagonal period where it has one; along its
  one axis when it reads only one (`_AxisRuns`); as the `&` / `|` of parts lowered apart
  (`_parts`); else by leaves."""
  period = _periodic(m, geo)
  if period is not None:
    took("periodic")
    return _PeriodicRuns(m, geo, tables, batch, refine, budget, period)
  if _one_axis(m, geo):
    took("one_axis")
    return _AxisRuns(m, geo, tables, batch, refine, budget)
  while isinstance(m, ir.Call):  # `document(seg)`, `streaming(w, s)`: the parts of its body
    m = ir.expand(m)
  equal = _EqualRuns.of(m, geo, tables, batch, budget)
  if equal is not None:
    took("equal_reads")
    return equal
  parts = _parts(m, geo)
  if parts is not None and not _parts_pay(m, geo, tables, batch) and not all(
      _unanalysed(x, geo, tables, ir.and_ if isinstance(m, ir.And) else ir.or_)
      for x in parts):
    parts = None
  if parts is not None:
    took("parts")
    return _CombinedRuns(m, [_band_part(x, geo, batch) or
                             _runs_of_mask(x, geo, tables, batch, refine, budget)
                             for x in parts], geo, tables, batch, refine, budget)
  return _StaticRuns(m, geo, tables, batch, refine, budget)


def _band_part(m: ir.Mask, geo: TileGeometry, batch: int | None) -> BandRuns | None:
  """A part of an `&` or `|` that is exactly a band of `q - k` (`causal`, `sliding(w)`,
  `local(64, 64)`), in closed form (`maskc.lowering.closed_forms.band_runs`): an `&` clips the
  other parts' runs to it, an `|` combines them with its runs, no period analysed. None
  otherwise."""
  band = _clip_band(m, geo)
  if band is None:
    return None
  took("band")
  return BandRuns(geo, band, batch or 1)


def _clip_band(m: ir.Mask, geo: TileGeometry) -> tuple[int | None, int | None] | None:
  """The band `(lo, hi)` of `q - k` that operand-free `m` is exactly, where its closed form
  holds on `geo` (`maskc.lowering.closed_forms.band_runs.band_fits`); else None."""
  if m.operands or not enabled("band"):
    return None
  band = exact_band(m)
  return band if band is not None and band_fits(geo, band) else None


class _CombinedRuns:
  """The runs of `a & b & ...` or `a | b | ...` from the runs of its parts.

  With states ordered EMPTY < PARTIAL < FULL, a tile's state under `|` is the
  largest of its parts' and under `&` the smallest, exactly, except where two
  parts are PARTIAL: there the union may be FULL and the intersection EMPTY, so
  those tiles (few: where two parts' boundaries cross) are decided for the whole
  mask. Lets `causal & chunk(8192) | bidirectional(img)` repeat the period of
  `causal & chunk(8192)` and analyse only the image spans.
  """

  def __init__(self, m: ir.Mask, parts: list, geo: TileGeometry, tables: Tables,
               batch: int | None, refine: bool, budget: Budget):
    self.m, self.parts, self.geo, self.tables = m, parts, geo, tables
    self.batch, self.refine, self.budget = batch, refine, budget
    self.union = isinstance(m, ir.Or)

  def _true_on_diagonal(self) -> bool:
    """Whether the mask is true at every pair `q == k` (proved once, from its IR)."""
    if not enabled("diagonal_truth"):
      return False
    if not hasattr(self, "_diagonal"):
      self._diagonal = true_on_diagonal(self.m)
    if self._diagonal:
      took("diagonal_truth")
    return self._diagonal

  def _pieces(self, b, i, j):
    """Operand pieces of the whole mask's lines (as `_StaticRuns`) for deciding tiles
    `(b, i, j)`: of their rows and columns only, where no part lends them.

    The operand-free part reads nothing, so a part that cut its lines at the same
    reads lends its pieces.
    """
    geo = self.geo
    if geo.batched_positions:
      return None
    reads = [reads_at(self.m, axis) for axis in "qk"]
    lent = [x.pieces for x in self.parts if isinstance(x, _StaticRuns) and
            [reads_at(x.m, axis) for axis in "qk"] == reads]
    if lent:
      return lent[0]
    return tuple(_pieces(self.m, geo, self.tables, self.batch, rows, self.budget,
                         np.unique(b * n + line))
                 for rows, n, line in ((True, geo.nq, i), (False, geo.nk, j)))

  def flat(self, along_rows: bool):
    """The runs as sorted, merged flat runs `(start key, stop key, state)` (`keyed`): what
    an `&` / `|` of which this is a part combines, without splitting and joining keys."""
    geo = self.geo
    n_lines, n_span = (geo.nq, geo.nk) if along_rows else (geo.nk, geo.nq)
    flat, patterns = self._unspliced(along_rows)
    for part in patterns:
      flat = self._splice(flat, part, along_rows, n_lines, n_span)
    return merge_keyed(*flat)

  def runs(self, along_rows: bool) -> Runs:
    """The runs packed (`maskc.lowering.grid.run_lists.pack_keyed`); an `|` that ends with a pattern
    (`local(64, 64) | g[q] | g[k]`) packs its lines as it splices them, not through flat
    keys of every run: 269,000 runs at 1M."""
    geo = self.geo
    n_lines, n_span = (geo.nq, geo.nk) if along_rows else (geo.nk, geo.nq)
    flat, patterns = self._unspliced(along_rows)
    if not (self.union and patterns):
      for part in patterns:
        flat = self._splice(flat, part, along_rows, n_lines, n_span)
      return pack_keyed(*merge_keyed(*flat), self.batch or 1, n_lines, n_span)
    for part in patterns[:-1]:
      flat = self._splice(flat, part, along_rows, n_lines, n_span)
    return self._spliced_lines(flat, patterns[-1], along_rows, n_lines, n_span)

  def _unspliced(self, along_rows: bool):
    """The flat runs of every part but those of one axis whose runs along these lines are
    a pattern (`_AxisRuns`), unmerged, and those parts, to splice in."""
    geo = self.geo
    n_lines, n_span = (geo.nq, geo.nk) if along_rows else (geo.nk, geo.nq)
    axis = [p for p in self.parts if isinstance(p, _AxisRuns)]
    patterns = [p for p in axis if p.pattern_along(along_rows)]
    whole = [p for p in axis if not p.pattern_along(along_rows)]  # one run per line
    # a band (an `&`'s only) clips the runs of the others, unless it is all there is;
    # so does a band in an `|` of an `&`, spread over it (`_spread`)
    bands = [p for p in self.parts if isinstance(p, BandRuns) and not self.union]
    others = [p for p in self.parts if not isinstance(p, _AxisRuns) and
              not any(p is b for b in bands)]
    # an `|` with a pattern in an `&`: distributed, `x & (rest | pattern)` as
    # `(x & rest) | (x & pattern)`, so the pattern is spliced into x's runs alone
    distributed = [(p, self._pattern_or(p, along_rows)) for p in others]
    distributed = [(p, x) for p, x in distributed if x is not None]
    others = [p for p in others if not any(p is q for q, _ in distributed)]
    if distributed and not (whole or others or bands):
      others.append(distributed.pop(0)[0])
    band_ors = [(p, self._band_or(p)) for p in others]
    spread = [(p, x) for p, x in band_ors if x is not None]
    others = [p for p in others if not any(p is q for q, _ in spread)]
    if not (whole or others):
      if bands:
        others, bands = bands[:1], bands[1:]
      else:
        others, spread = [spread[0][0]], spread[1:]
    # whole lines first: under `&`, the other parts matter only on their non-EMPTY lines
    order = whole + others
    widened = self._widened(order, along_rows, n_lines, n_span) if self.union else None
    met = None
    if not self.union and len(order) == 1 and (bands or spread):
      met = self._met_in_closed_form(order[0], bands, spread, along_rows, n_lines, n_span)
    if widened is not None:
      (flat, order), exact = widened, True
    elif met is not None:  # `causal & document(seg)`: pieces from both parts' bounds
      (flat, bands, spread, exact), order = met, []
    else:
      flat = _flat_runs(order[0], along_rows, n_lines, n_span)
      exact = _exact_runs(order[0])  # the runs so far are one exact part's, as lowered
      order = order[1:]
    for part in order:
      other = _flat_runs(part, along_rows, n_lines, n_span)
      if whole and not self.union:
        other = on_lines(other, lines_of(flat[0], n_span), n_span)
      flat = self._combine_by_lines(flat, other, along_rows, n_lines, n_span,
                                    exact_part=exact or _exact_runs(part))
      exact = False
    for band in bands:
      flat = self._clip_lines(flat, band.bounds(along_rows), along_rows, n_lines, n_span)
      exact = False
    for _, (band, rest) in spread:
      flat = self._spread(flat, band, rest, along_rows, n_lines, n_span, exact)
      exact = False
    for _, (rest, pattern) in distributed:
      kept = self._met_with(flat, rest, along_rows, n_lines, n_span, exact)
      met = self._spliced_met(flat, pattern, along_rows, n_lines, n_span)[0]
      flat = self._combine_by_lines(kept, met, along_rows, n_lines, n_span, union=True)
      exact = False
    return flat, patterns

  def _met_in_closed_form(self, part, bands: list, spread: list, along_rows: bool,
                          n_lines: int, n_span: int):
    """`(flat runs, bands left, spreads left, False)` of `part & band` where the part's
    tiles are a band's bounds per line (`document(seg)`: `_EqualRuns.bounds`) and so are
    the first band's, or the first spread's widened (`causal | bidirectional(img)`): the
    pieces of both bounds (`met_bounds_pieces`), no runs written and clipped; else None."""
    if not (isinstance(part, _EqualRuns) and part.on is None and enabled("met_bounds")):
      return None
    if bands:
      bounds, bands = bands[0].bounds(along_rows), bands[1:]
    else:
      band, rest = spread[0][1]
      bounds = (rest.widened(Intervals(*band.band), along_rows)
                if isinstance(rest, _EqualRuns) else None)
      if bounds is None:
        return None
      spread = spread[1:]
    took("met_bounds")
    x_bounds = cast(np.ndarray, part.bounds(along_rows))  # not None: `part.on` is None
    lines = x_bounds.shape[1]
    chunk = max(1, min(lines, self.budget.items(MET_LINE_BYTES), COMBINE_CHUNK // 3))
    self.budget.charge(min(lines, chunk) * MET_LINE_BYTES, "meeting bounds")
    out = [self._pieces_decided(*met_bounds_pieces(x_bounds[:, a:a + chunk], a, bounds,
                                                   n_lines, n_span),
                                along_rows, n_span, False, exact_part=True)
           for a in range(0, lines, chunk)]
    return tuple(np.concatenate(v) for v in zip(*out)), bands, spread, False

  def _widened(self, order: list, along_rows: bool, n_lines: int, n_span: int):
    """`(flat runs, the other parts)` of this `|` where a band (or a band inside chunks)
    and equal reads among `order` join into one interval per row (`causal & chunk(8192)
    | bidirectional(img)`: `maskc.lowering.closed_forms.widened_band`), their runs written from
    bounds with nothing combined; else None."""
    equal = next((p for p in order if isinstance(p, _EqualRuns)), None)
    if equal is None:
      return None
    band, intervals = next(((p, x) for p, x in ((p, _intervals(p, self.geo)) for p in order)
                            if x is not None), (None, None))
    if band is None or intervals is None:  # both None or neither
      return None
    bounds = equal.widened(intervals, along_rows)
    if bounds is None:
      return None
    return (keyed_band_runs(bounds, None, n_lines, n_span, self.batch or 1),
            [p for p in order if p is not band and p is not equal])

  def _pattern_or(self, part, along_rows: bool):
    """`(rest, pattern)` where `part` of this `&` is `rest | pattern`, the pattern a part
    of one axis whose runs along these lines repeat on every line (`| g[k]` in
    `document(seg) & (causal | bidirectional(img) | g[k])`); else None.

    The rest's PARTIAL tiles are decided for the whole `|`, as in `_band_or`: between
    the `&` with it and the whole, the union with `x & pattern` is still exact.
    """
    if self.union or not (isinstance(part, _CombinedRuns) and part.union and
                          enabled("distribute")):
      return None
    patterns = [p for p in part.parts if isinstance(p, _AxisRuns) and
                p.pattern_along(along_rows)]
    rest = [p for p in part.parts if not any(p is q for q in patterns)]
    if len(patterns) != 1 or not rest:
      return None
    took("distribute")
    if len(rest) > 1:
      rest = [_CombinedRuns(part.m, rest, self.geo, self.tables, self.batch, self.refine,
                            self.budget)]
    return rest[0], patterns[0]

  def _met_with(self, x, part, along_rows: bool, n_lines: int, n_span: int, exact: bool):
    """Flat runs `x` of this `&`'s other parts `& part`: clipped at a band, spread over a
    band in an `|` (`_spread`), else combined line by line."""
    if isinstance(part, BandRuns):
      return self._clip_lines(x, part.bounds(along_rows), along_rows, n_lines, n_span)
    band_or = self._band_or(part)
    if band_or is not None:
      return self._spread(x, *band_or, along_rows, n_lines, n_span, exact)
    return self._combine_by_lines(x, _flat_runs(part, along_rows, n_lines, n_span), along_rows,
                                  n_lines, n_span, exact_part=exact or _exact_runs(part))

  def _band_or(self, part) -> tuple[BandRuns, Any] | None:
    """`(band, rest)` where `part` of this `&` is `band | rest` (`causal |
    bidirectional(img)`), its band in closed form; else None.

    Only where the rest has no parts of one axis: those splice a pattern into every
    line (`_splice`), which `_spread` would write out.
    """
    if self.union or not (isinstance(part, _CombinedRuns) and part.union and
                          enabled("spread")):
      return None
    band = [p for p in part.parts if isinstance(p, BandRuns)]
    rest = [p for p in part.parts if not any(p is q for q in band[:1])]
    if not band or any(isinstance(p, _AxisRuns) for p in rest):
      return None
    took("spread")
    if len(rest) > 1:  # their PARTIAL tiles decided for the whole `|`: sound for `_spread`
      rest = [_CombinedRuns(part.m, rest, self.geo, self.tables, self.batch, self.refine,
                            self.budget)]
    return band[0], rest[0]

  def _spread(self, x, band: BandRuns, rest, along_rows: bool, n_lines: int, n_span: int,
              exact_x: bool = False):
    """Flat runs `x` of this `&`'s other parts, `& (band | rest)`. Where the rest is equal
    reads that widen the band to one interval per row
    (`maskc.lowering.closed_forms.widened_band`), `x` clipped at the widened band's bounds;
    else, on lines where the rest has no runs,
    `x` clipped at the band, and on the rest's lines (few: an image's rows), `x` met
    with the band's runs joined with the rest's.

    `document(seg) & (causal | bidirectional(img))`: the documents clipped as in
    `causal & document(seg)`, at bounds that reach past the diagonal on an image's
    lines. Tiles PARTIAL in two parts are decided for the whole mask: between the `|`
    and the whole, the following `&` with `x` is still exact.
    """
    if isinstance(rest, _EqualRuns):  # one interval per row: the band widened
      widened = rest.widened(Intervals(*band.band), along_rows)
      if widened is not None:
        return self._clip_lines(x, widened, along_rows, n_lines, n_span)
    y = _flat_runs(rest, along_rows, n_lines, n_span)
    lines = lines_of(y[0], n_span)
    on = on_lines_mask(x[0], lines, n_span)
    bounds = band.bounds(along_rows)
    off = self._clip_lines(tuple(v[~on] for v in x), bounds, along_rows, n_lines, n_span)
    joined = self._combine_by_lines(keyed_band_runs(bounds, lines, n_lines, n_span), y,
                                    along_rows, n_lines, n_span, union=True)
    met = self._combine_by_lines(tuple(v[on] for v in x), joined, along_rows, n_lines,
                                 n_span, union=False, exact_part=exact_x)
    return interleaved(off, met)

  def _splice(self, x, part: _AxisRuns, along_rows: bool, n_lines: int, n_span: int):
    """Flat runs `x` combined with the runs of a part of one axis whose runs along these
    lines are a pattern (`_AxisRuns.pattern`, `(b, a, z, state)`): runs that every line of
    batch row `b` has, never written out for lines where `x` has none.

    Only the pattern's runs that meet the span of a line's runs in `x` are looked at
    (`_spliced_met`); for `|` the line keeps the pattern's runs before and after that
    span as they are, and a line without runs in `x` is the pattern
    (`_spliced_lines`).
    """
    if not self.union:
      return self._spliced_met(x, part, along_rows, n_lines, n_span)[0]
    runs = self._spliced_lines(x, part, along_rows, n_lines, n_span)
    self.budget.charge(int(runs.count.sum()) * 40, "splicing a pattern of runs")  # as keys
    return unpacked(runs, self.batch or 1, n_lines, n_span)

  def _spliced_met(self, x, part: _AxisRuns, along_rows: bool, n_lines: int, n_span: int):
    """The flat runs of `x` combined with the pattern's runs that meet the span of each
    line's runs in `x`, and those lines (flat), with the range `[lo, hi)` of the
    pattern's runs (indices into it) that each meets.

    Of those looked at, only the ones that meet a PARTIAL run of `x` or cross the edge
    of a FULL one are combined with `x` (`_combine_by_lines`): one inside a FULL run is
    kept as it is under `&` and covered under `|`, one between the runs is dropped
    under `&` and kept under `|` (`causal | g[k]` at 1M: the pattern's runs left of the
    diagonal, not combined). Tiles PARTIAL in both are sampled where the pattern is
    exact (`_exact_runs`).
    """
    key, end, state = x
    pb, pa, pz, ps = part.pattern
    stride = n_span + 1
    n_all = (self.batch or 1) * n_lines
    flat_line = key // stride
    in_x = np.bincount(flat_line, minlength=n_all)
    x_first = np.cumsum(in_x) - in_x
    lines = np.flatnonzero(in_x)
    base = lines * stride
    lb = lines // n_lines
    # the pattern's runs of each line's batch row that meet (or touch) its span in x
    p_lo, p_hi = pb * stride + pa, pb * stride + pz
    lo = np.searchsorted(p_hi, lb * stride + key[x_first[lines]] - base, "left")
    hi = np.searchsorted(p_lo, lb * stride + end[x_first[lines] + in_x[lines] - 1] - base,
                         "right")
    n = hi - lo
    item = np.repeat(np.arange(lines.size), n)
    at = np.cumsum(n) - n  # where each line's runs start among those looked at
    p = (lo - at)[item] + np.arange(item.size)
    # each looked at: its keys, place and kind, and a copy of the combined or kept ones
    # with their interleaving; each of x's runs: its range of the pattern (`_splice_kinds`)
    self.budget.charge(item.size * 100 + key.size * 128, "splicing a pattern of runs")
    met = (base[item] + pa[p], base[item] + pz[p], ps[p])
    if item.size > SPLICE_SORTED_AFTER * key.size:  # many per run of x: most inside one
      shift = (at - lo)[np.repeat(np.arange(lines.size), in_x[lines])]  # per run of x
      combined, inside = self._splice_kinds(x, flat_line, shift, p_lo, p_hi, pa, pz,
                                            item.size, n_lines, stride)
      mid = self._combine_by_lines(x, tuple(v[combined] for v in met), along_rows, n_lines,
                                   n_span, exact_part=part.exact)
      kept = inside if not self.union else ~(combined | inside)
      mid = interleaved(mid, tuple(v[kept] for v in met))
    else:
      mid = self._combine_by_lines(x, met, along_rows, n_lines, n_span,
                                   exact_part=part.exact)
    return mid, lines, lo, hi

  def _spliced_lines(self, x, part: _AxisRuns, along_rows: bool, n_lines: int, n_span: int):
    """The packed runs of `x | part`
    (`maskc.lowering.closed_forms.pattern_lines.spliced_pattern`): each line the pattern's runs
    before those met (`_spliced_met`), the combined ones, those after; a line without runs in
    `x`, the pattern.

    The combined runs are merged, and never touch a kept run in its state: a pattern run
    that touches the span of x is among those met, so a kept one ends before the first
    combined run starts unless that run begins with the next pattern run, which keeps
    its own state (the pattern is merged) up to the span; likewise after it.
    """
    mid, lines, lo, hi = self._spliced_met(x, part, along_rows, n_lines, n_span)
    key, end, state = merge_keyed(*mid)
    mid_line = key // (n_span + 1)
    base = mid_line * (n_span + 1)
    return spliced_pattern(part.pattern, self.batch or 1, n_lines, lines, lo, hi,
                           (mid_line, key - base, end - base, state), self.budget)

  @staticmethod
  def _splice_kinds(x, flat_line, shift, p_lo, p_hi, pa, pz, n_met: int, n_lines: int,
                    stride: int):
    """Which of the pattern's runs looked at by `_splice` (`n_met`, each line's in order,
    the pattern's run `p` of a line at `shift + p` for each of its runs in `x`) must be
    combined with `x`, and which lie inside one of x's FULL runs.

    Each run of `x` meets a range of the pattern's runs: all to combine where the run is
    PARTIAL; where it is FULL, the first and last if they cross its edges, the ones
    between them inside it.
    """
    combined = np.zeros(n_met, bool)
    if not n_met:
      return combined, np.zeros(n_met, bool)
    key, end, state = x
    row = flat_line // n_lines * stride
    a, z = key - flat_line * stride, end - flat_line * stride
    r_lo, r_hi = overlapping(row + a, row + z, p_lo, p_hi)
    meets = r_hi > r_lo
    full = (state == FULL) & meets
    partial = meets & ~full
    combined |= marked(n_met, (shift + r_lo)[partial], (shift + r_hi)[partial])
    left = full & (pa[np.minimum(r_lo, pa.size - 1)] < a)
    right = full & (pz[np.maximum(r_hi - 1, 0)] > z)
    combined[(shift + r_lo)[left]] = True
    combined[(shift + r_hi - 1)[right]] = True
    i_lo, i_hi = r_lo + left, r_hi - right
    some = full & (i_hi > i_lo)
    return combined, marked(n_met, (shift + i_lo)[some], (shift + i_hi)[some])

  def _combine_by_lines(self, x, y, along_rows: bool, n_lines: int, n_span: int,
                        union: bool | None = None, exact_part: bool = False):
    """`_combine` over groups of whole lines of about `COMBINE_CHUNK` runs: runs never
    cross a line, so the groups are independent, and memory stays bounded.

    Where one list has runs on few lines (an image's rows, a pattern's meeting), only
    the other's runs that overlap them are combined: elsewhere a union keeps the other
    list's runs as they are, and an intersection drops them (`causal & ~img[k] |
    bidirectional(img)` at 1M: 63 of 523K runs, where the images' lines hold 78K).
    `union`: whether to join as `|` (default: as the mask does). `exact_part`: one of the
    lists is exact as it stands (`_pieces_decided`).
    """
    union = self.union if union is None else union
    small, large = (x, y) if x[0].size <= y[0].size else (y, x)
    lines = lines_of(small[0], n_span)
    if lines.size * 4 < lines_of(large[0], n_span).size:
      meets = meeting_mask(large, small)
      both = self._combine_lines(tuple(v[meets] for v in large), small, along_rows, n_lines,
                                 n_span, union, exact_part)
      if not union:
        return both
      return interleaved(both, tuple(v[~meets] for v in large))
    return self._combine_lines(x, y, along_rows, n_lines, n_span, union, exact_part)

  def _combine_lines(self, x, y, along_rows: bool, n_lines: int, n_span: int, union: bool,
                     exact_part: bool = False):
    """`_combine_by_lines` over every line."""
    def pieces_of(x, y):
      return _union_pieces(x, y) if union else _meeting_pieces(x, y)

    def decided(*pieces):
      return self._pieces_decided(*pieces, along_rows, n_span, union, exact_part)

    return self._by_line_chunks([x, y], x[0].size + y[0].size, n_lines, n_span, pieces_of,
                                decided)

  def _clip_lines(self, x, bounds, along_rows: bool, n_lines: int, n_span: int):
    """Flat runs `x` of an `&` with a band whose lines have bounds `bounds`
    (`maskc.lowering.closed_forms.band_runs`): cut at them, PARTIAL with PARTIAL decided tile
    by tile."""
    def pieces_of(x):
      return clipped_pieces(x, bounds, n_lines, n_span)

    def decided(*pieces):  # a band is exact
      return self._pieces_decided(*pieces, along_rows, n_span, False, exact_part=True)

    return self._by_line_chunks([x], 3 * x[0].size, n_lines, n_span, pieces_of, decided)

  def _by_line_chunks(self, lists, total: int, n_lines: int, n_span: int, pieces_of, decided):
    """The runs of flat run lists `lists` combined: `pieces_of` them (`(lo, hi, sx, sy)`),
    then `decided`, over groups of whole lines of about `COMBINE_CHUNK` runs in all
    (`total`): runs never cross a line, so the groups are independent, and the
    working memory stays bounded. The pieces of small groups wait to be decided
    together, up to a group's worth: deciding a few tiles at a time costs more than
    the tiles (`causal & document(seg)` at 1M: once, where each of three groups was)."""
    per_run = COMBINE_RUN_BYTES + WAITING_PIECE_BYTES
    per_chunk = min(COMBINE_CHUNK, self.budget.items(per_run))
    chunks = max(1, -(-total // per_chunk))
    self.budget.charge(min(total, per_chunk) * per_run, "combining runs")
    all_lines = (self.batch or 1) * n_lines
    cuts = (np.arange(chunks + 1, dtype=np.int64) * all_lines // chunks) * (n_span + 1)
    out: list[tuple[np.ndarray, ...]] = []
    waiting: list[tuple[np.ndarray, ...]] = []  # pieces `(lo, hi, sx, sy)` not decided yet

    def decide_waiting():
      if waiting:
        out.append(decided(*(waiting[0] if len(waiting) == 1 else
                             (np.concatenate(v) for v in zip(*waiting)))))
        waiting.clear()

    for lo, hi in itertools.pairwise(cuts):
      held = sum(p[0].size for p in waiting)
      if held * 2 >= per_chunk:  # before the next group's pieces: memory stays bounded
        decide_waiting()
        held = 0
      parts = [slice(*np.searchsorted(x[0], [lo, hi])) for x in lists]
      pieces = pieces_of(*(tuple(v[at] for v in x) for x, at in zip(lists, parts)))
      if held + pieces[0].size > per_chunk:
        decide_waiting()
      waiting.append(pieces)
    decide_waiting()
    return tuple(np.concatenate(v) for v in zip(*out))

  def _pieces_decided(self, lo, hi, sx, sy, along_rows: bool, n_span: int, union: bool,
                      exact_part: bool = False):
    """Flat pieces `[lo, hi)` in order, in states `sx` and `sy` of two parts, as the runs
    of the whole mask: the larger state under `|` (`union`), the smaller under `&`,
    where both are PARTIAL decided tile by tile; EMPTY pieces dropped.

    `exact_part`: one of the two is exact as it stands (a band, equal reads of runs),
    so its PARTIAL tiles are mixed even where the mask is not refined: sampled pairs
    decide tiles then too (`_both_partial`).
    """
    state = np.maximum(sx, sy) if union else np.minimum(sx, sy)
    both = np.flatnonzero((sx == PARTIAL) & (sy == PARTIAL))
    if not both.size:
      keep = state != EMPTY
      return lo[keep], hi[keep], state[keep].astype(np.int8)
    blo, bhi = lo[both], hi[both]
    n = bhi - blo
    if np.all(n == 1):  # the usual case, each such piece one tile: decided in place
      state = state.astype(np.int8)
      state[both] = self._both_partial(blo, along_rows, n_span, union, exact_part)
      keep = state != EMPTY
      return lo[keep], hi[keep], state[keep]
    keep = state != EMPTY
    keep[both] = False
    tiles = self._tiles_decided(blo, n, along_rows, n_span, union, exact_part)
    lo_k, hi_k, st_k = (np.concatenate([v[keep], t]) for v, t in zip((lo, hi, state), tiles))
    order = np.argsort(lo_k, kind="stable")
    return lo_k[order], hi_k[order], st_k[order].astype(np.int8)

  def _tiles_decided(self, blo, n, along_rows: bool, n_span: int, union: bool,
                     exact_part: bool):
    """The tiles of flat pieces `[blo, blo + n)`, PARTIAL in two parts, decided for the whole
    mask (`_both_partial`) a group that fits the budget at a time, as flat runs, neighbours
    of one state merged and EMPTY ones dropped.

    A piece can be a whole line (`g[q] | g[k]` with a global token in every tile: every
    tile of the grid), so its tiles are never listed at once.
    """
    end = np.cumsum(n)
    total = int(end[-1])
    group = min(total, self.budget.items(DECIDED_TILE_BYTES))
    self.budget.charge(group * DECIDED_TILE_BYTES, "deciding tiles PARTIAL in two parts")
    out = []
    for t0 in range(0, total, group):
      t = np.arange(t0, min(t0 + group, total), dtype=np.int64)
      piece = np.searchsorted(end, t, "right")
      tile = blo[piece] + t - (end - n)[piece]
      out.append(merge_keyed(tile, tile + 1, self._both_partial(tile, along_rows, n_span,
                                                                 union, exact_part)))
    return tuple(np.concatenate(v) for v in zip(*out))

  def _both_partial(self, tile, along_rows: bool, n_span: int, union: bool,
                    exact_part: bool = False):
    """The whole mask's states of flat tiles `tile` (keys), PARTIAL in two parts joined
    by `|` (`union`) or `&`.

    Where one part is exactly mixed there (every part when refined; a band or equal reads
    always: `exact_part`), the whole `&` lies inside it and is not FULL, the whole `|`
    holds it and is not EMPTY, so one sampled pair of the other value proves the tile
    PARTIAL (`causal & document(seg) & ~pad[k]`, not refined: its diagonal tiles, 7,000
    for documents of 50-200 tokens at 1M, were each analysed by pieces). An `&` true at
    every pair `q == k` (`causal & document(seg)`: `maskc.analysis.diagonal_truth`) has that pair
    in every tile the diagonal crosses, with no pair evaluated.
    """
    bb, line, pos = split_keys(tile, self.geo.nq if along_rows else self.geo.nk, n_span,
                               True)
    i, j = (line, pos) if along_rows else (pos, line)
    st = np.full(tile.shape, PARTIAL, np.int8)
    todo = np.ones(tile.shape, bool)
    if self.refine or exact_part:
      if not (union or self.geo.positions) and self._true_on_diagonal():
        todo &= ~_diagonal_pairs(self.geo, i, j)[2]  # a true pair where the diagonal crosses
      sample = np.flatnonzero(todo)
      if sample.size:
        todo[sample] = ~_sampled_mixed(self.m, self.geo, self.tables,
                                       bb[sample] if self.batch else 0, i[sample],
                                       j[sample], union, self.budget)
    if todo.any():
      bt = bb[todo] if self.batch else 0
      # unrefined, by the pieces alone: as sharp as the analysis of the mask whole
      st[todo] = _decide_tiles(self.m, self.geo, self.tables, bt, i[todo], j[todo],
                               self.budget, self._pieces(bb[todo], i[todo], j[todo]),
                               self.batch or 1, evaluate=self.refine)
    return st


def _tile_corners(geo: TileGeometry, i, j):
  """The first and last row and column `(r0, r1, c0, c1)` of tiles `(i, j)`."""
  r0, c0 = i * geo.bq, j * geo.bk
  return (r0, np.minimum(r0 + geo.bq, geo.shape.q_len) - 1, c0,
          np.minimum(c0 + geo.bk, geo.shape.kv_len) - 1)


def _diagonal_pairs(geo: TileGeometry, i, j):
  """`(row, column, on)`: the first pair `q == k` of each tile `(i, j)` and whether the
  diagonal crosses it at all (consecutive positions only: `geo.positions` is False)."""
  r0, r1, c0, c1 = _tile_corners(geo, i, j)
  off = geo.shape.q_offset
  p = np.maximum(r0 + off, c0)
  return p - off, p, p <= np.minimum(r1 + off, c1)


def _intervals(part, geo: TileGeometry) -> Intervals | None:
  """A part's one interval per row (`maskc.lowering.closed_forms.band_runs.Intervals`): a
  band's, or a band's inside chunks (`causal & chunk(8192)`, lowered by its period) in the
  closed form's range (`band_fits`)."""
  if isinstance(part, BandRuns):
    return Intervals(*part.band)
  if not isinstance(part, _PeriodicRuns):
    return None
  found = Intervals.of(part.m)
  if found is None or not band_fits(geo, (found.lo, found.hi, found.chunk)):
    return None
  return found


def _exact_runs(part) -> bool:
  """Whether a part's runs are exact however the mask is lowered: a band's closed form,
  equal reads of runs (`_EqualRuns`), a part of one axis whose analysis left no tile
  ambiguous (`g[k]`: a tile holding some global keys is PARTIAL in every row); other
  analysed parts are exact only when refined."""
  return isinstance(part, (BandRuns, _EqualRuns)) or (isinstance(part, _AxisRuns) and
                                                      part.exact)


def _flat_runs(part, along_rows: bool, n_lines: int, n_span: int):
  """A part's runs as flat runs (`keyed`): a part that is itself an `&` / `|` hands them
  over as it combined them (`causal & ~img[k] | bidirectional(img)` at 1M: 523K runs not
  split into lines and keyed again), equal reads as they find them, by flat line."""
  if isinstance(part, (_CombinedRuns, _EqualRuns)):
    return part.flat(along_rows)
  return keyed(part.merged(along_rows), n_lines, n_span)


def _sampled_mixed(m: ir.Mask, geo: TileGeometry, tables: Tables, b, i, j, union: bool,
                   budget: Budget):
  """Which tiles `(b, i, j)`, PARTIAL in two exactly mixed parts, hold a true pair of the
  `&` of them (a false one of the `|`) among a few sampled pairs: then the tile is mixed.

  Both parts mixed put a false pair in the `&` (a true one in the `|`): one sampled
  pair of the other value decides the tile PARTIAL, with no pieces and no analysis
  of sub-rectangles. Without explicit positions, the first sample of an `&` is where
  the tile's rows and columns meet on the diagonal `q == k`, true for `causal &
  document(seg)`'s diagonal tiles, the common case (documents of 50-200 tokens at
  1M: about 7,000); then the corners of the tiles not decided yet. An `|` samples
  the corners first: a band in it (`causal & chunk(8192) | bidirectional(img)`)
  holds on the diagonal, its false pairs lie at corners off it. Pairs are
  evaluated with per-token operands read through their runs (`_RunReads`), a bounded
  chunk of tiles at a time.
  """
  per_tile = SAMPLE_BYTES + SAMPLE_GROUP * NODE_BYTES * ir.expanded_size(m, 1 << 12)
  chunk = max(1, min(SAMPLE_CHUNK, budget.items(per_tile)))
  budget.charge(min(i.size, chunk) * per_tile, "sampling pairs of tiles")
  out = [_sampled_chunk(m, geo, tables, b if np.isscalar(b) else b[s:s + chunk],
                        i[s:s + chunk], j[s:s + chunk], union)
         for s in range(0, i.size, chunk)]
  return np.concatenate(out) if out else np.zeros(0, bool)


def _sampled_chunk(m: ir.Mask, geo: TileGeometry, tables: Tables, b, i, j, union: bool):
  """`_sampled_mixed` of one chunk."""
  r0, r1, c0, c1 = _tile_corners(geo, i, j)
  samples = [(r0, c0), (r0, c1), (r1, c0), (r1, c1)]
  if not geo.positions:
    row, col, on = _diagonal_pairs(geo, i, j)
    diagonal = (np.where(on, row, r0), np.where(on, col, c0))
    samples = samples + [diagonal] if union else [diagonal] + samples
  reads = _RunReads(tables)
  proved = np.zeros(i.shape, bool)
  split = SAMPLE_GROUP if union else 1
  for group in (samples[:split], samples[split:]):
    todo = np.flatnonzero(~proved)
    if not (todo.size and group):
      break
    rows = np.concatenate([r[todo] for r, _ in group])
    cols = np.concatenate([c[todo] for _, c in group])
    bb = b if np.isscalar(b) else np.tile(b[todo], len(group))
    v = evaluate_mask(m, Env(np, geo.q_at(bb, rows), geo.k_at(bb, cols), reads, bb))
    proof = ~v if union else v
    proved[todo] = proof.reshape(len(group), todo.size).any(axis=0)
  return proved


class _RunReads:
  """Operand arrays for evaluating a few pairs: a per-token operand not written out yet
  (`maskc.semantics.operand_arrays`) is read through its run table instead of written out."""

  def __init__(self, tables: Tables):
    self.tables = tables

  def __getitem__(self, name: str):
    arrays = self.tables.arrays
    if getattr(arrays, "written", lambda _: True)(name):
      return arrays[name]
    return _TokenReads(self.tables.run_table(name))


class _TokenReads:
  """`a[row, idx]` of a per-token operand `a`, read from its run table (`values_at`)."""

  def __init__(self, table: RunTable):
    self.table = table
    self.shape = (table.batch, table.length)

  def __getitem__(self, at):
    return self.table.values_at(*at)


def _union_pieces(x, y):
  """The pieces between consecutive boundaries of two sorted flat run lists, in order, with
  each list's state on them (EMPTY outside its runs)."""
  # Each list's starts and stops interleave in order, so their concatenation is two
  # sorted runs (a linear merge), and a list covers a cut iff an odd number of its
  # boundaries lie at or before it: the last one was a start. Between lines lies a
  # key no run covers, so a piece reaching over it is EMPTY in both lists: dropped.
  xb, yb = (np.stack(v[:2], axis=1).reshape(-1) for v in (x, y))
  cuts = np.concatenate([xb, yb])
  order = np.argsort(cuts, kind="stable")
  cuts = cuts[order]
  # pieces start at the last of equal cuts (which counts all of them) and end at the next
  at = np.flatnonzero(cuts[1:] != cuts[:-1])
  nx = np.cumsum(order < xb.size)[at]
  ny = at + 1 - nx
  # the state after n boundaries: a run's for odd n (inside it), EMPTY for even n
  sx, sy = (np.zeros(2 * v[2].size + 1, np.int8) for v in (x, y))
  sx[1::2], sy[1::2] = x[2], y[2]
  return cuts[at], cuts[at + 1], sx[nx], sy[ny]


def _meeting_pieces(x, y):
  """The intersections of each run of one sorted flat run list with each of the other's, in
  order, with both lists' states: the pieces of `_union_pieces` inside both lists' runs,
  found by binary searches instead of a merge of every boundary."""
  (xa, xz, xs), (ya, yz, ys) = x, y
  first, stop = overlapping(xa, xz, ya, yz)  # the runs of y that meet each of x's
  count = stop - first
  i = np.repeat(np.arange(xa.size), count)
  j = ranges(first, count)
  return (np.maximum(xa[i], ya[j]), np.minimum(xz[i], yz[j]), xs[i], ys[j])


def compile_static(masks, shape: Shape, operands: Mapping[str, Any], batch: int | None,
                   block_q: int, block_kv: int, refine: list[bool], budget: Budget | None = None,
                   forms: dict[str, RunForm] | None = None):
  """Per-q-tile runs `[B, U, nq, R]` of the masks, and the memo computing the per-key-tile runs.

  `forms`: the per-token operands' runs where binding already found them.
  """
  geo = TileGeometry(shape, block_q, block_kv)
  budget = budget or Budget(MEMORY_BUDGET)
  # shared: tables are built for the operands masks read
  tables = Tables(np, operands, forms, budget=budget, same_runs=enabled("same_run_ids"))
  per_mask = [_runs_of_mask(m, geo, tables, batch, ref, budget) for m, ref in zip(masks, refine)]
  if tables.same_runs_used:
    took("same_run_ids")
  return stack_runs([r.runs(along_rows=True) for r in per_mask]), _Backward(per_mask)
