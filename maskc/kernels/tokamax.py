"""tokamax's Mosaic GPU flash attention forward, fed one interval of keys per row.

tokamax (openxla/tokamax) ships a flash attention for NVIDIA GPUs written in Pallas
Mosaic GPU (sm80, sm90, sm100). Its masks are per-row key ranges `k_start` (inclusive)
and `k_end` (exclusive). Its forward skips the key blocks outside each query tile's range
and evaluates no mask inside it. So it runs exactly the maps whose rows are one interval
each (`BlockMap.key_intervals()` with `exact=True`: causal, sliding windows,
`causal & chunk(c)`, packed documents declared or proved contiguous,
`causal | bidirectional(img)`, prefix-LM), and refuses the rest with a `BackendError`
naming `flash`.

**Forward tokamax, backward flash.** tokamax's backward (`PallasMosaicGpuFlashAttentionVjp`)
takes the same ranges but does not skip: on an H100 at 32K tokens it took about 52 ms for
every mask, packed documents included, where flash's whole forward+backward takes 7.4 ms
(docs/benchmarks.md). A forward pass cannot know whether a gradient will be taken, so
this backend is one `jax.custom_vjp` (`maskc.kernels.flash.kernel.run_with_forward`): tokamax's
forward, with its residuals (each row's softmax maximum and denominator) turned into the
log-sum-exp flash's backward takes (`lse_from_residuals`), and flash's block-sparse
backward on the same map. Forward-only use runs tokamax alone.

- The intervals go in as `k_start`/`k_end` of tokamax's attention `Mask` (the class its
  ops take, `tokamax._src.ops.attention.base.Mask`; tokamax exports no other way to pass
  them), with one row of intervals per batch row, shared by the heads. The kernel class
  is `tokamax.ops.gpu.PallasMosaicFlashAttention`, imported from its own module, since
  `tokamax.ops.gpu` also imports jax_triton for its Triton ops.
- bfloat16 and float16. float32 is refused: tokamax runs float32 at TF32, which its
  Mosaic kernel then rejects (`Unsupported precision: TF32_TF32_F32`).
- Rows with no key are given key 0 to attend to (a finite softmax), set to zero
  afterwards, and given `lse = +inf`, so their outputs and gradients are zero.
- Soft caps go through (flash's backward applies the same cap); sinks do not exist in
  tokamax's kernel and are refused. There is no `run_with_lse`, so rings
  (`maskc.sharded_attention`) do not use this backend.
- `attend(..., op)` is the whole backend with tokamax's op as a parameter: `run` passes
  the Mosaic GPU kernel, and the CPU tests pass tokamax's XLA reference, which returns
  its residuals in the same convention.
- tokamax is an optional dependency, imported on first use; without it, or off an
  NVIDIA GPU, the backend raises `BackendError`. tokamax checks for a GPU when it traces,
  so the Mosaic kernel cannot be lowered for CUDA from a CPU-only machine: it runs in
  `tests/test_gpu.py` only.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maskc.compiled.blockmap import BlockMap
from maskc.kernels import common
from maskc.kernels.flash import kernel as flash
from maskc.language.errors import BackendError

BLOCK_SIZES = (64, 64)  # the tiles the map is compiled at (flash's); tokamax picks its own
# The GPU cost model's rates on its key-interval work (`forward_work`;
# `maskc.kernels.api.GPU_COSTS_MEASURED`): forward TFLOP/s, backward TFLOP/s, fixed ms a
# call. Its own backward (185 TFLOP/s, an earlier run that day) does not skip key blocks,
# so its gradients run flash's backward on the same map (`BACKWARD_ENGINE`), and the cost
# model prices them at flash's rate: the 185 is never used.
GPU_COST = (549.0, 185.0, 0.05)
BACKWARD_ENGINE = "flash"
run_with_lse = None  # rings (`maskc.sharded_attention`) do not use this backend
length_refusal = common.any_length
ROWS = 128  # the q rows tokamax's kernel takes per block, over one hull of key intervals


def default_blocks(q_len: int, kv_len: int) -> tuple[int, int]:
  """Tile sizes to compile maps at (flash's, so `auto` can fall back to it on the same map)."""
  return common.cap_block(BLOCK_SIZES[0], q_len, 16), common.cap_block(BLOCK_SIZES[1], kv_len, 16)


def installed() -> bool:
  """Whether tokamax can be imported (without importing it)."""
  return importlib.util.find_spec("tokamax") is not None


def refusal(bm: BlockMap, *, head_dim: int | None = None, dtype: Any = None,
            soft_cap: bool = False, sinks: bool = False) -> str | None:
  """Why this backend cannot run `bm`, or None when it can (tokamax's presence apart; soft
  caps go through)."""
  if sinks:
    return "tokamax's kernel has no sinks"
  if bm.heads is not None and len(set(bm.head_index or ())) > 1:
    return "tokamax takes one interval per row for every head, and the heads' masks differ"
  if dtype is not None and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    # its float32 path asks for TF32 dots, which its Mosaic GPU kernel then refuses
    # ("Unsupported precision: TF32_TF32_F32", H100, tokamax 0.0.17)
    return (f"tokamax's Mosaic GPU kernel runs bfloat16 and float16, not "
            f"{jnp.dtype(dtype)} (cast q, k and v to bfloat16, or use backend='flash')")
  if head_dim is not None and (head_dim % 8 or head_dim > 256):
    return f"tokamax needs a head dim that is a multiple of 8, at most 256, got {head_dim}"
  if not bm.key_intervals()[2]:
    return ("its rows are not one exact interval of keys each (declare segment ids "
            "contiguous under jit: maskc.compile(..., contiguous=['seg']))")
  return None


def forward_work(bm: BlockMap, head_dim: int) -> float:
  """The forward FLOPs per batch row and head: each 128-row block's hull of key intervals
  (tokamax's kernel skips the key blocks outside it). A traced map counts its tiles."""
  if not bm.is_static:
    return common.tile_work(bm, head_dim)
  lead = int(np.prod(bm.lead_shape or (1,)))
  start, stop, _ = bm.key_intervals()
  n = -(-bm.q_len // ROWS)
  pad = n * ROWS - bm.q_len
  lo = np.pad(np.asarray(start), [(0, 0)] * (start.ndim - 1) + [(0, pad)], mode="edge")
  hi = np.pad(np.asarray(stop), [(0, 0)] * (stop.ndim - 1) + [(0, pad)], mode="edge")
  lo = lo.reshape(lo.shape[:-1] + (n, ROWS)).min(-1)
  hi = hi.reshape(hi.shape[:-1] + (n, ROWS)).max(-1)
  return float(4.0 * ROWS * np.maximum(hi - lo, 0).sum() * head_dim / lead)


def run(q, k, v, bm, *, scale=None, logits_soft_cap=None, sinks=None, interpret=None):
  """The backend entry point: tokamax's forward, flash's backward, `[B, Lq, H, Dv]`."""
  q, k, v = common.qkv_arrays(q, k, v)
  b, lq, h, lkv, _, d = common.check_qkv(q, k, v)
  common.check_blockmap(bm, "tokamax", lq, lkv, b)
  why = refusal(bm, head_dim=d, dtype=q.dtype, sinks=sinks is not None)
  if why is not None:
    raise BackendError(f"backend 'tokamax' cannot run {_text(bm)}: {why}",
                       hint="Use backend='flash' (GPU) or 'xla', which run every mask.")
  try:
    # tokamax.ops.gpu exports the same class, but imports jax_triton (and Triton) for
    # its other ops; the attention module needs neither
    kernel = importlib.import_module("tokamax._src.ops.attention.pallas_mosaic_gpu")
  except ImportError as e:
    raise BackendError("backend 'tokamax' needs tokamax (pip install tokamax)",
                       hint="Use backend='flash' or 'cudnn' on a GPU.") from e
  try:
    return attend(q, k, v, bm, interval_op(kernel.PallasMosaicGpuFlashAttention()),
                  scale=scale, logits_soft_cap=logits_soft_cap, interpret=interpret)
  except NotImplementedError as e:  # no Mosaic GPU here, or a shape it does not take
    raise BackendError(f"backend 'tokamax' cannot run here: {e}",
                       hint="Use backend='flash' (GPU) or 'xla'.") from e


IntervalOp = Callable[..., tuple[jax.Array, tuple[jax.Array, jax.Array]]]


def interval_op(op: Any) -> IntervalOp:
  """A tokamax attention op (a `DotProductAttention`) as `attend` calls it.

  `interval_op(op)(q, k, v, k_start, k_end, *, logits_scale, logits_soft_cap)` returns
  `(out, (m, l))`: `op`'s output and residuals for the mask `k_start <= k < k_end`
  (`[B, 1, Lq]` each, shared by the heads).
  """
  base = importlib.import_module("tokamax._src.ops.attention.base")

  def call(q, k, v, k_start, k_end, *, logits_scale, logits_soft_cap):
    return op(q, k, v, mask=base.Mask(k_start=k_start, k_end=k_end), logits_scale=logits_scale,
              logits_soft_cap=logits_soft_cap, return_residuals=True)
  return call


def attend(q: jax.Array, k: jax.Array, v: jax.Array, bm: BlockMap, op: IntervalOp, *,
           scale: float | None = None, logits_soft_cap: float | None = None,
           interpret: bool | None = None) -> jax.Array:
  """The backend with tokamax's op as a parameter: `op`'s forward, flash's backward.

  `run` passes tokamax's Mosaic GPU kernel (`interval_op`); the CPU tests pass tokamax's
  XLA reference (`base.DotProductAttention`, whose residuals follow the same convention),
  or a jax.numpy function written from that convention. The map must be one `refusal`
  accepts (`run` checks).
  """
  scale = common.default_scale(q.shape[-1], scale)
  start, stop, _ = bm.key_intervals()
  start = _per_batch(jnp.asarray(start, jnp.int32), bm)
  stop = _per_batch(jnp.asarray(stop, jnp.int32), bm)
  forward = functools.partial(_forward, op, scale, logits_soft_cap)
  return flash.run_with_forward(forward, q, k, v, bm, aux=(start, stop), scale=scale,
                                logits_soft_cap=logits_soft_cap, interpret=interpret)


def _forward(op: IntervalOp, scale: float, cap: float | None, q: jax.Array, k: jax.Array,
             v: jax.Array, start: jax.Array, stop: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`op` on the intervals `[B or 1, Lq]`: `(out, lse [B, H, Lq])` as flash's backward takes
  them (`maskc.kernels.flash.kernel.run_with_forward`)."""
  b, lq = q.shape[0], q.shape[1]
  empty = jnp.broadcast_to(stop <= start, (b, lq))
  # a row with no key attends to key 0 (finite) and is zeroed below
  lo = jnp.broadcast_to(jnp.where(empty, 0, start), (b, lq))[:, None, :]
  hi = jnp.broadcast_to(jnp.where(empty, 1, stop), (b, lq))[:, None, :]
  out, (m, l) = op(q, k.astype(q.dtype), v.astype(q.dtype), lo, hi, logits_scale=scale,
                   logits_soft_cap=cap)
  out = jnp.where(empty[:, :, None, None], jnp.zeros((), out.dtype), out).astype(q.dtype)
  return out, lse_from_residuals(m, l, empty[:, None, :])


def lse_from_residuals(m: jax.Array, l: jax.Array, empty: jax.Array) -> jax.Array:
  """Each row's log-sum-exp `[B, H, Lq]` from tokamax's residuals, `+inf` where `empty`.

  tokamax's attention residuals (`tokamax._src.ops.attention.base.Residuals`) are the
  row's softmax maximum `m` and denominator `l = sum_j exp(s_ij - m)`, both in natural
  units of the scaled (soft-capped) logits `s` (the Mosaic kernels compute in base 2 and
  convert `m` back); without a stable softmax `m` is 0 and `l = sum_j exp(s_ij)`. Either
  way `lse = m + log(l)`, the convention of flash's backward, where `+inf` gives a row
  no weight.
  """
  lse = m.astype(jnp.float32) + jnp.log(l.astype(jnp.float32))
  return jnp.where(empty, jnp.inf, lse)


def _per_batch(x: jax.Array, bm: BlockMap) -> jax.Array:
  """Intervals `[B?, H?, Lq]` → `[B or 1, Lq]` (the heads share one mask)."""
  if bm.heads is not None:
    x = x[..., 0, :]
  return x if bm.batch is not None else x[None]


def _text(bm: BlockMap) -> str:
  return " ; ".join(str(m) for m in bm.masks)
