"""Rule `widened_band`: a band widened by blocks of equal reads, in closed form: `causal |
bidirectional(img)`, static and traced.

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

A combine rule at step "join" (an `|`'s parts: a part of one interval per row and equal reads
that widen it), and the widening itself (`widen`) for the rules `met_bounds` and `spread`,
which meet or clip at the widened bounds.

Under `jit` (`traced`): the runs of `causal & chunk(8192) | bidirectional(img)`
from a few reductions per tile line, with no tile grid, range analysis or refinement.

Along rows, `intervals | bidirectional(x)` holds on one interval of each row where the
intervals (`maskc.lowering.grid.bands.Intervals`) hold the diagonal: an image row's block,
the positions of its own run, holds it too (as above). A line's tiles are then a band's,
from the least and greatest ends of its rows' intervals. Both ends grow with the row over
text rows (the band's) and over image rows (the band's widened to the run's start and end,
which grow too), so the extremes lie at the line's first and last text rows and first and
last image rows; the runs those rows lie in start and end at the line's first and last run
starts and ends, or, for a run that crosses the line's edge, at the last start before the
line or the first end after it (a scan over the lines). Along columns the same holds with
rows and columns swapped. That is one kernel of reductions over the tokens and a few over
the lines; at most three runs per line follow elementwise: fewer than half the kernels of
the analysis of the mask over every tile, the refinement of the tiles PARTIAL in both items
and the runs found in the grid.

The bounds must never be fused into a grid: XLA then computes each line's
reductions again for every tile of it. (The figures: `docs/lowering.md`, "Measurements
behind the design".)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maskc.arrays.ragged import ranges
from maskc.compiled.tiles import Runs
from maskc.language import ir
from maskc.lowering.closed_forms.equal_reads import LineMemo, lines_read
from maskc.lowering.closed_forms.same_run_ids import SameRun
from maskc.lowering.generic.combination import CombinedRuns
from maskc.lowering.grid.bands import FAR, Intervals, line_bounds, span_tiles
from maskc.lowering.grid.forms import Array, FlatRuns, Form, LineBounds, keyed_band_runs
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.parts import IntervalsPart, PartRuns, WideningPart, given
from maskc.lowering.rules import Rule
from maskc.semantics.operand_runs import RunTable
from maskc.semantics.ranges import FULL, PARTIAL, reduce_many

_FAR = 1 << 29  # beyond any position on the traced path (int32 under jit)


def widened_bounds(geo: TileGeometry, intervals: Intervals, table: RunTable,
                   shifts: tuple[int, int], on: Array | None, along_rows: bool,
                   memo: LineMemo | None = None) -> LineBounds | None:
  """Bounds `[4, table.batch * n_lines]` (`maskc.lowering.grid.bands.band_bounds`:
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

def widen(part: WideningPart, intervals: Intervals, along_rows: bool) -> LineBounds | None:
  """The bounds of `intervals | part` per flat line, where they are a band's
  (`widened_bounds`); None where they are not, or the rule is off. Remembered on the part: a
  spread that cannot use them in closed form asks again."""
  if not WIDENED_BAND.enabled():
    return None
  key = (intervals.lo, intervals.hi, intervals.chunk, along_rows)
  memo = part.widened_memo
  if key not in memo:
    geo, table = part.geo, part.table
    part.budget.charge((table.batch * (geo.nq + geo.nk) + table.values.size) * 12 * 8,
                       "a band widened by equal reads")
    memo[key] = widened_bounds(geo, intervals, table, part.shifts, part.on, along_rows,
                               part.line_memo)
  if memo[key] is not None:
    WIDENED_BAND.took()
  return memo[key]


Joined = tuple[WideningPart, IntervalsPart, list[PartRuns]]


def match(order: Sequence[PartRuns], union: bool) -> Joined | None:
  """An `|`'s parts `order`: the first that widens a band (`Form.WIDENS`), the first that is
  one interval per row (`Form.INTERVALS`), and the others."""
  if not union:
    return None
  equal = next((given(p, Form.WIDENS) for p in order if Form.WIDENS in p.forms), None)
  band = next((given(p, Form.INTERVALS) for p in order if Form.INTERVALS in p.forms), None)
  if equal is None or band is None:
    return None
  return equal, band, [p for p in order if p is not band and p is not equal]


def lower(c: CombinedRuns, found: Joined, along_rows: bool, n_lines: int,
          n_span: int) -> tuple[FlatRuns, list[PartRuns]] | None:
  """`(flat runs, the other parts)` of the `|` `c` where the band and the equal reads join
  into one interval per row, their runs written from bounds with nothing combined; else
  None."""
  equal, band, others = found
  intervals = band.intervals()
  bounds = None if intervals is None else widen(equal, intervals, along_rows)
  if bounds is None:
    return None
  return keyed_band_runs(bounds, None, n_lines, n_span, c.batch or 1), others


# ----------------------------------------------------------------------------- under `jit`


@dataclasses.dataclass(frozen=True)
class TracedWidening:
  """`intervals | bidirectional(operand)` found in a whole mask under `jit` (`traced`)."""
  intervals: Intervals
  operand: str

  def runs(self, x: Any, geo: TileGeometry, nb: int, along_rows: bool) -> Runs:
    """The runs along rows (or columns) for operand values `x` (`[B', size]`)."""
    return bounds_runs(widened_bounds_traced(x, self.intervals, geo, along_rows), nb,
                       geo.nk if along_rows else geo.nq)


def traced(m: ir.Mask, geo: TileGeometry, same: Sequence[SameRun]) -> TracedWidening | None:
  """The traced lower: `m` as `intervals | bidirectional(x)` (its body,
  `runs(x)[q] == runs(x)[k] & x[q]`: `same` holds it), the intervals holding the
  diagonal, on consecutive positions with a static offset and small enough for int32;
  else None."""
  split = ir.operand_free_split(m)
  shape = geo.shape
  if split is None or split[2] is not ir.or_ or geo.positions or not shape.static:
    return None
  free, rest, join = split
  if not free or len(rest) != 1:
    return None
  found = [p for p in same if p.node is rest[0] and p.s == 0 and p.t == 0]
  intervals = Intervals.of(ir.joined(free, join))
  if not found or intervals is None:
    return None
  if not intervals.holds_diagonal:
    return None  # an interval that misses its row's diagonal: blocks could lie apart
  lo, hi = intervals.lo, intervals.hi
  reach = abs(int(shape.q_offset)) + shape.q_len + shape.kv_len + sum(
      abs(x) for x in (lo, hi, intervals.chunk) if x is not None)
  if reach >= _FAR // 4:
    return None
  return TracedWidening(intervals, found[0].operand)


def widened_bounds_traced(x: Any, intervals: Intervals, geo: TileGeometry,
                          along_rows: bool) -> tuple[Any, Any, Any, Any]:
  """Bounds `(s, f, g, e)`, each `[B', n_lines]`
  (`maskc.lowering.grid.bands.band_bounds`), of `intervals | bidirectional(x)`
  along rows or columns, for operand `x` (`[B', size]`), exact (`traced` found it)."""
  shape = geo.shape
  if along_rows:  # q tiles: positions from the offset
    offset, count, block, n_lines = int(shape.q_offset), shape.q_len, geo.bq, geo.nq
  else:
    offset, count, block, n_lines = 0, shape.kv_len, geo.bk, geo.nk
  rows = x.shape[0]
  total = n_lines * block
  # x != 0 at the lines' positions and one on each side, zeros past the operand's ends
  # (the neighbours that tell where a run starts and ends)
  pad = max(0, offset + total + 1 - x.shape[1])
  on = jnp.pad(x != 0, [(0, 0), (1, pad)])[:, offset:offset + total + 2]
  cur, prev, nxt = on[:, 1:-1], on[:, :-2], on[:, 2:]
  # positions as iotas (XLA folds big array constants slowly)
  pos = (jax.lax.broadcasted_iota(jnp.int32, (1, n_lines, block), 1) * block +
         jax.lax.broadcasted_iota(jnp.int32, (1, n_lines, block), 2))
  real = pos < count
  pos = pos + offset
  img = cur.reshape(rows, n_lines, block) & real
  text = ~cur.reshape(rows, n_lines, block) & real
  starts = (cur & ~prev).reshape(rows, n_lines, block) & real
  ends = (cur & ~nxt).reshape(rows, n_lines, block) & real

  def first(flags: Any) -> tuple[Any, str]:
    return jnp.where(flags, pos, _FAR), "min"

  def last(flags: Any) -> tuple[Any, str]:
    return jnp.where(flags, pos, -_FAR), "max"

  (first_text, last_text, first_img, last_img, first_start, last_start, first_end,
   last_end) = reduce_many(jnp, [first(text), last(text), first(img), last(img),
                                 first(starts), last(starts), first(ends), last(ends)], -1)
  # the last run start before each line, the first run end after it: over the lines, and
  # over the operand before the first line and after the last
  every = jnp.pad(x != 0, [(0, 0), (1, 1)])
  at = jax.lax.broadcasted_iota(jnp.int32, (1, x.shape[1]), 1)
  before_lines, after_lines = reduce_many(jnp, [
      (jnp.where((every[:, 1:-1] & ~every[:, :-2]) & (at < offset), at, -_FAR), "max"),
      (jnp.where((every[:, 1:-1] & ~every[:, 2:]) & (at >= offset + count), at, _FAR),
       "min")], -1)
  before = jax.lax.cummax(jnp.concatenate([before_lines[:, None], last_start], 1), axis=1)
  after = jax.lax.cummin(jnp.concatenate([first_end, after_lines[:, None]], 1), axis=1,
                         reverse=True)
  before, after = before[:, :-1], after[:, 1:]
  # the runs of the line's first and last image rows: where they start and end
  start_first = jnp.where(first_start == first_img, first_img, before)
  start_last = jnp.where(last_start > -_FAR, last_start, before)
  end_first = jnp.where(first_end < _FAR, first_end, after)
  end_last = jnp.where(last_end == last_img, last_img, after)
  has_text, has_img = first_text < _FAR, first_img < _FAR
  lt, ht, lt2, ht2, li, hi_, li2, hi2 = (
      end for p in (first_text, last_text, first_img, last_img)
      for end in intervals.ends(p, along_rows, jnp, _FAR))
  least_lo = jnp.minimum(jnp.where(has_text, lt, _FAR),
                         jnp.where(has_img, jnp.minimum(li, start_first), _FAR))
  most_lo = jnp.maximum(jnp.where(has_text, lt2, -_FAR),
                        jnp.where(has_img, jnp.minimum(li2, start_last), -_FAR))
  least_hi = jnp.minimum(jnp.where(has_text, ht, _FAR),
                         jnp.where(has_img, jnp.maximum(hi_, end_first), _FAR))
  most_hi = jnp.maximum(jnp.where(has_text, ht2, -_FAR),
                        jnp.where(has_img, jnp.maximum(hi2, end_last), -_FAR))

  return line_bounds(span_tiles(geo, along_rows, jnp), least_lo, most_lo, least_hi, most_hi)


def bounds_runs(bounds: tuple[Any, Any, Any, Any], nb: int, n: int) -> Runs:
  """The runs `[nb, n_lines, n]` (slots) of lines with bounds `(s, f, g, e)` (`[B',
  n_lines]`): `[s, f)` PARTIAL, `[f, g)` FULL, `[g, e)` PARTIAL, empty ones dropped and
  two PARTIAL ones that meet (no FULL run between) one run. Elementwise on three slots
  per line: no grid, no sort."""
  s, f, g, e = bounds
  full = g > f
  left = full & (f > s)  # a PARTIAL run before the FULL one
  right = full & (e > g)
  one = ~full & (e > s)  # the line is one PARTIAL run, or empty
  starts = jnp.stack([jnp.where(full, jnp.where(left, s, f), s),
                      jnp.where(left, f, g), g], -1)
  stops = jnp.stack([jnp.where(full, jnp.where(left, f, g), e),
                     jnp.where(left, g, e), e], -1)
  states = jnp.stack([jnp.where(full & ~left, FULL, PARTIAL),
                      jnp.where(left, FULL, PARTIAL),
                      jnp.full(s.shape, PARTIAL, jnp.int32)], -1)
  count = jnp.where(full, 1 + left + right, one).astype(jnp.int32)
  valid = jnp.arange(3, dtype=jnp.int32) < count[..., None]
  lead = (nb,) + s.shape[1:]
  pad = jnp.zeros(lead + (max(0, n - 3),), jnp.int32)

  def slots(v: Any) -> Any:
    v = jnp.broadcast_to(jnp.where(valid, v, 0), lead + (3,))
    return jnp.concatenate([v, pad], -1)[..., :n]

  return Runs(slots(starts), slots(stops), slots(states).astype(jnp.int8),
              jnp.broadcast_to(count, lead))


WIDENED_BAND = Rule(
    "widened_band", "a band joined with equal reads into one interval per row (`causal | "
    "bidirectional(img)`), static and traced (maskc.lowering.closed_forms.widened_band)",
    "combine", "join", exact=True, match=match, lower=lower, traced=traced)
