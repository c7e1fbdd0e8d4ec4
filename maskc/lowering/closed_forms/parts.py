"""Rule `parts`: an `&` / `|` whose parts lower apart, each its own way, their runs combined
(static), or whose operand-free items lower at trace time (traced).

`causal & chunk(8192) | bidirectional(img)` repeats the period of `causal & chunk(8192)`
and finds the image spans' runs by binary search; the combiner
(`maskc.lowering.generic.combination`) joins them, deciding again only the tiles where two
parts are PARTIAL. `local(64, 64) | g[q] | g[k]` splices the patterns of `g` into the
band's runs without writing them out line by line.

Under `jit` (`traced`), the operand-free items of an `&` / `|` depend on the shape only,
static there: the static path lowers them at trace time to a constant tile grid, and only
the other items are analysed under `jit`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from maskc.compiled.tiles import Runs, expand_runs
from maskc.language import ir
from maskc.lowering.closed_forms.band import BAND
from maskc.lowering.closed_forms.periodic import PERIODIC
from maskc.lowering.generic.combination import CombinedRuns
from maskc.lowering.generic.dispatch import body_of, lower_part
from maskc.lowering.grid.forms import Array
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget
from maskc.lowering.rules import Rule, Site
from maskc.lowering.tuning import STATIC_PART_TILES, WHOLE_AFTER
from maskc.semantics.operand_runs import reads_at


def split(m: ir.Mask, site: Site) -> list[ir.Mask] | None:
  """The parts of an `&` / `|` lowered apart, or None to lower it whole.

  Parts: its items that read one position only, joined per axis (`g[q]`, `g[k]`,
  `valid[k]`, `sink(4)`: rule `one_axis`); its operand-free items joined, where they have
  a diagonal period worth repeating (else those that have one); each other item that is
  itself lowered in parts (`document(seg) & (causal | bidirectional(img))`, `causal |
  prefix(4096)`); the other items joined. At least one part must be periodic (or a band
  of an `&`), in parts itself or of one axis: otherwise splitting saves nothing.
  """
  m = body_of(m)
  found = ir.operand_free_split(m)
  if found is None or site.geo.positions:
    return None
  free, rest, join = found
  inner = site.part_of(join)
  axis_items = {a: [x for x in free + rest if ir.positions_of(x) == {a}] for a in "qk"}
  free, rest = ([x for x in items if len(ir.positions_of(x)) != 1] for items in (free, rest))
  periodic: list[ir.Mask] = []
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
  names = {n for n, _ in reads_at(m, "q")}
  return sum(site.tables.run_table(name).starts.size - nb for name in names)


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
  one part, a part rule of the registry but those that split or rewrite (a band only in an
  `&`: in an `|` its period serves), or in parts that all are (`causal |
  bidirectional(img)` in `document(seg) & (causal | bidirectional(img))`)."""
  m = body_of(m)
  for rule in site.rules.at("part"):
    if rule.recurses or (rule is BAND and site.join is not ir.and_):
      continue
    if rule.found(m, site) is not None:
      return True
  parts = split(m, site)
  inner = site.part_of(ir.and_ if isinstance(m, ir.And) else ir.or_)
  return parts is not None and all(_unanalysed(x, inner) for x in parts)


Found = tuple[ir.Mask, list[ir.Mask]]


def match(m: ir.Mask, site: Site) -> Found | None:
  """`(m's body, its parts)` where `m` is an `&` / `|` that lowers in parts (`split`), and
  either that pays (`_parts_pay`) or no part needs the analysis."""
  m = body_of(m)
  parts = split(m, site)
  if parts is None:
    return None
  inner = site.part_of(ir.and_ if isinstance(m, ir.And) else ir.or_)
  if not _parts_pay(m, site) and not all(_unanalysed(x, inner) for x in parts):
    return None
  return m, parts


def lower(m: ir.Mask, found: Found, site: Site) -> CombinedRuns:
  body, parts = found
  inner = site.part_of(ir.and_ if isinstance(body, ir.And) else ir.or_)
  return CombinedRuns(body, [lower_part(x, inner) for x in parts], inner)


def why_not(m: ir.Mask, site: Site) -> str | None:
  """An `&` that could lower in parts, but lowers faster whole."""
  if PARTS.enabled() and split(m, site) is not None:
    body = body_of(m)
    per_line = _changes(body, site) / ((site.batch or 1) * site.geo.nq)
    return (f"an `&` whose operands change {per_line:.2f} times per tile "
            f"row (over {WHOLE_AFTER}), with a part that needs the analysis: faster whole "
            f"than in parts")
  return None


# A static lowering of masks at a shape (`maskc.lowering.static.compile_static`), handed down
# by the traced path.
LowerStatic = Callable[..., tuple[Runs, Any]]


def traced(m: ir.Mask, geo: TileGeometry, refine: bool, memory: Budget,
           lower_static: LowerStatic) -> tuple[ir.Mask, Array, bool] | None:
  """An `&` / `|` split into its operand-free items, lowered now, and the others.

  The operand-free items depend on the shape only, static here (no traced offset or
  positions): `lower_static` lowers them at trace time to a constant tile grid (it repeats
  a diagonal period, in milliseconds). Only the other items are analysed over the grid
  under `jit`, and the two combined as the static path's combiner does: with EMPTY <
  PARTIAL < FULL, a tile of `a | b` is `max(a, b)` and of `a & b` `min(a, b)`, exactly, but
  where both are PARTIAL.

  Returns `(the other items joined, grid [nq, nk], is a union)`, or None where the mask is
  no such `&` / `|`, the shape is traced or has positions, or the grid would have more than
  `STATIC_PART_TILES` tiles.
  """
  found = ir.operand_free_split(m)
  if (found is None or not found[0] or not found[1] or geo.positions or
      not geo.shape.static or geo.nq * geo.nk > STATIC_PART_TILES or not PARTS.enabled()):
    return None
  PARTS.took()
  free, rest, join = found
  rows, _ = lower_static([ir.joined(free, join)], geo.shape, {}, None, geo.bq, geo.bk,
                         [refine], memory)
  tiles = expand_runs(rows)
  grid = np.zeros((geo.nq, geo.nk), np.int8)
  grid[tiles.line, tiles.other] = tiles.state
  return ir.joined(rest, join), grid, join is ir.or_


PARTS = Rule(
    "parts", "an `&` / `|` whose parts lower apart, their runs combined (static), or whose "
    "operand-free items lower at trace time (traced; maskc.lowering.closed_forms.parts)",
    "part", "part", exact=False, match=match, lower=lower, traced=traced, why_not=why_not,
    recurses=True)

