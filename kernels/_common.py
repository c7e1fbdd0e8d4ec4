"""What every attention backend shares: shape checks, bindings, tile lists, head splitting.

A backend sees a *binding*: the masks, their shape and prepared operands. A compiled
`BlockMap` is one (it adds the tile metadata); `bind` makes one without compiling,
for the dense reference. Tile lists are the per-line index lists a block-sparse
kernel walks, derived from the BlockMap's compact runs (static, NumPy) or its grid
(traced, padded to a static bound).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from maskc import _ir as ir
from maskc import _lower
from maskc._blockmap import FULL as FULL, PARTIAL as PARTIAL  # re-exported for the backends
from maskc._blockmap import EMPTY, BlockMap, grid_from_runs
from maskc._errors import MaskValueError
from maskc._evaluate import Env, evaluate_mask

# Finite, so fully masked rows never produce inf - inf = NaN (splash and jax use the same).
NEG = -0.7 * float(np.finfo(np.float32).max)

# A binding is masks bound to a shape with prepared operands and no tile metadata; a
# compiled BlockMap is one too (it adds the tiles). Lowering and kernels share one.
Binding = _lower.Binding


def bind(mask: Any, q_len: int, kv_len: int, *, q_offset: Any = None,
         operands: dict[str, Any] | None = None) -> Binding:
  """Masks (text, Mask or a per-head sequence) bound to a shape with prepared operands."""
  return _lower.bind_masks(mask, q_len, kv_len, q_offset=q_offset, operands=operands)


def cap_block(block: int, length: int, minimum: int = 8) -> int:
  """`block`, shrunk to the next power of two of a shorter `length` (at least `minimum`)."""
  return min(block, max(minimum, 1 << max(0, (length - 1).bit_length())))


def default_scale(head_dim: int, scale: float | None) -> float:
  """`scale`, or `1 / sqrt(head_dim)` when None."""
  return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def check_qkv(q, k, v) -> tuple[int, int, int, int, int, int]:
  """`(B, Lq, H, Lkv, Hkv, D)` after checking the layouts `[B, L, heads, D]` agree."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise MaskValueError(f"{name} must have shape [batch, length, heads, head_dim], got "
                           f"{name}.shape={tuple(getattr(x, 'shape', ()))}")
  b, lq, h, d = q.shape
  bk, lkv, hkv, dk = k.shape
  if bk != b or v.shape[0] != b:
    raise MaskValueError(f"q, k and v must share the batch size, got {q.shape=}, {k.shape=}, "
                         f"{v.shape=}")
  if dk != d:
    raise MaskValueError(f"q and k must share the head dimension, got {q.shape=}, {k.shape=}")
  if v.shape[1] != lkv or v.shape[2] != hkv:
    raise MaskValueError(f"k and v must share length and heads, got {k.shape=}, {v.shape=}")
  if h % hkv:
    raise MaskValueError(f"the query heads must be a multiple of the key heads (GQA/MQA), got "
                         f"{h} query heads and {hkv} key heads")
  return b, lq, h, lkv, hkv, d


def kernel_operands(binding) -> dict[str, jax.Array]:
  """The binding's operand arrays as int32 jax arrays (batch axis first)."""
  out = {}
  for n, a in binding.operands.items():
    if isinstance(a, np.ndarray):
      a = jnp.asarray(a.astype(np.int32))
    else:
      a = jnp.asarray(a).astype(jnp.int32)
    out[n] = a
  return out


def batch_index(binding, ndim: int):
  """Batch indices `[B', 1, ...]` with `ndim` axes for evaluation, or 0 without a batch."""
  if binding.batch is None:
    return 0
  return jnp.arange(binding.batch, dtype=jnp.int32).reshape((binding.batch,) + (1,) * (ndim - 1))


def dense_allowed(binding, u: int):
  """Mask `u` evaluated densely: bool `[B', q_len, kv_len]` (B' the batch or 1)."""
  ops = kernel_operands(binding)
  qpos = jnp.arange(binding.q_len, dtype=jnp.int32)[None, :, None] + binding.q_offset
  kpos = jnp.arange(binding.kv_len, dtype=jnp.int32)[None, None, :]
  out = evaluate_mask(binding.masks[u], Env(jnp, qpos, kpos, ops, batch_index(binding, 3)))
  return jnp.broadcast_to(out, ((binding.batch or 1), binding.q_len, binding.kv_len))


# ----------------------------------------------------------------------------- tile lists


def _static_lists(start, stop, state, want: int):
  """Per-line sorted tile indices of the runs in `state`, from NumPy runs `[..., n, R]`."""
  lead = start.shape[:-1]
  lines = int(np.prod(lead))
  start = start.reshape(lines, -1).astype(np.int64)
  length = np.where(state.reshape(lines, -1) == want, stop.reshape(lines, -1) - start, 0)
  count = length.sum(-1)
  m = max(1, int(count.max()) if count.size else 1)
  idx = np.zeros((lines, m), np.int32)
  flat_len = length.reshape(-1)
  total = int(flat_len.sum())
  if total:
    run_line = np.repeat(np.arange(lines), length.shape[1])
    first = np.repeat(np.cumsum(flat_len) - flat_len, flat_len)
    within = np.arange(total) - first
    tile = np.repeat(start.reshape(-1), flat_len) + within
    line = np.repeat(run_line, flat_len)
    line_first = np.concatenate([[0], np.cumsum(count)[:-1]])
    slot = np.arange(total) - line_first[line]
    idx[line, slot] = tile
  return idx.reshape(lead + (m,)), count.astype(np.int32).reshape(lead)


def _traced_lists(grid, want: int, m: int):
  """Per-line sorted tile indices in `want` state from a (traced) grid `[..., n, n_other]`."""
  n_other = grid.shape[-1]
  hit = grid == want
  j = jnp.arange(n_other, dtype=jnp.int32)
  idx = jnp.sort(jnp.where(hit, j, n_other), axis=-1)[..., :m]
  count = hit.sum(-1).astype(jnp.int32)
  return jnp.where(idx >= n_other, 0, idx).astype(jnp.int32), count


def static_bound(bm: BlockMap, u: int, transpose: bool) -> tuple[int, int] | None:
  """Static bounds on the non-empty tiles of a traced map, from its operand-free part.

  A mask `a & b & ...` whose conjuncts `a` need no operands has no more non-empty
  tiles than those conjuncts alone, which compile statically. Returns `(most per
  line, total)`, or None when there is no such part.
  """
  if isinstance(bm.q_offset, jax.core.Tracer):
    return None
  m = bm.masks[u]
  items = m.items if isinstance(m, ir.And) else (m,)
  static = [i for i in items if not i.operands]
  if not static:
    return None
  from maskc._lower import compile as compile_mask
  part = static[0] if len(static) == 1 else ir.and_(static)
  sbm = compile_mask(part, bm.q_len, bm.kv_len, block_q=bm.block_q, block_kv=bm.block_kv,
                     q_offset=int(bm.q_offset))
  runs = sbm.cols if transpose else sbm.rows
  length = np.where(runs.state != EMPTY, runs.stop - runs.start, 0).sum(-1)
  if not length.size:
    return 1, 1
  return max(1, int(length.max())), max(1, int(length.sum()))


def tile_lists(bm: BlockMap, u: int, want: int, *, transpose: bool = False):
  """Tiles in state `want` per line, for mask `u`: `(idx [B', n, M], count [B', n], static)`.

  Lines are q tiles (their key tiles), or key tiles with `transpose` (their q
  tiles). `idx[b, i, :count[b, i]]` lists them in increasing order; the rest is 0.
  NumPy arrays for a static map (M is the true maximum); jax arrays padded to a
  static bound for a traced one.
  """
  runs = bm.cols if transpose else bm.rows
  if bm.is_static:
    idx, count = _static_lists(runs.start[:, u], runs.stop[:, u], runs.state[:, u], want)
    return idx, count, True
  n_other = bm.n_q_tiles if transpose else bm.n_kv_tiles
  grid = grid_from_runs(jnp, runs, n_other)[:, u]
  bound = static_bound(bm, u, transpose)
  m = n_other if bound is None else min(bound[0], n_other)
  idx, count = _traced_lists(grid, want, m)
  return idx, count, False


def tile_pairs(bm: BlockMap, u: int, want: int):
  """All tiles in state `want` of mask u in row-major order: `(i, j, count, static)`.

  `i, j` are `[B', T]` (q tile, key tile), the first `count[b]` valid. T is the
  largest count over the batch for a static map, a static bound for a traced one.
  """
  if bm.is_static:
    idx, count, _ = tile_lists(bm, u, want)
    nb, n, m = idx.shape
    valid = np.arange(m)[None, None, :] < count[..., None]
    total = count.sum(-1)
    t = max(1, int(total.max()))
    i = np.zeros((nb, t), np.int32)
    j = np.zeros((nb, t), np.int32)
    for b in range(nb):
      rows, slots = np.nonzero(valid[b])
      i[b, :rows.size] = rows
      j[b, :rows.size] = idx[b, rows, slots]
    return i, j, total.astype(np.int32), True
  nq, nk = bm.n_q_tiles, bm.n_kv_tiles
  grid = grid_from_runs(jnp, bm.rows, nk)[:, u]                # [B', nq, nk]
  bound = static_bound(bm, u, False)
  t = nq * nk if bound is None else min(bound[1], nq * nk)
  hit = (grid == want).reshape(grid.shape[0], -1)
  flat = jax.vmap(lambda h: jnp.nonzero(h, size=t, fill_value=0)[0])(hit).astype(jnp.int32)
  return flat // nk, flat % nk, hit.sum(-1).astype(jnp.int32), False


# ----------------------------------------------------------------------------- heads


def head_groups(binding, heads: int) -> list[tuple[int, list[int]]]:
  """`(u, heads using mask u)` for each distinct mask."""
  if binding.head_index is None:
    return [(0, list(range(heads)))]
  if len(binding.head_index) != heads:
    raise MaskValueError(f"the mask has {len(binding.head_index)} heads but q has {heads}",
                         hint="Pass one mask per query head, or a single mask for all heads.")
  groups: dict[int, list[int]] = {}
  for h, u in enumerate(binding.head_index):
    groups.setdefault(u, []).append(h)
  return sorted(groups.items())


def per_mask(fn: Callable, q, k, v, binding, sinks):
  """Runs `fn(q, k, v, u, sinks)` once per distinct mask on the heads that use it.

  With one mask, `fn` sees every head (GQA intact). With several, each call gets
  its heads' queries and, per query head, its key/value head (so G = 1).
  """
  heads, hkv = q.shape[2], k.shape[2]
  groups = head_groups(binding, heads)
  if len(groups) == 1:
    return fn(q, k, v, groups[0][0], sinks)
  g = heads // hkv
  outs, order = [], []
  for u, hs in groups:
    hs_a = np.asarray(hs)
    kv_a = hs_a // g
    outs.append(fn(q[:, :, hs_a], k[:, :, kv_a], v[:, :, kv_a], u,
                   None if sinks is None else sinks[hs_a]))
    order.extend(hs)
  out = jnp.concatenate(outs, axis=2)
  inverse = np.argsort(np.asarray(order))
  return out[:, :, inverse]


def check_batch(binding, b: int) -> None:
  """Raises when the mask's batch (from batched operands) differs from q's."""
  if binding.batch is not None and binding.batch != b:
    raise MaskValueError(f"the mask's operands have batch size {binding.batch} but q has {b}",
                         hint="Give batched operands the batch size of q, or no batch axis.")


def check_blockmap(bm, backend: str, q_len: int, kv_len: int, batch: int) -> None:
  """Raises unless `bm` is a BlockMap compiled for these lengths and this batch."""
  if not isinstance(bm, BlockMap):
    raise MaskValueError(f"the {backend} backend needs a compiled BlockMap (maskc.compile)")
  if (bm.q_len, bm.kv_len) != (q_len, kv_len):
    raise MaskValueError(f"the BlockMap is compiled for q_len={bm.q_len}, kv_len={bm.kv_len} "
                         f"but q and k have lengths {q_len} and {kv_len}")
  check_batch(bm, batch)


def check_sinks(sinks, heads: int):
  """`sinks` as float32 `[H]`, or None."""
  if sinks is None:
    return None
  sinks = jnp.asarray(sinks)
  if sinks.shape != (heads,):
    raise MaskValueError(f"sinks must have shape [heads]=({heads},), got {sinks.shape}")
  return sinks.astype(jnp.float32)
