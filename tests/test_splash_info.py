"""`maskc.kernels.splash.mask_info(bm)` against JAX splash's own `process_mask` on the same masks.

Equal up to the order of the deduplicated partial blocks: `block_mask` and
`data_next` exactly, the set of partial blocks, and `mask_next` pointing at equal
blocks everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys

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
from maskc.kernels.splash import as_splash_mask, mask_info


def theirs(masks, block_q: int, block_kv: int):
  mh = sm.MultiHeadMask(tuple(masks))
  fwd, fn = smi.process_mask(mh, (block_q, block_kv))
  dkv, fn_dkv = smi.process_mask_dkv(mh, (block_q, block_kv))
  return fwd, dkv, fn


def ours(mask, q_len, kv_len, block_q, block_kv, *, q_offset=None, operands=None,
         use_mask_function=None):
  bm = maskc.compile(mask, q_len, kv_len, block_q=block_q, block_kv=block_kv, q_offset=q_offset,
                     operands=operands)
  fwd, dq, dkv, fn = mask_info(bm, use_mask_function=use_mask_function)
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
    mask_info(bm)


def test_batched_operands_name_another_backend():
  seg = np.zeros((2, 256), np.int32)
  bm = maskc.compile("causal & document(seg)", 256, block_q=128, block_kv=128,
                     operands={"seg": seg})
  with pytest.raises(maskc.BackendError, match="xla"):
    mask_info(bm)


def test_mask_function_is_hashable_by_value():
  a = mask_info(maskc.compile("sliding(100)", 512, block_q=128, block_kv=128))[3]
  b = mask_info(maskc.compile("sliding(100)", 512, block_q=64, block_kv=128))[3]
  assert a == b and hash(a) == hash(b)


def test_only_partial_tiles_are_evaluated(monkeypatch):
  from maskc.compiled import predicate
  calls = []
  real = predicate.evaluate

  def counting(pred, xp, q, k, fetch):
    out = real(pred, xp, q, k, fetch)
    calls.append(np.asarray(out).shape[0])
    return out

  monkeypatch.setattr(predicate, "evaluate", counting)
  bm = maskc.compile("sliding(1000)", 1 << 15, block_q=512, block_kv=512)
  mask_info(bm, use_mask_function=False)
  assert sum(calls) == bm.counts["partial"]


# ----------------------------------------------------------------------------- bound masks
# `maskc.ComputableMask` is a plain sliceable mask; `as_splash_mask` makes it splash's own
# `Mask`, which splash's `process_mask` must treat exactly as its own mask classes.


def process(masks, block_shape):
  info, _ = smi.process_mask(sm.MultiHeadMask(tuple(masks)), block_shape)
  return info


def assert_identical_info(a, b):
  for name in ("block_mask", "data_next", "mask_next", "partial_mask_blocks", "q_sequence"):
    x, y = getattr(a, name), getattr(b, name)
    if x is None or y is None:
      assert x is None and y is None, name
    else:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


@pytest.mark.parametrize("q_len,kv_len,block", [(256, 256, (64, 64)), (128, 256, (64, 128)),
                                                (256, 256, (128, 64))])
def test_bound_causal_is_splash_causal(q_len, kv_len, block):
  cm = as_splash_mask(maskc.parse("causal").bind(q_len, kv_len))
  theirs = sm.CausalMask((q_len, kv_len), offset=kv_len - q_len)
  assert_identical_info(process([cm], block), process([theirs], block))


@pytest.mark.parametrize("window", [(32, 0), (100, 20), (0, 64)])
def test_bound_local_is_splash_local(window):
  cm = as_splash_mask(maskc.parse(f"local({window[0]}, {window[1]})").bind(256))
  theirs = sm.LocalMask((256, 256), window, offset=0)
  assert_identical_info(process([cm], (64, 64)), process([theirs], (64, 64)))


def test_bound_chunked_causal_is_splash_chunked_causal():
  cm = as_splash_mask(maskc.parse("causal & chunk(64)").bind(256))
  theirs = sm.ChunkedCausalMask((256, 256), chunk_size=64)
  assert_identical_info(process([cm], (32, 32)), process([theirs], (32, 32)))


def test_bound_masks_per_head():
  heads = [as_splash_mask(maskc.parse(t).bind(256)) for t in ("causal", "local(64, 0)")]
  theirs = [sm.CausalMask((256, 256)), sm.LocalMask((256, 256), (64, 0), 0)]
  assert_identical_info(process(heads, (64, 64)), process(theirs, (64, 64)))


def test_bound_mask_with_array_operands_is_stored_blocks():
  seg = np.repeat(np.arange(4), 64)
  bound = maskc.parse("causal & document(seg)").bind(256, operands={"seg": seg})
  cm = as_splash_mask(bound)
  assert not hasattr(cm, "mask_function")
  assert_identical_info(process([cm], (64, 64)), process([sm.NumpyMask(bound[:, :])], (64, 64)))


def test_bound_masks_combine_with_splash_masks():
  bound = maskc.parse("sliding(48)").bind(128)
  ours = as_splash_mask(bound) & sm.CausalMask((128, 128))
  assert isinstance(ours, sm.LogicalAnd)
  np.testing.assert_array_equal(ours[:, :], bound[:, :])


def test_bound_splash_masks_hash_by_value():
  a, b = (as_splash_mask(maskc.parse("sliding(48)").bind(128)) for _ in range(2))
  assert a == b and hash(a) == hash(b)
  assert a != as_splash_mask(maskc.parse("sliding(47)").bind(128))


def test_as_splash_mask_takes_bound_masks_only():
  with pytest.raises(maskc.MaskValueError, match="bound mask"):
    as_splash_mask(maskc.parse("causal"))
  # the bound mask itself is no splash mask: the compiler imports no kernel
  assert not isinstance(maskc.parse("causal").bind(8), sm.Mask)


def test_blockmap_names_where_its_kernel_formats_went():
  bm = maskc.compile("causal", 256, block_q=128, block_kv=128)
  with pytest.raises(AttributeError, match=r"maskc\.kernels\.splash\.mask_info\(bm"):
    bm.splash()
  with pytest.raises(AttributeError, match=r"maskc\.kernels\.splash\.tokamax_mask_info\(bm"):
    bm.tokamax_splash()
  with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
    bm.nonsense  # noqa: B018
  assert not hasattr(bm, "splash")


def test_the_formats_are_reached_from_maskc_alone():
  """`maskc.kernels.splash.mask_info(bm)`, as the README writes it, in a fresh process: the
  kernels and their subpackages import on first access."""
  code = ("import maskc\n"
          "bm = maskc.compile('causal', 256, block_q=128, block_kv=128)\n"
          "print(maskc.kernels.splash.mask_info(bm)[0].block_mask.tolist())\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.stdout.strip() == "[[[1, 0], [2, 1]]]"
