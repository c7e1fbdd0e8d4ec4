"""Rule `one_axis`: a mask that reads one position only (`g[k]`, `valid[k] & k < n`,
`sink(4)`): one line of tiles decides each axis.

Such a mask has the same state in every tile of a column of tiles (of a row, for `q`): a
vector of states over the tiles of its axis decides it, found on a virtual grid one tile
thick. Along the lines of its own axis (q tile rows of a `q` mask) each line is one run over
the whole span. Across them every line repeats the same runs, a *pattern*: the combiner
splices it into the other parts' runs without writing it out line by line, so `local(64,
64) | g[q] | g[k]` costs its output, not a pass of the analysis over every g column of every
row.

Where the position enters only as the whole index of per-token reads (`g[k]`, `~pad[k]`,
`img[q] & ~pad[q]`, `seg[k] == 0`: `x[k]`, not `x[k + 1]` or `k < n`), the mask is constant
between the tokens where one of the operands read starts a run: one evaluation per such
stretch gives its value, and a tile is FULL or EMPTY where one value covers it and PARTIAL
where the value changes inside it, exactly (`read_tile_states`). Otherwise each tile of the
line goes through one round of the analysis, refined where the map is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from maskc.compiled.tiles import EMPTY, FULL, PARTIAL, Runs
from maskc.language import ir
from maskc.lowering.generic.range_analysis import leaves_and_exactness
from maskc.lowering.grid.forms import Array, Form, LineRuns, Pattern, pack_runs
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget
from maskc.lowering.grid.run_lists import merge_runs
from maskc.lowering.rules import Rule, Site
from maskc.lowering.tuning import CUT_BYTES
from maskc.semantics.evaluate import Env, evaluate_mask
from maskc.semantics.ranges import Tables
from maskc.semantics.shape import Shape


def bare_reads_only(m: ir.Node) -> bool:
  """Whether positions enter `m` only as the whole index of per-token reads (`x[k]`), of
  operands (not run ids, not pairwise): `g[k] | ~pad[k]`, not `g[k] & k < n`."""
  if isinstance(m, ir.Read):
    return isinstance(m.index, ir.Pos) and not m.runs and isinstance(m.operand, ir.Operand)
  if isinstance(m, (ir.Pos, ir.PairRead, ir.Param)):
    return False
  if isinstance(m, ir.Call):
    return bare_reads_only(ir.expand(m))
  return all(bare_reads_only(c) for c in m.children() if not isinstance(c, ir.Operand))


def read_tile_states(m: ir.Mask, n: int, block: int, offset: int, nb: int, tables: Tables,
                     reads: Mapping[str, Any], budget: Budget) -> Array:
  """The states `[nb, ceil(n / block)]` of the tiles of one axis of `m` (`bare_reads_only`,
  reading positions of one axis only): `n` tokens at positions `offset + t`, tiles of
  `block`; `tables` give the operands' runs (`maskc.semantics.ranges.Tables.run_table`),
  `reads` the operands to evaluate with (`Tables.reads`); the stretches
  are charged to `budget` (the tiles are the caller's).
  """
  names = sorted({ir.array_key(r) for r in ir.walk(m) if isinstance(r, ir.Read)})
  n_tiles = -(-n // block)
  # each batch row's tokens where an operand read starts a run (clipped reads keep
  # the first and last token's value beyond the operand's ends): the stretches
  cuts = [np.arange(nb, dtype=np.int64) * n]
  for name in names:
    table = tables.run_table(name)  # of `nb` rows: forms come broadcast to the batch
    row, t = np.divmod(table.starts, table.length)
    t -= offset
    inside = (t > 0) & (t < n)
    cuts.append(row[inside] * n + t[inside])
  budget.charge(sum(c.size for c in cuts) * CUT_BYTES, "the reads of one axis")
  cut = np.unique(np.concatenate(cuts))
  b, t = np.divmod(cut, n)
  pos = t + offset
  env = Env(np, pos, pos, reads, b if nb > 1 else 0)
  value = np.asarray(evaluate_mask(m, env), bool)
  # where the value changes (a stretch of another value begins inside a row)
  change = np.flatnonzero((value[1:] != value[:-1]) & (b[1:] == b[:-1])) + 1
  # a tile's state: the value of the stretch holding its first token, PARTIAL where the
  # value changes past that token
  first = np.arange(nb, dtype=np.int64)[:, None] * n + np.arange(n_tiles) * block
  states = np.where(value[np.searchsorted(cut, first, "right") - 1], FULL, EMPTY)
  states = states.astype(np.int8)
  c = cut[change]
  inner = c % n % block != 0
  states.reshape(-1)[(c // n * n_tiles + c % n // block)[inner]] = PARTIAL
  return states


class AxisRuns:
  """The runs of a mask that reads one position only (`g[k]`, `valid[k]`, `g[q]`): one
  `pattern` of tile states per batch row over the tiles of its axis.

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
    self.exact: bool
    if bare:  # from the operands' runs: exact, no analysis
      tokens, block, offset = ((shape.q_len, geo.bq, shape.q_offset) if self.axis == "q" else
                               (shape.kv_len, geo.bk, 0))
      state = read_tile_states(m, tokens, block, offset, nb, tables, tables.reads(),
                               budget).reshape(-1)
      a, z, self.exact = t, t + 1, True
    else:  # every tile of the line at once: one round of the analysis, ambiguous ones refined
      one = np.zeros_like(t)
      start = (b, t, t + 1, one, one + 1) if self.axis == "q" else (b, one, one + 1, t, t + 1)
      (b, i0, i1, j0, j1, state), self.exact = leaves_and_exactness(
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


def match(m: ir.Mask, site: Site) -> str | None:
  """The one position `m` reads (`"q"` or `"k"`), on consecutive positions."""
  axes = ir.positions_of(m)
  return next(iter(axes)) if len(axes) == 1 and not site.geo.positions else None


def lower(m: ir.Mask, axis: str, site: Site) -> AxisRuns:
  return AxisRuns(m, site.geo, site.tables, site.batch, site.refine, site.budget)


def why_not(m: ir.Mask, site: Site) -> str | None:
  """A mask of one position that the generic analysis lowered: the rule was off."""
  if len(ir.positions_of(m)) == 1 and not ONE_AXIS.enabled():
    return "reads one position only, but rule one_axis is off"
  return None


ONE_AXIS = Rule(
    "one_axis", "a mask that reads one position only (`g[k]`, `sink(4)`): one line of tiles "
    "decides each axis (maskc.lowering.closed_forms.one_axis)", "part", "part", exact=False,
    match=match, lower=lower, why_not=why_not)
