"""Rule `band`: a part of an `&` / `|` that is exactly a band of `q - k` (`causal`,
`sliding(w)`, `local(64, 64)`), in closed form.

On a tile line with consecutive positions, `q - k` over a tile takes every value between its
extremes, so the line's tiles are EMPTY, then PARTIAL, FULL, PARTIAL, EMPTY, at bounds that
follow from the line's positions by integer division (`maskc.lowering.grid.bands`): no
analysis, no period to repeat. In an `&` the combiner then clips the other parts' runs at
those bounds (`causal & document(seg)`). A whole mask that is a band is periodic instead
(rule `periodic` repeats one period).
"""

from __future__ import annotations

import numpy as np

from maskc.analysis.linear import exact_band
from maskc.compiled.tiles import Runs
from maskc.language import ir
from maskc.lowering.grid.bands import Intervals, band_bounds, band_fits
from maskc.lowering.grid.forms import Form, LineBounds, LineRuns, line_runs, pack_runs
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.run_lists import merge_runs
from maskc.lowering.rules import Rule, Site


class BandRuns:
  """The runs of a band `lo <= q - k <= hi` on `geo` (`band_fits`), for `nb` batch rows."""

  forms = frozenset({Form.BAND, Form.INTERVALS})
  exact = True

  def __init__(self, m: ir.Mask, geo: TileGeometry, band: tuple[int | None, int | None],
               nb: int):
    self.m, self.geo, self.band, self.nb = m, geo, band, nb
    self._bounds: dict[bool, LineBounds] = {}

  def intervals(self) -> Intervals:
    """The band as one interval per row."""
    return Intervals(*self.band)

  def bounds(self, along_rows: bool) -> LineBounds:
    """`band_bounds` along rows or columns, computed once."""
    if along_rows not in self._bounds:
      self._bounds[along_rows] = band_bounds(self.geo, *self.band, along_rows)
    return self._bounds[along_rows]

  def merged(self, along_rows: bool) -> LineRuns:
    """The runs as sorted, merged `(b, line, a, z, state)` arrays (where the band is all an
    `&` has: no other runs to clip)."""
    line, a, z, state = line_runs(self.bounds(along_rows))
    b = np.repeat(np.arange(self.nb, dtype=np.int64), line.size)
    line, a, z, state = (np.tile(x, self.nb) for x in (line, a, z, state))
    # an empty FULL run leaves two PARTIAL ones side by side: merged into one
    return merge_runs(b, line, a, z, state, in_order=True)

  def runs(self, along_rows: bool) -> Runs:
    return pack_runs(*self.merged(along_rows), self.nb,
                     self.geo.nq if along_rows else self.geo.nk)


def match(m: ir.Mask, site: Site) -> tuple[int | None, int | None] | None:
  """The band `(lo, hi)` of `q - k` that operand-free part `m` is exactly, where its closed
  form holds on the grid (`band_fits`); None for a whole mask (a band alone is periodic)."""
  if site.join is None or m.operands:
    return None
  band = exact_band(m)
  return band if band is not None and band_fits(site.geo, band) else None


def lower(m: ir.Mask, band: tuple[int | None, int | None], site: Site) -> BandRuns:
  return BandRuns(m, site.geo, band, site.batch or 1)


BAND = Rule(
    "band", "a band of `q - k` (`causal`, `sliding(w)`, `local(l, r)`) in an `&` / `|`, in "
    "closed form (maskc.lowering.closed_forms.band)", "part", "part", exact=True,
    match=match, lower=lower)
