"""A band widened by blocks of equal reads, in closed form: `causal | bidirectional(img)`.

A band `lo <= q - k <= hi` holds on one interval of each row, `[p - hi, p - lo]`,
and the intervals of consecutive rows touch; so does a band inside chunks holding
the diagonal (`causal & chunk(8192)`: `[8192 (p // 8192), p]`), each interval
holding its row's diagonal. Both ends grow with the row. `x[q + s] == x[k + t]`
(with `& w[q + s]`: `bidirectional(img)`), where each value of x is one run, holds
on one block of each row too: the columns that read the run the row reads. Where
each row's block meets or touches its interval (an image's block holds its own
diagonal), their union is again one interval per row, and the union over a tile
line's rows is one interval as well, since each holds its row's interval. So a
line's tiles are EMPTY, PARTIAL, FULL, PARTIAL, EMPTY, like a band's: FULL where
every row's interval covers the tile, non-EMPTY where the union reaches it,
exactly, from the least and greatest ends of the rows' intervals. The rows of a
line split at the runs they read, and on each such stretch both ends grow with
the row, so the stretch's first and last rows give their extremes. The same holds
along columns.

`causal & chunk(8192) | bidirectional(img)` is then written from bounds, with no
runs combined; in `document(seg) & (causal | bidirectional(img))` the documents are
clipped at these bounds, one pass over their runs as in `causal & document(seg)`,
instead of being clipped at the band off the images' lines and met with the band
joined with the blocks on them.
"""

from __future__ import annotations

import numpy as np

from maskc.arrays.ragged import ranges
from maskc.lowering.closed_forms.band_runs import FAR, Intervals, line_bounds, span_tiles
from maskc.lowering.closed_forms.equal_reads import lines_read
from maskc.lowering.grid.forms import LineBounds
from maskc.lowering.grid.geometry import TileGeometry
from maskc.semantics.operand_runs import RunTable


def widened_bounds(geo: TileGeometry, intervals: Intervals, table: RunTable,
                   shifts: tuple[int, int], on: np.ndarray | None, along_rows: bool,
                   memo: dict | None = None) -> LineBounds | None:
  """Bounds `[4, table.batch * n_lines]` (`maskc.lowering.closed_forms.band_runs.band_bounds`:
  s, f, g, e per flat line of each operand row) of `intervals | x[q + s] == x[k + t]
  [& w[q + s]]`, on consecutive positions with a static offset (`band_fits`), where each
  value of x is one run of its row (`unique_runs`) and `on` says per run whether w holds
  there (None: no w).

  None where the band is empty or some row's block neither meets nor touches its
  interval: that row's union is two intervals.
  `memo`: the runs lines read (`maskc.lowering.closed_forms.equal_reads.lines_read`).
  """
  lo, hi = intervals.lo, intervals.hi
  if lo is not None and hi is not None and lo > hi:
    return None
  s_line, s_span = shifts if along_rows else shifts[::-1]
  n_lines = geo.nq if along_rows else geo.nk
  t = np.arange(n_lines, dtype=np.int64)
  first, last = geo.q_bounds(t, t + 1) if along_rows else geo.k_bounds(t, t + 1)
  r0, r1 = lines_read(table, geo, along_rows, s_line, memo)
  rows = table.batch
  first, last = np.tile(first, rows), np.tile(last, rows)
  # the stretches of each line's rows that read one run: (line, run, first row, last row)
  n = r1 - r0 + 1
  line = np.repeat(np.arange(r0.size, dtype=np.int64), n)
  run = ranges(r0, n)
  length = table.length
  row_start = table.row[run] * length
  start = table.starts[run] - row_start
  end = np.append(table.starts[1:], rows * length)[run] - row_start  # exclusive
  pa = np.where(run == r0[line], first[line], start - s_line)
  pb = np.where(run == r1[line], last[line], end - 1 - s_line)
  # the intervals of a stretch's first and last rows
  la, ha = intervals.ends(pa, along_rows)
  lb, hb = intervals.ends(pb, along_rows)
  # the block: the positions that read the run (the first and last run of a row reach
  # past the operand's ends, where reads are clipped)
  blocked = np.ones(run.shape, bool) if on is None else on[run]
  b0 = np.where(start == 0, -FAR, start - s_span)[blocked]
  b1 = np.where(end == length, FAR, end - 1 - s_span)[blocked]
  if np.any(b0 > ha[blocked] + 1) or np.any(b1 < lb[blocked] - 1):
    return None  # a row whose block is apart from its band interval
  la[blocked] = np.minimum(la[blocked], b0)
  lb[blocked] = np.minimum(lb[blocked], b0)
  ha[blocked] = np.maximum(ha[blocked], b1)
  hb[blocked] = np.maximum(hb[blocked], b1)
  at = np.flatnonzero(np.diff(line, prepend=-1))  # each line's first stretch
  least_lo, most_lo = np.minimum.reduceat(la, at), np.maximum.reduceat(lb, at)
  least_hi, most_hi = np.minimum.reduceat(ha, at), np.maximum.reduceat(hb, at)
  return np.stack(line_bounds(span_tiles(geo, along_rows), least_lo, most_lo, least_hi,
                              most_hi))
