"""The runs of an `&` / `|` from the runs of its parts, lowered apart (`_CombinedRuns`).

With states ordered EMPTY < PARTIAL < FULL a tile's state under `|` is the largest of its
parts' and under `&` the smallest, except where two parts are PARTIAL: those tiles are
decided for the whole mask (`_pieces_decided`). The pairwise closed forms between kinds
of part (a band clipping the others' runs, a pattern of one axis spliced into them, equal
reads widening a band, ...) are the methods of `_CombinedRuns`; the flat run lists'
merges are `_union_pieces` and `_meeting_pieces`.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from maskc.analysis.diagonal_truth import true_on_diagonal
from maskc.arrays.ragged import ranges
from maskc.compiled.tiles import Runs
from maskc.language import ir
from maskc.lowering.closed_forms.band_runs import (
  clipped_pieces,
  met_bounds_pieces,
)
from maskc.lowering.closed_forms.pattern_lines import spliced_pattern
from maskc.lowering.grid.forms import (
  Form,
  keyed,
  keyed_band_runs,
  merge_keyed,
  pack_keyed,
  split_keys,
  unpacked,
)
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget
from maskc.lowering.grid.run_lists import (
  interleaved,
  lines_of,
  marked,
  meeting_mask,
  on_lines,
  on_lines_mask,
  overlapping,
)
from maskc.lowering.range_analysis import _decide_tiles, _pieces
from maskc.lowering.rules import Rule, enabled, took
from maskc.lowering.sampling import _diagonal_pairs, _sampled_mixed
from maskc.lowering.tuning import (
  COMBINE_CHUNK,
  COMBINE_RUN_BYTES,
  DECIDED_TILE_BYTES,
  MET_LINE_BYTES,
  SPLICE_SORTED_AFTER,
  WAITING_PIECE_BYTES,
)
from maskc.semantics.operand_runs import reads_at
from maskc.semantics.ranges import EMPTY, FULL, PARTIAL, Tables

if TYPE_CHECKING:  # the parts' classes, for types only: the combiner asks for their forms
  from maskc.lowering.part_runs import _AxisRuns


class _CombinedRuns:
  """The runs of `a & b & ...` or `a | b | ...` from the runs of its parts.

  With states ordered EMPTY < PARTIAL < FULL, a tile's state under `|` is the
  largest of its parts' and under `&` the smallest, exactly, except where two
  parts are PARTIAL: there the union may be FULL and the intersection EMPTY, so
  those tiles (few: where two parts' boundaries cross) are decided for the whole
  mask. Lets `causal & chunk(8192) | bidirectional(img)` repeat the period of
  `causal & chunk(8192)` and analyse only the image spans.

  Which closed form combines which parts is decided by the forms the parts give
  (`maskc.lowering.grid.forms.Form`), through the matches of the "combine" rules below.
  """

  forms = frozenset({Form.FLAT, Form.JOIN})
  exact = False

  def __init__(self, m: ir.Mask, parts: list, geo: TileGeometry, tables: Tables,
               batch: int | None, refine: bool, budget: Budget):
    self.m, self.parts, self.geo, self.tables = m, parts, geo, tables
    self.batch, self.refine, self.budget = batch, refine, budget
    self.union = isinstance(m, ir.Or)

  def _true_on_diagonal(self) -> bool:
    """Whether the mask is true at every pair `q == k` (proved once, from its IR)."""
    if not enabled("diagonal_truth"):
      return False
    if not hasattr(self, "_diagonal"):
      self._diagonal = true_on_diagonal(self.m)
    if self._diagonal:
      took("diagonal_truth")
    return self._diagonal

  def _pieces(self, b, i, j):
    """Operand pieces of the whole mask's lines (as `_StaticRuns`) for deciding tiles
    `(b, i, j)`: of their rows and columns only, where no part lends them.

    The operand-free part reads nothing, so a part that cut its lines at the same
    reads lends its pieces.
    """
    geo = self.geo
    if geo.batched_positions:
      return None
    reads = [reads_at(self.m, axis) for axis in "qk"]
    lent = [x.pieces for x in self.parts if Form.PIECES in x.forms and
            [reads_at(x.m, axis) for axis in "qk"] == reads]
    if lent:
      return lent[0]
    return tuple(_pieces(self.m, geo, self.tables, self.batch, rows, self.budget,
                         np.unique(b * n + line))
                 for rows, n, line in ((True, geo.nq, i), (False, geo.nk, j)))

  def flat(self, along_rows: bool):
    """The runs as sorted, merged flat runs `(start key, stop key, state)` (`keyed`): what
    an `&` / `|` of which this is a part combines, without splitting and joining keys."""
    geo = self.geo
    n_lines, n_span = (geo.nq, geo.nk) if along_rows else (geo.nk, geo.nq)
    flat, patterns = self._unspliced(along_rows)
    for part in patterns:
      flat = self._splice(flat, part, along_rows, n_lines, n_span)
    return merge_keyed(*flat)

  def runs(self, along_rows: bool) -> Runs:
    """The runs packed (`maskc.lowering.grid.forms.pack_keyed`); an `|` that ends with a pattern
    (`local(64, 64) | g[q] | g[k]`) packs its lines as it splices them, not through flat
    keys of every run (hundreds of thousands on long grids)."""
    geo = self.geo
    n_lines, n_span = (geo.nq, geo.nk) if along_rows else (geo.nk, geo.nq)
    flat, patterns = self._unspliced(along_rows)
    if not (self.union and patterns):
      for part in patterns:
        flat = self._splice(flat, part, along_rows, n_lines, n_span)
      return pack_keyed(*merge_keyed(*flat), self.batch or 1, n_lines, n_span)
    for part in patterns[:-1]:
      flat = self._splice(flat, part, along_rows, n_lines, n_span)
    return self._spliced_lines(flat, patterns[-1], along_rows, n_lines, n_span)

  def _unspliced(self, along_rows: bool):
    """The flat runs of every part but those of one axis whose runs along these lines are
    a pattern (`Form.PATTERN`), unmerged, and those parts, to splice in."""
    geo = self.geo
    n_lines, n_span = (geo.nq, geo.nk) if along_rows else (geo.nk, geo.nq)
    axis = [p for p in self.parts if Form.PATTERN in p.forms]
    patterns = [p for p in axis if p.pattern_along(along_rows)]
    whole = [p for p in axis if not p.pattern_along(along_rows)]  # one run per line
    # a band (an `&`'s only) clips the runs of the others, unless it is all there is;
    # so does a band in an `|` of an `&`, spread over it (`_spread`)
    bands = [p for p in self.parts if Form.BAND in p.forms and not self.union]
    others = [p for p in self.parts if Form.PATTERN not in p.forms and
              not any(p is b for b in bands)]
    band_ors = [(p, self._band_or(p)) for p in others]
    spread = [(p, x) for p, x in band_ors if x is not None]
    others = [p for p in others if not any(p is q for q, _ in spread)]
    if not (whole or others):
      if bands:
        others, bands = bands[:1], bands[1:]
      else:
        others, spread = [spread[0][0]], spread[1:]
    # whole lines first: under `&`, the other parts matter only on their non-EMPTY lines
    order = whole + others
    widened = self._widened(order, along_rows, n_lines, n_span) if self.union else None
    met = None
    if not self.union and len(order) == 1 and (bands or spread):
      met = self._met_in_closed_form(order[0], bands, spread, along_rows, n_lines, n_span)
    if widened is not None:
      (flat, order), exact = widened, True
    elif met is not None:  # `causal & document(seg)`: pieces from both parts' bounds
      (flat, bands, spread, exact), order = met, []
    else:
      flat = _flat_runs(order[0], along_rows, n_lines, n_span)
      exact = order[0].exact  # the runs so far are one exact part's, as lowered
      order = order[1:]
    for part in order:
      other = _flat_runs(part, along_rows, n_lines, n_span)
      if whole and not self.union:
        other = on_lines(other, lines_of(flat[0], n_span), n_span)
      flat = self._combine_by_lines(flat, other, along_rows, n_lines, n_span,
                                    exact_part=exact or part.exact)
      exact = False
    for band in bands:
      flat = self._clip_lines(flat, band.bounds(along_rows), along_rows, n_lines, n_span)
      exact = False
    for _, (band, rest) in spread:
      flat = self._spread(flat, band, rest, along_rows, n_lines, n_span, exact)
      exact = False
    return flat, patterns

  def _met_in_closed_form(self, part, bands: list, spread: list, along_rows: bool,
                          n_lines: int, n_span: int):
    """`(flat runs, bands left, spreads left, False)` of `part & band` where the part's
    tiles are a band's bounds per line (`document(seg)`: `_EqualRuns.bounds`) and so are
    the first band's, or the first spread's widened (`causal | bidirectional(img)`): the
    pieces of both bounds (`met_bounds_pieces`), no runs written and clipped; else None."""
    if MET_BOUNDS.found(part, bands, spread) is None:
      return None
    if bands:
      bounds, bands = bands[0].bounds(along_rows), bands[1:]
    else:
      band, rest = spread[0][1]
      bounds = rest.widened(band.intervals(), along_rows)
      if bounds is None:
        return None
      spread = spread[1:]
    took("met_bounds")
    x_bounds = cast(np.ndarray, part.bounds(along_rows))  # `Form.LINE_BOUNDS`: not None
    lines = x_bounds.shape[1]
    chunk = max(1, min(lines, self.budget.items(MET_LINE_BYTES), COMBINE_CHUNK // 3))
    self.budget.charge(min(lines, chunk) * MET_LINE_BYTES, "meeting bounds")
    out = [self._pieces_decided(*met_bounds_pieces(x_bounds[:, a:a + chunk], a, bounds,
                                                   n_lines, n_span),
                                along_rows, n_span, False, exact_part=True)
           for a in range(0, lines, chunk)]
    return tuple(np.concatenate(v) for v in zip(*out)), bands, spread, False

  def _widened(self, order: list, along_rows: bool, n_lines: int, n_span: int):
    """`(flat runs, the other parts)` of this `|` where a band (or a band inside chunks)
    and equal reads among `order` join into one interval per row (`causal & chunk(8192)
    | bidirectional(img)`: `maskc.lowering.closed_forms.widened_band`), their runs written from
    bounds with nothing combined; else None."""
    found = WIDENED_BAND.found(order, self.union)
    if found is None:
      return None
    equal, band = found
    bounds = equal.widened(band.intervals(), along_rows)
    if bounds is None:
      return None
    return (keyed_band_runs(bounds, None, n_lines, n_span, self.batch or 1),
            [p for p in order if p is not band and p is not equal])

  def _band_or(self, part) -> tuple[Any, Any] | None:
    """`(band, rest)` where `part` of this `&` is `band | rest` (`causal |
    bidirectional(img)`), its band in closed form; else None.

    Only where the rest has no parts of one axis: those splice a pattern into every
    line (`_splice`), which `_spread` would write out.
    """
    found = SPREAD.found(part, self.union)
    if found is None:
      return None
    band, rest = found
    took("spread")
    if len(rest) > 1:  # their PARTIAL tiles decided for the whole `|`: sound for `_spread`
      rest = [_CombinedRuns(part.m, rest, self.geo, self.tables, self.batch, self.refine,
                            self.budget)]
    return band, rest[0]

  def _spread(self, x, band, rest, along_rows: bool, n_lines: int, n_span: int,
              exact_x: bool = False):
    """Flat runs `x` of this `&`'s other parts, `& (band | rest)`. Where the rest is equal
    reads that widen the band to one interval per row
    (`maskc.lowering.closed_forms.widened_band`), `x` clipped at the widened band's bounds;
    else, on lines where the rest has no runs,
    `x` clipped at the band, and on the rest's lines (few: an image's rows), `x` met
    with the band's runs joined with the rest's.

    `document(seg) & (causal | bidirectional(img))`: the documents clipped as in
    `causal & document(seg)`, at bounds that reach past the diagonal on an image's
    lines. Tiles PARTIAL in two parts are decided for the whole mask: between the `|`
    and the whole, the following `&` with `x` is still exact.
    """
    if Form.WIDENS in rest.forms:  # one interval per row: the band widened
      widened = rest.widened(band.intervals(), along_rows)
      if widened is not None:
        return self._clip_lines(x, widened, along_rows, n_lines, n_span)
    y = _flat_runs(rest, along_rows, n_lines, n_span)
    lines = lines_of(y[0], n_span)
    on = on_lines_mask(x[0], lines, n_span)
    bounds = band.bounds(along_rows)
    off = self._clip_lines(tuple(v[~on] for v in x), bounds, along_rows, n_lines, n_span)
    joined = self._combine_by_lines(keyed_band_runs(bounds, lines, n_lines, n_span), y,
                                    along_rows, n_lines, n_span, union=True)
    met = self._combine_by_lines(tuple(v[on] for v in x), joined, along_rows, n_lines,
                                 n_span, union=False, exact_part=exact_x)
    return interleaved(off, met)

  def _splice(self, x, part: _AxisRuns, along_rows: bool, n_lines: int, n_span: int):
    """Flat runs `x` combined with the runs of a part of one axis whose runs along these
    lines are a pattern (`maskc.lowering.grid.forms.Pattern`): runs that every line of
    batch row `b` has, never written out for lines where `x` has none.

    Only the pattern's runs that meet the span of a line's runs in `x` are looked at
    (`_spliced_met`); for `|` the line keeps the pattern's runs before and after that
    span as they are, and a line without runs in `x` is the pattern
    (`_spliced_lines`).
    """
    if not self.union:
      return self._spliced_met(x, part, along_rows, n_lines, n_span)[0]
    runs = self._spliced_lines(x, part, along_rows, n_lines, n_span)
    self.budget.charge(int(runs.count.sum()) * 40, "splicing a pattern of runs")  # as keys
    return unpacked(runs, self.batch or 1, n_lines, n_span)

  def _spliced_met(self, x, part: _AxisRuns, along_rows: bool, n_lines: int, n_span: int):
    """The flat runs of `x` combined with the pattern's runs that meet the span of each
    line's runs in `x`, and those lines (flat), with the range `[lo, hi)` of the
    pattern's runs (indices into it) that each meets.

    Of those looked at, only the ones that meet a PARTIAL run of `x` or cross the edge
    of a FULL one are combined with `x` (`_combine_by_lines`): one inside a FULL run is
    kept as it is under `&` and covered under `|`, one between the runs is dropped
    under `&` and kept under `|` (`causal | g[k]`: the pattern's runs left of the
    diagonal, not combined). Tiles PARTIAL in both are sampled where the pattern is
    exact (`part.exact`).
    """
    key, end, state = x
    pb, pa, pz, ps = part.pattern
    stride = n_span + 1
    n_all = (self.batch or 1) * n_lines
    flat_line = key // stride
    in_x = np.bincount(flat_line, minlength=n_all)
    x_first = np.cumsum(in_x) - in_x
    lines = np.flatnonzero(in_x)
    base = lines * stride
    lb = lines // n_lines
    # the pattern's runs of each line's batch row that meet (or touch) its span in x
    p_lo, p_hi = pb * stride + pa, pb * stride + pz
    lo = np.searchsorted(p_hi, lb * stride + key[x_first[lines]] - base, "left")
    hi = np.searchsorted(p_lo, lb * stride + end[x_first[lines] + in_x[lines] - 1] - base,
                         "right")
    n = hi - lo
    item = np.repeat(np.arange(lines.size), n)
    at = np.cumsum(n) - n  # where each line's runs start among those looked at
    p = (lo - at)[item] + np.arange(item.size)
    # each looked at: its keys, place and kind, and a copy of the combined or kept ones
    # with their interleaving; each of x's runs: its range of the pattern (`_splice_kinds`)
    self.budget.charge(item.size * 100 + key.size * 128, "splicing a pattern of runs")
    met = (base[item] + pa[p], base[item] + pz[p], ps[p])
    if item.size > SPLICE_SORTED_AFTER * key.size:  # many per run of x: most inside one
      shift = (at - lo)[np.repeat(np.arange(lines.size), in_x[lines])]  # per run of x
      combined, inside = self._splice_kinds(x, flat_line, shift, p_lo, p_hi, pa, pz,
                                            item.size, n_lines, stride)
      mid = self._combine_by_lines(x, tuple(v[combined] for v in met), along_rows, n_lines,
                                   n_span, exact_part=part.exact)
      kept = inside if not self.union else ~(combined | inside)
      mid = interleaved(mid, tuple(v[kept] for v in met))
    else:
      mid = self._combine_by_lines(x, met, along_rows, n_lines, n_span,
                                   exact_part=part.exact)
    return mid, lines, lo, hi

  def _spliced_lines(self, x, part: _AxisRuns, along_rows: bool, n_lines: int, n_span: int):
    """The packed runs of `x | part`
    (`maskc.lowering.closed_forms.pattern_lines.spliced_pattern`): each line the pattern's runs
    before those met (`_spliced_met`), the combined ones, those after; a line without runs in
    `x`, the pattern.

    The combined runs are merged, and never touch a kept run in its state: a pattern run
    that touches the span of x is among those met, so a kept one ends before the first
    combined run starts unless that run begins with the next pattern run, which keeps
    its own state (the pattern is merged) up to the span; likewise after it.
    """
    mid, lines, lo, hi = self._spliced_met(x, part, along_rows, n_lines, n_span)
    key, end, state = merge_keyed(*mid)
    mid_line = key // (n_span + 1)
    base = mid_line * (n_span + 1)
    return spliced_pattern(part.pattern, self.batch or 1, n_lines, lines, lo, hi,
                           (mid_line, key - base, end - base, state), self.budget)

  @staticmethod
  def _splice_kinds(x, flat_line, shift, p_lo, p_hi, pa, pz, n_met: int, n_lines: int,
                    stride: int):
    """Which of the pattern's runs looked at by `_splice` (`n_met`, each line's in order,
    the pattern's run `p` of a line at `shift + p` for each of its runs in `x`) must be
    combined with `x`, and which lie inside one of x's FULL runs.

    Each run of `x` meets a range of the pattern's runs: all to combine where the run is
    PARTIAL; where it is FULL, the first and last if they cross its edges, the ones
    between them inside it.
    """
    combined = np.zeros(n_met, bool)
    if not n_met:
      return combined, np.zeros(n_met, bool)
    key, end, state = x
    row = flat_line // n_lines * stride
    a, z = key - flat_line * stride, end - flat_line * stride
    r_lo, r_hi = overlapping(row + a, row + z, p_lo, p_hi)
    meets = r_hi > r_lo
    full = (state == FULL) & meets
    partial = meets & ~full
    combined |= marked(n_met, (shift + r_lo)[partial], (shift + r_hi)[partial])
    left = full & (pa[np.minimum(r_lo, pa.size - 1)] < a)
    right = full & (pz[np.maximum(r_hi - 1, 0)] > z)
    combined[(shift + r_lo)[left]] = True
    combined[(shift + r_hi - 1)[right]] = True
    i_lo, i_hi = r_lo + left, r_hi - right
    some = full & (i_hi > i_lo)
    return combined, marked(n_met, (shift + i_lo)[some], (shift + i_hi)[some])

  def _combine_by_lines(self, x, y, along_rows: bool, n_lines: int, n_span: int,
                        union: bool | None = None, exact_part: bool = False):
    """`_combine` over groups of whole lines of about `COMBINE_CHUNK` runs: runs never
    cross a line, so the groups are independent, and memory stays bounded.

    Where one list has runs on few lines (an image's rows, a pattern's meeting), only
    the other's runs that overlap them are combined: elsewhere a union keeps the other
    list's runs as they are, and an intersection drops them (`causal & ~img[k] |
    bidirectional(img)`: a few dozen of half a million runs, `docs/lowering.md`,
    "Measurements behind the design").
    `union`: whether to join as `|` (default: as the mask does). `exact_part`: one of the
    lists is exact as it stands (`_pieces_decided`).
    """
    union = self.union if union is None else union
    small, large = (x, y) if x[0].size <= y[0].size else (y, x)
    lines = lines_of(small[0], n_span)
    if lines.size * 4 < lines_of(large[0], n_span).size:
      meets = meeting_mask(large, small)
      both = self._combine_lines(tuple(v[meets] for v in large), small, along_rows, n_lines,
                                 n_span, union, exact_part)
      if not union:
        return both
      return interleaved(both, tuple(v[~meets] for v in large))
    return self._combine_lines(x, y, along_rows, n_lines, n_span, union, exact_part)

  def _combine_lines(self, x, y, along_rows: bool, n_lines: int, n_span: int, union: bool,
                     exact_part: bool = False):
    """`_combine_by_lines` over every line."""
    def pieces_of(x, y):
      return _union_pieces(x, y) if union else _meeting_pieces(x, y)

    def decided(*pieces):
      return self._pieces_decided(*pieces, along_rows, n_span, union, exact_part)

    return self._by_line_chunks([x, y], x[0].size + y[0].size, n_lines, n_span, pieces_of,
                                decided)

  def _clip_lines(self, x, bounds, along_rows: bool, n_lines: int, n_span: int):
    """Flat runs `x` of an `&` with a band whose lines have bounds `bounds`
    (`maskc.lowering.closed_forms.band_runs`): cut at them, PARTIAL with PARTIAL decided tile
    by tile."""
    def pieces_of(x):
      return clipped_pieces(x, bounds, n_lines, n_span)

    def decided(*pieces):  # a band is exact
      return self._pieces_decided(*pieces, along_rows, n_span, False, exact_part=True)

    return self._by_line_chunks([x], 3 * x[0].size, n_lines, n_span, pieces_of, decided)

  def _by_line_chunks(self, lists, total: int, n_lines: int, n_span: int, pieces_of, decided):
    """The runs of flat run lists `lists` combined: `pieces_of` them (`(lo, hi, sx, sy)`),
    then `decided`, over groups of whole lines of about `COMBINE_CHUNK` runs in all
    (`total`): runs never cross a line, so the groups are independent, and the
    working memory stays bounded. The pieces of small groups wait to be decided
    together, up to a group's worth: deciding a few tiles at a time costs more than
    the tiles (`causal & document(seg)`: once, where each of several groups was)."""
    per_run = COMBINE_RUN_BYTES + WAITING_PIECE_BYTES
    per_chunk = min(COMBINE_CHUNK, self.budget.items(per_run))
    chunks = max(1, -(-total // per_chunk))
    self.budget.charge(min(total, per_chunk) * per_run, "combining runs")
    all_lines = (self.batch or 1) * n_lines
    cuts = (np.arange(chunks + 1, dtype=np.int64) * all_lines // chunks) * (n_span + 1)
    out: list[tuple[np.ndarray, ...]] = []
    waiting: list[tuple[np.ndarray, ...]] = []  # pieces `(lo, hi, sx, sy)` not decided yet

    def decide_waiting():
      if waiting:
        out.append(decided(*(waiting[0] if len(waiting) == 1 else
                             (np.concatenate(v) for v in zip(*waiting)))))
        waiting.clear()

    for lo, hi in itertools.pairwise(cuts):
      held = sum(p[0].size for p in waiting)
      if held * 2 >= per_chunk:  # before the next group's pieces: memory stays bounded
        decide_waiting()
        held = 0
      parts = [slice(*np.searchsorted(x[0], [lo, hi])) for x in lists]
      pieces = pieces_of(*(tuple(v[at] for v in x) for x, at in zip(lists, parts)))
      if held + pieces[0].size > per_chunk:
        decide_waiting()
      waiting.append(pieces)
    decide_waiting()
    return tuple(np.concatenate(v) for v in zip(*out))

  def _pieces_decided(self, lo, hi, sx, sy, along_rows: bool, n_span: int, union: bool,
                      exact_part: bool = False):
    """Flat pieces `[lo, hi)` in order, in states `sx` and `sy` of two parts, as the runs
    of the whole mask: the larger state under `|` (`union`), the smaller under `&`,
    where both are PARTIAL decided tile by tile; EMPTY pieces dropped.

    `exact_part`: one of the two is exact as it stands (a band, equal reads of runs),
    so its PARTIAL tiles are mixed even where the mask is not refined: sampled pairs
    decide tiles then too (`_both_partial`).
    """
    state = np.maximum(sx, sy) if union else np.minimum(sx, sy)
    both = np.flatnonzero((sx == PARTIAL) & (sy == PARTIAL))
    if not both.size:
      keep = state != EMPTY
      return lo[keep], hi[keep], state[keep].astype(np.int8)
    blo, bhi = lo[both], hi[both]
    n = bhi - blo
    if np.all(n == 1):  # the usual case, each such piece one tile: decided in place
      state = state.astype(np.int8)
      state[both] = self._both_partial(blo, along_rows, n_span, union, exact_part)
      keep = state != EMPTY
      return lo[keep], hi[keep], state[keep]
    keep = state != EMPTY
    keep[both] = False
    tiles = self._tiles_decided(blo, n, along_rows, n_span, union, exact_part)
    lo_k, hi_k, st_k = (np.concatenate([v[keep], t]) for v, t in zip((lo, hi, state), tiles))
    order = np.argsort(lo_k, kind="stable")
    return lo_k[order], hi_k[order], st_k[order].astype(np.int8)

  def _tiles_decided(self, blo, n, along_rows: bool, n_span: int, union: bool,
                     exact_part: bool):
    """The tiles of flat pieces `[blo, blo + n)`, PARTIAL in two parts, decided for the whole
    mask (`_both_partial`) a group that fits the budget at a time, as flat runs, neighbours
    of one state merged and EMPTY ones dropped.

    A piece can be a whole line (`g[q] | g[k]` with a global token in every tile: every
    tile of the grid), so its tiles are never listed at once.
    """
    end = np.cumsum(n)
    total = int(end[-1])
    group = min(total, self.budget.items(DECIDED_TILE_BYTES))
    self.budget.charge(group * DECIDED_TILE_BYTES, "deciding tiles PARTIAL in two parts")
    out = []
    for t0 in range(0, total, group):
      t = np.arange(t0, min(t0 + group, total), dtype=np.int64)
      piece = np.searchsorted(end, t, "right")
      tile = blo[piece] + t - (end - n)[piece]
      out.append(merge_keyed(tile, tile + 1, self._both_partial(tile, along_rows, n_span,
                                                                 union, exact_part)))
    return tuple(np.concatenate(v) for v in zip(*out))

  def _both_partial(self, tile, along_rows: bool, n_span: int, union: bool,
                    exact_part: bool = False):
    """The whole mask's states of flat tiles `tile` (keys), PARTIAL in two parts joined
    by `|` (`union`) or `&`.

    Where one part is exactly mixed there (every part when refined; a band or equal reads
    always: `exact_part`), the whole `&` lies inside it and is not FULL, the whole `|`
    holds it and is not EMPTY, so one sampled pair of the other value proves the tile
    PARTIAL (`causal & document(seg) & ~pad[k]`, not refined: its diagonal tiles,
    thousands for short documents, were each analysed by pieces: `docs/lowering.md`,
    "Measurements behind the design"). An `&` true at every pair `q == k` (`causal &
    document(seg)`: `maskc.analysis.diagonal_truth`) has that pair in every tile the
    diagonal crosses, with no pair evaluated.
    """
    bb, line, pos = split_keys(tile, self.geo.nq if along_rows else self.geo.nk, n_span,
                               True)
    i, j = (line, pos) if along_rows else (pos, line)
    st = np.full(tile.shape, PARTIAL, np.int8)
    todo = np.ones(tile.shape, bool)
    if self.refine or exact_part:
      if not (union or self.geo.positions) and self._true_on_diagonal():
        todo &= ~_diagonal_pairs(self.geo, i, j)[2]  # a true pair where the diagonal crosses
      sample = np.flatnonzero(todo)
      if sample.size:
        todo[sample] = ~_sampled_mixed(self.m, self.geo, self.tables,
                                       bb[sample] if self.batch else 0, i[sample],
                                       j[sample], union, self.budget)
    if todo.any():
      bt = bb[todo] if self.batch else 0
      # unrefined, by the pieces alone: as sharp as the analysis of the mask whole
      st[todo] = _decide_tiles(self.m, self.geo, self.tables, bt, i[todo], j[todo],
                               self.budget, self._pieces(bb[todo], i[todo], j[todo]),
                               self.batch or 1, evaluate=self.refine)
    return st


def _flat_runs(part, along_rows: bool, n_lines: int, n_span: int):
  """A part's runs as flat runs (`keyed`): a part that is itself an `&` / `|` hands them
  over as it combined them (`causal & ~img[k] | bidirectional(img)`: half a million runs
  not split into lines and keyed again), equal reads as they find them, by flat line."""
  if Form.FLAT in part.forms:
    return part.flat(along_rows)
  return keyed(part.merged(along_rows), n_lines, n_span)


def _widened_match(order: list, union: bool) -> tuple[Any, Any] | None:
  """Rule `widened_band`'s precondition on an `|`'s parts: `(equal reads, band)`, the first
  part that widens a band (`Form.WIDENS`) and the first that is one interval per row
  (`Form.INTERVALS`)."""
  if not union:
    return None
  equal = next((p for p in order if Form.WIDENS in p.forms), None)
  band = next((p for p in order if Form.INTERVALS in p.forms), None)
  return None if equal is None or band is None else (equal, band)


def _met_bounds_match(part, bands: list, spread: list) -> bool | None:
  """Rule `met_bounds`'s precondition on a part of an `&` and the `&`'s bands and spreads:
  the part's lines are band-shaped (`Form.LINE_BOUNDS`), and a band (or a band in an `|`
  beside reads that may widen it) meets it."""
  if Form.LINE_BOUNDS not in part.forms:
    return None
  return True if bands or Form.WIDENS in spread[0][1][1].forms else None


def _spread_match(part, union: bool) -> tuple[Any, list] | None:
  """Rule `spread`'s precondition on a part of an `&`: an `|` (`Form.JOIN`) of a band
  (`Form.BAND`) and others none of which reads one position only: `(band, others)`."""
  if union or not (Form.JOIN in part.forms and part.union):
    return None
  band = next((p for p in part.parts if Form.BAND in p.forms), None)
  rest = [p for p in part.parts if p is not band]
  if band is None or any(Form.PATTERN in p.forms for p in rest):
    return None
  return band, rest


WIDENED_BAND = Rule(
    "widened_band", "a band joined with equal reads into one interval per row (`causal | "
    "bidirectional(img)`), static and traced (maskc.lowering.closed_forms.widened_band)",
    "combine", exact=True, match=_widened_match,
    traced="maskc.lowering.closed_forms.widened_traced.widened_parts")
MET_BOUNDS = Rule(
    "met_bounds", "equal reads `&` a band (or a widened band), met as bounds per line "
    "(`causal & document(seg)`)", "combine", exact=True, match=_met_bounds_match)
SPREAD = Rule(
    "spread", "`x & (band | rest)`: x clipped at the band off the rest's lines", "combine",
    exact=False, match=_spread_match)
DIAGONAL_TRUTH = Rule(
    "diagonal_truth", "tiles PARTIAL in two parts of an `&` that the diagonal crosses, in a "
    "mask true at every q == k, mixed with no pair evaluated "
    "(maskc.analysis.diagonal_truth)", "combine", exact=True)

COMBINE_RULES: tuple[Rule, ...] = (WIDENED_BAND, MET_BOUNDS, SPREAD, DIAGONAL_TRUTH)


def _union_pieces(x, y):
  """The pieces between consecutive boundaries of two sorted flat run lists, in order, with
  each list's state on them (EMPTY outside its runs)."""
  # Each list's starts and stops interleave in order, so their concatenation is two
  # sorted runs (a linear merge), and a list covers a cut iff an odd number of its
  # boundaries lie at or before it: the last one was a start. Between lines lies a
  # key no run covers, so a piece reaching over it is EMPTY in both lists: dropped.
  xb, yb = (np.stack(v[:2], axis=1).reshape(-1) for v in (x, y))
  cuts = np.concatenate([xb, yb])
  order = np.argsort(cuts, kind="stable")
  cuts = cuts[order]
  # pieces start at the last of equal cuts (which counts all of them) and end at the next
  at = np.flatnonzero(cuts[1:] != cuts[:-1])
  nx = np.cumsum(order < xb.size)[at]
  ny = at + 1 - nx
  # the state after n boundaries: a run's for odd n (inside it), EMPTY for even n
  sx, sy = (np.zeros(2 * v[2].size + 1, np.int8) for v in (x, y))
  sx[1::2], sy[1::2] = x[2], y[2]
  return cuts[at], cuts[at + 1], sx[nx], sy[ny]


def _meeting_pieces(x, y):
  """The intersections of each run of one sorted flat run list with each of the other's, in
  order, with both lists' states: the pieces of `_union_pieces` inside both lists' runs,
  found by binary searches instead of a merge of every boundary."""
  (xa, xz, xs), (ya, yz, ys) = x, y
  first, stop = overlapping(xa, xz, ya, yz)  # the runs of y that meet each of x's
  count = stop - first
  i = np.repeat(np.arange(xa.size), count)
  j = ranges(first, count)
  return (np.maximum(xa[i], ya[j]), np.minimum(xz[i], yz[j]), xs[i], ys[j])
