"""Rule `tile_cover`: where a mask can hold a true position at all, from its operands' runs.

`document(seg)` is `seg[q] == seg[k]`: where each segment id is one run, every
true position lies in a square `run × run` on the diagonal, and the rest of the
grid is EMPTY however many documents there are. The static lowering starts its
analysis from these squares instead of the whole grid, so it does not spend a
dozen rounds of halving to find the documents' edges.

A cover is a sorted list of disjoint intervals of rows (of each batch row),
each with an interval of tile columns: outside them the mask is EMPTY. It is
sound (a superset of the mask's positions), not exact; the analysis decides
what lies inside. Known covers:

- `x[q + s] == x[k + t]` for a per-token operand (or `runs(x)`): the rows
  reading each run, with the columns reading the same run where its value
  occurs in no other run of its batch row, else every column.
- `x[q + s]` as a mask: the rows reading a nonzero value, every column.
- `false`: none; an `&` the intersection of its items' covers, an `|` the
  union (with the hull of the columns where two overlap). So
  `bidirectional(img)` (`runs(img)[q] == runs(img)[k] & img[q]`) covers the
  image squares alone.

At the end each tile row takes the hull of the columns of the intervals it
meets: one rectangle per run of tile rows with the same columns.

Anything else (and any axis with explicit positions) has none: the whole grid. An analysis
rule (step "start"): `maskc.lowering.generic.dispatch` asks it before the generic analysis.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import numpy as np

from maskc.language import ir
from maskc.lowering.generic.range_analysis import Rects
from maskc.lowering.grid.forms import Array
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget
from maskc.lowering.rules import Rule, Site
from maskc.semantics.operand_runs import RunTable, reads_at, unit_shift
from maskc.semantics.ranges import Tables


class _Cover(NamedTuple):
  """Disjoint row intervals `[lo, hi)`, sorted, as keys `b * (q_len + 1) + row` (`batch`
  rows of them: 1 or the lowering's), each with tile columns `[c_lo, c_hi)`."""
  lo: Array
  hi: Array
  c_lo: Array
  c_hi: Array
  batch: int


def tile_cover(m: ir.Mask, geo: TileGeometry, tables: Tables, nb: int,
               budget: Budget) -> Rects | None:
  """Rectangles of tiles `(b, i0, i1, j0, j1)` holding every tile where `m` can be true;
  None when no cover is known (the whole grid).

  Its arrays hold a few int64 per operand run and per tile row: charged to `budget`.
  """
  if geo.positions:
    return None
  # the cover reads the run tables of reads along q (built already for the line pieces)
  runs = sum(tables.run_table(name).starts.size for name in {n for n, _ in reads_at(m, "q")})
  budget.charge((runs * 4 + nb * geo.nq) * 8 * 8, "the operands' tile cover")
  cover = _cover(m, geo, tables, nb)
  if cover is None:
    return None
  cover = _broadcast(cover, geo, nb)
  stride = geo.shape.q_len + 1
  b, lo = np.divmod(cover.lo, stride)
  hi = cover.hi - b * stride
  # each interval over the tile rows it meets; the intervals are sorted and disjoint,
  # so the tile rows follow in order (a tile row shared at most by neighbours)
  t_lo, t_hi = lo // geo.bq, -(-hi // geo.bq)
  n = t_hi - t_lo
  item = np.repeat(np.arange(n.size), n)
  flat = (b * geo.nq + t_lo)[item] + np.arange(item.size) - np.repeat(np.cumsum(n) - n, n)
  if not flat.size:
    none = np.zeros(0, np.int64)
    return none, none, none, none, none
  at = np.flatnonzero(np.append(True, flat[1:] != flat[:-1]))
  rows = flat[at]
  c_lo = np.minimum.reduceat(cover.c_lo[item], at)
  c_hi = np.maximum.reduceat(cover.c_hi[item], at)
  # consecutive rows of one batch row with the same columns form one rectangle
  new = np.ones(rows.size, bool)
  new[1:] = ((rows[1:] != rows[:-1] + 1) | (c_lo[1:] != c_lo[:-1]) | (c_hi[1:] != c_hi[:-1]) |
             (rows[1:] % geo.nq == 0))
  first = np.flatnonzero(new)
  last = np.append(first[1:], rows.size) - 1
  bb, i0 = np.divmod(rows[first], geo.nq)
  return bb, i0, rows[last] - bb * geo.nq + 1, c_lo[first], c_hi[first]


def _cover(m: ir.Mask, geo: TileGeometry, tables: Tables, nb: int) -> _Cover | None:
  if isinstance(m, ir.Call):
    return _cover(ir.expand(m), geo, tables, nb)
  if isinstance(m, ir.BoolConst) and not m.value:
    lo, hi, c_lo, c_hi = (np.zeros(0, np.int64) for _ in range(4))
    return _Cover(lo, hi, c_lo, c_hi, 1)
  if isinstance(m, (ir.And, ir.Or)):
    known = [c for c in (_cover(x, geo, tables, nb) for x in m.items) if c is not None]
    union = isinstance(m, ir.Or)
    if not known or (union and len(known) < len(m.items)):
      return None
    out = known[0]
    for other in known[1:]:
      out = _join(out, other, union, geo, nb)
    return out
  if isinstance(m, ir.Truth) and isinstance(m.read, ir.Read):
    shift = unit_shift(m.read.index, "q")
    if shift is None:
      return None
    t = tables.run_table(ir.array_key(m.read))
    return _from_runs(t, geo, shift, None, t.values != 0)
  if isinstance(m, ir.Compare) and m.ops == ("==",) and all(isinstance(x, ir.Read)
                                                           for x in m.terms):
    a, b = cast(tuple[ir.Read, ir.Read], m.terms)  # two reads: checked above
    if ir.array_key(a) != ir.array_key(b):
      return None
    shifts = [(unit_shift(x.index, "q"), unit_shift(x.index, "k")) for x in (a, b)]
    if shifts[0][0] is not None and shifts[1][1] is not None:
      sq, sk = shifts[0][0], shifts[1][1]
    elif shifts[1][0] is not None and shifts[0][1] is not None:
      sq, sk = shifts[1][0], shifts[0][1]
    else:
      return None
    t = tables.run_table(ir.array_key(a))
    return _from_runs(t, geo, sq, sk, np.ones(t.values.size, bool))
  return None


def _broadcast(c: _Cover, geo: TileGeometry, nb: int) -> _Cover:
  """A cover of one batch row repeated for `nb`."""
  if c.batch == nb:
    return c
  shift = np.repeat(np.arange(nb, dtype=np.int64) * (geo.shape.q_len + 1), c.lo.size)
  return _Cover(np.tile(c.lo, nb) + shift, np.tile(c.hi, nb) + shift, np.tile(c.c_lo, nb),
                np.tile(c.c_hi, nb), nb)


def _join(x: _Cover, y: _Cover, union: bool, geo: TileGeometry, nb: int) -> _Cover:
  """Intersection (or union) of two covers: over the pieces between all their ends."""
  if x.batch != y.batch:
    x, y = _broadcast(x, geo, nb), _broadcast(y, geo, nb)
  cuts = np.unique(np.concatenate([x.lo, x.hi, y.lo, y.hi]))
  lo, hi = cuts[:-1], cuts[1:]
  cols = []
  for c in (x, y):
    at = np.searchsorted(c.lo, lo, side="right") - 1
    inside = at >= 0
    at = np.maximum(at, 0)
    inside &= c.hi[at] >= hi if c.hi.size else False
    cols.append((inside, c.c_lo[at] if c.lo.size else lo, c.c_hi[at] if c.lo.size else lo))
  (ix, xl, xh), (iy, yl, yh) = cols
  if union:
    keep = ix | iy
    c_lo = np.where(ix & iy, np.minimum(xl, yl), np.where(ix, xl, yl))
    c_hi = np.where(ix & iy, np.maximum(xh, yh), np.where(ix, xh, yh))
  else:
    c_lo, c_hi = np.maximum(xl, yl), np.minimum(xh, yh)
    keep = ix & iy & (c_hi > c_lo)
  return _Cover(lo[keep], hi[keep], c_lo[keep], c_hi[keep], x.batch)


def _from_runs(t: RunTable, geo: TileGeometry, q_shift: int, k_shift: int | None,
               keep: Array) -> _Cover:
  """The rows reading each `keep` run, with their columns.

  With `k_shift`, a run's columns are those reading it where its value is unique
  in its batch row, else every column; without, every column.
  """
  shape = geo.shape
  length = t.length
  ends = np.append(t.starts[1:], t.batch * length)
  row_of = t.starts // length
  first = t.starts - row_of * length
  last = ends - row_of * length  # exclusive
  origin = shape.q_offset + q_shift
  r_lo = np.clip(first - origin, 0, shape.q_len)
  r_hi = np.clip(last - origin, 0, shape.q_len)
  c_lo = np.zeros(t.starts.size, np.int64)
  c_hi = np.full(t.starts.size, geo.nk, np.int64)
  if k_shift is not None:
    k_lo = np.clip(first - k_shift, 0, shape.kv_len)
    k_hi = np.clip(last - k_shift, 0, shape.kv_len)
    unique = _unique_in_row(t.values, row_of)
    c_lo = np.where(unique, k_lo // geo.bk, c_lo)
    c_hi = np.where(unique, -(-k_hi // geo.bk), c_hi)
    keep = keep & ((k_hi > k_lo) | ~unique)  # a unique run no column reads: no true position
  keep = keep & (r_hi > r_lo)
  base = row_of * (shape.q_len + 1)
  return _Cover((base + r_lo)[keep], (base + r_hi)[keep], c_lo[keep], c_hi[keep], t.batch)


def _unique_in_row(values: Array, row: Array) -> Array:
  """Whether each run's value occurs in no other run of its batch row."""
  if values.size < 2 or np.all((values[1:] > values[:-1]) | (row[1:] != row[:-1])):
    return np.ones(values.size, bool)  # increasing in each batch row (sorted ids)
  order = np.lexsort((values, row))
  v, r = values[order], row[order]
  same = (v[1:] == v[:-1]) & (r[1:] == r[:-1])
  repeated = np.zeros(values.size, bool)
  repeated[1:] |= same
  repeated[:-1] |= same
  out = np.empty(values.size, bool)
  out[order] = ~repeated
  return out


def lower(m: ir.Mask, site: Site) -> Rects | None:
  """The rectangles the generic analysis of part `m` starts from, or None (the whole grid)."""
  return tile_cover(m, site.geo, site.tables, site.batch or 1, site.budget)


TILE_COVER = Rule(
    "tile_cover", "the analysis starts from the rectangles where the operands' runs allow a "
    "true pair (maskc.lowering.closed_forms.tile_cover)", "analysis", "start", exact=False,
    lower=lower)
