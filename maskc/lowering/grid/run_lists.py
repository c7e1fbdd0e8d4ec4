"""Lists of runs of tiles in NumPy: sorted, merged, expanded from leaves, combined by keys.

The static lowering describes a mask by runs `(b, line, a, z, state)`
(`maskc.lowering.grid.forms.LineRuns`): tiles `[a, z)` of line `line` (a q tile row, or
a key tile column for the backward pass) of batch row `b`, in one state, PARTIAL or FULL.
Its ways of lowering (leaves of analysis, periodic repeats, equal reads, parts of one
axis) each make such lists; here they are sorted and merged, and flat runs (one sorted
key per tile, `maskc.lowering.grid.forms.FlatRuns`) of many lines are combined as one.
The forms themselves and the conversions between them are in `maskc.lowering.grid.forms`.
"""

from __future__ import annotations

import numpy as np

from maskc.arrays.ragged import group_ends, ranges
from maskc.compiled.tiles import EMPTY, Runs
from maskc.lowering.grid.forms import Array, FlatRuns, LineRuns


def lines_of(key: Array, n_span: int) -> Array:
  """The distinct flat lines of sorted keys (`keyed`), in order."""
  line: Array = key // (n_span + 1)
  if line.size < 2:
    return line
  distinct: Array = line[np.append(True, line[1:] != line[:-1])]
  return distinct


def on_lines_mask(key: Array, lines: Array, n_span: int) -> Array:
  """Which sorted keys (`keyed`) lie on one of the sorted distinct flat `lines`: each
  line's keys found by binary search, not each key's line."""
  start = lines * (n_span + 1)
  return marked(key.size, np.searchsorted(key, start),
                np.searchsorted(key, start + (n_span + 1)))


def overlapping(a: Array, z: Array, starts: Array, stops: Array) -> tuple[Array, Array]:
  """For each run `[a, z)`: the range `[lo, hi)` (`hi >= lo`) of the sorted disjoint runs
  `[starts, stops)` that overlap it, by binary search (the runs of one list are disjoint,
  so their starts and their stops are both sorted)."""
  lo = np.searchsorted(stops, a, "right")  # the first that stops after a
  return lo, np.maximum(np.searchsorted(starts, z, "left"), lo)  # past the last before z


def marked(size: int, lo: Array, hi: Array) -> Array:
  """A mask of `size` flags, set in every range `[lo, hi)`."""
  out = np.zeros(size, bool)
  out[ranges(lo, hi - lo)] = True
  return out


def meeting_mask(x: FlatRuns, y: FlatRuns) -> Array:
  """Which runs of sorted flat run list `x` (`keyed`) overlap a run of sorted flat run list
  `y`: each of y's runs finds the range of x's it meets (`overlapping`)."""
  return marked(x[0].size, *overlapping(y[0], y[1], x[0], x[1]))


def on_lines(runs: FlatRuns, lines: Array, n_span: int) -> FlatRuns:
  """Flat runs `(start key, stop key, state)` (`keyed`) of the sorted flat `lines` only."""
  keep = on_lines_mask(runs[0], lines, n_span)
  return FlatRuns(*(x[keep] for x in runs))


def interleaved(x: FlatRuns, y: FlatRuns) -> FlatRuns:
  """Flat run lists `x` and `y` (`keyed`), each sorted, no run of one overlapping a run of
  the other, as one sorted list: the few runs of one placed among the many of the other
  by binary search, not a sort of both."""
  if x[0].size < y[0].size:
    x, y = y, x
  at = np.searchsorted(x[0], y[0]) + np.arange(y[0].size)
  from_x = np.ones(x[0].size + y[0].size, bool)
  from_x[at] = False
  out = FlatRuns(*(np.empty(from_x.size, v.dtype) for v in x))
  for o, u, v in zip(out, x, y):
    o[at] = v
    o[from_x] = u
  return out


def merge_runs(b: Array, line: Array, a: Array, z: Array, state: Array,
               in_order: bool = False) -> LineRuns:
  """Runs of non-empty tiles sorted by (b, line, a), adjacent runs of one state merged.

  `in_order`: the runs come sorted already.
  """
  keep = state != EMPTY
  if not keep.all():
    b, line, a, z, state = b[keep], line[keep], a[keep], z[keep], state[keep]
  if b.size and not in_order:
    lines, span = int(line.max()) + 1, int(a.max()) + 1
    if (int(b.max()) + 1) * lines * span < 1 << 62:  # one int64 key sorts faster than three
      order = np.argsort((b.astype(np.int64) * lines + line) * span + a, kind="stable")
    else:
      order = np.lexsort((a, line, b))
    b, line, a, z, state = b[order], line[order], a[order], z[order], state[order]
  if b.size:
    new = np.ones(b.size, bool)
    new[1:] = (b[1:] != b[:-1]) | (line[1:] != line[:-1]) | (state[1:] != state[:-1]) | (
        a[1:] != z[:-1])
    first, last = group_ends(new)  # runs are disjoint and sorted: the last ends last
    b, line, state, a, z = b[first], line[first], state[first], a[first], z[last]
  return LineRuns(b, line, a, z, state)


def expand_leaves(leaves: tuple[Array, ...], along_rows: bool) -> LineRuns:
  """Leaves `(b, i0, i1, j0, j1, state)` as runs `(b, line, a, z, state)` of single lines."""
  b, i0, i1, j0, j1, state = leaves
  lo, hi, a, z = (i0, i1, j0, j1) if along_rows else (j0, j1, i0, i1)
  n = hi - lo
  item = np.repeat(np.arange(n.size, dtype=np.int32), n)  # tile counts fit int32 (`Runs`)
  line = (lo - (np.cumsum(n) - n)).astype(np.int32)[item] + np.arange(item.size, dtype=np.int32)
  return LineRuns(b.astype(np.int32)[item], line, a.astype(np.int32)[item],
                  z.astype(np.int32)[item], state[item])


def expand_in_order(leaves: tuple[Array, ...], along_rows: bool, n_lines: int) -> LineRuns:
  """`expand_leaves`, sorted by `(b, line, a)`.

  The leaves are ordered by their first position `a`, so that expanding them
  gives each line's runs in order, and the runs then sorted stably by line and
  batch row: radix sorts (NumPy's stable sort of 16-bit keys), several times
  faster than sorting one int64 key when a mask has hundreds of thousands of runs
  (`| g[k]` puts one on every line). Runs of a mask never overlap, so `a` is
  distinct within a line and ties in the first sort do not matter.
  """
  nb = int(leaves[0].max()) + 1 if leaves[0].size else 1
  if max(n_lines, nb) > 1 << 16:  # keys too wide for a radix sort: sorted (and merged) by one key
    return merge_runs(*expand_leaves(leaves, along_rows))
  order = np.argsort(leaves[3] if along_rows else leaves[1])
  runs = expand_leaves(tuple(x[order] for x in leaves), along_rows)
  order = np.argsort(runs[1].astype(np.uint16), kind="stable")
  if nb > 1:
    order = order[np.argsort(runs[0][order].astype(np.uint16), kind="stable")]
  b, line, a, z, state = (x[order] for x in runs)
  return LineRuns(b, line, a, z, state)


def transposed_through_grid(col_runs: LineRuns, nb: int, nq: int, nk: int) -> LineRuns:
  """Each row's runs (sorted and merged, as `merge_runs` gives them) of the columns' runs
  `col_runs` (`(b, column, i0, i1, state)`, disjoint within a column), through the dense
  grid of tile states `[nb, nq, nk]` (int8), which is then read row by row for where the
  state changes.

  The grid is written without expanding a run: each run's state is XORed in at its first
  row and again at its end, and an XOR prefix down the columns leaves each cell the state
  of the run that covers it (adjacent runs of one column meet in one cell, which then holds
  the XOR of both). XOR carries nothing between bytes, so the prefix runs over eight
  columns at once, as 64-bit words.

  It costs a few passes over `nb * nq * nk` bytes, where expanding the runs into their
  tiles and sorting those by row (`expand_in_order`) costs several passes over the tiles
  the runs cover, in wider types: the grid is faster where the runs cover a good part of
  it (`maskc.lowering.tuning.GRID_TRANSPOSE_COVER`).
  """
  b, col, i0, i1, state = (np.asarray(x) for x in col_runs)
  width = -(-nk // 8) * 8  # whole words
  starts = np.zeros((nb, nq + 1, width), np.uint8)
  ends = np.zeros((nb, nq + 1, width), np.uint8)
  starts[b, i0, col] = state  # distinct within a column: its runs do not overlap
  ends[b, i1, col] = state
  words = (starts ^ ends).view(np.uint64)
  grid = np.bitwise_xor.accumulate(words, axis=1).view(np.uint8)[:, :nq, :nk]
  grid = grid.reshape(nb * nq, nk).view(np.int8)
  edge = np.zeros((nb * nq, 1), np.int8)
  on = grid != EMPTY
  first = np.flatnonzero((grid != np.concatenate([edge, grid[:, :-1]], axis=1)) & on)
  last = np.flatnonzero((grid != np.concatenate([grid[:, 1:], edge], axis=1)) & on)
  line, a = np.divmod(first, nk)
  return LineRuns((line // nq).astype(np.int32), (line % nq).astype(np.int32),
                  a.astype(np.int32), (last % nk + 1).astype(np.int32),
                  grid.reshape(-1)[first])


def stack_runs(runs: list[Runs]) -> Runs:
  """Each mask's runs `[B, n_lines, R_u]` as one `[B, U, n_lines, R]` (a view for one mask)."""
  if len(runs) == 1:
    return Runs(*(np.expand_dims(x, 1) for x in runs[0]))
  r = max(x.start.shape[-1] for x in runs)
  def pad(arr: Array) -> Array:
    return np.pad(arr, [(0, 0)] * (arr.ndim - 1) + [(0, r - arr.shape[-1])])
  start, stop, state = (np.stack([pad(getattr(x, f)) for x in runs], axis=1)
                        for f in ("start", "stop", "state"))
  return Runs(start, stop, state, np.stack([x.count for x in runs], axis=1))
