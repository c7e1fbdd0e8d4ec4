"""Splash MaskInfo laid out for a mesh (`head_shards`, `q_seq_shards`), and the kernel on it.

`maskc.kernels.splash.mask_info(bm, head_shards=, q_seq_shards=)` must give what JAX splash's own
`process_mask` / `process_mask_dkv` give with those arguments (equal up to the
numbering of deduplicated partial blocks, as in `tests/test_splash_info.py`), for
the masks splash expresses: causal, local, chunked causal, full and a NumpyMask
of a random mask; also per-head masks and splash's dynamic (traced) layout. The
kernel from `maskc.kernels.splash.jax_kernel.make_kernel` runs under `jax.shard_map` on 8
fake CPU devices in a subprocess (`tests/splash_shards_worker.py`, slow), and
here on one device by running each shard's slice of the MaskInfo by hand.
"""

from __future__ import annotations

import os
import sys

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from jax.experimental.pallas.ops.tpu.splash_attention import (
  splash_attention_mask as sm,
  splash_attention_mask_info as smi,
)

import maskc
from maskc.kernels.splash import jax_kernel as splash, mask_info

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_devices  # noqa: E402
import splash_shards_worker  # noqa: E402
from helpers import assert_same_info  # noqa: E402

L = 512
BLOCK = 64
SHARDS = [(hs, qs) for hs in (1, 2) for qs in (1, 2, 4)]
HEADS = 4


def theirs(masks, head_shards: int, q_seq_shards: int, block: int = BLOCK):
  """Splash's own `(fwd, dkv)` MaskInfos for a multi-head mask."""
  mh = sm.MultiHeadMask(tuple(masks))
  kw = dict(head_shards=head_shards, q_seq_shards=q_seq_shards)
  fwd, _ = smi.process_mask(mh, (block, block), **kw)
  dkv, _ = smi.process_mask_dkv(mh, (block, block), **kw)
  return fwd, dkv


def check_same(bm, their_masks, hs: int, qs: int, **kw) -> None:
  fwd, dq, dkv, _ = mask_info(bm, head_shards=hs, q_seq_shards=qs, **kw)
  t_fwd, t_dkv = theirs(their_masks, hs, qs, bm.block_q)
  assert_same_info(fwd, t_fwd)
  assert_same_info(dq, t_fwd)
  assert_same_info(dkv, t_dkv)


@pytest.mark.parametrize("hs, qs", SHARDS)
@pytest.mark.parametrize("name", ["causal", "local", "chunked"])
def test_computable_masks_match_splash(name, hs, qs):
  """Splash's own mask classes: evaluated in the kernel (mask function, q_sequence)."""
  text, their = {
      "causal": ("causal", sm.CausalMask((L, L))),
      "local": ("local(100, 20)", sm.LocalMask((L, L), (100, 20), 0)),
      "chunked": ("causal & chunk(96)", sm.ChunkedCausalMask((L, L), 96)),
  }[name]
  bm = maskc.compile(text, L, block_q=BLOCK, block_kv=BLOCK)
  check_same(bm, [their] * HEADS, hs, qs)


@pytest.mark.parametrize("hs, qs", SHARDS)
def test_numpy_mask_matches_splash(hs, qs):
  """A random mask as splash's NumpyMask: stored partial blocks, empty rows and columns."""
  m = splash_shards_worker.pattern(3)
  bm = maskc.compile("m[q, k]", L, block_q=BLOCK, block_kv=BLOCK, operands={"m": m})
  check_same(bm, [sm.NumpyMask(m)] * HEADS, hs, qs)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), density=st.sampled_from([0.002, 0.02, 0.3]),
       shards=st.sampled_from(SHARDS), tiles=st.sampled_from([(64, 64), (32, 128), (128, 64)]))
def test_random_masks_match_splash(seed, density, shards, tiles):
  """Random masks with whole empty q tiles, so shards shrink to different widths."""
  rng = np.random.default_rng(seed)
  n = 512
  m = rng.random((n, n)) < density
  m[rng.random(n) < 0.3] = False
  m[:, rng.random(n) < 0.3] = False
  m[0, 0] = True                                  # splash asserts on a wholly empty mask
  bq, bk = tiles
  bm = maskc.compile("m[q, k]", n, block_q=bq, block_kv=bk, operands={"m": m})
  hs, qs = shards
  kw = dict(head_shards=hs, q_seq_shards=qs)
  fwd, dq, dkv, _ = mask_info(bm, **kw)
  mh = sm.MultiHeadMask((sm.NumpyMask(m),) * 2)
  t_fwd, _ = smi.process_mask(mh, (bq, bk), **kw)
  t_dkv, _ = smi.process_mask_dkv(mh, (bq, bk), **kw)
  assert_same_info(fwd, t_fwd)
  assert_same_info(dkv, t_dkv)


@pytest.mark.parametrize("hs, qs", SHARDS)
def test_full_mask(hs, qs):
  """Splash's FullMask: equal at one q shard; with more, splash's own `process_mask`
  fails (no partial blocks to pad), so ours is checked against the layout itself."""
  bm = maskc.compile("full", L, block_q=BLOCK, block_kv=BLOCK)
  n = L // BLOCK
  if qs == 1:
    check_same(bm, [sm.FullMask((L, L))] * HEADS, hs, qs, use_mask_function=False)
    return
  with pytest.raises(ValueError):
    theirs([sm.FullMask((L, L))] * HEADS, hs, qs)
  fwd, _, dkv, _ = mask_info(bm, head_shards=hs, q_seq_shards=qs,
                                    use_mask_function=False)
  for info in (fwd, dkv):
    assert info.block_mask.shape == (hs, n, n)
    np.testing.assert_array_equal(info.block_mask, 2)
    assert info.mask_next is None and info.partial_mask_blocks is None
  rows, cols = np.indices((n, n))
  np.testing.assert_array_equal(fwd.data_next, np.broadcast_to(cols, (hs, n, n)))
  np.testing.assert_array_equal(dkv.data_next, np.broadcast_to(rows % (n // qs), (hs, n, n)))


@pytest.mark.parametrize("hs, qs", SHARDS)
@pytest.mark.parametrize("order", ["AABB", "ABAB"])
def test_per_head_masks_match_splash(order, hs, qs):
  """A mask per head: one row per head shard when its heads share a mask, else per head."""
  texts = {"A": "causal", "B": "sliding(100) | sink(5)"}
  heads = [texts[c] for c in order]
  bm = maskc.compile(heads, L, block_q=BLOCK, block_kv=BLOCK)
  dense = {t: np.asarray(maskc.materialize(t, L)) for t in texts.values()}
  check_same(bm, [sm.NumpyMask(dense[t]) for t in heads], hs, qs)
  fwd, _, _, _ = mask_info(bm, head_shards=hs, q_seq_shards=qs)
  assert fwd.block_mask.shape[0] == (hs if order == "AABB" and hs == 2 else 4)


@pytest.mark.parametrize("hs, qs", SHARDS)
def test_dynamic_layout_matches_splash(hs, qs):
  """A traced map: splash's dynamic MaskInfo of the mask given to each head shard."""
  n = 256
  m = splash_shards_worker.pattern(5)[:n, :n]

  def infos(m):
    bm = maskc.compile("causal & m[q, k]", n, block_q=BLOCK, block_kv=BLOCK, operands={"m": m})
    assert not bm.is_static
    fwd, _, dkv, _ = mask_info(bm, head_shards=hs, q_seq_shards=qs)
    return tuple(info[:4] for info in (fwd, dkv))

  ours = jax.jit(infos)(jnp.asarray(m))
  dense = jnp.asarray(np.tril(np.ones((n, n), bool)) & m)
  full = jnp.broadcast_to(dense, (hs, n, n))
  kw = dict(head_shards=hs, q_seq_shards=qs)
  t_fwd, _ = smi.process_dynamic_mask(full, (BLOCK, BLOCK), **kw)
  t_dkv, _ = smi.process_dynamic_mask_dkv(full, (BLOCK, BLOCK), **kw)
  for mine, want in zip(ours, (t_fwd, t_dkv)):
    for field, a in zip(("data_next", "mask_next", "block_mask", "partial_mask_blocks"), mine):
      b = getattr(want, field)
      assert a.shape == b.shape and a.dtype == b.dtype, (field, a.shape, b.shape)
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=field)


def test_shards_must_divide_the_tiles_and_heads():
  bm = maskc.compile("causal", 384, block_q=128, block_kv=128)
  with pytest.raises(maskc.MaskValueError, match="q_seq_shards=2"):
    mask_info(bm, q_seq_shards=2)
  with pytest.raises(maskc.MaskValueError, match="positive"):
    mask_info(bm, head_shards=0)
  heads = maskc.compile(["causal", "full", "causal"], 256, block_q=128, block_kv=128)
  with pytest.raises(maskc.MaskValueError, match="head_shards=2"):
    mask_info(heads, head_shards=2)
  with pytest.raises(maskc.MaskValueError, match="multiple"):
    splash.make_kernel(maskc.compile("causal", 200, block_q=128, block_kv=128))


def test_kernel_on_each_shards_slice_matches_dense():
  """Without a mesh: each (head shard, q shard) runs the kernel on its slice of the
  MaskInfo and its rows of q, as `shard_map` would hand them out."""
  n, hs, qs, h, d = 256, 2, 2, 2, 16
  mask = "local(40, 0) | k < 3"
  bm = maskc.compile(mask, n, block_q=64, block_kv=128)
  kernel = splash.make_kernel(bm, head_shards=hs, q_seq_shards=qs, interpret=True)
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (h, n, d), jnp.float32) / np.sqrt(d)
  k = jax.random.normal(keys[1], (h, n, d), jnp.float32)
  v = jax.random.normal(keys[2], (h, n, d), jnp.float32)

  def shard(info, a, b):
    if info is None:
      return None
    def cut(x):
      return None if x is None else x[a * x.shape[0] // hs:(a + 1) * x.shape[0] // hs,
                                        b * x.shape[1] // qs:(b + 1) * x.shape[1] // qs]
    seq = None if info.q_sequence is None else info.q_sequence.reshape(qs, -1)[b]
    return info._replace(data_next=cut(info.data_next), mask_next=cut(info.mask_next),
                         block_mask=cut(info.block_mask), q_sequence=seq)

  rows = n // qs
  out = np.zeros((h, n, d), np.float32)
  for a in range(hs):
    for b in range(qs):
      part = type(kernel)(*(shard(i, a, b) for i in (kernel.fwd_mask_info, kernel.dq_mask_info,
                                                      kernel.dkv_mask_info)), **kernel.kwargs)
      hsl, qsl = slice(a * h // hs, (a + 1) * h // hs), slice(b * rows, (b + 1) * rows)
      out[hsl, qsl] = np.asarray(part(q[hsl, qsl], k[hsl], v[hsl]))
  allowed = np.asarray(maskc.materialize(mask, n))
  s = np.einsum("hqd,hkd->hqk", np.asarray(q, np.float64), np.asarray(k, np.float64))
  s = np.where(allowed, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  want = np.einsum("hqk,hkd->hqd", p / p.sum(-1, keepdims=True), np.asarray(v, np.float64))
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory):
  return fake_devices.run_worker("splash_shards_worker.py", tmp_path_factory, timeout=1800)


@pytest.mark.slow
@pytest.mark.parametrize("case", splash_shards_worker.CASES, ids=splash_shards_worker.case_id)
def test_sharded_kernel_on_8_devices_matches_dense(mesh_results, case):
  res = mesh_results[splash_shards_worker.case_id(case)]
  assert res["shape"] == [2, case[3], splash_shards_worker.L, 32], res
  assert res["forward"] < 1e-5, res
  if case[-1]:
    for name in "qkv":
      assert res[f"grad_{name}"] < 1e-5, res
