"""Block-sparse attention in jax.numpy: runs anywhere, and on CPU its time tracks density.

For every q tile at once, the key tiles to visit come from the BlockMap as two
index lists, FULL and PARTIAL, padded to the largest count over q tiles (a static
number). A `lax.scan` walks the lists; each step gathers one key/value tile per q
tile, so one step is a batched `[bq, D] x [D, bk]` matmul over all q tiles, and
an online softmax carries the running max, denominator and output across steps.

FULL tiles do no mask work: an additive bias per key column only drops padding
slots in the lists and keys past `kv_len` in the last tile. PARTIAL tiles evaluate
the compiled predicate on their positions and operands (`maskc._evaluate`), so
every operand kind works here, pairwise ones included. EMPTY tiles are never
touched: the work is the non-empty tiles, `density × dense`.

Gradients are JAX's own through the scan and gathers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maskc._errors import MaskValueError
from maskc._evaluate import Env, evaluate_mask
from maskc.kernels import _common as common

BLOCK_SIZES = (128, 128)


def default_blocks(q_len: int, kv_len: int) -> tuple[int, int]:
  """Tile sizes for this backend: 128 × 128, smaller for short sequences."""
  return common.cap_block(BLOCK_SIZES[0], q_len), common.cap_block(BLOCK_SIZES[1], kv_len)


def run(q, k, v, bm, *, scale=None, logits_soft_cap=None, sinks=None, interpret=None):
  """The backend entry point: attention `[B, Lq, H, Dv]` under a compiled BlockMap."""
  del interpret
  b, lq, h, lkv, _, d = common.check_qkv(q, k, v)
  if not hasattr(bm, "rows"):
    raise MaskValueError("the xla backend needs a compiled BlockMap (maskc.compile)")
  if (bm.q_len, bm.kv_len) != (lq, lkv):
    raise MaskValueError(f"the BlockMap is compiled for q_len={bm.q_len}, kv_len={bm.kv_len} "
                         f"but q and k have lengths {lq} and {lkv}")
  common.check_batch(bm, b)
  sinks = common.check_sinks(sinks, h)
  scale = common.default_scale(d, scale)

  def one(q, k, v, u, sinks):
    return _attend(q, k, v, bm, u, scale=scale, cap=logits_soft_cap, sinks=sinks)

  return common.per_mask(one, q, k, v, bm, sinks)


def _pad_to(x, axis: int, size: int):
  pad = size - x.shape[axis]
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def _gather(tiles, idx, batched: bool):
  """`tiles[b, idx[b, n]]` → `[B, n, ...]`; `idx` has a batch axis of B or 1."""
  if not batched:
    return tiles[:, idx[0]]
  return jax.vmap(lambda t, i: t[i])(tiles, idx)


def _attend(q, k, v, bm, u: int, *, scale: float, cap, sinks):
  """Attention of all heads of q under mask `u` of `bm` (GQA: H = G × Hkv)."""
  b, lq, h, d = q.shape
  lkv, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
  g = h // hkv
  bq, bk = bm.block_q, bm.block_kv
  nq, nk = bm.n_q_tiles, bm.n_kv_tiles
  f32 = jnp.float32
  qt = (_pad_to(q.astype(f32), 1, nq * bq) * scale).reshape(b, nq, bq, hkv, g, d)
  kt = _pad_to(k.astype(f32), 1, nk * bk).reshape(b, nk, bk, hkv, d)
  vt = _pad_to(v.astype(f32), 1, nk * bk).reshape(b, nk, bk, hkv, dv)

  lists = []
  for state in (common.FULL, common.PARTIAL):
    idx, count, static = common.tile_lists(bm, u, state)
    if static and not count.any():
      continue
    idx, count = jnp.asarray(idx), jnp.asarray(count)
    valid = jnp.arange(idx.shape[-1])[None, None, :] < count[..., None]
    lists.append((state, jnp.moveaxis(idx, -1, 0), jnp.moveaxis(valid, -1, 0)))

  batched = bm.batch is not None
  ops = common.kernel_operands(bm)
  mask = bm.masks[u]
  bidx = common.batch_index(bm, 4)
  qpos = (jnp.arange(nq * bq, dtype=jnp.int32).reshape(1, nq, bq, 1) + bm.q_offset)
  cols = jnp.arange(bk, dtype=jnp.int32)

  if sinks is None:
    m0 = jnp.full((b, nq, hkv, g, bq), common.NEG, f32)
    l0 = jnp.zeros_like(m0)
  else:
    # The running max carries no gradient (the result does not depend on it); the sink
    # logit's gradient flows through its term of the denominator.
    sink = jnp.broadcast_to(sinks.reshape(1, 1, hkv, g, 1), (b, nq, hkv, g, bq))
    m0 = jax.lax.stop_gradient(sink)
    l0 = jnp.exp(sink - m0)
  acc0 = jnp.zeros((b, nq, hkv, g, bq, dv), f32)

  def step(carry, xs, partial: bool):
    m, l, acc = carry
    idx, valid = xs                                   # [B', nq]
    kg = _gather(kt, idx, batched)                    # [B, nq, bk, hkv, d]
    vg = _gather(vt, idx, batched)
    s = jnp.einsum("bnqhgd,bnkhd->bnhgqk", qt, kg)    # [B, nq, hkv, g, bq, bk]
    if cap is not None:
      s = cap * jnp.tanh(s / cap)
    kpos = idx[..., None] * bk + cols                 # [B', nq, bk]
    keep = valid[..., None] & (kpos < lkv)
    if partial:
      allowed = evaluate_mask(mask, Env(jnp, qpos, kpos[:, :, None, :], ops, bidx))
      allowed = allowed & keep[:, :, None, :]         # [B', nq, bq, bk]
      s = jnp.where(allowed[:, :, None, None], s, common.NEG)
    else:
      s = s + jnp.where(keep, 0.0, common.NEG)[:, :, None, None, None, :]
    m_new = jax.lax.stop_gradient(jnp.maximum(m, s.max(-1)))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    l = alpha * l + p.sum(-1)
    acc = alpha[..., None] * acc + jnp.einsum("bnhgqk,bnkhd->bnhgqd", p, vg)
    return (m_new, l, acc), None

  carry = (m0, l0, acc0)
  for state, idx, valid in lists:
    partial = state == common.PARTIAL
    carry, _ = jax.lax.scan(lambda c, xs, p=partial: step(c, xs, p), carry, (idx, valid))
  m, l, acc = carry
  out = acc / jnp.where(l == 0, 1.0, l)[..., None]
  if sinks is None:
    # A row that met no allowed key still has the initial max; its sums are padding.
    out = jnp.where((m > common.NEG / 2)[..., None], out, 0.0)
  out = jnp.moveaxis(out, 4, 2).reshape(b, nq * bq, h, dv)[:, :lq]
  return out.astype(q.dtype)
