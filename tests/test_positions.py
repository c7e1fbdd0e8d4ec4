"""Explicit positions: `q_positions` / `kv_positions` in materialize, bind, compile, attention.

Row `i` of a mask with `q_positions` is query position `q_positions[i]`, so a
permutation of positions permutes the dense mask's rows (and columns for
`kv_positions`). Lowering must stay sound for any positions and be exact where
each tile's positions are consecutive integers (zigzag and striped layouts).
Every claim is checked against NumPy: the permuted dense mask, and tile states
recomputed from it tile by tile.
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maskc
from helpers import assert_sound, tile_states
from maskc.testing import (
  mask_trees as masks,
  prelude_combinations,
  seeded_operand_values as operand_values,
)
from sampling import PARTS, count


def col_grid(bm) -> np.ndarray:
  """The backward (per key tile) runs as a `[..., n_q_tiles, n_kv_tiles]` grid."""
  g = maskc.compiled.tiles.grid_from_runs(np, bm.cols, bm.n_q_tiles)
  return np.swapaxes(bm._public(g), -1, -2)


def zigzag(n: int, shards: int) -> np.ndarray:
  """MaxText's load-balanced order: 2*shards chunks, shard r holds chunks r and 2s-1-r."""
  c = n // (2 * shards)
  order = [x for r in range(shards) for x in (r, 2 * shards - 1 - r)]
  return np.concatenate([np.arange(o * c, (o + 1) * c) for o in order])


def striped(n: int, shards: int, chunk: int) -> np.ndarray:
  """Striped layout: chunk t goes to shard t % shards; shards stored one after another."""
  chunks = np.arange(n // chunk)
  order = np.concatenate([chunks[r::shards] for r in range(shards)])
  return np.concatenate([np.arange(o * chunk, (o + 1) * chunk) for o in order])


# ----------------------------------------------------------------------------- dense


@hypothesis.given(masks(), st.integers(1, 20), st.integers(0, 2**16))
def test_permuted_rows_and_columns_equal_permuted_dense_mask(m, n, seed):
  rng = np.random.default_rng(seed)
  p, pk = rng.permutation(n), rng.permutation(n)
  ops = operand_values(n, seed)
  dense = maskc.materialize(m, n, operands=ops)
  assert np.array_equal(maskc.materialize(m, n, operands=ops, q_positions=p), dense[p])
  assert np.array_equal(maskc.materialize(m, n, operands=ops, kv_positions=pk), dense[:, pk])
  both = maskc.materialize(m, n, operands=ops, q_positions=p, kv_positions=pk)
  assert np.array_equal(both, dense[p][:, pk])
  cm = m.bind(n, operands=ops, q_positions=p, kv_positions=pk)
  assert np.array_equal(cm[:, :], both)
  assert np.array_equal(cm[1:3, ::2], both[1:3, ::2])


def test_causal_with_positions_against_numpy_formula():
  rng = np.random.default_rng(0)
  p = rng.integers(-5, 40, size=12)
  pk = rng.integers(0, 40, size=9)
  want = p[:, None] >= pk[None, :]
  got = maskc.materialize("causal", 12, 9, q_positions=p, kv_positions=pk)
  assert np.array_equal(got, want)
  bias = np.asarray(maskc.additive_bias("causal", 12, 9, q_positions=p, kv_positions=pk))
  assert np.array_equal(bias == 0, want)
  assert (bias[~want] < -1e30).all()


def test_batched_positions_give_one_mask_per_row():
  p = np.stack([np.arange(8), np.arange(8)[::-1], np.roll(np.arange(8), 3)])
  dense = maskc.materialize("sliding(3)", 8)
  got = maskc.materialize("sliding(3)", 8, q_positions=p)
  assert got.shape == (3, 8, 8)
  for b in range(3):
    assert np.array_equal(got[b], dense[p[b]])
  seg = np.stack([np.repeat([0, 1], 4), np.repeat([0, 1], [2, 6]), np.zeros(8, int)])
  got = maskc.materialize("document(seg)", 8, q_positions=p, operands={"seg": seg})
  for b in range(3):
    assert np.array_equal(got[b], (seg[b][p[b]][:, None] == seg[b][None, :]))
  cm = maskc.parse("sliding(3)").bind(8, q_positions=p)
  assert cm.shape == (3, 8, 8)
  assert np.array_equal(cm[:, :, :], maskc.materialize("sliding(3)", 8, q_positions=p))
  assert np.array_equal(cm[1, 2:5, :], dense[p[1]][2:5])


def test_traced_positions_under_jit():
  rng = np.random.default_rng(1)
  p = rng.permutation(16)
  seg = np.repeat(np.arange(4), 4)
  f = jax.jit(lambda p: maskc.materialize("causal & document(seg)", 16, q_positions=p,
                                          kv_positions=p, operands={"seg": seg}))
  dense = maskc.materialize("causal & document(seg)", 16, operands={"seg": seg})
  assert np.array_equal(np.asarray(f(jnp.asarray(p))), dense[p][:, p])


@pytest.mark.parametrize("kwargs, error", [
    (dict(q_offset=2, q_positions=np.arange(4)), maskc.MaskValueError),
    (dict(q_positions=np.arange(5)), maskc.MaskValueError),
    (dict(q_positions=np.arange(4.0)), maskc.MaskTypeError),
    (dict(kv_positions=np.zeros((2, 3, 4), int)), maskc.MaskValueError),
])
def test_bad_positions_raise(kwargs, error):
  with pytest.raises(error):
    maskc.materialize("causal", 4, **kwargs)


def test_reads_beyond_an_operand_at_the_given_positions_raise():
  with pytest.raises(maskc.OperandError):
    maskc.materialize("document(seg)", 4, q_positions=np.array([0, 1, 2, 9]),
                      operands={"seg": np.zeros(8, int)})
  out = maskc.materialize("document(seg)", 4, q_positions=np.array([0, 1, 2, 7]),
                          operands={"seg": np.arange(8) // 4})
  assert np.array_equal(out[3], [False, False, False, False])


# ----------------------------------------------------------------------------- lowering


@hypothesis.given(masks(), st.integers(1, 24), st.integers(0, 2**16), st.sampled_from([2, 3, 4]))
def test_lowering_is_sound_for_random_permutations(m, n, seed, block):
  rng = np.random.default_rng(seed)
  p, pk = rng.permutation(n), rng.permutation(n)
  ops = operand_values(n, seed)
  dense = maskc.materialize(m, n, operands=ops)[p][:, pk]
  truth = tile_states(dense, block, block)
  bm = maskc.compile(m, n, block_q=block, block_kv=block, operands=ops, q_positions=p,
                     kv_positions=pk)
  assert_sound(bm.grid, dense, block, block, "rows")
  assert_sound(col_grid(bm), dense, block, block, "columns")
  assert np.array_equal(bm.to_dense(), dense)
  exact = maskc.compile(m, n, block_q=block, block_kv=block, operands=ops, q_positions=p,
                        kv_positions=pk, exact=True)
  assert np.array_equal(exact.grid, truth)


@hypothesis.given(prelude_combinations(), st.sampled_from(["zigzag", "striped"]),
                  st.sampled_from([2, 4]), st.integers(0, 2**16))
def test_lowering_is_exact_for_zigzag_and_striped(m, layout, shards, seed):
  n, block = 32, 4
  p = zigzag(n, shards) if layout == "zigzag" else striped(n, shards, block)
  ops = operand_values(n, seed)
  truth = tile_states(maskc.materialize(m, n, operands=ops)[p][:, p], block, block)
  bm = maskc.compile(m, n, block_q=block, block_kv=block, operands=ops, q_positions=p,
                     kv_positions=p)
  assert np.array_equal(bm.grid, truth)
  assert np.array_equal(col_grid(bm), truth)


def test_zigzag_runs_are_exact_without_refinement():
  # A non-prelude mask is not refined by evaluation: exactness comes from the analysis
  # over dense tiles (each tile's positions are consecutive) alone.
  n, block = 64, 8
  p = zigzag(n, 4)
  m = maskc.ir.q >= maskc.ir.k
  truth = tile_states(maskc.materialize("causal", n)[p][:, p], block, block)
  bm = maskc.compile(m, n, block_q=block, block_kv=block, q_positions=p, kv_positions=p)
  assert np.array_equal(bm.grid, truth)


# A jit compile per example: a share by default, all with `-m slow` (sampling.py).
@pytest.mark.parametrize("part", PARTS)
def test_traced_positions_compile_equals_static(part):
  hypothesis.settings(max_examples=count(15, part))(hypothesis.given(
      prelude_combinations(), st.integers(0, 2**16))(_check_traced_positions))()


def _check_traced_positions(m, seed):
  n, block = 16, 4
  rng = np.random.default_rng(seed)
  p = rng.permutation(n)
  ops = operand_values(n, seed)
  static = maskc.compile(m, n, block_q=block, block_kv=block, operands=ops, q_positions=p,
                         kv_positions=p)
  f = jax.jit(lambda p: maskc.compile(m, n, block_q=block, block_kv=block, operands=ops,
                                      q_positions=p, kv_positions=p).grid)
  truth = tile_states(maskc.materialize(m, n, operands=ops)[p][:, p], block, block)
  assert np.array_equal(np.asarray(f(jnp.asarray(p))), truth)
  assert np.array_equal(static.grid, truth)


def test_batched_positions_compile_per_row():
  n, block = 16, 4
  p = np.stack([zigzag(n, 2), np.random.default_rng(3).permutation(n)])
  seg = np.repeat(np.arange(4), 4)
  bm = maskc.compile("causal & document(seg)", n, block_q=block, block_kv=block,
                     q_positions=p, kv_positions=p, operands={"seg": seg})
  assert bm.batch == 2
  dense = maskc.materialize("causal & document(seg)", n, operands={"seg": seg})
  for b in range(2):
    truth = tile_states(dense[p[b]][:, p[b]], block, block)
    assert np.array_equal(bm.grid[b], truth)
    assert np.array_equal(bm.to_dense()[b], dense[p[b]][:, p[b]])


def test_positions_drop_row_facts_and_keep_segments():
  seg = np.repeat(np.arange(2), 4)
  p = np.arange(8)[::-1].copy()
  bm = maskc.compile("causal & document(seg)", 8, block_q=4, block_kv=4, q_positions=p,
                     operands={"seg": seg})
  pred = bm.predicates[0]
  assert pred.band == (None, None) and pred.chunk is None and len(pred.segments) == 1
  assert not any(i.op in ("q", "k") for i in pred.program)


# ----------------------------------------------------------------------------- attention


def reference_attention(q, k, v, allowed):
  """Softmax attention in NumPy with a dense `[B?, Lq, Lk]` mask; fully masked rows are 0."""
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  allowed = np.broadcast_to(allowed if allowed.ndim == 3 else allowed[None],
                            (q.shape[0],) + allowed.shape[-2:])[:, None]
  s = np.where(allowed, s, -np.inf)
  mx = np.max(np.where(allowed, s, -1e30), axis=-1, keepdims=True)
  e = np.where(allowed, np.exp(s - mx), 0.0)
  w = e / np.maximum(e.sum(-1, keepdims=True), 1e-30)
  return np.einsum("bhqk,bkhd->bqhd", w, v)


@pytest.mark.parametrize("backend", ["xla", "dense"])
@pytest.mark.parametrize("text", ["causal", "sliding(5) | global(2)", "causal & document(seg)"])
def test_attention_with_positions_matches_numpy(backend, text):
  rng = np.random.default_rng(0)
  n, h, d = 32, 2, 8
  q, k, v = (rng.standard_normal((2, n, h, d)).astype(np.float32) for _ in range(3))
  seg = np.repeat(np.arange(4), 8)
  ops = {"seg": seg} if "seg" in text else {}
  p = zigzag(n, 2)
  blocks = {} if backend == "dense" else dict(block_q=8, block_kv=8)
  out = maskc.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), text, operands=ops,
                        backend=backend, q_positions=p, kv_positions=p, **blocks)
  allowed = maskc.materialize(text, n, operands=ops, q_positions=p, kv_positions=p)
  np.testing.assert_allclose(np.asarray(out), reference_attention(q, k, v, allowed),
                             rtol=1e-5, atol=1e-5)
  qj, kj, vj = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  f = jax.jit(lambda p: maskc.attention(qj, kj, vj, text, operands=ops, backend=backend,
                                        q_positions=p, kv_positions=p, **blocks))
  np.testing.assert_allclose(np.asarray(f(jnp.asarray(p))), reference_attention(q, k, v, allowed),
                             rtol=1e-5, atol=1e-5)
