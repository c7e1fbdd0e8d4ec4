"""The Mosaic GPU backend's host side on CPU: its tile walk, read arrays, wrapper and refusals.

The kernel itself runs only on an sm90 GPU (tests/test_gpu.py; Pallas interpret mode does
not run Mosaic GPU's wgmma pipelines) and is cross-lowered in
tests/test_mosaic_gpu_lowering.py. What runs here is everything around it, with the kernel
(`mosaic_gpu._forward`) replaced by `emulated_forward`: the function the kernel must
compute from the same inputs, written densely in jax.numpy from its contract (each q
tile visits the key tiles of its walk, FULL ones unmasked but for keys past `kv_len`,
PARTIAL ones through the predicate on the read arrays; the rest is masked). Checked
against the dense reference, this shows that the walk and the read arrays describe the
mask, and that padding, GQA, per-head masks, sinks, soft caps, empty rows, the log-sum-exp
and the gradients (flash's backward, interpreted) are wired as the backend promises.
The opt-in Mosaic GPU backward (`mosaic_gpu.BACKWARD = "mosaic_gpu"`) is checked the same
way: its dq and dk/dv kernels (`mosaic_gpu_backward._dq`, `_dkv`) replaced by
`emulated_dq` and `emulated_dkv`, dense functions of the same inputs (the dk/dv one walks
the transposed map and reads the transposed pairwise array), against the dense backend's
gradients, sinks' and `run_with_lse`'s included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maskc
from helpers import assert_norm_close
from maskc.compiled import predicate as _predicate
from maskc.kernels import api, common
from maskc.kernels.mosaic_gpu import forward as mosaic_gpu
from maskc.kernels.xla import NEG_LSE

TOL = 2e-2          # bf16 inputs


def emulated_allowed(cfg: mosaic_gpu.Config, meta, ins: mosaic_gpu.Inputs, *,
                     transpose: bool = False, pair=None):
  """`[B', Lq_pad, Lkv_pad]` bool: the pairs a kernel walking `meta` computes with.

  `meta` is the forward's walk (per q tile, its key tiles), or with `transpose` the dk/dv
  kernel's (per key tile, its q tiles); FULL tiles are unmasked but for keys past `kv_len`,
  PARTIAL ones evaluate the predicate on the read arrays (`pair` replaces `ins.pair`: the
  dk/dv kernel's transposed array, transposed back)."""
  bq, bk, nq, nk = mosaic_gpu.BLOCK_Q, cfg.block_kv, cfg.n_q_tiles, cfg.n_kv_tiles
  lq_pad, lkv_pad = nq * bq, nk * bk
  t = jnp.arange(meta.shape[-1] - 2)
  tiles = jax.nn.one_hot(meta[..., 2:], nq if transpose else nk, dtype=jnp.int32)
  full = (tiles * (t < meta[..., :1])[..., None]).sum(2) > 0
  part = (tiles * ((t >= meta[..., :1]) & (t < meta[..., 1:2]))[..., None]).sum(2) > 0
  if transpose:                                                      # [B', nk, nq] -> q-major
    full, part = jnp.swapaxes(full, 1, 2), jnp.swapaxes(part, 1, 2)
  def grow(g):
    return jnp.repeat(jnp.repeat(g, bq, axis=1), bk, axis=2)   # [B', Lq_pad, Lkv_pad]
  ns = len(cfg.pred.scalars)
  qpos = jnp.arange(lq_pad)[None, :, None] + ins.scal[:, ns][:, None, None]
  kpos = jnp.arange(lkv_pad)[None, None, :]
  pair = ins.pair if pair is None else pair

  def fetch(kind, slot):
    if kind == "q_read":
      return ins.qtok[:, slot][:, :, None]
    if kind == "k_read":
      return ins.ktok[:, slot][:, None, :]
    if kind == "pair":
      return pair[:, slot]
    if kind == "tile_pair":
      return grow(ins.tile[:, slot * nq * nk:(slot + 1) * nq * nk].reshape(-1, nq, nk))
    return ins.scal[:, slot][:, None, None]

  pred = _predicate.evaluate(cfg.pred, jnp, qpos, kpos, fetch)
  return (grow(full) | (grow(part) & pred)) & (kpos < cfg.kv_len)


def emulated_forward(cfg: mosaic_gpu.Config, q, k, v, sinks, ins: mosaic_gpu.Inputs):
  """What `mosaic_gpu._forward` computes, densely: `(out [B, Lq_pad, H, D], lse [B, H, Lq_pad])`."""
  allowed = emulated_allowed(cfg, ins.meta, ins)
  kk = jnp.repeat(k, cfg.groups, axis=2).astype(jnp.float32)
  vv = jnp.repeat(v, cfg.groups, axis=2).astype(jnp.float32)
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kk, precision="highest") * cfg.scale
  if cfg.cap is not None:
    s = cfg.cap * jnp.tanh(s / cfg.cap)
  s = jnp.where(allowed[:, None], s, -jnp.inf)
  top = s.max(-1)
  if cfg.has_sinks:
    top = jnp.maximum(top, sinks[None, :, None])
  seen = jnp.isfinite(top)
  top = jnp.where(seen, top, 0.0)
  e = jnp.exp(s - top[..., None])
  total = e.sum(-1) + (jnp.exp(sinks[None, :, None] - top) if cfg.has_sinks else 0.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", e / jnp.where(seen, total, 1.0)[..., None], vv,
                   precision="highest")
  lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), jnp.inf)
  return out.astype(q.dtype), lse


def _emulated_ds(cfg: mosaic_gpu.Config, q, k, v, do, lse2, delta, allowed):
  """`(p, ds)` `[B, H, Lq_pad, Lkv_pad]` as the backward kernels form them (base-2 lse)."""
  kk = jnp.repeat(k, cfg.groups, axis=2).astype(jnp.float32)
  vv = jnp.repeat(v, cfg.groups, axis=2).astype(jnp.float32)
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kk, precision="highest") * cfg.scale
  t = None
  if cfg.cap is not None:
    t = jnp.tanh(s / cfg.cap)
    s = cfg.cap * t
  p = jnp.where(allowed[:, None], jnp.exp2(s * mosaic_gpu.LOG2E - lse2[..., None]), 0.0)
  dp = jnp.einsum("bqhd,bkhd->bhqk", do.astype(jnp.float32), vv, precision="highest")
  ds = p * (dp - delta[..., None])
  return p, ds if t is None else ds * (1 - t * t)


def emulated_dq(bc, q, k, v, do, lse2, delta, ins: mosaic_gpu.Inputs):
  """What `mosaic_gpu_backward._dq` computes, densely, walking the forward's `meta`."""
  cfg = bc.fwd
  _, ds = _emulated_ds(cfg, q, k, v, do, lse2, delta, emulated_allowed(cfg, ins.meta, ins))
  kk = jnp.repeat(k, cfg.groups, axis=2).astype(jnp.float32)
  dq = jnp.einsum("bhqk,bkhd->bqhd", ds, kk, precision="highest") * cfg.scale
  return dq.astype(q.dtype)


def emulated_dkv(bc, q, k, v, do, lse2, delta, meta_b, ins: mosaic_gpu.Inputs, pair_t):
  """What `mosaic_gpu_backward._dkv` computes, densely, walking the transposed `meta_b` with
  the transposed pairwise array; summed over each key head's query heads."""
  cfg = bc.fwd
  allowed = emulated_allowed(cfg, meta_b, ins, transpose=True,
                             pair=jnp.swapaxes(pair_t, -1, -2))
  p, ds = _emulated_ds(cfg, q, k, v, do, lse2, delta, allowed)
  b, lkv_pad, hkv, d = k.shape
  dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32), precision="highest")
  dv = jnp.einsum("bhqk,bqhd->bkhd", p, do.astype(jnp.float32), precision="highest")
  def group(x):
    return x.reshape(b, lkv_pad, hkv, cfg.groups, d).sum(3).astype(k.dtype)
  return group(dk * cfg.scale), group(dv)


@pytest.fixture
def emulated(monkeypatch):
  """The kernel replaced by `emulated_forward`, and jax taken to run on a GPU."""
  monkeypatch.setattr(mosaic_gpu, "_forward", emulated_forward)
  monkeypatch.setattr(mosaic_gpu, "platform", lambda: "gpu")


def ops_for(n: int, seed: int = 0, batch: int | None = None) -> dict:
  rng = np.random.default_rng(seed)
  shape = (n,) if batch is None else (batch, n)
  seg = np.sort(rng.integers(0, 4, shape), axis=-1).astype(np.int32)
  img = np.zeros(shape, bool)
  img[..., n // 5: n // 2] = True
  anc = rng.random((n, n)) < 0.3
  sel = rng.random((-(-n // 128),) * 2) < 0.5
  return {"seg": seg, "img": img, "anc": anc, "sel": sel, "n": np.int32(n - 50)}


# (mask, q_len, kv_len, heads, kv heads, head dim, tiles, soft cap, sinks, batched operands)
CASES = [
    ("causal", 300, 300, 4, 2, 64, (128, 128), None, False, False),
    ("sliding(100) | sink(4)", 400, 400, 2, 1, 80, (128, 64), 5.0, False, False),
    ("causal & document(seg)", 300, 300, 2, 2, 64, (128, 64), None, False, True),
    ("causal | bidirectional(img)", 256, 384, 2, 1, 64, (128, 128), None, False, False),
    ("causal & anc[q, k]", 300, 300, 2, 1, 64, (128, 64), None, False, False),
    ("causal & sel[q // 128, k // 128]", 384, 384, 2, 1, 64, (128, 128), None, False, False),
    ("causal & k < n", 300, 300, 2, 1, 64, (128, 128), None, False, False),
    ("sliding(50) & q >= 100", 300, 300, 4, 1, 64, (128, 64), None, True, False),
    (("causal", "sliding(64)"), 256, 256, 2, 1, 64, (128, 64), None, False, False),
]


def case_id(case) -> str:
  mask = case[0] if isinstance(case[0], str) else " ; ".join(case[0])
  return f"{mask}|{case[1]}x{case[2]}|H{case[3]}/{case[4]}|D{case[5]}"


def inputs(b: int, lq: int, lkv: int, h: int, hkv: int, d: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  def f(*s):
    return jnp.asarray(rng.standard_normal(s, np.float32)).astype(jnp.bfloat16)
  return f(b, lq, h, d), f(b, lkv, hkv, d), f(b, lkv, hkv, d), f(b, lq, h, d)


def run_case(case):
  """`(ours, dense, (q, k, v, w))` for a case: attention through the backend and densely."""
  mask, lq, lkv, h, hkv, d, (bq, bk), cap, has_sinks, batched = case
  b = 2
  ops = ops_for(lkv, batch=b if batched else None)
  names = set()
  for m in ([mask] if isinstance(mask, str) else mask):
    names |= {s.name for s in maskc.parse(m).operands}
  ops = {n: ops[n] for n in names}
  bm = maskc.compile(mask, lq, lkv, block_q=bq, block_kv=bk, operands=ops)
  sinks = jnp.linspace(-1.0, 1.0, h) if has_sinks else None

  def ours(q, k, v, sinks=sinks):
    return api.attention(q, k, v, bm, backend="mosaic_gpu", logits_soft_cap=cap, sinks=sinks)

  def dense(q, k, v, sinks=sinks):
    return api.attention(q, k, v, bm, backend="dense", logits_soft_cap=cap, sinks=sinks)

  return ours, dense, inputs(b, lq, lkv, h, hkv, d)


def f32(x) -> np.ndarray:
  return np.asarray(x, np.float32)


# The default run takes sinks with empty rows (MQA, ragged lengths); the rest (pairwise
# reads, holes and soft cap, batched per-token reads, per-head masks, ...) run with
# `make test-slow`: the kernel has never run, and the emulation checks its host side only.
FORWARD_CASES = [pytest.param(c, id=case_id(c), marks=() if n == 7 else
                              pytest.mark.slow) for n, c in enumerate(CASES)]


@pytest.mark.parametrize("case", FORWARD_CASES)
def test_emulated_kernel_matches_dense(emulated, case):
  ours, dense, (q, k, v, _) = run_case(case)
  out = ours(q, k, v)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert_norm_close(f32(out), f32(dense(q, k, v)), TOL, "out")


# Gradients run flash's backward interpreted (flash.run_with_forward, which the tokamax
# backend's tests also cover): all with `make test-slow`.
GRAD_CASES = [pytest.param(c, id=case_id(c), marks=pytest.mark.slow)
              for c in CASES if not c[8]]


@pytest.mark.parametrize("case", GRAD_CASES)
def test_emulated_gradients_are_flash_backward(emulated, case):
  ours, dense, (q, k, v, w) = run_case(case)
  def loss(fn):
    return lambda q, k, v: (fn(q, k, v).astype(jnp.float32) * w).sum()
  grads = jax.grad(loss(ours), (0, 1, 2))(q, k, v)
  refs = jax.grad(loss(dense), (0, 1, 2))(q.astype(jnp.float32), k.astype(jnp.float32),
                                          v.astype(jnp.float32))
  for g, r, n in zip(grads, refs, "qkv"):
    assert_norm_close(f32(g), f32(r), TOL, f"d{n}")


@pytest.fixture
def emulated_backward(emulated, monkeypatch):
  """Also the opt-in Mosaic GPU backward, its kernels replaced by their dense emulations."""
  from maskc.kernels.mosaic_gpu import backward as mosaic_gpu_backward
  monkeypatch.setattr(mosaic_gpu, "BACKWARD", "mosaic_gpu")
  monkeypatch.setattr(mosaic_gpu_backward, "_dq", emulated_dq)
  monkeypatch.setattr(mosaic_gpu_backward, "_dkv", emulated_dkv)


# The Mosaic GPU backward's host side (padding, lse and delta, the transposed walk and
# pairwise array, GQA sums, sinks): every case, sinks included, with `make test-slow` (the
# backward is opt-in and has never run; its cross-lowering runs by default).
MOSAIC_GRAD_CASES = [pytest.param(c, id=case_id(c), marks=pytest.mark.slow)
                     for n, c in enumerate(CASES)]


@pytest.mark.parametrize("case", MOSAIC_GRAD_CASES)
def test_emulated_mosaic_backward_matches_dense(emulated_backward, case):
  ours, dense, (q, k, v, w) = run_case(case)
  h, has_sinks = case[3], case[8]
  if has_sinks:                           # differentiated w.r.t. the sinks too
    ours_s, dense_s, s0 = ours, dense, jnp.linspace(-1.0, 1.0, h)
  else:
    def ours_s(q, k, v, s):
      return ours(q, k, v)
    def dense_s(q, k, v, s):
      return dense(q, k, v)
    s0 = jnp.zeros((h,), jnp.float32)
  def loss(fn):
    return lambda q, k, v, s: (fn(q, k, v, s).astype(jnp.float32) * w).sum()
  grads = jax.grad(loss(ours_s), (0, 1, 2, 3))(q, k, v, s0)
  refs = jax.grad(loss(dense_s), (0, 1, 2, 3))(q.astype(jnp.float32), k.astype(jnp.float32),
                                               v.astype(jnp.float32), s0)
  for g, r, n in zip(grads, refs, ("q", "k", "v", "sinks")):
    if n == "sinks" and not has_sinks:
      continue
    assert_norm_close(f32(g), f32(r), TOL, f"d{n}")


@pytest.mark.slow
def test_emulated_mosaic_backward_of_run_with_lse(emulated_backward):
  """Cotangents on both outputs of `run_with_lse` (the lse one enters as `delta − dlse`)."""
  lq, lkv, h, d = 300, 384, 2, 64
  bm = maskc.compile("sliding(30) & q >= 150", lq, lkv, block_q=128, block_kv=64)
  q, k, v, _ = inputs(1, lq, lkv, h, h, d)
  rng = np.random.default_rng(3)
  wo = jnp.asarray(rng.standard_normal((1, lq, h, d)), jnp.float32)
  wl = jnp.asarray(rng.standard_normal((1, lq, h)), jnp.float32)

  def loss(fn):
    def f(q, k, v):
      out, lse = fn(q, k, v, bm, logits_soft_cap=3.0)
      return (out * wo).sum() + (jnp.where(lse > NEG_LSE / 2, lse, 0.0) * wl).sum()
    return f

  grads = jax.grad(loss(mosaic_gpu.run_with_lse), (0, 1, 2))(q, k, v)
  refs = jax.grad(loss(maskc.kernels.xla.run_with_lse), (0, 1, 2))(
      *(x.astype(jnp.float32) for x in (q, k, v)))
  for g, r, n in zip(grads, refs, "qkv"):
    assert_norm_close(f32(g), f32(r), TOL, f"d{n}")


def test_gradients_with_sinks_refuse(emulated):
  ours, _, (q, k, v, _) = run_case(CASES[7])
  with pytest.raises(maskc.BackendError, match="sinks") as err:
    jax.grad(lambda q: ours(q, k, v).astype(jnp.float32).sum())(q)
  assert "flash" in str(err.value)


@pytest.mark.slow
def test_emulated_run_with_lse(emulated):
  lq, lkv, h, d = 300, 384, 2, 64
  bm = maskc.compile("sliding(30) & q >= 150", lq, lkv, block_q=128, block_kv=64)
  q, k, v, _ = inputs(1, lq, lkv, h, h, d)
  out, lse = mosaic_gpu.run_with_lse(q, k, v, bm, logits_soft_cap=3.0)
  ref_out, ref_lse = maskc.kernels.xla.run_with_lse(q, k, v, bm, logits_soft_cap=3.0)
  assert out.dtype == jnp.float32 and lse.shape == (1, lq, h)
  empty = np.asarray(ref_lse) == np.float32(NEG_LSE)
  assert empty.any() and (np.asarray(lse)[empty] == np.float32(NEG_LSE)).all()
  assert_norm_close(np.asarray(out), np.asarray(ref_out, np.float32), TOL, "out")
  assert_norm_close(np.where(empty, 0, lse), np.where(empty, 0, ref_lse), TOL, "lse")
  with pytest.raises(maskc.BackendError, match="run_with_lse"):
    jax.grad(lambda q: mosaic_gpu.run_with_lse(q, k, v, bm)[1].sum())(q)


@pytest.mark.parametrize("mask", ["sliding(200) | sink(4)", "causal & document(seg)",
                                  "global(3) | (q - k) % 5 == 0"])
def test_walk_lists_full_then_partial_tiles(mask):
  seg = ops_for(700)["seg"]
  ops = {"seg": seg} if "seg" in mask else {}
  bm = maskc.compile(mask, 700, block_q=128, block_kv=64, operands=ops)
  grid = np.asarray(bm.grid)[0] if np.asarray(bm.grid).ndim == 3 else np.asarray(bm.grid)
  walk = np.asarray(mosaic_gpu.walk(bm, 0))[0]
  for i, row in enumerate(walk):
    n_full, n_all = row[0], row[1]
    assert list(row[2:2 + n_full]) == list(np.flatnonzero(grid[i] == common.FULL))
    assert list(row[2 + n_full:2 + n_all]) == list(np.flatnonzero(grid[i] == common.PARTIAL))
  if ops:                                  # the traced map's walk lists the same tiles
    traced = jax.jit(lambda s: mosaic_gpu.walk(
        maskc.compile(mask, 700, block_q=128, block_kv=64, operands={"seg": s}), 0))(seg)
    traced = np.asarray(traced)[0]
    for row, t_row in zip(walk, traced):
      assert list(row[:2 + row[1]]) == list(t_row[:2 + t_row[1]])


@pytest.mark.parametrize("kw, match", [
    (dict(dtype=jnp.float32), "bfloat16 and float16"),
    (dict(d=256, bk=128), "block_kv=64"),
    (dict(bq=64, bk=64), "block_q=128"),
    (dict(d=320), "over 256"),
    (dict(interpret=True), "interpret"),
])
def test_refusals_name_flash(monkeypatch, kw, match):
  monkeypatch.setattr(mosaic_gpu, "platform", lambda: "gpu")
  d = kw.get("d", 64)
  bm = maskc.compile("causal", 256, block_q=kw.get("bq", 128), block_kv=kw.get("bk", 128))
  x = jnp.zeros((1, 256, 2, d), kw.get("dtype", jnp.bfloat16))
  with pytest.raises(maskc.BackendError, match=match) as err:
    api.attention(x, x, x, bm, backend="mosaic_gpu", interpret=kw.get("interpret"))
  assert "flash" in str(err.value)


def test_eager_calls_off_a_gpu_refuse():
  bm = maskc.compile("causal", 256, block_q=128, block_kv=128)
  x = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
  for call in (lambda: api.attention(x, x, x, bm, backend="mosaic_gpu"),
               lambda: mosaic_gpu.run_with_lse(x, x, x, bm)):
    with pytest.raises(maskc.BackendError, match="NVIDIA GPU") as err:
      call()
    assert "flash" in str(err.value)


def test_registered_but_never_chosen_by_auto():
  assert "mosaic_gpu" in api.BACKENDS
  bm = maskc.compile("sliding(100) | sink(4)", 4096, block_q=128, block_kv=128)
  for dtype in (jnp.bfloat16, jnp.float16):
    assert api.choose(bm, platform="gpu", head_dim=128, dtype=dtype).backend != "mosaic_gpu"


def test_shared_memory_budget():
  """Slots per head dim and key tile: at least two always fit but at head dim 256 with 128
  keys, which is refused."""
  assert mosaic_gpu.stages_for(128, 128) == 2
  assert mosaic_gpu.stages_for(64, 128) >= 3
  assert mosaic_gpu.stages_for(256, 64) == 2
  assert mosaic_gpu.stages_for(256, 128) == 0
  for d in (64, 128, 256):
    for bk in (64, 128):
      s = mosaic_gpu.stages_for(d, bk)
      assert not s or mosaic_gpu.smem_bytes(d, bk, s) <= mosaic_gpu.SMEM_BYTES


def test_backward_plans_every_shape_the_forward_takes():
  """The opt-in backward fits wherever the forward does: two dq warpgroups but at head dim
  256 (one, 64 rows a CTA), one dk/dv warpgroup per 64 keys, at least two slots each."""
  from maskc.kernels.mosaic_gpu import backward as mb
  for d in (64, 128, 256):
    for bk in (64, 128):
      if not mosaic_gpu.stages_for(d, bk):
        continue
      cfg = mosaic_gpu.Config(pred=maskc.compile("causal", 256).predicates[0], block_kv=bk,
                              q_len=256, kv_len=256, n_q_tiles=2, n_kv_tiles=256 // bk,
                              groups=1, head_dim=d, dtype="bfloat16", scale=1.0, cap=None,
                              has_sinks=False, batched_meta=False, stages=2)
      plan = mb.plan(cfg)
      assert plan is not None and mb.refusal(cfg) is None, (d, bk)
      assert plan.dq_wgs == (1 if d == 256 else 2) and plan.dkv_wgs == bk // 64
      assert plan.dq_stages >= 2 and plan.dkv_stages >= 2
      assert mb.dq_smem_bytes(d, bk, plan.dq_wgs, plan.dq_stages) <= mb.SMEM_BYTES
      assert mb.dkv_smem_bytes(d, bk, plan.q_sub, plan.dkv_stages) <= mb.SMEM_BYTES
