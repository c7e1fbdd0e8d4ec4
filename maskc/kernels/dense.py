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
from jax.typing import DTypeLike

from maskc.compiled.blockmap import BlockMap
from maskc.kernels import common

# Tiny masks and nearly full ones gain nothing from block sparsity: `auto` runs them here on
# CPU (`refusal`, `length_refusal`).
TINY = 256 * 256
# Keys above which even a few query rows gain from skipping tiles: a decode row over a
# cache of 1K keys runs in about half dense's time on xla (CPU, 2026-11-26; below 512
# keys dense wins), though its pair count is far under TINY.
TINY_KEYS = 512
NEARLY_FULL = 0.9

run_with_lse = None  # no log-sum-exp: rings run xla instead
GPU_COST = None
BACKWARD_ENGINE = None
installed = common.installed
forward_work = common.tile_work


def tiny(q_len: int, kv_len: int) -> bool:
  """Whether a mask is small enough that dense attention beats xla's tile bookkeeping on
  CPU: at most `TINY` pairs and `TINY_KEYS` keys."""
  return q_len * kv_len <= TINY and kv_len <= TINY_KEYS


def default_blocks(q_len: int, kv_len: int) -> tuple[int, int]:
  """One tile, the whole mask: dense attention reads no tiles."""
  return q_len, kv_len


def length_refusal(q_len: int, kv_len: int) -> str | None:
  """Why `auto` should not start from dense attention at these lengths: they are not tiny."""
  if tiny(q_len, kv_len):
    return None
  return f"{q_len} x {kv_len} is not tiny: skipping EMPTY tiles saves more than it costs"


def refusal(bm: BlockMap, *, head_dim: int, dtype: DTypeLike, soft_cap: bool = False,
            sinks: bool = False) -> str | None:
  """Why `auto` should not run `bm` densely: neither tiny nor nearly full, block sparsity
  is cheaper (dense attention runs every map when named)."""
  if tiny(bm.q_len, bm.kv_len) or (bm.is_static and bm.density > NEARLY_FULL):
    return None
  return "neither tiny nor nearly full: block sparsity is cheaper"


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
