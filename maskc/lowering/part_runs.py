"""The runs of one part lowered by a closed form of the static lowering, one class per kind:

- `_PeriodicRuns`: an operand-free mask with a diagonal period, one period classified
  and repeated (rule `periodic`);
- `_AxisRuns`: a mask that reads one position only, one line of tiles decides it (rule
  `one_axis`);
- `_EqualRuns`: `x[q + s] == x[k + t]` where each value of x is one run, by binary
  searches per line (rule `equal_reads`).

Each gives its runs as `merged()` / `flat()` lists and packed `runs()`, as the generic
analysis's `_StaticRuns` does, for `maskc.lowering.static` to pack or
`maskc.lowering.combined` to combine.
"""

from __future__ import annotations

import math

import numpy as np

from maskc.compiled.tiles import Runs
from maskc.language import ir
from maskc.lowering.closed_forms.axis_reads import bare_reads_only, read_tile_states
from maskc.lowering.closed_forms.band_runs import Intervals, band_fits
from maskc.lowering.closed_forms.equal_reads import (
  equal_read_bounds,
  equal_read_runs,
  equal_reads_where,
  unique_runs,
)
from maskc.lowering.closed_forms.widened_band import widened_bounds
from maskc.lowering.grid.forms import (
  FlatRuns,
  Form,
  LineBounds,
  LineRuns,
  Pattern,
  pack_keyed,
  pack_runs,
)
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget
from maskc.lowering.grid.run_lists import expand_in_order, expand_leaves, merge_runs
from maskc.lowering.range_analysis import _decided_leaves, _hold_leaves, _leaves_and_exactness
from maskc.lowering.rules import enabled, took
from maskc.lowering.sampling import _RunReads
from maskc.semantics.operand_runs import RunTable
from maskc.semantics.ranges import Tables
from maskc.semantics.shape import Shape


class _AxisRuns:
  """The runs of a mask that reads one position only (`g[k]`, `valid[k]`, `g[q]`).

  Such a mask has the same state in every tile of a column of tiles (of a row,
  for `q`): a vector of states over the tiles of its axis decides it, found on
  a virtual grid one tile thick. Along the lines of its own axis (q tile rows of
  a `q` mask) each line is one run over the whole span. Across them every line
  repeats the same runs, a *pattern*: `_CombinedRuns` splices it into the other
  parts' runs without writing it out line by line, so `local(64, 64) | g[q] |
  g[k]` costs its output, not a pass of the analysis over every g column of
  every row.

  Its runs are exact (`exact`) where it reads bare operands (`g[k]`), found from their
  runs; else as sharp as one round of the analysis, refined or not.
  """

  forms = frozenset({Form.PATTERN})

  def __init__(self, m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None,
               refine: bool, budget: Budget):
    (self.axis,) = ir.positions_of(m)
    self.m, self.geo, self.batch, self.budget = m, geo, batch, budget
    shape = geo.shape
    if self.axis == "q":
      line = TileGeometry(Shape.of(shape.q_len, 1, shape.q_offset), geo.bq, 1)
    else:
      line = TileGeometry(Shape.of(1, shape.kv_len, shape.q_offset), 1, geo.bk)
    nb = batch or 1
    n = line.nq if self.axis == "q" else line.nk
    budget.charge(nb * n * 8 * 8, "the tiles of one axis")
    b = np.repeat(np.arange(nb, dtype=np.int64), n)
    t = np.tile(np.arange(n, dtype=np.int64), nb)
    bare = bare_reads_only(m)
    if bare:  # from the operands' runs: exact, no analysis
      tokens, block, offset = ((shape.q_len, geo.bq, shape.q_offset) if self.axis == "q" else
                               (shape.kv_len, geo.bk, 0))
      state = read_tile_states(m, tokens, block, offset, nb, tables, _RunReads(tables),
                               budget).reshape(-1)
      a, z, self.exact = t, t + 1, True
    else:  # every tile of the line at once: one round of the analysis, ambiguous ones refined
      one = np.zeros_like(t)
      start = (b, t, t + 1, one, one + 1) if self.axis == "q" else (b, one, one + 1, t, t + 1)
      (b, i0, i1, j0, j1, state), self.exact = _leaves_and_exactness(
          m, line, tables, batch, refine, budget, start=start)
      a, z = (i0, i1) if self.axis == "q" else (j0, j1)
    # the pattern of each batch row, sorted and merged
    mb, _, ma, mz, ms = merge_runs(b, np.zeros_like(b), a, z, state, in_order=bare)
    self.pattern = Pattern(mb, ma, mz, ms)

  def pattern_along(self, along_rows: bool) -> bool:
    """Whether the runs along these lines are the pattern, the same on every line."""
    return (self.axis == "k") == along_rows

  def merged(self, along_rows: bool) -> LineRuns:
    """The runs as sorted, merged `(b, line, a, z, state)` arrays."""
    geo = self.geo
    n_lines, n_span = (geo.nq, geo.nk) if along_rows else (geo.nk, geo.nq)
    b, a, z, state = self.pattern
    if not self.pattern_along(along_rows):  # each run of lines: one run over the span
      n = z - a
      item = np.repeat(np.arange(n.size), n)
      line = (a - (np.cumsum(n) - n))[item] + np.arange(item.size)
      self.budget.charge(item.size * 48, "the packed runs")
      return LineRuns(b[item], line, np.zeros_like(line), np.full_like(line, n_span),
                      state[item])
    # every line repeats its batch row's pattern
    nb = self.batch or 1
    count = np.bincount(b, minlength=nb)
    self.budget.charge(int(count.sum()) * n_lines * 48, "the packed runs")
    first = np.cumsum(count) - count
    p = np.concatenate([np.tile(np.arange(f, f + c), n_lines) for f, c in zip(first, count)])
    line = np.concatenate([np.repeat(np.arange(n_lines), c) for c in count])
    return LineRuns(b[p], line, a[p], z[p], state[p])

  def runs(self, along_rows: bool) -> Runs:
    return pack_runs(*self.merged(along_rows), self.batch or 1,
                     self.geo.nq if along_rows else self.geo.nk)


class _EqualRuns:
  """The runs of `x[q + s] == x[k + t]` where each value of x is one run of its batch row
  (sorted segment ids; the ids of an image mask's runs): found by binary searches over
  the runs each line reads, exactly, with no analysis
  (`maskc.lowering.closed_forms.equal_reads`)."""

  exact = True

  def __init__(self, table: RunTable, shifts: tuple[int, int], on: np.ndarray | None,
               geo: TileGeometry, batch: int | None, budget: Budget):
    self.table, self.shifts, self.on, self.geo, self.batch = table, shifts, on, geo, batch
    # band-shaped lines where no truth read stands beside the equal reads
    self.forms = frozenset({Form.FLAT, Form.WIDENS} |
                           ({Form.LINE_BOUNDS} if on is None else set()))
    self.budget = budget
    self._lines: dict = {}  # the runs each line reads, for both directions
    self._widened: dict = {}  # bounds of a band widened by these reads (`widened`)

  @staticmethod
  def match(m: ir.Mask, geo: TileGeometry,
            tables: Tables) -> tuple[RunTable, tuple[int, int], np.ndarray | None] | None:
    """Rule `equal_reads`'s precondition, building nothing: `(x's runs, (s, t), on)` where
    `m` is equal reads of x (`maskc.lowering.closed_forms.equal_reads.equal_reads_where`),
    each value of x one run, and a truth read beside them (`on`, else None) constant on
    x's runs; else None."""
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

  def _lines_runs(self, along_rows: bool):
    """The runs as sorted, merged `(flat line, a, z, state)` arrays."""
    nb = self.batch or 1
    geo = self.geo
    tokens = self.table.length if self.on is None else 2 * self.table.length  # runs read
    self.budget.charge(nb * (geo.nq + geo.nk + min(geo.nq + geo.nk, tokens)) * 6 * 8,
                       "the runs of equal reads")
    return equal_read_runs(self.table, geo, nb, *self.shifts, along_rows, self.on, self._lines)

  def bounds(self, along_rows: bool) -> LineBounds | None:
    """The tiles as a band's bounds per flat line
    (`maskc.lowering.closed_forms.equal_reads.equal_read_bounds`), where no truth read stands
    beside the equal reads; else None."""
    if self.on is not None:
      return None
    nb, geo = self.batch or 1, self.geo
    self.budget.charge(nb * (geo.nq + geo.nk) * 6 * 8, "the runs of equal reads")
    return equal_read_bounds(self.table, geo, nb, *self.shifts, along_rows, self._lines)

  def widened(self, intervals: Intervals, along_rows: bool):
    """The bounds of `intervals | self` per line, where they are a band's
    (`maskc.lowering.closed_forms.widened_band`); else None. Remembered: a spread that cannot
    use them in closed form asks again."""
    if not enabled("widened_band"):
      return None
    key = (intervals.lo, intervals.hi, intervals.chunk, along_rows)
    if key not in self._widened:
      geo = self.geo
      self.budget.charge((self.table.batch * (geo.nq + geo.nk) + self.table.values.size) *
                         12 * 8, "a band widened by equal reads")
      self._widened[key] = widened_bounds(geo, intervals, self.table, self.shifts, self.on,
                                          along_rows, self._lines)
    if self._widened[key] is not None:
      took("widened_band")
    return self._widened[key]

  def flat(self, along_rows: bool) -> FlatRuns:
    """The runs as sorted, merged flat runs (`keyed`), from their flat lines directly."""
    f, a, z, state = self._lines_runs(along_rows)
    base = f * ((self.geo.nk if along_rows else self.geo.nq) + 1)
    return FlatRuns(base + a, base + z, state)

  def runs(self, along_rows: bool) -> Runs:
    n_lines, n_span = (self.geo.nq, self.geo.nk) if along_rows else (self.geo.nk, self.geo.nq)
    return pack_keyed(*self.flat(along_rows), self.batch or 1, n_lines, n_span)


class _PeriodicRuns:
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
    edges = []
    if self.nq < geo.nq:
      edges.append((self.nq, geo.nq, 0, geo.nk))
    if self.nk < geo.nk and self.nq:
      edges.append((0, self.nq, self.nk, geo.nk))
    self.edges = None
    if edges:
      start = tuple(np.asarray(x, np.int64) for x in zip(*([(0,) + e for e in edges])))
      self.edges = _hold_leaves(self._decided(geo, start), budget)

  @property
  def forms(self) -> frozenset[Form]:
    """`INTERVALS` where the mask is a band, or a band inside chunks, in the closed form's
    range (`causal & chunk(8192)`)."""
    return frozenset({Form.INTERVALS} if self.intervals() is not None else ())

  def intervals(self) -> Intervals | None:
    """The mask's one interval per row (`Intervals.of`), where `band_fits` the grid."""
    if not hasattr(self, "_intervals"):
      found = Intervals.of(self.m)
      self._intervals = (found if found is not None and band_fits(
          self.geo, (found.lo, found.hi, found.chunk)) else None)
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

  def _decided(self, geo: TileGeometry, start=None):
    """Leaves of `geo` (or of rectangles `start`), ambiguous tiles refined, EMPTY ones dropped."""
    return _decided_leaves(self.m, geo, self.tables, None, self.refine, self.budget, start=start)

  def _merged_row(self, along_rows: bool) -> LineRuns:
    """The runs of one batch row as sorted, merged `(b, line, a, z, state)` arrays."""
    geo, shape = self.geo, self.geo.shape
    n_lines, n_span = (self.nq, self.nk) if along_rows else (self.nk, self.nq)
    t_line, t_span = (self.tq, self.tk) if along_rows else (self.tk, self.tq)
    parts = []
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
