"""Adapter to tokamax's splash attention (MaxText's): our MaskInfo, tokamax's TPU kernel.

tokamax (`tokamax._src.ops.experimental.tpu.splash_attention`) carries its own
splash kernel: a compacted schedule of active tiles instead of JAX splash's
dense grid, a fused backward (dq, dk and dv in one kernel), and 2-D masks only.
The kernel here is tokamax's `SplashAttentionKernel`, built from
`tokamax_mask_info(bm)` (`maskc.kernels.splash.tokamax_info`), never from
tokamax's `process_mask`, so building it costs the mask's partial tiles, not
its whole grid. On CPU it runs in Pallas interpret mode. tokamax needs Python
3.12 and jax 0.11.1 or later (`pip install -e ".[tokamax]"`); this module is the
only one of maskc that imports it.

What it runs, as the JAX splash adapter (`maskc.kernels.splash.jax_kernel`) does:
- a static mask without batched operands: its compacted MaskInfo, with partial
  tiles stored or, for masks of positions and scalars, evaluated in the kernel;
- a mask whose segment conjuncts `s[q] == s[k]` read batched or traced ids, with
  its other conjuncts static and unbatched: tokamax `SegmentIds` per batch row,
  the rest as the static MaskInfo the compiler prepared;
- a traced mask without a batch axis: tokamax's dynamic layout (every tile's
  block stored, the schedule's length traced).
A per-head map runs one kernel per distinct mask, over that mask's heads.
Other batched operands raise `BackendError` naming `xla` and `flash`.
`block_q` and `block_kv` must be multiples of 128 (tokamax's own constraint).

Any length: padded to whole tiles as in `maskc.kernels.splash.jax_kernel` (padding keys
are masked by the predicate, padding rows dropped). Rows with no allowed key
are exactly zero, with zero gradients: the adapter always passes sink logits
(a very negative one when the caller has none), and schedules a write-only
step for q tiles without any active tile, which tokamax's own `process_mask`
leaves unwritten.

On a mesh: `make_kernel(bm, q_seq_shards=)` returns tokamax's kernel object,
sharded with `kernel.manual_sharding_spec(NamedSharding(mesh, P(q_seq_axis)))`
as tokamax's `make_splash_mha(..., q_seq_shards=)`. tokamax's MaskInfo has no
head axis, so heads shard without touching it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from tokamax._src.ops.experimental.tpu.splash_attention import (  # type: ignore[import-not-found, import-untyped, unused-ignore]
  splash_attention_kernel as tk,
  splash_attention_mask as tm,
)

from maskc.compiled.blockmap import BlockMap
from maskc.kernels import common
from maskc.kernels.platform import platform
from maskc.kernels.splash.jax_kernel import (  # the backend protocol: as JAX's splash
  BACKWARD_ENGINE as BACKWARD_ENGINE,
  GPU_COST as GPU_COST,
  LANES as LANES,
  checked_inputs,
  default_blocks,
  forward_work as forward_work,
  head_major,
  installed as installed,
  length_refusal as length_refusal,
  padded_map,
  plan,
  refusal as refusal,
)
from maskc.kernels.splash.masks import adapted, adapters
from maskc.kernels.splash.tokamax_info import tokamax_mask_info
from maskc.kernels.xla import NEG_LSE
from maskc.language.errors import MaskValueError

# The backend protocol as JAX's splash declares it (`LANES`, `GPU_COST`, `refusal`, ...)
# comes with the imports above: the two kernels take the same maps.
# A sink logit that never wins against a real one but keeps empty rows at 0/1 = 0; it is
# also the log-sum-exp of an empty row, which `run_with_lse` returns as is.
_NO_SINK = NEG_LSE
# tokamax's default, far below `_NO_SINK * log2(e)`: masked logits never beat the sink.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def _check_tiles(bq: int, bk: int) -> None:
  if bq % LANES or bk % LANES:
    raise MaskValueError(
        f"tokamax's splash needs block_q and block_kv to be multiples of {LANES}, got "
        f"{bq=}, {bk=}", hint="Use tiles of 128, 256 or 512, or backend='xla' or 'flash'.")


@functools.lru_cache(maxsize=32)
def _static_infos(bm: BlockMap, mask: int, q_seq_shards: int):
  return tokamax_mask_info(bm, mask=mask, q_seq_shards=q_seq_shards)


def _kernel(bm: BlockMap, mask: int, cap: float | None, interpret: bool,
            q_seq_shards: int = 1) -> tk.SplashAttentionKernel:
  """tokamax's kernel for distinct mask `mask` of `bm` (lengths already whole tiles)."""
  if bm.is_static:
    fwd, dkv, fn = _static_infos(bm, mask, q_seq_shards)
  else:
    fwd, dkv, fn = tokamax_mask_info(bm, mask=mask)
  bq, bk = bm.block_q, bm.block_kv
  config = tk.SplashConfig(
      block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
      block_kv_dkv_compute=bk, attn_logits_soft_cap=cap, interpret=interpret,
      dq_reduction_steps=None if dkv.active_rows is None and bm.is_static else 3)
  return tk.SplashAttentionKernel(
      _to_jax(fwd), _to_jax(dkv), config=config, is_mqa=False, save_residuals=False,
      mask_value=_MASK_VALUE, mask_function=fn, fwd_mask_sparsity=_sparsity(fwd),
      dkv_mask_sparsity=_sparsity(dkv))


def _to_jax(info) -> tk.MaskInfo:
  """tokamax's `MaskInfo` of a `CompactMaskInfo`: the same fields, as jax arrays."""
  return tk.MaskInfo(*(None if a is None else jnp.asarray(a) for a in info))


def _sparsity(info) -> float:
  """tokamax's cost-estimate hint: the share of scheduled steps (1.0 when unknown)."""
  if info.block_mask is None or not isinstance(info.block_mask, np.ndarray):
    return 1.0
  return float(np.mean(info.block_mask != 0))


def make_kernel(bm: BlockMap, *, q_seq_shards: int = 1, logits_soft_cap: float | None = None,
                interpret: bool | None = None) -> tk.SplashAttentionKernel:
  """tokamax's `SplashAttentionKernel` for a compiled map of one mask, laid out for a mesh.

  What tokamax's `make_splash_mha(mask, config=, q_seq_shards=)` returns, with
  the MaskInfo from the BlockMap (`tokamax_mask_info(bm, q_seq_shards=)`).
  Use it as tokamax's own: one batch row is `kernel(q, k, v)` with
  `q [H, Lq, D]` already scaled, `k, v [Hkv, Lkv, D]`, optional `segment_ids=`
  (`tk.SegmentIds`) and `sinks=`. On a mesh, shard its MaskInfo with
  `kernel.manual_sharding_spec(NamedSharding(mesh, P("seq")))` (tokamax shards
  its MaskInfo over the q sequence only; heads need no MaskInfo layout).
  Rows with no allowed key get what tokamax gives them: pass a very negative
  `sinks` entry per head, as `run` does, to make them zero.

  Args:
    bm: a map of one mask for every head, without a batch axis (static or
      traced), whose lengths are multiples of its tiles, both multiples of 128.
    q_seq_shards: the mesh's shards of the q sequence; they must divide the q
      tiles. A traced map takes 1.
    logits_soft_cap: tokamax's `attn_logits_soft_cap`.
    interpret: Pallas interpret mode (default: off on TPU only).

  Raises:
    MaskValueError: lengths or tiles tokamax cannot take, shards that do not
      divide the q tiles, or a map of several head masks.
    BackendError: the map has a batch axis.

  >>> import maskc
  >>> from maskc.kernels.splash.tokamax_kernel import make_kernel
  >>> bm = maskc.compile("causal", 512, block_q=128, block_kv=128)
  >>> make_kernel(bm, q_seq_shards=2).fwd_mask_info.num_active_blocks.tolist()
  [3, 7]
  """
  if not isinstance(bm, BlockMap):
    raise MaskValueError("make_kernel needs a compiled BlockMap (maskc.compile)")
  _check_tiles(bm.block_q, bm.block_kv)
  if bm.head_index is not None:
    raise MaskValueError(
        f"tokamax's splash takes one 2-D mask per kernel; this map has {len(bm.masks)} head "
        "masks", hint="Compile each head group's mask on its own, or call `run`, which runs one "
                      "kernel per distinct mask.")
  if interpret is None:
    interpret = platform() != "tpu"
  return _kernel(bm, 0, logits_soft_cap, bool(interpret), q_seq_shards)


def run(q: jax.Array, k: jax.Array, v: jax.Array, bm: BlockMap, *, scale: float | None = None,
        logits_soft_cap: float | None = None, sinks: ArrayLike | None = None,
        interpret: bool | None = None) -> jax.Array:
  """The backend entry point: attention `[B, Lq, H, Dv]` through tokamax's splash kernel."""
  call = _prepare(q, k, v, bm, scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
                  interpret=interpret)
  outs = []
  for kernel, heads in call.groups:
    qh, kh, vh, sk = call.heads(heads)
    outs.append(call.vmapped(lambda q, k, v, ids, s, kern=kernel: kern(q, k, v, segment_ids=ids,
                                                                      sinks=s), qh, kh, vh, sk))
  out = call.merge(outs)                                      # [B, H, Lq_pad, Dv]
  return jnp.swapaxes(out, 1, 2)[:, :q.shape[1]].astype(q.dtype)


def run_with_lse(q: jax.Array, k: jax.Array, v: jax.Array, bm: BlockMap, *,
                 scale: float | None = None, logits_soft_cap: float | None = None,
                 interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """Attention and its log-sum-exp: `(out [B, Lq, H, Dv] f32, lse [B, Lq, H] f32)`.

  The contract of `maskc.kernels.xla.run_with_lse`, with tokamax's kernel: for
  combining partial attentions over disjoint key sets exactly (ring attention).
  Rows with no allowed key have `out = 0` and `lse = NEG_LSE`. One mask for
  every head. Differentiable w.r.t. q, k and v through both outputs.

  tokamax returns the log-sum-exp (`save_residuals=True`) but its backward drops
  the log-sum-exp's cotangent (it is a stop-gradient statistic there). So this
  wraps tokamax's forward kernel and fused backward kernel in a custom_vjp of
  its own (`_tokamax_lse`) whose backward passes `delta - dlse` where tokamax
  passes `delta = rowsum(out * do)` (`∂ lse_i / ∂ s_ij = p_ij`, so
  `ds = p (dp - delta + dlse)`). Those kernels are private to tokamax
  (`_splash_attention_forward`, `_splash_attention_bwd_dkv`); a tokamax that
  renames them fails loudly here rather than returning wrong gradients.
  """
  call = _prepare(q, k, v, bm, scale=scale, logits_soft_cap=logits_soft_cap, sinks=None,
                  interpret=interpret)
  common.check_one_mask(bm)
  ((kern, _),) = call.groups
  kw = kern.kwargs
  static = _LseStatic(config=kw["config"], mask_value=kw["mask_value"],
                      mask_function=kw["mask_function"],
                      fwd_sparsity=kw["fwd_mask_sparsity"], dkv_sparsity=kw["dkv_mask_sparsity"])
  out, lse = call.vmapped(
      lambda q, k, v, ids, s: _tokamax_lse(static, kern.fwd_mask_info, kern.dkv_mask_info, q, k,
                                           v, ids, s), call.qh, call.kh, call.vh, call.sinks)
  lq = q.shape[1]
  return (jnp.swapaxes(out, 1, 2)[:, :lq].astype(jnp.float32),
          jnp.swapaxes(lse, 1, 2)[:, :lq].astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class _Call:
  """tokamax kernels (one per distinct mask, with its heads) and the padded, head-major inputs."""
  groups: tuple[tuple[tk.SplashAttentionKernel, np.ndarray | None], ...]
  qh: jax.Array                     # [B, H, Lq_pad, D]
  kh: jax.Array                     # [B, Hkv, Lkv_pad, D]
  vh: jax.Array
  ids: tk.SegmentIds | None
  ids_axis: int | None
  sinks: jax.Array                  # [H]

  def heads(self, heads: np.ndarray | None):
    """q, k, v and sinks of these query heads (all for None), one KV head per query head."""
    if heads is None:
      return self.qh, self.kh, self.vh, self.sinks
    group = self.qh.shape[1] // self.kh.shape[1]
    kv = jnp.asarray(heads // group)
    return (self.qh[:, jnp.asarray(heads)], self.kh[:, kv], self.vh[:, kv],
            self.sinks[jnp.asarray(heads)])

  def merge(self, outs: list[jax.Array]) -> jax.Array:
    """The groups' outputs `[B, h_g, L, Dv]` back in head order."""
    if len(outs) == 1 and self.groups[0][1] is None:
      return outs[0]
    order = np.concatenate([h for _, h in self.groups])
    return jnp.concatenate(outs, axis=1)[:, np.argsort(order)]

  def vmapped(self, fn, qh, kh, vh, sinks):
    """`fn(q, k, v, segment_ids, sinks)` of one batch row, over the batch."""
    return jax.vmap(lambda q, k, v, ids: fn(q, k, v, ids, sinks),
                    in_axes=(0, 0, 0, self.ids_axis))(qh, kh, vh, self.ids)


def _prepare(q, k, v, bm, *, scale, logits_soft_cap, sinks, interpret) -> _Call:
  """Checks, the kernels for `bm` and the padded, head-major inputs (see the module doc)."""
  _check_tiles(bm.block_q, bm.block_kv)
  scale, sinks, interpret = checked_inputs(q, k, v, bm, "splash_tokamax", scale=scale,
                                           sinks=sinks, interpret=interpret)
  info_bm, segment = plan(bm)
  padded = padded_map(info_bm)
  groups: tuple[tuple[tk.SplashAttentionKernel, np.ndarray | None], ...]
  if padded.head_index is None:
    groups = ((_kernel(padded, 0, logits_soft_cap, bool(interpret)), None),)
  else:
    index = np.asarray(padded.head_index)
    groups = tuple((_kernel(padded, u, logits_soft_cap, bool(interpret)),
                    np.flatnonzero(index == u)) for u in range(len(padded.masks)))
  qh, kh, vh, ids = head_major(q, k, v, bm, scale, segment)
  if ids is None:
    return _Call(groups, qh, kh, vh, None, None, sinks)
  qs, ks, axis = ids
  return _Call(groups, qh, kh, vh, tk.SegmentIds(q=qs, kv=ks), axis, sinks)


# ----------------------------------------------------------------------------- log-sum-exp


@dataclasses.dataclass(frozen=True)
class _LseStatic:
  """The kernel's static settings (hashable: custom_vjp's nondiff argument)."""
  config: tk.SplashConfig
  mask_value: float
  mask_function: Any
  fwd_sparsity: float
  dkv_sparsity: float


def _lse_forward(st: _LseStatic, fwd_info, q, k, v, ids, sinks):
  """tokamax's forward kernel: `(out, lse in the kernel's base)` of one batch row."""
  out, stats = tk._splash_attention_forward(
      fwd_info, q, k, v, ids, sinks, mask_value=st.mask_value, is_mqa=False, config=st.config,
      save_residuals=True, mask_function=st.mask_function, fwd_mask_sparsity=st.fwd_sparsity)
  return out, stats["logsumexp"]


def _natural(st: _LseStatic, lse: jax.Array) -> jax.Array:
  """The kernel's log-sum-exp (base 2 with `use_base2_exp`) in natural units."""
  return lse / tk.LOG2E if st.config.use_base2_exp else lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tokamax_lse(st: _LseStatic, fwd_info, dkv_info, q, k, v, ids, sinks):
  """`(out [H, L, Dv], lse [H, L])` of one batch row, differentiable through both."""
  out, lse = _lse_forward(st, fwd_info, q, k, v, ids, sinks)
  return out, _natural(st, lse)


def _tokamax_lse_fwd(st, fwd_info, dkv_info, q, k, v, ids, sinks):
  out, lse = _lse_forward(st, fwd_info, q, k, v, ids, sinks)
  return (out, _natural(st, lse)), (q, k, v, ids, out, lse, dkv_info)


def _tokamax_lse_bwd(st, res, cts):
  q, k, v, ids, out, lse, dkv_info = res
  do, dlse = cts
  do = do.astype(q.dtype)
  # tokamax's `di` is delta = rowsum(out * do); the lse cotangent adds p * dlse to ds.
  di = (jnp.einsum("hsd,hsd->hs", out.astype(jnp.float32), do.astype(jnp.float32))
        - dlse.astype(jnp.float32))
  cfg = st.config
  dq, dk, dv = tk._splash_attention_bwd_dkv(
      q, k, v, ids, lse, do, di, bq=cfg.block_q_dkv, bkv=cfg.block_kv_dkv,
      bkv_compute=cfg.block_kv_dkv_compute, is_mqa=False, mask_info=dkv_info,
      mask_value=st.mask_value, mask_function=st.mask_function, config=cfg,
      dkv_mask_sparsity=st.dkv_sparsity)
  return (None, None, dq, dk, dv, None, None)


_tokamax_lse.defvjp(_tokamax_lse_fwd, _tokamax_lse_bwd)


# ----------------------------------------------------------------------------- masks


_TOKAMAX = adapters(tm.Mask, "as_tokamax")


def as_tokamax(cm: Any) -> tm.Mask:
  """A bound mask (`maskc.ComputableMask`) as a tokamax splash `Mask`.

  Hands a maskc mask to tokamax wherever it takes a splash mask
  (`make_splash_mha`, `process_mask`): tokamax slices tiles from it, and a mask
  of positions and scalars also gives tokamax `q_sequence` and `mask_function`
  to evaluate it in the kernel. maskc's compiler cannot import tokamax (it is
  optional), so the adapter lives here, as JAX splash's does in
  `maskc.kernels.splash.masks` (`as_splash_mask`).

  Args:
    cm: a `ComputableMask` (`maskc.parse(text).bind(q_len, kv_len, ...)`) without
      a batch axis: tokamax's masks are 2-D.

  Returns:
    A tokamax `Mask` equal to `cm` everywhere, hashable by value (tokamax caches
    its `process_mask` on the mask).

  Raises:
    MaskValueError: `cm` is no bound mask, or has a batch axis.

  >>> import maskc
  >>> from maskc.kernels.splash.tokamax_kernel import as_tokamax
  >>> m = as_tokamax(maskc.parse("causal").bind(4))
  >>> m[1:3, :].astype(int).tolist()
  [[1, 1, 0, 0], [1, 1, 1, 0]]
  """
  out: tm.Mask = adapted(cm, _TOKAMAX, "as_tokamax")
  if len(cm.shape) != 2:
    raise MaskValueError(
        f"tokamax's splash masks are 2-D, but this bound mask has shape {tuple(cm.shape)} (its "
        "operands have a batch axis)",
        hint="Bind one batch row's operands at a time, or use maskc's own splash_tokamax "
             "backend, which turns batched segment ids into SegmentIds.")
  return out


__all__ = ["run", "run_with_lse", "make_kernel", "as_tokamax", "default_blocks"]
