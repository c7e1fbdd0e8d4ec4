"""Every rule of the lowering, in one list: the order part rules are tried in, then the rules
of the other stages (`maskc.lowering.rules.Rule`, one module each in `closed_forms/`).

- "part" rules lower a part of a mask on their own: a pure `match`, a `lower` to the part's
  runs, tried in this order by `maskc.lowering.generic.dispatch`, and otherwise the generic
  range analysis.
- "combine" rules combine the runs of an `&` / `|`'s parts in closed form, matched on the
  forms the parts give (`maskc.lowering.grid.parts`), not on the rule that lowered them,
  at the combiner's steps (`maskc.lowering.generic.combination`).
- "analysis" rules sharpen or shorten the generic range analysis.
- "intervals" rules prove `bm.key_intervals()`.

The lowering reaches them through `RULESET` alone, handed down in every `Site`. Each rule can
be turned off (`maskc.lowering.rules.disabled`, which knows the names this module registers),
and `tests/test_lowering_rules.py` checks each against the lowering without it: exact rules
(`Rule.exact`) give the mask's exact tiles, the others never contradict them.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from maskc.lowering.closed_forms.aligned_pairs import ALIGNED_PAIRS
from maskc.lowering.closed_forms.band import BAND
from maskc.lowering.closed_forms.diagonal_truth import DIAGONAL_TRUTH
from maskc.lowering.closed_forms.distribute import DISTRIBUTE
from maskc.lowering.closed_forms.equal_reads import EQUAL_READS
from maskc.lowering.closed_forms.met_bounds import MET_BOUNDS
from maskc.lowering.closed_forms.one_axis import ONE_AXIS
from maskc.lowering.closed_forms.parts import PARTS
from maskc.lowering.closed_forms.periodic import PERIODIC
from maskc.lowering.closed_forms.row_intervals import ROW_INTERVALS
from maskc.lowering.closed_forms.same_run_ids import SAME_RUN_IDS
from maskc.lowering.closed_forms.spread import SPREAD
from maskc.lowering.closed_forms.tile_cover import TILE_COVER
from maskc.lowering.closed_forms.tree import TREE
from maskc.lowering.closed_forms.widened_band import WIDENED_BAND
from maskc.lowering.rules import Rule, RuleSet, register

# Part rules in the order they are tried: a band first (a part's closed form, no period
# analysed), then the whole-mask forms, then the rewrite, then the split.
REGISTRY: tuple[Rule, ...] = (
    BAND, PERIODIC, ONE_AXIS, EQUAL_READS, TREE, DISTRIBUTE, PARTS,
    WIDENED_BAND, MET_BOUNDS, SPREAD, DIAGONAL_TRUTH,
    TILE_COVER, SAME_RUN_IDS, ALIGNED_PAIRS,
    ROW_INTERVALS,
)
"""Every rule, part rules in the order they are tried."""

RULESET = RuleSet(REGISTRY)
"""The registry as the lowering reads it: by step (`RuleSet.at`)."""

BY_NAME: Mapping[str, Rule] = types.MappingProxyType({r.name: r for r in REGISTRY})
RULES: Mapping[str, str] = types.MappingProxyType({r.name: r.doc for r in REGISTRY})
"""Each rule's name and its one-line description."""


register(*REGISTRY)
