"""Independent attention references shared by the kernel tests: float64 NumPy and dense jnp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NEG_LSE = -1e30  # the lse of a row with no allowed key (maskc.kernels.xla.NEG_LSE)


def numpy_scores(q, k, allowed, scale: float, cap: float | None) -> np.ndarray:
  """Scores `[B, H, Lq, Lk]` in float64: GQA key heads repeated, soft cap, -inf where not
  allowed."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
  s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
  if cap is not None:
    s = cap * np.tanh(s / cap)
  return np.where(allowed, s, -np.inf)


def repeat_kv(v, q_heads: int) -> np.ndarray:
  """Value heads repeated to the query heads (GQA), in float64."""
  v = np.asarray(v, np.float64)
  return np.repeat(v, q_heads // v.shape[2], axis=2)


def numpy_reference(q, k, v, allowed, scale: float, cap: float | None):
  """Float64 `(out [B, Lq, H, Dv], lse [B, Lq, H])`: softmax over allowed keys only."""
  s = numpy_scores(q, k, allowed, scale, cap)
  v = repeat_kv(v, s.shape[1])
  seen = np.broadcast_to(allowed.any(-1), s.shape[:-1])
  top = np.where(seen, s.max(-1), 0.0)
  e = np.exp(s - top[..., None])
  total = e.sum(-1)
  lse = np.where(seen, top + np.log(np.where(seen, total, 1.0)), NEG_LSE)
  out = np.einsum("bhqk,bkhd->bqhd", e / np.where(seen, total, 1.0)[..., None], v)
  return out, np.moveaxis(lse, 1, 2)


def jnp_reference(q, k, v, allowed, scale: float, cap: float | None):
  """The same formula in float32 jax.numpy (dense), for JAX to differentiate."""
  g = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
  if cap is not None:
    s = cap * jnp.tanh(s / cap)
  allowed = jnp.asarray(allowed)
  seen = jnp.broadcast_to(allowed.any(-1), s.shape[:-1])
  s = jnp.where(allowed, s, -1e30)
  top = jax.lax.stop_gradient(s.max(-1))
  e = jnp.where(allowed, jnp.exp(s - top[..., None]), 0.0)
  total = e.sum(-1)
  lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), NEG_LSE)
  p = e / jnp.where(seen, total, 1.0)[..., None]
  out = jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")
  return out, jnp.moveaxis(lse, 1, 2)


def numpy_gradients(q, k, v, w, allowed, scale: float, cap: float | None, sinks=None,
                    w_lse=None):
  """Float64 `(dq, dk, dv, dsinks)` of `sum(out · w)` (plus `sum(lse · w_lse)` for a
  `[B, Lq, H]` cotangent on the log-sum-exp, whose `∂ lse / ∂ s = p` adds `p · w_lse` to
  `ds`), the backward written out.

  `ds = p (dp − delta)` with `dp = w vᵀ` and `delta = rowsum(out · w)`, times `1 − tanh²`
  under a soft cap; key gradients summed over each key head's query heads (GQA). Sinks
  (`[H]` logits) join each row's softmax denominator; their gradient is
  `−Σ p_sink · delta` (None without sinks). Rows with no allowed key (and no sink) give
  zeros.
  """
  q64, k64, v64, w64 = (np.asarray(x, np.float64) for x in (q, k, v, w))
  h, hkv = q64.shape[2], k64.shape[2]
  kk, vv = repeat_kv(k64, h), repeat_kv(v64, h)
  raw = np.einsum("bqhd,bkhd->bhqk", q64, kk) * scale
  t = None if cap is None else np.tanh(raw / cap)
  s = np.where(allowed, raw if t is None else cap * t, -np.inf)
  top = s.max(-1)
  sink = None if sinks is None else np.asarray(sinks, np.float64)[None, :, None]
  if sink is not None:
    top = np.maximum(top, sink)
  seen = np.isfinite(top)
  top = np.where(seen, top, 0.0)
  total = np.exp(s - top[..., None]).sum(-1) + (0.0 if sink is None else np.exp(sink - top))
  total = np.where(seen, total, 1.0)
  p = np.exp(s - top[..., None]) / total[..., None]
  out = np.einsum("bhqk,bkhd->bqhd", p, vv)
  delta = np.einsum("bqhd,bqhd->bhq", out, w64)
  if w_lse is not None:
    delta = delta - np.moveaxis(np.asarray(w_lse, np.float64), 1, 2)
  ds = p * (np.einsum("bqhd,bkhd->bhqk", w64, vv) - delta[..., None])
  if t is not None:
    ds = ds * (1.0 - t * t)

  def group(x):
    b, n, _, d = x.shape
    return x.reshape(b, n, hkv, h // hkv, d).sum(3)

  dq = np.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
  dk = group(np.einsum("bhqk,bqhd->bkhd", ds, q64) * scale)
  dv = group(np.einsum("bhqk,bqhd->bkhd", p, w64))
  dsinks = None if sink is None else -(np.exp(sink - top) / total * delta).sum((0, 2))
  return dq, dk, dv, dsinks
