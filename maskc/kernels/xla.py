"""Block-sparse attention in jax.numpy: runs anywhere, and on CPU its time tracks density.

For every q tile at once, the key tiles to visit come from the BlockMap as two
index lists, FULL and PARTIAL, padded to the largest count over q tiles (a static
number). A `lax.scan` walks the lists; each step gathers one key/value tile per q
tile, so one step is a batched `[bq, D] x [D, bk]` matmul over all q tiles, and
an online softmax carries the running max, denominator and output across steps.
A traced map's lists are padded to a static bound; steps past every lane's count
are skipped (`lax.cond`), so a decode row over a long cache visits the key tiles its
runs name, not the whole cache.

FULL tiles do no mask work: an additive bias per key column only drops padding
slots in the lists and keys past `kv_len` in the last tile. PARTIAL tiles run
the compiled predicate (`maskc.compiled.predicate`) on their positions and read values,
so every operand kind works here, pairwise ones included. EMPTY tiles are never
touched: the work is the non-empty tiles, `density × dense`.

Gradients are JAX's own through the scan and gathers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maskc.compiled import predicate as _predicate
from maskc.kernels import common

BLOCK_SIZES = (128, 128)
GPU_COST = None  # not costed: on CPU `auto` takes it unless dense attention is cheaper
BACKWARD_ENGINE = None
installed = common.installed
refusal = common.no_refusal
length_refusal = common.any_length
forward_work = common.tile_work


def default_blocks(q_len: int, kv_len: int) -> tuple[int, int]:
  """Tile sizes for this backend: 128 × 128, smaller for short sequences."""
  return common.cap_block(BLOCK_SIZES[0], q_len), common.cap_block(BLOCK_SIZES[1], kv_len)


def run(q, k, v, bm, *, scale=None, logits_soft_cap=None, sinks=None, interpret=None):
  """The backend entry point: attention `[B, Lq, H, Dv]` under a compiled BlockMap."""
  del interpret
  b, lq, h, lkv, _, d = common.check_qkv(q, k, v)
  common.check_blockmap(bm, "xla", lq, lkv, b)
  sinks = common.check_sinks(sinks, h)
  scale = common.default_scale(d, scale)

  def one(q, k, v, u, sinks):
    return _attend(q, k, v, bm, u, scale=scale, cap=logits_soft_cap, sinks=sinks)

  return common.per_mask(one, q, k, v, bm, sinks)


def run_with_lse(q, k, v, bm, *, scale=None, logits_soft_cap=None, interpret=None):
  """Attention and its log-sum-exp: `(out [B, Lq, H, Dv] f32, lse [B, Lq, H] f32)`.

  For combining partial attentions over disjoint key sets exactly (ring attention):
  `out = sum_t exp(lse_t - LSE) out_t` with `LSE = logsumexp_t lse_t`. Rows with no
  allowed key have `out = 0` and `lse = NEG_LSE` (finite, so combining stays NaN-free).
  One mask for every head (the map must not be per-head). `interpret` is ignored (no
  Pallas here).
  """
  del interpret
  b, lq, h, lkv, _, d = common.check_qkv(q, k, v)
  common.check_blockmap(bm, "xla", lq, lkv, b)
  common.check_one_mask(bm)
  scale = common.default_scale(d, scale)
  return _attend(q, k, v, bm, 0, scale=scale, cap=logits_soft_cap, sinks=None, with_lse=True)


NEG_LSE = -1e30


def _pad_to(x, axis: int, size: int):
  pad = size - x.shape[axis]
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def _gather(tiles, idx, batched: bool):
  """`tiles[b, idx[b, w]]` → `[B, W, ...]`; `idx` has a batch axis of B or 1."""
  if not batched:
    return tiles[:, idx[0]]
  return jax.vmap(lambda t, i: t[i])(tiles, idx)


def _scatter(buf, idx, val, batched: bool):
  """`buf[b, idx[b, w]] = val[b, w]`, dropping out-of-range indices."""
  if not batched:
    return buf.at[:, idx[0]].set(val, mode="drop")
  return jax.vmap(lambda bf, i, x: bf.at[i].set(x, mode="drop"))(buf, idx, val)


def _lanes(i, j, count, n_lines: int, xp):
  """Balanced work: the row-major tile pairs cut into W lanes of S consecutive steps.

  A lane's run of pairs with the same q tile is a *segment*; its softmax state is
  written to a buffer when the run ends and combined per q tile afterwards. So
  every lane does the same number of steps, whatever the spread of tiles over q
  tiles (a causal mask's rows hold 1 to n tiles), and work tracks density.
  Returns the scan inputs `[S, B', W]` (i, j, valid, start, write slot), the
  segments' q tiles `[B', n_seg]` and `n_seg`.
  """
  nb, t = i.shape
  w = max(1, min(n_lines, t))
  steps = -(-t // w)
  pad = w * steps - t
  i = xp.pad(i, ((0, 0), (0, pad)))
  j = xp.pad(j, ((0, 0), (0, pad)))
  valid = xp.arange(w * steps)[None, :] < count[:, None]
  i, j, valid = (x.reshape(nb, w, steps) for x in (i, j, valid))
  nxt_valid = xp.concatenate([valid[..., 1:], xp.zeros_like(valid[..., :1])], axis=-1)
  nxt_i = xp.concatenate([i[..., 1:], xp.full_like(i[..., :1], -1)], axis=-1)
  prev_i = xp.concatenate([xp.full_like(i[..., :1], -1), i[..., :-1]], axis=-1)
  end = valid & (~nxt_valid | (nxt_i != i))
  start = prev_i != i
  seg = xp.cumsum(end.reshape(nb, -1), axis=-1).reshape(nb, w, steps) - 1
  if xp is np:
    n_seg = max(1, int(end.reshape(nb, -1).sum(-1).max()))
  else:
    n_seg = n_lines + w                      # a lane splits at most one q tile's run
  write = xp.where(end, seg, n_seg).astype(xp.int32)
  tile = xp.full((nb, n_seg + 1), n_lines, xp.int32)
  if xp is np:
    np.put_along_axis(tile, write.reshape(nb, -1), i.reshape(nb, -1), axis=-1)
    tile = tile[:, :n_seg]
  else:
    tile = jax.vmap(lambda tl, wr, ii: tl.at[wr].set(ii, mode="drop"))(
        tile, write.reshape(nb, -1), i.reshape(nb, -1))[:, :n_seg]
  xs = tuple(xp.moveaxis(x, -1, 0) for x in (i, j, valid, start, write))
  return xs, tile, n_seg


def _tile_fetch(values, bidx, i, j, rows, cols):
  """Reads of the lanes' tiles `(i, j)` `[B', W]` at row indices `rows [B', W, bq, 1]` and
  column indices `cols [B', W, 1, bk]` (clipped: padding rows and columns are masked out)."""
  def fetch(kind: str, slot: int):
    if kind == "q_read":
      a = values.q[:, slot]
      return a[bidx, jnp.clip(rows, 0, a.shape[-1] - 1)]
    if kind == "k_read":
      a = values.k[:, slot]
      return a[bidx, jnp.clip(cols, 0, a.shape[-1] - 1)]
    if kind == "scalar":
      return values.scalars[:, slot][bidx]
    if kind == "pair":
      a = values.pairs[:, slot]
      return a[bidx, jnp.clip(rows, 0, a.shape[-2] - 1), jnp.clip(cols, 0, a.shape[-1] - 1)]
    a = values.tile_pairs[:, slot]
    bb = bidx if isinstance(bidx, int) else bidx[:, :, 0, 0]
    return a[bb, i, j][..., None, None]
  return fetch


def _attend(q, k, v, bm, u: int, *, scale: float, cap, sinks, with_lse: bool = False):
  """Attention of all heads of q under mask `u` of `bm` (GQA: H = G × Hkv)."""
  b, lq, h, d = q.shape
  lkv, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
  g = h // hkv
  bq, bk = bm.block_q, bm.block_kv
  nq, nk = bm.n_q_tiles, bm.n_kv_tiles
  f32 = jnp.float32
  qt = (_pad_to(q.astype(f32), 1, nq * bq) * scale).reshape(b, nq, bq, hkv, g, d)
  if lkv % bk:
    # Key tiles read as rows, clipped at the last key (the columns past it are masked):
    # padding the keys would copy a whole KV cache for every decode step.
    kt, vt = k.astype(f32), v.astype(f32)
  else:
    kt = k.astype(f32).reshape(b, nk, bk, hkv, d)
    vt = v.astype(f32).reshape(b, nk, bk, hkv, dv)
  batched = bm.batch is not None
  values = common.read_values(bm, u)
  pred = bm.predicates[u]
  bidx = common.batch_index(bm, 4)
  rows = jnp.arange(bq, dtype=jnp.int32)[:, None]
  cols = jnp.arange(bk, dtype=jnp.int32)

  def step(carry, xs, partial: bool):
    m, l, acc, bufs = carry
    i, j, valid, start, write = xs                     # [B', W]
    fresh = start[..., None, None, None]
    m = jnp.where(fresh, common.NEG, m)
    l = jnp.where(fresh, 0.0, l)
    acc = jnp.where(fresh[..., None], 0.0, acc)
    qg = _gather(qt, i, batched)                       # [B, W, bq, hkv, g, d]
    if lkv % bk:
      key_rows = jnp.minimum(j[..., None] * bk + cols, lkv - 1)  # [B', W, bk]
      kg = _gather(kt, key_rows, batched)              # [B, W, bk, hkv, d]
      vg = _gather(vt, key_rows, batched)
    else:
      kg = _gather(kt, j, batched)
      vg = _gather(vt, j, batched)
    s = jnp.einsum("bwqhgd,bwkhd->bwhgqk", qg, kg)     # [B, W, hkv, g, bq, bk]
    if cap is not None:
      s = cap * jnp.tanh(s / cap)
    kpos = j[..., None] * bk + cols                    # [B', W, bk]
    keep = valid[..., None] & (kpos < lkv)
    if partial:
      qpos = i[..., None, None] * bq + rows + bm.q_offset
      allowed = _predicate.evaluate(pred, jnp, qpos, kpos[:, :, None, :],
                                    _tile_fetch(values, bidx, i, j, qpos - bm.q_offset,
                                                kpos[:, :, None, :]))
      allowed = allowed & keep[:, :, None, :]          # [B', W, bq, bk]
      s = jnp.where(allowed[:, :, None, None], s, common.NEG)
    else:
      s = s + jnp.where(keep, 0.0, common.NEG)[:, :, None, None, None, :]
    m_new = jax.lax.stop_gradient(jnp.maximum(m, s.max(-1)))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    l = alpha * l + p.sum(-1)
    acc = alpha[..., None] * acc + jnp.einsum("bwhgqk,bwkhd->bwhgqd", p, vg)
    bm_, bl, bacc = bufs
    bufs = (_scatter(bm_, write, m_new, batched), _scatter(bl, write, l, batched),
            _scatter(bacc, write, acc, batched))
    return (m_new, l, acc, bufs), None

  seg_m, seg_l, seg_acc, seg_tile = [], [], [], []
  for state in (common.FULL, common.PARTIAL):
    i, j, count, static = common.tile_pairs(bm, u, state)
    if static and not count.any():
      continue
    xp = np if static else jnp
    xs, tile, n_seg = _lanes(i, j, count, nq, xp)
    xs = tuple(jnp.asarray(x) for x in xs)
    w = xs[0].shape[-1]
    lane = (b, w, hkv, g, bq)
    init = (jnp.full(lane, common.NEG, f32), jnp.zeros(lane, f32), jnp.zeros(lane + (dv,), f32),
            (jnp.full((b, n_seg, hkv, g, bq), common.NEG, f32),
             jnp.zeros((b, n_seg, hkv, g, bq), f32), jnp.zeros((b, n_seg, hkv, g, bq, dv), f32)))
    partial = state == common.PARTIAL
    if static:
      def body(c, x, p=partial):
        return step(c, x, p)
    else:
      # A traced map's lists are padded to a static bound (every key tile, for a decode
      # row over a whole cache). Each lane's valid steps come first, so a step where no
      # lane is valid has nothing left to do: skipping it keeps the work at the tiles the
      # runs name, not the bound.
      def body(c, x, p=partial):
        return jax.lax.cond(x[2].any(), lambda c: step(c, x, p)[0], lambda c: c, c), None

    (_, _, _, (bm_, bl, bacc)), _ = jax.lax.scan(body, init, xs)
    seg_m.append(bm_)
    seg_l.append(bl)
    seg_acc.append(bacc)
    seg_tile.append(jnp.broadcast_to(jnp.asarray(tile), (b, n_seg)) if not batched else
                    jnp.asarray(tile))

  # Combine the segments of each q tile (and the sink logit) into one softmax.
  if seg_m:
    sm, sl, sa = (jnp.concatenate(x, axis=1) for x in (seg_m, seg_l, seg_acc))
    tiles = jnp.concatenate(seg_tile, axis=1)          # [B, n_seg]
    seg_max = jax.vmap(lambda x, t: jax.ops.segment_max(x, t, nq))(sm, tiles)
    m = jnp.maximum(seg_max, common.NEG)
  else:
    m = jnp.full((b, nq, hkv, g, bq), common.NEG, f32)
  if sinks is not None:
    sink = jnp.broadcast_to(sinks.reshape(1, 1, hkv, g, 1), m.shape)
    m = jnp.maximum(m, sink)
  m = jax.lax.stop_gradient(m)
  l = jnp.zeros_like(m)
  acc = jnp.zeros(m.shape + (dv,), f32)
  if seg_m:
    safe = jnp.clip(tiles, 0, nq - 1)
    w8 = jnp.exp(sm - jax.vmap(lambda x, t: x[t])(m, safe))
    l = jax.vmap(lambda x, t: jax.ops.segment_sum(x, t, nq))(sl * w8, tiles)
    acc = jax.vmap(lambda x, t: jax.ops.segment_sum(x, t, nq))(sa * w8[..., None], tiles)
  if sinks is not None:
    l = l + jnp.exp(sink - m)
  out = acc / jnp.where(l == 0, 1.0, l)[..., None]
  if sinks is None:
    # A row that met no allowed key still has the initial max; its sums are padding.
    out = jnp.where((m > common.NEG / 2)[..., None], out, 0.0)
  out = jnp.moveaxis(out, 4, 2).reshape(b, nq * bq, h, dv)[:, :lq]
  if with_lse:
    seen = (l > 0) & (m > common.NEG / 2)   # a row that met an allowed key
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_LSE)
    lse = jnp.moveaxis(lse, 4, 2).reshape(b, nq * bq, h)[:, :lq]
    return out, lse
  return out.astype(q.dtype)
