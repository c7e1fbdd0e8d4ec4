"""The generic range analysis of the static lowering: the fallback every other way reaches
the same tiles as.

Rectangles of tiles are classified by range analysis (`maskc.semantics.ranges`) and the
PARTIAL ones split in two dimensions, first where an operand changes (`_split_hints`:
between such cuts every read is constant, so the analysis is as sharp as without
operands), then in halves, until each is decided, a single tile, or a strip of tiles the
operand pieces prove PARTIAL throughout (`_leaves`). Ambiguous single tiles are decided
by finer analysis and evaluation (`decide_tiles`). `GenericRuns` packs the decided
rectangles into runs along either axis. Cost: the tiles on the mask's boundary plus the
operand runs, times a logarithm.

The analysis rules (step "start", `maskc.lowering.rules.STEPS`) shorten it: where one gives
the rectangles the operands allow a true pair in, the analysis starts from those
(`maskc.lowering.generic.dispatch` asks them, and hands them to `GenericRuns`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from maskc.arrays.ragged import ranges
from maskc.compiled.tiles import Runs
from maskc.language import ir
from maskc.lowering.grid.forms import Array, Form, LineRuns, pack_runs
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget, analysis_bytes, evaluate_tiles, subdivide
from maskc.lowering.grid.run_lists import expand_in_order, merge_runs
from maskc.lowering.tuning import (
  EVAL_CHUNK,
  EXPANDED_RUN_BYTES,
  FEW_RECTS,
  LEAF_CHUNK,
  MEMORY_BUDGET,
  MIN_ROUND,
  PIECE_BYTES,
  PIECE_CHUNK,
  RECT_BYTES,
  SIDE_PARTS,
  SMALL_COVER,
  STRIP_PARTS,
)
from maskc.semantics.operand_runs import Pieces, line_pieces, reads_at
from maskc.semantics.ranges import EMPTY, FULL, PARTIAL, Analyzer, Tables

# Rectangles of tiles `(b, i0, i1, j0, j1)`: batch row, q tiles `[i0, i1)`, key tiles `[j0, j1)`.
Rects = tuple[Array, Array, Array, Array, Array]
# Decided rectangles `(b, i0, i1, j0, j1, state)`, non-EMPTY: the analysis's leaves.
Leaves = tuple[Array, Array, Array, Array, Array, Array]


def _combine_pieces(item: Array, n_items: int, state: Any,
                    certain: Any) -> tuple[Array, Array, Array]:
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


def _decide_by_pieces(m: ir.Mask, geo: TileGeometry, tables: Tables, b: Array | int, i: Array,
                      j: Array, pieces: tuple[Pieces, Pieces], nb: int) -> tuple[Array, Array]:
  """States of tiles `(b, i, j)` from their operand pieces; and whether each stays ambiguous."""
  row_pieces, col_pieces = pieces
  bb = np.zeros_like(i) if isinstance(b, (int, np.integer)) else b
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


def decide_tiles(m: ir.Mask, geo: TileGeometry, tables: Tables, b: Array | int, i: Array,
                 j: Array, budget: Budget, pieces: tuple[Pieces, Pieces] | None = None,
                 nb: int = 1, evaluate: bool = True, beside: int = 0) -> Array:
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
      state, ambiguous = _decide_by_pieces(m, geo, tables, _at(b, sl), i[sl], j[sl], pieces,
                                           nb)
      out[sl] = state
      todo[sl] = ambiguous
  for parts in (4, 16):
    if not evaluate or not todo.any() or parts > max(geo.bq, geo.bk):
      break
    idx = np.flatnonzero(todo)
    step = max(1, chunk_items // (parts * parts))
    for s0 in range(0, idx.size, step):
      sub = idx[s0:s0 + step]
      state, ambiguous = subdivide(m, geo, tables, np, _at(b, sub), i[sub], j[sub], parts)
      out[sub] = state
      todo[sub] = ambiguous
  idx = np.flatnonzero(todo)
  if idx.size and evaluate:
    budget.charge(min(EVAL_CHUNK, geo.bq * geo.bk) * 64, "evaluating a tile")
    out[idx] = evaluate_tiles(m, geo, tables, np, _at(b, idx), i[idx], j[idx])
  return out


def _at(b: Array | int, at: Any) -> Array | int:
  """Batch rows `b` at `at` (a slice or indices), or 0 for every tile of batch row 0."""
  return 0 if isinstance(b, (int, np.integer)) else b[at]


def _leaves(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None, budget: Budget,
            pieces: tuple[Pieces, Pieces] | None, hints: tuple[Hints, Hints],
            start: Rects | None = None) -> list[Array]:
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
  pending: list[tuple[Array, ...]] = [
      start or (np.arange(nb, dtype=np.int64), zeros, zeros + geo.nq, zeros, zeros + geo.nk)]
  done: list[tuple[Array, ...]] = []
  held = nbytes(pending[0])  # what `pending` and `done` hold
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
    held += nbytes(done[-1])
    split = ~fin
    if split.any():
      pending.append(_split(tuple(x[split] for x in rect), hints, geo.nq, geo.nk))
      held += nbytes(pending[-1])
    held -= nbytes(rect)
  if not done:
    return [np.zeros(0, np.int64)] * 5 + [np.zeros(0, np.int8), np.zeros(0, bool)]
  budget.charge(2 * held, "the decided rectangles of tiles")  # the parts and their concatenation
  return [np.concatenate(x) for x in zip(*done)]


def nbytes(arrays: Sequence[Array]) -> int:
  """The bytes `arrays` hold."""
  return sum(x.nbytes for x in arrays)


def hold_leaves(leaves: Leaves, budget: Budget) -> Leaves:
  """`leaves`, held in `budget` for as long as the lowering keeps them."""
  budget.hold(nbytes(leaves), "the decided rectangles of tiles")
  return leaves


def _split(rect: tuple[Array, ...], hints: tuple[Hints, Hints], nq: int,
           nk: int) -> tuple[Array, ...]:
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
  over the mask) drop by a factor of three (`causal`'s period, one row of tiles over
  every column: `docs/lowering.md`, "Measurements behind the design").

  In a round of at most `FEW_RECTS` rectangles, whose cost is mostly fixed,
  rectangles without hints are cut into `SIDE_PARTS` x `SIDE_PARTS` instead of
  halved: a boundary is followed down to single tiles in half the rounds, for
  more rectangles analysed per round (`causal & chunk(8192)`'s period: `docs/lowering.md`,
  "Measurements behind the design").
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


def _side_cuts(lo: Array, hi: Array, hint: Array, hinted: Array, free: Array,
               ways: int) -> Array:
  """`ways + 1` cut points of each side: `lo, hint, ..., hint, hi` where it has a hint, `ways`
  equal parts where the rectangle has no hints, else the side whole (repeated cuts make
  empty parts)."""
  t = np.arange(ways + 1)[:, None]
  equal = lo + (hi - lo) * t // ways
  at_hint = np.where(t == 0, lo, np.where(t == ways, hi, hint))
  whole = np.where(t == 0, lo, hi)
  return np.where(hinted, at_hint, np.where(free, equal, whole))


def _cut_strips(rect: tuple[Array, ...], parts: int) -> tuple[Array, ...]:
  """Strips of tiles one tile thick, each cut along its length into `parts` equal parts."""
  b, i0, i1, j0, j1 = rect
  rows = i1 - i0 > 1  # a column of tiles: cut its rows
  lo, hi = np.where(rows, i0, j0), np.where(rows, i1, j1)
  cuts = lo + (hi - lo) * np.arange(parts + 1)[:, None] // parts
  a, z = cuts[:-1].reshape(-1), cuts[1:].reshape(-1)
  rows, b, i0, i1, j0, j1 = (np.tile(x, parts) for x in (rows, b, i0, i1, j0, j1))
  return (b, np.where(rows, a, i0), np.where(rows, z, i1), np.where(rows, j0, a),
          np.where(rows, j1, z))


def _median_hint(hints: Hints, b: Array, lo: Array, hi: Array, n: int) -> tuple[Array, Array]:
  """The median hint strictly inside `(lo, hi)` of batch row `b`, and how many there are."""
  if not hints.at.size:
    return hi, np.zeros(b.shape, np.int64)
  base = b * (n + 1)
  first = hints.upto[base + lo]     # hints at or before lo
  last = hints.upto[base + hi - 1]  # hints before hi (hi > lo >= 0)
  count = last - first
  mid = hints.at[np.clip((first + last) // 2, 0, hints.at.size - 1)] - base
  return np.where(count > 0, mid, hi), count


class Hints(NamedTuple):
  """Sorted flat tile boundaries `b * (n + 1) + t` (`at`), and how many lie at or before
  each boundary (`upto`, `[nb * (n + 1)]`): counting them is a gather, not a search."""
  at: Array
  upto: Array

  @classmethod
  def of(cls, bounds: Array, size: int) -> Hints:
    """From flat boundaries (in `[0, size)`, repeats allowed)."""
    marked = np.bincount(bounds, minlength=size).astype(bool)
    return cls(np.flatnonzero(marked), np.cumsum(marked, dtype=np.int32))


NO_HINTS = Hints(np.zeros(0, np.int64), np.zeros(0, np.int32))


def _split_hints(m: ir.Mask, geo: TileGeometry, tables: Tables, nb: int, along_rows: bool,
                 budget: Budget) -> Hints:
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
  return Hints.of(np.concatenate(out), nb * (n + 1))


def _strip_pieces(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None,
                  along_rows: bool, pieces: Pieces, b: Array, i0: Array, i1: Array, j0: Array,
                  j1: Array, max_pieces: int) -> tuple[Array, Array, Array]:
  """(state, uniform, mixed) of strips one tile thick, from the pieces of their line, with at
  most about `max_pieces` pieces analysed at once."""
  n_lines = geo.nq if along_rows else geo.nk
  line = i0 if along_rows else j0
  flat = b * n_lines + line
  ends = np.cumsum(pieces.count[flat])
  out: list[tuple[Array, Array, Array]] = []
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
  if len(out) == 1:
    return out[0]
  st, uniform, mixed = (np.concatenate(x) for x in zip(*out))
  return st, uniform, mixed


def _line_pieces(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None,
                 budget: Budget) -> tuple[Pieces, Pieces] | None:
  """The row and column pieces of the grid's lines; None with batched positions.

  Pieces are cut in position space, the same for every batch row: not with
  batched positions, whose ambiguous tiles are refined without them.
  """
  if geo.batched_positions:
    return None
  return (pieces_of_lines(m, geo, tables, batch, True, budget),
          pieces_of_lines(m, geo, tables, batch, False, budget))


def pieces_of_lines(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None,
                    along_rows: bool, budget: Budget, lines: Array | None = None) -> Pieces:
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


class GenericRuns:
  """The runs of one mask along rows now and along columns on demand, from one set of leaves.

  Backward passes need the per-key-tile runs; a forward-only user never pays for
  packing them. Ambiguous single tiles are decided once, for both.
  """

  forms = frozenset({Form.PIECES})
  exact = False  # exact where refined

  def __init__(self, m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None,
               refine: bool, budget: Budget | None = None, start: Rects | None = None):
    """`start`: the rectangles of tiles where the operands allow a true pair (an analysis
    rule's, step "start"); None: the whole grid."""
    self.m, self.geo, self.batch = m, geo, batch
    self.budget = budget or Budget(MEMORY_BUDGET)
    nb = batch or 1
    self.pieces = _line_pieces(m, geo, tables, batch, self.budget)
    hints = (_split_hints(m, geo, tables, nb, True, self.budget),
             _split_hints(m, geo, tables, nb, False, self.budget))
    if start is not None:
      start = _small_as_tiles(start)
    self.leaves = hold_leaves(decided_leaves(m, geo, tables, batch, refine, self.budget,
                                             self.pieces, hints, start), self.budget)

  def merged(self, along_rows: bool) -> LineRuns:
    """The runs as sorted, merged `(b, line, a, z, state)` arrays."""
    _, i0, i1, j0, j1, _ = self.leaves
    runs = int(((i1 - i0) if along_rows else (j1 - j0)).sum())
    # the leaves sorted (a copy), their runs, and the runs sorted (a copy and the order)
    self.budget.charge(nbytes(self.leaves) + runs * EXPANDED_RUN_BYTES, "the packed runs")
    n_lines = self.geo.nq if along_rows else self.geo.nk
    return merge_runs(*expand_in_order(self.leaves, along_rows, n_lines), in_order=True)

  def runs(self, along_rows: bool) -> Runs:
    return pack_runs(*self.merged(along_rows), self.batch or 1,
                     self.geo.nq if along_rows else self.geo.nk)


def _small_as_tiles(rects: Rects) -> Rects:
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


def decided_leaves(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None,
                   refine: bool, budget: Budget, pieces: tuple[Pieces, Pieces] | None = None,
                   hints: tuple[Hints, Hints] | None = None, start: Rects | None = None
                   ) -> Leaves:
  """The non-EMPTY leaves `(b, i0, i1, j0, j1, state)` of the grid (or of rectangles `start`).

  Ambiguous single tiles are decided exactly when `refine`; otherwise they stay PARTIAL.
  A caller that keeps the leaves holds them in the budget (`hold_leaves`).
  """
  return leaves_and_exactness(m, geo, tables, batch, refine, budget, pieces, hints, start)[0]


def leaves_and_exactness(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None,
                         refine: bool, budget: Budget,
                         pieces: tuple[Pieces, Pieces] | None = None,
                         hints: tuple[Hints, Hints] | None = None, start: Rects | None = None
                         ) -> tuple[Leaves, bool]:
  """`decided_leaves`, and whether they are exact: every PARTIAL leaf proven mixed in each
  of its tiles (refined, or no ambiguous one left), as FULL and EMPTY leaves always are."""
  if hints is None:
    hints = (NO_HINTS, NO_HINTS)
  leaves = _leaves(m, geo, tables, batch, budget, pieces, hints, start)
  b, i0, i1, j0, j1, state, ambiguous = leaves
  held = nbytes(leaves)
  if refine and ambiguous.any():
    idx = np.flatnonzero(ambiguous)  # single tiles
    state[idx] = decide_tiles(m, geo, tables, b[idx] if batch else 0, i0[idx], j0[idx],
                               budget, pieces, batch or 1, beside=held + idx.nbytes)
  keep = state != EMPTY
  budget.charge(held + nbytes(leaves[:6]), "the decided rectangles of tiles")
  exact = refine or not ambiguous.any()
  kb, ki0, ki1, kj0, kj1, kst = (x[keep] for x in (b, i0, i1, j0, j1, state))
  return (kb, ki0, ki1, kj0, kj1, kst), exact
