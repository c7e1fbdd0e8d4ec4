"""The one dispatch of the static lowering: a part of a mask goes to the first part rule of
the registry that matches it (`site.rules.at("part")`, in the registry's order), else to
the generic range analysis (`maskc.lowering.generic.range_analysis.GenericRuns`), which
the analysis rules at step "start" may shorten.

The rules live in `maskc/lowering/closed_forms/`, one module each; a rule that lowers a part
in parts (`parts`, `distribute`) lowers each of them through `lower_part` again.
"""

from __future__ import annotations

from typing import Any

from maskc.language import ir
from maskc.lowering.generic.range_analysis import GenericRuns, Rects
from maskc.lowering.grid.parts import PartRuns
from maskc.lowering.rules import Site, disabled_now, recorder


def body_of(m: ir.Mask) -> ir.Mask:
  """`m` with its outer named calls expanded (`document(seg)`: its body)."""
  while isinstance(m, ir.Call):
    m = ir.expand(m)
  return m


def lower_part(m: ir.Mask, site: Site) -> PartRuns:
  """The runs of part `m` (a whole mask where `site.join` is None): by the first part rule
  that matches, else by the generic range analysis. Where `maskc.explain` listens
  (`maskc.lowering.rules.recording`), recorded as a part with the way it took."""
  rec = recorder()
  if rec is None:
    return _lowered(m, site)[0]
  with rec.part(m) as part:
    part.runs, part.way = _lowered(m, site)
    if part.way == "generic":
      part.reason = why_generic(m, site)
  runs: PartRuns = part.runs
  return runs


def _lowered(m: ir.Mask, site: Site) -> tuple[PartRuns, str]:
  """`(runs, way)` of one part: the way is the rule's name, or "generic"."""
  for rule in site.rules.at("part"):
    found = rule.found(m, site)
    if found is not None:
      rule.took()
      runs: PartRuns = rule.run(m, found, site)
      return runs, rule.name
  body = body_of(m)
  return (GenericRuns(body, site.geo, site.tables, site.batch, site.refine, site.budget,
                      start=_start(body, site)), "generic")


def _start(m: ir.Mask, site: Site) -> Rects | None:
  """The rectangles the generic analysis of `m` starts from, by the first rule at step
  "start" that finds them (where the operands allow a true pair); None: the whole grid."""
  for rule in site.rules.at("start"):
    if rule.enabled():
      found: Any = rule.run(m, site)
      if found is not None:
        rule.took()
        start: Rects = found
        return start
  return None


def why_generic(m: ir.Mask, site: Site) -> str:
  """Why no rule lowered `m` and the generic range analysis did, for `maskc.explain`: the
  first reason a part rule gives (`Rule.why_not`), in the registry's order."""
  rules = site.rules.at("part")
  off = sorted(disabled_now() & {r.name for r in rules})
  note = f" (rules turned off: {', '.join(off)})" if off else ""
  if site.geo.positions:
    return "explicit positions: the closed forms need consecutive positions" + note
  for rule in rules:
    if rule.why_not is not None:
      why = rule.why_not(m, site)
      if why is not None:
        return why + note
  if isinstance(body_of(m), (ir.And, ir.Or)):
    return ("an `&` / `|` with no part of a closed form (a diagonal period, one axis, a band "
            "of an `&`, or parts of its own) to split off" + note)
  return ("no closed form matches: no diagonal period, more than one position read, not "
          "equal reads of runs, not an `&` / `|`" + note)
