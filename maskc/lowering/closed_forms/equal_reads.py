"""Rule `equal_reads`: tiles of `x[q + s] == x[k + t]` by binary searches, where each value of
x is one run (`document(seg)`, `bidirectional(img)`).

`document(seg)` with sorted segment ids, and the ids of an image mask's runs of
zeros and nonzeros that `bidirectional(img)` compares (`maskc.semantics.ranges`), hold
each value in one run of its batch row. Then two positions are equal exactly
when they read the same run, and a tile's state follows from the runs its rows
read, `[r0, r1]`, and those its columns read, `[c0, c1]`: EMPTY where the
intervals are disjoint, FULL where both are the same single run, PARTIAL
(certainly mixed) otherwise. Columns read nondecreasing intervals of runs, so
each row's non-EMPTY columns are one range found by binary search, with its FULL
columns one range inside: at most three runs per line, exact, with no range
analysis, in time that follows the lines. Beside a truth read `& w[q + s]` that is
constant on x's runs (`bidirectional`'s `& img[q]`), only the runs where w holds
count: a line then meets one range per such run it reads.
"""

from __future__ import annotations

from typing import Any, Literal, cast

import numpy as np

from maskc.arrays.ragged import group_ends, ranges
from maskc.compiled.tiles import FULL, PARTIAL, Runs
from maskc.language import ir
from maskc.lowering.generic.dispatch import body_of
from maskc.lowering.grid.forms import Array, FlatRuns, Form, LineBounds, line_runs, pack_keyed
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget
from maskc.lowering.rules import Rule, Site
from maskc.semantics.operand_runs import RunTable, unit_shift
from maskc.semantics.ranges import Tables, same_runs

# The runs each line reads, first and last, by the lines' positions (`lines_read`): kept
# between calls, so that rows and columns over the same tokens search once.
LineMemo = dict[tuple[Any, ...], tuple[Array, Array]]


def equal_reads(m: ir.Mask) -> tuple[str, int, int] | None:
  """`(operand table, s, t)` when `m` is `x[q + s] == x[k + t]` (either side first)."""
  if not (isinstance(m, ir.Compare) and m.ops == ("==",) and
          all(isinstance(x, ir.Read) for x in m.terms)):
    return None
  a, b = cast(tuple[ir.Read, ir.Read], m.terms)  # two reads: checked above
  if ir.array_key(a) != ir.array_key(b):
    return None
  for x, y in ((a, b), (b, a)):
    s, t = unit_shift(x.index, "q"), unit_shift(y.index, "k")
    if s is not None and t is not None:
      return ir.array_key(a), s, t
  return None


def equal_reads_where(m: ir.Mask) -> tuple[str, int, int, str | None] | None:
  """`(x, s, t, w)` when `m` is `x[q + s] == x[k + t]` (w None) or that `& w[q + s]`
  (`bidirectional(x)`'s body once its run ids are those of x's runs: `maskc.semantics.ranges.
  same_runs`)."""
  if isinstance(m, ir.And) and len(m.items) == 2:
    items = same_runs(m.items)
    for eq, w in (items, items[::-1]):
      found = equal_reads(eq)
      if (found is not None and isinstance(w, ir.Truth) and isinstance(w.read, ir.Read) and
          unit_shift(w.read.index, "q") == found[1]):
        return found + (ir.array_key(w.read),)
    return None
  found = equal_reads(m)
  return None if found is None else found + (None,)


def unique_runs(table: RunTable) -> bool:
  """Whether each value of the operand occurs in one run of its batch row."""
  values, row = table.values, table.row
  if values.size < 2 or np.all((values[1:] > values[:-1]) | (row[1:] != row[:-1])):
    return True  # increasing in each batch row (sorted ids)
  order = np.lexsort((values, row))
  v, r = values[order], row[order]
  return not np.any((v[1:] == v[:-1]) & (r[1:] == r[:-1]))


def lines_read(table: RunTable, geo: TileGeometry, along_rows: bool, shift: int,
               memo: LineMemo | None = None) -> tuple[Array, Array]:
  """First and last run read by each line of tiles of each row of the operand,
  `[table.batch * n_lines]`: global run indices, nondecreasing in that order.

  `memo`: results by the lines' positions, so that rows and columns that cover the same
  tokens (a square grid at offset 0, `x[q] == x[k]`) search the runs once, and the
  backward pass not again.
  """
  shape = geo.shape
  key = ((shape.q_offset, geo.bq, shape.q_len, shift) if along_rows else
         (0, geo.bk, shape.kv_len, shift))
  if memo is not None and key in memo:
    return memo[key]
  n = geo.nq if along_rows else geo.nk
  t = np.arange(n, dtype=np.int64)
  lo, hi = geo.q_bounds(t, t + 1) if along_rows else geo.k_bounds(t, t + 1)
  rows = table.batch
  b = np.repeat(np.arange(rows, dtype=np.int64), n) if rows > 1 else 0
  lo, hi = np.tile(lo + shift, rows), np.tile(hi + shift, rows)
  found = table.run_index(b, lo), table.run_index(b, hi)
  if memo is not None:
    memo[key] = found
  return found


class _Sorted:
  """A nondecreasing integer array `a`, searched like `np.searchsorted(a, v, side)`: by
  counting where its values span a range no wider than a few times its size (run indices
  of lines), a count per value and their running sum, made once for every search (a
  quarter of the binary searches' time); by binary search otherwise."""

  def __init__(self, a: Array):
    self.a = a
    self.below: Array | None = None
    if a.size and int(a[-1]) - int(a[0]) <= 4 * a.size:
      self.first = a[0]
      width = int(a[-1] - a[0]) + 1
      self.below = np.zeros(width + 1, np.int64)  # below[x]: the entries under first + x
      np.cumsum(np.bincount(a - a[0], minlength=width), out=self.below[1:])

  def search(self, v: Array, side: Literal["left", "right"]) -> Array:
    if self.below is None:
      return np.searchsorted(self.a, v, side)
    found: Array = self.below[np.clip(v - self.first + (side == "right"), 0,
                                      self.below.size - 1)]
    return found


def _searches(table: RunTable, geo: TileGeometry, nb: int, q_shift: int, k_shift: int,
              along_rows: bool, on: Array | None, memo: LineMemo | None
              ) -> tuple[Array, Array, _Sorted, _Sorted, Array | None]:
  """The runs each line reads, first and last (`lines_read`), over `nb` batch rows, those
  its span's lines read, ready to search (`_Sorted`), and `on` over them."""
  shifts = (q_shift, k_shift) if along_rows else (k_shift, q_shift)
  r0, r1 = lines_read(table, geo, along_rows, shifts[0], memo)
  c0, c1 = lines_read(table, geo, not along_rows, shifts[1], memo)
  runs = table.values.size
  if table.batch == 1 and nb > 1:  # one operand row read by every batch row
    r0, r1, c0, c1 = (np.tile(x, nb) + np.repeat(np.arange(nb) * runs, x.size)
                      for x in (r0, r1, c0, c1))
    on = None if on is None else np.tile(on, nb)
  return r0, r1, _Sorted(c0), _Sorted(c1), on


def equal_read_bounds(table: RunTable, geo: TileGeometry, nb: int, q_shift: int, k_shift: int,
                      along_rows: bool, memo: LineMemo | None = None) -> LineBounds:
  """The tiles of `x[q + s] == x[k + t]` as bounds `[4, nb * n_lines]` per flat line (`b *
  n_lines + line`), a band's (`maskc.lowering.grid.bands.band_bounds`: `[j0, f0)`
  and `[f1, j1)` PARTIAL, `[f0, f1)` FULL): the span's lines meeting the runs a line reads,
  FULL inside where it reads one run. For an operand whose values are one run each
  (`unique_runs`), with 1 or `nb` batch rows; `memo` as in `equal_read_runs`."""
  r0, r1, c0, c1, _ = _searches(table, geo, nb, q_shift, k_shift, along_rows, None, memo)
  n_lines, n_span = (geo.nq, geo.nk) if along_rows else (geo.nk, geo.nq)
  base = np.arange(nb * n_lines, dtype=np.int64) // n_lines * n_span
  j0 = c1.search(r0, "left") - base
  j1 = c0.search(r1, "right") - base
  f0 = c0.search(r0, "left") - base
  f1 = c1.search(r0, "right") - base
  full = (r0 == r1) & (f1 > f0)
  f0, f1 = np.where(full, f0, j1), np.where(full, f1, j1)
  return np.stack([j0, f0, f1, j1])


def equal_read_runs(table: RunTable, geo: TileGeometry, nb: int, q_shift: int, k_shift: int,
                    along_rows: bool, on: Array | None = None, memo: LineMemo | None = None
                    ) -> tuple[Array, Array, Array, Array]:
  """The runs of `x[q + s] == x[k + t]` along rows (or columns) as sorted, merged
  `(flat line, a, z, state)` arrays (`b * n_lines + line`), for an operand whose values
  are one run each (`unique_runs`) and which has 1 or `nb` batch rows.

  `on`: per run of x, whether a truth read beside it at `q + s` holds there
  (`& w[q + s]`, where w is constant on x's runs): only those runs can be true.
  `memo`: the runs lines read, kept between calls (`lines_read`).
  """
  if on is None:  # every line: the span's lines meeting its runs, FULL inside for one run
    return line_runs(equal_read_bounds(table, geo, nb, q_shift, k_shift, along_rows, memo))
  r0, r1, c0, c1, on_runs = _searches(table, geo, nb, q_shift, k_shift, along_rows, on, memo)
  assert on_runs is not None  # given: the line's runs where w holds
  n_lines, n_span = (geo.nq, geo.nk) if along_rows else (geo.nk, geo.nq)
  flat = np.arange(nb * n_lines, dtype=np.int64)
  base = flat // n_lines * n_span
  # a line reading one run that is `on`: the span's lines meeting it, FULL where they
  # read it alone
  one = (r0 == r1) & on_runs[r0]
  f, r = flat[one], r0[one]
  j0 = c1.search(r, "left") - base[one]
  f0 = c0.search(r, "left") - base[one]
  f1 = c1.search(r, "right") - base[one]
  j1 = c0.search(r, "right") - base[one]
  full = f1 > f0
  f0, f1 = np.where(full, f0, j1), np.where(full, f1, j1)
  parts = [(np.repeat(f, 3), np.stack([j0, f0, f1], 1).reshape(-1),
            np.stack([f0, f1, j1], 1).reshape(-1),
            np.tile(np.array([PARTIAL, FULL, PARTIAL], np.int8), f.size))]
  # a line reading several runs: PARTIAL where the span meets one of those `on`, one
  # range per run, united where they meet
  many = r0 < r1
  n = (r1 - r0 + 1)[many]
  f = np.repeat(flat[many], n)
  r = ranges(r0[many], n)
  kept = on_runs[r]
  f, r = f[kept], r[kept]
  j0 = c1.search(r, "left") - base[f]
  j1 = c0.search(r, "right") - base[f]
  if f.size:
    new = np.ones(f.size, bool)
    new[1:] = (f[1:] != f[:-1]) | (j0[1:] > j1[:-1])
    first, last = group_ends(new)
    f, j0, j1 = f[first], j0[first], j1[last]
  parts.append((f, j0, j1, np.full(f.size, PARTIAL, np.int8)))
  f, a, z, state = (np.concatenate(x) for x in zip(*parts))
  keep = z > a
  f, a, z, state = f[keep], a[keep], z[keep], state[keep]
  order = np.argsort(f, kind="stable")  # each line's runs are in order already
  return f[order], a[order], z[order], state[order]


class EqualRuns:
  """The runs of `x[q + s] == x[k + t]` where each value of x is one run of its batch row
  (sorted segment ids; the ids of an image mask's runs): found by binary searches over
  the runs each line reads, exactly, with no analysis.

  Also what widens a band (`Form.WIDENS`, rule `widened_band`): the run table, the shifts
  `(s, t)`, `on` (per run of x whether a truth read beside the reads holds there), and the
  memos of the runs lines read and of widened bounds.
  """

  exact = True

  def __init__(self, m: ir.Mask, table: RunTable, shifts: tuple[int, int], on: Array | None,
               geo: TileGeometry, batch: int | None, budget: Budget):
    self.m, self.table, self.shifts, self.on = m, table, shifts, on
    self.geo, self.batch, self.budget = geo, batch, budget
    # band-shaped lines where no truth read stands beside the equal reads
    self.forms = frozenset({Form.FLAT, Form.WIDENS} |
                           ({Form.LINE_BOUNDS} if on is None else set()))
    self.line_memo: LineMemo = {}
    self.widened_memo: dict[tuple[Any, ...], LineBounds | None] = {}

  def _lines_runs(self, along_rows: bool) -> tuple[Array, Array, Array, Array]:
    """The runs as sorted, merged `(flat line, a, z, state)` arrays."""
    nb = self.batch or 1
    geo = self.geo
    tokens = self.table.length if self.on is None else 2 * self.table.length  # runs read
    self.budget.charge(nb * (geo.nq + geo.nk + min(geo.nq + geo.nk, tokens)) * 6 * 8,
                       "the runs of equal reads")
    return equal_read_runs(self.table, geo, nb, *self.shifts, along_rows, self.on,
                           self.line_memo)

  def bounds(self, along_rows: bool) -> LineBounds | None:
    """The tiles as a band's bounds per flat line (`equal_read_bounds`), where no truth read
    stands beside the equal reads; else None."""
    if self.on is not None:
      return None
    nb, geo = self.batch or 1, self.geo
    self.budget.charge(nb * (geo.nq + geo.nk) * 6 * 8, "the runs of equal reads")
    return equal_read_bounds(self.table, geo, nb, *self.shifts, along_rows, self.line_memo)

  def flat(self, along_rows: bool) -> FlatRuns:
    """The runs as sorted, merged flat runs (`keyed`), from their flat lines directly."""
    f, a, z, state = self._lines_runs(along_rows)
    base = f * ((self.geo.nk if along_rows else self.geo.nq) + 1)
    return FlatRuns(base + a, base + z, state)

  def runs(self, along_rows: bool) -> Runs:
    n_lines, n_span = (self.geo.nq, self.geo.nk) if along_rows else (self.geo.nk, self.geo.nq)
    return pack_keyed(*self.flat(along_rows), self.batch or 1, n_lines, n_span)


Found = tuple[RunTable, tuple[int, int], Array | None]


def find(m: ir.Mask, geo: TileGeometry, tables: Tables) -> Found | None:
  """`(x's runs, (s, t), on)` where `m` is equal reads of x (`equal_reads_where`), each
  value of x one run, and a truth read beside them (`on`, else None) constant on x's runs;
  else None. Builds nothing but the run tables."""
  found = None if geo.positions else equal_reads_where(m)
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
  return table, (s, t), on


def match(m: ir.Mask, site: Site) -> Found | None:
  """Equal reads of runs in `m`'s body, each value one run (`find`)."""
  return find(body_of(m), site.geo, site.tables)


def lower(m: ir.Mask, found: Found, site: Site) -> EqualRuns:
  table, shifts, on = found
  return EqualRuns(body_of(m), table, shifts, on, site.geo, site.batch, site.budget)


def why_not(m: ir.Mask, site: Site) -> str | None:
  """Equal reads of an operand some value of which spans more than one run."""
  found = equal_reads_where(body_of(m))
  if found is not None and not unique_runs(site.tables.run_table(found[0])):
    return (f"equal reads of `{found[0]}`, but some value of `{found[0]}` spans more than one "
            f"run")
  return None


EQUAL_READS = Rule(
    "equal_reads", "`x[q + s] == x[k + t]` where each value of x is one run "
    "(`document(seg)`, `bidirectional(img)`): binary searches per line "
    "(maskc.lowering.closed_forms.equal_reads)", "part", "part", exact=True,
    match=match, lower=lower, why_not=why_not)
