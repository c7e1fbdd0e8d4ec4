"""Pairwise operands read through blocks aligned with the tiles (`maskc.semantics.pair_blocks`,
rule `aligned_pairs`): block verdicts against brute force, exact tiles of aligned reads on
both paths, memory within the budget where 2-D prefix counts would not fit, block selection
under `jit`, and maps that never change after they are built."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import maskc
from helpers import assert_exact, assert_sound, tile_states
from maskc.lowering import compile as _lower
from maskc.lowering.rules import disabled, taken
from maskc.semantics.pair_blocks import BlockAxis, PairBlocks
from sampling import PARTS, count


@st.composite
def block_axis(draw, length: int):
  return BlockAxis(draw(st.integers(-8, 8)), draw(st.integers(1, 7)),
                   draw(st.integers(1, length + 8)), length)


@given(st.data())
def test_block_verdicts_are_the_rectangles_any_and_all(data):
  """Where a rectangle of indices is whole blocks inside the operand, its verdict is EMPTY
  (no nonzero), FULL (only nonzeros) or PARTIAL, read from the values; elsewhere no verdict
  (PARTIAL, unaligned)."""
  q_len, k_len = data.draw(st.integers(1, 30)), data.draw(st.integers(1, 30))
  a = data.draw(hnp.arrays(data.draw(st.sampled_from([np.bool_, np.int8])), (2, q_len, k_len)))
  rows, cols = data.draw(block_axis(q_len)), data.draw(block_axis(k_len))
  blocks = PairBlocks(np, a, rows, cols)
  b = data.draw(st.integers(0, 1))
  for _ in range(20):
    if data.draw(st.booleans()) and rows.count and cols.count:  # whole blocks
      u0 = data.draw(st.integers(0, rows.count - 1))
      v0 = data.draw(st.integers(0, cols.count - 1))
      lo = rows.first + u0 * rows.size
      hi = min(lo + data.draw(st.integers(1, 3)) * rows.size, rows.stop) - 1
      k_lo = cols.first + v0 * cols.size
      k_hi = min(k_lo + data.draw(st.integers(1, 3)) * cols.size, cols.stop) - 1
    else:
      lo, hi = sorted(data.draw(st.lists(st.integers(-9, q_len + 9), min_size=2, max_size=2)))
      k_lo, k_hi = sorted(data.draw(st.lists(st.integers(-9, k_len + 9), min_size=2,
                                             max_size=2)))
    state, aligned = blocks.verdict(b, np.array(lo), np.array(hi), np.array(k_lo),
                                    np.array(k_hi))
    if not aligned:
      assert state == 1
      continue
    assert 0 <= lo and hi < min(rows.end, q_len) and 0 <= k_lo and k_hi < min(cols.end, k_len)
    window = a[b, lo:hi + 1, k_lo:k_hi + 1] != 0
    assert state == (2 if window.all() else 1 if window.any() else 0)


# `a[(q + s) // r, (k + t) // c]`: read alone its tiles are exact, whatever else stands beside.
ALIGNED = ["a[q, k]", "a[q // 2, k // 2]", "a[(q + 2) // 2, k // 4]", "a[q + 3, k]"]
AROUND = ["{}", "causal & {}", "~{} | sliding(5)", "{} ^ chunk(6)", "k >= 2 & {}"]


@st.composite
def aligned_cases(draw):
  read = draw(st.sampled_from(ALIGNED))
  text = draw(st.sampled_from(AROUND)).format(read)
  kv_len = draw(st.integers(1, 70))
  q_len = draw(st.integers(1, kv_len))
  bq, bk = draw(st.sampled_from([4, 8])), draw(st.sampled_from([4, 8]))
  q_offset = kv_len - q_len
  r = 2 if "// 2" in read else 1
  rows = -(-(q_offset + q_len + 3) // r) + 1
  cols = -(-kv_len // (4 if "k // 4" in read else r)) + 1
  dtype = draw(st.sampled_from([np.bool_, np.int8]))
  lead = draw(st.sampled_from([(), (2,)]))
  a = draw(hnp.arrays(dtype, lead + (rows, cols)))
  return text, q_len, kv_len, bq, bk, {"a": a}


@settings(max_examples=80, deadline=None)
@given(aligned_cases())
def test_aligned_reads_give_their_exact_tiles_and_sound_compositions(case):
  """Every drawn mask takes the rule where its read is aligned with the tiles (or gives the
  same tiles without it), a read alone has the dense mask's exact tiles, and every map is
  sound, and exact where refined."""
  text, q_len, kv_len, bq, bk, ops = case
  dense = np.asarray(maskc.materialize(text, q_len, kv_len, operands=ops))
  with taken() as fired:
    bm = maskc.compile(text, q_len, kv_len, block_q=bq, block_kv=bk, operands=ops)
  grid = np.asarray(bm.grid)
  if text in ALIGNED and "aligned_pairs" in fired:
    assert_exact(grid, dense, bq, bk, text)
  assert_sound(grid, dense, bq, bk, text)
  refined = maskc.compile(text, q_len, kv_len, block_q=bq, block_kv=bk, operands=ops,
                          exact=True)
  assert_exact(np.asarray(refined.grid), dense, bq, bk, text + " (exact=True)")
  with disabled("aligned_pairs"):
    assert_sound(np.asarray(maskc.compile(text, q_len, kv_len, block_q=bq, block_kv=bk,
                                          operands=ops).grid), dense, bq, bk, text)


def test_reads_aligned_with_the_tiles_take_the_rule_and_others_do_not():
  a = np.ones((100, 64), bool)
  for text, bq, aligned in [("a[q, k]", 8, True), ("a[q // 4, k // 4]", 8, True),
                            ("a[q // 3, k // 3]", 8, False), ("a[q + 1, k]", 8, True),
                            ("a[q // 2, k // 2]", 4, True), ("a[q // 8, k // 8]", 4, False),
                            ("a[2 * q, k]", 8, False)]:
    with taken() as fired:
      maskc.compile(text, 48, 48, block_q=bq, block_kv=bq, operands={"a": a})
    assert ("aligned_pairs" in fired) == aligned, text


@pytest.mark.parametrize("part", PARTS)
def test_aligned_reads_under_jit_have_the_static_tiles(part):
  @settings(max_examples=count(20, part), deadline=None)
  @given(aligned_cases())
  def check(case):
    text, q_len, kv_len, bq, bk, ops = case
    static = np.asarray(maskc.compile(text, q_len, kv_len, block_q=bq, block_kv=bk,
                                      operands=ops).grid)
    with taken() as fired:
      traced = jax.jit(lambda a: maskc.compile(text, q_len, kv_len, block_q=bq, block_kv=bk,
                                               operands={"a": a}).grid)(ops["a"])
    dense = np.asarray(maskc.materialize(text, q_len, kv_len, operands=ops))
    assert_sound(np.asarray(traced), dense, bq, bk, text + " (traced)")
    if text in ALIGNED and "aligned_pairs" in fired:
      np.testing.assert_array_equal(np.asarray(traced), static)
  check()


def _tree_ancestors(n: int, seed: int) -> np.ndarray:
  """A random tree's ancestor-or-self matrix, tokens in DFS order."""
  rng = np.random.default_rng(seed)
  parent = np.array([-1] + [int(rng.integers(max(0, i - 40), i)) for i in range(1, n)])
  anc = np.zeros((n, n), bool)
  for i in range(n):
    anc[i, i] = True
    if parent[i] >= 0:
      anc[i] |= anc[parent[i]]
  return anc


def test_a_pairwise_operand_needs_no_memory_of_its_size_beyond_itself():
  """`causal & anc[q, k]` at 4K: the general read's 2-D prefix counts alone (64 MiB of int32)
  are over a 32 MiB budget, the blocked pass is not; the map is the dense mask's, tile for
  tile, where the analysis decides (exact where refined)."""
  n = 4096
  anc = _tree_ancestors(n, 0)
  ops = {"anc": anc}
  with disabled("aligned_pairs"), pytest.raises(maskc.MaskLimitError):
    maskc.compile("causal & anc[q, k]", n, block_q=128, block_kv=128, operands=ops,
                  memory_budget=32 << 20)
  bm = maskc.compile("causal & anc[q, k]", n, block_q=128, block_kv=128, operands=ops,
                     memory_budget=32 << 20, exact=True)
  dense = np.tril(anc)
  np.testing.assert_array_equal(np.asarray(bm.grid), tile_states(dense, 128, 128))


def test_a_map_does_not_change_when_its_caller_reuses_the_operand_buffer():
  """A pairwise operand is kept in its own dtype, not widened at bind time, but a caller's
  buffer written again after `compile` leaves the map as it was built."""
  anc = _tree_ancestors(64, 1)
  before = np.tril(anc)
  bm = maskc.compile("causal & anc[q, k]", 64, block_q=8, block_kv=8, operands={"anc": anc})
  anc[:] = ~anc
  np.testing.assert_array_equal(np.asarray(bm.to_dense()), before)


def test_large_pairwise_operands_are_not_digested_for_the_cache():
  """Maps of pairwise operands above `DIGEST_PAIR_BYTES` are built anew each call (their
  digest would cost as much as the lowering), smaller ones come from the cache."""
  from maskc.semantics.operands import DIGEST_PAIR_BYTES
  small = np.ones((64, 64), bool)
  large = np.ones((2100, 2100), bool)
  assert small.nbytes <= DIGEST_PAIR_BYTES < large.nbytes
  _lower._CACHE.clear()
  for a in (small, large):
    maskc.compile("causal & a[q, k]", a.shape[0], block_q=64, block_kv=64, operands={"a": a})
  assert len(_lower._CACHE) == 1


def test_block_selection_under_jit_traces_once_and_is_exact():
  """`causal & sel[q // 16, k // 16]` with a fresh selection each step: one trace, and each
  call's tiles are the dense mask's."""
  n, b = 256, 16
  traces = []

  @jax.jit
  def grid(sel):
    traces.append(1)
    return maskc.compile("causal & sel[q // 16, k // 16]", n, block_q=b, block_kv=b,
                         operands={"sel": sel}).grid

  rng = np.random.default_rng(0)
  for _ in range(3):
    sel = rng.random((n // b, n // b)) < 0.4
    dense = np.tril(np.repeat(np.repeat(sel, b, 0), b, 1))
    np.testing.assert_array_equal(np.asarray(grid(jnp.asarray(sel))), tile_states(dense, b, b))
  assert len(traces) == 1
