"""Dense masked dot-product attention: the reference every other backend is checked against.

It materializes the whole `[Lq, Lkv]` mask and logits, in float32 at the highest
matmul precision, so it is exact but costs `O(Lq × Lkv)` memory. Rows with no
allowed key return zeros, and their gradients are zero, never NaN: masked logits
take a finite large negative value and the softmax weights are zeroed where the
mask is false before normalizing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maskc.kernels import common


def run(q, k, v, bm, *, scale=None, logits_soft_cap=None, sinks=None, interpret=None):
  """The backend entry point: attention under a compiled map, every position evaluated.

  Only the map's predicates and operands are read, never its tiles, so a map of one
  PARTIAL tile (`maskc.lowering.compile.bind_map`, what `maskc.attention` builds for
  `backend="dense"`) serves as well as a lowered one.
  """
  del interpret
  b, lq, h, lkv, _, d = common.check_qkv(q, k, v)
  if (bm.q_len, bm.kv_len) != (lq, lkv):
    raise common.MaskValueError(
        f"the mask is bound to q_len={bm.q_len}, kv_len={bm.kv_len} but q and k have "
        f"lengths {lq} and {lkv}")
  common.check_batch(bm, b)
  common.check_int32(bm, "dense")
  sinks = common.check_sinks(sinks, h)
  scale = common.default_scale(d, scale)

  def one(q, k, v, u, sinks):
    return masked_attention(q, k, v, common.dense_allowed(bm, u)[:, None],
                            scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks)

  return common.per_mask(one, q, k, v, bm, sinks)


def masked_attention(q, k, v, allowed, *, scale: float, logits_soft_cap: float | None = None,
                     sinks=None) -> jax.Array:
  """Attention with a dense bool mask `allowed` broadcastable to `[B, H, Lq, Lkv]`."""
  b, lq, h, d = q.shape
  hkv = k.shape[2]
  g = h // hkv
  f32 = jnp.float32
  qf = q.astype(f32).reshape(b, lq, hkv, g, d)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k.astype(f32),
                 precision=jax.lax.Precision.HIGHEST) * scale
  if logits_soft_cap is not None:
    s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
  allowed = jnp.asarray(allowed, bool)
  allowed = allowed.reshape(allowed.shape[:1] + _head_shape(allowed.shape[1], hkv, g) +
                            allowed.shape[2:])
  s = jnp.where(allowed, s, common.NEG)
  m = jnp.max(s, axis=-1, keepdims=True)
  if sinks is not None:
    sk = sinks.reshape(1, hkv, g, 1, 1)
    m = jnp.maximum(m, sk)
  m = jax.lax.stop_gradient(m)
  p = jnp.where(allowed, jnp.exp(s - m), 0.0)
  denom = p.sum(-1, keepdims=True)
  if sinks is not None:
    denom = denom + jnp.exp(sk - m)
  o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(f32), precision=jax.lax.Precision.HIGHEST)
  denom = jnp.where(denom == 0, 1.0, denom)
  o = o / jnp.moveaxis(denom, (1, 2, 3), (2, 3, 1))
  return o.reshape(b, lq, h, v.shape[-1]).astype(q.dtype)


def _head_shape(n: int, hkv: int, g: int) -> tuple[int, int]:
  if n == 1:
    return (1, 1)
  return (hkv, g)
