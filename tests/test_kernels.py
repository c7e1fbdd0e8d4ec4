"""Every attention backend against the dense reference, forward and gradients.

One shared base, `KernelTests`, holds the tests; each backend subclasses it and
says what it supports with `supports_*` flags (tokamax style). The dense
reference itself is checked against an independent float64 NumPy formula over a
mask materialized by `maskc.materialize`.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings

import maskc
from attention_reference import numpy_scores, repeat_kv
from helpers import assert_close
from maskc.kernels import api, dense
from maskc.kernels.splash import jax_kernel as splash
from sampling import PARTS, count

try:
  from maskc.testing import mask_trees as random_masks, seeded_operand_values as operand_values
except ImportError:  # pragma: no cover - the strategies helper is optional
  random_masks = None
  operand_values = None

F32_TOL = 1e-5
BF16_TOL = 2e-2
HEADS = [(1, 1), (2, 1), (2, 2), (4, 2)]


def prelude_texts(lengths_max: int) -> st.SearchStrategy:
  """Prelude-based mask texts with drawn parameters (operands: seg, img)."""
  n = st.integers(1, max(1, lengths_max))
  small = st.integers(0, max(0, lengths_max // 2))
  return st.one_of(
      st.just("causal"), st.just("full"),
      n.map(lambda w: f"sliding({w})"),
      n.map(lambda c: f"causal & chunk({c})"),
      small.map(lambda p: f"causal | prefix({p})"),
      st.tuples(n, small).map(lambda a: f"sliding({a[0]}) | sink({a[1]})"),
      st.tuples(small, small).map(lambda a: f"local({a[0]}, {a[1]})"),
      st.just("causal & document(seg)"), st.just("document(seg)"),
      st.just("causal | bidirectional(img)"))


def token_operands(kv_len: int, seed: int, batch: int | None) -> dict:
  """seg (sorted segment ids) and img (image-token flags) for masks of `kv_len` keys."""
  rng = np.random.default_rng(seed)
  lead = () if batch is None else (batch,)
  seg = np.sort(rng.integers(0, 4, size=lead + (kv_len,)), axis=-1).astype(np.int32)
  return {"seg": seg, "img": rng.random(lead + (kv_len,)) < 0.5}


def qkv(seed: int, b: int, lq: int, lkv: int, h: int, hkv: int, d: int, dtype=jnp.float32):
  kq, kk, kv, kw = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (b, lq, h, d), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (b, lkv, hkv, d), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, lkv, hkv, d), jnp.float32).astype(dtype)
  w = jax.random.normal(kw, (b, lq, h, d), jnp.float32)
  return q, k, v, w


def out_and_grads(fn, q, k, v, w):
  """`fn(q, k, v)` and its gradients for the cotangent `w`, in one jitted vjp."""
  @jax.jit
  def both(q, k, v, w):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(w.astype(out.dtype))
  return both(q, k, v, w)


def dense_attention(q, k, v, mask, **kw):
  """The dense reference through the public face (it compiles the mask's predicate)."""
  return maskc.attention(q, k, v, mask, backend="dense", **kw)


class KernelTests:
  """Shared tests; subclasses set `backend` and what it supports."""

  backend: str = ""
  blocks: tuple[int, ...] = (16, 32)
  max_len: int = 96
  max_examples: int = 10
  supports_ragged = True           # lengths that are not multiples of the tiles
  supports_random_masks = True     # any mask of maskc.testing.mask_trees
  supports_batch_operands = True   # operands with a batch axis, any mask
  supports_cross_lengths = True    # q_len != kv_len

  def run(self, q, k, v, mask, **kw):
    return maskc.attention(q, k, v, mask, backend=self.backend, **kw)

  def supported(self, mask) -> bool:
    """Whether this backend takes the drawn mask (others must raise BackendError)."""
    return True

  # --------------------------------------------------------------------- drawing

  def draw_lengths(self, data) -> tuple[int, int]:
    if not self.supports_ragged:
      block = self.blocks[0]
      kv_len = block * data.draw(st.integers(1, self.max_len // block), label="kv tiles")
      q_len = kv_len if not self.supports_cross_lengths else block * data.draw(
          st.integers(1, kv_len // block), label="q tiles")
      return q_len, kv_len
    kv_len = data.draw(st.integers(1, self.max_len), label="kv_len")
    q_len = data.draw(st.integers(1, kv_len), label="q_len")
    return q_len, kv_len

  def draw_mask(self, data, kv_len: int):
    choices = [prelude_texts(kv_len)]
    if self.supports_random_masks and random_masks is not None:
      choices.append(random_masks(max_leaves=4, term_leaves=3))
    mask = data.draw(st.one_of(*choices), label="mask")
    return mask

  def draw_case(self, data):
    q_len, kv_len = self.draw_lengths(data)
    mask = self.draw_mask(data, kv_len)
    m = maskc.parse(mask) if isinstance(mask, str) else mask
    assume(self.supported(m))
    batched = data.draw(st.booleans(), label="batched operands") and self.supports_batch_operands
    b = 2
    seed = data.draw(st.integers(0, 2**16), label="seed")
    ops = (operand_values(kv_len, seed, b if batched else None) if operand_values else {})
    ops.update(token_operands(kv_len, seed, b if batched else None))
    ops = {s.name: ops[s.name] for s in m.operands}
    h, hkv = data.draw(st.sampled_from(HEADS), label="heads")
    block_q = data.draw(st.sampled_from(self.blocks), label="block_q")
    block_kv = data.draw(st.sampled_from(self.blocks), label="block_kv")
    kw = dict(block_q=block_q, block_kv=block_kv, operands=ops)
    if data.draw(st.booleans(), label="soft cap"):
      kw["logits_soft_cap"] = 2.0
    if data.draw(st.booleans(), label="sinks"):
      kw["sinks"] = jnp.linspace(-1.0, 1.0, h)
    return dict(mask=m, b=b, q_len=q_len, kv_len=kv_len, h=h, hkv=hkv, seed=seed, kw=kw)

  def compare(self, case, dtype, tol):
    q, k, v, w = qkv(case["seed"], case["b"], case["q_len"], case["kv_len"], case["h"],
                     case["hkv"], 16, dtype)
    kw = dict(case["kw"])
    mask = case["mask"]
    bm = maskc.compile(mask, case["q_len"], case["kv_len"], block_q=kw.pop("block_q"),
                       block_kv=kw.pop("block_kv"), operands=kw.pop("operands"))

    def ours(q, k, v):
      return self.run(q, k, v, bm, **kw)
    def ref(q, k, v):
      return dense.run(q.astype(jnp.float32), k.astype(jnp.float32),
                                        v.astype(jnp.float32), bm, **kw)
    out, grads = out_and_grads(ours, q, k, v, w)
    out_ref, grads_ref = out_and_grads(ref, q, k, v, w)
    assert_close(out, out_ref, tol, f"{self.backend} output, {mask}")
    for name, a, r in zip("qkv", grads, grads_ref):
      assert_close(a, r, tol, f"{self.backend} d{name}, {mask}")

  # --------------------------------------------------------------------- tests

  # Each example compiles a kernel and the reference: the default run draws a share of them,
  # `-m slow` all (sampling.py).
  @pytest.mark.parametrize("part", PARTS)
  def test_matches_dense_float32(self, part):
    @settings(max_examples=count(self.max_examples, part), deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(st.data())
    def check(data):
      self.compare(self.draw_case(data), jnp.float32, F32_TOL)
    check()

  @pytest.mark.parametrize("part", PARTS)
  def test_matches_dense_bfloat16(self, part):
    @settings(max_examples=count(max(2, self.max_examples // 3), part), deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(st.data())
    def check(data):
      self.compare(self.draw_case(data), jnp.bfloat16, BF16_TOL)
    check()

  def lengths(self, q_len: int, kv_len: int) -> tuple[int, int]:
    """Fixed-test lengths this backend takes (rounded up to its tiles if not ragged)."""
    if self.supports_ragged:
      return q_len, kv_len
    t = self.blocks[0]
    return -(-q_len // t) * t, -(-kv_len // t) * t

  # One kernel compile per mask: the default run takes the one with empty rows among partial
  # tiles, `-m slow` the others.
  @pytest.mark.parametrize("which", [2, pytest.param(0, marks=pytest.mark.slow),
                                     pytest.param(1, marks=pytest.mark.slow)])
  def test_empty_rows_are_zero_with_zero_gradients(self, which):
    lq, lkv = self.lengths(70, 70)
    t = self.blocks[0]
    q, k, v, w = qkv(0, 1, lq, lkv, 2, 1, 16)
    mask = ("empty", f"causal & q >= {lq - 3}", f"k >= {2 * t} & q < {t + 3}")[which]
    def run(q, k, v):
      return self.run(q, k, v, mask, block_q=t, block_kv=t)
    out, grads = out_and_grads(run, q, k, v, w)
    empty = ~maskc.materialize(mask, lq, lkv).any(-1)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out)[:, empty], 0.0)
    for g in grads:
      assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_array_equal(np.asarray(grads[0])[:, empty], 0.0)
    out_ref, grads_ref = out_and_grads(lambda q, k, v: dense_attention(q, k, v, mask), q, k, v,
                                       w)
    assert_close(out, out_ref, F32_TOL, mask)
    for name, g, r in zip("qkv", grads, grads_ref):
      assert_close(g, r, F32_TOL, f"d{name}, {mask}")

  # NumPy inputs reach every backend outside jit (notebooks, data pipelines): the kernels
  # index q, k and v with traced tile ids, which a NumPy array cannot take.
  @pytest.mark.parametrize("inputs", ["numpy", "mixed", "mixed dtypes"])
  def test_numpy_and_mixed_inputs(self, inputs):
    lq, lkv = self.lengths(64, 64)
    t = self.blocks[0]
    q, k, v, _ = qkv(7, 3, lq, lkv, 4, 2, 16)
    seg = np.repeat(np.arange(3), lkv // 3 + 1)[:lkv].astype(np.int32)
    mask, ops = "causal & document(seg) | sink(2)", {"seg": seg}
    if inputs == "numpy":
      args = tuple(np.asarray(x) for x in (q, k, v))
    elif inputs == "mixed":
      args = (np.asarray(q), k, np.asarray(v))
    else:  # float32 NumPy queries, bfloat16 keys and values: the output takes q's dtype
      args = (np.asarray(q), k.astype(jnp.bfloat16), np.asarray(v.astype(jnp.bfloat16)))
    out = self.run(*args, mask, operands=ops, block_q=t, block_kv=t, sinks=np.ones(4))
    assert out.dtype == jnp.float32
    ref = dense_attention(*(jnp.asarray(x, jnp.float32) for x in args), mask, operands=ops,
                          sinks=np.ones(4))
    assert_close(out, ref, BF16_TOL if inputs == "mixed dtypes" else F32_TOL, inputs)

  def test_gqa_soft_cap_and_sinks(self):
    lq, lkv = self.lengths(64, 64)
    t = self.blocks[0]
    q, k, v, w = qkv(1, 2, lq, lkv, 4, 2, 16)
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0])
    mask = f"sliding({t + 5}) | sink(3)"

    def loss(fn):
      return jax.jit(jax.value_and_grad(
          lambda s, q: (fn(q, k, v, mask, logits_soft_cap=3.0, sinks=s) * w).sum(), (0, 1)))

    def ours(*a, **kw):
      return self.run(*a, block_q=t, block_kv=t, **kw)
    (val, (g_s, g_q)) = loss(ours)(sinks, q)
    (val_ref, (g_s_ref, g_q_ref)) = loss(dense_attention)(sinks, q)
    assert_close(val, val_ref, F32_TOL * lq, "loss")
    assert_close(g_s, g_s_ref, F32_TOL, "d sinks")
    assert_close(g_q, g_q_ref, F32_TOL, "dq")

  def test_mqa_and_cross_lengths(self):
    if not self.supports_cross_lengths:
      pytest.skip(f"{self.backend} needs q_len == kv_len")
    lq, lkv = self.lengths(40, 100)
    t = self.blocks[0]
    q, k, v, _ = qkv(2, 1, lq, lkv, 3, 1, 16)
    for mask in ("causal", "sliding(17)"):
      out = jax.jit(lambda q, k, v, mask=mask: self.run(q, k, v, mask, block_q=t, block_kv=t))(
          q, k, v)
      assert_close(out, dense_attention(q, k, v, mask), F32_TOL, mask)

  def test_q_longer_than_kv_has_empty_rows(self):
    if not self.supports_cross_lengths:
      pytest.skip(f"{self.backend} needs q_len == kv_len")
    t = self.blocks[0]
    lq, lkv = (80, 48) if self.supports_ragged else (2 * t, t)
    q, k, v, _ = qkv(3, 1, lq, lkv, 2, 2, 16)
    out = jax.jit(lambda q, k, v: self.run(q, k, v, "causal", block_q=t, block_kv=t))(q, k, v)
    assert_close(out, dense_attention(q, k, v, "causal"), F32_TOL, "causal, q_len > kv_len")
    np.testing.assert_array_equal(np.asarray(out)[:, :lq - lkv], 0.0)

  def test_batched_segment_ids(self):
    lq, lkv = self.lengths(64, 64)
    t = self.blocks[0]
    q, k, v, w = qkv(4, 2, lq, lkv, 2, 1, 16)
    seg = np.stack([np.repeat(np.arange(4), lkv // 4 + 1)[:lkv],
                    np.repeat(np.arange(2), lkv // 2 + 1)[:lkv]]).astype(np.int32)
    mask = "causal & document(seg)"
    def run(q, k, v):
      return self.run(q, k, v, mask, operands={"seg": seg}, block_q=t, block_kv=t)
    def ref(q, k, v):
      return dense_attention(q, k, v, mask, operands={"seg": seg})
    out, grads = out_and_grads(run, q, k, v, w)
    out_ref, grads_ref = out_and_grads(ref, q, k, v, w)
    assert_close(out, out_ref, F32_TOL, mask)
    for name, g, r in zip("qkv", grads, grads_ref):
      assert_close(g, r, F32_TOL, f"d{name}, {mask}")

  # Three compiles per mask: the default run takes the first, `-m slow` the second.
  @pytest.mark.parametrize("mask", ["causal & document(seg)", pytest.param(
      "document(seg) & q - k < 40", marks=pytest.mark.slow)])
  def test_traced_operands_under_jit(self, mask):
    lq, lkv = self.lengths(64, 64)
    t = self.blocks[0]
    q, k, v, w = qkv(5, 2, lq, lkv, 2, 2, 16)
    seg = np.stack([np.repeat(np.arange(3), lkv // 3 + 1)[:lkv],
                    np.repeat(np.arange(5), lkv // 5 + 1)[:lkv]]).astype(np.int32)
    def run(q, k, v, seg):
      return self.run(q, k, v, mask, operands={"seg": seg}, block_q=t,
                                            block_kv=t)
    out, grads = out_and_grads(lambda q, k, v: run(q, k, v, jnp.asarray(seg)), q, k, v, w)
    out2 = jax.jit(run)(q, k, v, jnp.asarray(seg))
    def ref(q, k, v):
      return dense_attention(q, k, v, mask, operands={"seg": seg})
    out_ref, grads_ref = out_and_grads(ref, q, k, v, w)
    assert_close(out, out_ref, F32_TOL, mask)
    assert_close(out2, out_ref, F32_TOL, mask)
    for name, g, r in zip("qkv", grads, grads_ref):
      assert_close(g, r, F32_TOL, f"d{name}, {mask}")

  def test_jit_grad_vmap(self):
    lq, lkv = self.lengths(48, 48)
    t = self.blocks[0]
    q, k, v, _ = qkv(6, 3, lq, lkv, 2, 1, 16)
    mask = "causal & chunk(20)" if self.supports_ragged else f"causal & chunk({t})"
    def one(q, k, v):
      return self.run(q[None], k[None], v[None], mask, block_q=t, block_kv=t)[0]
    out = jax.jit(jax.vmap(one))(q, k, v)
    assert_close(out, dense_attention(q, k, v, mask), F32_TOL, "vmap")
    g = jax.jit(jax.grad(lambda q: jax.vmap(one)(q, k, v).sum()))(q)
    g_ref = jax.grad(lambda q: dense_attention(q, k, v, mask).sum())(q)
    assert_close(g, g_ref, F32_TOL, "grad of vmap")

  def test_head_dims_not_powers_of_two(self):
    lq, lkv = self.lengths(48, 48)
    t = self.blocks[0]
    q, k, _, _ = qkv(9, 1, lq, lkv, 2, 1, 24)
    v = jax.random.normal(jax.random.key(10), (1, lkv, 1, 40))
    out = jax.jit(lambda q, k, v: self.run(q, k, v, "causal", block_q=t, block_kv=t))(q, k, v)
    assert out.shape == (1, lq, 2, 40)
    assert_close(out, dense_attention(q, k, v, "causal"), F32_TOL, "D=24, Dv=40")

  def test_per_head_masks(self):
    lq, lkv = self.lengths(64, 64)
    t = self.blocks[0]
    q, k, v, _ = qkv(7, 1, lq, lkv, 4, 2, 16)
    masks = ["causal", f"sliding({t})", "causal", "full"]
    out = jax.jit(lambda q, k, v: self.run(q, k, v, masks, block_q=t, block_kv=t))(q, k, v)
    assert_close(out, dense_attention(q, k, v, masks), F32_TOL, "per-head masks")


class TestDenseReference:
  """The dense reference against a float64 NumPy softmax over `maskc.materialize`."""

  @staticmethod
  def numpy_attention(q, k, v, allowed, scale, cap=None, sinks=None):
    s = numpy_scores(q, k, allowed, scale, cap)
    v = repeat_kv(v, s.shape[1])
    m = s.max(-1, keepdims=True)
    if sinks is not None:
      m = np.maximum(m, np.asarray(sinks, np.float64)[None, :, None, None])
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    denom = p.sum(-1, keepdims=True)
    if sinks is not None:
      denom = denom + np.exp(np.asarray(sinks, np.float64)[None, :, None, None] - m)
    p = p / np.where(denom == 0, 1.0, denom)
    return np.einsum("bhqk,bkhd->bqhd", p, v)

  @pytest.mark.parametrize("part", PARTS)
  def test_dense_matches_numpy(self, part):
    # A jit compile per example: the default run draws a share, `-m slow` all (sampling.py).
    settings(max_examples=count(10, part), deadline=None)(given(st.data())(self._dense_check))()

  def _dense_check(self, data):
    kv_len = data.draw(st.integers(1, 40))
    q_len = data.draw(st.integers(1, kv_len))
    mask = data.draw(prelude_texts(kv_len))
    batched = data.draw(st.booleans())
    ops = token_operands(kv_len, 0, 2 if batched else None)
    ops = {s.name: ops[s.name] for s in maskc.parse(mask).operands}
    h, hkv = data.draw(st.sampled_from(HEADS))
    cap = data.draw(st.sampled_from([None, 1.5]))
    sinks = data.draw(st.sampled_from([None, np.linspace(-1, 1, h)]))
    q, k, v, _ = qkv(data.draw(st.integers(0, 99)), 2, q_len, kv_len, h, hkv, 8)
    out = jax.jit(lambda q, k, v: dense_attention(
        q, k, v, mask, operands=ops, logits_soft_cap=cap,
        sinks=None if sinks is None else jnp.asarray(sinks)))(q, k, v)
    allowed = np.asarray(maskc.materialize(mask, q_len, kv_len, operands=ops))
    allowed = allowed[:, None] if allowed.ndim == 3 else allowed[None, None]
    ref = self.numpy_attention(q, k, v, allowed, 1 / math.sqrt(8), cap, sinks)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6, rtol=1e-5)


class TestDense(KernelTests):
  """The base run on the reference itself: the unbound (`bind`) path against the BlockMap one."""
  backend = "dense"
  max_examples = 2


class TestXla(KernelTests):
  backend = "xla"
  blocks = (8, 16, 32)
  max_examples = 12

  def test_work_tracks_density(self):
    # Scan steps × lanes cover the non-empty tiles, not the grid nor n_q × the longest row.
    from maskc.kernels import common as _common, xla
    for text, most in (("sliding(64)", 4), ("causal", 32)):
      bm = maskc.compile(text, 1024, block_q=32, block_kv=32)
      steps = 0
      for state in (_common.FULL, _common.PARTIAL):
        i, j, count, _ = _common.tile_pairs(bm, 0, state)
        xs, _, _ = xla._lanes(i, j, count, bm.n_q_tiles, np)
        steps += xs[0].shape[0]
        assert xs[0].shape[0] == -(-int(count.max()) // bm.n_q_tiles)
      nonempty = bm.counts["full"] + bm.counts["partial"]
      assert steps <= nonempty / bm.n_q_tiles + 2 and steps <= most

  def test_traced_lists_are_bounded_by_the_static_part(self):
    from maskc.kernels import common as _common
    seen = {}

    @jax.jit
    def f(seg):
      bm = maskc.compile("sliding(64) & document(seg)", 1024, block_q=32, block_kv=32,
                         operands={"seg": seg})
      idx, _, static = _common.tile_lists(bm, 0, _common.PARTIAL)
      i, _, _, _ = _common.tile_pairs(bm, 0, _common.PARTIAL)
      seen["m"], seen["static"], seen["t"] = idx.shape[-1], static, i.shape[-1]
      return idx

    f(jnp.zeros(1024, jnp.int32))
    assert not seen["static"] and seen["m"] <= 3 and seen["t"] <= 3 * 32


def test_vmap_over_operands():
  q = jax.random.normal(jax.random.key(0), (3, 1, 48, 2, 16))
  seg = np.sort(np.random.default_rng(0).integers(0, 3, (3, 48)), -1).astype(np.int32)
  mask = "causal & document(seg)"
  f = jax.jit(jax.vmap(lambda q, s: maskc.attention(q, q, q, mask, operands={"seg": s},
                                                  backend="xla", block_q=16, block_kv=16)))
  out = f(q, jnp.asarray(seg))
  for n in range(3):
    ref = dense_attention(q[n], q[n], q[n], mask, operands={"seg": seg[n]})
    assert_close(out[n], ref, F32_TOL, f"vmap example {n}")


def test_unknown_backend_names_the_known_ones():
  x = jnp.ones((1, 8, 1, 8))
  with pytest.raises(maskc.BackendError, match="xla"):
    maskc.attention(x, x, x, "causal", backend="cuda")


def test_splash_names_which_kernel_runs():
  """`splash` is tokamax's kernel where tokamax imports, JAX's otherwise; both are named."""
  have_tokamax = importlib.util.find_spec("tokamax") is not None
  assert api.BACKENDS["splash"].resolved() == ("splash_tokamax" if have_tokamax else "splash_jax")
  assert api.BACKENDS["splash_jax"].load() is splash
  assert api.choose_backend("splash_jax", 512, 512) == "splash_jax"
  if not have_tokamax:
    assert api.BACKENDS["splash"].load() is splash
    with pytest.raises(maskc.BackendError, match=r"pip install -e \"\.\[tokamax\]\""):
      api.BACKENDS["splash_tokamax"].load()
  x = jnp.ones((1, 8, 1, 8))
  with pytest.raises(maskc.BackendError, match="splash, splash_tokamax, splash_jax"):
    maskc.attention(x, x, x, "causal", backend="cuda")


def test_bad_shapes_raise_mask_value_error():
  x = jnp.ones((1, 8, 3, 8))
  k = jnp.ones((1, 8, 2, 8))
  with pytest.raises(maskc.MaskValueError, match="multiple"):
    maskc.attention(x, k, k, "causal")
  with pytest.raises(maskc.MaskValueError, match="shape"):
    maskc.attention(x[0], k, k, "causal")


def test_auto_picks_xla_on_cpu_and_dense_when_tiny(monkeypatch):
  calls = []
  for name in ("dense", "xla"):
    mod = api.BACKENDS[name].load()
    monkeypatch.setattr(mod, "run", (lambda n, f: lambda *a, **k: (calls.append(n), f(*a, **k))[1])(
        name, mod.run))
  x = jnp.ones((1, 64, 1, 8))
  maskc.attention(x, x, x, "causal")
  y = jnp.ones((1, 1024, 1, 8))
  maskc.attention(y, y, y, "sliding(64)")
  maskc.attention(y, y, y, "full")
  assert calls == ["dense", "xla", "dense"]


class _Picked(Exception):
  """Raised by a faked backend: `auto` chose it (not an error `auto` falls back from)."""


def fake_platform(monkeypatch, name: str, real=()):
  """Pretends jax runs on `name`; records each backend `attention` calls.

  Every module that imported `platform` sees the fake. A backend in `real` runs
  for real (with its own errors, so `auto`'s fallback shows); any other raises
  `_Picked` once recorded, so no kernel is run.
  """
  from maskc.kernels import platform as _platform
  from maskc.kernels.flash import kernel as flash
  # "splash" is tokamax's module where tokamax imports, JAX's otherwise.
  for mod in {_platform, api, flash, splash, api.BACKENDS["splash"].load()}:
    monkeypatch.setattr(mod, "platform", lambda: name)
  calls: list[str] = []
  for backend in ("dense", "xla", "flash", "splash", "cudnn", "tokamax"):
    mod = api.BACKENDS[backend].load()
    real_run = mod.run

    def run(*a, _n=backend, _f=real_run, **kw):
      calls.append(_n)
      if _n in real:
        return _f(*a, **kw)
      raise _Picked(_n)

    monkeypatch.setattr(mod, "run", run)
  return calls


def picks(monkeypatch, platform: str, q_len: int, mask: str, ops=None, real=(), batch=1,
          **kw):
  """The backends `maskc.attention(..., backend="auto")` calls on a faked platform."""
  calls = fake_platform(monkeypatch, platform, real)
  ops = ops or {}
  x = jnp.ones((batch, q_len, 1, 8))
  try:
    maskc.attention(x, x, x, mask, operands=ops, **kw)
  except _Picked:
    pass
  monkeypatch.undo()
  return calls


@pytest.mark.parametrize("platform, q_len, mask, want", [
    # TPU: splash whatever the size, density or length (padded in the adapter)
    ("tpu", 1024, "causal", ["splash"]),
    ("tpu", 64, "causal", ["splash"]),
    ("tpu", 1024, "full", ["splash"]),
    ("tpu", 300, "sliding(40)", ["splash"]),
    # GPU: flash, pairwise operands included, any length
    ("gpu", 1024, "causal", ["flash"]),
    ("gpu", 64, "full", ["flash"]),
    ("gpu", 300, "causal & anc[q, k]", ["flash"]),
    # CPU: dense when tiny (dense.tiny) or nearly full, else block-sparse xla
    ("cpu", 256, "sliding(8)", ["dense"]),
    ("cpu", 257, "sliding(8)", ["xla"]),
    ("cpu", 1024, "sliding(64)", ["xla"]),
    ("cpu", 1024, "full", ["dense"]),
    ("cpu", 1024, "causal", ["xla"]),                  # density 0.53: still block-sparse
    ("cpu", 1024, "causal & anc[q, k]", ["xla"]),
])
def test_auto_dispatch_per_platform(monkeypatch, platform, q_len, mask, want):
  ops = {"anc": np.tril(np.ones((q_len, q_len), bool))} if "anc" in mask else {}
  assert picks(monkeypatch, platform, q_len, mask, ops) == want


def test_auto_choose_backend_per_platform(monkeypatch):
  from maskc.kernels import platform as _platform
  for name, want_big, want_tiny in (("tpu", "splash", "splash"), ("gpu", "flash", "flash"),
                                    ("cpu", "xla", "dense")):
    monkeypatch.setattr(api, "platform", lambda n=name: n)
    monkeypatch.setattr(_platform, "platform", lambda n=name: n)
    assert api.choose_backend("auto", 4096, 4096) == want_big, name
    assert api.choose_backend("auto", 16, 16) == want_tiny, name
    assert api.choose_backend("xla", 16, 16) == "xla"             # a named backend is kept
  # A decode row over a long cache: few pairs, but many key tiles to skip.
  assert api.choose_backend("auto", 1, 512) == "dense"
  assert api.choose_backend("auto", 1, 1024) == "xla"


def test_auto_falls_back_to_xla_where_the_native_kernel_cannot_run(monkeypatch):
  # TPU: splash's MaskInfo has no batch axis; image flags per batch row cannot become one
  img = np.zeros((2, 512), bool)
  assert picks(monkeypatch, "tpu", 512, "causal | bidirectional(img)", {"img": img},
               real=("splash",), batch=2) == ["splash", "xla"]
  # ... but batched segment ids become splash SegmentIds: no fallback
  seg = np.repeat([[0, 1], [2, 2]], 128, axis=1).astype(np.int32)
  assert picks(monkeypatch, "tpu", 256, "causal & document(seg)", {"seg": seg},
               real=("splash",), batch=2, interpret=True) == ["splash"]
  # TPU: block_kv off the 128 lanes; GPU: tiles Triton cannot load
  assert picks(monkeypatch, "tpu", 512, "causal", real=("splash",), block_q=64,
               block_kv=64) == ["splash", "xla"]
  assert picks(monkeypatch, "gpu", 96, "causal", real=("flash",), block_q=24,
               block_kv=24) == ["flash", "xla"]


def test_auto_on_a_faked_tpu_runs_ragged_lengths_on_splash(monkeypatch):
  """End to end: `auto` on TPU takes a length off the tiles and matches dense."""
  from maskc.kernels import platform as _platform
  from maskc.kernels.flash import kernel as flash
  splash_mod = api.BACKENDS["splash"].load()          # tokamax's where it imports, else JAX's
  for mod in {_platform, api, flash, splash, splash_mod}:
    monkeypatch.setattr(mod, "platform", lambda: "tpu")
  calls = []
  real_run = splash_mod.run
  monkeypatch.setattr(splash_mod, "run", lambda *a, **kw: (calls.append("splash"),
                                                           real_run(*a, **kw))[1])
  q, k, v, _ = qkv(12, 1, 200, 200, 2, 1, 16)
  out = maskc.attention(q, k, v, "sliding(50) | sink(2)", interpret=True)
  assert calls == ["splash"]
  monkeypatch.undo()
  assert_close(out, dense_attention(q, k, v, "sliding(50) | sink(2)"), F32_TOL, "auto on TPU")


def test_registry_is_immutable():
  with pytest.raises(TypeError):
    api.BACKENDS["mine"] = api.Backend("mine", "x")  # type: ignore[index]


class TestSplash(KernelTests):
  """JAX's splash kernel (`splash_jax`; `splash` is tokamax's where tokamax imports)."""
  backend = "splash_jax"
  blocks = (128,)
  max_len = 256
  max_examples = 4
  supports_ragged = True           # padded to the tiles in the adapter
  supports_batch_operands = False

  def run(self, q, k, v, mask, **kw):
    return maskc.attention(q, k, v, mask, backend=self.backend, interpret=True, **kw)

  def supported(self, mask) -> bool:
    return True

  # Each mask compiles two splash kernels with their gradients: the default run takes causal,
  # `-m slow` the others.
  @pytest.mark.parametrize("name", ["causal", pytest.param("local", marks=pytest.mark.slow),
                                    pytest.param("chunked", marks=pytest.mark.slow)])
  def test_matches_splash_built_from_its_own_mask(self, name):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as sk,
      splash_attention_mask as sm,
    )
    lq = lkv = 256
    text, their = {
        "causal": ("causal", sm.CausalMask((lq, lkv))),
        "local": ("local(100, 20)", sm.LocalMask((lq, lkv), (100, 20), 0)),
        "chunked": ("causal & chunk(96)", sm.ChunkedCausalMask((lq, lkv), 96)),
    }[name]
    q, k, v, w = qkv(8, 1, lq, lkv, 2, 2, 32)
    sizes = sk.BlockSizes(128, 128, 128, 128, 128, 128, 128, 128)
    kernel = sk.make_splash_mha_single_device(sm.MultiHeadMask([their] * 2), block_sizes=sizes,
                                              interpret=True)
    scale = 1 / math.sqrt(32)
    def ref(q, k, v):
      return jnp.swapaxes(kernel(jnp.swapaxes(q[0] * scale, 0, 1),
                                                  jnp.swapaxes(k[0], 0, 1),
                                                  jnp.swapaxes(v[0], 0, 1)), 0, 1)[None]
    def ours(q, k, v):
      return self.run(q, k, v, text, block_q=128, block_kv=128)
    out, grads = out_and_grads(ours, q, k, v, w)
    out_ref, grads_ref = out_and_grads(ref, q, k, v, w)
    assert_close(out, out_ref, F32_TOL, text)
    for n, a, r in zip("qkv", grads, grads_ref):
      assert_close(a, r, F32_TOL, f"d{n}, {text}")

  def test_unsupported_masks_name_the_backends_that_can(self):
    x = jnp.ones((2, 256, 1, 16))
    img = np.zeros((2, 256), bool)
    with pytest.raises(maskc.BackendError, match="xla"):
      self.run(x, x, x, "causal | bidirectional(img)", operands={"img": img}, block_q=128,
               block_kv=128)
    with pytest.raises(maskc.MaskValueError, match="128"):
      self.run(x, x, x, "causal", block_q=64, block_kv=64)

  # A splash kernel with gradients per case: the default run takes two, `-m slow` the others
  # (batched segment ids are also in test_batched_segment_ids).
  @pytest.mark.parametrize("lq, lkv, mask, traced", [
      (100, 300, "sliding(50) | sink(3)", False),     # mask function in the kernel, offset 200
      pytest.param(190, 190, "causal & anc[q, k]", False,  # stored partial blocks
                   marks=pytest.mark.slow),
      (190, 190, "causal & anc[q, k]", True),         # splash's dynamic MaskInfo
      pytest.param(150, 200, "causal & document(seg)", True,  # batched segment ids
                   marks=pytest.mark.slow),
  ])
  def test_ragged_lengths_match_dense(self, lq, lkv, mask, traced):
    """Lengths that are not multiples of the tiles: padded in the adapter, padding masked."""
    rng = np.random.default_rng(lq)
    q, k, v, w = qkv(lq, 2, lq, lkv, 2, 1, 16)
    ops = {"anc": rng.random((lkv, lkv)) < 0.5,
           "seg": np.sort(rng.integers(0, 3, (2, lkv)), -1).astype(np.int32)}
    ops = {n: a for n, a in ops.items() if n in mask}

    def run(q, k, v, ops):
      return self.run(q, k, v, mask, operands=ops, block_q=128, block_kv=128)

    if traced:                                 # jax arrays: compiled inside the trace
      def ours(q, k, v):
        return run(q, k, v, {n: jnp.asarray(a) for n, a in ops.items()})
    else:
      def ours(q, k, v):
        return run(q, k, v, ops)
    out, grads = out_and_grads(ours, q, k, v, w)
    out_ref, grads_ref = out_and_grads(lambda q, k, v: dense_attention(q, k, v, mask,
                                                                       operands=ops), q, k, v, w)
    assert_close(out, out_ref, F32_TOL, mask)
    for name, g, r in zip("qkv", grads, grads_ref):
      assert_close(g, r, F32_TOL, f"d{name}, {mask}")
    bm = maskc.compile(mask, lq, lkv, block_q=128, block_kv=128, operands=ops)
    padded = splash.padded_map(bm)
    assert (padded.q_len, padded.kv_len) == (-(-lq // 128) * 128, -(-lkv // 128) * 128)
    # the padding keys are allowed nowhere; the real ones exactly where the mask says
    allowed = np.asarray(padded.to_dense())
    np.testing.assert_array_equal(allowed[..., lkv:], False)
    np.testing.assert_array_equal(allowed[..., :lq, :lkv], np.asarray(bm.to_dense()))


def _slow(test):
  """A copy of a base-class test marked slow (the base's own marks stay as they are)."""
  @functools.wraps(test)
  def copy(*args, **kwargs):
    return test(*args, **kwargs)
  return pytest.mark.slow(copy)


@pytest.mark.skipif(importlib.util.find_spec("tokamax") is None,
                    reason="tokamax is not installed (it needs Python >= 3.12, jax >= 0.11.1)")
class TestSplashTokamax(TestSplash):
  """tokamax's splash kernel (`splash_tokamax`, what `splash` runs where tokamax imports).

  The whole matrix of TestSplash; each case compiles tokamax's forward and fused backward in
  interpret mode (3-8 s on 2 cores), so the default run takes the drawn float32 examples,
  empty rows, GQA with soft cap and sinks and traced (batched) segment ids, and `-m slow`
  the rest (tests/test_tokamax_splash.py has the MaskInfo, lse and lowering tests).
  """
  backend = "splash_tokamax"

  test_matches_dense_bfloat16 = _slow(TestSplash.test_matches_dense_bfloat16)
  test_numpy_and_mixed_inputs = _slow(TestSplash.test_numpy_and_mixed_inputs)
  test_mqa_and_cross_lengths = _slow(TestSplash.test_mqa_and_cross_lengths)
  test_q_longer_than_kv_has_empty_rows = _slow(TestSplash.test_q_longer_than_kv_has_empty_rows)
  test_jit_grad_vmap = _slow(TestSplash.test_jit_grad_vmap)
  test_head_dims_not_powers_of_two = _slow(TestSplash.test_head_dims_not_powers_of_two)
  test_per_head_masks = _slow(TestSplash.test_per_head_masks)
  test_ragged_lengths_match_dense = _slow(TestSplash.test_ragged_lengths_match_dense)
  test_batched_segment_ids = _slow(TestSplash.test_batched_segment_ids)  # traced ones run

  # Each mask compiles two tokamax kernels with their gradients: all run in `-m slow`.
  @pytest.mark.slow
  @pytest.mark.parametrize("name", ["causal", "local", "chunked"])
  def test_matches_splash_built_from_its_own_mask(self, name):
    """Against tokamax's kernel built by tokamax itself (`process_mask` on its own masks)."""
    from tokamax._src.ops.experimental.tpu.splash_attention import (
      splash_attention_kernel as tk,
      splash_attention_mask as tm,
    )
    lq = lkv = 256
    text, their = {
        "causal": ("causal", tm.CausalMask((lq, lkv))),
        "local": ("local(100, 20)", tm.LocalMask((lq, lkv), (100, 20), 0)),
        "chunked": ("causal & chunk(96)", tm.ChunkedCausalMask((lq, lkv), 96)),
    }[name]
    q, k, v, w = qkv(8, 1, lq, lkv, 2, 2, 32)
    config = tk.SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128,
                             block_kv_dkv_compute=128, interpret=True)
    kernel = tk.make_splash_mha_single_device(their, config=config)
    scale = 1 / math.sqrt(32)
    def ref(q, k, v):
      return jnp.swapaxes(kernel(jnp.swapaxes(q[0] * scale, 0, 1),
                                                  jnp.swapaxes(k[0], 0, 1),
                                                  jnp.swapaxes(v[0], 0, 1)), 0, 1)[None]
    def ours(q, k, v):
      return self.run(q, k, v, text, block_q=128, block_kv=128)
    out, grads = out_and_grads(ours, q, k, v, w)
    out_ref, grads_ref = out_and_grads(ref, q, k, v, w)
    assert_close(out, out_ref, F32_TOL, text)
    for n, a, r in zip("qkv", grads, grads_ref):
      assert_close(a, r, F32_TOL, f"d{n}, {text}")


class TestFlash(KernelTests):
  backend = "flash"
  blocks = (16, 32)
  max_len = 80
  max_examples = 4

  def run(self, q, k, v, mask, **kw):
    return maskc.attention(q, k, v, mask, backend=self.backend, interpret=True, **kw)

  @staticmethod
  def tree_ancestors(n: int, seed: int, batch: int | None) -> np.ndarray:
    """A random tree's ancestor-or-self relation `[.., n, n]` (speculative decoding trees)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batch or 1):
      parent = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
      anc = np.eye(n, dtype=bool)
      for i in range(1, n):
        anc[i] |= anc[parent[i]]
      out.append(anc)
    return out[0] if batch is None else np.stack(out)

  def test_reads_at_any_index_of_one_position(self):
    # The compiler gathers `seg[q // 2]` per position; the kernel slices it like `seg[q]`.
    x = jax.random.normal(jax.random.key(1), (1, 48, 1, 16))
    seg = np.repeat(np.arange(4), 6).astype(np.int32)
    mask = "causal & seg[q // 2] == seg[k // 2]"
    out = self.run(x, x, x, mask, operands={"seg": seg}, block_q=16, block_kv=16)
    assert_close(out, dense_attention(x, x, x, mask, operands={"seg": seg}), F32_TOL, mask)

  # A flash kernel with gradients per case: the default run takes one of each kind of read,
  # `-m slow` the others.
  @pytest.mark.parametrize("mask, kind, lq, lkv, t, batched", [
      ("causal & anc[q, k]", "pairs", 70, 70, 16, False),           # tree attention
      pytest.param("causal & anc[q, k]", "pairs", 40, 70, 32, True, marks=pytest.mark.slow),
      pytest.param("anc[q, k] | sliding(5)", "pairs", 48, 80, 16, True, marks=pytest.mark.slow),
      ("causal & sel[q // 32, k // 32]", "tile_pairs", 64, 64, 32, False),  # MoBA-style
      pytest.param("causal & sel[q // 32, k // 32]", "tile_pairs", 48, 80, 16, True,
                   marks=pytest.mark.slow),
      # q_offset 30 breaks the 32-alignment of the tiles: read per position instead
      ("causal & sel[q // 32, k // 32]", "pairs", 40, 70, 32, True),
      pytest.param("causal & sel[q // 24, k // 24]", "pairs", 70, 70, 16, False,
                   marks=pytest.mark.slow),
  ])
  def test_pairwise_operands_match_dense(self, mask, kind, lq, lkv, t, batched):
    b = 2
    q, k, v, w = qkv(lq + lkv + t, b, lq, lkv, 2, 1, 16)
    rng = np.random.default_rng(lq * lkv)
    lead = (b,) if batched else ()
    if "anc" in mask:
      ops = {"anc": self.tree_ancestors(lkv, lq, b if batched else None)}
    else:
      ops = {"sel": rng.random(lead + (-(-lkv // 24), -(-lkv // 24))) < 0.5}
    bm = maskc.compile(mask, lq, lkv, block_q=t, block_kv=t, operands=ops)
    pred = bm.predicates[0]
    assert len(getattr(pred, kind)) == 1, (mask, pred)
    assert (bm.batch is not None) == batched
    def run(q, k, v):
      return self.run(q, k, v, bm)
    def ref(q, k, v):
      return dense_attention(q, k, v, mask, operands=ops)
    out, grads = out_and_grads(run, q, k, v, w)
    out_ref, grads_ref = out_and_grads(ref, q, k, v, w)
    # The dense reference itself against NumPy: the mask it applied is the operand's.
    allowed = np.asarray(bm.to_dense())
    if "anc" in mask:
      qpos = np.arange(lq)[:, None] + lkv - lq
      kpos = np.arange(lkv)[None, :]
      band = (qpos >= kpos) & (qpos - kpos < (qpos.size + kpos.size if mask.startswith("causal")
                                                else 5))
      anc = ops["anc"][..., lkv - lq:, :]             # rows of the queries' absolute positions
      want = anc & band if mask.startswith("causal") else anc | band
    else:
      c = 32 if "32" in mask else 24
      qpos = np.arange(lq)[:, None] + lkv - lq
      kpos = np.arange(lkv)[None, :]
      sel = np.broadcast_to(ops["sel"], (b,) + ops["sel"].shape[-2:]) if batched else ops["sel"]
      want = sel[..., qpos // c, kpos // c] & (qpos >= kpos)
    np.testing.assert_array_equal(allowed, want)
    assert_close(out, out_ref, F32_TOL, mask)
    for name, g, r in zip("qkv", grads, grads_ref):
      assert_close(g, r, F32_TOL, f"d{name}, {mask}")

  @pytest.mark.slow  # ~7 s in interpret mode; the static pairwise cases run by default
  def test_pairwise_operands_traced_under_jit(self):
    lq = lkv = 64
    q, k, v, w = qkv(11, 2, lq, lkv, 2, 1, 16)
    anc = self.tree_ancestors(lkv, 3, 2)
    sel = np.random.default_rng(4).random((2, 2, 2)) < 0.5
    mask = "causal & (anc[q, k] | sel[q // 32, k // 32])"
    run = jax.jit(lambda q, k, v, a, s: self.run(q, k, v, mask, operands={"anc": a, "sel": s},
                                                 block_q=32, block_kv=32))
    out = run(q, k, v, jnp.asarray(anc), jnp.asarray(sel))
    ref = dense_attention(q, k, v, mask, operands={"anc": anc, "sel": sel})
    assert_close(out, ref, F32_TOL, mask)
    g = jax.jit(jax.grad(lambda q: (run(q, k, v, jnp.asarray(anc), jnp.asarray(sel)) * w).sum()))
    g_ref = jax.grad(lambda q: (dense_attention(q, k, v, mask, operands={"anc": anc, "sel": sel})
                                * w).sum())
    assert_close(g(q), g_ref(q), F32_TOL, f"dq, {mask}")


CUDNN_CASES = [  # mask, q_len, kv_len, q_offset, operands
    ("causal", 40, 40, None, {}),
    ("sliding(7)", 40, 40, None, {}),
    ("local(5, 0)", 33, 33, None, {}),
    ("k <= q & q - k < 3", 24, 24, None, {}),
    ("full", 24, 40, None, {}),
    ("causal", 24, 40, 0, {}),
    ("causal & k < n", 40, 40, None, {"n": np.array([5, 0], np.int32)}),
    ("k < n", 17, 40, None, {"n": np.int32(9)}),
]


class TestCudnn:
  """The cuDNN backend's arguments, built from the map's band, checked on a CPU by the
  identical `jax.nn.dot_product_attention` call with `implementation="xla"`."""


  # A jit of forward and gradients per case: the default run takes five cases in float32 and
  # one in bfloat16, `-m slow` the rest.
  @pytest.mark.parametrize("dtype, case", [
      pytest.param(dtype, case, id=f"{case[0]}-{case[1]}x{case[2]}-{np.dtype(dtype).name}",
                   marks=() if (dtype == jnp.float32 and i in (0, 1, 4, 6, 7)) or
                   (dtype == jnp.bfloat16 and i == 0) else pytest.mark.slow)
      for dtype in (jnp.float32, jnp.bfloat16) for i, case in enumerate(CUDNN_CASES)])
  def test_matches_dense(self, case, dtype):
    from maskc.kernels import cudnn
    text, lq, lkv, offset, ops = case
    q, k, v, w = qkv(3, 2, lq, lkv, 4, 2, 16, dtype)
    bm = maskc.compile(text, lq, lkv, q_offset=offset, operands=ops, block_q=16, block_kv=16)
    def ours(q, k, v):
      return cudnn.attend(q, k, v, bm, implementation="xla")
    def ref(q, k, v):
      return dense.run(q.astype(jnp.float32), k.astype(jnp.float32),
                                        v.astype(jnp.float32), bm)
    out, grads = out_and_grads(ours, q, k, v, w)
    out_ref, grads_ref = out_and_grads(ref, q, k, v, w)
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    assert_close(out, out_ref, tol, text)
    for name, a, r in zip("qkv", grads, grads_ref):
      assert_close(a, r, tol, f"d{name}, {text}")
    empty = ~np.asarray(maskc.materialize(text, lq, lkv, q_offset=offset, operands=ops)).any(-1)
    if empty.any():  # per-batch rows with no key (n == 0): zeros, zero gradients
      np.testing.assert_array_equal(np.asarray(out, np.float32)[np.broadcast_to(
          empty, out.shape[:2])], 0.0)
      np.testing.assert_array_equal(np.asarray(grads[0], np.float32)[np.broadcast_to(
          empty, out.shape[:2])], 0.0)

  def test_arguments_come_from_the_band(self):
    from maskc.kernels import cudnn
    assert cudnn.arguments(maskc.compile("causal", 64)) == {"is_causal": True}
    assert cudnn.arguments(maskc.compile("q - 8 < k <= q", 64)) == {
        "is_causal": True, "local_window_size": (7, 0)}
    assert cudnn.arguments(maskc.compile("full", 64)) == {}
    lengths = cudnn.arguments(maskc.compile("causal & k < n", 64, operands={
        "n": np.array([3, 9], np.int32)}))["key_value_seq_lengths"]
    np.testing.assert_array_equal(lengths, [3, 9])

  @pytest.mark.parametrize("text, lq, why", [
      ("local(3, 2)", 64, "no top-left causal"),       # a right window without causal
      ("causal", 32, "no top-left causal"),            # bottom-right: q_offset = 32
      ("k < q", 64, "no top-left causal"),             # strict
      ("causal & chunk(16)", 64, "bands only"),
      ("causal & document(seg)", 64, "bands only"),
      ("sliding(4) & k < n", 64, "a window with key lengths"),
  ])
  def test_refuses_what_it_cannot_run_and_names_flash(self, text, lq, why):
    from maskc.kernels import cudnn
    m = maskc.parse(text)
    ops = {"seg": np.repeat(np.arange(4), 16).astype(np.int32), "n": np.int32(9)}
    bm = maskc.compile(m, lq, 64, operands={s.name: ops[s.name] for s in m.operands})
    with pytest.raises(maskc.BackendError, match=why) as err:
      cudnn.arguments(bm)
    assert "flash" in str(err.value)

  def test_refuses_soft_cap_sinks_and_float32(self, monkeypatch):
    from maskc.kernels import platform as _platform
    bm = maskc.compile("causal", 32, block_q=16, block_kv=16)
    x = jnp.ones((1, 32, 2, 16), jnp.bfloat16)
    for kw, what in ((dict(logits_soft_cap=2.0), "soft cap"), (dict(sinks=jnp.ones(2)), "sinks")):
      with pytest.raises(maskc.BackendError, match=what):
        maskc.kernels.attention(x, x, x, bm, backend="cudnn", **kw)
    # off a GPU that comes first: no cast would make cuDNN run here
    with pytest.raises(maskc.BackendError, match="runs on an NVIDIA GPU"):
      maskc.kernels.attention(x.astype(jnp.float32), x, x, bm, backend="cudnn")
    monkeypatch.setattr(_platform, "platform", lambda: "gpu")
    with pytest.raises(maskc.BackendError, match="bfloat16 and float16"):
      maskc.kernels.attention(x.astype(jnp.float32), x, x, bm, backend="cudnn")


def convention_op(q, k, v, k_start, k_end, *, logits_scale, logits_soft_cap):
  """tokamax's attention with residuals, written from its convention (`base.Residuals`):
  `(out, (m, l))`, m the row's maximum scaled (capped) logit over `k_start <= k < k_end`,
  `l = sum exp(s - m)` there."""
  g = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * logits_scale
  if logits_soft_cap is not None:
    s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
  j = jnp.arange(k.shape[1])
  inside = (j >= k_start[..., None]) & (j < k_end[..., None])      # [B, 1, Lq, Lkv]
  m = jnp.where(inside, s, -jnp.inf).max(-1)
  e = jnp.where(inside, jnp.exp(s - m[..., None]), 0.0)
  l = e.sum(-1)
  out = jnp.einsum("bhqk,bkhd->bqhd", e / l[..., None], v, precision="highest")
  return out.astype(q.dtype), (m, l)


def _contiguous_seg(n: int, batch: int | None = None) -> np.ndarray:
  rng = np.random.default_rng(n)
  rows = [np.sort(rng.integers(0, 5, n)) for _ in range(batch or 1)]
  return np.stack(rows).astype(np.int32) if batch else rows[0].astype(np.int32)


# (mask, q_len, kv_len, heads, kv heads, soft cap, operands, op): op "convention" is the
# function above, "tokamax" tokamax's XLA reference (Python >= 3.12 with tokamax).
HYBRID_CASES = [
    ("sliding(20) & q >= 40", 96, 96, 4, 2, None, None, "convention"),     # empty rows, GQA
    ("causal & document(seg)", 100, 100, 2, 1, 5.0, "seg-batched", "convention"),
    ("causal | bidirectional(img)", 80, 128, 2, 2, None, "img", "tokamax"),  # bottom-right
    ("sliding(20) & q >= 40", 96, 96, 4, 2, None, None, "tokamax"),
]


class TestTokamax:
  """maskc's tokamax backend: tokamax's forward with its residuals turned into flash's
  log-sum-exp, flash's backward (interpreted here) on the same map. tokamax's Mosaic
  kernel needs a GPU (tests/test_gpu.py); here its forward is replaced by one returning
  out and residuals in tokamax's convention, and the hybrid is checked against the dense
  reference, forward and gradients."""

  @pytest.mark.parametrize("case", HYBRID_CASES,
                           ids=[f"{c[0]}-{c[1]}x{c[2]}-{c[7]}" for c in HYBRID_CASES])
  def test_hybrid_matches_dense(self, case):
    from attention_reference import numpy_reference
    from maskc.kernels import tokamax as tk
    from maskc.kernels.xla import NEG_LSE
    text, lq, lkv, h, hkv, cap, kind, op_kind = case
    if op_kind == "tokamax":
      base = pytest.importorskip("tokamax._src.ops.attention.base",
                                 reason="tokamax needs Python >= 3.12")
      op = tk.interval_op(base.DotProductAttention())
    else:
      op = convention_op
    img = np.zeros(lkv, bool)
    img[30:50] = img[90:100] = True
    ops = {"seg-batched": {"seg": _contiguous_seg(lkv, 2)}, "img": {"img": img},
           None: {}}[kind]
    q, k, v, w = qkv(7, 2, lq, lkv, h, hkv, 16)
    bm = maskc.compile(text, lq, lkv, operands=ops, block_q=32, block_kv=32)
    assert bm.key_intervals()[2], text
    def ours(q, k, v):
      return tk.attend(q, k, v, bm, op, logits_soft_cap=cap, interpret=True)
    def ref(q, k, v):
      return dense.run(q, k, v, bm, logits_soft_cap=cap)
    out, grads = out_and_grads(ours, q, k, v, w)
    out_ref, grads_ref = out_and_grads(ref, q, k, v, w)
    assert_close(out, out_ref, F32_TOL, text)
    for name, a, r in zip("qkv", grads, grads_ref):
      assert_close(a, r, F32_TOL, f"d{name}, {text}")
    # the residuals give each row's log-sum-exp (+inf on rows with no key)
    allowed = np.asarray(maskc.materialize(text, lq, lkv, operands=ops))
    allowed = allowed[:, None] if allowed.ndim == 3 else allowed
    _, lse64 = numpy_reference(np.asarray(q), np.asarray(k), np.asarray(v), allowed,
                               1 / math.sqrt(16), cap)
    start, stop, _ = bm.key_intervals()
    def per_batch(x):
      return jnp.asarray(x if bm.batch is not None else x[None], jnp.int32)
    _, lse = tk._forward(op, 1 / math.sqrt(16), cap, q, k, v, per_batch(start),
                         per_batch(stop))
    want = np.where(lse64 == NEG_LSE, np.inf, lse64).transpose(0, 2, 1)
    np.testing.assert_allclose(np.asarray(lse), want, rtol=1e-5, atol=1e-5)
    empty = ~np.broadcast_to(allowed.any(-1)[:, 0] if allowed.ndim == 4 else
                             allowed.any(-1), (2, lq))
    if empty.any():  # rows with no key: zeros, zero query gradients
      assert np.all(np.asarray(out)[empty] == 0) and np.all(np.asarray(grads[0])[empty] == 0)

  def test_refuses_float32_sinks_and_non_intervals_naming_flash(self):
    bm = maskc.compile("causal & chunk(16)", 32, block_q=16, block_kv=16)
    x = jnp.ones((1, 32, 2, 16), jnp.float32)
    with pytest.raises(maskc.BackendError, match="bfloat16 and float16, not float32") as err:
      maskc.kernels.attention(x, x, x, bm, backend="tokamax")
    assert "flash" in str(err.value)
    with pytest.raises(maskc.BackendError, match="no sinks"):
      maskc.kernels.attention(x.astype(jnp.bfloat16), x, x, bm, backend="tokamax",
                              sinks=jnp.ones(2))
    other = maskc.compile("causal & (q - k) % 3 == 0", 32, block_q=16, block_kv=16)
    with pytest.raises(maskc.BackendError, match="not one exact interval") as err:
      maskc.kernels.attention(x.astype(jnp.bfloat16), x, x, other, backend="tokamax")
    assert "flash" in str(err.value)


# (mask, q_len, kv_len): what `choose` picks on a faked GPU at flash's tiles, bf16, head dim
# 128, without tokamax and with it.
CHOICES = [
    ("causal", 1024, 1024, "cudnn", "cudnn"),
    ("sliding(128)", 1024, 1024, "cudnn", "cudnn"),
    ("full", 1024, 1024, "cudnn", "cudnn"),
    ("causal & k < n", 1024, 1024, "cudnn", "cudnn"),
    ("causal & chunk(256)", 1024, 1024, "flash", "tokamax"),
    ("causal & document(seg)", 1024, 1024, "flash", "tokamax"),
    ("causal | bidirectional(img)", 1024, 1024, "flash", "tokamax"),
    ("document(seg) & (causal | bidirectional(img))", 1024, 1024, "flash", "tokamax"),
    ("causal | prefix(100)", 1024, 1024, "flash", "tokamax"),
    ("local(64, 64)", 1024, 1024, "flash", "tokamax"),    # a right window: no cuDNN
    ("causal", 512, 1024, "flash", "tokamax"),            # bottom-right: no cuDNN
    ("sink(4) | sliding(64)", 1024, 1024, "flash", "flash"),
    ("causal & (q - k) % 3 == 0", 1024, 1024, "flash", "flash"),
    ("causal & anc[q, k]", 256, 256, "flash", "flash"),
]


def _choice_map(text: str, lq: int, lkv: int):
  rng = np.random.default_rng(0)
  img = np.zeros(lkv, bool)
  img[100:300] = img[600:700] = True
  values = {"seg": np.sort(rng.integers(0, 6, lkv)).astype(np.int32), "img": img,
            "n": np.int32(700), "anc": np.tril(np.ones((lq, lkv), bool))}
  m = maskc.parse(text)
  return maskc.compile(m, lq, lkv, block_q=64, block_kv=64,
                       operands={s.name: values[s.name] for s in m.operands})


@pytest.mark.parametrize("tokamax", [False, True])
@pytest.mark.parametrize("text, lq, lkv, without, with_tokamax", CHOICES,
                         ids=[f"{c[0]}-{c[1]}" for c in CHOICES])
def test_choose_on_a_faked_gpu(monkeypatch, text, lq, lkv, without, with_tokamax, tokamax):
  from maskc.kernels import tokamax as tokamax_mod
  monkeypatch.setattr(tokamax_mod, "installed", lambda: tokamax)
  bm = _choice_map(text, lq, lkv)
  got = api.choose(bm, platform="gpu", head_dim=128, dtype=jnp.bfloat16)
  assert got.backend == (with_tokamax if tokamax else without), got.reason
  assert got.reason.startswith(f"GPU: {got.backend}, estimated"), got.reason
  # cuDNN only for bands, tokamax only for exact intervals
  if got.backend == "cudnn":
    assert bm.band() is not None
  if got.backend == "tokamax":
    assert bm.key_intervals()[2]
  # rings need a differentiable log-sum-exp: flash then
  assert api.choose(bm, platform="gpu", head_dim=128, dtype=jnp.bfloat16,
                    need_lse=True).backend == "flash"


def test_choose_refusals_and_other_platforms(monkeypatch):
  from maskc.kernels import tokamax as tokamax_mod
  monkeypatch.setattr(tokamax_mod, "installed", lambda: True)
  bm = _choice_map("causal", 1024, 1024)
  f32 = api.choose(bm, platform="gpu", head_dim=128, dtype=jnp.float32)
  assert f32.backend == "flash" and "not cudnn: runs bfloat16" in f32.reason
  assert "not tokamax: tokamax's Mosaic GPU kernel runs bfloat16 and float16" in f32.reason
  capped = api.choose(bm, platform="gpu", head_dim=128, dtype=jnp.bfloat16, soft_cap=True)
  assert capped.backend == "tokamax" and "no soft cap" in capped.reason
  sinks = api.choose(bm, platform="gpu", head_dim=128, dtype=jnp.bfloat16, sinks=True)
  assert sinks.backend == "flash", sinks.reason
  assert api.choose(bm, platform="tpu", head_dim=128, dtype=jnp.bfloat16).backend == "splash"
  cpu = api.choose(bm, platform="cpu", head_dim=128, dtype=jnp.float32)
  assert cpu.backend == "xla" and cpu.reason
  tiny = api.choose(_choice_map("causal", 64, 64), platform="cpu", head_dim=8,
                    dtype=jnp.float32)
  assert tiny.backend == "dense" and "tiny" in tiny.reason


def test_gpu_cost_prices_tokamax_with_flash_backward():
  """tokamax's gradients run flash's backward: its estimate is its forward plus flash's
  backward on the same map, so it is below flash's exactly by the forward it saves."""
  bm = _choice_map("causal & chunk(256)", 1024, 1024)
  tok_f, tok_b = api.gpu_cost("tokamax", bm, 128)
  flash_f, flash_b = api.gpu_cost("flash", bm, 128)
  assert tok_b == flash_b and tok_f < flash_f
  tokamax = api.BACKENDS["tokamax"].load()
  fwd, _, fixed = tokamax.GPU_COST
  assert tok_f == pytest.approx(tokamax.forward_work(bm, 128) / (fwd * 1e9) + fixed)
  assert tokamax.BACKWARD_ENGINE == "flash"


def test_auto_on_a_faked_gpu_falls_back_from_cudnn_to_flash(monkeypatch):
  """cuDNN chosen for a bf16 band; on this CPU it cannot run, so `auto` moves to flash."""
  calls = fake_platform(monkeypatch, "gpu", real=("cudnn",))
  x = jnp.ones((1, 256, 2, 64), jnp.bfloat16)
  with pytest.raises(_Picked):
    maskc.attention(x, x, x, "causal")
  monkeypatch.undo()
  assert calls == ["cudnn", "flash"]


@pytest.mark.parametrize("backend", ["cudnn", "tokamax"])
def test_rings_refuse_engines_without_a_log_sum_exp(backend):
  from maskc.kernels import sharded
  assert api.BACKENDS[backend].load().run_with_lse is None
  with pytest.raises(maskc.BackendError, match="run_with_lse") as err:
    sharded._lse_runner(backend, None)
  assert "flash" in str(err.value)
