"""What the Mosaic GPU forward and backward kernels share: their config, inputs and tile code.

`maskc.kernels.mosaic_gpu.forward` (the forward kernel and the backend's entry points) and
`maskc.kernels.mosaic_gpu.backward` (the opt-in dq and dk/dv kernels) both import from
here, so neither imports the other's kernels: the tile geometry constants, `Config` and
`Inputs`, and the code every kernel runs per tile:

- `tile_mask`: a score tile's allowed pairs in registers (WGMMA layout), in either
  orientation (`Tile.q_axis`: 0 for `q kᵀ`, 1 for the dk/dv kernel's `k qᵀ`), FULL tiles
  masking only keys past `kv_len`, PARTIAL ones evaluating the compiled predicate with
  every kind of read; `side_reads` loads the per-token reads of the side a walk keeps
  fixed once;
- `stream`: the memory warpgroup's loop, TMA-copying each step's tiles into rotating
  shared-memory slots behind the compute warpgroups' release barriers;
- `softcap`: raw scores to base-2 logits, and the cap's `tanh` for the chain rule.

Pallas Mosaic GPU is imported only inside these functions (`compat.mosaic_gpu()`), when a
kernel is traced.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from maskc.compiled import predicate as _predicate
from maskc.compiled.predicate import Predicate
from maskc.kernels import compat
from maskc.language.errors import MaskValueError

BLOCK_Q = 128                 # two compute warpgroups of 64 rows
WG_ROWS = 64                  # rows of one wgmma, one compute warpgroup
BLOCK_KV = (64, 128)
MAX_STAGES = 4
SMEM_BYTES = 227 * 1024       # an H100's shared memory per block
LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything static about one launch of the kernel (hashable).

  Attributes:
    pred: the mask's compiled predicate (PARTIAL tiles evaluate it).
    block_kv: keys per tile (64 or 128); `block_q` is always 128.
    q_len, kv_len: the unpadded lengths.
    n_q_tiles, n_kv_tiles: tiles per row and column of the map.
    groups: query heads per key head.
    head_dim: q, k and v's head dim after padding to a multiple of 64.
    dtype: the inputs' dtype name ("bfloat16" or "float16").
    scale, cap: logit scale and soft cap (None: none).
    has_sinks: sink logits start each row's softmax.
    batched_meta: the tile lists and reads have a batch axis.
    stages: shared-memory slots for key/value tiles (at least 2).
    schedule_barrier: the two compute warpgroups alternate on the tensor cores (FA3).
  """
  pred: Predicate
  block_kv: int
  q_len: int
  kv_len: int
  n_q_tiles: int
  n_kv_tiles: int
  groups: int
  head_dim: int
  dtype: str
  scale: float
  cap: float | None
  has_sinks: bool
  batched_meta: bool
  stages: int
  schedule_barrier: bool = True

  def __post_init__(self):
    if self.block_kv not in BLOCK_KV:
      raise MaskValueError(f"the mosaic_gpu kernel takes block_kv in {BLOCK_KV}, got "
                           f"{self.block_kv=}")
    if self.head_dim % 64 or not 64 <= self.head_dim <= 256:
      raise MaskValueError(f"head_dim must be a multiple of 64 in [64, 256], got "
                           f"{self.head_dim=}")
    if self.stages < 2:
      raise MaskValueError(f"stages must be at least 2, got {self.stages=}")


class Inputs(NamedTuple):
  """The kernel's metadata and read arrays, for one mask.

  Attributes:
    meta: `[B', n_q_tiles, 2 + W]` int32: per q tile the count of FULL key tiles, the
      count of FULL and PARTIAL ones together, then their indices, FULL first.
    scal: `[B', Ns + 1]` int32: scalar reads, then the q offset.
    qtok: `[B', Nq, Lq_pad]`, ktok: `[B', Nk, Lkv_pad]` int32: per-token reads.
    pair: `[B', Np, Lq_pad, Lkv_pad]` int32: pairwise reads.
    tile: `[B', Nt · nq · nk]` int32: tile-constant pairwise reads.
  A kind the predicate does not read is a small block of zeros the kernel never loads.
  """
  meta: Any
  scal: Any
  qtok: Any
  ktok: Any
  pair: Any
  tile: Any


def pad_to(x: jax.Array, rows: int, dim: int, dtype: Any) -> jax.Array:
  """`x [B, L, H, D]` in `dtype`, zero-padded to `rows` positions and head dim `dim`."""
  return jnp.pad(x.astype(dtype), ((0, 0), (0, rows - x.shape[1]), (0, 0),
                                   (0, dim - x.shape[3])))


# ----------------------------------------------------------------------------- tile code


class ReadRefs(NamedTuple):
  """The read refs a kernel got (`Inputs` less the walk) and the batch row they are read at.

  `pair` is `[B', Np, Lq_pad, Lkv_pad]` for q-major tiles; the dk/dv kernel, whose tiles are
  key-major, gets its transpose `[B', Np, Lkv_pad, Lq_pad]`.
  """
  scal: Any
  qtok: Any
  ktok: Any
  pair: Any
  tile: Any
  mb: Any


class Tile(NamedTuple):
  """Where a `[rows, cols]` score tile sits in the padded attention matrix.

  Attributes:
    shape: the tile's shape in registers (WGMMA layout).
    q_axis: the tile's query axis: 0 in the forward and dq kernels (`q kᵀ`), 1 in the
      dk/dv kernel (`k qᵀ`); the other axis is the keys'.
    q_start, k_start: the first query row and key of the tile (padded coordinates, before
      the q offset).
    qi, kj: the map tile it lies in (for tile-constant reads).
  """
  shape: tuple[int, int]
  q_axis: int
  q_start: Any
  k_start: Any
  qi: Any
  kj: Any


def load_vec(ref: Any, axis: int) -> jax.Array:
  """A 1-D view in global memory, in registers as a vector along `axis` of a WGMMA tile."""
  plgpu = compat.mosaic_gpu()
  return compat.mosaic_load(ref, plgpu.Layout.WGMMA.reduce(1 - axis))


def side_reads(refs: ReadRefs, side: str, count: int, start: Any, length: int,
               axis: int) -> list[jax.Array]:
  """The `count` per-token reads of one side ("q" or "k") at padded positions
  `[start, start + length)`, as vectors along `axis`: for the side a walk keeps fixed, loaded
  once (a few registers a thread) and broadcast where a PARTIAL tile reads them."""
  ref = refs.qtok if side == "q" else refs.ktok
  return [load_vec(ref.at[refs.mb, r, pl.ds(start, length)], axis) for r in range(count)]


def tile_mask(cfg: Config, refs: ReadRefs, tile: Tile, partial: bool, *,
              q_vecs: list[jax.Array] | None = None,
              k_vecs: list[jax.Array] | None = None) -> jax.Array | None:
  """The allowed pairs of a score tile (bool, WGMMA layout), or None where none is masked.

  A FULL tile masks only keys past `kv_len` (in a ragged last key tile). A PARTIAL tile
  evaluates the compiled predicate with every kind of read: per-token q and k reads as
  vectors broadcast along the other axis (`q_vecs`/`k_vecs` when the caller loaded them
  once, `side_reads`, else loaded here), pairwise reads as a tile, tile-constant pairwise
  reads and scalars as scalars. The q offset rides at the end of the scalars.
  """
  plgpu = compat.mosaic_gpu()
  qa, ka = tile.q_axis, 1 - tile.q_axis
  nq, nk = tile.shape[qa], tile.shape[ka]

  def iota(axis: int):
    return plgpu.broadcasted_iota(jnp.int32, tile.shape, axis, layout=plgpu.Layout.WGMMA)

  def full(x):
    return lax.broadcast_in_dim(x, tile.shape, ())

  kpos = iota(ka) + tile.k_start
  in_range = kpos < cfg.kv_len
  if not partial:
    return in_range if cfg.kv_len % cfg.block_kv else None
  pred = cfg.pred
  qpos = iota(qa) + (tile.q_start + refs.scal[refs.mb, len(pred.scalars)])

  def fetch(kind: str, slot: int):
    if kind == "q_read":
      vec = (q_vecs[slot] if q_vecs is not None else
             load_vec(refs.qtok.at[refs.mb, slot, pl.ds(tile.q_start, nq)], qa))
      return lax.broadcast_in_dim(vec, tile.shape, [qa])
    if kind == "k_read":
      vec = (k_vecs[slot] if k_vecs is not None else
             load_vec(refs.ktok.at[refs.mb, slot, pl.ds(tile.k_start, nk)], ka))
      return lax.broadcast_in_dim(vec, tile.shape, [ka])
    if kind == "pair":
      rows, cols = ((tile.q_start, nq), (tile.k_start, nk))[::1 if qa == 0 else -1]
      view = refs.pair.at[refs.mb, slot, pl.ds(*rows), pl.ds(*cols)]
      return compat.mosaic_load(view, plgpu.Layout.WGMMA)
    if kind == "tile_pair":
      return full(refs.tile[refs.mb, (slot * cfg.n_q_tiles + tile.qi) * cfg.n_kv_tiles
                            + tile.kj])
    return full(refs.scal[refs.mb, slot])
  return _predicate.evaluate(pred, jnp, qpos, kpos, fetch) & in_range


class Stream(NamedTuple):
  """One operand the memory warpgroup streams: step `t`'s view in global memory
  (`source(t)`), the shared-memory slots, and per slot the barriers saying it is loaded and
  that every compute warpgroup is done with it."""
  source: Callable[[Any], Any]
  slots: Any
  loaded: Any
  consumed: Any


def stream(n_steps: Any, stages: int, streams: Sequence[Stream]) -> None:
  """The memory warpgroup's loop: step `t` of each stream is TMA-copied into slot
  `t % stages` as soon as the compute warpgroups released the slot's step `t - stages`, so
  loads run up to `stages` steps ahead of the compute."""
  plgpu = compat.mosaic_gpu()

  def load(t, carry):
    slot = lax.rem(t, jnp.int32(stages))
    for st in streams:
      @pl.when(t >= stages)
      def _():
        plgpu.barrier_wait(st.consumed.at[slot])  # noqa: B023  (called at once)
      plgpu.copy_gmem_to_smem(st.source(t), st.slots.at[slot], st.loaded.at[slot])
    return carry

  lax.fori_loop(0, n_steps, load, None)


def key_tiles(walk_: tuple, ref: Any, batch: Any, kv_head: Any, bk: int) -> Callable[[Any], Any]:
  """The source of a key-side stream walking a q tile's map row: step `t` is key tile
  `meta[mb, qi, 2 + t]` of `ref` (k or v) for `walk_ = (meta_ref, mb, qi)`."""
  meta_ref, mb, qi = walk_
  return lambda t: ref.at[batch, pl.ds(meta_ref[mb, qi, 2 + t] * bk, bk), kv_head]


def stream_row_keys(n_steps: Any, stages: int, walk_: tuple, k_ref: Any, v_ref: Any,
                    batch: Any, head: Any, groups: int, bk: int, k_slots: tuple,
                    v_slots: tuple) -> None:
  """The memory warpgroup of a kernel that walks a q tile's map row (the forward, dq):
  streams its key and value tiles (`key_tiles`) of query head `head`'s key head into
  `k_slots` / `v_slots`, each `(smem, loaded, consumed)`."""
  kv_head = lax.div(head, jnp.int32(groups))
  stream(n_steps, stages, [Stream(key_tiles(walk_, k_ref, batch, kv_head, bk), *k_slots),
                           Stream(key_tiles(walk_, v_ref, batch, kv_head, bk), *v_slots)])


def softcap(s: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array | None]:
  """Raw scores `q kᵀ` to the base-2 logits (scaled, soft-capped, times `log2 e`), and the
  cap's `tanh` (None without a cap), which the backward's chain rule needs."""
  if cfg.cap is None:
    return s * (cfg.scale * LOG2E), None
  t = jnp.tanh(s * (cfg.scale / cfg.cap))
  return t * (cfg.cap * LOG2E), t
