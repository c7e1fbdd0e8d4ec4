"""`run_with_lse` of the flash and splash backends: values and gradients through both outputs.

Ring attention combines partial attentions with weights from their log-sum-exps,
so gradients flow through `lse` as well as `out`. Every backend's `run_with_lse`
is checked against `maskc.kernels.xla.run_with_lse` and against independent
dense references written here: float64 NumPy for the values, a float32
jax.numpy formula differentiated by JAX for the gradients of a loss that uses
both outputs. The masks come from `maskc.materialize`; drawn ones include rows
with no allowed key (out 0, lse `NEG_LSE`, no gradient), GQA and a soft cap.
Flash and splash run in Pallas interpret mode on CPU.
"""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import attention_reference
import maskc
from attention_reference import jnp_reference, numpy_reference
from helpers import assert_close
from maskc.kernels import xla
from maskc.kernels.flash import kernel as flash
from maskc.kernels.splash import jax_kernel as splash

TOL = 1e-5
HEADS = [(1, 1), (2, 1), (4, 2)]


# ----------------------------------------------------------------------------- references


def values_and_grads(fn, q, k, v, w, c):
  """`(out, lse)` and the gradients w.r.t. q, k, v of `sum(w out) + sum(c lse)`."""
  def loss(q, k, v):
    out, lse = fn(q, k, v)
    return (out * w).sum() + (lse * c).sum(), (out, lse)
  (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2),
                                                      has_aux=True))(q, k, v)
  return out, lse, grads


def assert_lse_close(lse, ref, what: str) -> None:
  """Like `assert_close` over the rows that see a key; the others must be `NEG_LSE` exactly."""
  lse, ref = np.asarray(lse), np.asarray(ref)
  neg = np.float32(xla.NEG_LSE)                  # as the kernels store it
  empty = ref.astype(np.float32) == neg
  np.testing.assert_array_equal(lse[empty], neg, err_msg=f"{what}: empty rows")
  assert_close(np.where(empty, 0.0, lse), np.where(empty, 0.0, ref), TOL, what)


# ----------------------------------------------------------------------------- cases


def pattern(rng, lq: int, lkv: int, density: float, empty_rows: float) -> np.ndarray:
  """A random pairwise mask `[Lkv, Lkv]` indexed by absolute positions, some rows empty.

  Rows are query positions: with the default offset, row `i` of a `[Lq, Lkv]`
  mask reads position `Lkv - Lq + i`.
  """
  m = rng.random((lkv, lkv)) < density
  m[rng.random(lkv) < empty_rows] = False
  return m


@st.composite
def cases(draw, blocks: tuple[int, ...], max_tiles: int):
  """A mask (text and operands), lengths, tiles, heads, soft cap and a seed."""
  t = draw(st.sampled_from(blocks), label="tile")
  lkv = draw(st.integers(t // 2, max_tiles * t), label="kv_len")
  lq = draw(st.integers(max(1, lkv // 2), lkv), label="q_len")
  seed = draw(st.integers(0, 2**16), label="seed")
  kind = draw(st.sampled_from(["pattern", "sliding", "chunk", "causal"]), label="kind")
  rng = np.random.default_rng(seed)
  if kind == "pattern":
    density = draw(st.sampled_from([0.05, 0.3, 0.9]), label="density")
    mask, ops = "m[q, k]", {"m": pattern(rng, lq, lkv, density, 0.25)}
  elif kind == "sliding":      # rows of positions below the threshold see no key
    w, lo = draw(st.integers(1, lkv), label="window"), draw(st.integers(0, lkv), label="from")
    mask, ops = f"sliding({w}) & q >= {lo}", {}
  elif kind == "chunk":
    mask, ops = f"causal & chunk({draw(st.integers(1, lkv), label='chunk')})", {}
  else:
    mask, ops = "causal", {}
  h, hkv = draw(st.sampled_from(HEADS), label="heads")
  cap = draw(st.sampled_from([None, 2.0]), label="soft cap")
  return dict(mask=mask, ops=ops, lq=lq, lkv=lkv, tile=t, h=h, hkv=hkv, cap=cap, seed=seed)


def inputs(seed: int, b: int, lq: int, lkv: int, h: int, hkv: int, d: int = 16):
  """q, k, v ~ N(0, 1) and the loss weights w (on out) and c (on lse)."""
  kq, kk, kv, kw, kc = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(kq, (b, lq, h, d), jnp.float32)
  k = jax.random.normal(kk, (b, lkv, hkv, d), jnp.float32)
  v = jax.random.normal(kv, (b, lkv, hkv, d), jnp.float32)
  return q, k, v, jax.random.normal(kw, (b, lq, h, d)), jax.random.normal(kc, (b, lq, h))


def check_case(run_with_lse, case, **kw) -> None:
  """`run_with_lse` against xla's and the dense references, values and gradients."""
  lq, lkv, t = case["lq"], case["lkv"], case["tile"]
  q, k, v, w, c = inputs(case["seed"], 2, lq, lkv, case["h"], case["hkv"])
  mask, ops, cap = case["mask"], case["ops"], case["cap"]
  bm = maskc.compile(mask, lq, lkv, block_q=t, block_kv=t, operands=ops)
  allowed = maskc.materialize(mask, lq, lkv, operands=ops)
  assert allowed.shape == (lq, lkv)
  scale = 1 / np.sqrt(q.shape[-1])

  out, lse, grads = values_and_grads(
      lambda q, k, v: run_with_lse(q, k, v, bm, logits_soft_cap=cap, **kw), q, k, v, w, c)
  assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
  out_x, lse_x, grads_x = values_and_grads(
      lambda q, k, v: xla.run_with_lse(q, k, v, bm, logits_soft_cap=cap), q, k, v, w, c)
  out_d, lse_d, grads_d = values_and_grads(
      lambda q, k, v: jnp_reference(q, k, v, allowed, scale, cap), q, k, v, w, c)
  out_np, lse_np = numpy_reference(q, k, v, allowed, scale, cap)

  what = f"{mask} ({lq}x{lkv}, tile {t}, heads {case['h']}/{case['hkv']}, cap {cap})"
  assert_close(out, out_np, TOL, f"out vs numpy, {what}")
  assert_lse_close(lse, lse_np, f"lse vs numpy, {what}")
  assert_close(out, out_x, TOL, f"out vs xla, {what}")
  assert_lse_close(lse, lse_x, f"lse vs xla, {what}")
  empty = ~allowed.any(-1)
  np.testing.assert_array_equal(np.asarray(out)[:, empty], 0.0)
  # the references agree with each other (so a shared mistake would show)
  assert_close(out_d, out_np, TOL, f"jnp reference out, {what}")
  assert_lse_close(lse_d, lse_np, f"jnp reference lse, {what}")
  for name, g, gx, gd in zip("qkv", grads, grads_x, grads_d):
    assert_close(g, gd, TOL, f"d{name} vs dense, {what}")
    assert_close(g, gx, TOL, f"d{name} vs xla, {what}")
  # rows without keys get no gradient
  np.testing.assert_array_equal(np.asarray(grads[0])[:, empty], 0.0)


# ----------------------------------------------------------------------------- tests


@pytest.mark.slow  # ~20 s in interpret mode; runs with `make test-slow` (CI)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(blocks=(16, 32), max_tiles=2))
def test_flash_matches_xla_and_dense(case):
  check_case(flash.run_with_lse, case, interpret=True)


@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(blocks=(128,), max_tiles=2))
def test_splash_matches_xla_and_dense(case):
  check_case(splash.run_with_lse, case, interpret=True)


@pytest.mark.slow  # the sharded ring tests combine by lse too; this one isolates it
@pytest.mark.parametrize("backend", ["flash", "splash"])
def test_combining_two_key_halves_by_lse_is_full_attention(backend):
  """Ring attention's combination of two partial results, forward and gradients.

  Keys split in halves, each attended with its own map (kv positions of the half),
  combined with `exp(lse_t - LSE)` weights, equals attention over all keys. The
  gradients reach q and k through the weights, so a dropped lse cotangent fails.
  """
  t = 16 if backend == "flash" else 128
  mod = {"flash": flash, "splash": splash}[backend]
  lq = lkv = 2 * t
  mask = "sliding(20) & q >= 3"
  q, k, v, w, _ = inputs(11, 1, lq, lkv, 2, 2)
  halves = [maskc.compile(mask, lq, t, block_q=t, block_kv=t,
                          kv_positions=np.arange(s * t, (s + 1) * t), q_offset=0)
            for s in range(2)]

  def combined(q, k, v):
    parts = [mod.run_with_lse(q, k[:, s * t:(s + 1) * t], v[:, s * t:(s + 1) * t], bm,
                              interpret=True) for s, bm in enumerate(halves)]
    lse = jnp.stack([p[1] for p in parts])
    top = jax.lax.stop_gradient(lse.max(0))
    wts = jnp.exp(lse - top)
    total = wts.sum(0)
    wts = wts / jnp.where(total > 0, total, 1.0)
    return sum(wt[..., None] * p[0] for wt, p in zip(wts, parts))

  allowed = maskc.materialize(mask, lq, q_offset=0)
  scale = 1 / np.sqrt(q.shape[-1])

  def full(q, k, v):
    return jnp_reference(q, k, v, allowed, scale, None)[0]

  got = jax.jit(jax.value_and_grad(lambda q, k, v: (combined(q, k, v) * w).sum(),
                                   argnums=(0, 1, 2)))(q, k, v)
  want = jax.value_and_grad(lambda q, k, v: (full(q, k, v) * w).sum(), argnums=(0, 1, 2))(q, k, v)
  assert_close(got[0], want[0], TOL, f"{backend} combined loss")
  for name, g, r in zip("qkv", got[1], want[1]):
    assert_close(g, r, TOL, f"{backend} combined d{name}")


def test_splash_batched_segment_ids():
  """Per-batch-row documents: splash's SegmentIds path; rows before position 5 empty."""
  backend, t, mod = "splash", 128, splash
  n = 150
  seg = np.sort(np.random.default_rng(2).integers(0, 3, (2, n)), -1).astype(np.int32)
  mask, ops = "causal & document(seg) & q >= 5", {"seg": seg}
  q, k, v, w, c = inputs(3, 2, n, n, 2, 1)
  bm = maskc.compile(mask, n, block_q=t, block_kv=t, operands=ops)
  allowed = maskc.materialize(mask, n, operands=ops)[:, None]          # [B, 1, Lq, Lkv]
  scale = 1 / np.sqrt(q.shape[-1])
  out, lse, grads = values_and_grads(
      lambda q, k, v: mod.run_with_lse(q, k, v, bm, interpret=True), q, k, v, w, c)
  out_np, lse_np = numpy_reference(q, k, v, allowed, scale, None)
  _, _, grads_d = values_and_grads(
      lambda q, k, v: jnp_reference(q, k, v, allowed, scale, None), q, k, v, w, c)
  assert_close(out, out_np, TOL, f"{backend} out")
  assert_lse_close(lse, lse_np, f"{backend} lse")
  for name, g, gd in zip("qkv", grads, grads_d):
    assert_close(g, gd, TOL, f"{backend} d{name}")


@pytest.mark.parametrize("backend", ["flash", "splash"])
def test_per_head_maps_are_refused(backend):
  mod = {"flash": flash, "splash": splash}[backend]
  t = 16 if backend == "flash" else 128
  x = jnp.ones((1, t, 2, 16))
  bm = maskc.compile(["causal", "sliding(3)"], t, block_q=t, block_kv=t)
  with pytest.raises(maskc.MaskValueError, match="one mask for every head"):
    mod.run_with_lse(x, x, x, bm, interpret=True)


def test_references_mark_empty_rows_as_the_kernels_do():
  assert attention_reference.NEG_LSE == xla.NEG_LSE
