"""The static lowering path: every operand a NumPy value.

For all q tiles at once, classify the whole run of key tiles with range analysis,
keep runs that are EMPTY or FULL, and bisect the PARTIAL ones, until every run is
decided or a single tile. The work is proportional to the tiles on the mask's
boundary times the log of the grid width, the tile grid is never allocated, and no
`q_len × kv_len` array ever exists. The same runs are computed per key tile for the
backward pass, on demand.
"""

from __future__ import annotations

import numpy as np

from maskc import _ir as ir
from maskc._analysis import EMPTY, FULL, PARTIAL, Analyzer, Tables
from maskc._bind import Shape
from maskc._operand_runs import Pieces, line_pieces, reads_at
from maskc._tile_geometry import TileGeometry
from maskc._tile_refine import (EVAL_CHUNK, ITEM_BYTES, MEMORY_BUDGET, PIECE_CHUNK,
                                 Budget, evaluate_tiles, subdivide)
from maskc._tiles import Runs


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
                  pieces=None, nb: int = 1):
  """Exact states of ambiguous tiles: by finer analysis where it suffices, else by evaluation.

  Finer analysis first cuts tiles at their operands' changes (exact for prelude
  masks), then into 4 x 4 and 16 x 16 sub-rectangles; tiles still undecided are
  evaluated. Every step works in chunks that fit the memory budget.
  """
  out = np.full(i.shape, PARTIAL, np.int8)
  todo = np.ones(i.shape, bool)
  chunk_items = min(PIECE_CHUNK, budget.items(ITEM_BYTES))
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
    if not todo.any() or parts > max(geo.bq, geo.bk):
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
  if idx.size:
    budget.charge(min(EVAL_CHUNK, geo.bq * geo.bk) * 64, "evaluating a tile")
    out[idx] = evaluate_tiles(m, geo, tables, np, b[idx] if not np.isscalar(b) else 0, i[idx],
                               j[idx])
  return out


def _frontier(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None, along_rows: bool,
              budget: Budget, pieces: Pieces | None = None, by_pieces: bool = False,
              cuts: np.ndarray | None = None):
  """Decided runs `(b, line, a, z, state, ambiguous)` covering every line of tiles.

  Runs start as whole lines (cut before and after each tile of `cuts`, the
  tiles along the line where an operand changes, when given) and PARTIAL ones
  are bisected, a bounded chunk of runs at a time. With `pieces` (lines cut at
  their operands' changes), a run is also decided when one piece is FULL and
  another EMPTY over it: every tile of the run is then PARTIAL, so the run needs
  no bisection. With `by_pieces` the states come from the pieces, which is exact
  where the whole tile's analysis is not.
  """
  n_lines, n_span = (geo.nq, geo.nk) if along_rows else (geo.nk, geo.nq)
  nb = batch or 1
  bounds = np.asarray([0, n_span], np.int64)
  if cuts is not None and cuts.size:
    bounds = np.unique(np.concatenate([bounds, cuts, cuts + 1]))
    bounds = bounds[(bounds >= 0) & (bounds <= n_span)]
  per_line = bounds.size - 1
  use_pieces = pieces is not None and pieces.cut
  chunk = max(1, min(1 << 16, budget.items(ITEM_BYTES * (2 if use_pieces else 1))))
  budget.charge(nb * n_lines * per_line * 40, "the initial runs")
  line = np.tile(np.repeat(np.arange(n_lines, dtype=np.int64), per_line), nb)
  b = np.repeat(np.arange(nb, dtype=np.int64), n_lines * per_line)
  a = np.tile(bounds[:-1], nb * n_lines)
  z = np.tile(bounds[1:], nb * n_lines)
  pending = [(b, line, a, z)]
  done = []
  while pending:
    b, line, a, z = pending.pop()
    if line.size > chunk:  # split the work, not the runs: bounded memory per step
      pending.append((b[chunk:], line[chunk:], a[chunk:], z[chunk:]))
      b, line, a, z = b[:chunk], line[:chunk], a[:chunk], z[:chunk]
    single = (z - a) == 1
    if use_pieces and by_pieces:
      state, certain, uniform = _frontier_pieces(m, geo, tables, batch, along_rows, pieces,
                                                 b, line, a, z)
    else:
      state, certain = _analyse_runs(m, geo, tables, batch, along_rows, b, line, a, z)
      uniform = np.zeros(line.shape, bool)
      if use_pieces:
        sel = np.flatnonzero((state == PARTIAL) & ~single)
        if sel.size:
          _, _, uni = _frontier_pieces(m, geo, tables, batch, along_rows, pieces, b[sel],
                                       line[sel], a[sel], z[sel])
          uniform[sel] = uni
    if geo.positions:  # certainty and uniformity need real positions (dense tiles)
      dq, dk = (line, a) if along_rows else (a, line)
      line_dense = np.asarray(geo.dense_q(b, dq) if along_rows else geo.dense_k(b, dk))
      other_dense = np.asarray(geo.dense_k(b, dk) if along_rows else geo.dense_q(b, dq))
      certain = np.asarray(certain) & line_dense & other_dense
      uniform = np.asarray(uniform) & line_dense
    fin = (state != PARTIAL) | single | uniform
    done.append((b[fin], line[fin], a[fin], z[fin], state[fin], (~certain[fin]) &
                 (state[fin] == PARTIAL) & ~uniform[fin]))
    split = ~fin
    if split.any():
      mid = (a[split] + z[split]) // 2
      pending.append((np.concatenate([b[split], b[split]]),
                      np.concatenate([line[split], line[split]]),
                      np.concatenate([a[split], mid]), np.concatenate([mid, z[split]])))
  return [np.concatenate(c) for c in zip(*done)]


def _change_tiles(pieces: Pieces, nb: int, limit: int = 64) -> np.ndarray | None:
  """Tiles (indices along a line) where an operand read along that axis changes, if few."""
  n = pieces.count.size // nb
  changed = np.flatnonzero((pieces.count > 1).reshape(nb, n).any(axis=0))
  return changed if 0 < changed.size <= limit else None


def _analyse_runs(m, geo: TileGeometry, tables: Tables, batch, along_rows: bool, b, line, a, z):
  """(state, certain) of runs `[a, z)` of tiles on lines `line`, by whole-rectangle analysis."""
  if along_rows:
    ql, qh = geo.q_bounds(line, line + 1, b)
    kl, kh = geo.k_bounds(a, z, b)
  else:
    ql, qh = geo.q_bounds(a, z, b)
    kl, kh = geo.k_bounds(line, line + 1, b)
  t = Analyzer(np, tables, ql, qh, kl, kh, b if batch else 0).truth(m)
  state = np.broadcast_to(np.asarray(t.state, np.int8), line.shape)
  certain = np.broadcast_to(np.asarray(t.certain, bool), line.shape)
  return state, certain


def _frontier_pieces(m, geo: TileGeometry, tables: Tables, batch, along_rows: bool, pieces: Pieces,
                     b, line, a, z):
  """(state, certain, uniform) of runs from the pieces of their lines (see `_combine_pieces`)."""
  n_lines = geo.nq if along_rows else geo.nk
  item, plo, phi = pieces.expand(b * n_lines + line)
  if along_rows:
    kl, kh = geo.k_bounds(a[item], z[item], b[item])
    ql, qh = plo, phi
  else:
    ql, qh = geo.q_bounds(a[item], z[item], b[item])
    kl, kh = plo, phi
  t = Analyzer(np, tables, ql, qh, kl, kh, b[item] if batch else 0).truth(m)
  state, uniform, mixed = _combine_pieces(item, line.size, t.state, t.certain)
  return state, mixed, uniform


def _pack_runs(b, line, a, z, state, nb: int, n_lines: int) -> Runs:
  """Sorted, merged runs of non-empty tiles packed into `[nb, n_lines, R]` arrays."""
  keep = state != EMPTY
  b, line, a, z, state = b[keep], line[keep], a[keep], z[keep], state[keep]
  order = np.lexsort((a, line, b))
  b, line, a, z, state = b[order], line[order], a[order], z[order], state[order]
  if b.size:
    new = np.ones(b.size, bool)
    new[1:] = (b[1:] != b[:-1]) | (line[1:] != line[:-1]) | (state[1:] != state[:-1]) | (
        a[1:] != z[:-1])
    starts = np.flatnonzero(new)
    b, line, state, a = b[starts], line[starts], state[starts], a[starts]
    z = np.maximum.reduceat(z, starts)
  flat_line = b * n_lines + line
  count = np.bincount(flat_line, minlength=nb * n_lines).astype(np.int32)
  r = max(1, int(count.max()) if count.size else 1)
  first = np.concatenate([[0], np.cumsum(count)[:-1]])
  slot = np.arange(flat_line.size) - first[flat_line]
  shape = (nb * n_lines, r)
  start = np.zeros(shape, np.int32)
  stop = np.zeros(shape, np.int32)
  st = np.zeros(shape, np.int8)
  start[flat_line, slot] = a
  stop[flat_line, slot] = z
  st[flat_line, slot] = state
  return Runs(start.reshape(nb, n_lines, r), stop.reshape(nb, n_lines, r),
              st.reshape(nb, n_lines, r), count.reshape(nb, n_lines))


class _StaticRuns:
  """The runs of one mask along rows now and along columns on demand.

  Backward passes need the per-key-tile runs; a forward-only user never pays for
  them. Tiles refined for the rows are remembered, so the columns reuse them.
  """

  def __init__(self, m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None, refine: bool,
               budget: Budget | None = None):
    self.m, self.geo, self.tables, self.batch, self.refine = m, geo, tables, batch, refine
    self.budget = budget or Budget(MEMORY_BUDGET)
    self.refined_keys = np.zeros(0, np.int64)  # flat ids of refined tiles, sorted
    self.refined_states = np.zeros(0, np.int8)
    # Pieces are cut in position space, the same for every batch row: not with
    # batched positions, whose ambiguous tiles are refined without them.
    self.pieces = None if geo.batched_positions else (
        _pieces(m, geo, tables, batch, True, self.budget),
        _pieces(m, geo, tables, batch, False, self.budget))

  def runs(self, along_rows: bool) -> Runs:
    geo, batch = self.geo, self.batch
    line_pieces_ = None if self.pieces is None else self.pieces[0 if along_rows else 1]
    cuts = None if self.pieces is None else _change_tiles(self.pieces[1 if along_rows else 0],
                                                          batch or 1)
    b, line, a, z, state, ambiguous = _frontier(self.m, geo, self.tables, batch, along_rows,
                                                self.budget, line_pieces_, self.refine, cuts)
    if self.refine and ambiguous.any():
      idx = np.flatnonzero(ambiguous)
      ti, tj = (line[idx], a[idx]) if along_rows else (a[idx], line[idx])
      key = (b[idx] * geo.nq + ti) * geo.nk + tj  # flat tile ids; decisions are shared
      known = np.isin(key, self.refined_keys)
      todo = np.flatnonzero(~known)
      if todo.size:
        new = _decide_tiles(self.m, geo, self.tables, b[idx][todo] if batch else 0, ti[todo],
                            tj[todo], self.budget, self.pieces, batch or 1)
        keys = np.concatenate([self.refined_keys, key[todo]])
        order = np.argsort(keys, kind="stable")
        self.refined_keys = keys[order]
        self.refined_states = np.concatenate([self.refined_states, new])[order]
      state = state.copy()
      state[idx] = self.refined_states[np.searchsorted(self.refined_keys, key)]
    self.budget.charge(state.size * 24, "the packed runs")
    return _pack_runs(b, line, a, z, state, batch or 1, geo.nq if along_rows else geo.nk)


def _pieces(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None, along_rows: bool,
            budget: Budget) -> Pieces:
  """Each q tile row (or k tile column) cut at the changes of the operands read along it."""
  nb = batch or 1
  if along_rows:
    lo, hi = geo.q_bounds(np.arange(geo.nq), np.arange(1, geo.nq + 1))
  else:
    lo, hi = geo.k_bounds(np.arange(geo.nk), np.arange(1, geo.nk + 1))
  lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
  reads = reads_at(m, "q" if along_rows else "k")
  for name, _ in reads:
    t = tables.arrays[name]
    budget.charge(t.size * 2 + lo.size * nb * 64, f"the runs of operand `{name}`")
    tables.run_table(name)
  return line_pieces({n: tables.run_table(n) for n, _ in reads}, reads, nb, lo, hi)


def _stack_runs(runs: list[Runs]) -> Runs:
  r = max(x.start.shape[-1] for x in runs)
  def pad(arr):
    return np.pad(arr, [(0, 0)] * (arr.ndim - 1) + [(0, r - arr.shape[-1])])
  return Runs(*(np.stack([pad(getattr(x, f)) for x in runs], axis=1) for f in ("start", "stop",
                                                                                "state")),
              np.stack([x.count for x in runs], axis=1))


class _Backward:
  """Computes the per-key-tile runs of a static map once, when a backward pass first asks.

  The compiler's memo, handed to the `BlockMap` as a function: the map never changes.
  """

  def __init__(self, per_mask: list[_StaticRuns]):
    self.per_mask = per_mask
    self.runs: Runs | None = None

  def __call__(self) -> Runs:
    if self.runs is None:
      self.runs = _stack_runs([r.runs(along_rows=False) for r in self.per_mask])
      self.per_mask = []
    return self.runs


def compile_static(masks, shape: Shape, operands: dict, batch: int | None, block_q: int,
                   block_kv: int, refine: list[bool], budget: Budget | None = None):
  """Per-q-tile runs `[B, U, nq, R]` of the masks, and the memo computing the per-key-tile runs."""
  geo = TileGeometry(shape, block_q, block_kv)
  tables = Tables(np, operands)  # shared: tables are built for the operands masks read
  per_mask = [_StaticRuns(m, geo, tables, batch, ref, budget)
              for m, ref in zip(masks, refine)]
  return _stack_runs([r.runs(along_rows=True) for r in per_mask]), _Backward(per_mask)
