"""Block-sparse flash attention in Pallas (Triton lowering on GPU; `interpret=True` anywhere).

Forward: one program per (batch, head, q tile). It walks the q tile's FULL key
tiles, then its PARTIAL ones, from index lists derived from the BlockMap's
compact runs, with an online softmax; EMPTY tiles are never loaded. FULL tiles do
no mask work (keys past `kv_len` aside, in a ragged last tile); PARTIAL tiles
evaluate the compiled predicate in the kernel (`maskc.compiled.predicate` with jax.numpy)
on position iotas and the tile's slices of the operands.

Backward (custom_vjp), FlashAttention-2 style in two passes: dq per q tile over
the same lists, and dk/dv per key tile over the transposed lists (the BlockMap's
`cols` runs), per query head and summed over GQA groups outside the kernel.

Operands in the kernel: the predicate's per-token reads (`seg[q]`, `runs(img)[k]`,
`doc[q // 2]`) are gathered once per position outside the kernel and sliced per
tile inside; scalars are loaded as scalars. Pairwise reads (`anc[q, k]`, tree
masks) are gathered once into `[B', Np, Lq_pad, Lkv_pad]` and the kernel loads the
tile's `[block_q, block_kv]` slice (rows of its q tile, columns of its key tile);
tile-constant pairwise reads (`sel[q // 64, k // 64]` with 64-aligned tiles,
MoBA-style block selection) are one value per tile, loaded as a scalar. Every
load is a power-of-two block (the tiles), as Triton requires; the arrays a block
slices from may have any shape.

Decoding (`maskc.kernels.flash.decode`): a map of one q tile may have any `block_q`
(one query row, or a handful); the kernel pads its tile to a power of two >= 16 rows, the
least a Triton dot takes. When the launch has few programs and its rows many key tiles,
each q tile's key tiles are split into `S` shares, one program per `(b, h, q tile,
split)`, and the shares' outputs are merged by their log-sum-exps outside the kernel
(flash-decoding); `S = 1` is the single walk above. The backward pass is the same for both.

Rows with no allowed key return zeros; their log-sum-exp is +inf, so the backward
pass gives them zero weight and zero gradients.

`run_with_lse` also returns each row's log-sum-exp (for combining partial
attentions, as ring attention does), differentiable: a cotangent `dlse` on it
enters the backward pass as `ds = p · (dp − (delta − dlse))`, since
`∂ lse_i / ∂ s_ij = p_ij`; both backward kernels take the adjusted `delta`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from maskc.compiled import predicate as _predicate
from maskc.compiled.predicate import Predicate
from maskc.kernels import common, compat
from maskc.kernels.flash import decode as flash_decode
from maskc.kernels.platform import platform
from maskc.kernels.xla import NEG_LSE
from maskc.language.errors import BackendError, MaskValueError

BLOCK_SIZES = (64, 64)
# The GPU cost model's rates on its tile work (`maskc.kernels.api.GPU_COSTS_MEASURED`):
# forward TFLOP/s, backward TFLOP/s, fixed ms a call.
GPU_COST = (278.0, 311.0, 0.05)
BACKWARD_ENGINE = None
installed = common.installed
# Every mask runs (tiles Triton cannot load fail at run time, where `auto` falls back).
refusal = common.no_refusal
length_refusal = common.any_length
forward_work = common.tile_work

# JAX 0.11+ deprecates the Triton backend; maskc knows (see `compat`).
compat.quiet_triton_deprecation()


def default_blocks(q_len: int, kv_len: int) -> tuple[int, int]:
  """Tile sizes: 64 × 64, smaller powers of two (at least 16) for short sequences."""
  return (common.cap_block(BLOCK_SIZES[0], q_len, 16),
          common.cap_block(BLOCK_SIZES[1], kv_len, 16))


# ----------------------------------------------------------------------------- mask support


@dataclasses.dataclass(frozen=True)
class _Reads:
  """A tile's read values, as loaders by slot (each returns a pre-sliced value)."""
  qtok: Any        # slot -> [bq]
  ktok: Any        # slot -> [bk]
  scal: Any        # slot -> scalar
  pair: Any        # slot -> [bq, bk]
  tile: Any        # slot -> scalar (the tile's value)


def _tile_mask(pred: Predicate, qpos, kpos, reads: _Reads):
  """The predicate on a tile: `qpos [bq, 1]`, `kpos [1, bk]`; reads come pre-sliced."""
  def fetch(kind: str, slot: int):
    if kind == "q_read":
      return reads.qtok(slot)[:, None]
    if kind == "k_read":
      return reads.ktok(slot)[None, :]
    if kind == "pair":
      return reads.pair(slot)
    if kind == "tile_pair":
      return reads.tile(slot)
    return reads.scal(slot)
  return _predicate.evaluate(pred, jnp, qpos, kpos, fetch)


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class _Config:
  """Everything static about one kernel launch (hashable: custom_vjp's nondiff argument)."""
  pred: Predicate
  block_q: int
  block_kv: int
  q_len: int
  kv_len: int
  n_q_tiles: int
  n_kv_tiles: int
  groups: int                    # query heads per key head
  scale: float
  cap: float | None
  has_sinks: bool
  batched_meta: bool             # metadata/operands have a batch axis
  fwd_width: tuple[int, int]     # (max FULL, max PARTIAL) key tiles per q tile
  bwd_width: tuple[int, int]     # (max FULL, max PARTIAL) q tiles per key tile
  interpret: bool
  splits: int = 1                # forward programs per q tile (flash-decoding; 1: none)


def _meta(bm, u: int, transpose: bool):
  """`[B', n_lines, 2 + Mf + Mp]` int32: counts of FULL and PARTIAL tiles, then both lists."""
  fi, fc, _ = common.tile_lists(bm, u, common.FULL, transpose=transpose)
  pi, pc, _ = common.tile_lists(bm, u, common.PARTIAL, transpose=transpose)
  xp = np if isinstance(fi, np.ndarray) and isinstance(pi, np.ndarray) else jnp
  meta = xp.concatenate([fc[..., None], pc[..., None], fi, pi], axis=-1).astype(xp.int32)
  return meta, (fi.shape[-1], pi.shape[-1])


# ----------------------------------------------------------------------------- kernels


def _scores(q, k, cfg: _Config):
  s = compat.dot(q, k, trans_b=True, precision=_precision(q)) * cfg.scale
  t = None
  if cfg.cap is not None:
    t = jnp.tanh(s / cfg.cap)
    s = cfg.cap * t
  return s, t


def _precision(x):
  return lax.Precision.HIGHEST if x.dtype == jnp.float32 else None


def _allowed(cfg: _Config, partial: bool, i, j, reads: _Reads, qoff):
  """The tile's mask (None when nothing needs masking)."""
  kpos = j * cfg.block_kv + lax.broadcasted_iota(jnp.int32, (1, cfg.block_kv), 1)
  in_range = kpos < cfg.kv_len
  if not partial:
    return in_range if cfg.kv_len % cfg.block_kv else None
  qpos = i * cfg.block_q + lax.broadcasted_iota(jnp.int32, (cfg.block_q, 1), 0) + qoff
  return _tile_mask(cfg.pred, qpos, kpos, reads) & in_range


def _tile_value(cfg: _Config, tile_ref, i, j):
  """Loader of a tile-constant pairwise read of tile `(i, j)` from its flat `[Nt·nq·nk]` row."""
  return lambda r: tile_ref[(r * cfg.n_q_tiles + i) * cfg.n_kv_tiles + j]


def _fwd_kernel(meta_ref, scal_ref, qtok_ref, ktok_ref, pair_ref, tile_ref, sink_ref, q_ref,
                k_ref, v_ref, o_ref, lse_ref, *, cfg: _Config):
  h, i = pl.program_id(1), pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_kv
  mf, _ = cfg.fwd_width
  q = q_ref[...]
  ns = len(cfg.pred.scalars)
  qoff = scal_ref[ns]

  def scal(r):
    return scal_ref[r]

  def qtok(r):
    return qtok_ref[r, :]

  sinks = cfg.has_sinks and cfg.splits == 1     # split: the combine adds them, once
  if sinks:
    sink = sink_ref[h]
    m0 = jnp.full((bq,), sink, jnp.float32)
    l0 = jnp.ones((bq,), jnp.float32)
  else:
    m0 = jnp.full((bq,), common.NEG, jnp.float32)
    l0 = jnp.zeros((bq,), jnp.float32)
  acc0 = jnp.zeros((bq, v_ref.shape[-1]), jnp.float32)

  def visit(partial: bool, base: int):
    def body(t, carry):
      m, l, acc = carry
      j = meta_ref[base + t]
      start = pl.multiple_of(j * bk, bk)
      k = k_ref[pl.ds(start, bk), :]
      v = v_ref[pl.ds(start, bk), :]
      s, _ = _scores(q, k, cfg)
      reads = _Reads(qtok=qtok, ktok=lambda r: ktok_ref[r, pl.ds(start, bk)], scal=scal,
                     pair=lambda r: pair_ref[r, :, pl.ds(start, bk)],
                     tile=_tile_value(cfg, tile_ref, i, j))
      allowed = _allowed(cfg, partial, i, j, reads, qoff)
      if allowed is not None:
        s = jnp.where(allowed, s, common.NEG)
      m_new = jnp.maximum(m, s.max(axis=1))
      alpha = jnp.exp(m - m_new)
      p = jnp.exp(s - m_new[:, None])
      l = alpha * l + p.sum(axis=1)
      acc = alpha[:, None] * acc + compat.dot(p.astype(v.dtype), v, precision=_precision(v))
      return m_new, l, acc
    return body

  if cfg.splits == 1:
    carry = lax.fori_loop(0, meta_ref[0], visit(False, 2), (m0, l0, acc0))
    m, l, acc = lax.fori_loop(0, meta_ref[1], visit(True, 2 + mf), carry)
  else:
    # This split's share [lo, hi) of the tile's FULL-then-PARTIAL list, equal shares of
    # the count the list holds (a traced map's lists are padded past it).
    nf, n = meta_ref[0], meta_ref[0] + meta_ref[1]
    per = (n + cfg.splits - 1) // cfg.splits
    lo = pl.program_id(3) * per
    hi = jnp.minimum(lo + per, n)
    carry = lax.fori_loop(jnp.minimum(lo, nf), jnp.minimum(hi, nf), visit(False, 2),
                          (m0, l0, acc0))
    m, l, acc = lax.fori_loop(jnp.maximum(lo, nf) - nf, jnp.maximum(hi, nf) - nf,
                              visit(True, 2 + mf), carry)
  if sinks:
    o = acc / l[:, None]
    lse = m + jnp.log(l)
  else:
    empty = m <= common.NEG / 2
    o = jnp.where(empty[:, None], 0.0, acc / jnp.where(empty, 1.0, l)[:, None])
    lse = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
  o_ref[...] = o.astype(o_ref.dtype)
  lse_ref[...] = lse


def _dq_kernel(meta_ref, scal_ref, qtok_ref, ktok_ref, pair_ref, tile_ref, q_ref, k_ref, v_ref,
               do_ref, lse_ref, delta_ref, dq_ref, *, cfg: _Config):
  i = pl.program_id(2)
  bk = cfg.block_kv
  mf, _ = cfg.fwd_width
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  ns = len(cfg.pred.scalars)
  qoff = scal_ref[ns]

  def scal(r):
    return scal_ref[r]

  def qtok(r):
    return qtok_ref[r, :]

  def visit(partial: bool, base: int):
    def body(t, dq):
      j = meta_ref[base + t]
      start = pl.multiple_of(j * bk, bk)
      k = k_ref[pl.ds(start, bk), :]
      v = v_ref[pl.ds(start, bk), :]
      s, tanh = _scores(q, k, cfg)
      reads = _Reads(qtok=qtok, ktok=lambda r: ktok_ref[r, pl.ds(start, bk)], scal=scal,
                     pair=lambda r: pair_ref[r, :, pl.ds(start, bk)],
                     tile=_tile_value(cfg, tile_ref, i, j))
      allowed = _allowed(cfg, partial, i, j, reads, qoff)
      p = jnp.exp(s - lse[:, None])
      if allowed is not None:
        p = jnp.where(allowed, p, 0.0)
      dp = compat.dot(do, v, trans_b=True, precision=_precision(v))
      ds = p * (dp - delta[:, None])
      if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
      return dq + compat.dot(ds.astype(k.dtype), k, precision=_precision(k))
    return body

  dq = jnp.zeros(q.shape, jnp.float32)
  dq = lax.fori_loop(0, meta_ref[0], visit(False, 2), dq)
  dq = lax.fori_loop(0, meta_ref[1], visit(True, 2 + mf), dq)
  dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(meta_ref, scal_ref, qtok_ref, ktok_ref, pair_ref, tile_ref, q_ref, k_ref, v_ref,
                do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, cfg: _Config):
  j = pl.program_id(2)
  bq = cfg.block_q
  mf, _ = cfg.bwd_width
  k, v = k_ref[...], v_ref[...]
  ns = len(cfg.pred.scalars)
  qoff = scal_ref[ns]

  def scal(r):
    return scal_ref[r]

  def ktok(r):
    return ktok_ref[r, :]

  def visit(partial: bool, base: int):
    def body(t, carry):
      dk, dv = carry
      i = meta_ref[base + t]
      start = pl.multiple_of(i * bq, bq)
      q = q_ref[pl.ds(start, bq), :]
      do = do_ref[pl.ds(start, bq), :]
      lse = lse_ref[pl.ds(start, bq)]
      delta = delta_ref[pl.ds(start, bq)]
      s, tanh = _scores(q, k, cfg)
      reads = _Reads(qtok=lambda r: qtok_ref[r, pl.ds(start, bq)], ktok=ktok, scal=scal,
                     pair=lambda r: pair_ref[r, pl.ds(start, bq), :],
                     tile=_tile_value(cfg, tile_ref, i, j))
      allowed = _allowed(cfg, partial, i, j, reads, qoff)
      p = jnp.exp(s - lse[:, None])
      if allowed is not None:
        p = jnp.where(allowed, p, 0.0)
      dv = dv + compat.dot(p.astype(do.dtype), do, trans_a=True, precision=_precision(do))
      dp = compat.dot(do, v, trans_b=True, precision=_precision(v))
      ds = p * (dp - delta[:, None])
      if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
      dk = dk + compat.dot(ds.astype(q.dtype), q, trans_a=True, precision=_precision(q))
      return dk, dv
    return body

  carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  carry = lax.fori_loop(0, meta_ref[0], visit(False, 2), carry)
  dk, dv = lax.fori_loop(0, meta_ref[1], visit(True, 2 + mf), carry)
  dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- launches


def _b(cfg: _Config, b):
  return b if cfg.batched_meta else 0


def launch_params(kernel: str, d: int, block_q: int, block_kv: int) -> tuple[int, int]:
  """Triton's `(num_warps, num_stages)` for kernel `"fwd"`, `"dq"` or `"dkv"`.

  Measured on an H100 (`benchmarks/gpu_tuning.py`; causal and packed documents at
  16K-128K tokens, 16 heads of 128, bf16):
  - forward: 4 warps, 2 stages at every tile shape. With 128 × 64 tiles that is
    14.0 ms at 32K and 228 ms at 128K (causal); 8 warps took 16.5 and 269 ms.
  - backward with 64-row and 64-column tiles: 4 warps. Causal at 16K took 13.2 ms
    forward+backward against 25.7 ms with 8 warps.
  - backward with a 128-row or 128-column tile: 8 warps. 4 warps took twice as long
    (2.0 s against 1.03 s at 128K). 3 stages or more exceed the 227 KiB of shared
    memory there.
  """
  del d
  if kernel == "fwd" or max(block_q, block_kv) < 128:
    return 4, 2
  return 8, 2


def _compiler(cfg: _Config, d: int, kernel: str):
  if cfg.interpret:
    return None
  warps, stages = launch_params(kernel, d, cfg.block_q, cfg.block_kv)
  return compat.triton_compiler_params(warps, stages)


class _ReadArrays(NamedTuple):
  """The kernel's read inputs: scalars (+ q offset), per-token q and k rows, pairwise, tiles."""
  scal: Any      # [B', Ns + 1]
  qtok: Any      # [B', Nq, Lq_pad]
  ktok: Any      # [B', Nk, Lkv_pad]
  pair: Any      # [B', Np, Lq_pad, Lkv_pad] ([B', 1, bq, bk] zeros without pairwise reads)
  tile: Any      # [B', Nt · nq · nk] ([B', 1] zeros without tile reads)


def _read_specs(cfg: _Config, arrays: _ReadArrays, line: str):
  """BlockSpecs of the read inputs for a grid `(b, h, line)` over q tiles or key tiles (the
  forward's split grid `(b, h, q tile, split)` reads the same blocks in every split)."""
  bq, bk = cfg.block_q, cfg.block_kv

  def tok(b_):
    return _b(cfg, b_)

  def whole(a):
    return pl.BlockSpec((None,) + a.shape[1:],
                        lambda b_, h_, n, *_: (tok(b_),) + (0,) * (a.ndim - 1))

  npair = arrays.pair.shape[1]
  if line == "q":
    qtok = pl.BlockSpec((None, arrays.qtok.shape[1], bq),
                        lambda b_, h_, i, *_: (tok(b_), 0, i))
    ktok = whole(arrays.ktok)
    pair = (pl.BlockSpec((None, npair, bq, arrays.pair.shape[-1]),
                         lambda b_, h_, i, *_: (tok(b_), 0, i, 0))
            if cfg.pred.pairs else whole(arrays.pair))
  else:
    qtok = whole(arrays.qtok)
    ktok = pl.BlockSpec((None, arrays.ktok.shape[1], bk), lambda b_, h_, j: (tok(b_), 0, j))
    pair = (pl.BlockSpec((None, npair, arrays.pair.shape[-2], bk),
                         lambda b_, h_, j: (tok(b_), 0, 0, j))
            if cfg.pred.pairs else whole(arrays.pair))
  return [whole(arrays.scal), qtok, ktok, pair, whole(arrays.tile)]


def _forward(cfg: _Config, q, k, v, sinks, meta_f, reads: _ReadArrays, out_dtype=None):
  """`(out [B, Lq_pad, H, Dv], lse [B, H, Lq_pad] f32, +inf on rows with no key or sink)`.

  With `cfg.splits > 1`, one program per split writes a float32 partial output and
  log-sum-exp, and `flash_decode.combine` merges them (adding the sinks once)."""
  b, lq_pad, h, d = q.shape
  lkv_pad, dv = k.shape[1], v.shape[-1]
  bq, g, s = cfg.block_q, cfg.groups, cfg.splits
  kernel = functools.partial(_fwd_kernel, cfg=cfg)
  in_specs = [
      pl.BlockSpec((None, None, meta_f.shape[-1]), lambda b_, h_, i, *_: (_b(cfg, b_), i, 0)),
      *_read_specs(cfg, reads, "q"),
      pl.BlockSpec((h,), lambda b_, h_, i, *_: (0,)),
      pl.BlockSpec((None, bq, None, d), lambda b_, h_, i, *_: (b_, i, h_, 0)),
      pl.BlockSpec((None, lkv_pad, None, d),
                   lambda b_, h_, i, *_: (b_, 0, lax.div(h_, g), 0)),
      pl.BlockSpec((None, lkv_pad, None, dv),
                   lambda b_, h_, i, *_: (b_, 0, lax.div(h_, g), 0)),
  ]
  if s == 1:
    grid: tuple[int, ...] = (b, h, cfg.n_q_tiles)
    out_specs = [pl.BlockSpec((None, bq, None, dv), lambda b_, h_, i: (b_, i, h_, 0)),
                 pl.BlockSpec((None, None, bq), lambda b_, h_, i: (b_, h_, i))]
    out_shape = [jax.ShapeDtypeStruct((b, lq_pad, h, dv), out_dtype or q.dtype),
                 jax.ShapeDtypeStruct((b, h, lq_pad), jnp.float32)]
  else:
    grid = (b, h, cfg.n_q_tiles, s)
    out_specs = [pl.BlockSpec((None, None, bq, None, dv),
                              lambda b_, h_, i, s_: (s_, b_, i, h_, 0)),
                 pl.BlockSpec((None, None, None, bq), lambda b_, h_, i, s_: (s_, b_, h_, i))]
    out_shape = [jax.ShapeDtypeStruct((s, b, lq_pad, h, dv), jnp.float32),
                 jax.ShapeDtypeStruct((s, b, h, lq_pad), jnp.float32)]
  o, lse = pl.pallas_call(kernel, grid=grid, in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape, interpret=cfg.interpret,
                          compiler_params=_compiler(cfg, d, "fwd"),
                          name="maskc_flash_fwd" if s == 1 else "maskc_flash_fwd_split")(
      meta_f, *reads, sinks, q, k, v)
  if s == 1:
    return o, lse
  o, lse = flash_decode.combine(o, lse, sinks if cfg.has_sinks else None)
  return o.astype(out_dtype or q.dtype), lse


def _backward(cfg: _Config, q, k, v, o, lse, do, meta_f, meta_b, reads: _ReadArrays,
              dlse=None):
  """`(dq, dk, dv, delta)`; `dlse [B, H, Lq_pad]` is a cotangent on the rows' log-sum-exp."""
  b, lq_pad, h, d = q.shape
  lkv_pad, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
  bq, bk, g = cfg.block_q, cfg.block_kv, cfg.groups
  delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32))
  if dlse is not None:
    # ds = p (dp - delta) + p dlse: the kernels see delta - dlse.
    delta = delta - dlse.astype(jnp.float32)

  def tok(b_):
    return _b(cfg, b_)

  dq = pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg), grid=(b, h, cfg.n_q_tiles),
      in_specs=[
          pl.BlockSpec((None, None, meta_f.shape[-1]), lambda b_, h_, i: (tok(b_), i, 0)),
          *_read_specs(cfg, reads, "q"),
          pl.BlockSpec((None, bq, None, d), lambda b_, h_, i: (b_, i, h_, 0)),
          pl.BlockSpec((None, lkv_pad, None, d), lambda b_, h_, i: (b_, 0, lax.div(h_, g), 0)),
          pl.BlockSpec((None, lkv_pad, None, dv), lambda b_, h_, i: (b_, 0, lax.div(h_, g), 0)),
          pl.BlockSpec((None, bq, None, dv), lambda b_, h_, i: (b_, i, h_, 0)),
          pl.BlockSpec((None, None, bq), lambda b_, h_, i: (b_, h_, i)),
          pl.BlockSpec((None, None, bq), lambda b_, h_, i: (b_, h_, i)),
      ],
      out_specs=pl.BlockSpec((None, bq, None, d), lambda b_, h_, i: (b_, i, h_, 0)),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), interpret=cfg.interpret,
      compiler_params=_compiler(cfg, d, "dq"), name="maskc_flash_dq")(
          meta_f, *reads, q, k, v, do, lse, delta)
  dk, dv_ = pl.pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg), grid=(b, h, cfg.n_kv_tiles),
      in_specs=[
          pl.BlockSpec((None, None, meta_b.shape[-1]), lambda b_, h_, j: (tok(b_), j, 0)),
          *_read_specs(cfg, reads, "k"),
          pl.BlockSpec((None, lq_pad, None, d), lambda b_, h_, j: (b_, 0, h_, 0)),
          pl.BlockSpec((None, bk, None, d), lambda b_, h_, j: (b_, j, lax.div(h_, g), 0)),
          pl.BlockSpec((None, bk, None, dv), lambda b_, h_, j: (b_, j, lax.div(h_, g), 0)),
          pl.BlockSpec((None, lq_pad, None, dv), lambda b_, h_, j: (b_, 0, h_, 0)),
          pl.BlockSpec((None, None, lq_pad), lambda b_, h_, j: (b_, h_, 0)),
          pl.BlockSpec((None, None, lq_pad), lambda b_, h_, j: (b_, h_, 0)),
      ],
      out_specs=[pl.BlockSpec((None, bk, None, d), lambda b_, h_, j: (b_, j, h_, 0)),
                 pl.BlockSpec((None, bk, None, dv), lambda b_, h_, j: (b_, j, h_, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, lkv_pad, h, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, lkv_pad, h, dv), jnp.float32)],
      interpret=cfg.interpret, compiler_params=_compiler(cfg, d, "dkv"),
      name="maskc_flash_dkv")(
          meta_b, *reads, q, k, v, do, lse, delta)
  # Per-query-head key gradients, summed over each key head's group.
  dk = dk.reshape(b, lkv_pad, hkv, g, d).sum(3).astype(k.dtype)
  dv_ = dv_.reshape(b, lkv_pad, hkv, g, dv).sum(3).astype(v.dtype)
  return dq, dk, dv_, delta


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: _Config, q, k, v, sinks, meta_f, meta_b, scal, qtok, ktok, pair, tile):
  reads = _ReadArrays(scal, qtok, ktok, pair, tile)
  o, _ = _forward(cfg, q, k, v, sinks, meta_f, reads)
  return o


def _flash_fwd(cfg, q, k, v, sinks, meta_f, meta_b, scal, qtok, ktok, pair, tile):
  reads = _ReadArrays(scal, qtok, ktok, pair, tile)
  o, lse = _forward(cfg, q, k, v, sinks, meta_f, reads)
  return o, (q, k, v, sinks, o, lse, meta_f, meta_b, reads)


def _flash_bwd(cfg, res, do):
  q, k, v, sinks, o, lse, meta_f, meta_b, reads = res
  dq, dk, dv, delta = _backward(cfg, q, k, v, o, lse, do, meta_f, meta_b, reads)
  dsinks = None
  if cfg.has_sinks:
    # d out / d sink = -p_sink * out, with p_sink = exp(sink - lse) per row.
    p_sink = jnp.exp(sinks[None, :, None] - lse)
    dsinks = -(p_sink * delta).sum(axis=(0, 2))
  else:
    dsinks = jnp.zeros_like(sinks)
  return (dq, dk, dv, dsinks) + (None,) * 7


_flash.defvjp(_flash_fwd, _flash_bwd)


def _public_lse(lse):
  """The kernel's log-sum-exp with empty rows (+inf there) at `NEG_LSE`, as `run_with_lse` says."""
  return jnp.where(jnp.isfinite(lse), lse, NEG_LSE)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash_lse(cfg: _Config, q, k, v, meta_f, meta_b, scal, qtok, ktok, pair, tile):
  """`(out f32 [B, Lq_pad, H, Dv], lse [B, H, Lq_pad])`, differentiable through both."""
  reads = _ReadArrays(scal, qtok, ktok, pair, tile)
  sinks = jnp.zeros((q.shape[2],), jnp.float32)
  o, lse = _forward(cfg, q, k, v, sinks, meta_f, reads, out_dtype=jnp.float32)
  return o, _public_lse(lse)


def _flash_lse_fwd(cfg, q, k, v, meta_f, meta_b, scal, qtok, ktok, pair, tile):
  reads = _ReadArrays(scal, qtok, ktok, pair, tile)
  sinks = jnp.zeros((q.shape[2],), jnp.float32)
  o, lse = _forward(cfg, q, k, v, sinks, meta_f, reads, out_dtype=jnp.float32)
  return (o, _public_lse(lse)), (q, k, v, o, lse, meta_f, meta_b, reads)


def _flash_lse_bwd(cfg, res, cts):
  q, k, v, o, lse, meta_f, meta_b, reads = res
  do, dlse = cts
  # The kernels multiply do with v in v's dtype (Triton dots take one dtype).
  dq, dk, dv, _ = _backward(cfg, q, k, v, o, lse, do.astype(v.dtype), meta_f, meta_b, reads,
                            dlse=dlse)
  return (dq, dk, dv) + (None,) * 7


_flash_lse.defvjp(_flash_lse_fwd, _flash_lse_bwd)


# ----------------------------------------------------------------------------- entry point


def read_arrays(bm, u: int, lq_pad: int, lkv_pad: int) -> _ReadArrays:
  """Mask `u`'s read values laid out for the kernel (see `_ReadArrays`).

  Per-token rows and pairwise values are padded to the tiled lengths (padding
  positions are masked by `kv_len` and dropped rows, whatever they read). The
  scalars row ends with the q offset. A kind without reads gets a small block of
  zeros the kernel never loads.
  """
  values = common.read_values(bm, u)
  nb = values.scalars.shape[0]

  def side(arr, length):
    if not arr.shape[1]:
      return jnp.zeros((nb, 1, length), jnp.int32)
    return jnp.pad(arr, ((0, 0), (0, 0), (0, length - arr.shape[-1])))

  offset = jnp.broadcast_to(jnp.asarray(bm.q_offset, jnp.int32), (nb, 1))
  scal = jnp.concatenate([values.scalars, offset], axis=1)
  if values.pairs.shape[1]:
    p = values.pairs
    pair = jnp.pad(p, ((0, 0), (0, 0), (0, lq_pad - p.shape[2]), (0, lkv_pad - p.shape[3])))
  else:
    pair = jnp.zeros((nb, 1, lq_pad // bm.n_q_tiles, bm.block_kv), jnp.int32)
  tiles = values.tile_pairs
  tile = (tiles.reshape(nb, -1) if tiles.shape[1] else jnp.zeros((nb, 1), jnp.int32))
  return _ReadArrays(scal, side(values.q, lq_pad), side(values.k, lkv_pad), pair, tile)


def run(q, k, v, bm, *, scale=None, logits_soft_cap=None, sinks=None, interpret=None,
        splits: int | None = None):
  """The backend entry point: attention `[B, Lq, H, Dv]` with the Pallas flash kernel.

  `splits` is how many shares each q tile's key tiles are split into in the forward pass
  (flash-decoding, `maskc.kernels.flash.decode`): None picks by `flash_decode.splits`
  (1 unless the launch has few programs and its rows many key tiles), 1 never splits.
  """
  b, lq, h, lkv, hkv, d = common.check_qkv(q, k, v)
  common.check_blockmap(bm, "flash", lq, lkv, b)
  interpret = _check_interpret(bm, interpret)
  sinks = common.check_sinks(sinks, h)
  scale = common.default_scale(d, scale)

  def one(q, k, v, u, sinks):
    return _attend(q, k, v, bm, u, scale=scale, cap=logits_soft_cap, sinks=sinks,
                   interpret=interpret, splits=splits)

  return common.per_mask(one, q, k, v, bm, sinks)


def run_with_lse(q, k, v, bm, *, scale=None, logits_soft_cap=None, interpret=None,
                 splits: int | None = None):
  """Attention and its log-sum-exp: `(out [B, Lq, H, Dv] f32, lse [B, Lq, H] f32)`.

  The contract of `maskc.kernels.xla.run_with_lse`, with the Pallas kernel: for
  combining partial attentions over disjoint key sets exactly (ring attention),
  `out = sum_t exp(lse_t - LSE) out_t` with `LSE = logsumexp_t lse_t`. Rows with no
  allowed key have `out = 0` and `lse = NEG_LSE`. One mask for every head.
  Differentiable w.r.t. q, k and v through both outputs (the lse cotangent is
  folded into the backward kernels' `delta`). The kernel computes in the inputs'
  dtype and accumulates in float32; `out` is stored in float32. `splits` as `run`.
  """
  b, lq, h, lkv, hkv, d = common.check_qkv(q, k, v)
  common.check_blockmap(bm, "flash", lq, lkv, b)
  common.check_one_mask(bm)
  interpret = _check_interpret(bm, interpret)
  scale = common.default_scale(d, scale)
  return _attend(q, k, v, bm, 0, scale=scale, cap=logits_soft_cap, sinks=None,
                 interpret=interpret, with_lse=True, splits=splits)


def _check_interpret(bm, interpret) -> bool:
  """`interpret` resolved (default: off on GPU), after checking Triton's tile constraints."""
  if interpret is None:
    interpret = platform() != "gpu"
  if not interpret:
    if (why := compat.triton_unavailable()) is not None:
      raise BackendError(f"the flash kernel is written for Pallas Triton, and {why}",
                         hint="Use backend='xla' (any platform), or run flash with "
                              "interpret=True.")
    for name, t in (("block_q", _tile_rows(bm)), ("block_kv", bm.block_kv)):
      if t < 16 or t & (t - 1):
        raise MaskValueError(f"the Triton flash kernel needs power-of-two tiles >= 16, got "
                             f"{name}={t}")
  return bool(interpret)


class _Padding(NamedTuple):
  """The tiled lengths and head dims `_backward` takes (static)."""
  lq: int
  lkv: int
  d: int
  dv: int


def _pad(x, rows: int, dim: int):
  return jnp.pad(x, ((0, 0), (0, rows - x.shape[1]), (0, 0), (0, dim - x.shape[3])))


class _Launch(NamedTuple):
  """One map's kernel inputs: the config, tile lists, reads, and the padding they expect."""
  cfg: _Config
  meta_f: Any
  meta_b: Any
  reads: _ReadArrays
  shape: _Padding


def _tile_rows(bm) -> int:
  """The kernel's q tile: the map's, but for a map of one q tile that Triton cannot load (a
  decode step's few rows, `block_q = q_len`) a power of two >= 16 holding its rows."""
  t = bm.block_q
  if bm.n_q_tiles == 1 and (t < 16 or t & (t - 1)):
    return max(16, 1 << (bm.q_len - 1).bit_length())
  return t


def _launch(q, k, v, bm, u: int, *, scale, cap, has_sinks: bool, interpret: bool,
            splits: int | None = 1) -> _Launch:
  """One map's kernel inputs; `splits` None picks the forward's split by
  `flash_decode.splits` from the launch's programs and its rows' key tiles."""
  b, lq, h, d = q.shape
  lkv, hkv = k.shape[1], k.shape[2]
  nq, nk = bm.n_q_tiles, bm.n_kv_tiles
  bq = _tile_rows(bm)
  meta_f, fwd_width = _meta(bm, u, transpose=False)
  meta_b, bwd_width = _meta(bm, u, transpose=True)
  if splits is None:
    splits = flash_decode.splits(b * h * nq, min(sum(fwd_width), nk))
  if splits < 1:
    raise MaskValueError(f"splits must be a positive number of key-tile shares, got {splits}")
  cfg = _Config(pred=bm.predicates[u], block_q=bq, block_kv=bm.block_kv, q_len=lq,
                kv_len=lkv, n_q_tiles=nq, n_kv_tiles=nk, groups=h // hkv, scale=scale,
                cap=None if cap is None else float(cap), has_sinks=has_sinks,
                batched_meta=bm.batch is not None, fwd_width=fwd_width, bwd_width=bwd_width,
                interpret=interpret, splits=int(splits))
  # Triton loads power-of-two blocks: pad head dims (zeros change no dot product).
  d_pad, dv_pad = (max(16, 1 << (x - 1).bit_length()) for x in (d, v.shape[-1]))
  lq_pad, lkv_pad = nq * bq, nk * bm.block_kv
  return _Launch(cfg, jnp.asarray(meta_f), jnp.asarray(meta_b),
                 read_arrays(bm, u, lq_pad, lkv_pad), _Padding(lq_pad, lkv_pad, d_pad, dv_pad))


def _attend(q, k, v, bm, u: int, *, scale, cap, sinks, interpret: bool, with_lse: bool = False,
            splits: int | None = None):
  lq, dv = q.shape[1], v.shape[-1]
  ln = _launch(q, k, v, bm, u, scale=scale, cap=cap, has_sinks=sinks is not None,
               interpret=interpret, splits=splits)
  pads = ln.shape
  qp = _pad(q, pads.lq, pads.d)
  kp, vp = _pad(k, pads.lkv, pads.d), _pad(v, pads.lkv, pads.dv)
  if with_lse:
    out, lse = _flash_lse(ln.cfg, qp, kp, vp, ln.meta_f, ln.meta_b, *ln.reads)
    return out[:, :lq, :, :dv], jnp.swapaxes(lse, 1, 2)[:, :lq]
  sinks_in = jnp.zeros((q.shape[2],), jnp.float32) if sinks is None else sinks
  out = _flash(ln.cfg, qp, kp, vp, sinks_in, ln.meta_f, ln.meta_b, *ln.reads)
  return out[:, :lq, :, :dv]


# ----------------------------------------------------------------------------- another forward


def run_with_forward(forward: Callable[..., tuple[jax.Array, jax.Array]], q, k, v, bm, *,
                     aux: tuple = (), scale=None, logits_soft_cap=None, interpret=None):
  """Attention whose forward pass is another engine's and whose backward pass is this kernel's.

  For engines with a fast forward and a slow backward (tokamax's Mosaic GPU kernel skips
  key blocks forward but not backward): the backward pass needs only the output and each
  row's log-sum-exp, so this kernel's backward runs on `bm`'s tile lists (EMPTY tiles
  skipped) from what `forward` returned.

  Args:
    forward: `forward(q, k, v, *aux) -> (out, lse)`, the attention of `bm` at this scale
      and soft cap: `out [B, Lq, H, Dv]` in q's dtype, zero on rows with no allowed key,
      and `lse [B, H, Lq]` float32, `log sum_j exp(s_ij)` over row i's allowed keys of the
      scaled (then soft-capped) logits `s`, `+inf` on rows with no allowed key.
    q, k, v: as `run`. bm: a map of one mask for every head.
    aux: arrays `forward` reads besides q, k and v (they get no gradient).
    scale, logits_soft_cap, interpret: as `run`; the backward pass uses them.

  Returns:
    `out` as `forward` gives it; differentiable w.r.t. q, k and v by this kernel's backward.
  """
  b, lq, h, lkv, hkv, d = common.check_qkv(q, k, v)
  common.check_blockmap(bm, "flash", lq, lkv, b)
  if len(set(bm.head_index or (0,))) > 1:
    raise MaskValueError("run_with_forward takes a map of one mask for every head, got "
                         f"head masks {bm.head_index}",
                         hint="Run each head group separately (maskc.kernels.common.per_mask).")
  interpret = _check_interpret(bm, interpret)
  u = bm.head_index[0] if bm.head_index else 0
  ln = _launch(q, k, v, bm, u, scale=common.default_scale(d, scale), cap=logits_soft_cap,
               has_sinks=False, interpret=interpret)
  return _foreign(forward, ln.cfg, ln.shape, q, k, v, tuple(aux), ln.meta_f, ln.meta_b,
                  ln.reads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _foreign(forward, cfg: _Config, shape: _Padding, q, k, v, aux, meta_f, meta_b, reads):
  return forward(q, k, v, *aux)[0]


def _foreign_fwd(forward, cfg, shape, q, k, v, aux, meta_f, meta_b, reads):
  out, lse = forward(q, k, v, *aux)
  return out, (q, k, v, out, lse, meta_f, meta_b, reads)


def _foreign_bwd(forward, cfg, shape: _Padding, res, do):
  del forward
  q, k, v, out, lse, meta_f, meta_b, reads = res
  lq, lkv = q.shape[1], k.shape[1]
  # padded query rows get lse = +inf: zero weight, like rows with no key
  lse = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, 0), (0, shape.lq - lq)),
                constant_values=jnp.inf)
  dq, dk, dv, _ = _backward(
      cfg, _pad(q, shape.lq, shape.d), _pad(k, shape.lkv, shape.d),
      _pad(v, shape.lkv, shape.dv), _pad(out.astype(q.dtype), shape.lq, shape.dv), lse,
      _pad(do.astype(q.dtype), shape.lq, shape.dv), meta_f, meta_b, reads)
  return (dq[:, :lq, :, :q.shape[-1]], dk[:, :lkv, :, :k.shape[-1]],
          dv[:, :lkv, :, :v.shape[-1]], None, None, None, None)


_foreign.defvjp(_foreign_fwd, _foreign_bwd)
