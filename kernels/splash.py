"""Adapter to JAX's splash attention: our MaskInfo, splash's TPU kernel.

The kernel is JAX's `SplashAttentionKernel`, built from `BlockMap.splash()`
(`maskc._splash_info`) rather than from splash's `process_mask`, so building it
costs the mask's partial tiles, not its whole grid. On CPU it runs in Pallas
interpret mode.

What splash can take:
- a static mask without batched operands: its MaskInfo, with partial tiles
  stored or, for masks of positions and scalars, evaluated in the kernel;
- `document(s)` alone or `& ` masks that read no operands, with `s` batched or
  traced: splash `SegmentIds` per batch row, the rest as a static MaskInfo;
- a traced mask without a batch axis: splash's dynamic MaskInfo (every tile stored).
Anything else (batched operands other than segment ids) raises `BackendError`
naming `xla` and `flash`. Lengths must be multiples of the tiles, and `block_kv`
a multiple of 128 (splash's lane width).

Splash returns NaN or a mean of values for rows with no allowed key; the adapter
always passes sink logits (a very negative one when the caller has none), which
makes those rows exactly zero in the kernel, with zero gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

from maskc import _ir as ir
from maskc._errors import BackendError, MaskValueError
from maskc.kernels import _common as common

LANES = 128
# A sink logit that never wins against a real one but keeps empty rows at 0/1 = 0.
_NO_SINK = -1e30


def default_blocks(q_len: int, kv_len: int) -> tuple[int, int]:
  """The largest of 512, 256, 128 dividing each length (128 when none does)."""
  def pick(n):
    return next((b for b in (512, 256, 128) if n % b == 0), 128)
  return pick(q_len), pick(kv_len)


def _check_tiles(q_len: int, kv_len: int, bq: int, bk: int) -> None:
  if q_len % bq or kv_len % bk:
    raise MaskValueError(
        f"splash needs lengths that are multiples of the tile sizes, got q_len={q_len}, "
        f"block_q={bq}, kv_len={kv_len}, block_kv={bk}",
        hint="Pad the sequences, pick tiles that divide them, or use backend='xla' or "
             "'flash', which take any length.")
  if bk % LANES:
    raise MaskValueError(f"splash needs block_kv to be a multiple of {LANES}, got {bk=}",
                         hint="Use block_kv=128 (or 256, 512), or backend='xla' or 'flash'.")


def _document_split(m: ir.Mask):
  """`(segment operand name, rest)` when `m` is `document(s)` and operand-free masks, else None."""
  items = m.items if isinstance(m, ir.And) else (m,)
  docs = [i for i in items if isinstance(i, ir.Call) and i.name == "document"
          and i.definition.prelude and isinstance(i.args[0], ir.Operand)]
  if len(docs) != 1:
    return None
  rest = [i for i in items if i is not docs[0]]
  if any(i.operands for i in rest):
    return None
  rest_mask = ir.and_(rest) if rest else ir.BoolConst(True)
  return docs[0].args[0].name, rest_mask


def _plan(bm):
  """How splash runs this map: `(BlockMap for MaskInfo, segment name or None)`."""
  needs_split = bm.batch is not None or not bm.is_static
  if not needs_split:
    return bm, None
  if len(bm.masks) == 1:
    split = _document_split(bm.masks[0])
    if split is not None and not isinstance(bm.q_offset, jax.core.Tracer):
      name, rest = split
      from maskc._lower import compile as compile_mask
      sub = compile_mask(rest, bm.q_len, bm.kv_len, block_q=bm.block_q, block_kv=bm.block_kv,
                         q_offset=int(bm.q_offset))
      return sub, name
  if bm.batch is None:
    return bm, None                                 # traced: splash's dynamic MaskInfo
  raise BackendError(
      f"splash cannot run `{'; '.join(str(m) for m in bm.masks)}` with batched operands: its "
      "MaskInfo has no batch axis, and only `document(s)` (optionally `&` masks without "
      "operands) becomes splash SegmentIds",
      hint="Use backend='xla' (any mask) or backend='flash'.")


@functools.lru_cache(maxsize=32)
def _static_infos(bm):
  return bm.splash()


def _kernel(bm, cap, interpret: bool):
  infos = _static_infos(bm) if bm.is_static else bm.splash()
  fwd, dq, dkv, fn = infos
  to_jax = lambda info: jax.tree_util.tree_map(jnp.asarray, info)
  bq, bk = bm.block_q, bm.block_kv
  sizes = sk.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq,
                        block_kv_dkv=bk, block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
  return sk.SplashAttentionKernel(
      to_jax(fwd), to_jax(dq), to_jax(dkv), block_sizes=sizes, is_mqa=False,
      save_residuals=False, mask_value=sk.DEFAULT_MASK_VALUE, attn_logits_soft_cap=cap,
      residual_checkpoint_name=None, mask_function=fn, interpret=interpret)


def run(q, k, v, bm, *, scale=None, logits_soft_cap=None, sinks=None, interpret=None):
  """The backend entry point: attention `[B, Lq, H, Dv]` through JAX's splash kernel."""
  b, lq, h, lkv, _, d = common.check_qkv(q, k, v)
  common.check_blockmap(bm, "splash", lq, lkv, b)
  if bm.heads is not None and bm.heads != h:
    raise MaskValueError(f"the mask has {bm.heads} heads but q has {h}")
  _check_tiles(lq, lkv, bm.block_q, bm.block_kv)
  if interpret is None:
    from maskc.kernels.api import platform
    interpret = platform() != "tpu"
  sinks = common.check_sinks(sinks, h)
  if sinks is None:
    sinks = jnp.full((h,), _NO_SINK, jnp.float32)
  scale = common.default_scale(d, scale)
  info_bm, segment = _plan(bm)
  kernel = _kernel(info_bm, logits_soft_cap, bool(interpret))

  qh = jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2)      # [B, H, Lq, D]
  kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  if segment is None:
    out = jax.vmap(lambda q, k, v: kernel(q, k, v, sinks=sinks))(qh, kh, vh)
  else:
    seg = common.kernel_operands(bm)[segment]                   # [B' , L]
    qpos = jnp.clip(jnp.arange(lq, dtype=jnp.int32) + bm.q_offset, 0, seg.shape[-1] - 1)
    ids = sk.SegmentIds(q=seg[:, qpos], kv=seg[:, jnp.clip(jnp.arange(lkv), 0,
                                                           seg.shape[-1] - 1)])
    axis = 0 if seg.shape[0] == b and bm.batch is not None else None
    if axis is None:
      ids = sk.SegmentIds(q=ids.q[0], kv=ids.kv[0])
    out = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids, sinks=sinks),
                   in_axes=(0, 0, 0, axis))(qh, kh, vh, ids)
  return jnp.swapaxes(out, 1, 2).astype(q.dtype)


__all__ = ["run", "default_blocks"]
