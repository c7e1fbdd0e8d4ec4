"""The static lowering path: every operand a NumPy value.

Five ways to the same runs, chosen per mask:

- A mask without operands that has a *diagonal period* (`causal`, `sliding(w)`,
  `chunk(n)`, `(q - k) % 4 == 0`: see `maskc.analysis.diagonal_period`) has the same tile
  states one period further down the diagonal. One period of rows is classified,
  over a grid moved along the diagonal so that it reaches every column the
  repeats need, and repeated; the same for columns. Cost: one period plus the
  output.
- A mask that reads one position only (`g[k]`, `valid[k] & k < n`, `sink(4)`)
  has the same state in every tile across its axis: one line of tiles decides
  it. Cost: the tiles of one axis plus the output.
- `x[q + s] == x[k + t]` where each value of x is one run (sorted documents;
  `bidirectional(img)`): each line's tiles follow from binary searches over the
  runs the lines read (`maskc.lowering.closed_forms.equal_reads`). Cost: the lines plus the output.
- An `&` or `|` whose operand-free items have such a period, some of whose items
  read one position only, or are lowered in parts themselves
  (`causal & chunk(8192) | bidirectional(img)`, `local(64, 64) | g[q] | g[k]`):
  the parts are lowered apart, each its own way, and their runs combined; a part
  of `k` alone is spliced into each row's runs where they meet it, never written
  out for every row. Only tiles where two parts are PARTIAL are decided again,
  for the whole mask.
- Any other mask: rectangles of tiles are classified by range analysis and the
  PARTIAL ones split in two dimensions, first where an operand changes (between
  such cuts every read is constant, so the analysis is as sharp as without
  operands), then in halves, until each is decided, a single tile, or a strip of
  tiles the operand pieces prove PARTIAL throughout. Cost: the tiles on the
  mask's boundary plus the operand runs, times a logarithm.

None allocates the tile grid or any `q_len × kv_len` array. The decided
rectangles give the per-q-tile runs at once and the per-key-tile runs for the
backward pass on demand.

This module chooses the way per mask (`_runs_of_mask`); the ways live beside it: the
generic analysis in `maskc.lowering.range_analysis`, the closed forms of one part in
`maskc.lowering.part_runs`, the combination of parts in `maskc.lowering.combined`, the
pairs sampled there in `maskc.lowering.sampling`, and their tuning constants in
`maskc.lowering.tuning`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from maskc.analysis.diagonal_period import diagonal_period
from maskc.analysis.linear import exact_band
from maskc.compiled.tiles import Runs
from maskc.language import ir
from maskc.lowering.closed_forms.band_runs import BandRuns, band_fits
from maskc.lowering.closed_forms.equal_reads import equal_reads_where, unique_runs
from maskc.lowering.combined import _CombinedRuns
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget
from maskc.lowering.grid.run_lists import stack_runs
from maskc.lowering.part_runs import _AxisRuns, _EqualRuns, _PeriodicRuns
from maskc.lowering.range_analysis import _StaticRuns
from maskc.lowering.rules import disabled_now, enabled, recorder, step, took
from maskc.lowering.tuning import MEMORY_BUDGET, WHOLE_AFTER
from maskc.semantics.bind import Shape
from maskc.semantics.operand_runs import RunForm, reads_at
from maskc.semantics.ranges import Tables


class _Backward:
  """Computes the per-key-tile runs of a static map once, when a backward pass first asks.

  The compiler's memo, handed to the `BlockMap` as a function: the map never changes.
  """

  def __init__(self, per_mask: list[_StaticRuns]):
    self.per_mask = per_mask
    self.runs: Runs | None = None

  def __call__(self) -> Runs:
    if self.runs is None:
      self.runs = stack_runs([r.runs(along_rows=False) for r in self.per_mask])
      self.per_mask = []
    return self.runs


def _periodic(m: ir.Mask, geo: TileGeometry) -> int | None:
  """The diagonal period of an operand-free mask, where repeating it pays; else None."""
  if m.operands or geo.positions or not enabled("periodic"):
    return None
  period = diagonal_period(m)
  return period if period is not None and _PeriodicRuns.worth(geo, period) else None


def _parts(m: ir.Mask, geo: TileGeometry) -> list[ir.Mask] | None:
  """The parts of an `&` / `|` lowered apart, or None to lower it whole.

  Parts: its items that read one position only, joined per axis (`g[q]`, `g[k]`,
  `valid[k]`, `sink(4)`: see `_AxisRuns`); its operand-free items joined, where
  they have a diagonal period worth repeating (else those that have one); each
  other item that is itself lowered in parts (`document(seg) & (causal |
  bidirectional(img))`, `causal | prefix(4096)`); the other items joined. At
  least one part must be periodic (or a band of an `&`: `maskc.lowering.closed_forms.band_runs`), in
  parts itself or of one axis: otherwise splitting saves nothing.
  """
  while isinstance(m, ir.Call):
    m = ir.expand(m)
  split = ir.operand_free_split(m)
  if split is None or geo.positions or not enabled("parts"):
    return None
  free, rest, join = split
  axis_items = {a: [x for x in free + rest if ir.positions_of(x) == {a}] for a in "qk"}
  free, rest = ([x for x in items if len(ir.positions_of(x)) != 1] for items in (free, rest))
  periodic = []
  if free and (_periodic(ir.joined(free, join), geo) is not None or
               (join is ir.and_ and _clip_band(ir.joined(free, join), geo) is not None)):
    periodic, free = free, []
  elif free:
    some = [x for x in free if _periodic(x, geo) is not None]
    if some and _periodic(ir.joined(some, join), geo) is not None:
      periodic, free = some, [x for x in free if not any(x is y for y in some)]
  items = rest + free
  in_parts = [_parts(x, geo) is not None for x in items]
  nested = [x for x, y in zip(items, in_parts) if y]
  others = [x for x, y in zip(items, in_parts) if not y]
  axes = [ir.joined(axis_items[a], join) for a in "qk" if axis_items[a]]
  parts = ([ir.joined(periodic, join)] if periodic else []) + nested + (
      [ir.joined(others, join)] if others else []) + axes
  return parts if (periodic or nested or axes) and len(parts) > 1 else None


def _one_axis(m: ir.Mask, geo: TileGeometry) -> bool:
  """Whether `m` reads one position only (`g[k]`, `valid[k] & k < n`, `sink(4)`): lowered as
  `_AxisRuns`."""
  return not geo.positions and len(ir.positions_of(m)) == 1 and enabled("one_axis")


def _parts_pay(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None) -> bool:
  """Whether lowering `m` in parts (`_parts`) beats lowering it whole, where a part needs
  range analysis (parts that need none always pay: `_unanalysed`).

  An `&` lowered whole prunes its operand items by its periodic ones, and
  combining the parts' runs costs a pass over every square's runs: short documents
  (more than one change per four tile rows, `WHOLE_AFTER`) lower faster whole, long
  ones faster in parts. An `|` cannot prune that way: in parts always. (The figures:
  `docs/lowering.md`, "Measurements behind the design".)
  """
  if not isinstance(m, ir.And):
    return True
  nb = batch or 1
  changes = sum(tables.run_table(name).starts.size - nb for name in {n for n, _ in
                                                                       reads_at(m, "q")})
  return changes <= WHOLE_AFTER * nb * geo.nq


def _unanalysed(m: ir.Mask, geo: TileGeometry, tables: Tables, join) -> bool:
  """Whether `m`, a part of an `&` / `|` (`join`), is lowered without range analysis over
  the grid: by its period, along one axis, as equal reads of runs (`_runs_of_mask`), as
  a band of an `&`, or in parts that all are (`causal | bidirectional(img)` in
  `document(seg) & (causal | bidirectional(img))`)."""
  while isinstance(m, ir.Call):
    m = ir.expand(m)
  if (_periodic(m, geo) is not None or _one_axis(m, geo) or
      (join is ir.and_ and _clip_band(m, geo) is not None) or
      _EqualRuns.match(m, geo, tables) is not None):
    return True
  parts = _parts(m, geo)
  inner = ir.and_ if isinstance(m, ir.And) else ir.or_
  return parts is not None and all(_unanalysed(x, geo, tables, inner) for x in parts)


def _runs_of_mask(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None, refine: bool,
                  budget: Budget):
  """How one mask's runs are computed (`_lowered`); where `maskc.explain` listens
  (`maskc.lowering.rules.recording`), recorded as a part with the way it took."""
  rec = recorder()
  if rec is None:
    return _lowered(m, geo, tables, batch, refine, budget)[0]
  with rec.part(m) as part:
    part.runs, part.way = _lowered(m, geo, tables, batch, refine, budget)
    if part.way == "generic":
      part.reason = _why_generic(m, geo, tables, batch)
  return part.runs


def _lowered(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None, refine: bool,
             budget: Budget):
  """`(runs, way)` of one mask: by its diagonal period where it has one; along its one axis
  when it reads only one (`_AxisRuns`); as equal reads of runs; as the `&` / `|` of parts
  lowered apart (`_parts`); else by leaves (way "generic")."""
  period = _periodic(m, geo)
  if period is not None:
    took("periodic")
    return _PeriodicRuns(m, geo, tables, batch, refine, budget, period), "periodic"
  if _one_axis(m, geo):
    took("one_axis")
    return _AxisRuns(m, geo, tables, batch, refine, budget), "one_axis"
  while isinstance(m, ir.Call):  # `document(seg)`, `streaming(w, s)`: the parts of its body
    m = ir.expand(m)
  equal = _EqualRuns.of(m, geo, tables, batch, budget)
  if equal is not None:
    took("equal_reads")
    return equal, "equal_reads"
  parts = _parts(m, geo)
  if parts is not None and not _parts_pay(m, geo, tables, batch) and not all(
      _unanalysed(x, geo, tables, ir.and_ if isinstance(m, ir.And) else ir.or_)
      for x in parts):
    parts = None
  if parts is not None:
    took("parts")
    return _CombinedRuns(m, [_band_part(x, geo, batch) or
                             _runs_of_mask(x, geo, tables, batch, refine, budget)
                             for x in parts], geo, tables, batch, refine, budget), "parts"
  return _StaticRuns(m, geo, tables, batch, refine, budget), "generic"


def _why_generic(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None) -> str:
  """Why no rule lowered `m` and the generic range analysis did: for `maskc.explain` only
  (it repeats the checks of `_lowered`)."""
  off = sorted(disabled_now() & {"periodic", "one_axis", "equal_reads", "parts"})
  note = f" (rules turned off: {', '.join(off)})" if off else ""
  if geo.positions:
    return "explicit positions: the closed forms need consecutive positions" + note
  while isinstance(m, ir.Call):
    m = ir.expand(m)
  if not m.operands:
    period = diagonal_period(m)
    if period is None and not isinstance(m, (ir.And, ir.Or)):
      return "no operands, but no diagonal period (`maskc.analysis.diagonal_period`)" + note
    if period is not None and enabled("periodic"):
      return (f"a diagonal period of {period} tokens, too long to repeat on this grid (more "
              f"than a quarter of it)" + note)
  if len(ir.positions_of(m)) == 1:
    return "reads one position only, but rule one_axis is off" + note
  found = equal_reads_where(m)
  if found is not None and not unique_runs(tables.run_table(found[0])):
    return (f"equal reads of `{found[0]}`, but some value of `{found[0]}` spans more than one "
            f"run" + note)
  if _parts(m, geo) is not None:
    nb = batch or 1
    changes = sum(tables.run_table(name).starts.size - nb for name in {n for n, _ in
                                                                         reads_at(m, "q")})
    return (f"an `&` whose operands change {changes / (nb * geo.nq):.2f} times per tile row "
            f"(over {WHOLE_AFTER}), with a part that needs the analysis: faster whole than "
            f"in parts" + note)
  if isinstance(m, (ir.And, ir.Or)):
    return ("an `&` / `|` with no part of a closed form (a diagonal period, one axis, a band "
            "of an `&`, or parts of its own) to split off" + note)
  return ("no closed form matches: no diagonal period, more than one position read, not "
          "equal reads of runs, not an `&` / `|`" + note)


def _band_part(m: ir.Mask, geo: TileGeometry, batch: int | None) -> BandRuns | None:
  """A part of an `&` or `|` that is exactly a band of `q - k` (`causal`, `sliding(w)`,
  `local(64, 64)`), in closed form (`maskc.lowering.closed_forms.band_runs`): an `&` clips the
  other parts' runs to it, an `|` combines them with its runs, no period analysed. None
  otherwise."""
  band = _clip_band(m, geo)
  if band is None:
    return None
  rec = recorder()
  if rec is None:
    took("band")
    return BandRuns(geo, band, batch or 1)
  with rec.part(m) as part:
    took("band")
    part.runs, part.way = BandRuns(geo, band, batch or 1), "band"
  return part.runs


def _clip_band(m: ir.Mask, geo: TileGeometry) -> tuple[int | None, int | None] | None:
  """The band `(lo, hi)` of `q - k` that operand-free `m` is exactly, where its closed form
  holds on `geo` (`maskc.lowering.closed_forms.band_runs.band_fits`); else None."""
  if m.operands or not enabled("band"):
    return None
  band = exact_band(m)
  return band if band is not None and band_fits(geo, band) else None


def compile_static(masks, shape: Shape, operands: Mapping[str, Any], batch: int | None,
                   block_q: int, block_kv: int, refine: list[bool], budget: Budget | None = None,
                   forms: dict[str, RunForm] | None = None):
  """Per-q-tile runs `[B, U, nq, R]` of the masks, and the memo computing the per-key-tile runs.

  `forms`: the per-token operands' runs where binding already found them.
  """
  geo = TileGeometry(shape, block_q, block_kv)
  budget = budget or Budget(MEMORY_BUDGET)
  # shared: tables are built for the operands masks read
  tables = Tables(np, operands, forms, budget=budget, same_runs=enabled("same_run_ids"))
  with step("lower"):
    per_mask = [_runs_of_mask(m, geo, tables, batch, ref, budget)
                for m, ref in zip(masks, refine)]
  if tables.same_runs_used:
    took("same_run_ids")
  with step("combine"):  # the runs packed: where parts lowered apart are combined
    rows = stack_runs([r.runs(along_rows=True) for r in per_mask])
  return rows, _Backward(per_mask)
