"""JAX splash's `MaskInfo` from a BlockMap, for JAX's `SplashAttentionKernel`.

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

from maskc.compiled import predicate as _predicate
from maskc.compiled.blockmap import BlockMap
from maskc.compiled.predicate import Predicate
from maskc.compiled.tiles import EMPTY, PARTIAL, Runs, expand_runs
from maskc.language.errors import BackendError, MaskValueError

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

    def fetch(kind, slot):
      return self.scalars[slot]

    return _predicate.evaluate(self.predicate, xp, q_ids + self.q_offset, kv_ids, fetch)


def mask_info(bm: BlockMap, *, downcast_smem_data: bool = True,
              use_mask_function: bool | None = None, head_shards: int = 1,
              q_seq_shards: int = 1) -> tuple[MaskInfo, MaskInfo, MaskInfo, MaskFunction | None]:
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
    head_shards, q_seq_shards: the shards of the mesh the kernel runs on, as in
      splash's `process_mask`: the arrays are laid out so that splitting their
      leading axis into `head_shards` and their q-tile axis into `q_seq_shards`
      equal parts gives each device its own MaskInfo (indices relative to its
      slice, each q shard's shrunk grid padded to the widest shard). One mask for
      all heads gives a leading axis of `head_shards`; per-head masks give one row
      per head shard when each shard's heads share a mask, else one per head.
      Run the kernel under `jax.shard_map` with `manual_sharding_spec` (see
      `maskc.kernels.splash.jax_kernel.make_kernel`).

  Returns:
    `(fwd_mask_info, dq_mask_info, dkv_mask_info, mask_function_or_None)`. The dq
    MaskInfo equals the forward one (same tiles); the dkv one is walked per key
    tile, with transposed partial blocks. A traced BlockMap gives splash's dynamic
    layout (`is_dynamic_mask=True`, every tile's block stored).

  Raises:
    MaskValueError: a length is not a multiple of its tile size, or the shards do
      not divide the q tiles or the heads.
    BackendError: the map has a batch axis (splash has none).

  >>> import maskc
  >>> bm = maskc.compile("causal", 512, block_q=128, block_kv=128)
  >>> fwd, dq, dkv, fn = mask_info(bm)
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
  check_shards(bm, head_shards, q_seq_shards)
  if not bm.is_static:
    return _dynamic_info(bm, downcast_smem_data, head_shards, q_seq_shards)
  unique = len(bm.masks)
  if use_mask_function is None:
    use_mask_function = unique == 1 and not bm.predicates[0].reads_arrays
  if use_mask_function and unique > 1:
    raise MaskValueError("a splash mask_function serves one mask; this map has "
                         f"{unique} distinct head masks", hint="Pass use_mask_function=False.")
  blocks, ids = _partial_blocks(bm)
  if unique == 1:
    fwd = _shrunk_info(bm, ids, blocks, False, head_shards, q_seq_shards)
    dkv = _shrunk_info(bm, ids, blocks, True, head_shards, q_seq_shards)
  else:
    fwd = _per_head_info(bm, ids, blocks, False, head_shards, q_seq_shards)
    dkv = _per_head_info(bm, ids, blocks, True, head_shards, q_seq_shards)
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


def check_shards(bm: BlockMap, head_shards: int, q_seq_shards: int) -> None:
  """Raises unless the shards split the q tiles (and the heads of a per-head map) evenly."""
  for name, n in (("head_shards", head_shards), ("q_seq_shards", q_seq_shards)):
    if not isinstance(n, (int, np.integer)) or n < 1:
      raise MaskValueError(f"{name} must be a positive int, got {n!r}")
  if bm.n_q_tiles % q_seq_shards:
    raise MaskValueError(
        f"q_seq_shards={q_seq_shards} must divide the {bm.n_q_tiles} q tiles "
        f"(q_len={bm.q_len}, block_q={bm.block_q}): each shard holds whole tiles",
        hint="Pick a block_q that makes the q tiles a multiple of the shards.")
  heads = bm.heads
  if heads is not None and heads % head_shards:
    raise MaskValueError(f"head_shards={head_shards} must divide the mask's {heads} heads")


# ----------------------------------------------------------------------------- static


def tiles_of(runs: Runs, u: int):
  """Non-empty tiles of mask u as `(line, other, state)`, sorted by line then other."""
  t = expand_runs(Runs(*(np.asarray(a)[:1, u:u + 1] for a in runs)))
  return t.line, t.other, t.state


def _partial_blocks(
    bm: BlockMap) -> tuple[np.ndarray | None, list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
  """The distinct partial blocks, and for each mask u the block id of each partial tile.

  Ids follow splash: masks in order, tiles row-major, a block numbered when first seen.
  Returns `(blocks bool[n, bq, bk], ids)` with `ids[u] = (i, j, id)` arrays.
  """
  seen: dict[bytes, int] = {}
  blocks: list[np.ndarray] = []
  ids: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
  for u, pred in enumerate(bm.predicates):
    line, other, st = tiles_of(bm.rows, u)
    sel = st == PARTIAL
    i, j = line[sel], other[sel]
    ids.append((i, j, numbered_tiles(bm, pred, bm.read_values(u), i, j, seen, blocks)))
  arr = np.stack(blocks) if blocks else None
  return arr, ids


def numbered_tiles(bm: BlockMap, pred: Predicate, values, ii: np.ndarray, jj: np.ndarray,
                   seen: dict[bytes, int], blocks: list[np.ndarray]) -> np.ndarray:
  """Each tile `(ii, jj)`'s block id: tiles evaluated in chunks, a block numbered when first met.

  `seen` (block bytes to id) and `blocks` (the distinct blocks, `bool[bq, bk]`) carry over
  between calls, so ids can run on across masks, as splash numbers them.
  """
  bq, bk = bm.block_q, bm.block_kv
  ids = np.zeros(ii.shape, np.int64)
  per_chunk = max(1, _EVAL_CHUNK // (bq * bk))
  for s in range(0, ii.size, per_chunk):
    ci, cj = ii[s:s + per_chunk], jj[s:s + per_chunk]
    rows = ci[:, None, None] * bq + np.arange(bq)[None, :, None]
    cols = cj[:, None, None] * bk + np.arange(bk)[None, None, :]
    tiles = np.asarray(_predicate.evaluate(pred, np, rows + int(bm.q_offset), cols,
                                           _tile_fetch(values, ci, cj, rows, cols)), bool)
    for t, tile in enumerate(tiles):
      key = np.packbits(tile).tobytes()
      if key not in seen:
        seen[key] = len(blocks)
        blocks.append(tile)
      ids[s + t] = seen[key]
  return ids


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


def _shrunk_info(bm, ids, blocks, dkv: bool, head_shards: int = 1,
                 q_seq_shards: int = 1) -> MaskInfo:
  """One mask: splash's shrunk grid `[S_h, nq, width]` (forward) or `[S_h, height, nk]` (dkv).

  Each q shard is shrunk on its own (indices relative to its rows), then padded
  to the widest (forward) or tallest (dkv) shard as splash pads: block_mask with
  0, the index arrays with copies of their last column (row).
  """
  nq, nk = bm.n_q_tiles, bm.n_kv_tiles
  rows = nq // q_seq_shards
  pi, pj, pid = ids[0]
  line, other, st = tiles_of(bm.cols if dkv else bm.rows, 0)
  i, j = (other, line) if dkv else (line, other)
  shards = []
  for s in range(q_seq_shards):
    lo = s * rows
    sel = (i >= lo) & (i < lo + rows)
    psel = (pi >= lo) & (pi < lo + rows)
    shards.append(_shrunk_shard(i[sel] - lo, j[sel], st[sel], pi[psel] - lo, pj[psel], pid[psel],
                                rows, nk, dkv, blocks is not None))
  axis = 0 if dkv else 1                    # dkv shrinks the q axis, forward the key axis
  size = max(x[0].shape[axis] for x in shards)

  def pad(a, mode):
    widths = [(0, 0), (0, 0)]
    widths[axis] = (0, size - a.shape[axis])
    return np.pad(a, widths, mode=mode) if mode == "edge" else np.pad(a, widths)

  block_mask = np.concatenate([pad(x[0], "constant") for x in shards], axis=0)
  data_next = np.concatenate([pad(x[1], "edge") for x in shards], axis=0)
  mask_next = (None if blocks is None else
               np.concatenate([pad(x[2], "edge") for x in shards], axis=0))

  def lead(a):
    return None if a is None else np.repeat(a[None], head_shards, axis=0)

  partial = None if blocks is None else (np.swapaxes(blocks, -1, -2) if dkv else blocks)
  return MaskInfo(data_next=lead(data_next), mask_next=lead(mask_next),
                  block_mask=lead(block_mask), partial_mask_blocks=partial, q_sequence=None)


def _shrunk_shard(i, j, st, pi, pj, pid, rows: int, nk: int, dkv: bool, stored: bool):
  """One q shard's shrunk `(block_mask, data_next, mask_next)`; `i` relative to the shard.

  Tiles come sorted by line (q tile forward, key tile for dkv) then the other index.
  A tile's slot holds its state and its data index (key tile forward, the shard's
  q tile for dkv); `mask_next` is the block id of the first partial tile at or
  after it in splash's walk over the shard, wrapping to the shard's first.
  """
  if dkv:
    line, other, n_lines = j, i, nk
    key, pkey = j * rows + i, pj * rows + pi
  else:
    line, other, n_lines = i, j, rows
    key, pkey = i * nk + j, pi * nk + pj
  count = np.bincount(line, minlength=n_lines)
  width = max(1, int(np.max(count)) if count.size else 1)
  first = np.concatenate([[0], np.cumsum(count)[:-1]])
  slot = np.arange(line.size) - first[line]
  if dkv:
    slot = slot + (width - count[line])              # splash pads dkv columns at the front
  shape = (width, nk) if dkv else (rows, width)
  where = (slot, line) if dkv else (line, slot)
  block_mask = np.zeros(shape, np.int32)
  data_next = np.zeros(shape, np.int32)
  block_mask[where] = st
  data_next[where] = other
  mask_next = None
  if stored:
    mask_next = np.zeros(shape, np.int32)
    mask_next[where] = _next_ids(key, pkey, pid)
  return block_mask, data_next, mask_next


def _per_head_info(bm, ids, blocks, dkv: bool, head_shards: int = 1,
                   q_seq_shards: int = 1) -> MaskInfo:
  """Several masks: splash's unshrunk grid `[R, nq, nk]`, walked per (head shard, q shard).

  R is the number of head shards when every shard's heads share one mask (each
  row that mask), else the number of heads. Within a slice splash walks heads,
  q tiles, key tiles (forward) or key tiles, heads, q tiles (dkv); every position
  holds the data index of the first non-empty tile at or after it (the key tile,
  or the q tile relative to the shard for dkv) and the block id of the first
  partial one, wrapping to the slice's first.
  """
  nq = bm.n_q_tiles
  heads = len(bm.head_index)
  per_shard = heads // head_shards
  shard_masks = [set(bm.head_index[s * per_shard:(s + 1) * per_shard])
                 for s in range(head_shards)]
  if all(len(m) == 1 for m in shard_masks):
    row_heads = [s * per_shard for s in range(head_shards)]
    slice_rows = 1
  else:
    row_heads = list(range(heads))
    slice_rows = per_shard
  grids = np.asarray(bm.grid, np.int32)[np.asarray(row_heads)]      # [R, nq, nk]
  pids = np.full(grids.shape, -1, np.int64)
  for r, h in enumerate(row_heads):
    pi, pj, pid = ids[bm.head_index[h]]
    pids[r, pi, pj] = pid
  rows = nq // q_seq_shards
  data_next = np.zeros(grids.shape, np.int32)
  mask_next = np.zeros(grids.shape, np.int32)
  for r0 in range(0, len(row_heads), slice_rows):
    for q0 in range(0, nq, rows):
      g = grids[r0:r0 + slice_rows, q0:q0 + rows]
      p = pids[r0:r0 + slice_rows, q0:q0 + rows]
      idx = np.indices(g.shape)                    # (row, q tile in shard, key tile)
      data = idx[1] if dkv else idx[2]
      if dkv:                                      # walk order: key tile, row, q tile
        def order(a):
          return np.moveaxis(a, 2, 0)

        def back(a):
          return np.moveaxis(a, 0, 2)
      else:
        def order(a):
          return a

        def back(a):
          return a
      gw, dw, pw = (order(a).reshape(-1) for a in (g, data, p))
      shape = order(g).shape
      dn = _next_in_walk(gw != EMPTY, dw)
      mn = _next_in_walk(pw >= 0, pw)
      data_next[r0:r0 + slice_rows, q0:q0 + rows] = back(dn.reshape(shape))
      mask_next[r0:r0 + slice_rows, q0:q0 + rows] = back(mn.reshape(shape))
  partial = None
  if blocks is not None:
    partial = np.swapaxes(blocks, -1, -2) if dkv else blocks
  return MaskInfo(data_next=data_next, mask_next=None if blocks is None else mask_next,
                  block_mask=grids, partial_mask_blocks=partial, q_sequence=None)


def _next_in_walk(hit: np.ndarray, value: np.ndarray) -> np.ndarray:
  """For each position of a walk, `value` at the first hit at or after it (wrapping); 0s if none."""
  where = np.flatnonzero(hit)
  if not where.size:
    return np.zeros(hit.shape, np.int32)
  pos = np.searchsorted(where, np.arange(hit.size), side="left")
  pos = np.where(pos >= where.size, 0, pos)
  return value[where[pos]].astype(np.int32)


def small(a):
  """Splash's downcast: `a` in the smallest of int8, int16, int32 holding its values."""
  if a is None or a.size == 0:
    return a
  top = int(a.max())
  for t in (np.int8, np.int16):
    if top <= np.iinfo(t).max:
      return a.astype(t)
  return a.astype(np.int32)


def _downcast(info: MaskInfo) -> MaskInfo:
  return info._replace(data_next=small(info.data_next), mask_next=small(info.mask_next),
                       block_mask=small(info.block_mask))


# ----------------------------------------------------------------------------- dynamic


def _dynamic_info(bm, downcast: bool, head_shards: int = 1, q_seq_shards: int = 1):
  """Splash's dynamic layout from a traced map: every tile's block stored, per mask head.

  Indices are relative to each (head shard, q shard) slice, as splash's
  `process_dynamic_mask` lays them out. One mask for all heads is given one head
  per head shard (splash would take the mask broadcast to `head_shards` heads).
  """
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
  if grid.shape[0] == 1 and head_shards > 1:
    grid = jnp.broadcast_to(grid, (head_shards, nq, nk))
    blocks = jnp.broadcast_to(blocks, (head_shards,) + blocks.shape[1:])
  heads = grid.shape[0]
  per_shard, rows = heads // head_shards, nq // q_seq_shards
  h, i, j = np.indices(grid.shape)
  flat = jnp.asarray((((h % per_shard) * rows + i % rows) * nk + j).astype(np.int32))
  mask_next = jnp.where(grid == PARTIAL, flat, 0)
  cols = jnp.asarray(j.astype(np.int32))
  local_rows = jnp.asarray((i % rows).astype(np.int32))

  def info(data_next, partial, data_top):
    block_mask, dn, mn = grid, data_next, mask_next
    if downcast:
      block_mask = block_mask.astype(jnp.int8)
      dn = dn.astype(_small_type(data_top))
      mn = mn.astype(_small_type(per_shard * rows * nk))
    return MaskInfo(data_next=dn, mask_next=mn, block_mask=block_mask, partial_mask_blocks=partial,
                    q_sequence=None, is_dynamic_mask=True)

  fwd = info(jnp.where(grid == EMPTY, 0, cols), blocks, nk)
  dkv = info(jnp.where(grid == EMPTY, 0, local_rows), blocks.swapaxes(-1, -2), rows)
  return fwd, fwd, dkv, None


def _small_type(top: int):
  for t in (np.int8, np.int16):
    if top <= np.iinfo(t).max:
      return t
  return np.int32

