"""Rule `periodic`: an operand-free mask with a diagonal period (`causal`, `chunk(n)`,
`(q - k) % 4 == 0`): one period of tiles classified and repeated.

A mask without operands that has a diagonal period (`maskc.analysis.diagonal_period`) has
the same tile states one period further down the diagonal. One period of rows is
classified, over a grid moved along the diagonal so that it reaches every column the repeats
need, and repeated; the same for columns. Cost: one period plus the output.
"""

from __future__ import annotations

import math

import numpy as np

from maskc.analysis.diagonal_period import diagonal_period
from maskc.compiled.tiles import Runs
from maskc.language import ir
from maskc.lowering.generic.range_analysis import Leaves, Rects, decided_leaves, hold_leaves
from maskc.lowering.grid.bands import Intervals, band_fits
from maskc.lowering.grid.forms import Array, Form, LineRuns, pack_runs
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget
from maskc.lowering.grid.run_lists import expand_in_order, expand_leaves, merge_runs
from maskc.lowering.rules import Rule, Site
from maskc.semantics.ranges import Tables
from maskc.semantics.shape import Shape


class PeriodicRuns:
  """The runs of a mask without operands that has a diagonal period
  (`maskc.analysis.diagonal_period`).

  With `T = lcm(P, bq, bk)`, tile `(i + T / bq, j + T / bk)` has the state of tile
  `(i, j)` wherever both are whole tiles, so one period of rows is classified over
  enough columns to the left (a grid moved along the diagonal by a multiple of
  `T`) and repeated down the grid; likewise one period of columns. The last row
  and column of tiles, when cut short by the lengths, are classified directly.
  Work and memory follow one period plus the output, not the grid.
  """

  exact = False  # as sharp as the analysis of the period

  def __init__(self, m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None,
               refine: bool, budget: Budget, period: int):
    self.m, self.geo, self.tables, self.batch, self.refine = m, geo, tables, batch, refine
    self.budget = budget
    step = math.lcm(period, geo.bq, geo.bk)
    self.step, self.tq, self.tk = step, step // geo.bq, step // geo.bk
    self.nq, self.nk = geo.shape.q_len // geo.bq, geo.shape.kv_len // geo.bk  # whole tiles
    edges: list[tuple[int, int, int, int]] = []
    if self.nq < geo.nq:
      edges.append((self.nq, geo.nq, 0, geo.nk))
    if self.nk < geo.nk and self.nq:
      edges.append((0, self.nq, self.nk, geo.nk))
    self.edges: Leaves | None = None
    if edges:
      b, i0, i1, j0, j1 = (np.asarray(x, np.int64) for x in zip(*([(0,) + e for e in edges])))
      self.edges = hold_leaves(self._decided(geo, (b, i0, i1, j0, j1)), budget)
    self._intervals: Intervals | None = None
    self._found_intervals = False

  @property
  def forms(self) -> frozenset[Form]:
    """`INTERVALS` where the mask is a band, or a band inside chunks, in the closed form's
    range (`causal & chunk(8192)`)."""
    return frozenset({Form.INTERVALS} if self.intervals() is not None else ())

  def intervals(self) -> Intervals | None:
    """The mask's one interval per row (`Intervals.of`), where `band_fits` the grid."""
    if not self._found_intervals:
      found = Intervals.of(self.m)
      self._intervals = (found if found is not None and band_fits(
          self.geo, (found.lo, found.hi, found.chunk)) else None)
      self._found_intervals = True
    return self._intervals

  @staticmethod
  def worth(geo: TileGeometry, period: int) -> bool:
    """Whether a period spans at most a quarter of the grid, and the moved grids stay far
    from the integer limits (positions near them take the general path's overflow checks)."""
    step = math.lcm(period, geo.bq, geo.bk)
    shape = geo.shape
    return ((step // geo.bq) * 4 <= shape.q_len // geo.bq and
            (step // geo.bk) * 4 <= shape.kv_len // geo.bk and
            abs(shape.q_offset) + 2 * (shape.q_len + shape.kv_len + step) < 1 << 62)

  def _decided(self, geo: TileGeometry, start: Rects | None = None) -> Leaves:
    """Leaves of `geo` (or of rectangles `start`), ambiguous tiles refined, EMPTY ones dropped."""
    return decided_leaves(self.m, geo, self.tables, None, self.refine, self.budget, start=start)

  def _merged_row(self, along_rows: bool) -> LineRuns:
    """The runs of one batch row as sorted, merged `(b, line, a, z, state)` arrays."""
    geo, shape = self.geo, self.geo.shape
    n_lines, n_span = (self.nq, self.nk) if along_rows else (self.nk, self.nq)
    t_line, t_span = (self.tq, self.tk) if along_rows else (self.tk, self.tq)
    parts: list[tuple[Array, ...]] = []
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
    return LineRuns(b, line, a, z, state)

  def runs(self, along_rows: bool) -> Runs:
    runs = pack_runs(*self._merged_row(along_rows), 1,
                     self.geo.nq if along_rows else self.geo.nk)
    nb = self.batch or 1
    return Runs(*(np.repeat(x, nb, axis=0) for x in runs)) if nb > 1 else runs


def match(m: ir.Mask, site: Site) -> int | None:
  """The diagonal period of operand-free `m` on consecutive positions, where repeating it
  pays (`PeriodicRuns.worth`: at most a quarter of the grid)."""
  if m.operands or site.geo.positions:
    return None
  period = diagonal_period(m)
  return period if period is not None and PeriodicRuns.worth(site.geo, period) else None


def lower(m: ir.Mask, period: int, site: Site) -> PeriodicRuns:
  return PeriodicRuns(m, site.geo, site.tables, site.batch, site.refine, site.budget, period)


def why_not(m: ir.Mask, site: Site) -> str | None:
  """An operand-free mask without a diagonal period, or with one too long for the grid."""
  if m.operands:
    return None
  period = diagonal_period(m)
  if period is None and not isinstance(m, (ir.And, ir.Or)):
    return "no operands, but no diagonal period (`maskc.analysis.diagonal_period`)"
  if period is not None and PERIODIC.enabled():
    return (f"a diagonal period of {period} tokens, too long to repeat on this grid (more "
            f"than a quarter of it)")
  return None


PERIODIC = Rule(
    "periodic", "an operand-free mask with a diagonal period (`causal`, `chunk(c)`): one "
    "period of tiles classified and repeated (maskc.lowering.closed_forms.periodic)", "part",
    "part", exact=False, match=match, lower=lower, why_not=why_not)
