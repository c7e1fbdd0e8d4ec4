"""The lowering's correctness on run-structured operands, mostly by its static path
(`maskc.lowering.static`): exactness and soundness, traced == static, the memory budget,
extreme magnitudes, parts lowered apart and along one axis, the operands' tile cover, and
the static path's pieces (median cuts, meeting pieces, splits, sampled pairs, strips); every
tile checked against a dense NumPy reference written here. The operands' run form has its
own tests in test_operand_runs.py."""

import itertools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import maskc
from helpers import (
  EMPTY,
  FULL,
  assert_maximal_runs,
  assert_sound,
  runs_reference,
  tile_states,
  tile_truth,
)
from maskc.compiled.tiles import grid_from_runs
from maskc.lowering.rules import disabled, taken
from sampling import PARTS, count

PRELUDE_WITH_OPERANDS = [
    "document(seg)", "bidirectional(img)", "causal & document(seg)",
    "causal & chunk(8) | bidirectional(img)", "document(seg) & (causal | bidirectional(img))",
    "sliding(5) | bidirectional(img)", "~bidirectional(img) & causal",
]


def _dense(text, q_len, kv_len, q_offset, ops):
  """The mask by NumPy broadcasting, independent of maskc's evaluator."""
  q = np.arange(q_len)[:, None] + q_offset
  k = np.arange(kv_len)[None, :]
  seg, img = ops.get("seg"), ops.get("img")
  lead = (slice(None),) if (seg is not None and seg.ndim == 2) or (
      img is not None and img.ndim == 2) else ()

  def at(a, i):
    return a[(Ellipsis, i)] if a.ndim == 1 else a[:, i]

  causal = k <= q
  env = {"causal": causal}
  if seg is not None:
    env["document(seg)"] = at(seg, q) == at(seg, k)
  if img is not None:
    runs = runs_reference(img)
    env["bidirectional(img)"] = (at(runs, q) == at(runs, k)) & at(img, q)
  table = {
      "document(seg)": lambda: env["document(seg)"],
      "bidirectional(img)": lambda: env["bidirectional(img)"],
      "causal & document(seg)": lambda: causal & env["document(seg)"],
      "causal & chunk(8) | bidirectional(img)":
          lambda: (causal & (q // 8 == k // 8)) | env["bidirectional(img)"],
      "document(seg) & (causal | bidirectional(img))":
          lambda: env["document(seg)"] & (causal | env["bidirectional(img)"]),
      "sliding(5) | bidirectional(img)":
          lambda: ((q - 5 < k) & (k <= q)) | env["bidirectional(img)"],
      "~bidirectional(img) & causal": lambda: ~env["bidirectional(img)"] & causal,
  }
  del lead
  return np.asarray(table[text]())


@st.composite
def run_operands(draw):
  """Run-structured operands: many short runs, one long run, runs on tile edges, unsorted."""
  n = draw(st.integers(8, 120))
  batch = draw(st.sampled_from([None, 2]))
  kind = draw(st.sampled_from(["short", "long", "edges", "unsorted"]))
  rng = np.random.default_rng(draw(st.integers(0, 2**31)))
  bq = draw(st.sampled_from([4, 8, 16]))
  rows = []
  for _ in range(batch or 1):
    if kind == "short":
      lengths = rng.integers(1, 5, n)
    elif kind == "long":
      lengths = np.array([rng.integers(0, n // 3 + 1), n, n])
    elif kind == "edges":
      lengths = np.full(n, bq * int(rng.integers(1, 3)))
    else:
      lengths = rng.integers(1, 12, n)
    ids = np.repeat(np.arange(lengths.size), lengths)[:n]
    ids = np.pad(ids, (0, n - ids.size), mode="edge")
    if kind == "unsorted":
      ids = rng.permutation(ids.max() + 1)[ids]
    rows.append(ids)
  seg = np.stack(rows) if batch else rows[0]
  img = (seg % 2 == 1) if kind != "unsorted" else (rng.random(seg.shape) < 0.5)
  text = draw(st.sampled_from(PRELUDE_WITH_OPERANDS))
  bk = draw(st.sampled_from([4, 8, 16]))
  q_len = draw(st.integers(1, n))
  offset = draw(st.integers(0, n - q_len))
  return text, n, q_len, offset, bq, bk, {"seg": seg, "img": img}


def _ops_for(text, ops):
  return {k: v for k, v in ops.items() if k in text}


@given(run_operands())
def test_exact_and_sound_on_run_structured_operands(case):
  text, n, q_len, offset, bq, bk, ops = case
  ops = _ops_for(text, ops)
  bm = maskc.compile(text, q_len, n, q_offset=offset, block_q=bq, block_kv=bk, operands=ops)
  expected = tile_states(_dense(text, q_len, n, offset, ops), bq, bk)
  np.testing.assert_array_equal(np.asarray(bm.grid).reshape(expected.shape), expected)
  # the backward runs (per key tile) describe the same tiles
  cols = np.asarray(grid_from_runs(np, bm.cols, expected.shape[-2]))[:, 0]
  np.testing.assert_array_equal(np.swapaxes(cols, -1, -2).reshape(expected.shape), expected)


# Each example jits a compile: the default run draws a share, `-m slow` all (sampling.py).
@pytest.mark.parametrize("part", PARTS)
def test_traced_equals_static_on_run_structured_operands(part):
  settings(max_examples=count(8, part), deadline=None)(given(run_operands())(
      _check_traced_equals_static))()


@pytest.mark.parametrize("part", PARTS)
def test_traced_pieces_in_many_small_rounds_equal_static(part):
  """The traced path cuts only a round's tiles' lines into pieces: rounds of 3 tiles (many
  rounds, lines cut again in each) give the static path's tiles."""
  def check(case):
    with mock.patch("maskc.lowering.traced.PIECE_ROUND", 3):
      _check_traced_equals_static(case)
  settings(max_examples=count(8, part), deadline=None)(given(run_operands())(check))()


def _check_traced_equals_static(case):
  """The grid compiled under `jit` (operands traced) equals the static compile's."""
  text, n, q_len, offset, bq, bk, ops = case
  ops = _ops_for(text, ops)
  static = maskc.compile(text, q_len, n, q_offset=offset, block_q=bq, block_kv=bk, operands=ops)
  traced = jax.jit(lambda o: maskc.compile(text, q_len, n, q_offset=offset, block_q=bq,
                                           block_kv=bk, operands=o).grid)(ops)
  np.testing.assert_array_equal(np.asarray(traced), np.asarray(static.grid))


def test_bidirectional_is_decided_by_analysis_without_evaluation(monkeypatch):
  from maskc.lowering import compile as _lower
  from maskc.lowering.generic import range_analysis as _range_analysis

  def no_evaluation(*args, **kwargs):
    raise AssertionError("a tile was evaluated")

  monkeypatch.setattr(_range_analysis, "evaluate_tiles", no_evaluation)
  img = np.zeros(4096, bool)
  for start, length in [(5, 300), (700, 129), (1024, 128), (2000, 1000), (3500, 7)]:
    img[start:start + length] = True
  seg = np.repeat(np.arange(8), 512)
  for text in ["causal & chunk(512) | bidirectional(img)", "document(seg) & bidirectional(img)",
               "causal & document(seg)"]:
    ops = _ops_for(text, {"seg": seg, "img": img})
    _lower._CACHE.clear()
    bm = maskc.compile(text, 4096, block_q=64, block_kv=64, operands=ops)
    dense = np.asarray(maskc.materialize(text, 4096, operands=ops))
    np.testing.assert_array_equal(bm.grid, tile_states(dense, 64, 64))


def test_a_tiny_memory_budget_raises_instead_of_allocating():
  seg = np.repeat(np.arange(64), 1024)
  with pytest.raises(maskc.MaskError, match="memory budget"):
    maskc.compile("causal & document(seg)", seg.size, operands={"seg": seg}, memory_budget=4096)
  with pytest.raises(maskc.MaskError, match="memory budget"):
    jax.jit(lambda s: maskc.compile("causal & document(seg)", s.size, operands={"seg": s},
                                    memory_budget=4096).grid)(jnp.asarray(seg))


def test_traced_refinement_keeps_tile_zero():
  # Issue 14 item 4/7: padding entries of a refinement round overwrote flat tile 0.
  rng = np.random.default_rng(3)
  img = rng.random(101) < 0.5
  seg = np.sort(rng.integers(0, 4, 101))
  text = "bidirectional(img) & (sink(114) | local(12, 59)) & document(seg)"
  ops = {"img": img, "seg": seg}
  static = maskc.compile(text, 17, 101, q_offset=72, block_q=60, block_kv=50, operands=ops)
  traced = jax.jit(lambda o: maskc.compile(text, 17, 101, q_offset=72, block_q=60, block_kv=50,
                                           operands=o).grid)(ops)
  np.testing.assert_array_equal(np.asarray(traced), static.grid)


@pytest.mark.parametrize("ids", [[2**63 - 1, 0, -2**63, 5], [-2**63, -2**63, 2**63 - 1, 0]])
@pytest.mark.parametrize("text", ["document(seg)", "seg[q] == seg[k]", "seg[q] < seg[k]",
                                  "seg[q] != seg[k] | causal"])
def test_extreme_int64_ids_are_never_unsound(text, ids):
  seg = np.array(ids, np.int64)
  s = [int(v) for v in ids]  # exact Python integers
  ref = {"document(seg)": lambda a, b: a == b, "seg[q] == seg[k]": lambda a, b: a == b,
         "seg[q] < seg[k]": lambda a, b: a < b,
         "seg[q] != seg[k] | causal": lambda a, b: a != b}[text]
  dense = np.array([[ref(s[i], s[j]) or ("causal" in text and j <= i) for j in range(4)]
                    for i in range(4)])
  for bq, bk in [(1, 1), (2, 2), (4, 4), (2, 3)]:
    bm = maskc.compile(text, 4, block_q=bq, block_kv=bk, operands={"seg": seg})
    assert_sound(bm.grid, dense, bq, bk)


def test_extreme_traced_int32_ids_and_offsets_are_never_unsound():
  seg = np.array([2**31 - 1, 0, -2**31, 5], np.int32)
  dense = seg[:, None].astype(np.int64) == seg[None, :].astype(np.int64)
  grid = jax.jit(lambda s: maskc.compile("document(seg)", 4, block_q=2, block_kv=2,
                                         operands={"seg": s}).grid)(seg)
  assert_sound(grid, dense, 2, 2)
  # q - k < 4 at q_offset = 2**31 - 8: exact q is never below k + 4 (q >= 2**31 - 8 > 15 + 4)
  offset = 2**31 - 8
  grid = jax.jit(lambda o: maskc.compile("q - k < 4", 16, block_q=4, block_kv=4,
                                         q_offset=o).grid)(jnp.int32(offset))
  q = np.arange(16, dtype=object)[:, None] + offset
  k = np.arange(16, dtype=object)[None, :]
  assert_sound(grid, np.asarray(q - k < 4, bool), 4, 4)


@settings(max_examples=30)
@given(st.sampled_from([2**37, 2**40, 2**62 - 64, 2**63 - 64]),
       st.sampled_from(["q * 1099511627776 > k", "2 * q > k", "q - k < 5", "q + 1000 > k",
                        "abs(q - k) < 3", "q % 7 == k % 7", "q // 3 > k", "-q < k"]))
def test_extreme_offsets_are_never_unsound(offset, text):
  q_len = 16
  q = np.arange(q_len, dtype=object)[:, None] + offset
  k = np.arange(16, dtype=object)[None, :]
  exact = {"q * 1099511627776 > k": q * 1099511627776 > k, "2 * q > k": 2 * q > k,
           "q - k < 5": q - k < 5, "q + 1000 > k": q + 1000 > k,
           "abs(q - k) < 3": abs(q - k) < 3, "q % 7 == k % 7": q % 7 == k % 7,
           "q // 3 > k": q // 3 > k, "-q < k": -q < k}[text]
  try:
    bm = maskc.compile(text, q_len, 16, q_offset=offset, block_q=4, block_kv=4)
  except maskc.MaskValueError:
    return  # refusing is allowed; a wrong map is not
  assert_sound(bm.grid, np.asarray(exact, bool), 4, 4)


def test_check_reads_needs_no_per_token_arrays():
  import tracemalloc
  tracemalloc.start()
  bm = maskc.compile("causal", 2**28, block_q=2**22, block_kv=2**22)
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  assert bm.grid.shape == (64, 64)
  assert peak < 64 << 20  # a per-token int64 array alone would be 2 GiB
  with pytest.raises(maskc.OperandError, match="length"):
    maskc.compile("seg[q + 10] == seg[k]", 64, operands={"seg": np.zeros(64, np.int64)})


@settings(max_examples=25, deadline=None)
@given(run_operands(), st.sampled_from(["img[q + 1] & img[k + 2]", "seg[q + 2] == seg[k + 1]",
                                        "seg[q] == seg[k + 3] & k <= q + 5",
                                        "img[q + 1] | img[k + 3] & causal"]))
def test_shifted_reads_are_exact_with_cuts_at_their_changes(case, text):
  """Splits go to where a shifted read changes; `exact=True` maps equal the dense tiles."""
  _, n, q_len, offset, bq, bk, ops = case
  # operands 3 tokens longer than the keys, so that every shifted read stays inside
  ops = {name: np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, 3)], mode="edge")
         for name, a in _ops_for(text, ops).items()}
  q = np.arange(q_len)[:, None] + offset
  k = np.arange(n)[None, :]
  seg, img = ops.get("seg"), ops.get("img")

  def at(a, i):
    return a[..., i] if a.ndim == 1 else a[:, i]

  bm = maskc.compile(text, q_len, n, q_offset=offset, block_q=bq, block_kv=bk, operands=ops,
                     exact=True)
  dense = {"img[q + 1] & img[k + 2]": lambda: at(img, q + 1) & at(img, k + 2),
           "seg[q + 2] == seg[k + 1]": lambda: at(seg, q + 2) == at(seg, k + 1),
           "seg[q] == seg[k + 3] & k <= q + 5": lambda: (at(seg, q) == at(seg, k + 3)) & (
               k <= q + 5),
           "img[q + 1] | img[k + 3] & causal": lambda: at(img, q + 1) | (at(img, k + 3) & (
               k <= q))}[text]()
  expected = tile_states(np.asarray(dense), bq, bk)
  np.testing.assert_array_equal(np.asarray(bm.grid).reshape(expected.shape), expected)


@pytest.mark.parametrize("text", ["causal & document(seg)", "document(seg)",
                                  "causal & chunk(8) | bidirectional(img)"])
def test_many_short_runs_looked_up_by_token_index_are_exact(text):
  """Thousands of 1-12-token documents (and image spans), with the per-token run index
  forced on: the map equals the dense mask, forward and backward."""
  from maskc.lowering import compile as _lower
  from maskc.semantics import operand_runs as _operand_runs
  rng = np.random.default_rng(7)
  n = 3000
  seg = np.repeat(np.arange(n), rng.integers(1, 13, n))[:n]
  ops = _ops_for(text, {"seg": seg, "img": seg % 2 == 1})
  in_cache, _operand_runs.SEARCH_IN_CACHE = _operand_runs.SEARCH_IN_CACHE, 0
  _lower._CACHE.clear()
  try:
    bm = maskc.compile(text, n, block_q=16, block_kv=32, operands=ops)
    cols = bm.cols
  finally:
    _operand_runs.SEARCH_IN_CACHE = in_cache
    _lower._CACHE.clear()
  expected = tile_states(_dense(text, n, n, 0, ops), 16, 32)
  np.testing.assert_array_equal(np.asarray(bm.grid), expected)
  back = np.asarray(grid_from_runs(np, cols, expected.shape[0]))[0, 0]
  np.testing.assert_array_equal(back.T, expected)


SAME_RUN_MASKS = [
    "runs(x)[q] == runs(x)[k] & x[q]", "runs(x)[q] == runs(x)[k] & x[k]",
    "x[q + 1] & runs(x)[k] == runs(x)[q + 1]", "runs(x)[q] == runs(x)[k] & x[q] & k <= q",
    "~(runs(x)[q] == runs(x)[k] & x[q]) & causal", "runs(x)[q] == runs(x)[k] & y[q]",
    "runs(x)[q] == runs(x)[k] & runs(x)[q] > 0", "runs(x)[q] == runs(y)[k] & x[q]",
]


@settings(deadline=None)
@given(st.sampled_from(SAME_RUN_MASKS), st.integers(8, 90), st.integers(0, 2**31),
       st.sampled_from([4, 8, 16]), st.sampled_from([None, 2]))
def test_same_run_equalities_stay_exact(text, n, seed, block, batch):
  """`runs(x)[a] == runs(x)[b]` beside `x[a]` is analysed by the ids of x's runs of zeros and
  nonzeros (and left alone without the `x[a]` beside it): on operands of several nonzero
  values and zero gaps, every tile equals the dense mask's, forward and backward."""
  from maskc.lowering import compile as _lower
  rng = np.random.default_rng(seed)
  shape = (batch, n + 1) if batch else (n + 1,)
  x = rng.choice([0, 0, 1, 2, 5], shape) * (rng.random(shape) < 0.8)
  x = np.repeat(x, rng.integers(1, 6, x.shape[-1]), axis=-1)[..., :n + 1]  # runs of values
  y = np.roll(x, 3, axis=-1) != 0
  ops = {k: v for k, v in {"x": x, "y": y}.items() if f"{k}[" in text or f"({k})" in text}
  _lower._CACHE.clear()
  bm = maskc.compile(text, n, block_q=block, block_kv=block, operands=ops, exact=True)
  dense = np.asarray(maskc.materialize(text, n, operands=ops)).reshape((-1, n, n))
  # the dense reference written here: runs(x) by a plain loop
  runs_x = runs_reference(x != 0).reshape((-1, n + 1))
  q, k = np.arange(n)[:, None], np.arange(n)[None, :]
  if text == SAME_RUN_MASKS[0]:
    np.testing.assert_array_equal(dense, (runs_x[:, q] == runs_x[:, k]) & (x.reshape(
        (-1, n + 1))[:, q] != 0))
  expected = tile_states(dense, block, block)
  np.testing.assert_array_equal(np.asarray(bm.grid).reshape(expected.shape), expected)
  cols = np.asarray(grid_from_runs(np, bm.cols, expected.shape[-2]))[:, 0]
  np.testing.assert_array_equal(np.swapaxes(cols, -1, -2).reshape(expected.shape), expected)


def test_same_run_ids_decide_rectangles_over_several_runs():
  """Off the diagonal, a rectangle over several image spans and the gaps between them is
  EMPTY by `bidirectional(img)`; the plain analysis of `runs(img)` (0 at every gap token on
  both sides) can only say PARTIAL, the static path's same-run ids decide it."""
  from maskc.lowering import compile as _lower
  from maskc.semantics.ranges import EMPTY as A_EMPTY, PARTIAL as A_PARTIAL, Analyzer, Tables
  img = np.zeros(64, bool)
  for s in (2, 12, 34, 50):
    img[s:s + 6] = True
  bound = _lower.bind_masks("bidirectional(img)", 64, operands={"img": img})
  m, arrays = bound.masks[0], bound.operands
  rect = [np.array([v]) for v in (0, 25, 34, 63)]  # q over spans 1-2, k over spans 3-4
  plain = Analyzer(np, Tables(np, arrays), *rect).truth(m)
  sharp = Analyzer(np, Tables(np, arrays, forms=bound.forms, same_runs=True), *rect).truth(m)
  assert int(np.asarray(plain.state).reshape(-1)[0]) == A_PARTIAL
  assert int(np.asarray(sharp.state).reshape(-1)[0]) == A_EMPTY
  dense = np.asarray(maskc.materialize("bidirectional(img)", 64, operands={"img": img}))
  assert not dense[0:26, 34:64].any()


@given(st.integers(1, 3), st.integers(1, 40), st.data())
def test_median_operand_change_by_counts_equals_binary_search(nb, n, data):
  """Rectangles are cut at the median operand change inside them: found from cumulative
  marks (`Hints`), the same cut and count as binary searches over the sorted changes."""
  from maskc.lowering.generic.range_analysis import Hints, _median_hint
  size = nb * (n + 1)
  bounds = np.array(data.draw(st.lists(st.integers(0, size - 1), max_size=60)), np.int64)
  hints = Hints.of(bounds, size)
  at = np.unique(bounds)
  np.testing.assert_array_equal(hints.at, at)
  b = np.array(data.draw(st.lists(st.integers(0, nb - 1), min_size=1, max_size=20)))
  lo = np.array([data.draw(st.integers(0, n - 1)) for _ in b])
  hi = np.array([data.draw(st.integers(int(x) + 1, n)) for x in lo])
  cut, count = _median_hint(hints, b, lo, hi, n)
  base = b * (n + 1)
  first = np.searchsorted(at, base + lo, side="right")  # changes strictly inside (lo, hi)
  last = np.searchsorted(at, base + hi, side="left")
  np.testing.assert_array_equal(count, last - first)
  inside = last > first
  expected = at[np.clip((first + last) // 2, 0, max(at.size - 1, 0))] - base if at.size else hi
  np.testing.assert_array_equal(cut, np.where(inside, expected, hi))
  assert np.all((cut[inside] > lo[inside]) & (cut[inside] < hi[inside]))


@st.composite
def flat_run_list(draw, size: int = 60):
  """A sorted flat run list `(start, stop, state)` over keys `[0, size)`: disjoint runs."""
  cuts = sorted(set(draw(st.lists(st.integers(0, size), max_size=16))))
  runs = [(a, z) for a, z in itertools.pairwise(cuts) if draw(st.booleans())]
  states = [draw(st.sampled_from([1, 2])) for _ in runs]  # PARTIAL, FULL
  return (np.array([a for a, _ in runs], np.int64), np.array([z for _, z in runs], np.int64),
          np.array(states, np.int8))


@given(flat_run_list(), flat_run_list())
def test_meeting_pieces_are_the_keys_in_both_lists(x, y):
  """`&` of run lists: the pieces found by binary searches are disjoint, in order, and
  cover exactly the keys inside a run of both lists, each with both lists' states."""
  from maskc.lowering.generic.combination import _meeting_pieces

  def states(lst, size=60):
    out = np.zeros(size, np.int8)
    for a, z, s in zip(*lst):
      out[a:z] = s
    return out

  lo, hi, sx, sy = _meeting_pieces(x, y)
  assert np.all(lo < hi) and np.all(hi[:-1] <= lo[1:])
  got_x, got_y = np.zeros(60, np.int8), np.zeros(60, np.int8)
  for a, z, u, v in zip(lo, hi, sx, sy):
    got_x[a:z], got_y[a:z] = u, v
  both = (states(x) > 0) & (states(y) > 0)
  np.testing.assert_array_equal(got_x, np.where(both, states(x), 0))
  np.testing.assert_array_equal(got_y, np.where(both, states(y), 0))


@given(st.lists(st.tuples(st.integers(1, 70), st.integers(1, 70)), min_size=1, max_size=40),
       st.booleans(), st.data())
def test_split_children_tile_their_rectangle(sides, few, data):
  """A rectangle's children (halves, 4 x 4 parts in a round of few, cuts at a hint) are
  non-empty and cover it exactly once."""
  from maskc.lowering.generic.range_analysis import NO_HINTS, Hints, _split
  nq = nk = 70
  i0 = np.array([data.draw(st.integers(0, nq - h)) for h, _ in sides], np.int64)
  j0 = np.array([data.draw(st.integers(0, nk - w)) for _, w in sides], np.int64)
  i1 = i0 + np.array([h for h, _ in sides])
  j1 = j0 + np.array([w for _, w in sides])
  b = np.arange(len(sides), dtype=np.int64)  # a batch row each: children tell their parent
  size = b.size * (nq + 1)
  q_hints = Hints.of(np.array(data.draw(st.lists(st.integers(0, size - 1), max_size=9)),
                               np.int64), size)
  with mock.patch("maskc.lowering.generic.range_analysis.FEW_RECTS", len(sides) if few else 0):
    cb, ci0, ci1, cj0, cj1 = _split((b, i0, i1, j0, j1), (q_hints, NO_HINTS), nq, nk)
  assert np.all((ci1 > ci0) & (cj1 > cj0))
  for r in range(len(sides)):
    cover = np.zeros((nq, nk), np.int64)
    for u in np.flatnonzero(cb == r):
      cover[ci0[u]:ci1[u], cj0[u]:cj1[u]] += 1
    expected = np.zeros((nq, nk), np.int64)
    expected[i0[r]:i1[r], j0[r]:j1[r]] = 1
    np.testing.assert_array_equal(cover, expected)


@settings(max_examples=40, deadline=None)
@given(run_operands(), st.sampled_from(["causal & document(seg)", "sliding(5) & document(seg)",
                                        "causal & chunk(8) | bidirectional(img)",
                                        "causal | img[q] & seg[q] == seg[k]"]))
def test_a_sampled_pair_proves_a_tile_holds_that_value(case, text):
  """`sampled_mixed` reads every operand through its runs: a tile it proves holds a true
  pair (of an `&`; a false one of an `|`) in the dense reference."""
  from maskc.language import ir as _ir
  from maskc.lowering import compile as _lower
  from maskc.lowering.generic.sampling import sampled_mixed
  from maskc.lowering.grid.geometry import TileGeometry
  from maskc.lowering.grid.refine import Budget
  from maskc.semantics.ranges import Tables
  _, n, q_len, offset, bq, bk, ops = case
  ops = _ops_for(text, ops)
  bound = _lower.bind_masks(text, q_len, n, q_offset=offset, operands=ops)
  m, geo = bound.masks[0], TileGeometry(bound.shape, bq, bk)
  tables = Tables(np, bound.operands, bound.forms, same_runs=True)
  nb = bound.batch or 1
  b, i, j = (x.reshape(-1) for x in np.meshgrid(np.arange(nb), np.arange(geo.nq),
                                                 np.arange(geo.nk), indexing="ij"))
  union = isinstance(m, _ir.Or)
  with mock.patch("maskc.lowering.generic.sampling.SAMPLE_CHUNK", 7):  # several chunks
    proved = sampled_mixed(m, geo, tables, b if bound.batch else 0, i, j, union,
                            Budget(1 << 20))
  assert not any(bound.operands.written(x) for x in bound.operands), "operands written out"
  dense = np.asarray(maskc.materialize(text, q_len, n, q_offset=offset, operands=ops),
                     bool).reshape(nb, q_len, n)
  for t in np.flatnonzero(proved):
    tile = dense[b[t], i[t] * bq:(i[t] + 1) * bq, j[t] * bk:(j[t] + 1) * bk]
    assert (~tile).any() if union else tile.any(), (text, b[t], i[t], j[t])


def test_cache_keys_follow_operand_values_not_identity():
  """Equal operands share a cached map; a one-token change does not."""
  seg = np.repeat(np.arange(8), 40).astype(np.int32)
  a = maskc.compile("causal & document(seg)", 320, block_q=32, block_kv=32, operands={"seg": seg})
  b = maskc.compile("causal & document(seg)", 320, block_q=32, block_kv=32,
                    operands={"seg": seg.copy()})
  assert a is b
  seg2 = seg.copy()
  seg2[100] = 99
  c = maskc.compile("causal & document(seg)", 320, block_q=32, block_kv=32,
                    operands={"seg": seg2})
  assert c is not a
  np.testing.assert_array_equal(np.asarray(c.grid), tile_states(
      _dense("causal & document(seg)", 320, 320, 0, {"seg": seg2}), 32, 32))


SPLIT_MASKS = [
    "causal & chunk(8) | bidirectional(img)", "sliding(5) | bidirectional(img)",
    "causal & document(seg)", "~bidirectional(img) & causal", "local(3, 2) | g[q]",
    "causal & (q - k) % 3 == 0 | bidirectional(img)", "causal & document(seg) & img[k]",
    "document(seg) & (causal | bidirectional(img))",  # a part lowered in parts itself
    "(causal & chunk(8) | bidirectional(img)) & ~document(seg) | img[q] & sliding(3)",
    "local(3, 2) | g[q] | g[k]", "sliding(5) & ~g[k] | g[q]",  # parts of one axis
]


@settings(max_examples=60, deadline=None)
@given(run_operands(), st.sampled_from(SPLIT_MASKS), st.sampled_from([8, 16]),
       st.sampled_from([8, 16]), st.sampled_from([5, 1 << 16]))
def test_parts_lowered_apart_combine_exactly(case, text, bq, bk, chunk):
  """`periodic part | operand part` (and `&`) lowered apart and combined: the same tiles as
  the dense mask, forward and backward, and as lowering the mask whole (`exact=True`, so
  masks beyond the prelude are refined too)."""
  from maskc.lowering import compile as _lower
  from maskc.lowering.closed_forms import parts as _part_rules
  _, n, _, _, _, _, ops = case
  n = max(n, 8)
  reps = -(-256 // n)                      # 256 tokens: a period spans at most a quarter
  seg = np.concatenate([np.asarray(ops["seg"])] * reps, axis=-1)[..., :256]
  img = np.concatenate([np.asarray(ops["img"])] * reps, axis=-1)[..., :256]
  ops = _ops_for(text, {"seg": seg, "img": img, "g": img & (seg % 3 == 0)})
  m = maskc.parse(text)
  _lower._CACHE.clear()
  # chunk 5: runs are combined in many groups of lines; in parts however dense the operands
  from maskc.lowering.generic import combination as _combined
  default_chunk, _combined.COMBINE_CHUNK = _combined.COMBINE_CHUNK, chunk
  default_whole, _part_rules.WHOLE_AFTER = _part_rules.WHOLE_AFTER, float("inf")
  try:
    with taken() as fired:
      bm = maskc.compile(m, 256, block_q=bq, block_kv=bk, operands=ops, exact=True)
      _ = bm.cols
  finally:
    _combined.COMBINE_CHUNK = default_chunk
    _part_rules.WHOLE_AFTER = default_whole
  assert "parts" in fired, f"the split is not taken: {sorted(fired)}"
  dense = np.asarray(maskc.materialize(m, 256, operands=ops)).reshape((-1, 256, 256))
  expected = tile_states(dense, bq, bk)
  np.testing.assert_array_equal(np.asarray(bm.grid).reshape(expected.shape), expected)
  cols = np.asarray(grid_from_runs(np, bm.cols, expected.shape[-2]))[:, 0]
  np.testing.assert_array_equal(np.swapaxes(cols, -1, -2).reshape(expected.shape), expected)
  # lowered whole, the runs are the same arrays
  _lower._CACHE.clear()
  try:
    with disabled("parts"), taken() as fired:
      whole = maskc.compile(m, 256, block_q=bq, block_kv=bk, operands=ops, exact=True)
  finally:
    _lower._CACHE.clear()
  assert "parts" not in fired, sorted(fired)
  for got, want in zip(bm.rows, whole.rows):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


AXIS_MASKS = {  # mask: (the reference by NumPy broadcasting, `_axis_parts`)
    "g[k]": (lambda q, k, g, s, n: g(k) | (q < q), -1),  # a whole mask of one axis
    "g[q] & q < n": (lambda q, k, g, s, n: g(q) & (q < n) | (k < k), -1),
    "local(3, 2) | g[q] | g[k]": (lambda q, k, g, s, n: (q - 3 <= k) & (k <= q + 2) | g(q) | g(k),
                                  2),
    "g[q] | g[k]": (lambda q, k, g, s, n: g(q) | g(k), 2),
    "causal & ~g[k] | g[q]": (lambda q, k, g, s, n: (k <= q) & ~g(k) | g(q), 1),
    "sliding(5) & g[k]": (lambda q, k, g, s, n: (q - 5 < k) & (k <= q) & g(k), 1),
    "causal & chunk(8) | g[k] & g[q]": (  # two parts of one axis in a nested part
        lambda q, k, g, s, n: (k <= q) & (q // 8 == k // 8) | g(k) & g(q), 0),
    "document(seg) | g[k] & k < n": (lambda q, k, g, s, n: (s(q) == s(k)) | g(k) & (k < n), 1),
    "causal & k < n": (lambda q, k, g, s, n: (k <= q) & (k < n), 1),
    "sliding(5) | sink(3)": (lambda q, k, g, s, n: (q - 5 < k) & (k <= q) | (k < 3), 1),
    # a pattern with many runs in each FULL run (`_CombinedRuns._splice_kinds`)
    "causal | g[k]": (lambda q, k, g, s, n: (k <= q) | g(k), 1),
    "document(seg) & causal & ~g[k] | g[q]": (
        lambda q, k, g, s, n: (s(q) == s(k)) & (k <= q) & ~g(k) | g(q), 1),
    # an `|` with a pattern in an `&`: distributed, the pattern spliced into the documents
    "document(seg) & (causal | g[k])": (lambda q, k, g, s, n: (s(q) == s(k)) & ((k <= q) | g(k)),
                                        0),
    "document(seg) & (causal | g[q] | g[k])": (
        lambda q, k, g, s, n: (s(q) == s(k)) & ((k <= q) | g(q) | g(k)), 0),
    "document(seg) & (sliding(5) | bidirectional(g) | g[k])": (
        lambda q, k, g, s, n: (s(q) == s(k)) & (((q - 5 < k) & (k <= q)) | _bidirectional(g, q, k) |
                                                g(k)), 0),
    "sink(3)": (lambda q, k, g, s, n: (k < 3) | (q < q), -1),  # no operands, one axis
    # operand-free parts that are `&` / `|` of parts of one axis (`q < 7 & k < 7`)
    "causal | prefix(7)": (lambda q, k, g, s, n: (k <= q) | (q < 7) & (k < 7), 0),
    "causal & sliding(5) | global(3)": (
        lambda q, k, g, s, n: (k <= q) & (q - 5 < k) | (q < 3) | (k < 3), 0),
}


def _bidirectional(g, q, k):
  """`bidirectional(g)` by `runs_reference`: both positions in one run of true values of g
  (read through `g(indices)`; every position is below the number of keys)."""
  runs = runs_reference(np.asarray(g(np.arange(k.shape[-1]))))
  at_q, at_k = runs[..., q], runs[..., k]
  return (at_q == at_k) & (at_q > 0)


def _axis_parts(e: maskc.Explanation) -> int:
  """How many parts of one axis (rule `one_axis`) the static lowering explained by `e`
  combines at its top; -1 for a mask lowered as one such part."""
  top = e.parts[0].rule
  if top == "parts":
    return sum(p.depth == 1 and p.rule == "one_axis" for p in e.parts)
  return -1 if top == "one_axis" else 0


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(AXIS_MASKS)), st.integers(8, 160), st.sampled_from([None, 2]),
       st.sampled_from([4, 8, 16]), st.sampled_from([4, 8, 16]),
       st.sampled_from([0.02, 0.2, 0.7]), st.integers(0, 2**31),
       st.sampled_from([0, float("inf")]))
def test_parts_of_one_axis_are_exact(text, kv_len, batch, bq, bk, density, seed, sorted_after):
  """Masks and parts that read one position (`g[k]`, `g[q]`, `k < n`, `sink(3)`) are lowered
  once per tile of their axis and spliced into the other parts' runs: the tiles of the dense mask,
  forward and backward, for ragged lengths, offsets and batches; sound unrefined. The pattern's
  runs inside FULL runs are sorted out before combining, or all combined (`sorted_after`)."""
  rng = np.random.default_rng(seed)
  q_len = int(rng.integers(1, kv_len + 1))
  offset = int(rng.integers(0, kv_len - q_len + 1))
  m = maskc.parse(text)
  batch = batch if m.operands else None  # without operands, nothing has a batch axis
  shape = (batch, kv_len) if batch else (kv_len,)
  ops = {"g": rng.random(shape) < density,
         "seg": np.sort(rng.integers(0, 1 + kv_len // 16, shape), axis=-1),
         "n": rng.integers(0, kv_len + 1, batch or ()).astype(np.int32)}
  ops = {o.name: ops[o.name] for o in m.operands}
  reference, parts = AXIS_MASKS[text]
  lead = (slice(None), None, None) if batch else ()
  q = np.arange(q_len)[:, None] + offset
  k = np.arange(kv_len)[None, :]
  n = ops["n"][lead] if "n" in ops else None
  dense = reference(q, k, lambda i: ops["g"][..., i] if "g" in ops else None,
                    lambda i: ops["seg"][..., i] if "seg" in ops else None, n)
  dense = np.broadcast_to(dense, ((batch or 1), q_len, kv_len))
  expected = tile_states(dense, bq, bk)
  from maskc.lowering import compile as _lower
  from maskc.lowering.generic import combination as _combined
  assert _axis_parts(maskc.explain(m, q_len, kv_len, q_offset=offset, block_q=bq, block_kv=bk,
                                   operands=ops, exact=True)) == parts
  for exact in (True, False):
    _lower._CACHE.clear()
    default, _combined.SPLICE_SORTED_AFTER = _combined.SPLICE_SORTED_AFTER, sorted_after
    try:
      bm = maskc.compile(m, q_len, kv_len, q_offset=offset, block_q=bq, block_kv=bk,
                         operands=ops, exact=exact)
      _ = bm.cols
    finally:
      _combined.SPLICE_SORTED_AFTER = default
    got = np.asarray(bm.grid).reshape(expected.shape)
    cols = np.asarray(grid_from_runs(np, bm.cols, expected.shape[-2]))[:, 0]
    np.testing.assert_array_equal(np.swapaxes(cols, -1, -2).reshape(expected.shape), got)
    if exact:
      np.testing.assert_array_equal(got, expected)
      assert_maximal_runs(bm.rows, expected)
    else:
      assert np.all((got == FULL) <= (expected == FULL))
      assert np.all((got == EMPTY) <= (expected == EMPTY))


@pytest.mark.parametrize("lo,hi,ids,in_parts", [(4, 16, 7, False), (40, 160, 7, True),
                                                 (4, 16, None, True)])
def test_an_intersection_with_dense_operands_is_lowered_whole(lo, hi, ids, in_parts):
  """`causal & document(seg)` with repeated ids (`ids` values, round robin) is lowered in parts
  for long documents and whole for short ones (more than one document per four tile rows);
  with one run per id (sorted documents) its documents need no analysis, and it is lowered in
  parts however short; the same runs every way."""
  from maskc.lowering import compile as _lower
  rng = np.random.default_rng(lo)
  doc = np.arange(512) % ids if ids else np.arange(512)
  seg = np.repeat(doc, rng.integers(lo, hi, 512))[:4096]
  e = maskc.explain("causal & document(seg)", 4096, block_q=16, block_kv=16,
                    operands={"seg": seg}, exact=True)
  if in_parts:
    assert e.parts[0].rule == "parts", e
    ways = {p.rule for p in e.parts if p.depth == 1}
    assert ways == {"band", "equal_reads" if ids is None else "generic"}, e
  else:  # split, but faster whole
    assert e.parts[0].rule == "generic" and "faster whole" in e.parts[0].reason, e
  dense = np.asarray(maskc.materialize("causal & document(seg)", 4096, operands={"seg": seg}))
  _lower._CACHE.clear()
  bm = maskc.compile("causal & document(seg)", 4096, block_q=16, block_kv=16,
                     operands={"seg": seg})
  np.testing.assert_array_equal(np.asarray(bm.grid).reshape(256, 256),
                                tile_states(dense.reshape(1, 4096, 4096), 16, 16)[0])


COVER_MASKS = PRELUDE_WITH_OPERANDS + [
    "seg[q + 2] == seg[k + 1]", "seg[k] == seg[q] & img[q + 1]", "img[q] | document(seg)",
    "bidirectional(img) | false", "~document(seg)", "img[q] & img[k]"]


@settings(max_examples=60, deadline=None)
@given(run_operands(), st.sampled_from(COVER_MASKS))
def test_the_operands_tile_cover_holds_every_true_position(case, text):
  """Every part's cover (`maskc.lowering.closed_forms.tile_cover`) holds each tile where that part
  is true, in disjoint rectangles; the lowering stays exact (`exact`: masks beyond the prelude,
  such as `seg[k] == seg[q] & img[q + 1]`, are refined only on request)."""
  from maskc.lowering.closed_forms import tile_cover as _tile_cover
  _, n, q_len, offset, bq, bk, ops = case
  kv_len = n
  if "+" in text:  # shifted reads stay inside the operands
    kv_len, offset = n - 2, min(offset, n - 3)
    q_len = max(1, min(q_len, n - 2 - offset))
  ops = _ops_for(text, ops)
  seen = []
  real = _tile_cover.tile_cover

  def spy(m, geo, tables, nb, budget):
    seen.append((m, real(m, geo, tables, nb, budget)))
    return seen[-1][1]

  with mock.patch.object(_tile_cover, "tile_cover", spy):
    bm = maskc.compile(text, q_len, kv_len, q_offset=offset, block_q=bq, block_kv=bk,
                       operands=ops, exact=True)
  nb = next(iter(ops.values())).shape[0] if next(iter(ops.values())).ndim == 2 else 1
  for part, cover in seen:
    if cover is None:
      continue
    any_, _ = tile_truth(part.to_dense(q_len, kv_len, q_offset=offset, operands=ops), bq, bk)
    any_ = np.broadcast_to(any_.reshape((-1,) + any_.shape[-2:]), (nb,) + any_.shape[-2:])
    held = np.zeros(any_.shape, np.int64)
    for b, i0, i1, j0, j1 in zip(*cover):
      held[b, i0:i1, j0:j1] += 1
    assert held.max(initial=0) <= 1, "cover rectangles overlap"
    assert not (any_ & (held == 0)).any(), f"{part}: a true tile lies outside its cover"
  dense = maskc.parse(text).to_dense(q_len, kv_len, q_offset=offset, operands=ops)
  expected = tile_states(dense, bq, bk)
  np.testing.assert_array_equal(np.asarray(bm.grid).reshape(expected.shape), expected)


def test_documents_and_image_spans_cover_their_diagonal_squares():
  """Sorted documents cover their squares; `bidirectional(img)` the image spans' squares only
  (its repeated run id 0 between spans is cut away by `img[q]`)."""
  from maskc.lowering.closed_forms import tile_cover as _tile_cover
  from maskc.lowering.grid.refine import Budget
  from maskc.lowering.tuning import MEMORY_BUDGET
  from maskc.semantics.ranges import Tables
  budget = Budget(MEMORY_BUDGET)
  from maskc.lowering.grid.geometry import TileGeometry
  from maskc.semantics.shape import Shape
  geo = TileGeometry(Shape.of(64), 8, 8)
  seg = np.repeat(np.arange(4), [16, 20, 4, 24])[None]
  b, i0, i1, j0, j1 = _tile_cover.tile_cover(maskc.parse("document(seg)"), geo,
                                             Tables(np, {"seg": seg}), 1, budget)
  held = np.zeros((8, 8), int)
  for args in zip(b, i0, i1, j0, j1):
    held[args[1]:args[2], args[3]:args[4]] = 1
  # documents [0, 16), [16, 36), [36, 40), [40, 64): tiles 0-1, 2-4, 4, 5-7
  expected = np.zeros((8, 8), int)
  for lo, hi in [(0, 2), (2, 5), (4, 5), (5, 8)]:
    expected[lo:hi, lo:hi] = 1
  np.testing.assert_array_equal(held, expected)
  img = np.zeros((1, 64), bool)
  img[0, 10:20] = img[0, 40:48] = True
  runs = np.cumsum(np.diff(img.astype(int), prepend=0) == 1, axis=1) * img
  tables = Tables(np, {"img": img, "runs(img)": runs})
  b, i0, i1, j0, j1 = _tile_cover.tile_cover(maskc.parse("bidirectional(img)"), geo, tables, 1,
                                             budget)
  assert [tuple(map(int, x)) for x in zip(i0, i1, j0, j1)] == [(1, 3, 1, 3), (5, 6, 5, 6)]
  unsorted = np.array([[0] * 8 + [1] * 8 + [0] * 48])  # id 0 repeats: whole rows
  b, i0, i1, j0, j1 = _tile_cover.tile_cover(maskc.parse("document(seg)"), geo,
                                             Tables(np, {"seg": unsorted}), 1, budget)
  assert [tuple(map(int, x)) for x in zip(i0, i1, j0, j1)] == [(0, 1, 0, 8), (1, 2, 1, 2),
                                                               (2, 8, 0, 8)]
  # a run no column reads keeps its rows when its id repeats: row 3 reads id 5, as column 0
  short = TileGeometry(Shape.of(4, 3, 0), 1, 1)
  five_sevens = Tables(np, {"seg": np.array([[5, 7, 7, 5]])})
  b, i0, i1, j0, j1 = _tile_cover.tile_cover(maskc.parse("document(seg)"), short, five_sevens,
                                             1, budget)
  assert [tuple(map(int, x)) for x in zip(i0, i1, j0, j1)] == [(0, 1, 0, 3), (1, 3, 1, 3),
                                                               (3, 4, 0, 3)]
  with pytest.raises(maskc.MaskError, match="tile cover"):  # its arrays are charged
    _tile_cover.tile_cover(maskc.parse("document(seg)"), short, five_sevens, 1, Budget(64))


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 50), st.integers(9, 300),
                          st.booleans()), min_size=1, max_size=20), st.integers(1, 9))
def test_strips_are_cut_into_equal_parts_that_tile_them(strips, parts):
  """`_cut_strips`: each strip (one tile thick, at least `parts` long, as `_split` gives
  it) into `parts` equal parts, together exactly the strip."""
  from maskc.lowering.generic.range_analysis import _cut_strips
  b = np.array([s[0] for s in strips])
  start = np.array([s[1] for s in strips])
  length = np.array([s[2] for s in strips])
  along_rows = np.array([s[3] for s in strips])
  i0, j0 = start, start + 7
  i1 = np.where(along_rows, i0 + length, i0 + 1)
  j1 = np.where(along_rows, j0 + 1, j0 + length)
  cb, ci0, ci1, cj0, cj1 = _cut_strips((b, i0, i1, j0, j1), parts)
  for n, (bb, a0, a1, c0, c1) in enumerate(zip(b, i0, i1, j0, j1)):
    mine = np.arange(n, cb.size, len(strips))  # part p of strip n is at p * len(strips) + n
    assert (cb[mine] == bb).all()
    held = np.zeros((a1 + 1, c1 + 1), int)
    for x0, x1, y0, y1 in zip(ci0[mine], ci1[mine], cj0[mine], cj1[mine]):
      held[x0:x1, y0:y1] += 1
    expected = np.zeros_like(held)
    expected[a0:a1, c0:c1] = 1
    np.testing.assert_array_equal(held, expected)
    sizes = (ci1[mine] - ci0[mine]) * (cj1[mine] - cj0[mine])
    assert sizes.min() >= 1 and sizes.max() - sizes.min() <= 1  # no empty part, equal parts


@settings(max_examples=40)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["x[q] == x[k]", "x[q] != x[k]", "x[q] == 2",
                                                    "x[q] * 2 == x[k] + 2"]))
def test_certain_comparisons_of_reads_are_mixed(seed, text):
  """`==` / `!=` between reads on independent axes is certainly mixed where an attained end
  of one side equals one of the other (`Analyzer._link`): checked on random rectangles of
  unsorted values against the dense mask."""
  from maskc.lowering import compile as _lower
  from maskc.semantics.ranges import (
    EMPTY as A_EMPTY,
    FULL as A_FULL,
    PARTIAL as A_PARTIAL,
    Analyzer,
    Tables,
  )
  n = 48
  rng = np.random.default_rng(seed)
  x = np.repeat(rng.integers(0, 4, n), rng.integers(1, 5, n))[:n].astype(np.int32)
  bound = _lower.bind_masks(text, n, operands={"x": x})
  ql, kl = rng.integers(0, n, 64), rng.integers(0, n, 64)
  qh, kh = ql + rng.integers(0, 12, 64), kl + rng.integers(0, 12, 64)
  qh, kh = np.minimum(qh, n - 1), np.minimum(kh, n - 1)
  t = Analyzer(np, Tables(np, bound.operands), ql, qh, kl, kh).truth(bound.masks[0])
  state = np.broadcast_to(np.asarray(t.state), ql.shape)
  certain = np.broadcast_to(np.asarray(t.certain), ql.shape)
  dense = np.asarray(maskc.materialize(text, n, operands={"x": x}))
  for r in range(ql.size):
    tile = dense[ql[r]:qh[r] + 1, kl[r]:kh[r] + 1]
    assert state[r] != A_FULL or tile.all()
    assert state[r] != A_EMPTY or not tile.any()
    if state[r] == A_PARTIAL and certain[r]:
      assert tile.any() and not tile.all()
