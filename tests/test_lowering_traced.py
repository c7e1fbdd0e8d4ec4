"""The traced lowering path (`jax.jit`) on run-structured operands.

Every map is checked against an independent dense reference: the mask written
out in NumPy here, reduced to tile states (EMPTY: no true position, FULL: all
true, PARTIAL otherwise), and the traced map against the static one. Shapes are
fixed per mask, so each jitted lowering compiles once and hypothesis varies the
operand values only.
"""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import maskc
from helpers import runs_reference, tile_states
from maskc.arrays.bit_words import count_through
from maskc.lowering import compile as _lower, traced as _lower_dynamic
from maskc.lowering.closed_forms.parts import PARTS
from maskc.lowering.closed_forms.same_run_ids import same_runs
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget, evaluate_tiles, subdivide
from maskc.lowering.static import compile_static
from maskc.lowering.traced import MAX_CUTS
from maskc.lowering.tuning import MEMORY_BUDGET
from maskc.semantics.ranges import Tables, reduce_many

N = 200            # keys (and queries, unless offset): not a multiple of the tiles
BQ, BK = 32, 16    # tiles: 7 x 13, the last ones partial


def _dense(text: str, q_len: int, n: int, offset: int, ops: dict) -> np.ndarray:
  """The mask `[B, q_len, n]`, from its definition in NumPy (B = 1 when unbatched)."""
  q = (offset + np.arange(q_len))[None, :, None]
  k = np.arange(n)[None, None, :]
  ops = {name: np.asarray(v).reshape((-1, n)) for name, v in ops.items()}
  at_q = {name: v[:, offset:offset + q_len][:, :, None] for name, v in ops.items()}
  at_k = {name: v[:, None, :] for name, v in ops.items()}

  def bidirectional(name):
    r = runs_reference(ops[name])
    return (r[:, offset:offset + q_len][:, :, None] == r[:, None, :]) & (at_q[name] != 0)

  causal = k <= q
  if text == "causal & document(seg)":
    return causal & (at_q["seg"] == at_k["seg"])
  if text == "causal & chunk(48) | bidirectional(img)":
    return (causal & (q // 48 == k // 48)) | bidirectional("img")
  if text == "document(seg) & (causal | bidirectional(img))":
    return (at_q["seg"] == at_k["seg"]) & (causal | bidirectional("img"))
  if text == "local(5, 9) | g[q] | g[k]":
    return ((q - 5 <= k) & (k <= q + 9)) | (at_q["g"] != 0) | (at_k["g"] != 0)
  if text == "sliding(40) & document(seg)":
    return causal & (q - k < 40) & (at_q["seg"] == at_k["seg"])
  if text == "local(5, 9) | bidirectional(img)":
    return ((q - 5 <= k) & (k <= q + 9)) | bidirectional("img")
  raise AssertionError(text)


def _grid_of(runs, n_other: int) -> np.ndarray:
  """The tile grid `[B, lines, n_other]` written out from runs (one mask)."""
  start, stop, state, count = (np.asarray(a) for a in runs)
  b, _, lines, _ = start.shape
  out = np.zeros((b, lines, n_other), np.int8)
  for bb in range(b):
    for i in range(lines):
      for r in range(count[bb, 0, i]):
        out[bb, i, start[bb, 0, i, r]:stop[bb, 0, i, r]] = state[bb, 0, i, r]
  return out


MASKS = {
    "causal & document(seg)": ("seg",),
    "causal & chunk(48) | bidirectional(img)": ("img",),
    "document(seg) & (causal | bidirectional(img))": ("seg", "img"),
    "local(5, 9) | g[q] | g[k]": ("g",),
}
# Masks refined only with `exact=True`: raw reads (`g[q]`) are not prelude-only.
EXACT = {"local(5, 9) | g[q] | g[k]"}

STYLES = ("short", "long", "edges", "mixed", "sparse")


def _run_lengths(rng, style: str, n: int) -> np.ndarray:
  if style == "short":  # many short runs
    lengths = rng.integers(1, 5, n)
  elif style == "long":  # one long run, or two
    cut = int(rng.integers(0, n))
    lengths = np.array([n] if cut == 0 else [cut, n - cut])
  elif style == "edges":  # runs starting and ending on tile edges, or one token off
    lengths = rng.choice([15, 16, 17, 31, 32, 33, 48, 64], n)
  elif style == "sparse":  # single tokens between long gaps (global tokens)
    lengths = np.ravel(np.stack([rng.integers(10, 70, n), np.ones(n, np.int64)], axis=1))
  else:
    lengths = rng.integers(1, 80, n)
  lengths = lengths[np.cumsum(lengths) - lengths < n]
  return lengths


def _operand(rng, style: str, name: str, n: int, batch: int | None, sorted_ids: bool):
  rows = []
  for _ in range(batch or 1):
    lengths = _run_lengths(rng, style, n)
    if name == "seg":
      ids = np.arange(lengths.size) if sorted_ids else rng.integers(0, 4, lengths.size)
      row = np.repeat(ids, lengths)[:n].astype(np.int32)
    else:  # flags: runs alternate, from a random first value
      first = int(rng.integers(0, 2))
      row = np.repeat((np.arange(lengths.size) + first) % 2 == 1, lengths)[:n]
    rows.append(row)
  return np.stack(rows) if batch else rows[0]


@st.composite
def operands(draw, names, batch):
  style = draw(st.sampled_from(STYLES))
  seed = draw(st.integers(0, 2**32 - 1))
  sorted_ids = draw(st.booleans())
  rng = np.random.default_rng(seed)
  return {name: _operand(rng, style, name, N, batch, sorted_ids) for name in names}


@functools.cache
def _traced(text: str, q_len: int, n: int, offset: int, bq: int, bk: int,
            budget: int | None = None, memory: int = MEMORY_BUDGET):
  """The jitted lowering, built once per shape: (row runs, column runs)."""
  def lower(ops):
    bm = maskc.compile(text, q_len, n, q_offset=offset, block_q=bq, block_kv=bk, operands=ops,
                       refine_budget=budget, exact=text in EXACT, memory_budget=memory)
    return bm.rows, bm.cols
  return jax.jit(lower)


def _check(text: str, q_len: int, offset: int, ops: dict, memory: int = MEMORY_BUDGET) -> None:
  expected = tile_states(_dense(text, q_len, N, offset, ops), BQ, BK)
  static = maskc.compile(text, q_len, N, q_offset=offset, block_q=BQ, block_kv=BK, operands=ops,
                         exact=text in EXACT)
  rows, cols = _traced(text, q_len, N, offset, BQ, BK, memory=memory)(
      {k: jnp.asarray(v) for k, v in ops.items()})
  nq, nk = expected.shape[1:]
  np.testing.assert_array_equal(_grid_of(rows, nk), expected)
  np.testing.assert_array_equal(_grid_of(cols, nq), expected.transpose(0, 2, 1))
  np.testing.assert_array_equal(np.asarray(static.grid).reshape(expected.shape), expected)


@pytest.mark.parametrize("text", list(MASKS))
@settings(max_examples=12)
@given(data=st.data())
def test_traced_equals_static_and_dense_reference(text, data):
  # batched: 3 rows of different runs (one compilation per mask: shapes are fixed)
  ops = data.draw(operands(MASKS[text], 3))
  _check(text, N, 0, ops)


@settings(max_examples=10)
@given(operands(("seg", "img"), None))
def test_traced_with_an_offset_equals_dense_reference(ops):
  # 120 queries at positions 80..199: q tiles do not start on key tiles' edges
  _check("document(seg) & (causal | bidirectional(img))", 120, 80, ops)


@settings(max_examples=10)
@given(operands(("seg", "img"), 3))
def test_traced_in_small_chunks_equals_dense_reference(ops):
  # A memory budget of 80 KB decides 4 ambiguous tiles a round, so the 273 tiles are listed
  # by top_k where at most 4 are ambiguous and by a sort where more are (`_sort_few`).
  _check("document(seg) & (causal | bidirectional(img))", N, 0, ops, memory=80_000)


def test_prelude_masks_on_few_runs_need_no_evaluation(monkeypatch):
  # Evaluation replaced by a wrong answer (state 3): a map equal to the reference
  # was decided by analysis of the operand pieces alone.
  monkeypatch.setattr(_lower_dynamic, "evaluate_tiles",
                      lambda m, geo, tables, xp, b, i, j: jnp.full(i.shape, 3, jnp.int8))
  rng = np.random.default_rng(7)
  # Runs of at least BQ / 2 tokens change at most twice along a tile line; the masks
  # read at most two operands along an axis (`runs(img)` changes where `img` does).
  assert MAX_CUTS >= 4
  for text, names in MASKS.items():
    ops = {}
    for name in names:
      lengths = rng.integers(BQ // 2, 3 * BQ, N)
      lengths = lengths[np.cumsum(lengths) - lengths < N]
      if name == "seg":
        ops[name] = np.repeat(rng.permutation(lengths.size), lengths)[:N].astype(np.int32)
      else:
        ops[name] = np.repeat(np.arange(lengths.size) % 2 == 1, lengths)[:N]
    expected = tile_states(_dense(text, N, N, 0, ops), BQ, BK)
    grid = jax.jit(lambda o, text=text: maskc.compile(
        text, N, block_q=BQ, block_kv=BK, operands=o, exact=text in EXACT).grid)(
            {k: jnp.asarray(v) for k, v in ops.items()})
    np.testing.assert_array_equal(np.asarray(grid).reshape(expected.shape), expected)


@pytest.mark.parametrize("budget", [0, 3])
def test_refine_budget_leaves_sound_partial_tiles(budget):
  # Ids alternate token by token, 0 and 2 in the first half, 1 and 3 in the second:
  # tiles across the halves are EMPTY, but no range, piece or part of them shows it
  # (the ids' ranges overlap everywhere): they need evaluation, within the budget.
  seg = np.where(np.arange(N) < N // 2, 0, 1) + 2 * (np.arange(N) % 2)
  seg = seg.astype(np.int32)
  text = "causal & document(seg)"
  expected = tile_states(_dense(text, N, N, 0, {"seg": seg}), BQ, BK)[0]

  def grid(b):
    rows, _ = _traced(text, N, N, 0, BQ, BK, b)({"seg": jnp.asarray(seg)})
    out = _grid_of(rows, expected.shape[1])[0]
    # sound: EMPTY and FULL only where the reference says so; PARTIAL anywhere
    assert np.all((out == 1) | (out == expected))
    return out

  np.testing.assert_array_equal(grid(None), expected)
  none = grid(0)
  assert np.sum(none != expected) > 0
  # at most `budget` more tiles decided, each one PARTIAL without the budget
  changed = grid(budget) != none
  assert changed.sum() <= budget and np.all(none[changed] == 1)


# `&` / `|` of operand-free items and others: the traced path lowers the former at
# trace time (rule `parts`, traced) and analyses only the latter under jit.
SPLIT = {
    "causal & document(seg)": ("seg",),
    "causal & chunk(48) | bidirectional(img)": ("img",),
    "sliding(40) & document(seg)": ("seg",),
    "local(5, 9) | bidirectional(img)": ("img",),
}
# (q_len, q_offset): ragged (120 queries at the end of 200 keys, q tiles off the key
# tiles' edges); ragged with an offset of its own (rows 20..169). Square shapes:
# `test_traced_equals_static_and_dense_reference`.
SPLIT_SHAPES = [(120, 80), (150, 20)]


def test_static_part_splits_operand_free_items():
  # The masks above take the split, on every shape: their operand-free items become
  # a constant grid, the dense reference's tile states of those items, and the rest
  # reads every operand. A mask without operand-free items at its top does not split.
  for text, names in SPLIT.items():
    for q_len, offset in SPLIT_SHAPES + [(N, 0)]:
      bound = _lower.bind_masks(text, q_len, N, q_offset=offset, operands={
          n: np.zeros(N, bool if n != "seg" else np.int32) for n in names})
      split = PARTS.traced(bound.masks[0], TileGeometry(bound.shape, BQ, BK), True,
                           Budget(MEMORY_BUDGET), compile_static)
      assert split is not None
      rest, grid, union = split
      assert union == (" | " in text)
      assert {spec.name for spec in rest.operands} == set(names)
      free = text.split(" | " if union else " & ")[0]
      expected = tile_states(_dense_free(free, q_len, N, offset), BQ, BK)[0]
      np.testing.assert_array_equal(grid, expected)
  mixed = _lower.bind_masks("document(seg) & (causal | bidirectional(img))", N, N, operands={
      "seg": np.zeros(N, np.int32), "img": np.zeros(N, bool)})
  assert PARTS.traced(mixed.masks[0], TileGeometry(mixed.shape, BQ, BK), True,
                      Budget(MEMORY_BUDGET), compile_static) is None


def _dense_free(text: str, q_len: int, n: int, offset: int) -> np.ndarray:
  """An operand-free prelude mask `[1, q_len, n]`, from its definition in NumPy."""
  q = (offset + np.arange(q_len))[None, :, None]
  k = np.arange(n)[None, None, :]
  causal = k <= q
  return {"causal": causal, "causal & chunk(48)": causal & (q // 48 == k // 48),
          "sliding(40)": causal & (q - k < 40), "local(5, 9)": (q - 5 <= k) & (k <= q + 9)}[text]


@pytest.mark.parametrize("text", list(SPLIT))
@pytest.mark.parametrize("q_len,offset", SPLIT_SHAPES)
@settings(max_examples=6)
@given(data=st.data())
def test_split_traced_equals_static_and_dense_reference(text, q_len, offset, data):
  # Unsorted ids and every run style (`operands`), batched (3 rows) or not, ragged
  # lengths and offsets: the traced map (rows and columns) is the dense reference's,
  # and so is the static path's.
  batch = data.draw(st.sampled_from([None, 3]))
  _check(text, q_len, offset, data.draw(operands(SPLIT[text], batch)))


@pytest.mark.parametrize("union", [True, False])
def test_combined_states_hold_for_every_tile_they_describe(union):
  # Every pair of tiles of 4 elements the parts' states allow (the fixed part exact;
  # the other's PARTIAL mixed only where certain): the combined state holds for the
  # union (intersection) of every such pair, and a certain PARTIAL one is mixed in
  # every pair; a combination that is exact for every pair is decided.
  tiles = np.array(list(np.ndindex(2, 2, 2, 2)), bool)  # all 16 tiles
  exact = np.where(tiles.all(1), 2, np.where(tiles.any(1), 1, 0))
  cases = [(f, s, c) for f in range(3) for s in range(3) for c in (False, True)]
  fixed, state, certain = (np.array(x) for x in zip(*cases))
  got_state, got_certain = (np.asarray(x) for x in _lower_dynamic._combine(
      fixed, state, certain & (state == 1), union))
  for f, s, c, gs, gc in zip(fixed, state, certain & (state == 1), got_state, got_certain):
    a = tiles[exact == f]
    b = tiles[(exact == s) | ((s == 1) & ~c)]  # uncertain PARTIAL: any tile
    both = (a[:, None] | b[None]) if union else (a[:, None] & b[None])
    truth = np.where(both.all(-1), 2, np.where(both.any(-1), 1, 0))
    if gs != 1:
      assert np.all(truth == gs)
    elif gc:
      assert np.all(truth == 1)
    if np.all(truth == truth.flat[0]) and truth.flat[0] != 1:
      assert gs == truth.flat[0]  # decided whenever every pair agrees on FULL or EMPTY


@settings(max_examples=8)
@given(ops=operands(("g",), 3), offset=st.integers(0, 80))
def test_split_without_refinement_is_sound(ops, offset):
  # `local(5, 9) | g[q] | g[k]` is not prelude-only: without `exact`, no tile is
  # refined. The map is still sound (FULL and EMPTY only where the reference says
  # so), and every tile the operand-free part fills is FULL without refinement; also
  # with a traced offset, where the split is not taken.
  text = "local(5, 9) | g[q] | g[k]"
  q_len = 120
  expected = tile_states(_dense(text, q_len, N, offset, ops), BQ, BK)
  free = tile_states(_dense_free("local(5, 9)", q_len, N, offset), BQ, BK)
  dev = {k: jnp.asarray(v) for k, v in ops.items()}
  for traced_offset in (False, True):
    grid = np.asarray(_unrefined(text, q_len, traced_offset)(dev, jnp.int32(offset) if
                                                            traced_offset else offset))
    grid = grid.reshape(expected.shape)
    assert np.all((grid == 1) | (grid == expected))
    assert np.all(grid[np.broadcast_to(free == 2, grid.shape)] == 2)


@functools.cache
def _unrefined(text: str, q_len: int, traced_offset: bool):
  def lower(ops, offset):
    return maskc.compile(text, q_len, N, q_offset=offset, block_q=BQ, block_kv=BK,
                         operands=ops).grid
  return jax.jit(lower, static_argnums=() if traced_offset else (1,))


@functools.cache
def _refiners(text: str, q_len: int, offset: int):
  """The shared refinement functions on every tile of one shape, NumPy and jitted jax.numpy.

  Returns `(numpy, jitted)`, each prepared operands -> `{name: array}` of `evaluate_tiles`
  states and `subdivide` states and ambiguity for 4 x 4 and 16 x 16 parts (with
  direct reads along an axis, `spans=True`, on the jax.numpy side too).
  """
  ops0 = {name: np.zeros(N, bool if name != "seg" else np.int32) for name in MASKS[text]}
  bound = _lower.bind_masks(text, q_len, N, q_offset=offset, operands=ops0)
  m = bound.masks[0]

  def run(xp, bound_ops):  # prepared operands (`runs(img)` included), `[1, N]`
    geo = TileGeometry(bound.shape, BQ, BK, xp=xp)
    tables = Tables(xp, bound_ops)
    i, j = (a.ravel() for a in xp.meshgrid(xp.arange(geo.nq), xp.arange(geo.nk), indexing="ij"))
    out = {"evaluate": evaluate_tiles(m, geo, tables, xp, 0, i, j)}
    for parts in (4, 16):
      out[f"sub{parts}"] = subdivide(m, geo, tables, xp, 0, i, j, parts)
      if xp is jnp:
        out[f"span{parts}"] = subdivide(m, geo, tables, xp, 0, i, j, parts, spans=True)
    return out

  return functools.partial(run, np), jax.jit(functools.partial(run, jnp))


# `runs(x)[a] == runs(x)[b]` beside `x[a]` (or `x[b]`): (mask, q_len, offset, shift of a)
SAME_RUN = [("bidirectional(img)", N, 0, 0),
            ("runs(img)[q] == runs(img)[k] & img[k]", 120, 80, 0),
            ("runs(img)[q + 3] == runs(img)[k] & img[q + 3]", N - 3, 0, 3)]


@functools.cache
def _unrefined_lowering(text: str, q_len: int, offset: int):
  """The traced grid of `text` without refinement: the analysis' verdicts alone."""
  def lower(ops):
    bound = _lower.bind_masks(text, q_len, N, q_offset=offset, operands=ops)
    rows, _ = _lower_dynamic.compile_dynamic(bound.masks, bound.shape, bound.operands,
                                             bound.batch, BQ, BK, [False], None)
    return rows
  return jax.jit(lower)


@pytest.mark.parametrize("text,q_len,offset,shift", SAME_RUN)
@settings(max_examples=10)
@given(ops=operands(("img",), 3))
def test_same_run_verdicts_are_exact_without_refinement(text, q_len, offset, shift, ops):
  # The tiles come from the run labels the lines read (`maskc.lowering.closed_forms.same_run_ids`):
  # exact, with no refinement at all, for any flags, also across the lines' run boundaries.
  ops0 = {"img": np.zeros(N, bool)}
  assert len(same_runs(_lower.bind_masks(text, q_len, N, q_offset=offset,
                                         operands=ops0).masks[0])[1]) == 1
  img = np.asarray(ops["img"]).reshape(-1, N)
  r = runs_reference(img)
  at = offset + shift + np.arange(q_len)
  truth = img[:, at][:, :, None] if "img[k]" not in text else img[:, None, :]
  dense = (r[:, at][:, :, None] == r[:, None, :]) & (truth != 0)
  expected = tile_states(dense, BQ, BK)
  rows = _unrefined_lowering(text, q_len, offset)({"img": jnp.asarray(ops["img"])})
  np.testing.assert_array_equal(_grid_of(rows, expected.shape[2]), expected)


@pytest.mark.parametrize("text,offset,q_len", [
    (text, *shape) for text, shape in zip(MASKS, [(0, N), (80, 120), (0, N), (80, 120)])])
@settings(max_examples=8)
@given(data=st.data())
def test_shared_refinement_agrees_in_numpy_and_jax_and_with_reference(text, offset, q_len, data):
  # `maskc.lowering.grid.refine` serves both paths: the same function in NumPy and in
  # jax.numpy gives the same states, evaluation is exact, and every state that
  # sub-rectangles decide (or prove mixed) is the dense reference's. (One jitted
  # function per shape; half the masks with an offset: q tiles off the key tiles' edges.)
  ops = data.draw(operands(MASKS[text], None))
  # The mask on all N keys, its rows at `offset`, as lowering sees them.
  expected = tile_states(_dense(text, q_len, N, offset, ops), BQ, BK)[0].ravel()
  with_numpy, with_jax = _refiners(text, q_len, offset)
  prepared = _lower.bind_masks(text, q_len, N, q_offset=offset, operands=ops).operands
  got_np = with_numpy(prepared)
  got_jax = jax.tree.map(np.asarray, with_jax({k: jnp.asarray(v) for k, v in prepared.items()}))
  np.testing.assert_array_equal(got_np["evaluate"], expected)
  np.testing.assert_array_equal(got_jax["evaluate"], expected)
  for parts in (4, 16):
    state, ambiguous = got_np[f"sub{parts}"]
    np.testing.assert_array_equal(got_jax[f"sub{parts}"][0], state)
    np.testing.assert_array_equal(got_jax[f"sub{parts}"][1], ambiguous)
    for state, ambiguous in (got_np[f"sub{parts}"], got_jax[f"span{parts}"]):
      # sound: FULL and EMPTY only where the reference says so; decided tiles exact
      decided = (state != 1) | ~ambiguous
      np.testing.assert_array_equal(state[decided], expected[decided])
      assert np.all(state[ambiguous] == 1)


@settings(max_examples=10)
@given(seed=st.integers(0, 2**32 - 1), axis=st.sampled_from([-1, 1, (1, 2), (0, 2)]))
def test_reduce_many_is_each_reduction(seed, axis):
  # One variadic reduction under jit (one XLA kernel): the same values as each
  # reduction on its own, in NumPy and in jax.numpy, including over 33+ elements.
  rng = np.random.default_rng(seed)
  a = rng.integers(-1000, 1000, (3, 40, 37)).astype(np.int32)
  flags = rng.random((3, 40, 37)) < 0.9
  flags[0], flags[1] = True, False  # all-true and all-false slices: each identity matters
  terms = [(a, "min"), (a, "max"), (a, "sum"), (a, "or"), (a, "and"), (flags, "or"),
           (flags, "and"), (flags, "min"), (flags, "max")]
  expected = [a.min(axis), a.max(axis), a.sum(axis, dtype=np.int32),
              np.bitwise_or.reduce(a, axis=axis), np.bitwise_and.reduce(a, axis=axis),
              flags.any(axis), flags.all(axis), flags.all(axis), flags.any(axis)]
  got_np = reduce_many(np, terms, axis)
  got_jax = jax.jit(lambda t: reduce_many(jnp, list(zip(t, [op for _, op in terms])), axis))(
      [jnp.asarray(x) for x, _ in terms])
  for e, g, h in zip(expected, got_np, got_jax):
    np.testing.assert_array_equal(g, e)
    np.testing.assert_array_equal(np.asarray(h), e)


# Lines of under 128 tiles and over 1024 by top_k or a sort (16-bit keys up to 16382
# tiles), others from bit words (the fewest words, a word and a bit, the most words) with a
# sort where a line has more than 8 runs
@pytest.mark.parametrize("n", [1, 7, 128, 161, 1024, 16382, 16383])
@settings(max_examples=6)
@given(seed=st.integers(0, 2**32 - 1), density=st.sampled_from([0.0, 0.1, 0.9]))
def test_traced_runs_of_a_grid_equal_numpy(n, seed, density):
  from maskc.compiled.tiles import runs_from_grid
  rng = np.random.default_rng(seed)
  grid = rng.integers(1, 3, (2, n)) * (rng.random((2, n)) < density)
  grid[:, rng.integers(0, n, 3)] = rng.integers(0, 3, 3)  # runs of one tile
  got = _traced_runs(n)(jnp.asarray(grid, jnp.int8))
  want = runs_from_grid(np, grid.astype(np.int8))
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("width", [3, 8, 40])
@settings(max_examples=8)
@given(seed=st.integers(0, 2**32 - 1), most=st.sampled_from([0, 5, 6, 7, 40]))
def test_sort_few_is_a_sort(width, seed, most):
  # Lines of at most `most` keys below the fill, by top_k when none has more than 6 and
  # the line is wider than 7, by the whole sort otherwise: the same keys either way.
  rng = np.random.default_rng(seed)
  fill = 4 * width + 4
  keys = np.full((5, 2, width), fill, np.int32)
  for line in keys.reshape(-1, width):
    count = rng.integers(0, min(most, width) + 1)
    line[rng.choice(width, count, replace=False)] = rng.choice(fill, count, replace=False)
  got = _sort_few_jit(width, fill)(jnp.asarray(keys, jnp.uint16))
  np.testing.assert_array_equal(np.asarray(got, np.int32), np.sort(keys, axis=-1))


@pytest.mark.parametrize("n", [5, 300, 1000])  # few groups: `_sort_few`; many: two steps
@settings(max_examples=8)
@given(seed=st.integers(0, 2**32 - 1), count=st.sampled_from([0, 1, 6, 7, 40]),
       bunched=st.booleans())
def test_listed_flags_are_their_places_in_order(n, seed, count, bunched):
  """The set places of `n` flags, ascending and padded with `n`, whether at most 6 are
  set (two small top_k's over groups of 32, then their flags) or more (the whole sort),
  set places spread out or bunched into one group."""
  rng = np.random.default_rng(seed)
  flags = np.zeros(n, bool)
  places = (rng.integers(0, max(1, n - 32)) + np.arange(min(count, 32, n)) if bunched
            else rng.choice(n, min(count, n), replace=False))
  flags[places] = True
  got = np.asarray(_listed_jit(n)(jnp.asarray(flags)))
  want = np.full(n + 3, n)
  want[:flags.sum()] = np.flatnonzero(flags)
  np.testing.assert_array_equal(got, want)


@functools.cache
def _listed_jit(n: int):
  return jax.jit(lambda f: _lower_dynamic._listed(f, n + 3, 6))


@functools.cache
def _sort_few_jit(width: int, fill: int):
  del width  # one compilation per width
  return jax.jit(lambda k: _lower_dynamic._sort_few(k, fill, 6))


@pytest.mark.parametrize("n", [64, 200])  # top_k, bit words
@pytest.mark.parametrize("runs", [0, 1, 8, 9, 64, 65])
@settings(max_examples=4)
@given(seed=st.integers(0, 2**32 - 1))
def test_traced_runs_of_lines_with_few_runs_equal_numpy(n, runs, seed):
  # `runs` runs a line (8 and 64 are the most read from bit words in the first and second
  # try, more are sorted), some touching a neighbour of the other state, across words of
  # 32 tiles: the traced runs equal NumPy's
  from maskc.compiled.tiles import runs_from_grid
  if 2 * runs > n + 1:
    pytest.skip(f"{runs} runs do not fit a line of {n} tiles")
  rng = np.random.default_rng(seed)
  grid = np.zeros((3, n), np.int8)
  for line in grid:
    cuts = np.sort(rng.choice(n + 1, 2 * runs, replace=False)).reshape(-1, 2)
    state = 1
    for r, (a, z) in enumerate(cuts):
      touch = r and rng.random() < 0.5  # start where the last run stopped, in the other state
      state = 3 - state if touch else rng.integers(1, 3)
      line[cuts[r - 1, 1] if touch else a:z] = state
  got = _traced_runs(n)(jnp.asarray(grid))
  want = runs_from_grid(np, grid)
  assert (np.asarray(want.count) == runs).all()
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("block", [16, 64])  # lines of 128 tiles (bit words), of 32 (top_k)
def test_traced_lowering_with_64_bit_integers_equals_static(block):
  # Under jax_enable_x64 the traced path computes in int64; the run lists, however they are
  # read, keep one type in both branches of their `lax.cond` (this raised at trace time)
  img = np.zeros((2, 2048), np.int32)
  img[0, 300:700] = img[1, 1000:1900] = img[1, 40:90] = 1
  text = "causal & chunk(1024) | bidirectional(img)"
  static = maskc.compile(text, 2048, block_q=block, block_kv=block, operands={"img": img})
  with jax.enable_x64(True):
    traced = jax.jit(lambda o: maskc.compile(text, 2048, block_q=block, block_kv=block,
                                             operands=o).grid)({"img": jnp.asarray(img)})
  np.testing.assert_array_equal(np.asarray(traced), np.asarray(static.grid))


@pytest.mark.parametrize("length", [1, 31, 32, 33, 1024, 1025, 40_000])
@settings(max_examples=5)
@given(seed=st.integers(0, 2**32 - 1), density=st.sampled_from([0.0, 0.01, 0.5, 1.0]))
def test_count_through_bit_words_is_a_prefix_sum(length, seed, density):
  # words of 32 flags, then levels of 32 words (40,000 flags: three levels)
  flags = np.random.default_rng(seed).random((2, length)) < density
  got = _count_through(length)(jnp.asarray(flags))
  np.testing.assert_array_equal(np.asarray(got), np.cumsum(flags, axis=-1))


@settings(max_examples=5)
@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from([(1, 5, 7), (2, 40, 33)]))
def test_pairwise_prefix_counts_under_jit_equal_numpy(seed, shape):
  # `Tables.prefix`: 2-D counts of a pairwise operand's nonzeros, `[B, Q + 1, K + 1]`
  a = np.random.default_rng(seed).integers(0, 3, shape) * (np.arange(shape[-1]) % 4 > 0)
  want = np.zeros((shape[0], shape[1] + 1, shape[2] + 1), np.int64)
  want[:, 1:, 1:] = np.cumsum(np.cumsum(a != 0, axis=-1), axis=-2)
  got = jax.jit(lambda x: Tables(jnp, {"anc": x}).prefix("anc"))(jnp.asarray(a))
  np.testing.assert_array_equal(np.asarray(got), want)
  np.testing.assert_array_equal(Tables(np, {"anc": a}).prefix("anc"), want)


@functools.cache
def _count_through(length: int):
  del length  # one compilation per length
  return jax.jit(lambda f: count_through(jnp, f, jnp.int32))


@functools.cache
def _traced_runs(n: int):
  del n  # one compilation per length
  return jax.jit(_lower_dynamic._runs)


@pytest.mark.parametrize("text", ["seg[q] * 16 > k", "seg[k] * 16 < q + 3"])
def test_exact_traced_lowering_of_reads_along_one_axis(text):
  """Refining a mask whose operand reads are all along one axis (the other axis' lines
  read nothing, so they have one piece each): it crashed on the other axis' lines."""
  seg = np.repeat(np.arange(16), 16).astype(np.int32)
  static = maskc.compile(text, 256, block_q=16, block_kv=16, operands={"seg": seg}, exact=True)
  traced = jax.jit(lambda o: maskc.compile(text, 256, block_q=16, block_kv=16, operands=o,
                                           exact=True).grid)({"seg": seg})
  np.testing.assert_array_equal(np.asarray(traced), np.asarray(static.grid))
  dense = np.asarray(maskc.materialize(text, 256, operands={"seg": seg}))
  tiles = dense.reshape(16, 16, 16, 16)
  expected = np.where(tiles.all((1, 3)), 2, np.where(tiles.any((1, 3)), 1, 0))
  np.testing.assert_array_equal(np.asarray(static.grid).reshape(16, 16), expected)
