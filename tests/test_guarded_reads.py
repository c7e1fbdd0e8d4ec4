"""Reads guarded by their `&` (`maskc.semantics.reads`): a read whose index can leave its operand
is accepted where the same `&` keeps it inside, pairs outside the guard never depend on the
operand, and an unguarded read is refused with the guard in its hint."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import maskc
from helpers import assert_exact


def _reference(anc: np.ndarray, p: int, q_len: int, kv_len: int) -> np.ndarray:
  """`k >= p & anc[q, k - p]`, written out: no read below 0."""
  q = np.arange(kv_len - q_len, kv_len)[:, None]
  k = np.arange(kv_len)[None, :]
  out = np.zeros((q_len, kv_len), bool)
  ok = (k >= p) & np.ones_like(q, bool)
  out[ok] = anc[np.broadcast_to(q, ok.shape)[ok], np.broadcast_to(k - p, ok.shape)[ok]]
  return out


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(0, 6), st.integers(0, 2**16), st.sampled_from([2, 4]))
def test_a_shifted_pairwise_read_guarded_by_its_and(n, p, seed, block):
  """`k >= P & anc[q, k - P]` (FlexAttention users write it so): the dense mask is the
  reference's, and its tiles, compiled exactly, the reference's tiles."""
  anc = np.random.default_rng(seed).random((n, n)) < 0.5
  for text in (f"k >= {p} & anc[q, k - {p}]", f"k - {p} >= 0 & anc[q, k - {p}]",
               f"anc[q, k - {p}] & {p} <= k"):
    dense = np.asarray(maskc.materialize(text, n, operands={"anc": anc}))
    np.testing.assert_array_equal(dense, _reference(anc, p, n, n), text)
    bm = maskc.compile(text, n, block_q=block, block_kv=block, operands={"anc": anc},
                       exact=True)
    assert_exact(np.asarray(bm.grid), dense, block, block, text)


def test_pairs_outside_the_guard_never_depend_on_the_operand():
  """Below its guard a read would reach indices under 0 (evaluated clipped to column 0): the
  pairs there are False whatever column 0 holds, in the dense mask and in attention, where
  xla's block-sparse kernel agrees with the dense reference."""
  n, p = 32, 5
  rng = np.random.default_rng(0)
  anc = rng.random((n, n)) < 0.5
  flipped = anc.copy()
  flipped[:, 0] = ~flipped[:, 0]  # what a clipped read below the guard would see
  text = f"k >= {p} & anc[q, k - {p}]"
  for values in (anc, flipped):
    dense = np.asarray(maskc.materialize(text, n, operands={"anc": values}))
    assert not dense[:, :p].any()
    np.testing.assert_array_equal(dense, _reference(values, p, n, n))
    x = rng.standard_normal((1, n, 2, 8)).astype(np.float32)
    out = maskc.attention(x, x, x, text, operands={"anc": values}, backend="xla",
                          block_q=8, block_kv=8)
    ref = maskc.attention(x, x, x, text, operands={"anc": values}, backend="dense")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)


def test_a_scalar_bound_guards_a_per_token_read():
  """`q < n & x[q]` with `x` of `n` tokens reads inside it; one more query than that and the
  read is refused, its hint naming the guard that fits."""
  x = np.arange(10) % 3 == 0
  np.testing.assert_array_equal(
      np.asarray(maskc.materialize("q < n & x[q]", 24, operands={"x": x, "n": 10})),
      np.pad(np.broadcast_to(x[:, None], (10, 24)), [(0, 14), (0, 0)]))
  with pytest.raises(maskc.OperandError, match="where its guards hold") as e:
    maskc.materialize("q < n & x[q]", 24, operands={"x": x, "n": 11})
  assert "`q < 10 & x[q]`" in e.value.hint


def test_guards_hold_per_batch_row():
  """A batched scalar guard is checked row by row."""
  x = np.zeros((2, 10), bool)
  maskc.materialize("q < n & x[q]", 16, operands={"x": x, "n": np.array([10, 4])})
  with pytest.raises(maskc.OperandError):
    maskc.materialize("q < n & x[q]", 16, operands={"x": x, "n": np.array([4, 12])})


@pytest.mark.parametrize("text, hint", [
    ("anc[q, k - 3]", "`k - 3 >= 0 & anc[q, k - 3]`"),
    ("k >= 3 & anc[q, k - 3] | anc[q, k - 3]", "`k - 3 >= 0 & anc[q, k - 3]`"),
    ("k >= 2 & anc[q, k - 3]", "`k - 3 >= 0 & anc[q, k - 3]`"),
    ("q >= 3 & anc[q, k - 3]", "`k - 3 >= 0 & anc[q, k - 3]`"),
    ("anc[q + 1, k]", "`q + 1 < 16 & anc[q + 1, k]`"),
])
def test_unguarded_reads_are_refused_with_the_guard_in_the_hint(text, hint):
  """A read outside any guard (or beside a guard too weak, or on the other position) keeps
  today's refusal; its hint shows the guard that would keep it inside."""
  anc = np.ones((16, 16), bool)
  with pytest.raises(maskc.OperandError, match="has length 16") as e:
    maskc.compile(text, 16, block_q=4, block_kv=4, operands={"anc": anc})
  assert hint in e.value.hint, e.value.hint


def test_a_guard_that_never_holds_needs_no_read():
  anc = np.ones((4, 4), bool)
  dense = np.asarray(maskc.materialize("k >= 100 & anc[q, k - 100]", 4,
                                       operands={"anc": anc}))
  assert not dense.any()
