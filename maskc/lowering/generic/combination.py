"""The runs of an `&` / `|` from the runs of its parts, lowered apart (`CombinedRuns`).

With states ordered EMPTY < PARTIAL < FULL a tile's state under `|` is the largest of its
parts' and under `&` the smallest, except where two parts are PARTIAL: those tiles are
decided for the whole mask (`pieces_decided`). The general ways to combine two parts are
here: flat run lists merged (`_union_pieces`, `_meeting_pieces`), a band's bounds clipping
the others' runs (`clip_lines`), a pattern of one axis spliced into them (`_splice`). The
closed forms between kinds of part are the combine rules (`maskc/lowering/closed_forms/`:
`widened_band`, `met_bounds`, `spread`, `diagonal_truth`), which the combiner reaches
through the `RuleSet` of its site at its steps "join", "meet", "clip" and "decide"
(`maskc.lowering.rules.STEPS`), matched on the forms the parts give
(`maskc.lowering.grid.parts`), never on the rules that lowered them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from maskc.arrays.ragged import ranges
from maskc.compiled.tiles import Runs
from maskc.language import ir
from maskc.lowering.generic.range_analysis import decide_tiles, pieces_of_lines
from maskc.lowering.generic.sampling import diagonal_pairs, sampled_mixed
from maskc.lowering.grid.bands import clipped_pieces
from maskc.lowering.grid.forms import (
  Array,
  FlatRuns,
  Form,
  LineBounds,
  keyed,
  merge_keyed,
  pack_keyed,
  split_keys,
  unpacked,
)
from maskc.lowering.grid.parts import PartRuns, PatternPart, given, line_part
from maskc.lowering.grid.pattern_lines import spliced_pattern
from maskc.lowering.grid.run_lists import (
  interleaved,
  lines_of,
  marked,
  meeting_mask,
  on_lines,
  overlapping,
)
from maskc.lowering.rules import Rule, Site
from maskc.lowering.tuning import (
  COMBINE_CHUNK,
  COMBINE_RUN_BYTES,
  DECIDED_TILE_BYTES,
  SPLICE_SORTED_AFTER,
  WAITING_PIECE_BYTES,
)
from maskc.semantics.operand_runs import Pieces, reads_at
from maskc.semantics.ranges import EMPTY, FULL, PARTIAL

# Pieces of flat runs `(lo, hi, x's state, y's state)`, as two run lists meet or join.
FlatPieces = tuple[Array, Array, Array, Array]


class CombinedRuns:
  """The runs of `a & b & ...` or `a | b | ...` from the runs of its parts.

  With states ordered EMPTY < PARTIAL < FULL, a tile's state under `|` is the
  largest of its parts' and under `&` the smallest, exactly, except where two
  parts are PARTIAL: there the union may be FULL and the intersection EMPTY, so
  those tiles (few: where two parts' boundaries cross) are decided for the whole
  mask. Lets `causal & chunk(8192) | bidirectional(img)` repeat the period of
  `causal & chunk(8192)` and analyse only the image spans.

  Which closed form combines which parts is decided by the forms the parts give
  (`maskc.lowering.grid.parts`), through the combine rules of `site.rules` at each step.
  """

  forms = frozenset({Form.FLAT, Form.JOIN})
  exact = False

  def __init__(self, m: ir.Mask, parts: Sequence[PartRuns], site: Site):
    """`m`: the `&` / `|` (its body); `parts`: its parts' runs; `site`: where it is lowered."""
    self.m, self.parts, self.site = m, parts, site
    self.geo, self.tables, self.batch = site.geo, site.tables, site.batch
    self.refine, self.budget = site.refine, site.budget
    self.union = isinstance(m, ir.Or)
    self._diagonal: bool | None = None

  def first(self, step: str, *args: Any) -> tuple[Rule, Any] | None:
    """The first enabled rule at `step` whose match on `args` holds, with what it found."""
    for rule in self.site.rules.at(step):
      found = rule.found(*args)
      if found is not None:
        return rule, found
    return None

  def _true_on_diagonal(self) -> bool:
    """Whether the mask is true at every pair `q == k`, as a rule at step "decide" proves
    (once, from its IR)."""
    if self._diagonal is None:
      self._diagonal = False
      for rule in self.site.rules.at("decide"):
        if rule.found(self.m):
          self._diagonal = True
          rule.took()
          break
    return self._diagonal

  def _pieces(self, b: Array, i: Array, j: Array) -> tuple[Pieces, Pieces] | None:
    """Operand pieces of the whole mask's lines (as `GenericRuns`) for deciding tiles
    `(b, i, j)`: of their rows and columns only, where no part lends them.

    The operand-free part reads nothing, so a part that cut its lines at the same
    reads lends its pieces.
    """
    geo = self.geo
    if geo.batched_positions:
      return None
    reads = [reads_at(self.m, axis) for axis in "qk"]
    lent = [given(x, Form.PIECES).pieces for x in self.parts if Form.PIECES in x.forms and
            [reads_at(x.m, axis) for axis in "qk"] == reads]
    if lent:
      return lent[0]
    rows, cols = (pieces_of_lines(self.m, geo, self.tables, self.batch, along_rows,
                                  self.budget, np.unique(b * n + line))
                  for along_rows, n, line in ((True, geo.nq, i), (False, geo.nk, j)))
    return rows, cols

  def flat(self, along_rows: bool) -> FlatRuns:
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

  def _unspliced(self, along_rows: bool) -> tuple[FlatRuns, list[PatternPart]]:
    """The flat runs of every part but those of one axis whose runs along these lines are
    a pattern (`Form.PATTERN`), unmerged, and those parts, to splice in."""
    geo = self.geo
    n_lines, n_span = (geo.nq, geo.nk) if along_rows else (geo.nk, geo.nq)
    axis = [given(p, Form.PATTERN) for p in self.parts if Form.PATTERN in p.forms]
    patterns = [p for p in axis if p.pattern_along(along_rows)]
    whole: list[PartRuns] = [p for p in axis if not p.pattern_along(along_rows)]  # a run a line
    # a band (an `&`'s only) clips the runs of the others, unless it is all there is;
    # so does a band in an `|` of an `&`, spread over it (a rule at step "clip")
    bands = [given(p, Form.BAND) for p in self.parts
             if Form.BAND in p.forms and not self.union]
    others = [p for p in self.parts if Form.PATTERN not in p.forms and
              not any(p is b for b in bands)]
    spread = [(p, found) for p, found in ((p, self.first("clip", self, p))
                                          for p in others) if found is not None]
    for _, (rule, _found) in spread:
      rule.took()
    others = [p for p in others if not any(p is q for q, _ in spread)]
    if not (whole or others):
      if bands:
        others, bands = [bands[0]], bands[1:]
      else:
        others, spread = [spread[0][0]], spread[1:]
    # whole lines first: under `&`, the other parts matter only on their non-EMPTY lines
    order = whole + others
    exact = False
    flat: FlatRuns | None = None
    if self.union:  # `causal & chunk(8192) | bidirectional(img)`: written from bounds
      joined = self.first("join", order, self.union)
      if joined is not None:
        out = joined[0].run(self, joined[1], along_rows, n_lines, n_span)
        if out is not None:
          (flat, order), exact = out, True
    elif len(order) == 1 and (bands or spread):  # `causal & document(seg)`: from bounds
      spreads = [f for _, (_, f) in spread]
      met = self.first("meet", order[0], bands, spreads)
      if met is not None:
        out = met[0].run(self, met[1], along_rows, n_lines, n_span, bands, spreads)
        if out is not None:
          flat, used_bands, used_spreads = out
          bands, spread, order = bands[used_bands:], spread[used_spreads:], []
    if flat is None:
      flat = flat_runs(order[0], along_rows, n_lines, n_span)
      exact = order[0].exact  # the runs so far are one exact part's, as lowered
      order = order[1:]
    for part in order:
      other = flat_runs(part, along_rows, n_lines, n_span)
      if whole and not self.union:
        other = on_lines(other, lines_of(flat[0], n_span), n_span)
      flat = self.combine_by_lines(flat, other, along_rows, n_lines, n_span,
                                   exact_part=exact or part.exact)
      exact = False
    for band in bands:
      flat = self.clip_lines(flat, band.bounds(along_rows), along_rows, n_lines, n_span)
      exact = False
    for _, (rule, found) in spread:
      flat = rule.run(self, found, flat, along_rows, n_lines, n_span, exact)
      exact = False
    return flat, patterns

  def _splice(self, x: FlatRuns, part: PatternPart, along_rows: bool, n_lines: int,
              n_span: int) -> FlatRuns:
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

  def _spliced_met(self, x: FlatRuns, part: PatternPart, along_rows: bool, n_lines: int,
                   n_span: int) -> tuple[FlatRuns, Array, Array, Array]:
    """The flat runs of `x` combined with the pattern's runs that meet the span of each
    line's runs in `x`, and those lines (flat), with the range `[lo, hi)` of the
    pattern's runs (indices into it) that each meets.

    Of those looked at, only the ones that meet a PARTIAL run of `x` or cross the edge
    of a FULL one are combined with `x` (`combine_by_lines`): one inside a FULL run is
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
    met = FlatRuns(base[item] + pa[p], base[item] + pz[p], ps[p])
    if item.size > SPLICE_SORTED_AFTER * key.size:  # many per run of x: most inside one
      shift = (at - lo)[np.repeat(np.arange(lines.size), in_x[lines])]  # per run of x
      combined, inside = self._splice_kinds(x, flat_line, shift, p_lo, p_hi, pa, pz,
                                            item.size, n_lines, stride)
      mid = self.combine_by_lines(x, FlatRuns(*(v[combined] for v in met)), along_rows, n_lines,
                                   n_span, exact_part=part.exact)
      kept = inside if not self.union else ~(combined | inside)
      mid = interleaved(mid, FlatRuns(*(v[kept] for v in met)))
    else:
      mid = self.combine_by_lines(x, met, along_rows, n_lines, n_span,
                                   exact_part=part.exact)
    return mid, lines, lo, hi

  def _spliced_lines(self, x: FlatRuns, part: PatternPart, along_rows: bool, n_lines: int,
                     n_span: int) -> Runs:
    """The packed runs of `x | part`
    (`maskc.lowering.grid.pattern_lines.spliced_pattern`): each line the pattern's runs
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
  def _splice_kinds(x: FlatRuns, flat_line: Array, shift: Array, p_lo: Array, p_hi: Array,
                    pa: Array, pz: Array, n_met: int, n_lines: int,
                    stride: int) -> tuple[Array, Array]:
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

  def combine_by_lines(self, x: FlatRuns, y: FlatRuns, along_rows: bool, n_lines: int,
                       n_span: int, union: bool | None = None,
                       exact_part: bool = False) -> FlatRuns:
    """`_combine` over groups of whole lines of about `COMBINE_CHUNK` runs: runs never
    cross a line, so the groups are independent, and memory stays bounded.

    Where one list has runs on few lines (an image's rows, a pattern's meeting), only
    the other's runs that overlap them are combined: elsewhere a union keeps the other
    list's runs as they are, and an intersection drops them (`causal & ~img[k] |
    bidirectional(img)`: a few dozen of half a million runs, `docs/lowering.md`,
    "Measurements behind the design").
    `union`: whether to join as `|` (default: as the mask does). `exact_part`: one of the
    lists is exact as it stands (`pieces_decided`).
    """
    union = self.union if union is None else union
    small, large = (x, y) if x[0].size <= y[0].size else (y, x)
    lines = lines_of(small[0], n_span)
    if lines.size * 4 < lines_of(large[0], n_span).size:
      meets = meeting_mask(large, small)
      both = self._combine_lines(FlatRuns(*(v[meets] for v in large)), small, along_rows, n_lines,
                                 n_span, union, exact_part)
      if not union:
        return both
      return interleaved(both, FlatRuns(*(v[~meets] for v in large)))
    return self._combine_lines(x, y, along_rows, n_lines, n_span, union, exact_part)

  def _combine_lines(self, x: FlatRuns, y: FlatRuns, along_rows: bool, n_lines: int,
                     n_span: int, union: bool, exact_part: bool = False) -> FlatRuns:
    """`combine_by_lines` over every line."""
    def pieces_of(x: FlatRuns, y: FlatRuns) -> FlatPieces:
      return _union_pieces(x, y) if union else _meeting_pieces(x, y)

    def decided(pieces: FlatPieces) -> FlatRuns:
      return self.pieces_decided(*pieces, along_rows, n_span, union, exact_part)

    return self._by_line_chunks([x, y], x[0].size + y[0].size, n_lines, n_span, pieces_of,
                                decided)

  def clip_lines(self, x: FlatRuns, bounds: LineBounds, along_rows: bool, n_lines: int,
                 n_span: int) -> FlatRuns:
    """Flat runs `x` of an `&` with a band whose lines have bounds `bounds`
    (`maskc.lowering.grid.bands`): cut at them, PARTIAL with PARTIAL decided tile
    by tile."""
    def pieces_of(x: FlatRuns) -> FlatPieces:
      return clipped_pieces(x, bounds, n_lines, n_span)

    def decided(pieces: FlatPieces) -> FlatRuns:  # a band is exact
      return self.pieces_decided(*pieces, along_rows, n_span, False, exact_part=True)

    return self._by_line_chunks([x], 3 * x[0].size, n_lines, n_span, pieces_of, decided)

  def _by_line_chunks(self, lists: Sequence[FlatRuns], total: int, n_lines: int, n_span: int,
                      pieces_of: Callable[..., FlatPieces],
                      decided: Callable[[FlatPieces], FlatRuns]) -> FlatRuns:
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
    out: list[FlatRuns] = []
    waiting: list[FlatPieces] = []  # pieces `(lo, hi, sx, sy)` not decided yet

    def decide_waiting() -> None:
      if waiting:
        lo, hi, sx, sy = (waiting[0] if len(waiting) == 1 else
                          (np.concatenate(v) for v in zip(*waiting)))
        out.append(decided((lo, hi, sx, sy)))
        waiting.clear()

    for lo, hi in itertools.pairwise(cuts):
      held = sum(p[0].size for p in waiting)
      if held * 2 >= per_chunk:  # before the next group's pieces: memory stays bounded
        decide_waiting()
        held = 0
      parts = [slice(*np.searchsorted(x[0], [lo, hi])) for x in lists]
      pieces = pieces_of(*(FlatRuns(*(v[at] for v in x)) for x, at in zip(lists, parts)))
      if held + pieces[0].size > per_chunk:
        decide_waiting()
      waiting.append(pieces)
    decide_waiting()
    return FlatRuns(*(np.concatenate(v) for v in zip(*out)))

  def pieces_decided(self, lo: Array, hi: Array, sx: Array, sy: Array, along_rows: bool,
                     n_span: int, union: bool, exact_part: bool = False) -> FlatRuns:
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
      return FlatRuns(lo[keep], hi[keep], state[keep].astype(np.int8))
    blo, bhi = lo[both], hi[both]
    n = bhi - blo
    if np.all(n == 1):  # the usual case, each such piece one tile: decided in place
      state = state.astype(np.int8)
      state[both] = self._both_partial(blo, along_rows, n_span, union, exact_part)
      keep = state != EMPTY
      return FlatRuns(lo[keep], hi[keep], state[keep])
    keep = state != EMPTY
    keep[both] = False
    tiles = self._tiles_decided(blo, n, along_rows, n_span, union, exact_part)
    lo_k, hi_k, st_k = (np.concatenate([v[keep], t]) for v, t in zip((lo, hi, state), tiles))
    order = np.argsort(lo_k, kind="stable")
    return FlatRuns(lo_k[order], hi_k[order], st_k[order].astype(np.int8))

  def _tiles_decided(self, blo: Array, n: Array, along_rows: bool, n_span: int, union: bool,
                     exact_part: bool) -> FlatRuns:
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
    out: list[FlatRuns] = []
    for t0 in range(0, total, group):
      t = np.arange(t0, min(t0 + group, total), dtype=np.int64)
      piece = np.searchsorted(end, t, "right")
      tile = blo[piece] + t - (end - n)[piece]
      out.append(merge_keyed(tile, tile + 1, self._both_partial(tile, along_rows, n_span,
                                                                 union, exact_part)))
    return FlatRuns(*(np.concatenate(v) for v in zip(*out)))

  def _both_partial(self, tile: Array, along_rows: bool, n_span: int, union: bool,
                    exact_part: bool = False) -> Array:
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
        todo &= ~diagonal_pairs(self.geo, i, j)[2]  # a true pair where the diagonal crosses
      sample = np.flatnonzero(todo)
      if sample.size:
        todo[sample] = ~sampled_mixed(self.m, self.geo, self.tables,
                                       bb[sample] if self.batch else 0, i[sample],
                                       j[sample], union, self.budget)
    if todo.any():
      bt = bb[todo] if self.batch else 0
      # unrefined, by the pieces alone: as sharp as the analysis of the mask whole
      st[todo] = decide_tiles(self.m, self.geo, self.tables, bt, i[todo], j[todo],
                               self.budget, self._pieces(bb[todo], i[todo], j[todo]),
                               self.batch or 1, evaluate=self.refine)
    return st


def flat_runs(part: PartRuns, along_rows: bool, n_lines: int, n_span: int) -> FlatRuns:
  """A part's runs as flat runs (`keyed`): a part that is itself an `&` / `|` hands them
  over as it combined them (`causal & ~img[k] | bidirectional(img)`: half a million runs
  not split into lines and keyed again), equal reads as they find them, by flat line."""
  if Form.FLAT in part.forms:
    return given(part, Form.FLAT).flat(along_rows)
  return keyed(line_part(part).merged(along_rows), n_lines, n_span)


def _union_pieces(x: FlatRuns, y: FlatRuns) -> FlatPieces:
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


def _meeting_pieces(x: FlatRuns, y: FlatRuns) -> FlatPieces:
  """The intersections of each run of one sorted flat run list with each of the other's, in
  order, with both lists' states: the pieces of `_union_pieces` inside both lists' runs,
  found by binary searches instead of a merge of every boundary."""
  (xa, xz, xs), (ya, yz, ys) = x, y
  first, stop = overlapping(xa, xz, ya, yz)  # the runs of y that meet each of x's
  count = stop - first
  i = np.repeat(np.arange(xa.size), count)
  j = ranges(first, count)
  return (np.maximum(xa[i], ya[j]), np.minimum(xz[i], yz[j]), xs[i], ys[j])
