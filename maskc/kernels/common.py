"""What every attention backend shares: shape checks, read values, tile lists, head splitting.

A backend sees one compiled object, the `BlockMap` (`maskc.compiled.blockmap`): tile runs,
per distinct mask a compiled `Predicate` (`maskc.compiled.predicate`) and the operand
arrays it reads. Nothing here knows the mask language: partial tiles are
evaluated by running the predicate's program on positions and read values.
Tile lists are the per-line index lists a block-sparse kernel walks, derived
from the runs (static, NumPy) or from the grid (traced, padded to a static bound
the compiler found).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from maskc.compiled import predicate as _predicate
from maskc.compiled.blockmap import BlockMap
from maskc.compiled.tiles import (  # for the backends
  EMPTY as EMPTY,
  FULL as FULL,
  PARTIAL as PARTIAL,
  Runs,
  grid_from_runs,
  tile_lists as _run_tile_lists,
)
from maskc.language.errors import MaskValueError

# Finite, so fully masked rows never produce inf - inf = NaN (splash and jax use the same).
NEG = -0.7 * float(np.finfo(np.float32).max)


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


def qkv_arrays(q, k, v) -> tuple[jax.Array, jax.Array, jax.Array]:
  """q, k and v as jax arrays, after `check_qkv`.

  NumPy inputs are common (notebooks, data pipelines). The kernels index them
  with traced tile ids inside scans and Pallas calls, which a NumPy array cannot
  take, so every backend receives jax arrays; tracers and jax arrays pass through.
  """
  check_qkv(q, k, v)
  q, k, v = (x if isinstance(x, jax.Array) else jnp.asarray(x) for x in (q, k, v))
  return q, k, v


def read_values(bm: BlockMap, u: int, *, rest: bool = False) -> _predicate.ReadValues:
  """Mask `u`'s read values as int32 jax arrays (batch axis first; see
  `maskc.compiled.predicate`)."""
  values = bm.read_values(u, dtype=np.int32, rest=rest)
  return _predicate.ReadValues(*(jnp.asarray(a) for a in values))


def batch_index(bm: BlockMap, ndim: int):
  """Batch indices `[B', 1, ...]` with `ndim` axes for evaluation, or 0 without a batch."""
  if bm.batch is None:
    return 0
  return jnp.arange(bm.batch, dtype=jnp.int32).reshape((bm.batch,) + (1,) * (ndim - 1))


def dense_allowed(bm: BlockMap, u: int):
  """Mask `u` evaluated on every position: bool `[B', q_len, kv_len]` (B' the batch or 1)."""
  values = read_values(bm, u)
  qpos = jnp.arange(bm.q_len, dtype=jnp.int32)[None, :, None] + bm.q_offset
  kpos = jnp.arange(bm.kv_len, dtype=jnp.int32)[None, None, :]
  fetch = _predicate.dense_fetch(values, jnp, block_q=bm.block_q, block_kv=bm.block_kv,
                                 q_len=bm.q_len, kv_len=bm.kv_len)
  out = _predicate.evaluate(bm.predicates[u], jnp, qpos, kpos, fetch)
  return jnp.broadcast_to(out, ((bm.batch or 1), bm.q_len, bm.kv_len))


# ----------------------------------------------------------------------------- tile lists


def _traced_lists(grid, want: int, m: int):
  """Per-line sorted tile indices in `want` state from a (traced) grid `[..., n, n_other]`."""
  n_other = grid.shape[-1]
  hit = grid == want
  j = jnp.arange(n_other, dtype=jnp.int32)
  idx = jnp.sort(jnp.where(hit, j, n_other), axis=-1)[..., :m]
  count = hit.sum(-1).astype(jnp.int32)
  return jnp.where(idx >= n_other, 0, idx).astype(jnp.int32), count


def _bound(bm: BlockMap, u: int, which: int) -> int | None:
  bounds = bm.line_bounds[u] if bm.line_bounds is not None else None
  return None if bounds is None else bounds[which]


def _mask_runs(runs: Runs, u: int) -> Runs:
  return Runs(*(a[:, u] for a in runs))


def tile_lists(bm: BlockMap, u: int, want: int, *, transpose: bool = False):
  """Tiles in state `want` per line, for mask `u`: `(idx [B', n, M], count [B', n], static)`.

  Lines are q tiles (their key tiles), or key tiles with `transpose` (their q
  tiles). `idx[b, i, :count[b, i]]` lists them in increasing order; the rest is 0.
  NumPy arrays for a static map (M is the true maximum); jax arrays padded to a
  static bound for a traced one.
  """
  runs = bm.cols if transpose else bm.rows
  if bm.is_static:
    idx, count = _run_tile_lists(_mask_runs(runs, u), want)
    return idx, count, True
  n_other = bm.n_q_tiles if transpose else bm.n_kv_tiles
  grid = grid_from_runs(jnp, _mask_runs(runs, u), n_other)
  bound = _bound(bm, u, 2 if transpose else 0)
  m = n_other if bound is None else min(bound, n_other)
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
  grid = grid_from_runs(jnp, _mask_runs(bm.rows, u), nk)          # [B', nq, nk]
  bound = _bound(bm, u, 1)
  t = nq * nk if bound is None else min(bound, nq * nk)
  hit = (grid == want).reshape(grid.shape[0], -1)
  flat = jax.vmap(lambda h: jnp.nonzero(h, size=t, fill_value=0)[0])(hit).astype(jnp.int32)
  return flat // nk, flat % nk, hit.sum(-1).astype(jnp.int32), False


# ----------------------------------------------------------------------------- heads


def head_groups(bm: BlockMap, heads: int) -> list[tuple[int, list[int]]]:
  """`(u, heads using mask u)` for each distinct mask."""
  if bm.head_index is None:
    return [(0, list(range(heads)))]
  if len(bm.head_index) != heads:
    raise MaskValueError(f"the mask has {len(bm.head_index)} heads but q has {heads}",
                         hint="Pass one mask per query head, or a single mask for all heads.")
  groups: dict[int, list[int]] = {}
  for h, u in enumerate(bm.head_index):
    groups.setdefault(u, []).append(h)
  return sorted(groups.items())


def per_mask(fn: Callable, q, k, v, bm: BlockMap, sinks):
  """Runs `fn(q, k, v, u, sinks)` once per distinct mask on the heads that use it.

  With one mask, `fn` sees every head (GQA intact). With several, each call gets
  its heads' queries and, per query head, its key/value head (so G = 1).
  """
  heads, hkv = q.shape[2], k.shape[2]
  groups = head_groups(bm, heads)
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


def check_batch(bm: BlockMap, b: int) -> None:
  """Raises when the mask's batch (from batched operands) differs from q's."""
  if bm.batch is not None and bm.batch != b:
    raise MaskValueError(f"the mask's operands have batch size {bm.batch} but q has {b}",
                         hint="Give batched operands the batch size of q, or no batch axis.")


def check_int32(bm: BlockMap, backend: str) -> None:
  """Raises when a term of the mask leaves int32, which the kernels compute in.

  The compiler bounds every term exactly (`BlockMap.int_range`); a traced map has no
  such bound, and then values past int32 would wrap (documented on `maskc.attention`).
  """
  if bm.int_range is None:
    return
  lo, hi = bm.int_range
  if lo < -2**31 or hi > 2**31 - 1:
    raise MaskValueError(
        f"the {backend} attention backend computes mask terms in int32, but a term of "
        f"`{'; '.join(str(p) for p in bm.predicates)}` reaches values in [{lo}, {hi}]",
        hint="Renumber operand ids, shrink literals or the q offset so every term fits in "
             "int32 (maskc.materialize and maskc.compile compute such masks exactly in int64).")


def check_blockmap(bm, backend: str, q_len: int, kv_len: int, batch: int) -> None:
  """Raises unless `bm` is a BlockMap compiled for these lengths, this batch, and int32."""
  if not isinstance(bm, BlockMap):
    raise MaskValueError(f"the {backend} backend needs a compiled BlockMap (maskc.compile)")
  if (bm.q_len, bm.kv_len) != (q_len, kv_len):
    raise MaskValueError(f"the BlockMap is compiled for q_len={bm.q_len}, kv_len={bm.kv_len} "
                         f"but q and k have lengths {q_len} and {kv_len}")
  check_batch(bm, batch)
  check_int32(bm, backend)


def check_one_mask(bm: BlockMap) -> None:
  """Raises MaskValueError unless the map holds one mask for every head: `run_with_lse`
  returns one log-sum-exp per row, and rings combine partial attentions of one mask."""
  if bm.head_index is not None:
    raise MaskValueError("run_with_lse takes a map of one mask for every head, got a map of "
                         f"{len(bm.head_index)} head masks",
                         hint="Compile one mask for all heads, or call it per head group.")


def check_sinks(sinks, heads: int):
  """`sinks` as float32 `[H]`, or None."""
  if sinks is None:
    return None
  sinks = jnp.asarray(sinks)
  if sinks.shape != (heads,):
    raise MaskValueError(f"sinks must have shape [heads]=({heads},), got {sinks.shape}")
  return sinks.astype(jnp.float32)


# ----------------------------------------------------------------------------- plain declarations
# What a backend module declares (`maskc.kernels.api.BackendModule`) when it has nothing of its
# own to say: `installed = common.installed`, and so on.


def installed() -> bool:
  """Whether the backend's packages import here: always, for one that needs only jax."""
  return True


def no_refusal(bm: BlockMap, *, head_dim: int, dtype: DTypeLike, soft_cap: bool = False,
               sinks: bool = False) -> str | None:
  """No reason against any map: the backend runs them all (or refuses a call at run time,
  where `auto` falls back)."""
  return None


def any_length(q_len: int, kv_len: int) -> str | None:
  """No reason against any lengths before a map is compiled."""
  return None


def tile_work(bm: BlockMap, head_dim: int) -> float:
  """Forward FLOPs (two matmuls) on the map's non-EMPTY tiles, per batch row and head: the
  work of a kernel that visits those tiles. A traced map counts every tile."""
  if not bm.is_static:
    return 4.0 * bm.q_len * bm.kv_len * head_dim
  lead = int(np.prod(bm.lead_shape or (1,)))
  return float(bm.attention_flops(head_dim)[0] / lead)
