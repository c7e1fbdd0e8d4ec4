"""Rule `spread`: `x & (band | rest)`, x clipped at the band off the rest's lines.

In `document(seg) & (causal | bidirectional(img))` the `|` is a band beside parts that are
no band. Its runs need not be combined with the documents' everywhere: off the lines where
the rest has runs (an image's rows), the `|` is the band alone, and the documents are
clipped at the band's bounds, a pass over their runs as in `causal & document(seg)`; on
the rest's lines they meet the band joined with the rest. Where the rest is equal reads
that widen the band to one interval per row (rule `widened_band`), the documents are
clipped at the widened bounds everywhere. A combine rule at step "clip".
"""

from __future__ import annotations

from maskc.language import ir
from maskc.lowering.closed_forms.widened_band import widen
from maskc.lowering.generic.combination import CombinedRuns, flat_runs
from maskc.lowering.grid.forms import FlatRuns, Form, keyed_band_runs
from maskc.lowering.grid.parts import BandPart, PartRuns, given
from maskc.lowering.grid.run_lists import interleaved, lines_of, on_lines_mask
from maskc.lowering.rules import Rule

Found = tuple[BandPart, PartRuns]


def match(c: CombinedRuns, part: PartRuns) -> Found | None:
  """`(band, rest)` where `part` of the `&` `c` is an `|` (`Form.JOIN`) of a band
  (`Form.BAND`) and others none of which reads one position only (those splice a pattern
  into every line, which spreading would write out); several others are joined into one
  part whose PARTIAL tiles are decided for the whole `|` (sound for the clipping)."""
  if c.union or Form.JOIN not in part.forms:
    return None
  joined = given(part, Form.JOIN)
  if not joined.union:
    return None
  band = next((given(p, Form.BAND) for p in joined.parts if Form.BAND in p.forms), None)
  rest = [p for p in joined.parts if p is not band]
  if band is None or any(Form.PATTERN in p.forms for p in rest):
    return None
  if len(rest) > 1:
    return band, CombinedRuns(part.m, rest, c.site.part_of(ir.or_))
  return band, rest[0]


def lower(c: CombinedRuns, found: Found, x: FlatRuns, along_rows: bool, n_lines: int,
          n_span: int, exact_x: bool = False) -> FlatRuns:
  """Flat runs `x` of the `&` `c`'s other parts, `& (band | rest)`.

  Where the rest is equal reads that widen the band to one interval per row, `x` clipped at
  the widened band's bounds; else, on lines where the rest has no runs, `x` clipped at the
  band, and on the rest's lines (few: an image's rows), `x` met with the band's runs joined
  with the rest's. Tiles PARTIAL in two parts are decided for the whole mask: between the
  `|` and the whole, the following `&` with `x` is still exact.
  """
  band, rest = found
  if Form.WIDENS in rest.forms:  # one interval per row: the band widened
    widened = widen(given(rest, Form.WIDENS), band.intervals(), along_rows)
    if widened is not None:
      return c.clip_lines(x, widened, along_rows, n_lines, n_span)
  y = flat_runs(rest, along_rows, n_lines, n_span)
  lines = lines_of(y[0], n_span)
  on = on_lines_mask(x[0], lines, n_span)
  bounds = band.bounds(along_rows)
  off = c.clip_lines(FlatRuns(*(v[~on] for v in x)), bounds, along_rows, n_lines, n_span)
  joined = c.combine_by_lines(keyed_band_runs(bounds, lines, n_lines, n_span), y, along_rows,
                              n_lines, n_span, union=True)
  met = c.combine_by_lines(FlatRuns(*(v[on] for v in x)), joined, along_rows, n_lines,
                           n_span, union=False, exact_part=exact_x)
  return interleaved(off, met)


SPREAD = Rule(
    "spread", "`x & (band | rest)`: x clipped at the band off the rest's lines "
    "(maskc.lowering.closed_forms.spread)", "combine", "clip", exact=False, match=match,
    lower=lower)
