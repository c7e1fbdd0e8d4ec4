"""Bands of `q - k` in closed form (`maskc.lowering.closed_forms.band`,
`maskc.lowering.grid.bands`): their tiles, and other parts' runs clipped to them, against dense
masks."""

import numpy as np
from hypothesis import given, strategies as st

import maskc
from helpers import tile_states
from maskc.analysis.linear import exact_band
from maskc.compiled.tiles import EMPTY, FULL, PARTIAL, grid_from_runs
from maskc.lowering import compile as _lower
from maskc.lowering.closed_forms import one_axis as _one_axis, parts as _parts
from maskc.lowering.closed_forms.met_bounds import met_bounds_pieces
from maskc.lowering.generic import combination as _combined, range_analysis as _range_analysis
from maskc.lowering.grid.bands import band_bounds, clipped_pieces
from maskc.lowering.grid.forms import line_runs
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget
from maskc.lowering.registry import RULESET
from maskc.lowering.rules import Site
from maskc.semantics.ranges import Tables
from maskc.semantics.shape import Shape

bounds_st = st.one_of(st.none(), st.integers(-40, 40))


@given(bounds_st, bounds_st, st.integers(1, 60), st.integers(1, 60), st.integers(-70, 70),
       st.integers(1, 9), st.integers(1, 9))
def test_band_bounds_give_the_dense_tiles(lo, hi, q_len, kv_len, offset, bq, bk):
  """Each line's bounds, along rows and along columns, give the tiles of the dense band,
  empty bands (`lo > hi`) and lines past either end included."""
  q = offset + np.arange(q_len)[:, None]
  k = np.arange(kv_len)[None, :]
  dense = np.ones((q_len, kv_len), bool)
  if lo is not None:
    dense &= q - k >= lo
  if hi is not None:
    dense &= q - k <= hi
  expected = tile_states(dense, bq, bk)
  geo = TileGeometry(Shape.of(q_len, kv_len, offset), bq, bk)
  for along_rows, want in ((True, expected), (False, expected.T)):
    s, f, g, e = band_bounds(geo, lo, hi, along_rows)
    assert np.all((s <= f) & (f <= g) & (g <= e))
    t = np.arange(want.shape[1])[None, :]
    got = np.where((t >= f[:, None]) & (t < g[:, None]), FULL,
                   np.where((t >= s[:, None]) & (t < e[:, None]), PARTIAL, EMPTY))
    np.testing.assert_array_equal(got, want)


def test_exact_bands_are_found_and_nothing_else():
  found = {t: exact_band(maskc.parse(t)) for t in [
      "causal", "sliding(8)", "local(3, 5)", "q - k == 3", "q + 1 > k + 1", "k - q >= 2",
      "causal & k > q - 4", "causal & chunk(4)", "q - k != 2", "2 * q - 2 * k >= 0",
      "causal | sliding(4)", "q >= 3"]}
  assert found == {"causal": (0, None), "sliding(8)": (0, 7), "local(3, 5)": (-5, 3),
                   "q - k == 3": (3, 3), "q + 1 > k + 1": (1, None), "k - q >= 2": (None, -2),
                   "causal & k > q - 4": (0, 3), "causal & chunk(4)": None,
                   "q - k != 2": None, "2 * q - 2 * k >= 0": None,
                   "causal | sliding(4)": None, "q >= 3": None}


BAND_MASKS = [
    "causal & document(seg)",
    "sliding(W) & document(seg)",
    "local(L, R) & document(seg)",
    "causal & bidirectional(img)",
    "local(L, R) & bidirectional(img) & document(seg)",
    "q - k >= L & k - q >= R & document(seg)",  # an empty band where L + R > 0
    "q - k == L & document(seg)",
    "sliding(W) & document(seg) & img[k]",
    "causal & seg[q] % 3 == seg[k] % 3",
]


@st.composite
def band_cases(draw):
  """A band `&` masks with operands: sorted and unsorted documents, image spans, batches."""
  n = draw(st.integers(8, 96))
  batch = draw(st.sampled_from([None, 2]))
  rng = np.random.default_rng(draw(st.integers(0, 2**31)))
  rows = []
  for _ in range(batch or 1):
    ids = np.repeat(np.arange(n), rng.integers(1, draw(st.sampled_from([3, 9, 40])), n))[:n]
    if draw(st.booleans()):
      ids = rng.permutation(n)[ids]
    rows.append(ids)
  seg = np.stack(rows) if batch else rows[0]
  img = rng.random(seg.shape) < 0.5 if draw(st.booleans()) else seg % 2 == 1
  text = draw(st.sampled_from(BAND_MASKS))
  text = (text.replace("W", str(draw(st.integers(1, 20))))
          .replace("L", str(draw(st.integers(0, 12)))).replace("R", str(draw(st.integers(0, 12)))))
  q_len = draw(st.integers(1, n))
  offset = draw(st.integers(0, n - q_len))  # `seg[q]` reads every query position
  return text, n, q_len, offset, draw(st.sampled_from([1, 4, 8, 16])), draw(
      st.sampled_from([1, 4, 8, 16])), {k: v for k, v in (("seg", seg), ("img", img))
                                        if k in text}


@given(band_cases())
def test_band_intersections_are_exact(case):
  """`band & x` lowers to the dense mask's tiles, rows and columns, with the band clipping
  the other parts' runs wherever the mask is lowered in parts (`exact`: masks beyond the
  prelude are refined too)."""
  grids, expected = _lowered_and_dense(case, exact=True)
  for got in grids:
    np.testing.assert_array_equal(got, expected)


def _lowered_and_dense(case, exact: bool):
  """(the map's grid from its rows and from its columns, the dense mask's tiles) of a case."""
  text, n, q_len, offset, bq, bk, ops = case
  _lower._CACHE.clear()
  bm = maskc.compile(text, q_len, n, q_offset=offset, block_q=bq, block_kv=bk, operands=ops,
                     exact=exact)
  dense = np.asarray(maskc.materialize(text, q_len, n, q_offset=offset, operands=ops))
  expected = tile_states(dense.reshape((-1,) + dense.shape[-2:]), bq, bk)
  cols = np.asarray(grid_from_runs(np, bm.cols, expected.shape[-2]))[:, 0]
  return (np.asarray(bm.grid).reshape(expected.shape),
          np.swapaxes(cols, -1, -2).reshape(expected.shape)), expected


SPREAD_MASKS = [
    "document(seg) & (causal | bidirectional(img))",
    "document(seg) & (sliding(W) | bidirectional(img))",
    "img[q] & (local(L, R) | document(seg))",
    "seg[q] % 3 == seg[k] % 3 & (q - k >= L & k - q >= R | bidirectional(img))",
    "document(seg) & (causal | bidirectional(img) | seg[q] == seg[k] + 1)",
    "causal & (sliding(W) | bidirectional(img))",  # a band all the `&` has beside the spread
]


@st.composite
def spread_cases(draw):
  """`x & (band | rest)` with few operand changes per tile row, so that it is lowered in
  parts and the band spread over the `&` (`_CombinedRuns._spread`): documents of 40-400
  tokens, sorted or not, and up to four image spans, in batches or not."""
  n = draw(st.integers(64, 1024))
  batch = draw(st.sampled_from([None, 2]))
  rng = np.random.default_rng(draw(st.integers(0, 2**31)))
  segs, imgs = [], []
  for _ in range(batch or 1):
    ids = np.repeat(np.arange(n), rng.integers(40, 400, n))[:n]
    segs.append(rng.permutation(n)[ids] if draw(st.booleans()) else ids)
    img = np.zeros(n, bool)
    for start in rng.integers(0, n, draw(st.integers(0, 4))):
      img[start:start + rng.integers(1, 200)] = True
    imgs.append(img)
  seg, img = (np.stack(x) if batch else x[0] for x in (segs, imgs))
  text = draw(st.sampled_from(SPREAD_MASKS))
  text = (text.replace("W", str(draw(st.integers(1, 60))))
          .replace("L", str(draw(st.integers(0, 40)))).replace("R", str(draw(st.integers(0, 40)))))
  q_len = draw(st.integers(1, n))
  offset = draw(st.integers(0, n - q_len))
  return text, n, q_len, offset, draw(st.sampled_from([4, 8, 16])), draw(
      st.sampled_from([4, 8, 16])), {k: v for k, v in (("seg", seg), ("img", img))
                                     if k in text}


@given(spread_cases(), st.booleans())
def test_a_band_spread_over_an_and_is_exact(case, exact):
  """`x & (band | rest)` lowers to the dense mask's tiles, rows and columns, where the band is
  spread over the `&` as where it is not: exactly for prelude masks and with `exact=True`,
  soundly (FULL and EMPTY right, the rest PARTIAL) for masks beyond the prelude without."""
  grids, expected = _lowered_and_dense(case, exact)
  for got in grids:
    if exact or "==" not in case[0]:  # explicit comparisons: beyond the prelude
      np.testing.assert_array_equal(got, expected)
    else:
      decided = got != PARTIAL
      np.testing.assert_array_equal(got[decided], expected[decided])


def test_the_band_clips_the_documents():
  """`causal & document(seg)` and `sliding(w) & document(seg)` are lowered in parts with the
  band in closed form (no analysis, no period repeated), so these tests reach the clip."""
  seg = np.repeat(np.arange(40), 100)[:4000]
  for text in ["causal & document(seg)", "sliding(300) & document(seg)",
               "local(7, 9) & bidirectional(img)"]:
    ops = {"seg": seg, "img": seg % 3 == 0}
    e = maskc.explain(text, 4000, block_q=16, block_kv=16,
                      operands={k: v for k, v in ops.items() if k in text})
    assert e.parts[0].rule == "parts", e
    assert "band" in [p.rule for p in e.parts if p.depth == 1], e


def test_a_band_in_an_or_is_spread_over_the_and():
  """`document(seg) & (causal | bidirectional(img))` spreads the band over the `&`
  (`_CombinedRuns._spread`): the documents clipped at the band widened by the images, or,
  with several parts beside the band, clipped at the band and met with the images on the
  images' lines. These masks of the property test above reach it."""
  seg = np.repeat(np.arange(10), 400)
  for text in ["document(seg) & (causal | bidirectional(img))",
               "document(seg) & (causal | bidirectional(img) | seg[q] == seg[k] + 1)"]:
    ops = {"seg": seg, "img": seg % 3 == 0}
    e = maskc.explain(text, 4000, block_q=16, block_kv=16, operands=ops)
    assert e.parts[0].rule == "parts" and "spread" in e.rules, e


def test_an_and_of_parts_needing_no_analysis_stays_in_parts():
  """`document(seg) & (causal | bidirectional(img))` with a document change every tile row,
  above `WHOLE_AFTER`, is still lowered in parts: its `|` is in parts that need no range
  analysis itself, so lowering the `&` whole would analyse every document's squares for
  nothing (1M tokens, 64 images, documents of 50-200 tokens at 128-tiles or of 1K-8K at
  1024-tiles: 5-10 times slower). Its tiles are the dense mask's."""
  seg = np.repeat(np.arange(250), 16)
  ops = {"seg": seg, "img": (seg % 7 == 3) | (seg % 11 == 0)}
  text = "document(seg) & (causal | bidirectional(img))"
  bound = _lower.bind_masks(text, 4000, operands=ops)
  geo = TileGeometry(bound.shape, 16, 16)
  site = Site(geo, Tables(np, bound.operands, bound.forms), None, True, Budget(1 << 28),
              RULESET)
  assert not _parts._parts_pay(bound.masks[0], site)
  assert maskc.explain(text, 4000, block_q=16, block_kv=16, operands=ops).parts[0].rule == (
      "parts")
  _lower._CACHE.clear()
  bm = maskc.compile(text, 4000, block_q=16, block_kv=16, operands=ops)
  expected = tile_states(np.asarray(maskc.materialize(text, 4000, operands=ops)), 16, 16)
  np.testing.assert_array_equal(np.asarray(bm.grid).reshape(expected.shape), expected)


def test_tiles_partial_in_exact_parts_are_sampled_unrefined(monkeypatch):
  """`document(seg) & causal & ~pad[k]` reads a raw operand, so it is not refined; yet its
  band and its documents are exact as lowered, so the tiles PARTIAL in both (the diagonal
  tiles a document's edge crosses) are decided by sampled pairs, none analysed by pieces,
  and the map is the dense mask's. The padding starts at a tile's edge past the last
  document's edge: no tile is PARTIAL in it, and none to decide lies in it (where the whole
  mask has no true pair for the samples to find)."""
  seg = np.repeat(np.arange(100), 40)
  ops = {"seg": seg, "pad": np.arange(4000) >= 3984}
  text = "document(seg) & causal & ~pad[k]"
  analysed = []
  decide = _range_analysis.decide_tiles
  for module in (_range_analysis, _combined):  # its callers
    monkeypatch.setattr(module, "decide_tiles",
                        lambda *a, **k: analysed.append(np.size(a[4])) or decide(*a, **k))
  _lower._CACHE.clear()
  bm = maskc.compile(text, 4000, block_q=16, block_kv=16, operands=ops)
  assert not analysed
  expected = tile_states(np.asarray(maskc.materialize(text, 4000, operands=ops)), 16, 16)
  np.testing.assert_array_equal(np.asarray(bm.grid).reshape(expected.shape), expected)


def test_tiles_partial_in_two_exact_parts_of_one_axis_are_sampled_unrefined(monkeypatch):
  """`g[q] | g[k]` reads raw operands, so it is not refined; yet each part's analysis proves
  every PARTIAL tile mixed (a tile column holding some global keys holds them in every
  row), so the tiles where a global row meets a global column, PARTIAL in both, are
  decided by sampled pairs, none analysed, and the map is the dense mask's, both ways.
  A part whose analysis leaves tiles ambiguous (`w[k] + k > 500`, w changing at every
  token) is not exact, and its tiles are analysed."""
  g = np.zeros(1024, bool)
  g[[5, 300, 301, 777, 1000]] = True  # inside tiles: no corner pair of a tile reads them
  ops = {"g": g, "w": np.arange(1024) % 7}
  analysed, parts = [], []
  decide, axis_runs = _range_analysis.decide_tiles, _one_axis.AxisRuns.__init__
  for module in (_range_analysis, _combined):  # its callers
    monkeypatch.setattr(module, "decide_tiles",
                        lambda *a, **k: analysed.append(np.size(a[4])) or decide(*a, **k))
  monkeypatch.setattr(_one_axis.AxisRuns, "__init__",
                      lambda self, *a, **k: axis_runs(self, *a, **k) or parts.append(self))
  for text, exact, sampled in (("g[q] | g[k]", [True, True], True),
                               ("w[k] + k > 500 | g[q]", [False, True], False)):
    analysed.clear()
    parts.clear()
    _lower._CACHE.clear()
    bm = maskc.compile(text, 1024, block_q=16, block_kv=16, operands=ops)
    cols = bm.cols
    assert sorted(p.exact for p in parts) == exact
    assert (not analysed) == sampled
    expected = tile_states(np.asarray(maskc.materialize(text, 1024, operands=ops)), 16, 16)
    got = np.asarray(bm.grid).reshape(expected.shape)
    assert np.all((got == FULL) <= (expected == FULL))
    assert np.all((got == EMPTY) <= (expected == EMPTY))
    if sampled:
      np.testing.assert_array_equal(got, expected)
    back = np.asarray(grid_from_runs(np, cols, expected.shape[-2]))[:, 0]
    np.testing.assert_array_equal(np.swapaxes(back, -1, -2).reshape(expected.shape), got)


@st.composite
def _band_shaped(draw, lines: int, span: int):
  """Bounds `[4, lines]`, `s <= f <= g <= e` on `[0, span]`, some runs empty."""
  cuts = np.sort(np.asarray(draw(st.lists(st.lists(st.integers(0, span), min_size=4,
                                                     max_size=4), min_size=lines,
                                            max_size=lines))), axis=1)
  return cuts.T.copy()


@given(st.data(), st.integers(1, 6), st.integers(1, 12), st.integers(0, 3), st.booleans())
def test_met_bounds_pieces_are_the_clipped_runs(data, n_lines, n_span, rows, per_flat_line):
  """Two band-shaped bounds met in closed form give the pieces of the first's runs clipped
  at the second's (`clipped_pieces`), for lines of any batch row, the second's bounds per
  line or per flat line."""
  first = rows * n_lines + data.draw(st.integers(0, n_lines - 1))
  count = data.draw(st.integers(1, 3 * n_lines))
  x_bounds = data.draw(_band_shaped(count, n_span))
  total = first + count
  bounds = data.draw(_band_shaped(total if per_flat_line else n_lines, n_span))
  got = met_bounds_pieces(x_bounds, first, bounds, n_lines, n_span)
  at, a, z, state = line_runs(x_bounds)
  base = (first + at) * (n_span + 1)
  expected = clipped_pieces((base + a, base + z, state), bounds, n_lines, n_span)
  for g, e in zip(got, expected):
    np.testing.assert_array_equal(g, e)


def test_bounds_met_in_small_groups_of_lines(monkeypatch):
  """`causal & document(seg)` and `document(seg) & (causal | bidirectional(img))`, batched,
  lowered with the documents' bounds met a few lines at a time, give the dense tiles."""
  monkeypatch.setattr(_combined, "COMBINE_CHUNK", 12)  # 4 lines at a time
  rng = np.random.default_rng(5)
  seg = np.sort(rng.integers(0, 9, (2, 300)), axis=1)
  img = np.zeros((2, 300), bool)
  img[0, 40:90] = img[1, 200:260] = True
  for text in ["causal & document(seg)", "document(seg) & (causal | bidirectional(img))"]:
    ops = {"seg": seg, "img": img} if "img" in text else {"seg": seg}
    for exact in (False, True):
      grids, expected = _lowered_and_dense((text, 300, 300, 0, 8, 8, ops), exact)
      for got in grids:
        np.testing.assert_array_equal(got, expected)
