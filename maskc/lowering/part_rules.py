"""The rules that lower one part of a mask on their own, in the order they are tried, and the
loop that tries them (`lower_part`).

Each is a `maskc.lowering.rules.Rule` of stage "part": a pure `match` (its precondition on
the mask and the operands' run structure, which builds no runs), a `lower` that builds the
part's runs from what `match` found, whether those runs are always exact, and its traced
variant where it has one. A part no rule matches is lowered by the generic range analysis
(`maskc.lowering.range_analysis._StaticRuns`):

- `band`: a part of an `&` / `|` that is exactly a band of `q - k` (`causal`,
  `sliding(w)`, `local(64, 64)`), in closed form (`maskc.lowering.closed_forms.band_runs`).
- `periodic`: an operand-free mask with a diagonal period (`causal`, `chunk(n)`, `(q - k) %
  4 == 0`): one period of tiles classified and repeated (`_PeriodicRuns`).
- `one_axis`: a mask that reads one position only (`g[k]`, `valid[k] & k < n`, `sink(4)`):
  one line of tiles decides each axis (`_AxisRuns`).
- `equal_reads`: `x[q + s] == x[k + t]` where each value of x is one run (sorted
  documents, `bidirectional(img)`): binary searches per line (`_EqualRuns`).
- `distribute`: an IR rewrite, `x & (rest | g[k])` as `(x & rest) | (x & g[k])`, lowered by
  this loop: the pattern of `g[k]` is spliced into x's runs alone.
- `parts`: an `&` / `|` whose parts lower apart, each by this loop, their runs combined
  (`maskc.lowering.combined._CombinedRuns`), where that pays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from maskc.analysis.diagonal_period import diagonal_period
from maskc.analysis.linear import exact_band
from maskc.language import ir
from maskc.lowering.closed_forms.band_runs import BandRuns, band_fits
from maskc.lowering.closed_forms.equal_reads import equal_reads_where, unique_runs
from maskc.lowering.combined import _CombinedRuns
from maskc.lowering.part_runs import _AxisRuns, _EqualRuns, _PeriodicRuns
from maskc.lowering.range_analysis import _StaticRuns
from maskc.lowering.rules import Rule, Site, disabled_now, enabled, recorder, took
from maskc.lowering.tuning import WHOLE_AFTER
from maskc.semantics.operand_runs import reads_at


def _expanded(m: ir.Mask) -> ir.Mask:
  """`m` with its outer named calls expanded (`document(seg)`: its body)."""
  while isinstance(m, ir.Call):
    m = ir.expand(m)
  return m


def _band_match(m: ir.Mask, site: Site) -> tuple[int | None, int | None] | None:
  """The band `(lo, hi)` of `q - k` that operand-free part `m` is exactly, where its closed
  form holds on the grid (`band_fits`); None for a whole mask (a band alone is periodic)."""
  if site.join is None or m.operands:
    return None
  band = exact_band(m)
  return band if band is not None and band_fits(site.geo, band) else None


def _periodic_match(m: ir.Mask, site: Site) -> int | None:
  """The diagonal period of operand-free `m` on consecutive positions, where repeating it
  pays (`_PeriodicRuns.worth`: at most a quarter of the grid)."""
  if m.operands or site.geo.positions:
    return None
  period = diagonal_period(m)
  return period if period is not None and _PeriodicRuns.worth(site.geo, period) else None


def _one_axis_match(m: ir.Mask, site: Site) -> str | None:
  """The one position `m` reads (`"q"` or `"k"`), on consecutive positions."""
  axes = ir.positions_of(m)
  return next(iter(axes)) if len(axes) == 1 and not site.geo.positions else None


def _equal_reads_match(m: ir.Mask, site: Site):
  """`_EqualRuns.match` of `m`'s body: equal reads of runs, each value one run."""
  return None if site.geo.positions else _EqualRuns.match(_expanded(m), site.geo, site.tables)


BAND = Rule(
    "band", "a band of `q - k` (`causal`, `sliding(w)`, `local(l, r)`) in an `&` / `|`, in "
    "closed form (maskc.lowering.closed_forms.band_runs)", "part", exact=True,
    match=_band_match, lower=lambda m, band, site: BandRuns(site.geo, band, site.batch or 1))
PERIODIC = Rule(
    "periodic", "an operand-free mask with a diagonal period (`causal`, `chunk(c)`): one "
    "period of tiles classified and repeated (maskc.analysis.diagonal_period)", "part",
    exact=False, match=_periodic_match,
    lower=lambda m, period, s: _PeriodicRuns(m, s.geo, s.tables, s.batch, s.refine, s.budget,
                                             period))
ONE_AXIS = Rule(
    "one_axis", "a mask that reads one position only (`g[k]`, `sink(4)`): one line of tiles "
    "decides each axis (maskc.lowering.closed_forms.axis_reads)", "part", exact=False,
    match=_one_axis_match,
    lower=lambda m, axis, s: _AxisRuns(m, s.geo, s.tables, s.batch, s.refine, s.budget))
EQUAL_READS = Rule(
    "equal_reads", "`x[q + s] == x[k + t]` where each value of x is one run "
    "(`document(seg)`, `bidirectional(img)`): binary searches per line "
    "(maskc.lowering.closed_forms.equal_reads)", "part", exact=True,
    match=_equal_reads_match,
    lower=lambda m, found, s: _EqualRuns(found[0], found[1], found[2], s.geo, s.batch,
                                         s.budget))


def split(m: ir.Mask, site: Site) -> list[ir.Mask] | None:
  """The parts of an `&` / `|` lowered apart, or None to lower it whole.

  Parts: its items that read one position only, joined per axis (`g[q]`, `g[k]`,
  `valid[k]`, `sink(4)`: see `_AxisRuns`); its operand-free items joined, where they have
  a diagonal period worth repeating (else those that have one); each other item that is
  itself lowered in parts (`document(seg) & (causal | bidirectional(img))`, `causal |
  prefix(4096)`); the other items joined. At least one part must be periodic (or a band
  of an `&`), in parts itself or of one axis: otherwise splitting saves nothing.
  """
  m = _expanded(m)
  found = ir.operand_free_split(m)
  if found is None or site.geo.positions:
    return None
  free, rest, join = found
  inner = site.part_of(join)
  axis_items = {a: [x for x in free + rest if ir.positions_of(x) == {a}] for a in "qk"}
  free, rest = ([x for x in items if len(ir.positions_of(x)) != 1] for items in (free, rest))
  periodic = []
  if free and (PERIODIC.found(ir.joined(free, join), site) is not None or
               (join is ir.and_ and BAND.found(ir.joined(free, join), inner) is not None)):
    periodic, free = free, []
  elif free:
    some = [x for x in free if PERIODIC.found(x, site) is not None]
    if some and PERIODIC.found(ir.joined(some, join), site) is not None:
      periodic, free = some, [x for x in free if not any(x is y for y in some)]
  items = rest + free
  in_parts = [split(x, site) is not None for x in items]
  nested = [x for x, y in zip(items, in_parts) if y]
  others = [x for x, y in zip(items, in_parts) if not y]
  axes = [ir.joined(axis_items[a], join) for a in "qk" if axis_items[a]]
  parts = ([ir.joined(periodic, join)] if periodic else []) + nested + (
      [ir.joined(others, join)] if others else []) + axes
  return parts if (periodic or nested or axes) and len(parts) > 1 else None


def _changes(m: ir.Mask, site: Site) -> int:
  """How often the operands `m` reads at `q` change, over every batch row."""
  nb = site.batch or 1
  return sum(site.tables.run_table(name).starts.size - nb for name in {n for n, _ in
                                                                       reads_at(m, "q")})


def _parts_pay(m: ir.Mask, site: Site) -> bool:
  """Whether lowering `m` in parts beats lowering it whole, where a part needs range analysis
  (parts that need none always pay: `_unanalysed`).

  An `&` lowered whole prunes its operand items by its periodic ones, and combining the
  parts' runs costs a pass over every square's runs: short documents (more than one
  change per four tile rows, `WHOLE_AFTER`) lower faster whole, long ones faster in
  parts. An `|` cannot prune that way: in parts always. (The figures: `docs/lowering.md`,
  "Measurements behind the design".)
  """
  return (not isinstance(m, ir.And) or
          _changes(m, site) <= WHOLE_AFTER * (site.batch or 1) * site.geo.nq)


def _unanalysed(m: ir.Mask, site: Site) -> bool:
  """Whether part `m` is lowered without range analysis over the grid: by a closed form of
  one part (a band only in an `&`: in an `|` its period serves), or in parts that all are
  (`causal | bidirectional(img)` in `document(seg) & (causal | bidirectional(img))`)."""
  m = _expanded(m)
  if any(rule.found(m, site) is not None for rule in (PERIODIC, ONE_AXIS, EQUAL_READS)) or (
      site.join is ir.and_ and BAND.found(m, site) is not None):
    return True
  parts = split(m, site)
  inner = site.part_of(ir.and_ if isinstance(m, ir.And) else ir.or_)
  return parts is not None and all(_unanalysed(x, inner) for x in parts)


def _parts_match(m: ir.Mask, site: Site) -> tuple[ir.Mask, list[ir.Mask]] | None:
  """`(m's body, its parts)` where `m` is an `&` / `|` that lowers in parts (`split`), and
  either that pays (`_parts_pay`) or no part needs the analysis."""
  m = _expanded(m)
  parts = split(m, site)
  if parts is None:
    return None
  inner = site.part_of(ir.and_ if isinstance(m, ir.And) else ir.or_)
  if not _parts_pay(m, site) and not all(_unanalysed(x, inner) for x in parts):
    return None
  return m, parts


def _lower_parts(m: ir.Mask, found: tuple[ir.Mask, list[ir.Mask]], site: Site) -> _CombinedRuns:
  body, parts = found
  inner = site.part_of(ir.and_ if isinstance(body, ir.And) else ir.or_)
  return _CombinedRuns(body, [lower_part(x, inner) for x in parts], site.geo, site.tables,
                       site.batch, site.refine, site.budget)


def _distributable(item: ir.Mask) -> tuple[list[ir.Mask], list[ir.Mask]] | None:
  """`(its items that read only k, the others)` where `item` of an `&` is an `|` with both;
  else None. Structure only: whether it lowers in parts is `_distribute_match`'s."""
  body = _expanded(item)
  if not isinstance(body, ir.Or):
    return None
  pattern = [x for x in body.items if ir.positions_of(x) == {"k"}]
  rest = [x for x in body.items if ir.positions_of(x) != {"k"}]
  return (pattern, rest) if pattern and rest else None


def _distribute_match(m: ir.Mask, site: Site) -> ir.Mask | None:
  """`(x & rest) | (x & pattern)` where `m` is `x & (rest | pattern)` lowered in parts, the
  pattern its `|`'s items that read only k (`g[k]`, a pattern along every q tile row),
  and no other item of the `&` is such an `|` (each would double the parts). The
  structure is checked first: most masks have no such `|`, and building nothing for
  them keeps small compiles cheap."""
  m = _expanded(m)
  if not isinstance(m, ir.And) or site.geo.positions:
    return None
  found = [(i, f) for i, f in ((i, _distributable(x)) for i, x in enumerate(m.items))
           if f is not None]
  if len(found) != 1:
    return None
  i, (pattern, rest) = found[0]
  if (split(_expanded(m.items[i]), site.part_of(ir.and_)) is None or
      _parts_match(m, site) is None):
    return None
  x = ir.joined(m.items[:i] + m.items[i + 1:], ir.and_)
  return ir.or_([ir.and_([x, ir.joined(rest, ir.or_)]),
                 ir.and_([x, ir.joined(pattern, ir.or_)])])


DISTRIBUTE = Rule(
    "distribute", "`x & (rest | pattern)` rewritten `(x & rest) | (x & pattern)` before it "
    "lowers, the pattern the `|`'s items that read only k (`g[k]`): `x & pattern` splices "
    "the pattern into x's runs", "part", exact=False, match=_distribute_match,
    lower=lambda m, rewritten, site: lower_part(rewritten, site))

PARTS = Rule(
    "parts", "an `&` / `|` whose parts lower apart, their runs combined (static), or whose "
    "operand-free items lower at trace time (traced)", "part", exact=False,
    match=_parts_match, lower=_lower_parts,
    traced="maskc.lowering.traced._static_part")

# Tried in this order: a band first (a part's closed form, no period analysed), then the
# whole-mask forms, then the rewrite, then the split.
PART_RULES: tuple[Rule, ...] = (BAND, PERIODIC, ONE_AXIS, EQUAL_READS, DISTRIBUTE, PARTS)


def lower_part(m: ir.Mask, site: Site) -> Any:
  """The runs of part `m` (a whole mask where `site.join` is None): by the first rule of
  `PART_RULES` that matches, else by the generic range analysis. Where `maskc.explain`
  listens (`maskc.lowering.rules.recording`), recorded as a part with the way it took."""
  rec = recorder()
  if rec is None:
    return _lowered(m, site)[0]
  with rec.part(m) as part:
    part.runs, part.way = _lowered(m, site)
    if part.way == "generic":
      part.reason = why_generic(m, site)
  return part.runs


def _lowered(m: ir.Mask, site: Site) -> tuple[Any, str]:
  """`(runs, way)` of one part: the way is the rule's name, or "generic"."""
  for rule in PART_RULES:
    found = rule.found(m, site)
    if found is not None:
      took(rule.name)
      return cast(Callable[..., Any], rule.lower)(m, found, site), rule.name
  return (_StaticRuns(_expanded(m), site.geo, site.tables, site.batch, site.refine,
                      site.budget), "generic")


def why_generic(m: ir.Mask, site: Site) -> str:
  """Why no rule lowered `m` and the generic range analysis did: for `maskc.explain` only."""
  off = sorted(disabled_now() & {r.name for r in PART_RULES})
  note = f" (rules turned off: {', '.join(off)})" if off else ""
  if site.geo.positions:
    return "explicit positions: the closed forms need consecutive positions" + note
  m = _expanded(m)
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
  if found is not None and not unique_runs(site.tables.run_table(found[0])):
    return (f"equal reads of `{found[0]}`, but some value of `{found[0]}` spans more than one "
            f"run" + note)
  if enabled("parts") and split(m, site) is not None:
    per_line = _changes(m, site) / ((site.batch or 1) * site.geo.nq)
    return (f"an `&` whose operands change {per_line:.2f} times per tile "
            f"row (over {WHOLE_AFTER}), with a part that needs the analysis: faster whole "
            f"than in parts" + note)
  if isinstance(m, (ir.And, ir.Or)):
    return ("an `&` / `|` with no part of a closed form (a diagonal period, one axis, a band "
            "of an `&`, or parts of its own) to split off" + note)
  return ("no closed form matches: no diagonal period, more than one position read, not "
          "equal reads of runs, not an `&` / `|`" + note)
