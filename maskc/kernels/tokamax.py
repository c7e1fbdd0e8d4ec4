"""tokamax's Mosaic GPU flash attention, fed one interval of keys per row.

tokamax (openxla/tokamax) ships a flash attention for NVIDIA GPUs written in Pallas
Mosaic GPU (sm80, sm90, sm100; forward and backward) that reaches 640 TFLOP/s forward on
an H100. Its masks are per-row key ranges `k_start` (inclusive) and `k_end` (exclusive):
it skips the key blocks outside each query tile's range and evaluates no mask inside it.
So it runs exactly the maps whose rows are one interval each (`BlockMap.key_intervals()`
with `exact=True`: causal, sliding windows, `causal & chunk(c)`, packed documents
declared or proved contiguous, `causal | bidirectional(img)`, prefix-LM), and refuses
the rest with a `BackendError` naming `flash`.

- The intervals go in as `k_start`/`k_end` of tokamax's attention `Mask` (the class its
  ops take, `tokamax._src.ops.attention.base.Mask`; tokamax exports no other way to pass
  them), with one row of intervals per batch row, shared by the heads. The kernel class
  is `tokamax.ops.gpu.PallasMosaicFlashAttention`, imported from its own module, since
  `tokamax.ops.gpu` also imports jax_triton for its Triton ops.
- Rows with no key are given key 0 to attend to (a finite softmax) and set to zero
  afterwards, so their outputs and gradients are zero.
- Soft caps go through; sinks do not exist in tokamax's kernel and are refused.
  tokamax's residuals get no gradient, so there is no `run_with_lse` and rings
  (`maskc.sharded_attention`) do not use it.
- tokamax is an optional dependency, imported on first use; without it, or off an
  NVIDIA GPU, the backend raises `BackendError`. tokamax checks for a GPU when it traces,
  so this backend cannot be lowered for CUDA from a CPU-only machine, and its tests run
  on a GPU only (`tests/test_gpu.py`).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import jax
import jax.numpy as jnp

from maskc.compiled.blockmap import BlockMap
from maskc.kernels import common
from maskc.language.errors import BackendError

BLOCK_SIZES = (64, 64)  # the tiles the map is compiled at (flash's); tokamax picks its own


def default_blocks(q_len: int, kv_len: int) -> tuple[int, int]:
  """Tile sizes to compile maps at (flash's, so `auto` can fall back to it on the same map)."""
  return common.cap_block(BLOCK_SIZES[0], q_len, 16), common.cap_block(BLOCK_SIZES[1], kv_len, 16)


def installed() -> bool:
  """Whether tokamax can be imported (without importing it)."""
  return importlib.util.find_spec("tokamax") is not None


def refusal(bm: BlockMap, *, head_dim: int | None = None, dtype: Any = None,
            sinks: bool = False) -> str | None:
  """Why this backend cannot run `bm`, or None when it can (tokamax's presence apart)."""
  if sinks:
    return "tokamax's kernel has no sinks"
  if bm.heads is not None and len(set(bm.head_index or ())) > 1:
    return "tokamax takes one interval per row for every head, and the heads' masks differ"
  if dtype is not None and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
    return f"tokamax runs bfloat16, float16 and float32, not {jnp.dtype(dtype)}"
  if head_dim is not None and (head_dim % 8 or head_dim > 256):
    return f"tokamax needs a head dim that is a multiple of 8, at most 256, got {head_dim}"
  if not bm.key_intervals()[2]:
    return ("its rows are not one exact interval of keys each (declare segment ids "
            "contiguous under jit: maskc.compile(..., contiguous=['seg']))")
  return None


def run(q, k, v, bm, *, scale=None, logits_soft_cap=None, sinks=None, interpret=None):
  """The backend entry point: tokamax attention `[B, Lq, H, Dv]` for an interval map."""
  del interpret
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
    base = importlib.import_module("tokamax._src.ops.attention.base")
  except ImportError as e:
    raise BackendError("backend 'tokamax' needs tokamax (pip install tokamax)",
                       hint="Use backend='flash' or 'cudnn' on a GPU.") from e
  start, stop, _ = bm.key_intervals()
  start, stop = _per_batch(jnp.asarray(start), bm), _per_batch(jnp.asarray(stop), bm)
  empty = stop <= start
  # a row with no key attends to key 0 (finite) and is zeroed below
  start = jnp.where(empty, 0, start)
  stop = jnp.where(empty, 1, stop)
  start = jnp.broadcast_to(start, (b, lq))[:, None, :]
  stop = jnp.broadcast_to(stop, (b, lq))[:, None, :]
  mask = base.Mask(k_start=start, k_end=stop)
  op = kernel.PallasMosaicGpuFlashAttention()
  k, v = k.astype(q.dtype), v.astype(q.dtype)
  try:
    out = op(q, k, v, mask=mask, logits_scale=common.default_scale(d, scale),
             logits_soft_cap=logits_soft_cap)
  except NotImplementedError as e:  # no Mosaic GPU here, or a shape it does not take
    raise BackendError(f"backend 'tokamax' cannot run here: {e}",
                       hint="Use backend='flash' (GPU) or 'xla'.") from e
  keep = jnp.broadcast_to(~empty, (b, lq))[:, :, None, None]
  return jnp.where(keep, out, jnp.zeros((), out.dtype)).astype(q.dtype)


def _per_batch(x: jax.Array, bm: BlockMap) -> jax.Array:
  """Intervals `[B?, H?, Lq]` → `[B or 1, Lq]` (the heads share one mask)."""
  if bm.heads is not None:
    x = x[..., 0, :]
  return x if bm.batch is not None else x[None]


def _text(bm: BlockMap) -> str:
  return " ; ".join(str(m) for m in bm.masks)
