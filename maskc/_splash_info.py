"""Splash `MaskInfo` from a BlockMap, for JAX's `SplashAttentionKernel`.

Splash's own `process_mask` visits every tile of the mask and slices it to
classify it: seconds at 32K tokens, a minute at 128K. The BlockMap already
knows every tile's state, so here only the PARTIAL tiles are evaluated (to
store their blocks, deduplicated), and the index arrays are built from the
compact runs in time proportional to the non-empty tiles.

The result is laid out exactly as splash lays out its own (same shapes, same
"next tile" indices, same shrunk grid for a single mask), with partial blocks
numbered in the same first-seen order, so a kernel built from either runs the
same. Masks that read no array operands may instead be evaluated inside the
kernel (`mask_function`, as splash does for its `CausalMask` or `LocalMask`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info import MaskInfo

from maskc import _predicate
from maskc._errors import BackendError, MaskValueError
from maskc._predicate import Predicate
from maskc._tiles import EMPTY, PARTIAL, Runs, expand_runs

_EVAL_CHUNK = 1 << 22  # mask elements evaluated at once


@dataclasses.dataclass(frozen=True)
class MaskFunction:
  """`f(q_ids, kv_ids)`: a mask at splash's row and column indices, hashable by value.

  Splash passes it to `jax.jit` as a static argument, so equal masks must hash
  equal to share one compiled kernel. It evaluates the compiled predicate, which
  reads no operand arrays (its scalars are stored here as values).
  """
  predicate: Predicate
  q_offset: int
  scalars: tuple[int, ...] = ()

  def __call__(self, q_ids, kv_ids):
    import jax.numpy as jnp
    xp = np if isinstance(q_ids, np.ndarray) and isinstance(kv_ids, np.ndarray) else jnp
    fetch = lambda kind, slot: self.scalars[slot]
    return _predicate.evaluate(self.predicate, xp, q_ids + self.q_offset, kv_ids, fetch)


def splash_mask_info(bm, downcast_smem_data: bool = True, *,
                     use_mask_function: bool | None = None
                     ) -> tuple[MaskInfo, MaskInfo, MaskInfo, MaskFunction | None]:
  """`(fwd, dq, dkv, mask_function)` MaskInfos for JAX's splash kernel, from a BlockMap.

  Args:
    bm: a compiled `BlockMap` whose lengths are multiples of its tile sizes, without
      a batch axis. Heads: one mask for all heads gives MaskInfos with a leading
      axis of 1 (splash's shrunk grid); several masks give one row per head.
    downcast_smem_data: store the index arrays in the smallest integer type that
      holds them (int8/int16/int32), as splash does for TPU scalar memory.
    use_mask_function: evaluate partial tiles in the kernel with `mask_function`
      instead of loading stored blocks. Default: when the map is static, has one
      mask and the mask reads no array operands (splash's choice for its
      computable masks).

  Returns:
    `(fwd_mask_info, dq_mask_info, dkv_mask_info, mask_function_or_None)`. The dq
    MaskInfo equals the forward one (same tiles); the dkv one is walked per key
    tile, with transposed partial blocks. A traced BlockMap gives splash's dynamic
    layout (`is_dynamic_mask=True`, every tile's block stored).

  Raises:
    MaskValueError: a length is not a multiple of its tile size.
    BackendError: the map has a batch axis (splash has none).

  >>> import maskc
  >>> bm = maskc.compile("causal", 512, block_q=128, block_kv=128)
  >>> fwd, dq, dkv, fn = bm.splash()
  >>> fwd.block_mask[0].tolist()
  [[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]]
  """
  if bm.q_len % bm.block_q or bm.kv_len % bm.block_kv:
    raise MaskValueError(
        f"splash needs lengths that are multiples of the tile sizes, got q_len={bm.q_len}, "
        f"block_q={bm.block_q}, kv_len={bm.kv_len}, block_kv={bm.block_kv}",
        hint="Pad the sequences to a multiple of the tiles, pick tiles that divide them, or "
             "use the xla or flash backend, which take any length.")
  if bm.batch is not None:
    raise BackendError(
        f"splash MaskInfo has no batch axis, but this mask's operands have batch size "
        f"{bm.batch}",
        hint="Use backend='xla' or 'flash'; the splash backend itself lowers `document(s)` "
             "with batched segment ids to splash SegmentIds.")
  if not bm.is_static:
    return _dynamic_info(bm, downcast_smem_data)
  unique = len(bm.masks)
  if use_mask_function is None:
    use_mask_function = unique == 1 and not bm.predicates[0].reads_arrays
  if use_mask_function and unique > 1:
    raise MaskValueError("a splash mask_function serves one mask; this map has "
                         f"{unique} distinct head masks", hint="Pass use_mask_function=False.")
  blocks, ids = _partial_blocks(bm)
  if unique == 1:
    fwd = _shrunk_info(bm, ids, blocks, dkv=False)
    dkv = _shrunk_info(bm, ids, blocks, dkv=True)
  else:
    fwd = _per_head_info(bm, ids, blocks, dkv=False)
    dkv = _per_head_info(bm, ids, blocks, dkv=True)
  fn = None
  if use_mask_function:
    pred = bm.predicates[0]
    if pred.reads_arrays:
      raise MaskValueError("a splash mask_function evaluates masks of positions and scalars; "
                           f"`{pred}` reads operand arrays", hint="Pass use_mask_function=False.")
    scalars = tuple(int(np.asarray(bm.operands[n]).reshape(-1)[0]) for n in pred.scalars)
    fn = MaskFunction(pred, int(bm.q_offset), scalars)
    q_sequence = np.arange(bm.q_len, dtype=np.int32)
    fwd = fwd._replace(mask_next=None, partial_mask_blocks=None, q_sequence=q_sequence)
    dkv = dkv._replace(mask_next=None, partial_mask_blocks=None, q_sequence=q_sequence)
  if downcast_smem_data:
    fwd, dkv = _downcast(fwd), _downcast(dkv)
  return fwd, fwd, dkv, fn


# ----------------------------------------------------------------------------- static


def _tiles(runs: Runs, u: int):
  """Non-empty tiles of mask u as `(line, other, state)`, sorted by line then other."""
  t = expand_runs(Runs(*(np.asarray(a)[:1, u:u + 1] for a in runs)))
  return t.line, t.other, t.state


def _partial_blocks(bm):
  """The distinct partial blocks, and for each mask u the block id of each partial tile.

  Ids follow splash: masks in order, tiles row-major, a block numbered when first seen.
  Returns `(blocks bool[n, bq, bk], ids)` with `ids[u] = (i, j, id)` arrays.
  """
  bq, bk = bm.block_q, bm.block_kv
  seen: dict[bytes, int] = {}
  blocks: list[np.ndarray] = []
  ids = []
  per_chunk = max(1, _EVAL_CHUNK // (bq * bk))
  for u, pred in enumerate(bm.predicates):
    line, other, st = _tiles(bm.rows, u)
    sel = st == PARTIAL
    i, j = line[sel], other[sel]
    out = np.zeros(i.shape, np.int64)
    values = bm.read_values(u)
    for s in range(0, len(i), per_chunk):
      ii, jj = i[s:s + per_chunk], j[s:s + per_chunk]
      rows = ii[:, None, None] * bq + np.arange(bq)[None, :, None]
      cols = jj[:, None, None] * bk + np.arange(bk)[None, None, :]
      tiles = np.asarray(_predicate.evaluate(pred, np, rows + int(bm.q_offset), cols,
                                             _tile_fetch(values, ii, jj, rows, cols)), bool)
      for t, tile in enumerate(tiles):
        key = np.packbits(tile).tobytes()
        if key not in seen:
          seen[key] = len(blocks)
          blocks.append(tile)
        out[s + t] = seen[key]
    ids.append((i, j, out))
  arr = np.stack(blocks) if blocks else None
  return arr, ids


def _tile_fetch(values, ii, jj, rows, cols):
  """Reads of tiles `(ii, jj)` at row indices `rows [T, bq, 1]`, columns `cols [T, 1, bk]`."""
  def fetch(kind: str, slot: int):
    if kind == "q_read":
      return values.q[0, slot][rows]
    if kind == "k_read":
      return values.k[0, slot][cols]
    if kind == "scalar":
      return values.scalars[0, slot]
    if kind == "pair":
      return values.pairs[0, slot][rows, cols]
    return values.tile_pairs[0, slot][ii, jj][:, None, None]
  return fetch


def _next_ids(order_keys: np.ndarray, partial_keys: np.ndarray, partial_ids: np.ndarray):
  """For each key, the id of the first partial tile at or after it (wrapping to the first)."""
  if not partial_keys.size:
    return np.zeros(order_keys.shape, np.int32)
  sort = np.argsort(partial_keys, kind="stable")
  pk, pid = partial_keys[sort], partial_ids[sort]
  pos = np.searchsorted(pk, order_keys, side="left")
  pos = np.where(pos >= pk.size, 0, pos)
  return pid[pos].astype(np.int32)


def _shrunk_info(bm, ids, blocks, dkv: bool) -> MaskInfo:
  """One mask: splash's shrunk grid `[1, nq, width]` (forward) or `[1, height, nk]` (dkv)."""
  nq, nk = bm.n_q_tiles, bm.n_kv_tiles
  pi, pj, pid = ids[0]
  if not dkv:
    line, other, st = _tiles(bm.rows, 0)           # line = q tile, other = key tile
    i, j = line, other
    key, pkey = i * nk + j, pi * nk + pj
  else:
    line, other, st = _tiles(bm.cols, 0)           # line = key tile, other = q tile
    i, j = other, line
    key, pkey = j * nq + i, pj * nq + pi
  n_lines = nk if dkv else nq
  count = np.bincount(line, minlength=n_lines)
  width = max(1, int(count.max()) if count.size else 1)
  first = np.concatenate([[0], np.cumsum(count)[:-1]])
  slot = np.arange(line.size) - first[line]
  if dkv:
    slot = slot + (width - count[line])              # splash pads dkv columns at the front
  shape = (width, nk) if dkv else (nq, width)
  where = (slot, line) if dkv else (line, slot)
  block_mask = np.zeros(shape, np.int32)
  data_next = np.zeros(shape, np.int32)
  block_mask[where] = st
  data_next[where] = other
  mask_next = None
  partial = None
  if blocks is not None:
    mask_next = np.zeros(shape, np.int32)
    mask_next[where] = _next_ids(key, pkey, pid)
    partial = np.swapaxes(blocks, -1, -2) if dkv else blocks
  return MaskInfo(data_next=data_next[None], mask_next=None if mask_next is None else
                  mask_next[None], block_mask=block_mask[None], partial_mask_blocks=partial,
                  q_sequence=None)


def _per_head_info(bm, ids, blocks, dkv: bool) -> MaskInfo:
  """Several masks: splash's unshrunk per-head grid `[H, nq, nk]`."""
  nq, nk = bm.n_q_tiles, bm.n_kv_tiles
  heads = len(bm.head_index)
  grids = np.asarray(bm.grid, np.int32)             # [H, nq, nk]
  h, i, j = np.meshgrid(np.arange(heads), np.arange(nq), np.arange(nk), indexing="ij")
  key = ((j * heads + h) * nq + i) if dkv else ((h * nq + i) * nk + j)
  nonempty = grids != EMPTY
  nkeys = np.sort(key[nonempty])
  data_next = np.zeros(grids.shape, np.int32)
  if nkeys.size:
    pos = np.searchsorted(nkeys, key.reshape(-1))
    nxt = nkeys[np.where(pos >= nkeys.size, 0, pos)]
    data_next = (nxt % nq if dkv else nxt % nk).reshape(grids.shape).astype(np.int32)
  mask_next = partial = None
  if blocks is not None:
    pk, pids = [], []
    for hh, u in enumerate(bm.head_index):
      pi, pj, pid = ids[u]
      pk.append(((pj * heads + hh) * nq + pi) if dkv else ((hh * nq + pi) * nk + pj))
      pids.append(pid)
    mask_next = _next_ids(key.reshape(-1), np.concatenate(pk), np.concatenate(pids)).reshape(
        grids.shape)
    partial = np.swapaxes(blocks, -1, -2) if dkv else blocks
  return MaskInfo(data_next=data_next, mask_next=mask_next, block_mask=grids,
                  partial_mask_blocks=partial, q_sequence=None)


def _downcast(info: MaskInfo) -> MaskInfo:
  def small(a):
    if a is None or a.size == 0:
      return a
    top = int(a.max())
    for t in (np.int8, np.int16):
      if top <= np.iinfo(t).max:
        return a.astype(t)
    return a.astype(np.int32)
  return info._replace(data_next=small(info.data_next), mask_next=small(info.mask_next),
                       block_mask=small(info.block_mask))


# ----------------------------------------------------------------------------- dynamic


def _dynamic_info(bm, downcast: bool):
  """Splash's dynamic layout from a traced map: every tile's block stored, per mask head."""
  import jax.numpy as jnp

  bq, bk = bm.block_q, bm.block_kv
  nq, nk = bm.n_q_tiles, bm.n_kv_tiles
  grid = jnp.asarray(bm.grid, jnp.int32)
  grid = grid.reshape((-1, nq, nk))                  # [H or 1, nq, nk]
  q = jnp.arange(bm.q_len, dtype=jnp.int32)[None, :, None] + bm.q_offset
  k = jnp.arange(bm.kv_len, dtype=jnp.int32)[None, None, :]
  dense = []
  for u, pred in enumerate(bm.predicates):
    values = bm.read_values(u, dtype=jnp.int32)
    fetch = _predicate.dense_fetch(values, jnp, block_q=bq, block_kv=bk, q_len=bm.q_len,
                                   kv_len=bm.kv_len)
    dense.append(_predicate.evaluate(pred, jnp, q, k, fetch)[0])
  per_head = [dense[u] for u in (bm.head_index or (0,))]
  full = jnp.stack([jnp.broadcast_to(d, (bm.q_len, bm.kv_len)) for d in per_head])
  blocks = full.reshape(-1, nq, bq, nk, bk).swapaxes(-2, -3)   # [H, nq, nk, bq, bk]
  heads = grid.shape[0]
  flat = jnp.arange(heads * nq * nk, dtype=jnp.int32).reshape(grid.shape)
  mask_next = jnp.where(grid == PARTIAL, flat, 0)
  cols = jnp.broadcast_to(jnp.arange(nk, dtype=jnp.int32)[None, None, :], grid.shape)
  rows = jnp.broadcast_to(jnp.arange(nq, dtype=jnp.int32)[None, :, None], grid.shape)

  def info(data_next, partial):
    block_mask, dn, mn = grid, data_next, mask_next
    if downcast:
      block_mask = block_mask.astype(jnp.int8)
      dn = dn.astype(_small_type(max(nq, nk)))
      mn = mn.astype(_small_type(heads * nq * nk))
    return MaskInfo(data_next=dn, mask_next=mn, block_mask=block_mask, partial_mask_blocks=partial,
                    q_sequence=None, is_dynamic_mask=True)

  fwd = info(jnp.where(grid == EMPTY, 0, cols), blocks)
  dkv = info(jnp.where(grid == EMPTY, 0, rows), blocks.swapaxes(-1, -2))
  return fwd, fwd, dkv, None


def _small_type(top: int):
  for t in (np.int8, np.int16):
    if top <= np.iinfo(t).max:
      return t
  return np.int32

