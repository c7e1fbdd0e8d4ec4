"""`BlockMap.splash()` against JAX splash's own `process_mask` on the same masks.

Equal up to the order of the deduplicated partial blocks: `block_mask` and
`data_next` exactly, the set of partial blocks, and `mask_next` pointing at equal
blocks everywhere.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from jax.experimental.pallas.ops.tpu.splash_attention import (
  splash_attention_mask as sm,
  splash_attention_mask_info as smi,
)

import maskc
from helpers import assert_same_info
from maskc.compiled.splash_info import splash_mask_info


def theirs(masks, block_q: int, block_kv: int):
  mh = sm.MultiHeadMask(tuple(masks))
  fwd, fn = smi.process_mask(mh, (block_q, block_kv))
  dkv, fn_dkv = smi.process_mask_dkv(mh, (block_q, block_kv))
  return fwd, dkv, fn


def ours(mask, q_len, kv_len, block_q, block_kv, *, q_offset=None, operands=None,
         use_mask_function=None):
  bm = maskc.compile(mask, q_len, kv_len, block_q=block_q, block_kv=block_kv, q_offset=q_offset,
                     operands=operands)
  fwd, dq, dkv, fn = splash_mask_info(bm, use_mask_function=use_mask_function)
  return fwd, dkv, fn, dq


def check(our_mask, their_masks, q_len, kv_len, bq, bk, **kw):
  fwd, dkv, fn, dq = ours(our_mask, q_len, kv_len, bq, bk, **kw)
  t_fwd, t_dkv, t_fn = theirs(their_masks, bq, bk)
  assert_same_info(fwd, t_fwd)
  assert_same_info(dkv, t_dkv)
  assert dq is fwd
  assert (fn is None) == (t_fn is None)
  return fn, t_fn


TILES = st.sampled_from([(64, 64), (64, 128), (128, 64), (128, 128)])
LENGTHS = st.sampled_from([256, 512])


@settings(max_examples=20, deadline=None)
@given(LENGTHS, LENGTHS, TILES, st.integers(-64, 300))
def test_causal(q_len, kv_len, tiles, offset):
  bq, bk = tiles
  fn, t_fn = check("causal", [sm.CausalMask((q_len, kv_len), offset=offset)], q_len, kv_len,
                   bq, bk, q_offset=offset)
  q = np.arange(q_len)[:, None]
  k = np.arange(kv_len)[None, :]
  np.testing.assert_array_equal(np.asarray(fn(q, k)), np.asarray(t_fn(q, k)))


@settings(max_examples=20, deadline=None)
@given(LENGTHS, TILES, st.integers(0, 300), st.integers(0, 300), st.integers(-40, 40))
def test_local_windows(length, tiles, left, right, offset):
  bq, bk = tiles
  fn, t_fn = check(f"local({left}, {right})",
                   [sm.LocalMask((length, length), window_size=(left, right), offset=offset)],
                   length, length, bq, bk, q_offset=offset)
  q = np.arange(length)[:, None]
  k = np.arange(length)[None, :]
  np.testing.assert_array_equal(np.asarray(fn(q, k)), np.asarray(t_fn(q, k)))


@settings(max_examples=15, deadline=None)
@given(LENGTHS, TILES, st.integers(1, 300))
def test_chunked_causal(length, tiles, chunk):
  bq, bk = tiles
  check(f"causal & chunk({chunk})", [sm.ChunkedCausalMask((length, length), chunk)], length,
        length, bq, bk, q_offset=0)


@pytest.mark.parametrize("tiles", [(64, 64), (128, 64)])
def test_full(tiles):
  check("full", [sm.FullMask((256, 512))], 256, 512, *tiles, q_offset=0, use_mask_function=False)


@settings(max_examples=15, deadline=None)
@given(TILES, st.integers(0, 2**16), st.floats(0.0, 1.0))
def test_numpy_random(tiles, seed, density):
  rng = np.random.default_rng(seed)
  # Blocky random masks: whole tiles empty or full, some mixed, some repeated.
  base = rng.random((8, 8)) < density
  dense = np.kron(base, np.ones((32, 32), bool))
  dense ^= rng.random(dense.shape) < 0.01
  check("allowed[q, k]", [sm.NumpyMask(dense)], 256, 256, *tiles,
        operands={"allowed": dense})


def test_computable_masks_as_stored_blocks():
  # Splash's computable masks given as NumpyMask store their partial blocks; so do ours.
  for text, their in [("causal", sm.CausalMask((512, 512))),
                      ("local(100, 30)", sm.LocalMask((512, 512), (100, 30), 0)),
                      ("causal & chunk(96)", sm.ChunkedCausalMask((512, 512), 96))]:
    dense = their[:, :]
    check(text, [sm.NumpyMask(dense)], 512, 512, 64, 128, q_offset=0, use_mask_function=False)


def test_multi_head_masks():
  q_len = kv_len = 512
  texts = ["causal", "local(64, 0)", "causal", "causal & chunk(128)"]
  their = [sm.NumpyMask(maskc.materialize(t, q_len, kv_len)) for t in texts]
  check(texts, their, q_len, kv_len, 64, 128)
  check(texts, their, q_len, kv_len, 128, 64)


def test_same_mask_on_every_head_is_stored_once():
  fwd, dkv, _, _ = ours(["causal"] * 4, 512, 512, 128, 128)
  t_fwd, t_dkv, _ = theirs([sm.CausalMask((512, 512))] * 4, 128, 128)
  assert_same_info(fwd, t_fwd)
  assert_same_info(dkv, t_dkv)
  assert fwd.block_mask.shape[0] == 1


def test_lengths_must_be_multiples_of_tiles():
  bm = maskc.compile("causal", 200, block_q=64, block_kv=64)
  with pytest.raises(maskc.MaskValueError, match="multiples"):
    bm.splash()


def test_batched_operands_name_another_backend():
  seg = np.zeros((2, 256), np.int32)
  bm = maskc.compile("causal & document(seg)", 256, block_q=128, block_kv=128,
                     operands={"seg": seg})
  with pytest.raises(maskc.BackendError, match="xla"):
    bm.splash()


def test_mask_function_is_hashable_by_value():
  a = maskc.compile("sliding(100)", 512, block_q=128, block_kv=128).splash()[3]
  b = maskc.compile("sliding(100)", 512, block_q=64, block_kv=128).splash()[3]
  assert a == b and hash(a) == hash(b)


def test_only_partial_tiles_are_evaluated(monkeypatch):
  from maskc.compiled import splash_info as _splash_info
  calls = []
  real = _splash_info._predicate.evaluate

  def counting(pred, xp, q, k, fetch):
    out = real(pred, xp, q, k, fetch)
    calls.append(np.asarray(out).shape[0])
    return out

  monkeypatch.setattr(_splash_info._predicate, "evaluate", counting)
  bm = maskc.compile("sliding(1000)", 1 << 15, block_q=512, block_kv=512)
  splash_mask_info(bm, use_mask_function=False)
  assert sum(calls) == bm.counts["partial"]
