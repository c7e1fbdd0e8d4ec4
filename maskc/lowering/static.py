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

This module packs the runs of each mask; the ways live beside it: the closed forms, one
rule a module, in `maskc/lowering/closed_forms/` (listed in `maskc.lowering.registry`), the
dispatch that tries them per part in `maskc.lowering.generic.dispatch`, the generic analysis
in `maskc.lowering.generic.range_analysis`, the combination of parts in
`maskc.lowering.generic.combination`, the pairs sampled there in
`maskc.lowering.generic.sampling`, and their tuning constants in `maskc.lowering.tuning`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from maskc.compiled.tiles import Runs
from maskc.language import ir
from maskc.lowering.generic.dispatch import lower_part
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.parts import PartRuns
from maskc.lowering.grid.refine import Budget
from maskc.lowering.grid.run_lists import stack_runs
from maskc.lowering.registry import RULESET
from maskc.lowering.rules import Site, step
from maskc.lowering.tuning import MEMORY_BUDGET
from maskc.semantics.operand_runs import RunForm
from maskc.semantics.ranges import Tables
from maskc.semantics.shape import Shape


class _Backward:
  """Computes the per-key-tile runs of a static map once, when a backward pass first asks.

  The compiler's memo, handed to the `BlockMap` as a function: the map never changes.
  """

  def __init__(self, per_mask: list[PartRuns]):
    self.per_mask = per_mask
    self.runs: Runs | None = None

  def __call__(self) -> Runs:
    if self.runs is None:
      self.runs = stack_runs([r.runs(along_rows=False) for r in self.per_mask])
      self.per_mask = []
    return self.runs


def compile_static(masks: Sequence[ir.Mask], shape: Shape, operands: Mapping[str, Any],
                   batch: int | None, block_q: int, block_kv: int, refine: Sequence[bool],
                   budget: Budget | None = None, forms: dict[str, RunForm] | None = None
                   ) -> tuple[Runs, _Backward]:
  """Per-q-tile runs `[B, U, nq, R]` of the masks, and the memo computing the per-key-tile runs.

  `forms`: the per-token operands' runs where binding already found them.
  """
  geo = TileGeometry(shape, block_q, block_kv)
  budget = budget or Budget(MEMORY_BUDGET)
  # shared: tables are built for the operands masks read, configured by the analysis rules
  # at step "tables"; each says afterwards whether the analysis used it
  tables = Tables(np, operands, forms, budget=budget)
  used = [(r, r.run(tables, masks, geo)) for r in RULESET.at("tables") if r.enabled()]
  with step("lower"):
    per_mask = [lower_part(m, Site(geo, tables, batch, ref, budget, RULESET))
                for m, ref in zip(masks, refine)]
  for rule, was_used in used:
    if was_used():
      rule.took()
  with step("combine"):  # the runs packed: where parts lowered apart are combined
    rows = stack_runs([r.runs(along_rows=True) for r in per_mask])
  return rows, _Backward(per_mask)
