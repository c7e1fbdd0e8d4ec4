"""The GPU kernels compiled by Triton and run on a real NVIDIA GPU.

The interpret-mode tests (`test_kernels.py`, `test_kernels_lse.py`) check the
kernels' arithmetic on CPU, and `test_cross_lowering.py` checks that they lower to
Triton. These check what neither can: that the compiled code on the device
computes the same function (no mask, read or tile lost in compilation, no race
between programs), forward and gradients, for the mask kinds the kernel reads
in different ways (none, per-token, pairwise, tile-constant, per head), ragged
lengths, GQA, soft caps, sinks and empty rows; and that the traced lowering
(`jax.jit` with operands as device arrays) gives the static path's map there.

Every figure is compared with a reference that does not share the kernel's
code: float64 NumPy for values, the dense jax.numpy formula on the CPU device
(float32, `precision="highest"`) for gradients, with inputs rounded to the
kernel's dtype first. Errors are relative to the reference's norm: float32
(IEEE on the GPU: the kernel asks for `HIGHEST`) within 2e-5, bf16 within 2e-2.

Marked `gpu` and deselected by default. `make test-gpu` runs them with
MASKC_TEST_GPU=1 (which keeps conftest from pinning the CPU); without a GPU
they are skipped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maskc
from attention_reference import jnp_reference, numpy_gradients, numpy_reference
from helpers import assert_norm_close
from maskc.kernels import api, xla
from maskc.kernels.flash import kernel as flash

F32_TOL = 2e-5
BF16_TOL = 2e-2


def _gpu():
  try:
    return jax.devices("gpu")[0]
  except RuntimeError:
    return None


GPU = _gpu()
CPU = jax.devices("cpu")[0]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPU is None, reason="no GPU visible to jax (run `make test-gpu`, which "
                                           "sets MASKC_TEST_GPU=1, on a machine with one)"),
]


def inputs(seed: int, b: int, lq: int, lkv: int, h: int, hkv: int, d: int, dtype):
  """q, k, v rounded to `dtype` (NumPy float32 values), and the cotangent w."""
  rng = np.random.default_rng(seed)
  def cast(x):
    return np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))
  q = cast(rng.standard_normal((b, lq, h, d), np.float32))
  k = cast(rng.standard_normal((b, lkv, hkv, d), np.float32))
  v = cast(rng.standard_normal((b, lkv, hkv, d), np.float32))
  w = rng.standard_normal((b, lq, h, d)).astype(np.float32)
  return q, k, v, w


def vjp_on(device, fn, q, k, v, w, dtype):
  """`fn(q, k, v)` and its q, k, v gradients for cotangent w, jitted on `device`."""
  def put(x, t=dtype):
    return jax.device_put(jnp.asarray(x, t), device)

  @jax.jit
  def both(q, k, v, w):
    out, pull = jax.vjp(fn, q, k, v)
    return out, pull(w.astype(out.dtype))

  out, grads = both(put(q), put(k), put(v), put(w, jnp.float32))
  assert all(x.devices() == {device} for x in (out, *grads))
  return np.asarray(out.astype(jnp.float32)), [np.asarray(g.astype(jnp.float32)) for g in grads]


def token_ops(n: int, seed: int, batch: int | None = None) -> dict[str, np.ndarray]:
  """Packed documents `seg` (sorted ids, runs of 20-300) and image spans `img`."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(batch or 1):
    seg = np.repeat(np.arange(n), rng.integers(20, 300, n))[:n].astype(np.int32)
    img = np.zeros(n, bool)
    for s in rng.integers(0, n, 4):
      img[s:s + int(rng.integers(16, 200))] = True
    rows.append((seg, img))
  if batch is None:
    return {"seg": rows[0][0], "img": rows[0][1]}
  return {"seg": np.stack([r[0] for r in rows]), "img": np.stack([r[1] for r in rows])}


# (id, mask, q_len, kv_len, heads, kv heads, head dim, dtype, soft cap, sinks, tiles, operands)
CASES = [
    ("causal", "causal", 1024, 1024, 4, 2, 64, "float32", None, False, None, None),
    ("causal-bf16-d128", "causal", 1024, 1024, 4, 4, 128, "bfloat16", None, False, None, None),
    ("documents-bf16-tiles128x64", "causal & document(seg)", 1024, 1024, 4, 2, 128, "bfloat16",
     None, False, (128, 64), "seg"),
    ("sliding-sink-ragged", "sliding(300) | sink(4)", 1000, 1000, 2, 1, 64, "float32", None,
     False, None, None),
    ("chunk-offset-cap", "causal & chunk(256)", 300, 1000, 2, 2, 64, "float32", 30.0, False,
     None, None),
    ("local-tiles32", "local(100, 20)", 512, 512, 2, 1, 32, "float32", None, False, (32, 32),
     None),
    ("documents-batched", "causal & document(seg)", 777, 777, 2, 1, 64, "float32", None, False,
     None, "seg-batched"),
    ("image-spans-bf16-d80", "causal | bidirectional(img)", 1024, 1024, 2, 2, 80, "bfloat16",
     None, False, None, "img"),
    ("documents-images", "document(seg) & (causal | bidirectional(img))", 640, 640, 2, 1, 64,
     "float32", None, False, (64, 64), "seg+img"),
    ("tree-pairs", "causal & anc[q, k]", 384, 384, 2, 1, 64, "float32", None, False, (64, 64),
     "anc"),
    ("moba-tile-pairs", "causal & sel[q // 64, k // 64]", 512, 512, 2, 1, 64, "float32", None,
     False, (64, 64), "sel"),
    ("sinks", "sliding(200)", 512, 512, 4, 2, 64, "float32", None, True, None, None),
    ("empty-rows", "sliding(50) & q >= 100", 512, 512, 2, 1, 64, "float32", None, False, None,
     None),
    ("per-head", ("causal", "sliding(128)"), 512, 512, 2, 1, 64, "float32", None, False, None,
     None),
]


def case_operands(kind: str | None, n: int, seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  if kind is None:
    return {}
  if kind == "seg-batched":
    return {"seg": token_ops(n, seed, batch=2)["seg"]}
  if kind == "anc":
    parent = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
    anc = np.eye(n, dtype=bool)
    for i in range(1, n):
      anc[i] |= anc[parent[i]]
    return {"anc": anc}
  if kind == "sel":
    return {"sel": rng.random((-(-n // 64), -(-n // 64))) < 0.5}
  ops = token_ops(n, seed)
  return {name: ops[name] for name in kind.split("+")}


def engine_and_dense(backend: str, mask, lq: int, lkv: int, tiles, ops, h: int, cap,
                     has_sinks: bool):
  """`(bm, ours, dense)`: the compiled map, attention through `backend` on it, and the dense
  backend on the mask, with the case's soft cap and sinks."""
  bm = maskc.compile(mask, lq, lkv, block_q=tiles[0], block_kv=tiles[1], operands=ops)
  sinks = (np.random.default_rng(1).standard_normal(h).astype(np.float32) if has_sinks
           else None)

  def ours(q, k, v):
    return api.attention(q, k, v, bm, backend=backend, logits_soft_cap=cap, sinks=sinks,
                         interpret=False)

  def dense(q, k, v):
    return maskc.attention(q, k, v, mask, backend="dense", logits_soft_cap=cap, sinks=sinks,
                           operands=ops)

  return bm, ours, dense


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_flash_on_gpu_matches_references(case):
  name, mask, lq, lkv, h, hkv, d, dtype, cap, has_sinks, tiles, kind = case
  dtype = jnp.dtype(dtype)
  ops = case_operands(kind, lkv, len(name))
  q, k, v, w = inputs(len(name), 2, lq, lkv, h, hkv, d, dtype)
  bq, bk = tiles or flash.default_blocks(lq, lkv)
  bm, ours, dense = engine_and_dense("flash", mask, lq, lkv, (bq, bk), ops, h, cap, has_sinks)

  out, grads = vjp_on(GPU, ours, q, k, v, w, dtype)
  out_ref, grads_ref = vjp_on(CPU, dense, q, k, v, w, jnp.float32)
  tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
  if not has_sinks:                       # the float64 formula has no sinks
    allowed = np.asarray(maskc.materialize(mask, lq, lkv, operands=ops))
    allowed = allowed[:, None] if bm.batch is not None else allowed    # [B, 1, Lq, Lkv]
    out64, _ = numpy_reference(q, k, v, allowed, 1 / np.sqrt(d), cap)
    assert_norm_close(out, out64, tol, f"{name}: out vs float64 NumPy")
    assert_norm_close(out_ref, out64, F32_TOL, f"{name}: the dense reference vs float64 NumPy")
  assert_norm_close(out, out_ref, tol, f"{name}: out vs dense")
  for g, r, n in zip(grads, grads_ref, "qkv"):
    assert_norm_close(g, r, tol, f"{name}: d{n} vs dense")


LSE_CASES = [
    ("causal", "causal", 512, 512, {}, None),
    ("empty-rows-cap", "sliding(20) & q >= 100", 384, 384, {}, 2.0),
    ("pattern-offset", "m[q, k]", 256, 384, "pattern", None),
]


def lse_operands(ops, lkv: int, rng: np.random.Generator):
  """A case's operands; "pattern" draws a random pairwise `m` with some empty rows."""
  if ops != "pattern":
    return ops
  m = rng.random((lkv, lkv)) < 0.3
  m[rng.random(lkv) < 0.25] = False
  return {"m": m}


@pytest.mark.parametrize("case", LSE_CASES, ids=[c[0] for c in LSE_CASES])
def test_flash_run_with_lse_on_gpu(case):
  """Values and gradients of a loss of both outputs (as ring attention uses them)."""
  name, mask, lq, lkv, ops, cap = case
  rng = np.random.default_rng(lq)
  ops = lse_operands(ops, lkv, rng)
  h, hkv, d = 4, 2, 64
  q, k, v, w = inputs(lq, 1, lq, lkv, h, hkv, d, jnp.float32)
  c = rng.standard_normal((1, lq, h)).astype(np.float32)
  bm = maskc.compile(mask, lq, lkv, block_q=64, block_kv=64, operands=ops)
  allowed = np.asarray(maskc.materialize(mask, lq, lkv, operands=ops))
  scale = 1 / np.sqrt(d)

  def loss_and_parts(fn, device):
    def loss(q, k, v):
      out, lse = fn(q, k, v)
      return (out * w).sum() + (lse * c).sum(), (out, lse)
    def put(x):
      return jax.device_put(jnp.asarray(x), device)
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(
        put(q), put(k), put(v))
    return np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads]

  out, lse, grads = loss_and_parts(
      lambda q, k, v: flash.run_with_lse(q, k, v, bm, logits_soft_cap=cap, interpret=False), GPU)
  _, _, grads_ref = loss_and_parts(lambda q, k, v: jnp_reference(q, k, v, allowed, scale, cap),
                                   CPU)
  out64, lse64 = numpy_reference(q, k, v, allowed, scale, cap)
  empty = np.asarray(lse64, np.float32) == np.float32(xla.NEG_LSE)
  np.testing.assert_array_equal(lse[empty], np.float32(xla.NEG_LSE))
  assert_norm_close(out, out64, F32_TOL, f"{name}: out")
  assert_norm_close(np.where(empty, 0, lse), np.where(empty, 0, lse64), F32_TOL, f"{name}: lse")
  for g, r, n in zip(grads, grads_ref, "qkv"):
    assert_norm_close(g, r, F32_TOL, f"{name}: d{n}")


TRACED = ["causal & document(seg)", "causal & chunk(96) | bidirectional(img)",
          "document(seg) & (causal | bidirectional(img))"]


@pytest.mark.parametrize("mask", TRACED)
def test_traced_lowering_on_gpu_matches_static(mask):
  """Operands as device arrays under `jit`: the map is computed on the GPU."""
  n, bq, bk = 2000, 64, 32
  ops = token_ops(n, 7, batch=3)
  ops = {name: a for name, a in ops.items() if f"({name})" in mask}
  static = maskc.compile(mask, n, block_q=bq, block_kv=bk, operands=ops)

  @jax.jit
  def grid(o):
    return maskc.compile(mask, n, block_q=bq, block_kv=bk, operands=o).grid

  traced = grid({name: jax.device_put(a, GPU) for name, a in ops.items()})
  assert traced.devices() == {GPU}
  np.testing.assert_array_equal(np.asarray(traced), np.asarray(static.grid))


def test_attention_with_traced_operands_on_gpu():
  """`maskc.attention` inside `jit`, documents as a device array: compile + flash on the GPU."""
  n, h, d = 1500, 2, 64
  seg = token_ops(n, 3, batch=2)["seg"]
  mask = "causal & document(seg)"
  q, k, v, w = inputs(5, 2, n, n, h, h, d, jnp.float32)
  seg_gpu = jax.device_put(seg, GPU)
  out, grads = vjp_on(GPU, lambda q, k, v: maskc.attention(
      q, k, v, mask, backend="flash", operands={"seg": seg_gpu}), q, k, v, w, jnp.float32)
  out_ref, grads_ref = vjp_on(CPU, lambda q, k, v: maskc.attention(
      q, k, v, mask, backend="dense", operands={"seg": seg}), q, k, v, w, jnp.float32)
  assert_norm_close(out, out_ref, F32_TOL, "out")
  for g, r, name in zip(grads, grads_ref, "qkv"):
    assert_norm_close(g, r, F32_TOL, f"d{name}")


def test_auto_picks_flash_on_gpu():
  assert api.choose_backend("auto", 4096, 4096) == "flash"


# Flash-decoding (maskc.kernels.flash.decode): decode steps, block_q = q_len (the kernel's
# tile 16 rows), over long caches. (id, mask, q_len, kv_len, heads, kv heads, head dim,
# dtype, soft cap, sinks, operands)
DECODE_CASES = [
    ("causal-row-bf16-gqa", "causal", 1, 8192, 8, 2, 128, "bfloat16", None, False, None),
    ("images-4-rows-sinks-cap", "causal | bidirectional(img)", 4, 8000, 4, 1, 64, "float32",
     30.0, True, "img"),
    ("documents-batched-row", "causal & document(seg)", 1, 6000, 4, 2, 64, "float32", None,
     False, "seg-batched"),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_flash_decoding_on_gpu_matches_references(case):
  """The split forward (the heuristic's S, and S = 1) on the device: the same rows as the
  dense reference, gradients through flash's backward on the combined lse included."""
  from maskc.kernels.flash import decode as flash_decode
  name, mask, lq, lkv, h, hkv, d, dtype, cap, has_sinks, kind = case
  dtype = jnp.dtype(dtype)
  ops = case_operands(kind, lkv, len(name))
  q, k, v, w = inputs(len(name), 2, lq, lkv, h, hkv, d, dtype)
  bm = maskc.compile(mask, lq, lkv, block_q=lq, block_kv=64, operands=ops)
  assert flash_decode.splits(2 * h, bm.n_kv_tiles) > 1
  sinks = (np.random.default_rng(1).standard_normal(h).astype(np.float32) if has_sinks
           else None)

  def ours(splits):
    return lambda q, k, v: flash.run(q, k, v, bm, logits_soft_cap=cap, sinks=sinks,
                                     interpret=False, splits=splits)

  def dense(q, k, v):
    return maskc.attention(q, k, v, mask, backend="dense", logits_soft_cap=cap, sinks=sinks,
                           operands=ops)

  out, grads = vjp_on(GPU, ours(None), q, k, v, w, dtype)
  out1, _ = vjp_on(GPU, ours(1), q, k, v, w, dtype)
  out_ref, grads_ref = vjp_on(CPU, dense, q, k, v, w, jnp.float32)
  tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
  assert_norm_close(out, out_ref, tol, f"{name}: split out vs dense")
  assert_norm_close(out, out1, tol, f"{name}: split out vs unsplit")
  for g, r, n in zip(grads, grads_ref, "qkv"):
    assert_norm_close(g, r, tol, f"{name}: d{n} vs dense")


# (id, engine, mask, q_len, kv_len, heads, kv heads, head dim, dtype, soft cap, q_offset,
#  operands): cuDNN for bands, tokamax for exact intervals of keys (its forward, flash's
#  backward: the gradients check the log-sum-exp made from tokamax's residuals).
ENGINE_CASES = [
    ("cudnn-causal", "cudnn", "causal", 1024, 1024, 4, 2, 128, "bfloat16", None, None, None),
    ("cudnn-sliding-d64", "cudnn", "sliding(300)", 1000, 1000, 2, 1, 64, "bfloat16", None,
     None, None),
    ("cudnn-full-cross", "cudnn", "full", 384, 1024, 2, 2, 128, "float16", None, None, None),
    ("cudnn-causal-offset0", "cudnn", "causal", 512, 1024, 2, 1, 128, "bfloat16", None, 0, None),
    ("cudnn-key-lengths-empty", "cudnn", "causal & k < n", 512, 512, 2, 1, 128, "bfloat16", None,
     None, "n"),
    ("tokamax-chunk", "tokamax", "causal & chunk(256)", 1024, 1024, 4, 2, 128, "bfloat16", None,
     None, None),
    ("tokamax-documents-d64", "tokamax", "causal & document(seg)", 1024, 1024, 2, 1, 64,
     "bfloat16", None, None, "seg"),
    ("tokamax-documents-batched", "tokamax", "causal & document(seg)", 777, 777, 2, 1, 128,
     "bfloat16", None, None, "seg-batched"),
    ("tokamax-images", "tokamax", "causal | bidirectional(img)", 1024, 1024, 2, 2, 128,
     "bfloat16", None, None, "img"),
    ("tokamax-documents-images", "tokamax", "document(seg) & (causal | bidirectional(img))", 640,
     640, 2, 1, 64, "bfloat16", None, None, "seg+img"),
    ("tokamax-local-cap", "tokamax", "local(100, 20)", 512, 512, 2, 1, 128, "bfloat16", 30.0,
     None, None),
    ("tokamax-empty-rows", "tokamax", "sliding(50) & q >= 100", 512, 512, 2, 1, 64, "bfloat16",
     None, None, None),
    ("tokamax-offset", "tokamax", "causal | prefix(100)", 300, 1000, 2, 2, 128, "bfloat16",
     None, None, None),
]


def _tokamax_ok() -> bool:
  from maskc.kernels import tokamax
  return tokamax.installed()


@pytest.mark.parametrize("case", ENGINE_CASES, ids=[c[0] for c in ENGINE_CASES])
def test_engines_on_gpu_match_references(case):
  name, engine, mask, lq, lkv, h, hkv, d, dtype, cap, offset, kind = case
  if engine == "tokamax" and not _tokamax_ok():
    pytest.skip("tokamax is not installed")
  dtype = jnp.dtype(dtype)
  if kind == "n":
    ops = {"n": np.array([300, 0], np.int32)}        # batch row 1: every row empty
  else:
    ops = case_operands(kind, lkv, len(name))
  q, k, v, w = inputs(len(name), 2, lq, lkv, h, hkv, d, dtype)
  bm = maskc.compile(mask, lq, lkv, block_q=64, block_kv=64, operands=ops, q_offset=offset)

  def ours(q, k, v):
    return api.attention(q, k, v, bm, backend=engine, logits_soft_cap=cap)

  def dense(q, k, v):
    return maskc.attention(q, k, v, mask, backend="dense", logits_soft_cap=cap, operands=ops,
                           q_offset=offset)

  out, grads = vjp_on(GPU, ours, q, k, v, w, dtype)
  out_ref, grads_ref = vjp_on(CPU, dense, q, k, v, w, jnp.float32)
  tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
  allowed = np.asarray(maskc.materialize(mask, lq, lkv, operands=ops, q_offset=offset))
  allowed = allowed[:, None] if bm.batch is not None else allowed
  out64, _ = numpy_reference(q, k, v, allowed, 1 / np.sqrt(d), cap)
  assert_norm_close(out, out64, tol, f"{name}: out vs float64 NumPy")
  assert_norm_close(out, out_ref, tol, f"{name}: out vs dense")
  for g, r, n in zip(grads, grads_ref, "qkv"):
    assert_norm_close(g, r, tol, f"{name}: d{n} vs dense")
  empty = ~np.broadcast_to(allowed.any(-1), (2, 1, lq) if allowed.ndim == 4 else (lq,))
  if empty.any():  # rows with no key: zeros, and zero query gradients
    rows = np.broadcast_to(empty.reshape(-1, lq) if empty.ndim > 1 else empty, (2, lq))
    assert np.all(out[rows] == 0) and np.all(grads[0][rows] == 0), name
  assert np.isfinite(out).all() and all(np.isfinite(g).all() for g in grads), name


def test_auto_on_gpu_chooses_on_the_compiled_map():
  q, k, v, _ = inputs(5, 1, 1024, 1024, 2, 2, 128, jnp.bfloat16)
  q, k, v = (jax.device_put(jnp.asarray(x, jnp.bfloat16), GPU) for x in (q, k, v))
  bm = maskc.compile("causal", 1024, block_q=64, block_kv=64)
  assert api.choose(bm, head_dim=128, dtype=jnp.bfloat16).backend == "cudnn"
  out = maskc.attention(q, k, v, "causal")
  ref = api.attention(q, k, v, bm, backend="cudnn")
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def test_tokamax_refuses_float32_on_gpu():
  """tokamax runs float32 at TF32, which its Mosaic kernel rejects: refused up front, and
  `choose` takes flash for float32 (cuDNN's bands apart)."""
  if not _tokamax_ok():
    pytest.skip("tokamax is not installed")
  seg = case_operands("seg", 256, 0)
  bm = maskc.compile("causal & document(seg)", 256, block_q=64, block_kv=64, operands=seg)
  x = jax.device_put(jnp.ones((1, 256, 2, 64), jnp.float32), GPU)
  with pytest.raises(maskc.BackendError, match="bfloat16 and float16") as err:
    api.attention(x, x, x, bm, backend="tokamax")
  assert "flash" in str(err.value)
  assert api.choose(bm, head_dim=64, dtype=jnp.float32).backend == "flash"


def test_tokamax_residuals_give_the_log_sum_exp_on_gpu():
  """The Mosaic kernel's residuals (max and denominator), turned into the log-sum-exp
  flash's backward takes, against float64 NumPy; +inf on rows with no key."""
  if not _tokamax_ok():
    pytest.skip("tokamax is not installed")
  from tokamax._src.ops.attention import pallas_mosaic_gpu

  from maskc.kernels import tokamax
  text, n, h, d = "causal & document(seg) & q >= 100", 768, 2, 128
  ops = case_operands("seg", n, 3)
  q, k, v, _ = inputs(3, 1, n, n, h, h, d, jnp.bfloat16)
  bm = maskc.compile(text, n, block_q=64, block_kv=64, operands=ops)
  start, stop, exact = bm.key_intervals()
  assert exact
  op = tokamax.interval_op(pallas_mosaic_gpu.PallasMosaicGpuFlashAttention())
  fwd = jax.jit(lambda q, k, v, a, b: tokamax._forward(op, 1 / np.sqrt(d), None, q, k, v, a, b))

  def put(x, t):
    return jax.device_put(jnp.asarray(x, t), GPU)

  out, lse = fwd(put(q, jnp.bfloat16), put(k, jnp.bfloat16), put(v, jnp.bfloat16),
                 put(np.asarray(start)[None], jnp.int32), put(np.asarray(stop)[None], jnp.int32))
  allowed = np.asarray(maskc.materialize(text, n, operands=ops))
  out64, lse64 = numpy_reference(q, k, v, allowed, 1 / np.sqrt(d), None)
  empty = ~allowed.any(-1)
  assert empty[:100].all() and not empty[100:].all()
  lse = np.asarray(lse).transpose(0, 2, 1)                       # [B, Lq, H]
  assert np.all(np.isposinf(lse[:, empty])), "rows with no key: lse = +inf"
  np.testing.assert_allclose(lse[:, ~empty], lse64[:, ~empty], atol=2e-2)
  assert_norm_close(np.asarray(out, np.float32), out64, BF16_TOL, "out vs float64 NumPy")


# ----------------------------------------------------------------------------- mosaic_gpu
# `backend="mosaic_gpu"` (maskc.kernels.mosaic_gpu.forward): the Pallas Mosaic GPU forward, flash's
# backward (its own Mosaic GPU backward, opt-in, has its test below). Never run on a GPU before
# these tests; they check it over flash's matrix (CASES), each case moved to what the kernel takes:
# bfloat16 or float16 inputs (float32 cases alternate between the two), 128-row tiles with 64 or 128
# keys, the tile-constant case's blocks at 128. Head dims off a multiple of 64 (32, 80) are padded
# by the wrapper. With sinks there is no gradient yet: those cases check the forward alone.


def _mosaic_case(n: int, case):
  name, mask, lq, lkv, h, hkv, d, dtype, cap, has_sinks, tiles, kind = case
  if dtype == "float32":
    dtype = ("bfloat16", "float16")[n % 2]
  bk = 64 if (tiles and tiles[1] < 128) or d > 128 else 128
  if kind == "sel":
    mask = "causal & sel[q // 128, k // 128]"
  return (f"mosaic-{name}", mask, lq, lkv, h, hkv, d, dtype, cap, has_sinks, (128, bk), kind)


MOSAIC_CASES = [_mosaic_case(n, c) for n, c in enumerate(CASES)] + [
    ("mosaic-causal-fp16-d256", "causal", 1024, 1024, 4, 1, 256, "float16", None, False,
     (128, 64), None),
    ("mosaic-sliding-sink-bf16-d256", "sliding(300) | sink(4)", 1000, 1000, 4, 2, 256,
     "bfloat16", None, False, (128, 64), None),
    ("mosaic-key-lengths-scalar", "causal & k < n", 700, 700, 2, 1, 128, "bfloat16", None,
     False, (128, 128), "n"),
]


def _mosaic_ops(kind, n: int, seed: int) -> dict[str, np.ndarray]:
  if kind == "n":
    return {"n": np.array([500, 0], np.int32)}        # batch row 1: every row empty
  if kind == "sel":
    return {"sel": np.random.default_rng(seed).random((-(-n // 128),) * 2) < 0.5}
  return case_operands(kind, n, seed)


@pytest.mark.parametrize("case", MOSAIC_CASES, ids=[c[0] for c in MOSAIC_CASES])
def test_mosaic_gpu_on_gpu_matches_references(case):
  from maskc.kernels.mosaic_gpu import forward as mosaic_gpu
  name, mask, lq, lkv, h, hkv, d, dtype, cap, has_sinks, (bq, bk), kind = case
  if (why := mosaic_gpu.compat.mosaic_gpu_unavailable()) is not None:
    pytest.fail(f"Pallas Mosaic GPU is not usable with this jax: {why}")
  dtype = jnp.dtype(dtype)
  ops = _mosaic_ops(kind, lkv, len(name))
  q, k, v, w = inputs(len(name), 2, lq, lkv, h, hkv, d, dtype)
  bm, ours, dense = engine_and_dense("mosaic_gpu", mask, lq, lkv, (bq, bk), ops, h, cap,
                                     has_sinks)

  if has_sinks:                          # forward only: no gradient with sinks yet
    def put(x):
      return jax.device_put(jnp.asarray(x, dtype), GPU)
    out = np.asarray(jax.jit(ours)(put(q), put(k), put(v)).astype(jnp.float32))
    out_ref, _ = vjp_on(CPU, dense, q, k, v, w, jnp.float32)
    assert_norm_close(out, out_ref, BF16_TOL, f"{name}: out vs dense")
    return
  out, grads = vjp_on(GPU, ours, q, k, v, w, dtype)
  out_ref, grads_ref = vjp_on(CPU, dense, q, k, v, w, jnp.float32)
  allowed = np.asarray(maskc.materialize(mask, lq, lkv, operands=ops))
  allowed = allowed[:, None] if bm.batch is not None else allowed    # [B, 1, Lq, Lkv]
  out64, _ = numpy_reference(q, k, v, allowed, 1 / np.sqrt(d), cap)
  assert_norm_close(out, out64, BF16_TOL, f"{name}: out vs float64 NumPy")
  assert_norm_close(out, out_ref, BF16_TOL, f"{name}: out vs dense")
  for g, r, n in zip(grads, grads_ref, "qkv"):
    assert_norm_close(g, r, BF16_TOL, f"{name}: d{n} vs dense")
  assert np.isfinite(out).all() and all(np.isfinite(g).all() for g in grads), name
  # allowed is [Lq, Lkv], [H, Lq, Lkv] (per head) or [B, 1, Lq, Lkv] (batched operands)
  empty = ~np.broadcast_to(allowed.any(-1), (2, h, lq)).transpose(0, 2, 1)   # [B, Lq, H]
  assert np.all(out[empty] == 0), f"{name}: rows with no key are exactly zero"


# The opt-in Mosaic GPU backward (`mosaic_gpu.BACKWARD = "mosaic_gpu"`,
# maskc.kernels.mosaic_gpu.backward), never run before these: the forward's cases, sinks
# included, each gradient (sinks' too) against float64 NumPy's backward formula
# (`numpy_gradients`). gpu_check.sh runs them after a one-call smoke run of their own.


@pytest.mark.parametrize("case", MOSAIC_CASES, ids=[c[0] for c in MOSAIC_CASES])
def test_mosaic_backward_on_gpu_matches_float64(case, monkeypatch):
  from maskc.kernels.mosaic_gpu import forward as mosaic_gpu
  name, mask, lq, lkv, h, hkv, d, dtype, cap, has_sinks, (bq, bk), kind = case
  if (why := mosaic_gpu.compat.mosaic_gpu_unavailable()) is not None:
    pytest.fail(f"Pallas Mosaic GPU is not usable with this jax: {why}")
  monkeypatch.setattr(mosaic_gpu, "BACKWARD", "mosaic_gpu")
  dtype = jnp.dtype(dtype)
  ops = _mosaic_ops(kind, lkv, len(name))
  q, k, v, w = inputs(len(name), 2, lq, lkv, h, hkv, d, dtype)
  bm = maskc.compile(mask, lq, lkv, block_q=bq, block_kv=bk, operands=ops)
  sinks = (np.random.default_rng(1).standard_normal(h).astype(np.float32) if has_sinks
           else None)

  def loss(q, k, v, w, s):
    out = api.attention(q, k, v, bm, backend="mosaic_gpu", logits_soft_cap=cap,
                        sinks=s if has_sinks else None, interpret=False)
    return (out.astype(jnp.float32) * w).sum()

  def put(x, t=dtype):
    return jax.device_put(jnp.asarray(x, t), GPU)
  s0 = np.zeros(h, np.float32) if sinks is None else sinks
  grads = jax.jit(jax.grad(loss, (0, 1, 2, 4)))(put(q), put(k), put(v), put(w, jnp.float32),
                                                put(s0, jnp.float32))
  grads = [np.asarray(g.astype(jnp.float32)) for g in grads]
  allowed = np.asarray(maskc.materialize(mask, lq, lkv, operands=ops))
  allowed = allowed[:, None] if bm.batch is not None else allowed    # [B, 1, Lq, Lkv]
  refs = numpy_gradients(q, k, v, w, allowed, 1 / np.sqrt(d), cap, sinks)
  for g, r, n in zip(grads, refs, ("q", "k", "v", "sinks")):
    if r is not None:
      assert np.isfinite(g).all(), f"{name}: d{n} is finite"
      assert_norm_close(g, r, BF16_TOL, f"{name}: d{n} vs float64 NumPy")
  empty = ~np.broadcast_to(allowed.any(-1), (2, h, lq)).transpose(0, 2, 1)   # [B, Lq, H]
  assert np.all(grads[0][empty] == 0), f"{name}: rows with no key have zero dq"


MOSAIC_LSE_CASES = [
    ("mosaic-lse-causal", "causal", 512, 512, {}, None, "bfloat16"),
    ("mosaic-lse-empty-rows-cap", "sliding(20) & q >= 100", 384, 384, {}, 2.0, "float16"),
    ("mosaic-lse-pattern-offset", "m[q, k]", 256, 384, "pattern", None, "bfloat16"),
]


@pytest.mark.parametrize("case", MOSAIC_LSE_CASES, ids=[c[0] for c in MOSAIC_LSE_CASES])
def test_mosaic_gpu_run_with_lse_on_gpu(case):
  """`run_with_lse`'s values against float64 NumPy (no gradient yet)."""
  from maskc.kernels.mosaic_gpu import forward as mosaic_gpu
  name, mask, lq, lkv, ops, cap, dtype = case
  rng = np.random.default_rng(lq)
  ops = lse_operands(ops, lkv, rng)
  h, hkv, d = 4, 2, 128
  q, k, v, _ = inputs(lq, 1, lq, lkv, h, hkv, d, jnp.dtype(dtype))
  bm = maskc.compile(mask, lq, lkv, block_q=128, block_kv=128, operands=ops)
  allowed = np.asarray(maskc.materialize(mask, lq, lkv, operands=ops))
  def put(x):
    return jax.device_put(jnp.asarray(x, dtype), GPU)
  out, lse = jax.jit(lambda q, k, v: mosaic_gpu.run_with_lse(q, k, v, bm, logits_soft_cap=cap))(
      put(q), put(k), put(v))
  out, lse = np.asarray(out), np.asarray(lse)
  out64, lse64 = numpy_reference(q, k, v, allowed, 1 / np.sqrt(d), cap)
  empty = np.asarray(lse64, np.float32) == np.float32(xla.NEG_LSE)
  np.testing.assert_array_equal(lse[empty], np.float32(xla.NEG_LSE))
  assert_norm_close(out, out64, BF16_TOL, f"{name}: out")
  assert_norm_close(np.where(empty, 0, lse), np.where(empty, 0, lse64), BF16_TOL, f"{name}: lse")


@pytest.mark.parametrize("case", MOSAIC_LSE_CASES, ids=[c[0] for c in MOSAIC_LSE_CASES])
def test_mosaic_backward_run_with_lse_on_gpu(case, monkeypatch):
  """`run_with_lse` differentiated through both outputs by the Mosaic GPU backward (the lse
  cotangent enters as `delta − dlse`), against float64 NumPy."""
  from maskc.kernels.mosaic_gpu import forward as mosaic_gpu
  name, mask, lq, lkv, ops, cap, dtype = case
  monkeypatch.setattr(mosaic_gpu, "BACKWARD", "mosaic_gpu")
  rng = np.random.default_rng(lq)
  ops = lse_operands(ops, lkv, rng)
  h, hkv, d = 4, 2, 128
  q, k, v, w = inputs(lq, 1, lq, lkv, h, hkv, d, jnp.dtype(dtype))
  w_lse = rng.standard_normal((1, lq, h)).astype(np.float32)
  bm = maskc.compile(mask, lq, lkv, block_q=128, block_kv=128, operands=ops)
  allowed = np.asarray(maskc.materialize(mask, lq, lkv, operands=ops))
  w_lse = np.where(allowed.any(-1)[None, :, None], w_lse, 0)    # lse is constant there

  def loss(q, k, v):
    out, lse = mosaic_gpu.run_with_lse(q, k, v, bm, logits_soft_cap=cap)
    return (out * w).sum() + (lse * w_lse).sum()

  def put(x):
    return jax.device_put(jnp.asarray(x, jnp.dtype(dtype)), GPU)
  grads = jax.jit(jax.grad(loss, (0, 1, 2)))(put(q), put(k), put(v))
  refs = numpy_gradients(q, k, v, w, allowed, 1 / np.sqrt(d), cap, w_lse=w_lse)
  for g, r, n in zip(grads, refs, "qkv"):
    g = np.asarray(g.astype(jnp.float32))
    assert np.isfinite(g).all(), f"{name}: d{n} is finite"
    assert_norm_close(g, r, BF16_TOL, f"{name}: d{n} vs float64 NumPy")


def test_auto_never_picks_mosaic_gpu_on_gpu():
  """Not before its numerics and speed are measured here."""
  bm = maskc.compile("causal & anc[q, k]", 1024, block_q=64, block_kv=64,
                     operands=case_operands("anc", 1024, 0))
  assert api.choose(bm, head_dim=128, dtype=jnp.bfloat16).backend != "mosaic_gpu"
