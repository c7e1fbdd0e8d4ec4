"""cuDNN's flash attention for bands: `jax.nn.dot_product_attention(implementation="cudnn")`.

cuDNN runs `causal` and sliding windows 2× faster than a block-sparse kernel on an
H100 (docs/benchmarks.md), but it takes a mask only as arguments: `is_causal`,
`local_window_size` and per-batch `key_value_seq_lengths`; anything else becomes a dense
bias, which is slower than any block-sparse kernel. So this backend runs exactly the
maps whose compiled facts say band (`BlockMap.band()`: the mask of every head is
`lo <= q - k <= hi`, alone or `& k < n`), and refuses the rest with a `BackendError`
naming `flash`.

The band is over positions `q = q_offset + i`; JAX's causal mask and window are over
indices, top-left aligned (row `i` sees keys `j <= i`). So a band becomes:

| band in indices `lo - q_offset <= i - j <= hi - q_offset` | arguments |
|---|---|
| unbounded both ways (`full`) | none |
| `0 <= i - j` (`causal` at offset 0) | `is_causal=True` |
| `0 <= i - j <= w - 1` (`sliding(w)`) | `is_causal=True, local_window_size=(w - 1, 0)` |

Other bands (a bottom-right causal mask with `q_len < kv_len`, `local(l, r)` with
`r > 0`, strict `k < q`) are refused. Key lengths (`& k < n`) go with an unbounded or
causal band only, so a row loses all its keys only where `n == 0`; those rows are
computed with one key and set to zero, with zero gradients.

Soft caps and sinks do not exist in this API: refused (flash runs them). cuDNN's
log-sum-exp output gets no gradient in JAX's backward rule, so this backend has no
`run_with_lse` and rings (`maskc.sharded_attention`) do not use it.

`attend(..., implementation=)` is the whole backend with the implementation as a
parameter: `run` passes `"cudnn"`, and the CPU tests pass `"xla"` to check the arguments
built from the map against the dense reference with the identical call.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp

from maskc.compiled.blockmap import BlockMap
from maskc.kernels import common, platform as _platform
from maskc.language.errors import BackendError

BLOCK_SIZES = (64, 64)  # the tiles the map is compiled at; cuDNN reads none of them
# The GPU cost model's rates on the map's tile work (cuDNN skips the masked tiles of its
# band itself; `maskc.kernels.api.GPU_COSTS_MEASURED`): forward TFLOP/s, backward TFLOP/s,
# fixed ms a call.
GPU_COST = (597.0, 540.0, 0.05)
BACKWARD_ENGINE = None
run_with_lse = None  # cuDNN's log-sum-exp gets no gradient in JAX's backward rule
installed = common.installed
length_refusal = common.any_length
forward_work = common.tile_work
DTYPES = (jnp.bfloat16, jnp.float16)


def default_blocks(q_len: int, kv_len: int) -> tuple[int, int]:
  """Tile sizes to compile maps at (flash's, so `auto` can fall back to it on the same map)."""
  return common.cap_block(BLOCK_SIZES[0], q_len, 16), common.cap_block(BLOCK_SIZES[1], kv_len, 16)


def arguments(bm: BlockMap) -> dict[str, Any]:
  """`is_causal`, `local_window_size` and `key_value_seq_lengths` for a map's band.

  Raises:
    BackendError: the map is no band cuDNN's arguments express; names `flash`.
  """
  found = bm.band()
  if found is None:
    raise BackendError(
        f"backend 'cudnn' runs bands only (causal, sliding windows, full, with `& k < n`), "
        f"not {_text(bm)}",
        hint="Use backend='flash' (GPU) or 'xla', which run every mask, or 'auto'.")
  lo, hi, lengths = found
  if isinstance(bm.q_offset, jax.core.Tracer):
    raise BackendError("backend 'cudnn' needs a static q_offset (its causal mask is fixed "
                       "at trace time)", hint="Use backend='flash' for a traced offset.")
  offset = int(bm.q_offset)
  lo_i = None if lo is None else lo - offset
  hi_i = None if hi is None else hi - offset
  kw: dict[str, Any] = {}
  if lo_i is None and hi_i is None:
    pass
  elif lo_i == 0 and hi_i is None:
    kw["is_causal"] = True
  elif lo_i == 0 and hi_i is not None and hi_i >= 0 and lengths is None:
    kw.update(is_causal=True, local_window_size=(hi_i, 0))
  else:
    why = ("a window with key lengths" if lo_i == 0 else
           f"its band {lo} <= q - k <= {hi} at q_offset={offset}, which is no top-left "
           f"causal mask or left window in indices")
    raise BackendError(
        f"backend 'cudnn' cannot run {_text(bm)}: {why}",
        hint="cuDNN's masks are top-left causal with a left window; use backend='flash' "
             "(or 'auto', which picks among the engines that can).")
  if lengths is not None:
    kw["key_value_seq_lengths"] = lengths
  return kw


def refusal(bm: BlockMap, *, head_dim: int, dtype: Any, soft_cap: bool = False,
            sinks: bool = False) -> str | None:
  """Why cuDNN cannot run `bm` with such inputs (what `check` would raise), or None."""
  if soft_cap or sinks:
    return "no soft cap or sinks"
  if jnp.dtype(dtype) not in DTYPES:
    return f"runs bfloat16 and float16, not {jnp.dtype(dtype)}"
  if head_dim % 8 or head_dim > 256:
    return f"head dim {head_dim}"
  try:
    arguments(bm)
  except BackendError:
    return "no band cuDNN expresses"
  return None


def _text(bm: BlockMap) -> str:
  return " ; ".join(str(m) for m in bm.masks)


def run(q, k, v, bm, *, scale=None, logits_soft_cap=None, sinks=None, interpret=None):
  """The backend entry point: cuDNN attention `[B, Lq, H, Dv]` for a band map."""
  del interpret
  return attend(q, k, v, bm, implementation="cudnn", scale=scale,
                logits_soft_cap=logits_soft_cap, sinks=sinks)


def check(q, k, v, bm: BlockMap, *, implementation: str = "cudnn",
          logits_soft_cap: float | None = None, sinks: Any = None) -> dict[str, Any]:
  """What `attend` checks before running: the arguments, or a BackendError."""
  b, lq, h, lkv, hkv, d = common.check_qkv(q, k, v)
  common.check_blockmap(bm, "cudnn", lq, lkv, b)
  if logits_soft_cap is not None or sinks is not None:
    what = "a soft cap" if logits_soft_cap is not None else "sinks"
    raise BackendError(f"backend 'cudnn' has no {what} (jax.nn.dot_product_attention "
                       f"takes neither)", hint="Use backend='flash' or 'xla'.")
  if implementation == "cudnn":
    if (where := _platform.platform()) != "gpu":
      # before the dtype: no cast would make it run here
      raise BackendError(f"backend 'cudnn' runs on an NVIDIA GPU, and jax runs on {where} "
                         f"here",
                         hint="Use backend='auto' or 'xla' here, or run on a GPU.")
    dt = jnp.result_type(q)
    if dt not in DTYPES:
      raise BackendError(f"backend 'cudnn' runs bfloat16 and float16, not {dt}",
                         hint="Cast q, k and v, or use backend='flash'.")
    if d % 8 or d > 256 or v.shape[-1] != d:
      raise BackendError(
          f"backend 'cudnn' needs a head dim that is a multiple of 8, at most 256, the same "
          f"for values; got {d} and {v.shape[-1]}", hint="Use backend='flash'.")
  return arguments(bm)


def attend(q, k, v, bm: BlockMap, *, implementation: Literal["cudnn", "xla"] = "cudnn",
           scale: float | None = None, logits_soft_cap: float | None = None,
           sinks: Any = None) -> jax.Array:
  """Attention under a band map through `jax.nn.dot_product_attention`.

  Args:
    q, k, v: `[B, Lq, H, D]`, `[B, Lkv, Hkv, D]`, `[B, Lkv, Hkv, D]` (GQA: `H % Hkv == 0`).
    bm: a compiled map whose facts say band (`BlockMap.band()`).
    implementation: `"cudnn"` on a GPU; `"xla"` runs the identical call anywhere.
    scale: logit scale (default `1 / sqrt(D)`).
    logits_soft_cap, sinks: refused (BackendError), as cuDNN has neither.

  Returns:
    `[B, Lq, H, D]` in q's dtype; rows with no allowed key are zero.
  """
  q, k, v = common.qkv_arrays(q, k, v)
  kw = check(q, k, v, bm, implementation=implementation, logits_soft_cap=logits_soft_cap,
             sinks=sinks)
  b = q.shape[0]
  d = q.shape[-1]
  lengths = kw.pop("key_value_seq_lengths", None)
  empty = None
  if lengths is not None:
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), (b,))
    empty = lengths <= 0
    kw["key_value_seq_lengths"] = jnp.maximum(lengths, 1)
  k, v = k.astype(q.dtype), v.astype(q.dtype)
  try:
    out = jax.nn.dot_product_attention(q, k, v, scale=common.default_scale(d, scale),
                                       implementation=implementation, **kw)
  except (NotImplementedError, RuntimeError) as e:  # no cuDNN here, or a shape it refuses
    raise BackendError(f"backend 'cudnn' cannot run here: {e}",
                       hint="Use backend='flash' (GPU) or 'xla'.") from e
  if empty is not None:
    out = jnp.where(empty[:, None, None, None], jnp.zeros((), out.dtype), out)
  return out.astype(q.dtype)

