"""The widened band under `jit`: the runs of `causal & chunk(8192) | bidirectional(img)`
from a few reductions per tile line, with no tile grid, range analysis or refinement.

Along rows, `intervals | bidirectional(x)` holds on one interval of each row where
the intervals (`maskc.lowering.closed_forms.band_runs.Intervals`) hold the diagonal: an image row's
block, the positions of its own run, holds it too (`maskc.lowering.closed_forms.widened_band`). A
line's tiles are then a band's, from the least and greatest ends of its rows'
intervals. Both ends grow with the row over text rows (the band's) and over image
rows (the band's widened to the run's start and end, which grow too), so the
extremes lie at the line's first and last text rows and first and last image
rows; the runs those rows lie in start and end at the line's first and last run
starts and ends, or, for a run that crosses the line's edge, at the last start
before the line or the first end after it (a scan over the lines). Along columns
the same holds with rows and columns swapped. That is one kernel of reductions over
the tokens and a few over the lines; at most three runs per line follow
elementwise: fewer than half the kernels of the analysis of the mask over every
tile, the refinement of the tiles PARTIAL in both items and the runs found in the grid.

The bounds must never be fused into a grid: XLA then computes each line's
reductions again for every tile of it. (The figures: `docs/lowering.md`, "Measurements
behind the design".)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maskc.compiled.tiles import Runs
from maskc.language import ir
from maskc.lowering.closed_forms.band_runs import Intervals, line_bounds, span_tiles
from maskc.lowering.closed_forms.same_run import SameRun
from maskc.lowering.grid.geometry import TileGeometry
from maskc.semantics.ranges import FULL, PARTIAL, reduce_many

_FAR = 1 << 29  # beyond any position on this path (int32 under jit)


def widened_parts(m: ir.Mask, geo: TileGeometry, same: list[SameRun]):
  """`(intervals, operand)` where `m` is `intervals | bidirectional(x)` (its body,
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
  return intervals, found[0].operand


def widened_bounds_traced(x, intervals: Intervals, geo: TileGeometry, along_rows: bool):
  """Bounds `(s, f, g, e)`, each `[B', n_lines]`
  (`maskc.lowering.closed_forms.band_runs.band_bounds`), of `intervals | bidirectional(x)`
  along rows or columns, for operand `x` (`[B', size]`), exact (`widened_parts` holds)."""
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

  def first(flags):
    return jnp.where(flags, pos, _FAR), "min"

  def last(flags):
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


def bounds_runs(bounds, nb: int, n: int) -> Runs:
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

  def slots(v):
    v = jnp.broadcast_to(jnp.where(valid, v, 0), lead + (3,))
    return jnp.concatenate([v, pad], -1)[..., :n]

  return Runs(slots(starts), slots(stops), slots(states).astype(jnp.int8),
              jnp.broadcast_to(count, lead))
