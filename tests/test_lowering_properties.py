"""Lowering: soundness, exactness, static == dynamic, and agreement of the formats."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import maskc
from helpers import FULL, PARTIAL, assert_exact, assert_sound
from maskc.compiled.blockmap import grid_from_runs

# Prelude leaves (exactness is promised for these combined with & | ^ ~).
_prelude_leaf = st.one_of(
    st.just("causal"), st.just("full"), st.just("empty"),
    st.integers(1, 40).map(lambda w: f"sliding({w})"),
    st.tuples(st.integers(0, 20), st.integers(0, 20)).map(lambda t: f"local({t[0]}, {t[1]})"),
    st.integers(1, 40).map(lambda c: f"chunk({c})"),
    st.integers(0, 60).map(lambda n: f"prefix({n})"),
    st.integers(0, 10).map(lambda n: f"sink({n})"),
    st.integers(0, 10).map(lambda n: f"global({n})"),
    st.just("document(seg)"), st.just("bidirectional(img)"),
)

# Arbitrary comparisons of terms (soundness only).
_term = st.sampled_from(["q", "k", "q - k", "k - q", "q // 3", "k // 5", "q % 7", "abs(q - k)",
                         "min(q, k)", "max(q, 2 * k)", "seg[q]", "seg[k]", "runs(img)[k]",
                         "3 * q - 2 * k", "-k", "q // -3", "k % -4"])
_comparison = st.tuples(_term, st.sampled_from(["<", "<=", "==", "!=", ">=", ">"]), _term,
                        st.integers(-20, 20)).map(lambda t: f"{t[0]} {t[1]} {t[2]} + {t[3]}")


def _combine(leaf):
  return st.recursive(leaf, lambda sub: st.one_of(
      st.tuples(sub, st.sampled_from(["&", "|", "^"]), sub)
      .map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
      sub.map(lambda s: f"~{s}" if not s.startswith("~") else f"~({s})")), max_leaves=4)


prelude_masks = _combine(_prelude_leaf)
any_masks = _combine(st.one_of(_prelude_leaf, _comparison,
                               st.just("img[q] & img[k]"), st.just("allowed[q, k]"),
                               st.just("allowed[q // 4, k // 4]")))


@st.composite
def setups(draw, masks=prelude_masks, batched=None):
  text = draw(masks)
  q_len = draw(st.integers(1, 70))
  kv_len = draw(st.integers(1, 70))
  q_offset = draw(st.one_of(st.none(), st.integers(0, 30)))
  if q_offset is None:  # bottom-right alignment; keep positions non-negative for operand reads
    kv_len = max(kv_len, q_len)
  bq, bk = draw(st.sampled_from([1, 2, 4, 8, 16])), draw(st.sampled_from([1, 3, 4, 8, 16]))
  batch = draw(st.sampled_from([None, 2])) if batched is None else batched
  n = max(kv_len, q_len + (q_offset if q_offset is not None else max(kv_len - q_len, 0))) + 1
  lead = () if batch is None else (batch,)
  rng = np.random.default_rng(draw(st.integers(0, 2**31)))
  if draw(st.booleans()):
    seg = np.sort(rng.integers(0, 4, lead + (n,)), axis=-1)
  else:
    seg = rng.integers(0, 3, lead + (n,))
  img = rng.random(lead + (n,)) < draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
  allowed = rng.random((n, n)) < 0.5
  mask = maskc.parse(text)
  names = {s.name for s in mask.operands}
  operands = {k: v for k, v in {"seg": seg, "img": img, "allowed": allowed}.items() if k in names}
  return mask, q_len, kv_len, q_offset, bq, bk, operands


def _dense(mask, q_len, kv_len, q_offset, operands):
  return np.asarray(maskc.materialize(mask, q_len, kv_len, q_offset=q_offset, operands=operands))


@given(setups(any_masks))
def test_sound_on_any_mask(s):
  mask, q_len, kv_len, q_offset, bq, bk, ops = s
  bm = maskc.compile(mask, q_len, kv_len, block_q=bq, block_kv=bk, q_offset=q_offset, operands=ops)
  assert_sound(bm.grid, _dense(mask, q_len, kv_len, q_offset, ops), bm.block_q, bm.block_kv,
               str(mask))


@given(setups(any_masks))
def test_exact_option_is_exact_on_any_mask(s):
  mask, q_len, kv_len, q_offset, bq, bk, ops = s
  bm = maskc.compile(mask, q_len, kv_len, block_q=bq, block_kv=bk, q_offset=q_offset,
                     operands=ops, exact=True)
  assert_exact(bm.grid, _dense(mask, q_len, kv_len, q_offset, ops), bm.block_q, bm.block_kv,
               str(mask))


@given(setups(prelude_masks))
def test_exact_on_prelude_masks(s):
  mask, q_len, kv_len, q_offset, bq, bk, ops = s
  bm = maskc.compile(mask, q_len, kv_len, block_q=bq, block_kv=bk, q_offset=q_offset, operands=ops)
  assert_exact(bm.grid, _dense(mask, q_len, kv_len, q_offset, ops), bm.block_q, bm.block_kv,
               str(mask))


@pytest.mark.slow  # a jit compile per example, about a minute; run_structured cases stay fast
@settings(max_examples=25)
@given(setups(any_masks))
def test_dynamic_path_equals_static(s):
  mask, q_len, kv_len, q_offset, bq, bk, ops = s
  static = maskc.compile(mask, q_len, kv_len, block_q=bq, block_kv=bk, q_offset=q_offset,
                         operands=ops)

  @jax.jit
  def grid(ops):
    return maskc.compile(mask, q_len, kv_len, block_q=bq, block_kv=bk, q_offset=q_offset,
                         operands=ops).grid

  np.testing.assert_array_equal(np.asarray(grid(ops)), static.grid)

  # A traced offset forces the traced path even for masks without operands.
  offset = q_offset if q_offset is not None else kv_len - q_len

  @jax.jit
  def grid_traced_offset(ops, offset):
    return maskc.compile(mask, q_len, kv_len, block_q=bq, block_kv=bk, q_offset=offset,
                         operands=ops).grid

  np.testing.assert_array_equal(np.asarray(grid_traced_offset(ops, offset)), static.grid)


@given(setups(any_masks))
def test_formats_describe_the_same_map(s):
  mask, q_len, kv_len, q_offset, bq, bk, ops = s
  bm = maskc.compile(mask, q_len, kv_len, block_q=bq, block_kv=bk, q_offset=q_offset, operands=ops)
  g = np.asarray(bm.grid).reshape((-1,) + bm.grid.shape[-2:])
  # compact rows and columns rebuild the grid
  rows = grid_from_runs(np, bm.rows, bm.n_kv_tiles)
  cols = grid_from_runs(np, bm.cols, bm.n_q_tiles)
  np.testing.assert_array_equal(rows.reshape(g.shape), g)
  np.testing.assert_array_equal(np.swapaxes(cols, -1, -2).reshape(g.shape), g)
  # runs are sorted, disjoint and maximal
  for b, u, i in np.ndindex(bm.rows.count.shape):
    n = bm.rows.count[b, u, i]
    start, stop, state = (x[b, u, i, :n] for x in bm.rows[:3])
    assert np.all(start < stop) and np.all(stop[:-1] <= start[1:])
    assert not np.any((stop[:-1] == start[1:]) & (state[:-1] == state[1:]))
  # flex index lists
  f = bm.flex()
  rebuilt = np.zeros((1, 1) + g.shape[-2:], np.int8)
  for i in range(g.shape[-2]):
    rebuilt[0, 0, i, f["kv_indices"][0, 0, i, :f["kv_num_blocks"][0, 0, i]]] = PARTIAL
    rebuilt[0, 0, i, f["full_kv_indices"][0, 0, i, :f["full_kv_num_blocks"][0, 0, i]]] = FULL
  np.testing.assert_array_equal(rebuilt[0, 0], g[0])
  rebuilt_t = np.zeros_like(rebuilt)
  for j in range(g.shape[-1]):
    rebuilt_t[0, 0, f["q_indices"][0, 0, j, :f["q_num_blocks"][0, 0, j]], j] = PARTIAL
    rebuilt_t[0, 0, f["full_q_indices"][0, 0, j, :f["full_q_num_blocks"][0, 0, j]], j] = FULL
  np.testing.assert_array_equal(rebuilt_t[0, 0], g[0])


def test_known_maps():
  assert maskc.compile("causal", 512).grid.tolist() == [[1, 0, 0, 0], [2, 1, 0, 0],
                                                        [2, 2, 1, 0], [2, 2, 2, 1]]
  bm = maskc.compile("sliding(128)", 512, block_q=128, block_kv=128)
  assert bm.grid.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
  # decode: one query row sees every key
  assert maskc.compile("causal", 1, 1000, block_q=1, block_kv=256).grid.tolist() == [[2, 2, 2, 2]]
  # ragged lengths
  bm = maskc.compile("full", 100, 130, block_q=64, block_kv=64)
  assert bm.grid.tolist() == [[2, 2, 2], [2, 2, 2]]


def test_multi_head_masks_are_stored_once():
  bm = maskc.compile(["causal", "sliding(64)", "causal", "sliding(64)"], 256, block_q=64,
                     block_kv=64)
  assert len(bm.masks) == 2 and bm.head_index == (0, 1, 0, 1)
  assert bm.grid.shape == (4, 4, 4)
  np.testing.assert_array_equal(bm.grid[0], maskc.compile("causal", 256, block_q=64,
                                                          block_kv=64).grid)


def test_batched_operands_give_a_batch_axis():
  seg = np.array([[0] * 32 + [1] * 32, [0] * 64])
  bm = maskc.compile("document(seg)", 64, block_q=32, block_kv=32, operands={"seg": seg})
  assert bm.grid.tolist() == [[[2, 0], [0, 2]], [[2, 2], [2, 2]]]


def test_static_blockmap_is_hashable_and_cached():
  a = maskc.compile("causal & chunk(64)", 256, block_q=32, block_kv=32)
  b = maskc.compile(maskc.causal() & maskc.chunk(64), 256, block_q=32, block_kv=32)
  assert a is b and hash(a) == hash(b)


def test_blockmap_is_a_pytree_through_jit():
  bm = maskc.compile("causal", 256, block_q=64, block_kv=64)
  out = jax.jit(lambda m: m.rows.count.sum())(bm)
  assert int(out) == int(bm.rows.count.sum())


def test_statistics():
  bm = maskc.compile("causal", 256, block_q=64, block_kv=64)
  assert bm.counts == {"empty": 6, "partial": 4, "full": 6}
  assert bm.density == pytest.approx(10 / 16)
  assert bm.flops_saved == pytest.approx(6 / 16)


def test_bad_arguments_raise_mask_errors():
  with pytest.raises(maskc.MaskValueError):
    maskc.compile("causal", 64, block_q=0)
  with pytest.raises(maskc.OperandError, match="seg"):
    maskc.compile("document(seg)", 64)
  with pytest.raises(maskc.MaskTypeError):
    maskc.compile(3, 64)
