"""Rule `distribute`: an IR rewrite before lowering, `x & (rest | pattern)` as `(x & rest) |
(x & pattern)`, the pattern the `|`'s items that read only k (`g[k]`).

`document(seg) & (causal | img[k])` lowers in parts either way, but as written the `|` is a
part of its own, combined with the documents over every tile line. Distributed, `x &
pattern` splices the pattern of `g` into the documents' runs alone (rule `one_axis`, and the
combiner's splice), and `x & rest` clips the documents at the band: each part in closed form.
The rewritten mask is lowered again through the dispatch (`lower_part`).
"""

from __future__ import annotations

from maskc.language import ir
from maskc.lowering.closed_forms.parts import PARTS, split
from maskc.lowering.generic.dispatch import body_of, lower_part
from maskc.lowering.grid.parts import PartRuns
from maskc.lowering.rules import Rule, Site


def _distributable(item: ir.Mask) -> tuple[list[ir.Mask], list[ir.Mask]] | None:
  """`(its items that read only k, the others)` where `item` of an `&` is an `|` with both;
  else None. Structure only: whether it lowers in parts is `match`'s."""
  body = body_of(item)
  if not isinstance(body, ir.Or):
    return None
  pattern = [x for x in body.items if ir.positions_of(x) == {"k"}]
  rest = [x for x in body.items if ir.positions_of(x) != {"k"}]
  return (pattern, rest) if pattern and rest else None


def match(m: ir.Mask, site: Site) -> ir.Mask | None:
  """`(x & rest) | (x & pattern)` where `m` is `x & (rest | pattern)` lowered in parts, the
  pattern its `|`'s items that read only k (`g[k]`, a pattern along every q tile row),
  and no other item of the `&` is such an `|` (each would double the parts). The
  structure is checked first: most masks have no such `|`, and building nothing for
  them keeps small compiles cheap."""
  m = body_of(m)
  if not isinstance(m, ir.And) or site.geo.positions:
    return None
  found = [(i, f) for i, f in ((i, _distributable(x)) for i, x in enumerate(m.items))
           if f is not None]
  if len(found) != 1:
    return None
  i, (pattern, rest) = found[0]
  if (split(body_of(m.items[i]), site.part_of(ir.and_)) is None or
      PARTS.match is None or PARTS.match(m, site) is None):
    return None
  x = ir.joined(m.items[:i] + m.items[i + 1:], ir.and_)
  return ir.or_([ir.and_([x, ir.joined(rest, ir.or_)]),
                 ir.and_([x, ir.joined(pattern, ir.or_)])])


def lower(m: ir.Mask, rewritten: ir.Mask, site: Site) -> PartRuns:
  return lower_part(rewritten, site)


DISTRIBUTE = Rule(
    "distribute", "`x & (rest | pattern)` rewritten `(x & rest) | (x & pattern)` before it "
    "lowers, the pattern the `|`'s items that read only k (`g[k]`): `x & pattern` splices "
    "the pattern into x's runs (maskc.lowering.closed_forms.distribute)", "part", "part",
    exact=False, match=match, lower=lower, recurses=True)
