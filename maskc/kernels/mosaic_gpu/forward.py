"""Block-sparse flash attention forward in Pallas Mosaic GPU (Hopper, sm90): `backend="mosaic_gpu"`.

**Not yet run on a GPU.** This kernel has been cross-lowered for cuda from a CPU-only
machine (`tests/test_mosaic_gpu_lowering.py`), which checks that every primitive it uses
has a Mosaic GPU lowering; it has never been compiled by ptxas, run, or timed. Its
numerics are checked by `tests/test_gpu.py` on the first GPU session. `auto` never picks
it until then.

The walk is flash's (`maskc.kernels.flash.kernel`): for each q tile, the FULL key tiles of its
BlockMap row, then its PARTIAL ones, from index lists built from the compact runs; EMPTY
tiles are never loaded, wherever they are in the row (holes included). PARTIAL tiles
evaluate the compiled predicate (`maskc.compiled.predicate`) in registers.

The kernel follows the FlashAttention-3 design of JAX's `attention_mgpu.py`:

- One CTA per (head, q tile, batch row); a q tile is `block_q = 128` rows, split between
  two compute warpgroups of 64 rows each (a `wgmma` is 64 rows per warpgroup). A third
  warpgroup, the memory warpgroup, copies key and value tiles with TMA into `stages`
  shared-memory slots, as far ahead as the slots allow; barriers say when a slot is
  loaded (`k_loaded`, `v_loaded`) and when both compute warpgroups are done with it
  (`k_consumed`, `v_consumed`).
- Both compute warpgroups walk the same key tiles (the map's row for the q tile), so each
  slot is loaded once for both. They alternate on the tensor cores (the "schedule
  barrier", FA3's ping-pong): one computes its softmax while the other's `wgmma` runs.
- Scores `q kᵀ` and `p v` are `wgmma`s from shared memory into float32 accumulators; the
  online softmax runs in float32 registers in base 2 (`exp2`, with logits scaled by
  `log2 e` once), as `attention_mgpu.py` does.
- Inputs are bfloat16 or float16 (shared-memory buffers take the inputs' dtype, not a
  hard-coded float16). Head dims are padded with zeros to a multiple of 64 (TMA's 128-byte
  swizzle), up to 256.
- Masked scores are set to a large finite negative (`common.NEG`), never `-inf`, so a row
  that sees only masked scores in its first tiles computes no `inf - inf`; a row with no
  allowed key at all ends with its maximum still at that value and is written as zeros,
  its log-sum-exp `+inf` (`NEG_LSE` through `run_with_lse`), as flash does.
- Sinks start each row's softmax at `(max = sink, sum = 1)`. The soft cap is
  `cap · tanh(s / cap)` on the scaled scores.
- Lengths need not be multiples of the tiles: q, k and v are padded to whole tiles, keys
  past `kv_len` are masked in the last key tile (FULL or not), padded query rows dropped.
- GQA/MQA: query head `h` reads key head `h // (H / Hkv)`.

Reads of PARTIAL tiles, loaded from global memory into the score tile's register layout
(`plgpu.Layout.WGMMA`): per-token q-side reads once per q tile (row layout, broadcast
along keys); per-token k-side reads per key tile (column layout, broadcast along rows);
pairwise reads as a `[64, block_kv]` int32 tile per warpgroup; tile-constant pairwise
reads and scalars as scalars. The q offset rides with the scalars, as in flash. This code
(`tile_mask`, `side_reads`) and the memory warpgroup's loop (`stream`) are shared with the
backward kernels, whose dk/dv tiles are key-major (`Tile.q_axis = 1`).

Gradients, two backward passes, chosen by the module-level `BACKWARD` (read when a call
is traced, like `SCHEDULE_BARRIER`):

- `BACKWARD = "flash"` (the default): flash's backward on the same map
  (`maskc.kernels.flash.kernel.run_with_forward`, as the tokamax backend does): this kernel
  returns each row's log-sum-exp, which is all flash's backward needs besides the output.
  So `jax.grad` through `backend="mosaic_gpu"` runs the Triton backward kernels, which
  need Triton's tiles (powers of two, which 128 × 64/128 are); `interpret` is passed on to
  them. Two paths have no gradient there and raise `BackendError` when differentiated:
  calls with sinks (flash's backward for a foreign forward has no sink gradient, and a
  zero one would be silently wrong) and `run_with_lse`.
- `BACKWARD = "mosaic_gpu"` (opt-in; **not yet run on a GPU**, only cross-lowered): the
  backward in Pallas Mosaic GPU, `maskc.kernels.mosaic_gpu.backward`: a dq kernel per q
  tile over this walk, a dk/dv kernel per key tile over the map's columns, PARTIAL tiles
  masked by this module's `tile_mask`. It differentiates sinks and `run_with_lse` too. It
  becomes the default once `tests/test_gpu.py -k mosaic` passes on a GPU.

What it refuses, with a `BackendError` naming `flash`: a JAX whose Pallas Mosaic GPU does
not import or lacks the warpgroup API (`compat.mosaic_gpu_unavailable`), dtypes other than
bfloat16 and float16, head dims over 256, tiles other than `block_q = 128` and
`block_kv` in (64, 128), and shapes whose shared-memory buffers do not fit in 227 KiB
with two slots. It has no interpret mode (interpret mode does not run `wgmma` pipelines
in jax 0.12): `interpret=True` is refused too, and so is an eager call where jax runs
off a GPU (a call under `jit` is refused only when lowered, by Pallas, since it may be
lowered for cuda from a CPU machine).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from maskc.compiled.blockmap import BlockMap
from maskc.kernels import common, compat
from maskc.kernels.flash import kernel as flash
from maskc.kernels.mosaic_gpu import backward as _backward
from maskc.kernels.mosaic_gpu.tiles import (
  BLOCK_KV,
  BLOCK_Q,
  LOG2E,
  MAX_STAGES,
  SMEM_BYTES,
  WG_ROWS,
  Config,
  Inputs,
  ReadRefs,
  Tile,
  pad_to,
  side_reads,
  softcap,
  stream_row_keys,
  tile_mask,
)
from maskc.kernels.platform import platform
from maskc.kernels.xla import NEG_LSE
from maskc.language.errors import BackendError, MaskValueError

BLOCK_SIZES = (128, 128)
COMPUTE_WGS = 2
DTYPES = (jnp.bfloat16, jnp.float16)
# FA3's ping-pong between the two compute warpgroups (`Config.schedule_barrier`). A
# module-level switch so that a first GPU session can rule it out if the kernel hangs
# (`maskc.kernels.mosaic_gpu.forward.SCHEDULE_BARRIER = False` before tracing); not a tuning knob.
SCHEDULE_BARRIER = True
# Which backward pass differentiates `backend="mosaic_gpu"` (read when a call is traced):
# "flash", flash's Triton kernels (the default), or "mosaic_gpu", this module's own in
# `maskc.kernels.mosaic_gpu.backward`, opt-in because it has never run on a GPU.
BACKWARD = "flash"
BACKWARDS = ("flash", "mosaic_gpu")
GPU_COST = None  # never run on a GPU: no measured rate, and `auto` does not consider it
BACKWARD_ENGINE = None  # not costed (its gradients run flash's backward unless `BACKWARD`)
installed = common.installed
length_refusal = common.any_length
forward_work = common.tile_work


def default_blocks(q_len: int, kv_len: int) -> tuple[int, int]:
  """Tile sizes: 128 query rows (two warpgroups of 64) by 128 keys (64 for short keys)."""
  del q_len
  return BLOCK_Q, (128 if kv_len > 64 else 64)


# ----------------------------------------------------------------------------- config


def smem_bytes(head_dim: int, block_kv: int, stages: int, itemsize: int = 2) -> int:
  """Shared memory one CTA uses: q (reused for the output), k and v slots, the lse rows."""
  q = COMPUTE_WGS * WG_ROWS * head_dim * itemsize
  kv = 2 * stages * block_kv * head_dim * itemsize
  # Mosaic GPU adds its reduction scratch (2 KiB), barriers and alignment.
  return q + kv + COMPUTE_WGS * WG_ROWS * 4 + 4096


def stages_for(head_dim: int, block_kv: int) -> int:
  """The most key/value slots (at most `MAX_STAGES`) that fit in shared memory; 0 if not 2."""
  for s in range(MAX_STAGES, 1, -1):
    if smem_bytes(head_dim, block_kv, s) <= SMEM_BYTES:
      return s
  return 0


def padded_head_dim(d: int) -> int:
  return -(-d // 64) * 64


def refusal(bm: BlockMap, *, head_dim: int, dtype: Any = None, soft_cap: bool = False,
            sinks: bool = False, dv: int | None = None,
            interpret: bool | None = None) -> str | None:
  """Why this kernel cannot run `bm` with these inputs here, or None when it can (soft caps
  and sinks go through)."""
  if interpret:
    return ("it has no interpret mode (Pallas interpret mode does not run Mosaic GPU's "
            "wgmma pipelines)")
  if (why := compat.mosaic_gpu_unavailable()) is not None:
    return why
  if dtype is not None and jnp.dtype(dtype) not in [jnp.dtype(t) for t in DTYPES]:
    return (f"it runs bfloat16 and float16, not {jnp.dtype(dtype)} (cast q, k and v, or "
            f"use backend='flash')")
  d = padded_head_dim(max(head_dim, dv or head_dim))
  if d > 256:
    return f"head dims over 256 do not fit, got {head_dim}" + (f" and {dv}" if dv else "")
  if bm.block_q != BLOCK_Q or bm.block_kv not in BLOCK_KV:
    return (f"it takes tiles of {BLOCK_Q} × {BLOCK_KV[0]} or {BLOCK_Q} × {BLOCK_KV[1]}, got "
            f"{bm.block_q} × {bm.block_kv} (compile with block_q=128, block_kv=128)")
  if not stages_for(d, bm.block_kv):
    return (f"two slots of {bm.block_kv}-key tiles at head dim {d} exceed the "
            f"{SMEM_BYTES // 1024} KiB of shared memory (compile with block_kv=64)")
  return None


def _check_device(bm: BlockMap, q) -> None:
  """Refuses an eager call off a GPU (Pallas would say only "Only interpret mode is supported
  on CPU backend"). Under `jit` the target is unknown until lowering, which may be for cuda
  from this machine (the cross-lowering tests), so traced calls pass."""
  if not isinstance(q, jax.core.Tracer) and platform() != "gpu":
    raise _refuse(bm, f"it runs on an NVIDIA GPU (sm90), and jax runs on {platform()} here")


def _refuse(bm: BlockMap, why: str) -> BackendError:
  text = " ; ".join(str(m) for m in bm.masks)
  return BackendError(f"backend 'mosaic_gpu' cannot run {text}: {why}",
                      hint="Use backend='flash' (GPU, every mask) or 'xla'.")


# ----------------------------------------------------------------------------- kernel inputs


def walk(bm: BlockMap, u: int, transpose: bool = False):
  """`[B', n_q_tiles, 2 + W]` int32: each q tile's FULL then PARTIAL key tiles (see `Inputs`).

  With `transpose`, `[B', n_kv_tiles, 2 + W]`: each key tile's FULL then PARTIAL q tiles,
  from the map's `cols` runs (the backward's dk/dv walk).
  """
  fi, fc, _ = common.tile_lists(bm, u, common.FULL, transpose=transpose)
  pi, pc, _ = common.tile_lists(bm, u, common.PARTIAL, transpose=transpose)
  xp = np if isinstance(fi, np.ndarray) and isinstance(pi, np.ndarray) else jnp
  mf, mp = fi.shape[-1], pi.shape[-1]
  t = xp.arange(max(1, mf + mp), dtype=np.int32)
  fc_, pc_ = fc[..., None], pc[..., None]
  from_full = xp.take_along_axis(fi, xp.clip(t, 0, max(mf - 1, 0))[None, None, :]
                                 * xp.ones_like(fc_), axis=-1) if mf else 0 * t
  from_part = xp.take_along_axis(pi, xp.clip(t - fc_, 0, max(mp - 1, 0)), axis=-1) if mp \
      else 0 * t
  order = xp.where(t < fc_, from_full, xp.where(t < fc_ + pc_, from_part, 0))
  order = xp.broadcast_to(order, fc.shape + (t.shape[0],))
  return xp.concatenate([fc_, fc_ + pc_, order], axis=-1).astype(np.int32)


def inputs(bm: BlockMap, u: int) -> Inputs:
  """Mask `u`'s tile walk and read values laid out for the kernel."""
  lq_pad, lkv_pad = bm.n_q_tiles * bm.block_q, bm.n_kv_tiles * bm.block_kv
  r = flash.read_arrays(bm, u, lq_pad, lkv_pad)
  return Inputs(jnp.asarray(walk(bm, u)), r.scal, r.qtok, r.ktok, r.pair, r.tile)


# ----------------------------------------------------------------------------- the kernel


def _forward(cfg: Config, q, k, v, sinks, ins: Inputs):
  """`(out [B, Lq_pad, H, D] in q's dtype, lse [B, H, Lq_pad] f32)` on padded inputs."""
  plgpu = compat.mosaic_gpu()
  b, lq_pad, h, d = q.shape
  bk, stages, rows = cfg.block_kv, cfg.stages, WG_ROWS
  dtype = q.dtype
  wgmma_layout = plgpu.Layout.WGMMA
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  pred = cfg.pred

  def kernel(meta_ref, scal_ref, qtok_ref, ktok_ref, pair_ref, tile_ref, sink_ref, q_ref,
             k_ref, v_ref, out_ref, lse_ref, scoped):
    batch = lax.axis_index("batch")
    head = lax.axis_index("heads")
    qi = lax.axis_index("q_tiles")
    wg = lax.axis_index("wg")
    mb = batch if cfg.batched_meta else 0
    (qo_smem2, k_smem, v_smem, lse_smem2), loaded, consumed, schedule = scoped
    k_loaded, v_loaded, q_loaded = loaded
    k_consumed, v_consumed = consumed
    n_full = meta_ref[mb, qi, 0]
    n_all = meta_ref[mb, qi, 1]

    def schedule_sync():
      if cfg.schedule_barrier:
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      qo_smem = qo_smem2.at[wg]
      lse_smem = lse_smem2.at[wg]
      q_base = qi * BLOCK_Q + wg * rows
      plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, rows), head], qo_smem,
                              q_loaded.at[wg])
      plgpu.barrier_wait(q_loaded.at[wg])

      refs = ReadRefs(scal_ref, qtok_ref, ktok_ref, pair_ref, tile_ref, mb)
      q_vecs = side_reads(refs, "q", len(pred.q_reads), q_base, rows, 0)

      def allowed(j, partial: bool):
        tile = Tile((rows, bk), 0, q_base, j * bk, qi, j)
        return tile_mask(cfg, refs, tile, partial, q_vecs=q_vecs)

      if cfg.has_sinks:
        m0 = full_row(sink_ref[head] * LOG2E, rows, row_layout)
        l0 = full_row(jnp.float32(1.0), rows, row_layout)
      else:
        m0 = full_row(jnp.float32(common.NEG), rows, row_layout)
        l0 = full_row(jnp.float32(0.0), rows, row_layout)
      acc0 = plgpu.layout_cast(jnp.zeros((rows, d), jnp.float32), wgmma_layout)
      pl.when(wg == 1)(schedule_sync)

      def step(partial: bool):
        def body(t, carry):
          acc, m, l = carry
          slot = lax.rem(t, jnp.int32(stages))
          j = meta_ref[mb, qi, 2 + t]
          plgpu.barrier_wait(k_loaded.at[slot])

          def scores(acc_ref):
            plgpu.wgmma(acc_ref, qo_smem, compat.mosaic_transpose(k_smem.at[slot], (1, 0)))
            schedule_sync()
            return acc_ref[...]

          s = pl.run_scoped(scores, plgpu.ACC((rows, bk), jnp.float32))
          plgpu.barrier_arrive(k_consumed.at[slot])
          s, _ = softcap(s, cfg)
          mask = allowed(j, partial)
          if mask is not None:
            s = jnp.where(mask, s, common.NEG)
          m_new = jnp.maximum(m, s.max(axis=1))
          alpha = jnp.exp2(m - m_new)
          p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
          l = l * alpha + p.sum(axis=1)
          p16 = p.astype(dtype)
          if cfg.schedule_barrier:
            plgpu.barrier_arrive(schedule)
          plgpu.barrier_wait(v_loaded.at[slot])
          if cfg.schedule_barrier:
            plgpu.barrier_wait(schedule)

          def values(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

          acc = pl.run_state(values)(plgpu.ACC.init(acc))
          plgpu.barrier_arrive(v_consumed.at[slot])
          return acc, m_new, l
        return body

      carry = lax.fori_loop(0, n_full, step(False), (acc0, m0, l0))
      acc, m, l = lax.fori_loop(n_full, n_all, step(True), carry)
      pl.when(wg == 0)(schedule_sync)
      if cfg.has_sinks:
        out = acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])
        lse = (m + jnp.log2(l)) * (1.0 / LOG2E)
      else:
        empty = m <= common.NEG / 2
        safe_l = jnp.where(empty, 1.0, l)
        inv = jnp.where(empty, 0.0, 1.0 / safe_l)
        out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
        lse = jnp.where(empty, jnp.inf, (m + jnp.log2(safe_l)) * (1.0 / LOG2E))
      qo_smem[...] = out.astype(dtype)
      lse_smem[...] = lse
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[batch, pl.ds(q_base, rows), head])
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(q_base, rows)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")
      stream_row_keys(n_all, stages, (meta_ref, mb, qi), k_ref, v_ref, batch, head,
                      cfg.groups, bk, (k_smem, k_loaded, k_consumed),
                      (v_smem, v_loaded, v_consumed))

  def entry(*refs):
    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    scratch = (
        plgpu.SMEM((COMPUTE_WGS, rows, d), dtype, transforms=(tiling, swizzle)),
        plgpu.SMEM((stages, bk, d), dtype, transforms=(tiling, swizzle)),
        plgpu.SMEM((stages, bk, d), dtype, transforms=(tiling, swizzle)),
        plgpu.SMEM((COMPUTE_WGS, rows), jnp.float32),
    )
    pl.run_scoped(
        lambda *scoped: kernel(*refs, scoped),
        scratch,
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=COMPUTE_WGS)),
        (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=COMPUTE_WGS),
        collective_axes="wg",
    )

  out_type = (jax.ShapeDtypeStruct((b, lq_pad, h, d), dtype),
              jax.ShapeDtypeStruct((b, h, lq_pad), jnp.float32))
  out, lse = plgpu.kernel(
      entry, out_type=out_type, grid=(h, cfg.n_q_tiles, b),
      grid_names=("heads", "q_tiles", "batch"), num_threads=COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True))(
          *ins, sinks, q, k, v)
  return out, lse


def full_row(x, rows: int, layout):
  """A `[rows]` float32 vector of the scalar `x` in a row layout of the score tile."""
  plgpu = compat.mosaic_gpu()
  return plgpu.layout_cast(lax.broadcast_in_dim(jnp.asarray(x, jnp.float32), (rows,), ()),
                           layout)


# ----------------------------------------------------------------------------- entry points


class _Launch(NamedTuple):
  cfg: Config
  ins: Inputs
  d: int


def _launch(q, k, v, bm: BlockMap, u: int, *, scale: float, cap, has_sinks: bool,
            interpret) -> _Launch:
  b, lq, h, lkv, hkv, d = common.check_qkv(q, k, v)
  why = refusal(bm, head_dim=d, dv=v.shape[-1], dtype=q.dtype, interpret=interpret)
  if why is not None:
    raise _refuse(bm, why)
  dp = padded_head_dim(max(d, v.shape[-1]))
  cfg = Config(pred=bm.predicates[u], block_kv=bm.block_kv, q_len=lq, kv_len=lkv,
               n_q_tiles=bm.n_q_tiles, n_kv_tiles=bm.n_kv_tiles, groups=h // hkv,
               head_dim=dp, dtype=jnp.dtype(q.dtype).name, scale=scale,
               cap=None if cap is None else float(cap), has_sinks=has_sinks,
               batched_meta=bm.batch is not None, stages=stages_for(dp, bm.block_kv),
               schedule_barrier=SCHEDULE_BARRIER)
  return _Launch(cfg, inputs(bm, u), dp)


def padded_forward(cfg: Config, d: int, q, k, v, sinks, ins: Inputs):
  """`(out [B, Lq, H, Dv] in q's dtype, lse [B, H, Lq] f32, +inf on rows with no key)`."""
  lq, dv = q.shape[1], v.shape[-1]
  lq_pad, lkv_pad = cfg.n_q_tiles * BLOCK_Q, cfg.n_kv_tiles * cfg.block_kv
  out, lse = _forward(cfg, pad_to(q, lq_pad, d, q.dtype), pad_to(k, lkv_pad, d, q.dtype),
                      pad_to(v, lkv_pad, d, q.dtype), sinks, ins)
  return out[:, :lq, :, :dv], lse[:, :, :lq]


def run(q, k, v, bm, *, scale=None, logits_soft_cap=None, sinks=None, interpret=None):
  """The backend entry point: attention `[B, Lq, H, Dv]` with the Mosaic GPU forward kernel.

  Differentiable: the backward pass is flash's on the same map, or with
  `BACKWARD = "mosaic_gpu"` the Mosaic GPU one, sinks included (module docstring).
  """
  q, k, v = common.qkv_arrays(q, k, v)
  b, lq, h, lkv, hkv, d = common.check_qkv(q, k, v)
  common.check_blockmap(bm, "mosaic_gpu", lq, lkv, b)
  _check_device(bm, q)
  sinks = common.check_sinks(sinks, h)
  scale = common.default_scale(d, scale)

  backward = _backward_choice(bm)

  def one(q, k, v, u, sinks):
    ln = _launch(q, k, v, bm, u, scale=scale, cap=logits_soft_cap, has_sinks=sinks is not None,
                 interpret=interpret)
    sinks_in = jnp.zeros((q.shape[2],), jnp.float32) if sinks is None else sinks
    if backward == "mosaic_gpu":
      return _own_backward(_backward_plan(bm, ln.cfg), ln.d, q, k, v, sinks_in, ln.ins,
                           jnp.asarray(walk(bm, u, transpose=True)))
    if sinks is not None:
      # flash's backward has no sinks; gradients through this path would miss them.
      return _no_grad_forward(ln.cfg, ln.d, q, k, v, sinks_in, ln.ins)
    forward = functools.partial(_forward_for_flash, ln.cfg, ln.d)
    sub = _single_mask(bm, u)
    return flash.run_with_forward(forward, q, k, v, sub, aux=(sinks_in, *ln.ins), scale=scale,
                                  logits_soft_cap=logits_soft_cap, interpret=interpret)

  return common.per_mask(one, q, k, v, bm, sinks)


def _backward_choice(bm: BlockMap) -> str:
  """`BACKWARD`, checked."""
  if BACKWARD not in BACKWARDS:
    raise MaskValueError(f"maskc.kernels.mosaic_gpu.forward.BACKWARD must be one of "
                         f"{BACKWARDS}, got {BACKWARD!r}")
  return BACKWARD


def _backward_plan(bm: BlockMap, cfg: Config) -> _backward.BwdConfig:
  """The Mosaic GPU backward's plan for `cfg`, or a refusal naming flash."""
  plan = _backward.plan(cfg)
  if plan is None:
    raise _refuse(bm, f"its backward pass: {_backward.refusal(cfg)}")
  return plan


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _own_backward(bc: _backward.BwdConfig, d: int, q, k, v, sinks, ins: Inputs, meta_b):
  """This kernel's output `[B, Lq, H, Dv]`, differentiated (w.r.t. q, k, v and sinks) by the
  Mosaic GPU backward (`BACKWARD = "mosaic_gpu"`)."""
  return padded_forward(bc.fwd, d, q, k, v, sinks, ins)[0]


def _own_backward_fwd(bc, d, q, k, v, sinks, ins, meta_b):
  out, lse = padded_forward(bc.fwd, d, q, k, v, sinks, ins)
  return out, (q, k, v, sinks, out, lse, ins, meta_b)


def _own_backward_bwd(bc, d, res, do):
  q, k, v, sinks, out, lse, ins, meta_b = res
  dq, dk, dv, dsinks = _backward.backward(bc, d, q, k, v, sinks, out, lse, do, ins, meta_b)
  return dq, dk, dv, dsinks, None, None


_own_backward.defvjp(_own_backward_fwd, _own_backward_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _own_backward_lse(bc: _backward.BwdConfig, d: int, q, k, v, ins: Inputs, meta_b):
  """`run_with_lse`'s `(out, lse)`, differentiated through both by the Mosaic GPU backward
  (the lse cotangent enters as `delta − dlse`)."""
  sinks = jnp.zeros((q.shape[2],), jnp.float32)
  return _public_lse(*padded_forward(bc.fwd, d, q, k, v, sinks, ins))


def _own_backward_lse_fwd(bc, d, q, k, v, ins, meta_b):
  sinks = jnp.zeros((q.shape[2],), jnp.float32)
  out, lse = padded_forward(bc.fwd, d, q, k, v, sinks, ins)
  return _public_lse(out, lse), (q, k, v, sinks, out, lse, ins, meta_b)


def _own_backward_lse_bwd(bc, d, res, cts):
  q, k, v, sinks, out, lse, ins, meta_b = res
  do, dlse = cts
  dq, dk, dv, _ = _backward.backward(bc, d, q, k, v, sinks, out, lse, do.astype(q.dtype), ins,
                                     meta_b, dlse=jnp.swapaxes(dlse, 1, 2))
  return dq, dk, dv, None, None


_own_backward_lse.defvjp(_own_backward_lse_fwd, _own_backward_lse_bwd)


def _forward_for_flash(cfg: Config, d: int, q, k, v, sinks, *ins):
  return padded_forward(cfg, d, q, k, v, sinks, Inputs(*ins))


def _single_mask(bm: BlockMap, u: int) -> BlockMap:
  """`bm` as flash's `run_with_forward` takes it: one mask (u) for every head."""
  if bm.head_index is None:
    return bm
  return dataclasses.replace(bm, head_index=(u,) * len(bm.head_index))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _no_grad_forward(cfg: Config, d: int, q, k, v, sinks, ins: Inputs):
  return padded_forward(cfg, d, q, k, v, sinks, ins)[0]


def _no_grad_fwd(cfg, d, q, k, v, sinks, ins):
  return _no_grad_forward(cfg, d, q, k, v, sinks, ins), None


def _no_grad_bwd(cfg, d, res, do):
  raise BackendError("backend 'mosaic_gpu' has no backward pass with sinks by default (flash's "
                     "backward, which it borrows, has none for a foreign forward; "
                     "maskc.kernels.mosaic_gpu.forward.BACKWARD = 'mosaic_gpu' has one, not "
                     "yet run on a GPU)",
                     hint="Use backend='flash' to differentiate attention with sinks.")


_no_grad_forward.defvjp(_no_grad_fwd, _no_grad_bwd)


def run_with_lse(q, k, v, bm, *, scale=None, logits_soft_cap=None, interpret=None):
  """Attention and its log-sum-exp: `(out [B, Lq, H, Dv] f32, lse [B, Lq, H] f32)`.

  The contract of `maskc.kernels.flash.kernel.run_with_lse` (rows with no key: `out = 0`,
  `lse = NEG_LSE`; one mask for every head), with one difference: the kernel stores
  `out` in the inputs' dtype (its output buffer is the q tile's shared memory), and it
  is returned cast to float32. Differentiable (through both outputs) only with
  `BACKWARD = "mosaic_gpu"`; with flash's backward a gradient raises BackendError.
  """
  q, k, v = common.qkv_arrays(q, k, v)
  b, lq, h, lkv, hkv, d = common.check_qkv(q, k, v)
  common.check_blockmap(bm, "mosaic_gpu", lq, lkv, b)
  common.check_one_mask(bm)
  _check_device(bm, q)
  ln = _launch(q, k, v, bm, 0, scale=common.default_scale(d, scale), cap=logits_soft_cap,
               has_sinks=False, interpret=interpret)
  if _backward_choice(bm) == "mosaic_gpu":
    return _own_backward_lse(_backward_plan(bm, ln.cfg), ln.d, q, k, v, ln.ins,
                             jnp.asarray(walk(bm, 0, transpose=True)))
  out, lse = _lse_forward(ln.cfg, ln.d, q, k, v, ln.ins)
  return out, lse


def _public_lse(out, lse):
  """`run_with_lse`'s contract from the kernel's outputs: out in float32, lse `[B, Lq, H]`
  with `NEG_LSE` (not `+inf`) on rows with no key."""
  lse = jnp.where(jnp.isfinite(lse), lse, NEG_LSE)
  return out.astype(jnp.float32), jnp.swapaxes(lse, 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _lse_forward(cfg: Config, d: int, q, k, v, ins: Inputs):
  sinks = jnp.zeros((q.shape[2],), jnp.float32)
  return _public_lse(*padded_forward(cfg, d, q, k, v, sinks, ins))


def _lse_fwd(cfg, d, q, k, v, ins):
  return _lse_forward(cfg, d, q, k, v, ins), None


def _lse_bwd(cfg, d, res, cts):
  raise BackendError("backend 'mosaic_gpu' has no backward pass for run_with_lse with "
                     "flash's backward (maskc.kernels.mosaic_gpu.forward.BACKWARD = "
                     "'mosaic_gpu' has one, not yet run on a GPU)",
                     hint="Use maskc.kernels.flash.kernel.run_with_lse to differentiate through "
                          "the log-sum-exp.")


_lse_forward.defvjp(_lse_fwd, _lse_bwd)
