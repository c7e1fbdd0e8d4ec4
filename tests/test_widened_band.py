"""A band widened by equal reads (`maskc.lowering.closed_forms.widened_band`): `band |
bidirectional(img)` as bounds per line, against dense masks."""

import jax
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

import maskc
from helpers import assert_exact, tile_states
from maskc.compiled.tiles import EMPTY, FULL, PARTIAL, grid_from_runs
from maskc.lowering import compile as _lower, traced as _lower_dynamic
from maskc.lowering.closed_forms.equal_reads import EQUAL_READS
from maskc.lowering.closed_forms.widened_band import widen
from maskc.lowering.generic import combination as _combined, range_analysis as _range_analysis
from maskc.lowering.grid.bands import Intervals
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget
from maskc.lowering.registry import RULESET
from maskc.lowering.rules import Site, taken
from maskc.semantics.ranges import Tables
from sampling import PARTS, count

BANDS = ["causal", "sliding(W)", "local(L, R)", "q - k >= A & q - k <= B", "k - q >= A",
         "q - k >= A", "causal & chunk(C)", "chunk(C)", "local(L, R) & chunk(C)",
         "q - k >= A & chunk(C)"]
# `x[q + s] == x[k + t]` where each value is one run, alone or `& w[q + s]`
EQUALS = ["bidirectional(img)", "document(seg)", "seg[q + S] == seg[k + T]",
          "runs(img)[q + S] == runs(img)[k + T] & img[q + S]"]
PAD = 3  # operands reach past the last key by the largest shift


@st.composite
def band_texts(draw):
  """One of `BANDS` with its parameters drawn."""
  band = draw(st.sampled_from(BANDS))
  for name, lo, hi in (("W", 1, 40), ("L", 0, 30), ("R", 0, 30), ("A", -10, 30),
                       ("B", -10, 30), ("C", 1, 70)):
    band = band.replace(name, str(draw(st.integers(lo, hi))))
  return band


@st.composite
def widened_cases(draw):
  """`(band, equal reads, kv_len, q_len, q_offset, bq, bk, operands)`: one to five image spans
  and documents of 1-60 tokens (ids sorted, so one run each), batched or not, shifted
  reads, bands that hold the diagonal and bands that do not (`q - k >= 5`, `k - q >= 2`),
  so that some blocks lie apart from their rows' band intervals."""
  n = draw(st.integers(8, 200))
  batch = draw(st.sampled_from([None, None, 2]))
  rng = np.random.default_rng(draw(st.integers(0, 2**31)))
  segs, imgs = [], []
  for _ in range(batch or 1):
    segs.append(np.repeat(np.arange(n + PAD), rng.integers(1, 60, n + PAD))[:n + PAD])
    img = np.zeros(n + PAD, bool)
    for start in rng.integers(0, n + PAD, draw(st.integers(1, 5))):
      img[start:start + rng.integers(1, 80)] = True
    imgs.append(img)
  seg, img = (np.stack(x) if batch else x[0] for x in (segs, imgs))
  band = draw(band_texts())
  equal = draw(st.sampled_from(EQUALS))
  equal = equal.replace("S", str(draw(st.integers(0, PAD)))).replace(
      "T", str(draw(st.integers(0, PAD))))
  q_len = draw(st.integers(1, n))
  offset = draw(st.integers(0, n - q_len))
  ops = {k: v for k, v in (("seg", seg), ("img", img)) if k in equal}
  return band, equal, n, q_len, offset, draw(st.sampled_from([1, 4, 8, 16])), draw(
      st.sampled_from([1, 4, 8, 16])), ops


def _dense_tiles(text, n, q_len, offset, bq, bk, ops):
  dense = np.asarray(maskc.materialize(text, q_len, n, q_offset=offset, operands=ops))
  return tile_states(dense.reshape((-1,) + dense.shape[-2:]), bq, bk)


def _equal_runs(equal, n, q_len, offset, bq, bk, ops):
  bound = _lower.bind_masks(equal, q_len, n, q_offset=offset, operands=ops)
  geo = TileGeometry(bound.shape, bq, bk)
  batch = next(iter(ops.values())).shape[0] if next(iter(ops.values())).ndim == 2 else None
  tables = Tables(np, bound.operands, bound.forms)
  site = Site(geo, tables, batch, True, Budget(1 << 28), RULESET)
  found = EQUAL_READS.found(bound.masks[0], site)
  return (None if found is None else EQUAL_READS.lower(bound.masks[0], found, site)), geo


def _grid_of_bounds(bounds, n_span):
  s, f, g, e = (b[:, None] for b in bounds)
  t = np.arange(n_span)[None, :]
  return np.where((t >= f) & (t < g), FULL, np.where((t >= s) & (t < e), PARTIAL, EMPTY))


@given(widened_cases())
def test_widened_bounds_give_the_dense_tiles(case):
  """Where `widened_bounds` gives bounds, along rows and along columns, they are the tiles
  of the dense `band | equal reads` on every line of every batch row, bands that hold the
  diagonal or not, reads shifted or not."""
  band, equal, n, q_len, offset, bq, bk, ops = case
  equal_runs, geo = _equal_runs(equal, n, q_len, offset, bq, bk, ops)
  # sorted ids and image runs are one run per value: None only where binding folded the
  # reads away (an image over every token)
  assume(equal_runs is not None)
  expected = _dense_tiles(f"({band}) | ({equal})", n, q_len, offset, bq, bk, ops)
  intervals = Intervals.of(maskc.parse(band))
  assume(intervals is not None)  # a band inside chunks that misses the diagonal
  for along_rows in (True, False):
    bounds = widen(equal_runs, intervals, along_rows)
    want = expected if along_rows else np.swapaxes(expected, -1, -2)
    if bounds is None:
      continue
    assert np.all((bounds[0] <= bounds[1]) & (bounds[1] <= bounds[2]) &
                  (bounds[2] <= bounds[3]))
    got = _grid_of_bounds(bounds, want.shape[-1])  # operands batched as the mask is
    np.testing.assert_array_equal(got.reshape(want.shape), want)


def _two_intervals(dense):
  """Whether some row of a dense mask `[..., q, k]` is true on two separate intervals."""
  rises = np.diff(dense.astype(np.int8), axis=-1, prepend=0) == 1
  return bool(np.any(rises.sum(-1) > 1))


def test_intervals_are_found_and_nothing_else():
  """Bands, and bands inside chunks that hold the diagonal; not a chunk beside a band that
  misses it (a row's interval can be empty), two chunks, or other masks."""
  found = {t: Intervals.of(maskc.parse(t)) for t in [
      "causal", "sliding(8)", "causal & chunk(4)", "chunk(4)", "local(2, 3) & chunk(5)",
      "q - k >= 1 & chunk(4)", "k - q >= 1 & chunk(4)", "chunk(4) & chunk(6)",
      "causal & (q // 4 == k // 8)", "q // 4 != k // 4", "causal | chunk(4)"]}
  assert {t: x and (x.lo, x.hi, x.chunk) for t, x in found.items()} == {
      "causal": (0, None, None), "sliding(8)": (0, 7, None), "causal & chunk(4)": (0, None, 4),
      "chunk(4)": (None, None, 4), "local(2, 3) & chunk(5)": (-3, 2, 5),
      "q - k >= 1 & chunk(4)": None, "k - q >= 1 & chunk(4)": None,
      "chunk(4) & chunk(6)": None, "causal & (q // 4 == k // 8)": None,
      "q // 4 != k // 4": None, "causal | chunk(4)": None}


@pytest.mark.parametrize("band", ["causal", "sliding(4)", "local(3, 5)", "q - k >= 0",
                                  "causal & chunk(10)", "chunk(16)"])
@pytest.mark.parametrize("equal", ["bidirectional(img)", "document(seg)"])
def test_blocks_holding_the_diagonal_always_widen(band, equal):
  """A band that holds the diagonal and blocks that hold it too (`bidirectional(img)`,
  `document(seg)`: a token reads its own run) always join into one interval per row and
  per column, at any offset: the closed form is taken, not skipped."""
  n = 97
  img = (np.arange(n) % 23 > 9) | (np.arange(n) < 3)
  seg = np.repeat(np.arange(n), 7)[:n]
  ops = {"img": img} if "img" in equal else {"seg": seg}
  for q_len, offset, bq, bk in [(97, 0, 8, 8), (40, 57, 16, 4), (13, 30, 1, 16)]:
    equal_runs, _ = _equal_runs(equal, n, q_len, offset, bq, bk, ops)
    for along_rows in (True, False):
      assert widen(equal_runs, Intervals.of(maskc.parse(band)), along_rows) is not None


def test_a_block_apart_from_the_band_is_not_widened():
  """`q - k >= 20 | document(seg)` with documents of 5 tokens: a row's document lies to the
  right of its band interval, so its union is two intervals, and no bounds are given."""
  n = 60
  seg = np.repeat(np.arange(12), 5)
  equal_runs, _ = _equal_runs("document(seg)", n, n, 0, 4, 4, {"seg": seg})
  assert widen(equal_runs, Intervals(20, None), True) is None
  dense = np.asarray(maskc.materialize("q - k >= 20 | document(seg)", n, operands={"seg": seg}))
  assert _two_intervals(dense)


@given(widened_cases(), st.booleans(), st.booleans())
def test_an_or_and_an_and_with_a_widened_band_are_exact(case, inside, exact):
  """`band | equal reads`, and `document(seg) & (band | equal reads)` (the band widened and
  the documents clipped to it), lower to the dense mask's tiles along rows and columns:
  exactly for prelude masks and with `exact=True`, soundly (FULL and EMPTY right) for
  explicit comparisons without."""
  band, equal, n, q_len, offset, bq, bk, ops = case
  text = f"({band}) | ({equal})"
  if inside:
    text = f"document(doc) & ({text})"
    rng = np.random.default_rng(n)
    lead = next(iter(ops.values())).shape[:-1]
    ops = dict(ops, doc=np.sort(rng.integers(0, 6, lead + (n + PAD,)), axis=-1))
  _lower._CACHE.clear()
  bm = maskc.compile(text, q_len, n, q_offset=offset, block_q=bq, block_kv=bk, operands=ops,
                     exact=exact)
  expected = _dense_tiles(text, n, q_len, offset, bq, bk, ops)
  cols = np.asarray(grid_from_runs(np, bm.cols, expected.shape[-2]))[:, 0]
  for got in (np.asarray(bm.grid).reshape(expected.shape),
              np.swapaxes(cols, -1, -2).reshape(expected.shape)):
    if exact or not any(op in text for op in "=<>"):  # prelude masks alone: exact
      np.testing.assert_array_equal(got, expected)
    else:
      decided = got != PARTIAL
      np.testing.assert_array_equal(got[decided], expected[decided])


@pytest.mark.parametrize("text", ["causal | bidirectional(img)",
                                  "causal & chunk(256) | bidirectional(img)",
                                  "sliding(50) | bidirectional(img) | g[k]",
                                  "document(seg) & (causal | bidirectional(img))"])
def test_the_widened_band_is_taken(text, monkeypatch):
  """These masks are lowered through the widened band, along rows and columns, with no
  tile analysed (but one period of the chunks, which is then not used), and give the
  dense tiles. The rule says which path ran; that no tile was analysed, the patch."""
  def no_analysis(*args, **kwargs):
    raise AssertionError("a tile analysed")

  if "chunk" not in text:
    for module in (_range_analysis, _combined):  # its callers
      monkeypatch.setattr(module, "decide_tiles", no_analysis)
  n = 2000
  img = np.zeros(n, bool)
  for a, z in [(100, 300), (640, 641), (1000, 1500), (1900, 2000)]:
    img[a:z] = True
  ops = {"img": img, "seg": np.repeat(np.arange(20), 100),
         "g": np.isin(np.arange(n), [5, 700, 1999])}
  ops = {k: v for k, v in ops.items() if k + ")" in text or k + "[" in text}
  _lower._CACHE.clear()
  with taken() as fired:
    bm = maskc.compile(text, n, block_q=64, block_kv=64, operands=ops)
    cols = bm.cols
  assert "widened_band" in fired, fired
  expected = _dense_tiles(text, n, n, 0, 64, 64, ops)
  np.testing.assert_array_equal(np.asarray(bm.grid).reshape(expected.shape), expected)
  cols = np.asarray(grid_from_runs(np, cols, expected.shape[-2]))[:, 0]
  np.testing.assert_array_equal(np.swapaxes(cols, -1, -2).reshape(expected.shape), expected)


@st.composite
def traced_cases(draw):
  """`intervals | bidirectional(img)` under `jit`: the bands and chunks above, query
  rows at an offset into longer keys or not, one to five image spans that may cross the
  rows' first and last positions or lie beyond them, batched or not."""
  n = draw(st.integers(8, 160))
  q_len = draw(st.integers(1, n))
  offset = draw(st.integers(0, n - q_len))
  batch = draw(st.sampled_from([None, 2]))
  rng = np.random.default_rng(draw(st.integers(0, 2**31)))
  imgs = []
  for _ in range(batch or 1):
    img = np.zeros(n, bool)
    for start in rng.integers(0, n, draw(st.integers(1, 5))):
      img[start:start + rng.integers(1, 60)] = True
    imgs.append(img)
  band = draw(band_texts())
  return (f"({band}) | bidirectional(img)", n, q_len, offset, draw(st.sampled_from([1, 4, 8, 16])),
          draw(st.sampled_from([1, 4, 8, 16])), {"img": np.stack(imgs) if batch else imgs[0]})


# Each example compiles a jitted lowering: the default run draws a share, `-m slow` all.
@pytest.mark.parametrize("part", PARTS)
def test_the_traced_widened_band_is_the_dense_mask(part):
  """Under `jit` (`maskc.lowering.closed_forms.widened_band`, traced), `intervals |
  bidirectional(img)` lowers to the dense mask's tiles, rows and columns, as the static path
  does; bands that miss the diagonal take the analysis instead, and give the same."""
  settings(max_examples=count(25, part), deadline=None)(given(traced_cases())(
      _check_traced_widened_band))()


def _check_traced_widened_band(case):
  text, n, q_len, offset, bq, bk, ops = case

  def lower(o):
    bm = maskc.compile(text, q_len, n, q_offset=offset, block_q=bq, block_kv=bk, operands=o)
    return bm.grid, bm.cols

  grid, cols = jax.jit(lower)(ops)
  expected = _dense_tiles(text, n, q_len, offset, bq, bk, ops)
  cols = np.asarray(grid_from_runs(np, jax.tree.map(np.asarray, cols), expected.shape[-2]))[:, 0]
  exact = not any(op in text for op in "=<>")
  for got in (np.asarray(grid).reshape(expected.shape),
              np.swapaxes(cols, -1, -2).reshape(expected.shape)):
    if exact:
      np.testing.assert_array_equal(got, expected)
    else:
      decided = got != PARTIAL
      np.testing.assert_array_equal(got[decided], expected[decided])


def test_the_traced_widened_band_is_taken(monkeypatch):
  """`causal & chunk(64) | bidirectional(img)` under `jit` is lowered from its lines'
  reductions (`widened_bounds_traced`), rows and columns, with no analysis of the grid,
  exactly. The rule says which path ran (the traced widened band gives rows and columns
  together); that nothing was analysed, the patch."""
  monkeypatch.setattr(_lower_dynamic, "Analyzer", None)  # any analysis fails
  n = 1000
  img = np.zeros((2, n), bool)
  img[0, 100:300] = img[0, 640:641] = img[1, 0:130] = img[1, 900:1000] = True
  text = "causal & chunk(64) | bidirectional(img)"
  def lower(o):
    bm = maskc.compile(text, n, block_q=32, block_kv=16, operands=o)
    return bm.grid, bm.cols

  with taken() as fired:
    grid, cols = jax.jit(lower)({"img": img})
  # `row_intervals` (the key intervals every compile proves) lowers no tiles.
  assert fired - {"row_intervals"} == {"widened_band"}, fired
  expected = _dense_tiles(text, n, n, 0, 32, 16, {"img": img})
  np.testing.assert_array_equal(np.asarray(grid).reshape(expected.shape), expected)
  cols = np.asarray(grid_from_runs(np, jax.tree.map(np.asarray, cols), expected.shape[-2]))[:, 0]
  np.testing.assert_array_equal(np.swapaxes(cols, -1, -2).reshape(expected.shape), expected)


def test_a_chunk_beside_something_that_is_no_band_is_not_widened():
  # `Intervals.of` unpacked `exact_band` of the chunk's other conjuncts, which is None for
  # `causal & k < 30`: the traced lowering raised a TypeError.
  img = np.zeros(32, bool)
  img[5:12] = True
  text = "causal & chunk(8) & k < 30 | bidirectional(img)"
  assert Intervals.of(maskc.parse("causal & chunk(8) & k < 30")) is None
  dense = np.asarray(maskc.materialize(text, 32, operands={"img": img}))
  static = maskc.compile(text, 32, block_q=4, block_kv=4, operands={"img": img})
  traced = jax.jit(lambda img: maskc.compile(text, 32, block_q=4, block_kv=4,
                                             operands={"img": img}).grid)(img)
  assert_exact(np.asarray(static.grid), dense, 4, 4)
  np.testing.assert_array_equal(np.asarray(traced), np.asarray(static.grid))
