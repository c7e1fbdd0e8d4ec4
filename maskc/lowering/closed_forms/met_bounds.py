"""Rule `met_bounds`: an `&` of a part whose tiles are band-shaped per line (equal reads of
runs: `document(seg)`) and a band, or a band widened by equal reads (`causal |
bidirectional(img)`), met as bounds per line: `causal & document(seg)`, `document(doc) &
(causal | bidirectional(img))`.

Each line's tiles of both are three runs at four bounds (`maskc.lowering.grid.bands`), so
their meeting is nine pieces a line, cut from the bounds directly (`met_bounds_pieces`),
with no runs written and clipped; tiles PARTIAL in both are then decided as in any `&`. A
combine rule at step "meet".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from maskc.lowering.closed_forms.widened_band import widen
from maskc.lowering.generic.combination import CombinedRuns
from maskc.lowering.grid.forms import BAND_STATES, Array, FlatRuns, Form, LineBounds
from maskc.lowering.grid.parts import BandPart, BoundsPart, PartRuns, given
from maskc.lowering.rules import Rule
from maskc.lowering.tuning import COMBINE_CHUNK, MET_LINE_BYTES

_X_STATES, _Y_STATES = np.repeat(BAND_STATES, 3), np.tile(BAND_STATES, 3)  # of 9 pieces

# A spread found in the `&` (rule `spread`): a band, and the rest of its `|`.
Spread = tuple[BandPart, PartRuns]


def met_bounds_pieces(x_bounds: LineBounds, first: int, bounds: LineBounds, n_lines: int,
                      n_span: int) -> tuple[Array, Array, Array, Array]:
  """The pieces of flat lines `first, first + 1, ...` whose tiles are both band-shaped
  bounds, `x_bounds` (`[4, n]`, of those lines: equal reads of runs,
  `maskc.lowering.closed_forms.equal_reads.equal_read_bounds`) and `bounds` (`[4, n_lines]`
  for every batch row, or by flat line): each of x's three runs cut at the other's, as
  `clipped_pieces` gives them, with no runs written first: `(lo, hi, x's state, the other's
  state)`, flat keys in order, the parts outside either dropped."""
  n = x_bounds.shape[1]
  flat = np.arange(first, first + n, dtype=np.int64)
  line = flat % n_lines if bounds.shape[1] == n_lines else flat
  base = flat * (n_span + 1)
  x, y = x_bounds + base, np.take(bounds, line, axis=1) + base
  # [x's run, the other's run, line], then each line's nine pieces in order: broadcasts
  # over the long axis, not over the short ones (four times as fast)
  lo = np.maximum(x[:3, None, :], y[None, :3, :]).reshape(9, n).T.reshape(-1)
  hi = np.minimum(x[1:, None, :], y[None, 1:, :]).reshape(9, n).T.reshape(-1)
  keep = np.flatnonzero(hi > lo)
  # states by tiling, not by `keep % 9` (int64 division is slow)
  return (lo[keep], hi[keep], np.tile(_X_STATES, n)[keep], np.tile(_Y_STATES, n)[keep])


def match(part: PartRuns, bands: Sequence[BandPart],
          spread: Sequence[Spread]) -> BoundsPart | None:
  """The part of an `&` whose lines are band-shaped (`Form.LINE_BOUNDS`), where a band (or
  a band in an `|` beside reads that may widen it) meets it."""
  if Form.LINE_BOUNDS not in part.forms:
    return None
  if bands or (spread and Form.WIDENS in spread[0][1].forms):
    return given(part, Form.LINE_BOUNDS)
  return None


def lower(c: CombinedRuns, part: BoundsPart, along_rows: bool, n_lines: int, n_span: int,
          bands: Sequence[BandPart], spread: Sequence[Spread]
          ) -> tuple[FlatRuns, int, int] | None:
  """`(flat runs, bands used, spreads used)` of `part & band` for the `&` `c`: the first band
  (or the first spread's band widened by its rest), met with the part's bounds per line;
  None where the spread's rest does not widen its band."""
  if bands:
    bounds, used = bands[0].bounds(along_rows), (1, 0)
  else:
    band, rest = spread[0]
    widened = widen(given(rest, Form.WIDENS), band.intervals(), along_rows)
    if widened is None:
      return None
    bounds, used = widened, (0, 1)
  x_bounds = part.bounds(along_rows)
  if x_bounds is None:
    return None
  MET_BOUNDS.took()
  lines = x_bounds.shape[1]
  chunk = max(1, min(lines, c.budget.items(MET_LINE_BYTES), COMBINE_CHUNK // 3))
  c.budget.charge(min(lines, chunk) * MET_LINE_BYTES, "meeting bounds")
  out = [c.pieces_decided(*met_bounds_pieces(x_bounds[:, a:a + chunk], a, bounds, n_lines,
                                             n_span), along_rows, n_span, False,
                          exact_part=True)
         for a in range(0, lines, chunk)]
  return FlatRuns(*(np.concatenate(v) for v in zip(*out))), *used


MET_BOUNDS = Rule(
    "met_bounds", "equal reads `&` a band (or a widened band), met as bounds per line "
    "(`causal & document(seg)`; maskc.lowering.closed_forms.met_bounds)", "combine", "meet",
    exact=True, match=match, lower=lower)
