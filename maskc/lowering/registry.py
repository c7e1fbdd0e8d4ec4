"""Every rule of the lowering, one entry each (`maskc.lowering.rules.Rule`), by stage.

- "part" rules (`maskc.lowering.part_rules.PART_RULES`) lower a part of a mask on their
  own: a pure `match`, a `lower` to the part's runs, tried in order, and otherwise the
  generic range analysis.
- "combine" rules (`maskc.lowering.combined.COMBINE_RULES`) combine the runs of an `&` /
  `|`'s parts in closed form, matched on the forms the parts give
  (`maskc.lowering.grid.forms.Form`), not on the rule that lowered them.
- "analysis" rules sharpen or shorten the generic range analysis.
- "intervals" rules prove `bm.key_intervals()`.

Each rule can be turned off (`maskc.lowering.rules.disabled`, which knows the names this
module registers), and
`tests/test_lowering_rules.py` checks each against the lowering without it: exact rules
(`Rule.exact`) give the mask's exact tiles, the others never contradict them.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from maskc.lowering.combined import COMBINE_RULES
from maskc.lowering.part_rules import PART_RULES
from maskc.lowering.rules import Rule, register

ANALYSIS_RULES: tuple[Rule, ...] = (
    Rule("tile_cover", "the analysis starts from the rectangles where the operands' runs "
         "allow a true pair (maskc.lowering.closed_forms.tile_cover)", "analysis", exact=False),
    Rule("same_run_ids", "`runs(x)[a] == runs(x)[b]` beside `x[a]` analysed by ids of x's "
         "runs of zeros and nonzeros (static) or by run labels (traced, "
         "maskc.lowering.closed_forms.same_run)", "analysis", exact=False,
         traced="maskc.lowering.closed_forms.same_run.same_runs"),
)

INTERVAL_RULES: tuple[Rule, ...] = (
    Rule("row_intervals", "one interval of keys per row for `bm.key_intervals()`, proved from "
         "bands, chunks, runs of equal reads and masks of one position "
         "(maskc.lowering.closed_forms.row_intervals)", "intervals", exact=True),
)

REGISTRY: tuple[Rule, ...] = PART_RULES + COMBINE_RULES + ANALYSIS_RULES + INTERVAL_RULES
"""Every rule, part rules in the order they are tried."""

BY_NAME: Mapping[str, Rule] = types.MappingProxyType({r.name: r for r in REGISTRY})
RULES: Mapping[str, str] = types.MappingProxyType({r.name: r.doc for r in REGISTRY})
"""Each rule's name and its one-line description."""


register(*REGISTRY)
