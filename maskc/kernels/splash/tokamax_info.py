"""Tokamax splash `MaskInfo` arrays from a BlockMap: the compacted list of active tiles.

tokamax (MaxText's kernels) carries its own copy of splash attention, whose
kernel walks a *compacted* schedule: a flat list of the tiles it visits, in
row-major order, instead of JAX splash's dense `[H, nq, nk]` grid with
"next tile" indices. Its `process_mask` builds that list by slicing every tile
of a 2-D mask; here it is read off the BlockMap's runs, and only the PARTIAL
tiles are evaluated (to store their blocks, deduplicated), as for JAX's splash
(`maskc.kernels.splash.jax_info`).

The arrays are NumPy (static maps) or jax arrays (traced maps) in a
`CompactMaskInfo`, whose fields are tokamax's `MaskInfo` fields in the same
order; nothing here imports tokamax (it is optional and needs Python 3.12):
`maskc.kernels.splash.tokamax_kernel` wraps them in tokamax's own type.

One layout difference from `process_mask`, on purpose: in the forward list a q
tile with no active tile at all gets one step `(i, 0)` with `block_mask = 0`
(tokamax's dkv list does the same for empty key tiles). The kernel then
initializes and writes that tile's output (zeros with maskc's sink logits);
`process_mask` leaves such tiles out, and the kernel never writes their rows.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from maskc.compiled import predicate as _predicate
from maskc.compiled.blockmap import BlockMap
from maskc.compiled.tiles import FULL, PARTIAL, grid_from_runs
from maskc.kernels.splash.jax_info import (
  MaskFunction,
  check_shards,
  numbered_tiles,
  small,
  tiles_of,
)
from maskc.language.errors import BackendError, MaskValueError

_EVAL_CHUNK = 1 << 22  # mask elements evaluated at once


class CompactMaskInfo(NamedTuple):
  """Tokamax splash's `MaskInfo` fields, for one 2-D mask (tokamax has no head axis).

  Forward: the kernel's grid is `(heads, num_active_blocks[shard])`; step `t`
  visits q tile `active_rows[t]` and key tile `active_cols[t]`. dkv: the same
  with rows and columns swapped (key tile, q tile), and the blocks transposed;
  a dkv info without `active_rows` is tokamax's full grid instead (every
  `(key tile, q tile)` pair, row-major, `block_mask` and `mask_next` per pair).
  With `q_seq_shards` shards, each array is the concatenation of the shards'
  own lists, each padded with -1 to the longest, and indices are relative to
  the shard.

  Attributes:
    mask_next: `int[T]`: per step, the index in `partial_mask_blocks` of the
      first PARTIAL step at or after it (the shard's first after its last; -1
      in a shard without one). None when no block is stored.
    active_rows: `int[T]`: per step, its q tile (key tile for dkv); -1 in padding.
    active_cols: `int[T]`: per step, its key tile (q tile for dkv).
    block_mask: `int[T]`: 2 FULL, 1 PARTIAL, 0 a step that only initializes and
      writes its row's output; -1 in padding.
    num_active_blocks: `int32[q_seq_shards]`: the valid steps of each shard.
    partial_mask_blocks: `int8[n, block_q, block_kv]` (transposed for dkv): the
      distinct PARTIAL tiles, numbered as first met in row-major order. None
      when there are none, or when `q_sequence` is set.
    q_sequence: `int32[q_len]`: the row indices the kernel's `mask_function`
      reads, when the mask is evaluated in the kernel; else None.

  Every field is None when every tile is FULL. Rebuilding
  the forward tile states of one shard:

      grid = np.zeros((n_q_tiles, n_kv_tiles), int)
      for t in range(num_active_blocks[0]):
        grid[active_rows[t], active_cols[t]] = block_mask[t]
  """
  mask_next: Any
  active_rows: Any
  active_cols: Any
  block_mask: Any
  num_active_blocks: Any
  partial_mask_blocks: Any
  q_sequence: Any


def tokamax_mask_info(bm: BlockMap, *, mask: int = 0, q_seq_shards: int = 1,
                      dkv_active: bool | None = None, downcast_smem_data: bool = True,
                      use_mask_function: bool | None = None
                      ) -> tuple[CompactMaskInfo, CompactMaskInfo, MaskFunction | None]:
  """`(fwd, dkv, mask_function)` in tokamax splash's layout, for one mask of a BlockMap.

  Args:
    bm: a compiled `BlockMap` without a batch axis whose lengths are multiples of
      its tiles.
    mask: which distinct mask of a per-head map (`bm.masks[mask]`); tokamax
      takes one 2-D mask per kernel.
    q_seq_shards: the mesh's shards of the q sequence (each must hold whole tiles).
    dkv_active: the dkv info as a compacted list (tokamax's layout when its
      config has `dq_reduction_steps=3`) rather than the full grid (its
      default). Default: compacted for traced maps (tokamax's dynamic mode
      takes only that), full grid for static ones.
    downcast_smem_data: store the index arrays in the smallest integer type
      holding them (int8/int16/int32), as tokamax does for TPU scalar memory.
    use_mask_function: evaluate PARTIAL tiles in the kernel (`q_sequence` and
      `mask_function`) instead of loading stored blocks. Default: a static map
      whose mask reads no operand arrays.

  Returns:
    The forward and dkv `CompactMaskInfo`s and the mask function (or None).
    Static maps give NumPy arrays equal to tokamax's `process_mask` on the same
    mask (partial blocks in the same order), except for q tiles without any
    active tile (see the module docstring); traced maps give jax arrays laid out
    as tokamax's `process_dynamic_mask`, every tile's block stored.

  Raises:
    MaskValueError: lengths off the tiles, shards that do not divide the q
      tiles, a mask index out of range, or a mask function asked for a mask
      that reads arrays.
    BackendError: the map has a batch axis.

  >>> import maskc
  >>> bm = maskc.compile("sliding(200)", 512, block_q=128, block_kv=128)
  >>> fwd, dkv, fn = tokamax_mask_info(bm)
  >>> fwd.active_rows.tolist(), fwd.active_cols.tolist(), fwd.block_mask.tolist()
  ([0, 1, 1, 2, 2, 2, 3, 3, 3], [0, 0, 1, 0, 1, 2, 1, 2, 3], [1, 1, 1, 1, 1, 1, 1, 1, 1])
  """
  if bm.q_len % bm.block_q or bm.kv_len % bm.block_kv:
    raise MaskValueError(
        f"tokamax's splash needs lengths that are multiples of the tiles, got q_len={bm.q_len}, "
        f"block_q={bm.block_q}, kv_len={bm.kv_len}, block_kv={bm.block_kv}",
        hint="Pad the sequences to whole tiles (the splash backends do), or pick tiles that "
             "divide them.")
  if bm.batch is not None:
    raise BackendError(
        f"tokamax's splash MaskInfo has no batch axis, but this mask's operands have batch "
        f"size {bm.batch}",
        hint="Use backend='xla' or 'flash'; the splash backends themselves turn `document(s)` "
             "with batched ids into SegmentIds.")
  if not 0 <= mask < len(bm.predicates):
    raise MaskValueError(f"the map has {len(bm.predicates)} distinct masks, got {mask=}")
  check_shards(bm, 1, q_seq_shards)
  if not bm.is_static:
    if q_seq_shards != 1:
      raise MaskValueError(f"a traced map gives tokamax's dynamic MaskInfo, which maskc lays out "
                           f"for one q shard, got {q_seq_shards=}",
                           hint="Compile the map outside jit (static operands) to shard it.")
    if use_mask_function:
      raise MaskValueError("a traced map stores every tile; it has no in-kernel mask function")
    return _dynamic_info(bm, mask, downcast_smem_data, dkv_active is not False)
  pred = bm.predicates[mask]
  if use_mask_function is None:
    use_mask_function = not pred.reads_arrays
  if use_mask_function and pred.reads_arrays:
    raise MaskValueError("a mask function evaluates masks of positions and scalars; "
                         f"`{pred}` reads operand arrays", hint="Pass use_mask_function=False.")
  i, j, st = tiles_of(bm.rows, mask)
  fn = None
  q_sequence = None
  if use_mask_function:
    scalars = tuple(int(np.asarray(bm.operands[n]).reshape(-1)[0]) for n in pred.scalars)
    fn = MaskFunction(pred, int(bm.q_offset), scalars)
    q_sequence = np.arange(bm.q_len, dtype=np.int32)
  if i.size == bm.n_q_tiles * bm.n_kv_tiles and (st == FULL).all():
    # Nothing to mask. (`process_mask` keeps a computable mask's `q_sequence` here without
    # its mask function, which the kernel's masking asserts against.)
    none = CompactMaskInfo(None, None, None, None, None, None, None)
    return none, none, None
  blocks, pid = (None, None) if use_mask_function else _partial_blocks(bm, mask, i, j, st)
  if use_mask_function:                     # mask_next still needs ids: number them apart
    pid = np.zeros(int((st == PARTIAL).sum()), np.int64)
  fwd = _static_info(i, j, st, pid, bm.n_q_tiles, bm.n_kv_tiles, q_seq_shards, dkv=False,
                     active=True)
  dkv = _static_info(i, j, st, pid, bm.n_q_tiles, bm.n_kv_tiles, q_seq_shards, dkv=True,
                     active=not bm.is_static if dkv_active is None else dkv_active)
  stored = blocks is not None

  def finish(info: CompactMaskInfo, part) -> CompactMaskInfo:
    if downcast_smem_data:
      info = info._replace(**{f: small(getattr(info, f)) for f in
                              ("mask_next", "active_rows", "active_cols", "block_mask")})
    return info._replace(mask_next=info.mask_next if stored else None,
                         partial_mask_blocks=part if stored else None, q_sequence=q_sequence)

  return (finish(fwd, blocks),
          finish(dkv, None if blocks is None else np.swapaxes(blocks, -1, -2)), fn)


def _partial_blocks(bm, u: int, i, j, st) -> tuple[np.ndarray | None, np.ndarray]:
  """The distinct PARTIAL tiles of mask u (`int8[n, bq, bk]`) and each PARTIAL tile's id.

  Tiles come row-major, so ids are tokamax's: a block numbered when first met.
  """
  sel = st == PARTIAL
  seen: dict[bytes, int] = {}
  blocks: list[np.ndarray] = []
  ids = numbered_tiles(bm, bm.predicates[u], bm.read_values(u), i[sel], j[sel], seen, blocks)
  return (np.stack(blocks).astype(np.int8) if blocks else None), ids


def _static_info(i, j, st, pid, nq: int, nk: int, shards: int, *, dkv: bool,
                 active: bool) -> CompactMaskInfo:
  """One direction's lists (or full grid), per q shard, concatenated (see `CompactMaskInfo`)."""
  rows = nq // shards
  partial = st == PARTIAL
  parts: list[tuple[Any, Any, np.ndarray, np.ndarray]] = []
  for s in range(shards):
    sel = (i >= s * rows) & (i < (s + 1) * rows)
    si, sj, sst = i[sel] - s * rows, j[sel], st[sel]
    psel = partial[sel]
    spid = pid[sel[partial]]
    if dkv:          # tokamax walks the transposed shard: key tile, then q tile
      line, other, n_lines, n_other = sj, si, nk, rows
    else:
      line, other, n_lines, n_other = si, sj, rows, nk
    key = line.astype(np.int64) * n_other + other
    pkey = key[psel]
    if active:
      # Lines with no active tile get one step at column 0 that only writes their output.
      empty = np.setdiff1d(np.arange(n_lines), line)
      key = np.concatenate([key, empty.astype(np.int64) * n_other])
      state = np.concatenate([sst, np.zeros(empty.size, sst.dtype)])
      order = np.argsort(key, kind="stable")
      key, state = key[order], state[order]
      parts.append((key // n_other, key % n_other, state, _next_partial(key, pkey, spid)))
    else:
      full = np.zeros(n_lines * n_other, np.int32)
      full[key] = sst
      parts.append((None, None, full, _next_partial(np.arange(full.size), pkey, spid)))
  if not active:
    return CompactMaskInfo(mask_next=np.concatenate([p[3] for p in parts]).astype(np.int32),
                           active_rows=None, active_cols=None,
                           block_mask=np.concatenate([p[2] for p in parts]).astype(np.int32),
                           num_active_blocks=None, partial_mask_blocks=None, q_sequence=None)
  size = max(p[0].size for p in parts)

  def cat(k: int) -> np.ndarray:
    return np.concatenate([np.pad(p[k].astype(np.int32), (0, size - p[k].size),
                                  constant_values=-1) for p in parts])

  return CompactMaskInfo(mask_next=cat(3), active_rows=cat(0), active_cols=cat(1),
                         block_mask=cat(2),
                         num_active_blocks=np.array([p[0].size for p in parts], np.int32),
                         partial_mask_blocks=None, q_sequence=None)


def _next_partial(keys: np.ndarray, pkeys: np.ndarray, pids: np.ndarray) -> np.ndarray:
  """Per key, the block id of the first PARTIAL key at or after it (wrapping); -1s if none."""
  if not pkeys.size:
    return np.full(keys.shape, -1, np.int32)
  order = np.argsort(pkeys, kind="stable")             # the walk's order (dkv's is transposed)
  pkeys, pids = pkeys[order], pids[order]
  pos = np.searchsorted(pkeys, keys, side="left")
  return pids[np.where(pos >= pkeys.size, 0, pos)].astype(np.int32)


# ----------------------------------------------------------------------------- traced


def _dynamic_info(bm, u: int, downcast: bool, dkv_active: bool):
  """tokamax's dynamic layout from a traced map: fixed-size lists, every tile's block stored.

  As `process_dynamic_mask` lays it out (lists of `nq * nk` slots, the first
  `num_active_blocks` valid; block `i * nk + j` is tile `(i, j)`), plus the
  forward's write-only steps for q tiles without an active tile.
  """
  import jax.numpy as jnp

  if not dkv_active:
    raise MaskValueError("a traced map's dkv info is tokamax's compacted list (its dynamic "
                         "mode), not the full grid", hint="Leave dkv_active unset.")
  bq, bk, nq, nk = bm.block_q, bm.block_kv, bm.n_q_tiles, bm.n_kv_tiles
  grid = grid_from_runs(jnp, bm.rows, nk)[0, u].astype(jnp.int32)      # [nq, nk]
  q = jnp.arange(bm.q_len, dtype=jnp.int32)[None, :, None] + bm.q_offset
  k = jnp.arange(bm.kv_len, dtype=jnp.int32)[None, None, :]
  values = bm.read_values(u, dtype=jnp.int32)
  fetch = _predicate.dense_fetch(values, jnp, block_q=bq, block_kv=bk, q_len=bm.q_len,
                                 kv_len=bm.kv_len)
  dense = jnp.broadcast_to(_predicate.evaluate(bm.predicates[u], jnp, q, k, fetch)[0],
                           (bm.q_len, bm.kv_len))
  blocks = dense.reshape(nq, bq, nk, bk).swapaxes(1, 2).astype(jnp.int8)   # [nq, nk, bq, bk]
  ids = jnp.arange(nq * nk, dtype=jnp.int32).reshape(nq, nk)

  def info(g, block_ids, part):
    n_lines, n_other = g.shape
    act = g > 0
    act = act | (~act.any(axis=1)[:, None] & (jnp.arange(n_other) == 0)[None, :])
    num = act.reshape(-1).sum(dtype=jnp.int32, keepdims=True)
    where = jnp.argwhere(act, size=act.size, fill_value=-1)
    r, c = where[:, 0].astype(jnp.int32), where[:, 1].astype(jnp.int32)
    valid = jnp.arange(act.size) < num[0]
    state = jnp.where(valid, g.at[r, c].get(mode="fill", fill_value=0), 0)
    nxt = jnp.where(state == PARTIAL, block_ids.at[r, c].get(mode="fill", fill_value=0), 0)
    if downcast:
      state = state.astype(jnp.int8)
      nxt = nxt.astype(_small_type(nq * nk))
    return CompactMaskInfo(mask_next=nxt, active_rows=r, active_cols=c, block_mask=state,
                           num_active_blocks=num,
                           partial_mask_blocks=part.reshape(nq * nk, *part.shape[-2:]),
                           q_sequence=None)

  fwd = info(grid, ids, blocks)
  dkv = info(grid.T, ids.T, blocks.swapaxes(-1, -2))
  return fwd, dkv, None


def _small_type(top: int):
  for t in (np.int8, np.int16):
    if top <= np.iinfo(t).max:
      return t
  return np.int32
