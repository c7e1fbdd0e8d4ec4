"""Tiles of `x[q + s] == x[k + t]` by binary searches, where each value of x is one run.

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

from typing import Literal, cast

import numpy as np

from maskc.arrays.ragged import group_ends, ranges
from maskc.compiled.tiles import FULL, PARTIAL
from maskc.language import ir
from maskc.lowering.grid.forms import LineBounds, line_runs
from maskc.lowering.grid.geometry import TileGeometry
from maskc.semantics.operand_runs import RunTable, unit_shift
from maskc.semantics.ranges import same_runs


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
               memo: dict | None = None):
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

  def __init__(self, a: np.ndarray):
    self.a = a
    self.below = None
    if a.size and int(a[-1]) - int(a[0]) <= 4 * a.size:
      self.first = a[0]
      width = int(a[-1] - a[0]) + 1
      self.below = np.zeros(width + 1, np.int64)  # below[x]: the entries under first + x
      np.cumsum(np.bincount(a - a[0], minlength=width), out=self.below[1:])

  def search(self, v: np.ndarray, side: Literal["left", "right"]) -> np.ndarray:
    if self.below is None:
      return np.searchsorted(self.a, v, side)
    return self.below[np.clip(v - self.first + (side == "right"), 0, self.below.size - 1)]


def _searches(table: RunTable, geo: TileGeometry, nb: int, q_shift: int, k_shift: int,
              along_rows: bool, on: np.ndarray | None, memo: dict | None):
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
                      along_rows: bool, memo: dict | None = None) -> LineBounds:
  """The tiles of `x[q + s] == x[k + t]` as bounds `[4, nb * n_lines]` per flat line (`b *
  n_lines + line`), a band's (`maskc.lowering.closed_forms.band_runs.band_bounds`: `[j0, f0)`
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
                    along_rows: bool, on: np.ndarray | None = None, memo: dict | None = None):
  """The runs of `x[q + s] == x[k + t]` along rows (or columns) as sorted, merged
  `(flat line, a, z, state)` arrays (`b * n_lines + line`), for an operand whose values
  are one run each (`unique_runs`) and which has 1 or `nb` batch rows.

  `on`: per run of x, whether a truth read beside it at `q + s` holds there
  (`& w[q + s]`, where w is constant on x's runs): only those runs can be true.
  `memo`: the runs lines read, kept between calls (`lines_read`).
  """
  if on is None:  # every line: the span's lines meeting its runs, FULL inside for one run
    return line_runs(equal_read_bounds(table, geo, nb, q_shift, k_shift, along_rows, memo))
  r0, r1, c0, c1, on = _searches(table, geo, nb, q_shift, k_shift, along_rows, on, memo)
  n_lines, n_span = (geo.nq, geo.nk) if along_rows else (geo.nk, geo.nq)
  flat = np.arange(nb * n_lines, dtype=np.int64)
  base = flat // n_lines * n_span
  # a line reading one run that is `on`: the span's lines meeting it, FULL where they
  # read it alone
  one = (r0 == r1) & on[r0]
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
  kept = on[r]
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
