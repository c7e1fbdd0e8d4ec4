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
