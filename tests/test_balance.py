"""`maskc.balance`: context-parallel layouts that are valid permutations with honest work.

Each layout must be a permutation of whole chunks; the work it reports for a
shard must equal the tiles that shard's rows visit, counted two ways: by
compiling the mask for the shard's rows at the layout's positions, and by
NumPy from the dense mask permuted into the layout's order. Balanced must be
no worse than zigzag and contiguous, and better where zigzag was not made for
the mask.
"""

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

import maskc
from helpers import FULL, PARTIAL, tile_truth
from maskc.parallel.layout import PARTIAL_COST, _balanced_order


def numpy_work(dense: np.ndarray, rows: np.ndarray, cols: np.ndarray, block: int) -> float:
  """Tiles visited by `rows` against `cols` of a dense mask `[B?, L, L]`, FULL 1, PARTIAL 1.5."""
  d = dense[..., rows, :][..., :, cols]
  any_, all_ = tile_truth(d.reshape((-1,) + d.shape[-2:]), block, block)
  return float(all_.sum() + PARTIAL_COST * (any_ & ~all_).sum())


def compiled_work(mask, seq_len, layout, r, operands) -> float:
  """Tiles shard `r` visits, from the map compiled for its rows at the layout's positions."""
  bm = maskc.compile(mask, layout.per_shard, seq_len, block_q=layout.block,
                     block_kv=layout.block, q_positions=layout.shard_positions(r),
                     kv_positions=layout.positions, operands=operands)
  g = np.asarray(bm.grid)
  return float((g == FULL).sum() + PARTIAL_COST * (g == PARTIAL).sum())


def image_spans(n: int, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  img = np.zeros(n, bool)
  for _ in range(max(1, n // 64)):
    s = int(rng.integers(0, n - 8))
    img[s:s + int(rng.integers(4, 48))] = True
  return img


def packed_segments(n: int, seed: int, batch: int | None = None) -> np.ndarray:
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(batch or 1):
    lengths = rng.integers(8, n // 2, size=n)
    rows.append(np.repeat(np.arange(n), lengths)[:n].astype(np.int32))
  return np.stack(rows) if batch else rows[0]


CASES = [
    ("causal", {}),
    ("sliding(24) | global(8)", {}),
    ("causal & chunk(64)", {}),
    ("causal & document(seg)", {"seg": packed_segments(256, 0, batch=2)}),
    ("causal | bidirectional(img)", {"img": image_spans(256, 1)}),
]


@pytest.mark.parametrize("method", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("mask, operands", CASES)
def test_layout_is_a_permutation_and_its_work_is_what_shards_visit(method, mask, operands):
  n, shards, block = 256, 4, 16
  lay = maskc.balance(mask, n, shards, block=block, operands=operands, method=method)
  n_chunks = n // lay.chunk
  assert sorted(lay.order.tolist()) == list(range(n_chunks))
  assert np.array_equal(lay.inverse[lay.order], np.arange(n_chunks))
  assert sorted(lay.positions.tolist()) == list(range(n))
  assert lay.chunk % block == 0 and n_chunks % shards == 0
  for slot, c in enumerate(lay.order):  # chunk c's tokens, in order, at slot `slot`
    assert np.array_equal(lay.positions[slot * lay.chunk:(slot + 1) * lay.chunk],
                          np.arange(c * lay.chunk, (c + 1) * lay.chunk))
  x = np.arange(2 * n).reshape(2, n)
  assert np.array_equal(lay.unpermute(lay.permute(x)), x)
  assert np.array_equal(lay.permute(x)[0], lay.positions)
  dense = maskc.materialize(mask, n, operands=operands)
  for r in range(shards):
    want = numpy_work(dense, lay.shard_positions(r), np.arange(n), block)
    assert lay.work[r] == pytest.approx(want)
    assert compiled_work(mask, n, lay, r, operands) == pytest.approx(want)
    # keys stored in the layout's order visit the same tiles (whole tiles move)
    assert numpy_work(dense, lay.shard_positions(r), lay.positions, block) == pytest.approx(want)
  assert lay.imbalance == pytest.approx(lay.work.max() / lay.work.mean())


def test_zigzag_is_maxtext_order():
  shards, n = 4, 512
  lay = maskc.balance("causal", n, shards, block=16, method="zigzag")
  want = []
  for r in range(shards):  # MaxText: 2*cp chunks, shard r holds chunks r and 2cp-1-r
    want += [r, 2 * shards - 1 - r]
  assert lay.order.tolist() == want
  assert lay.chunk == n // (2 * shards)
  assert lay.imbalance == pytest.approx(1.0)


@pytest.mark.parametrize("shards", [4, 8])
@pytest.mark.parametrize("mask, operands", CASES)
def test_balanced_is_never_worse_than_zigzag_or_contiguous(shards, mask, operands):
  n, block = 256, 8
  lays = {m: maskc.balance(mask, n, shards, block=block, operands=operands, method=m)
          for m in ("contiguous", "zigzag", "balanced")}
  assert lays["balanced"].imbalance <= lays["zigzag"].imbalance + 1e-9
  assert lays["balanced"].imbalance <= lays["contiguous"].imbalance + 1e-9


@pytest.mark.parametrize("mask, n, shards, operands", [
    ("causal & document(seg)", 1024, 8, {"seg": packed_segments(1024, 5)}),
    ("causal & document(seg)", 1024, 4, {"seg": packed_segments(1024, 7, batch=2)}),
])
def test_balanced_is_clearly_better_where_zigzag_is_not_made_for_the_mask(mask, n, shards,
                                                                          operands):
  # (Image spans over causal stay near zigzag's balance, which the test above covers.)
  zig = maskc.balance(mask, n, shards, block=16, operands=operands, method="zigzag")
  bal = maskc.balance(mask, n, shards, block=16, operands=operands)
  assert bal.imbalance < 1.1 < zig.imbalance, (mask, bal.imbalance, zig.imbalance)


@hypothesis.given(st.lists(st.floats(0, 100), min_size=1, max_size=48), st.integers(1, 6))
def test_balanced_order_is_equal_sized_and_no_worse_than_greedy_bound(costs, shards):
  n = len(costs) // shards * shards
  hypothesis.assume(n > 0)
  cost = np.asarray(costs[:n])
  order = _balanced_order(cost, shards)
  assert sorted(order.tolist()) == list(range(n))
  loads = cost[order].reshape(shards, -1).sum(1)
  # each shard holds n / shards chunks; the heaviest is within one chunk of the mean
  assert loads.max() <= cost.sum() / shards + cost.max() + 1e-9


@pytest.mark.parametrize("kwargs", [
    dict(method="striped"), dict(method="zigzag", block=48),
    dict(method="balanced", chunk=24), dict(method="contiguous", block=3)])
def test_bad_arguments_raise(kwargs):
  kwargs = {"block": 16, **kwargs}
  with pytest.raises(maskc.MaskValueError):
    maskc.balance("causal", 256, 4, **kwargs)


@pytest.mark.parametrize("mask", ["sliding(64) | global(8)", "causal | global(8)"])
def test_balanced_reaches_the_bound_of_equal_sized_shards(mask):
  # Global query rows make one chunk heavy; its shard must still hold n/shards - 1 other
  # chunks, so no layout of equal shards beats `heaviest + the cheapest others`, or the mean.
  n, shards, block = 4096, 4, 16
  bal = maskc.balance(mask, n, shards, block=block)
  cost = maskc.parallel.layout.tile_costs(mask, n, block=block)
  per = n // block // shards
  rest = np.sort(np.delete(cost, np.argmax(cost)))[:per - 1].sum()
  bound = max(cost.max() + rest, cost.sum() / shards)
  assert bal.work.max() == pytest.approx(bound, rel=0.01)
  zig = maskc.balance(mask, n, shards, block=block, method="zigzag")
  assert bal.work.max() <= zig.work.max()
