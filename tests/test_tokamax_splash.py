"""tokamax's splash attention fed maskc's MaskInfo (`maskc.kernels.splash.tokamax_kernel`).

- `maskc.kernels.splash.tokamax_mask_info(bm)` against tokamax's own `process_mask` /
  `process_dynamic_mask` on the same masks: equal field by field, but for the
  write-only steps maskc schedules for q tiles without an active tile;
- `as_tokamax(cm)`: a bound mask handed to tokamax equals the dense mask, and
  tokamax's `process_mask` of it equals maskc's MaskInfo;
- `run_with_lse` against the xla backend, gradients through the log-sum-exp;
- the kernels cross-lowered for TPU (Mosaic), forward and fused backward.

The kernel test matrix (against the dense reference, forward and backward) is
`TestSplashTokamax` in tests/test_kernels.py. tokamax needs Python >= 3.12 and
jax >= 0.11.1: elsewhere this module skips.
"""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

pytest.importorskip("tokamax")

from tokamax._src.ops.experimental.tpu.splash_attention import (  # noqa: E402
  splash_attention_kernel as tk,
  splash_attention_mask as tm,
  splash_attention_mask_info as tmi,
)

import maskc  # noqa: E402
from helpers import assert_close  # noqa: E402
from maskc.kernels import api, xla  # noqa: E402
from maskc.kernels.splash import (
  tokamax_kernel as tokamax_splash,  # noqa: E402
  tokamax_mask_info,  # noqa: E402
)

TILES = st.sampled_from([(128, 128), (128, 256), (256, 128), (64, 128)])
LENGTHS = st.sampled_from([512, 1024])


def without_write_only_steps(info, shards: int):
  """A forward MaskInfo with maskc's write-only steps (`block_mask == 0`) dropped, relaid out
  as `process_mask` pads its shards (what tokamax's own builder gives)."""
  if info.active_rows is None:
    return info
  n = info.active_rows.size // shards
  parts = []
  for s in range(shards):
    valid = slice(s * n, s * n + int(info.num_active_blocks[s]))
    keep = np.asarray(info.block_mask[valid]) != 0
    parts.append([None if a is None else np.asarray(a[valid])[keep]
                  for a in (info.mask_next, info.active_rows, info.active_cols, info.block_mask)])
  size = max(p[1].size for p in parts)

  def cat(k):
    if parts[0][k] is None:
      return None
    return np.concatenate([np.pad(p[k].astype(np.int64), (0, size - p[k].size),
                                  constant_values=-1) for p in parts])

  return info._replace(mask_next=cat(0), active_rows=cat(1), active_cols=cat(2),
                       block_mask=cat(3),
                       num_active_blocks=np.array([p[1].size for p in parts], np.int32))


def assert_same(ours, theirs, what: str, exact_types: bool = True) -> None:
  """Field by field: the same arrays (and dtypes when `exact_types`), None where None."""
  for field in theirs._fields:
    a, b = getattr(ours, field), getattr(theirs, field)
    assert (a is None) == (b is None), f"{what}: {field} is {a} against {b}"
    if a is None:
      continue
    a, b = np.asarray(a), np.asarray(b)
    if exact_types:
      assert a.dtype == b.dtype, f"{what}: {field} dtype {a.dtype} against {b.dtype}"
    np.testing.assert_array_equal(a, b, err_msg=f"{what}: {field}")


def check(text: str, their_mask, q_len: int, kv_len: int, bq: int, bk: int, *,
          shards: int = 1, dkv_active: bool = False, operands=None, q_offset=None,
          use_mask_function=None):
  """maskc's MaskInfo of `text` against tokamax's `process_mask` of `their_mask`."""
  bm = maskc.compile(text, q_len, kv_len, block_q=bq, block_kv=bk, operands=operands,
                     q_offset=q_offset)
  fwd, dkv, fn = tokamax_mask_info(bm, q_seq_shards=shards, dkv_active=dkv_active,
                                   use_mask_function=use_mask_function)
  t_fwd, t_fn = tmi.process_mask(their_mask, (bq, bk), q_seq_shards=shards)
  t_dkv, _ = tmi.process_mask_dkv(their_mask, (bq, bk), q_seq_shards=shards,
                                  return_dynamic_grid=dkv_active)
  stripped = without_write_only_steps(fwd, shards)
  assert_same(stripped, t_fwd, f"fwd {text}", exact_types=stripped is fwd)
  assert_same(dkv, t_dkv, f"dkv {text}")
  assert (fn is None) == (t_fn is None)
  if fn is not None:
    q = np.arange(q_len)[:, None]
    k = np.arange(kv_len)[None, :]
    np.testing.assert_array_equal(np.asarray(fn(q, k)), np.asarray(t_fn(q, k)))
  return fwd


# ----------------------------------------------------------------------------- MaskInfo


@settings(max_examples=15, deadline=None)
@given(LENGTHS, LENGTHS, TILES, st.integers(-64, 300), st.sampled_from([1, 2]), st.booleans())
def test_causal_equals_process_mask(q_len, kv_len, tiles, offset, shards, dkv_active):
  check("causal", tm.CausalMask((q_len, kv_len), offset=offset), q_len, kv_len, *tiles,
        shards=shards, dkv_active=dkv_active, q_offset=offset)


@settings(max_examples=15, deadline=None)
@given(LENGTHS, TILES, st.integers(0, 300), st.integers(0, 300), st.sampled_from([1, 2]),
       st.booleans())
def test_local_windows_equal_process_mask(length, tiles, left, right, shards, dkv_active):
  check(f"local({left}, {right})", tm.LocalMask((length, length), (left, right), 0), length,
        length, *tiles, shards=shards, dkv_active=dkv_active, q_offset=0)


@settings(max_examples=10, deadline=None)
@given(LENGTHS, TILES, st.integers(1, 300), st.booleans())
def test_chunked_causal_equals_process_mask(length, tiles, chunk, dkv_active):
  check(f"causal & chunk({chunk})", tm.ChunkedCausalMask((length, length), chunk), length,
        length, *tiles, dkv_active=dkv_active, q_offset=0)


@settings(max_examples=15, deadline=None)
@given(TILES, st.integers(0, 2**16), st.floats(0.0, 1.0), st.sampled_from([1, 2]),
       st.booleans())
def test_stored_blocks_equal_process_mask(tiles, seed, density, shards, dkv_active):
  """Blocky random masks read from an operand: partial blocks stored, deduplicated and
  numbered as tokamax numbers them; whole tile rows may be empty (write-only steps)."""
  rng = np.random.default_rng(seed)
  dense = np.kron(rng.random((8, 8)) < density, np.ones((64, 64), bool))
  dense ^= rng.random(dense.shape) < 0.01
  check("allowed[q, k]", tm.NumpyMask(dense), 512, 512, *tiles, shards=shards,
        dkv_active=dkv_active, operands={"allowed": dense})


def test_full_and_empty_tile_rows():
  # Every tile FULL: nothing to schedule or store, as in process_mask.
  fwd = check("full", tm.FullMask((256, 512)), 256, 512, 128, 128, use_mask_function=False)
  assert fwd.active_rows is None and fwd.block_mask is None
  # Query tile 1 has no allowed key: process_mask never visits it, so its output would stay
  # unwritten; maskc schedules one write-only step (1, 0) there.
  text = "q < 128 | q >= 256"
  dense = np.asarray(maskc.materialize(text, 384, 384, q_offset=0))
  fwd = check(text, tm.NumpyMask(dense), 384, 384, 128, 128, q_offset=0,
              use_mask_function=False)
  theirs, _ = tmi.process_mask(tm.NumpyMask(dense), (128, 128))
  assert 1 not in theirs.active_rows.tolist()
  steps = list(zip(fwd.active_rows.tolist(), fwd.active_cols.tolist(), fwd.block_mask.tolist()))
  assert (1, 0, 0) in steps and sum(r == 1 for r, _, _ in steps) == 1


def test_traced_map_equals_process_dynamic_mask():
  rng = np.random.default_rng(0)
  anc = (rng.random((512, 512)) < 0.3) | np.eye(512, dtype=bool)
  mask = "causal & anc[q, k]"

  @jax.jit
  def ours(anc):
    return tokamax_mask_info(maskc.compile(mask, 512, block_q=128, block_kv=128,
                                           operands={"anc": anc}))[:2]

  fwd, dkv = ours(jnp.asarray(anc))
  dense = jnp.asarray(maskc.materialize(mask, 512, operands={"anc": anc}))
  for got, want, what in ((fwd, tmi.process_dynamic_mask(dense, (128, 128)), "fwd"),
                          (dkv, tmi.process_dynamic_mask_dkv(dense, (128, 128)), "dkv")):
    n = int(want.num_active_blocks[0])
    assert int(got.num_active_blocks[0]) == n, what
    for field in ("active_rows", "active_cols", "block_mask", "partial_mask_blocks"):
      np.testing.assert_array_equal(np.asarray(getattr(got, field)),
                                    np.asarray(getattr(want, field)), err_msg=f"{what} {field}")
    # Padding slots are never visited; tokamax leaves arbitrary ids there.
    np.testing.assert_array_equal(np.asarray(got.mask_next)[:n], np.asarray(want.mask_next)[:n])


def test_per_head_maps_give_one_info_per_mask():
  bm = maskc.compile(["causal", "sliding(100)", "causal"], 512, block_q=128, block_kv=128)
  for u, their in enumerate((tm.CausalMask((512, 512)), tm.LocalMask((512, 512), (99, 0), 0))):
    fwd, dkv, _ = tokamax_mask_info(bm, mask=u)
    t_fwd, _ = tmi.process_mask(their, (128, 128))
    assert_same(fwd, t_fwd, f"head mask {u}")
  with pytest.raises(maskc.MaskValueError, match="distinct masks"):
    tokamax_mask_info(bm, mask=2)


def test_unsupported_maps_raise_with_a_hint():
  seg = np.zeros((2, 256), np.int32)
  bm = maskc.compile("causal & document(seg)", 256, block_q=128, block_kv=128,
                     operands={"seg": seg})
  with pytest.raises(maskc.BackendError, match="xla"):
    tokamax_mask_info(bm)
  with pytest.raises(maskc.MaskValueError, match="multiples"):
    tokamax_mask_info(maskc.compile("causal", 200, block_q=128, block_kv=128))
  with pytest.raises(maskc.MaskValueError, match="q tiles"):
    tokamax_mask_info(maskc.compile("causal", 384, block_q=128, block_kv=128), q_seq_shards=2)
  x = jnp.ones((1, 256, 1, 16))
  with pytest.raises(maskc.MaskValueError, match="multiples of 128"):
    tokamax_splash.run(x, x, x, maskc.compile("causal", 256, block_q=64, block_kv=128))
  with pytest.raises(maskc.MaskValueError, match="one 2-D mask"):
    tokamax_splash.make_kernel(maskc.compile(["causal", "full"], 256, block_q=128,
                                             block_kv=128))


# ----------------------------------------------------------------------------- as_tokamax


@settings(max_examples=10, deadline=None)
@given(st.sampled_from(["causal", "sliding(40) | sink(3)", "causal & chunk(24)",
                        "causal & document(seg)", "causal | bidirectional(img)"]),
       st.integers(1, 300), st.integers(0, 2**16))
def test_as_tokamax_equals_the_dense_mask(text, kv_len, seed):
  rng = np.random.default_rng(seed)
  ops = {"seg": np.sort(rng.integers(0, 4, kv_len)).astype(np.int32),
         "img": rng.random(kv_len) < 0.5}
  m = maskc.parse(text)
  ops = {s.name: ops[s.name] for s in m.operands}
  q_len = int(rng.integers(1, kv_len + 1))
  cm = m.bind(q_len, kv_len, operands=ops)
  theirs = tokamax_splash.as_tokamax(cm)
  assert isinstance(theirs, tm.Mask)
  assert theirs.shape == (q_len, kv_len)
  dense = np.asarray(maskc.materialize(text, q_len, kv_len, operands=ops))
  np.testing.assert_array_equal(theirs[:, :], dense)
  a, b = sorted(rng.integers(0, q_len + 1, 2))
  np.testing.assert_array_equal(theirs[a:b, 3:], dense[a:b, 3:])
  assert hasattr(theirs, "mask_function") == (not ops)
  assert theirs == tokamax_splash.as_tokamax(m.bind(q_len, kv_len, operands=ops))
  assert hash(theirs) == hash(tokamax_splash.as_tokamax(m.bind(q_len, kv_len, operands=ops)))


def test_process_mask_of_as_tokamax_equals_maskc_info():
  for text, ops in (("sliding(100) | sink(4)", {}),
                    ("causal & document(seg)", {"seg": np.repeat(np.arange(4), 128)})):
    cm = maskc.parse(text).bind(512, operands=ops)
    check(text, tokamax_splash.as_tokamax(cm), 512, 512, 128, 128, operands=ops)


def test_tokamax_kernel_runs_a_bound_mask():
  """tokamax builds its own kernel from `as_tokamax(cm)` (evaluating the mask in its kernel)."""
  cm = maskc.parse("sliding(100) | sink(4)").bind(256)
  config = tk.SplashConfig(block_q=128, block_kv=128, interpret=True)
  kernel = tk.make_splash_mha_single_device(tokamax_splash.as_tokamax(cm), config=config)
  assert kernel.kwargs["mask_function"] is not None
  q = jax.random.normal(jax.random.key(0), (1, 256, 2, 32))
  out = kernel(jnp.swapaxes(q[0], 0, 1) / np.sqrt(32), jnp.swapaxes(q[0], 0, 1),
               jnp.swapaxes(q[0], 0, 1))
  ref = maskc.attention(q, q, q, "sliding(100) | sink(4)", backend="dense")
  assert_close(jnp.swapaxes(out, 0, 1)[None], ref, 1e-5, "tokamax's kernel of as_tokamax(cm)")


def test_as_tokamax_refuses_batched_masks():
  cm = maskc.parse("document(seg)").bind(8, operands={"seg": np.zeros((2, 8), np.int32)})
  with pytest.raises(maskc.MaskValueError, match="2-D"):
    tokamax_splash.as_tokamax(cm)
  with pytest.raises(maskc.MaskValueError, match="bound mask"):
    tokamax_splash.as_tokamax("causal")


# ----------------------------------------------------------------------------- backends


def test_splash_resolves_to_tokamax_here():
  assert api.BACKENDS["splash"].resolved() == "splash_tokamax"
  assert api.BACKENDS["splash"].load() is tokamax_splash
  assert api.BACKENDS["splash_jax"].resolved() == "splash_jax"


def test_run_with_lse_matches_xla_with_gradients_through_the_lse():
  q, k, v = (jax.random.normal(kk, (1, 200, 2, 16)) for kk in jax.random.split(
      jax.random.key(3), 3))
  k, v = k[:, :, :1], v[:, :, :1]
  w = jax.random.normal(jax.random.key(4), (1, 200, 2, 16))
  c = jax.random.normal(jax.random.key(5), (1, 200, 2))
  # rows 0-59 of q tile 0 have no key (k >= 100 > q + 40): lse = NEG_LSE, out = 0
  bm = maskc.compile("sliding(40) & k >= 100", 200, block_q=128, block_kv=128, q_offset=0)

  def loss(fn):
    def f(q, k, v):
      out, lse = fn(q, k, v, bm)
      return (out * w).sum() + (jnp.where(lse > -1e29, lse, 0.0) * c).sum(), (out, lse)
    return jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))

  (val, (out, lse)), grads = loss(lambda *a: tokamax_splash.run_with_lse(*a, interpret=True))(
      q, k, v)
  (val_r, (out_r, lse_r)), grads_r = loss(xla.run_with_lse)(q, k, v)
  assert_close(out, out_r, 1e-5, "out")
  np.testing.assert_array_equal(np.asarray(lse)[:, :60], np.float32(xla.NEG_LSE))
  np.testing.assert_array_equal(np.asarray(out)[:, :60], 0.0)
  assert_close(jnp.where(lse_r > -1e29, lse, 0.0), jnp.where(lse_r > -1e29, lse_r, 0.0), 1e-5,
               "lse")
  for name, g, r in zip("qkv", grads, grads_r):
    assert_close(g, r, 1e-5, f"d{name}")
  per_head = maskc.compile(["causal", "full"], 128, block_q=128, block_kv=128)
  with pytest.raises(maskc.MaskValueError, match="one mask for every head"):
    tokamax_splash.run_with_lse(q[:, :128], k[:, :128], v[:, :128], per_head, interpret=True)


# ----------------------------------------------------------------------------- TPU lowering


@pytest.mark.parametrize("mask, dtype, heads, lengths", [
    ("causal", jnp.bfloat16, (4, 2), (512, 512)),                     # mask function
    ("sliding(100) | sink(4)", jnp.float32, (2, 2), (400, 400)),       # ragged: padded
    ("causal & anc[q, k]", jnp.bfloat16, (4, 1), (512, 512)),          # stored blocks
    ("causal & document(seg)", jnp.bfloat16, (2, 1), (384, 512)),      # SegmentIds
])
def test_lowers_to_mosaic_for_tpu(mask, dtype, heads, lengths):
  """Forward: one `tpu_custom_call`; with gradients: forward and tokamax's fused backward."""
  (h, hkv), (lq, lkv) = heads, lengths
  rng = np.random.default_rng(0)
  ops = {"anc": rng.random((lkv, lkv)) < 0.5,
         "seg": np.sort(rng.integers(0, 3, (2, lkv)), -1).astype(np.int32)}
  m = maskc.parse(mask)
  bm = maskc.compile(m, lq, lkv, block_q=128, block_kv=128,
                     operands={s.name: ops[s.name] for s in m.operands})
  qs = jax.ShapeDtypeStruct((2, lq, h, 128), dtype)
  ks = jax.ShapeDtypeStruct((2, lkv, hkv, 128), dtype)

  def fwd(q, k, v):
    return api.attention(q, k, v, bm, backend="splash_tokamax", interpret=False,
                         logits_soft_cap=2.0, sinks=jnp.linspace(-1.0, 1.0, h))

  def bwd(q, k, v):
    return jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)

  for f, calls in ((fwd, 1), (bwd, 2)):
    text = jax.jit(f).trace(qs, ks, ks).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == calls, (mask, f.__name__)


def test_interpret_mode_lowers_no_kernel():
  """The check can fail: interpret mode lowers to plain HLO, with no custom call."""
  bm = maskc.compile("causal", 256, block_q=128, block_kv=128)
  qs = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.float32)
  def f(q, k, v):
    return api.attention(q, k, v, bm, backend="splash_tokamax", interpret=True)
  text = jax.jit(f).trace(qs, qs, qs).lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" not in text
