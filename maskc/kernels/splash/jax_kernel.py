"""Adapter to JAX's splash attention: our MaskInfo, splash's TPU kernel.

The kernel is JAX's `SplashAttentionKernel`, built from `mask_info(bm)`
(`maskc.kernels.splash.jax_info`) rather than from splash's `process_mask`, so building it
costs the mask's partial tiles, not its whole grid. On CPU it runs in Pallas
interpret mode.

What splash can take:
- a static mask without batched operands: its MaskInfo, with partial tiles
  stored or, for masks of positions and scalars, evaluated in the kernel;
- a mask with segment conjuncts `s[q] == s[k]` anywhere in its conjunction (as the
  compiler found them: `document(s)`, written out, or inside a definition) whose
  other conjuncts read only static unbatched operands, with `s` batched or traced:
  splash `SegmentIds` per batch row, the rest as the static MaskInfo the compiler
  prepared (`BlockMap.segment_split`);
- a traced mask without a batch axis: splash's dynamic MaskInfo (every tile stored).
Anything else (other batched operands) raises `BackendError` naming `xla` and
`flash`. `block_kv` must be a multiple of 128 (splash's lane width).

On a mesh: `make_kernel(bm, head_shards=, q_seq_shards=)` returns splash's own
kernel object with its MaskInfo laid out per (head shard, q shard), to run under
`jax.shard_map` with `kernel.manual_sharding_spec(...)` exactly as splash's
`make_splash_mha(..., head_shards=, q_seq_shards=)`.

Any length: q, k and v are padded to multiples of the tiles and the MaskInfo comes
from the map of the padded shape (`padded`): the same tiles, the key tile holding
the padding PARTIAL rather than FULL, and every predicate `& k < kv_len`, so
padding keys get no weight. Padding query rows are computed and dropped.

Splash returns NaN or a mean of values for rows with no allowed key; the adapter
always passes sink logits (a very negative one when the caller has none), which
makes those rows exactly zero in the kernel, with zero gradients.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

from maskc.compiled.blockmap import BlockMap
from maskc.compiled.predicate import Instr, Predicate
from maskc.compiled.tiles import FULL, PARTIAL, grid_from_runs, runs_from_grid
from maskc.kernels import common
from maskc.kernels.platform import platform
from maskc.kernels.splash.jax_info import mask_info
from maskc.kernels.xla import NEG_LSE
from maskc.language.errors import BackendError, MaskValueError

LANES = 128
GPU_COST = None  # a TPU kernel: not costed (on TPU, `auto` takes splash whatever the mask)
BACKWARD_ENGINE = None
installed = common.installed  # loading the module is what needs its packages
# Every map is taken: one splash cannot run (batched operands beyond segment ids, key
# tiles off 128) fails at run time, where `auto` falls back to xla.
refusal = common.no_refusal
length_refusal = common.any_length
forward_work = common.tile_work
# A sink logit that never wins against a real one but keeps empty rows at 0/1 = 0; it
# is also the log-sum-exp of an empty row, which `run_with_lse` returns as is.
_NO_SINK = NEG_LSE


def default_blocks(q_len: int, kv_len: int) -> tuple[int, int]:
  """The largest of 512, 256, 128 dividing each length (128 when none does)."""
  def pick(n):
    return next((b for b in (512, 256, 128) if n % b == 0), 128)
  return pick(q_len), pick(kv_len)


def _check_tiles(bk: int) -> None:
  if bk % LANES:
    raise MaskValueError(f"splash needs block_kv to be a multiple of {LANES}, got {bk=}",
                         hint="Use block_kv=128 (or 256, 512), or backend='xla' or 'flash'.")


def _keys_below(pred: Predicate, kv_len: int) -> Predicate:
  """`pred & k < kv_len`: the predicate with the padding keys masked out."""
  n = len(pred.program)
  program = pred.program + (Instr("k"), Instr("const", (), kv_len), Instr("lt", (n, n + 1)),
                            Instr("and", (n - 1, n + 2)))
  rest = None if pred.rest is None else _keys_below(pred.rest, kv_len)
  return dataclasses.replace(pred, program=program, rest=rest,
                             text=f"({pred.text}) & k < {kv_len}")


def padded_map(bm: BlockMap) -> BlockMap:
  """`bm` over lengths rounded up to its tiles, keys past its `kv_len` masked out.

  The tiles are the same ones (rounding up adds no tile); only the last key tile,
  which now holds padding keys, turns from FULL into PARTIAL, and each predicate
  gains `& k < kv_len`. Padding rows keep their tile's verdict: they are dropped.
  """
  bq, bk, nq, nk = bm.block_q, bm.block_kv, bm.n_q_tiles, bm.n_kv_tiles
  if (bm.q_len, bm.kv_len) == (nq * bq, nk * bk):
    return bm
  xp = np if bm.is_static else jnp
  grid = grid_from_runs(xp, bm.rows, nk)                       # [B', U, nq, nk]
  preds = bm.predicates
  if bm.kv_len % bk:
    last = xp.arange(nk) == nk - 1
    grid = xp.where((grid == FULL) & last, xp.asarray(PARTIAL, grid.dtype), grid)
    preds = tuple(_keys_below(p, bm.kv_len) for p in preds)
  split = None if bm.segment_split is None else padded_map(bm.segment_split)
  return dataclasses.replace(
      bm, q_len=nq * bq, kv_len=nk * bk, rows=runs_from_grid(xp, grid),
      col_runs=runs_from_grid(xp, xp.swapaxes(grid, -1, -2)), backward=None, predicates=preds,
      segment_split=split)


def plan(bm):
  """How splash runs this map: `(BlockMap for MaskInfo, segment read slots or None)`."""
  if bm.batch is None and bm.is_static:
    return bm, None
  if bm.segment_split is not None and len(bm.predicates) == 1:
    return bm.segment_split, bm.predicates[0].segments
  if bm.batch is None:
    return bm, None                                 # traced: splash's dynamic MaskInfo
  raise BackendError(
      f"splash cannot run `{'; '.join(str(m) for m in bm.masks)}` with batched operands: its "
      "MaskInfo has no batch axis, and only segment-id equalities `s[q] == s[k]` in the "
      "mask's conjunction (the rest reading no batched operands) become splash SegmentIds",
      hint="Use backend='xla' (any mask) or backend='flash'.")


def _to_jax(info):
  """A MaskInfo with its arrays as jax arrays (its flags stay Python values)."""
  return info._replace(**{f: (None if getattr(info, f) is None else jnp.asarray(getattr(info, f)))
                          for f in ("data_next", "mask_next", "block_mask",
                                    "partial_mask_blocks", "q_sequence")})


@functools.lru_cache(maxsize=32)
def _static_infos(bm, head_shards: int = 1, q_seq_shards: int = 1):
  return mask_info(bm, head_shards=head_shards, q_seq_shards=q_seq_shards)


def _kernel(bm, cap, interpret: bool, head_shards: int = 1, q_seq_shards: int = 1):
  if bm.is_static:
    infos = _static_infos(bm, head_shards, q_seq_shards)
  else:
    infos = mask_info(bm, head_shards=head_shards, q_seq_shards=q_seq_shards)
  fwd, dq, dkv, fn = infos
  to_jax = _to_jax
  bq, bk = bm.block_q, bm.block_kv
  sizes = sk.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq,
                        block_kv_dkv=bk, block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
  return sk.SplashAttentionKernel(
      to_jax(fwd), to_jax(dq), to_jax(dkv), block_sizes=sizes, is_mqa=False,
      save_residuals=False, mask_value=sk.DEFAULT_MASK_VALUE, attn_logits_soft_cap=cap,
      residual_checkpoint_name=None, mask_function=fn, interpret=interpret)


def make_kernel(bm: BlockMap, *, head_shards: int = 1, q_seq_shards: int = 1,
                logits_soft_cap: float | None = None,
                interpret: bool | None = None) -> sk.SplashAttentionKernel:
  """JAX's `SplashAttentionKernel` for a compiled map, laid out for a mesh.

  What splash's `make_splash_mha(mask, head_shards=, q_seq_shards=)` returns, with
  the MaskInfo from the BlockMap (`mask_info(bm, head_shards=, q_seq_shards=)`,
  the same arrays splash's `process_mask` gives for masks it can express). Use it
  as splash's own, MaxText style: one batch row is `kernel(q, k, v)` with
  `q [H, Lq, D]` already scaled, `k, v [Hkv, Lkv, D]`, optional `segment_ids=` and
  `sinks=`; on a mesh, shard the kernel's MaskInfo with
  `kernel.manual_sharding_spec(NamedSharding(mesh, P(head_axis, q_seq_axis)))`:

      spec = kernel.manual_sharding_spec(NamedSharding(mesh, P("heads", "seq")))
      attend = jax.shard_map(
          lambda kern, q, k, v: jax.vmap(kern)(q, k, v), mesh=mesh,
          in_specs=(spec, P(None, "heads", "seq"), P(None, "heads"), P(None, "heads")),
          out_specs=P(None, "heads", "seq"))

  Splash shards queries only: keys and values stay whole on each device. Rows
  with no allowed key get what splash gives them (pass a very negative `sinks`
  entry per head, as `run` does, to make them zero).

  Args:
    bm: a map without a batch axis (static or traced) whose lengths are multiples
      of its tiles, with `block_kv` a multiple of 128.
    head_shards, q_seq_shards: the mesh's shards of heads and of the q sequence;
      `q_seq_shards` must divide the q tiles.
    logits_soft_cap: splash's `attn_logits_soft_cap`.
    interpret: Pallas interpret mode (default: off on TPU only).

  Raises:
    MaskValueError: lengths not multiples of the tiles, tiles splash cannot take,
      or shards that do not divide the q tiles (or a per-head map's heads).
    BackendError: the map has a batch axis.
  """
  if not isinstance(bm, BlockMap):
    raise MaskValueError("make_kernel needs a compiled BlockMap (maskc.compile)")
  _check_tiles(bm.block_kv)
  if interpret is None:
    interpret = platform() != "tpu"
  return _kernel(bm, logits_soft_cap, bool(interpret), head_shards, q_seq_shards)


def run(q, k, v, bm, *, scale=None, logits_soft_cap=None, sinks=None, interpret=None):
  """The backend entry point: attention `[B, Lq, H, Dv]` through JAX's splash kernel."""
  call = _prepare(q, k, v, bm, scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
                  interpret=interpret)
  out = call.vmapped(lambda q, k, v, ids, sinks: call.kernel(q, k, v, segment_ids=ids,
                                                            sinks=sinks))
  return jnp.swapaxes(out, 1, 2)[:, :q.shape[1]].astype(q.dtype)


def run_with_lse(q, k, v, bm, *, scale=None, logits_soft_cap=None, interpret=None):
  """Attention and its log-sum-exp: `(out [B, Lq, H, Dv] f32, lse [B, Lq, H] f32)`.

  The contract of `maskc.kernels.xla.run_with_lse`, with JAX's splash kernel: for
  combining partial attentions over disjoint key sets exactly (ring attention).
  Rows with no allowed key have `out = 0` and `lse = NEG_LSE`. One mask for every
  head. Differentiable w.r.t. q, k and v through both outputs.

  Splash computes the log-sum-exp (`save_residuals=True`) but cannot differentiate
  it: its custom_vjp raises for that mode. So this wraps splash's own forward and
  backward kernels in a custom_vjp of its own (`_splash_lse`), whose backward
  passes splash's dq and dkv kernels `delta - dlse` where splash passes `delta`
  (`∂ lse_i / ∂ s_ij = p_ij`, so `ds = p (dp - delta + dlse)`). Those kernels are
  private to splash (`_splash_attention_forward`, `_splash_attention_bwd_dq`,
  `_splash_attention_bwd_dkv`); a JAX that renames them fails loudly here rather
  than returning wrong gradients. `out` is splash's output in the inputs' dtype,
  stored as float32. Empty rows come out exactly as the contract says: the
  adapter's sink logit `_NO_SINK = NEG_LSE` is their log-sum-exp.
  """
  call = _prepare(q, k, v, bm, scale=scale, logits_soft_cap=logits_soft_cap, sinks=None,
                  interpret=interpret)
  common.check_one_mask(bm)
  kern = call.kernel
  static = _LseStatic(block_sizes=kern.kwargs["block_sizes"],
                      mask_value=kern.kwargs["mask_value"], cap=kern.kwargs["attn_logits_soft_cap"],
                      mask_function=kern.kwargs["mask_function"],
                      interpret=kern.kwargs["interpret"])
  infos = tuple(_collapse(i) for i in (kern.fwd_mask_info, kern.dq_mask_info, kern.dkv_mask_info))
  out, lse = call.vmapped(lambda q, k, v, ids, sinks: _splash_lse(static, *infos, q, k, v, ids,
                                                                  sinks))
  lq = q.shape[1]
  return (jnp.swapaxes(out, 1, 2)[:, :lq].astype(jnp.float32),
          jnp.swapaxes(lse, 1, 2)[:, :lq].astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class _Call:
  """A splash kernel and its inputs, laid out per batch row `[B, H, L_pad, D]`."""
  kernel: sk.SplashAttentionKernel
  qh: jax.Array
  kh: jax.Array
  vh: jax.Array
  ids: sk.SegmentIds | None
  ids_axis: int | None
  sinks: jax.Array

  def vmapped(self, fn):
    """`fn(q, k, v, segment_ids, sinks)` of one batch row, over the batch."""
    return jax.vmap(lambda q, k, v, ids: fn(q, k, v, ids, self.sinks),
                    in_axes=(0, 0, 0, self.ids_axis))(self.qh, self.kh, self.vh, self.ids)


def _prepare(q, k, v, bm, *, scale, logits_soft_cap, sinks, interpret) -> _Call:
  """Checks, the kernel for `bm` and the padded, head-major inputs (see the module doc)."""
  _check_tiles(bm.block_kv)
  scale, sinks, interpret = checked_inputs(q, k, v, bm, "splash", scale=scale, sinks=sinks,
                                           interpret=interpret)
  info_bm, segment = plan(bm)
  kernel = _kernel(padded_map(info_bm), logits_soft_cap, bool(interpret))
  qh, kh, vh, ids = head_major(q, k, v, bm, scale, segment)
  if ids is None:
    return _Call(kernel, qh, kh, vh, None, None, sinks)
  qs, ks, axis = ids
  return _Call(kernel, qh, kh, vh, sk.SegmentIds(q=qs, kv=ks), axis, sinks)


def checked_inputs(q, k, v, bm: BlockMap, backend: str, *, scale, sinks, interpret):
  """Shapes checked against the map; `(scale, sinks, interpret)` resolved for a splash kernel.

  Shared by both splash adapters. Sinks are always passed: a very negative logit per head
  when the caller has none, which makes rows with no allowed key exactly zero.
  """
  b, lq, h, lkv, _, d = common.check_qkv(q, k, v)
  common.check_blockmap(bm, backend, lq, lkv, b)
  if bm.heads is not None and bm.heads != h:
    raise MaskValueError(f"the mask has {bm.heads} heads but q has {h}")
  sinks = common.check_sinks(sinks, h)
  if sinks is None:
    sinks = jnp.full((h,), _NO_SINK, jnp.float32)
  interpret = platform() != "tpu" if interpret is None else bool(interpret)
  return common.default_scale(d, scale), sinks, interpret


def head_major(q, k, v, bm: BlockMap, scale: float, segment):
  """A splash kernel's inputs: `(qh, kh, vh, ids)`, shared by both splash adapters.

  `qh` (q times `scale`), `kh` and `vh` are padded to whole tiles and laid out
  `[B, H, L_pad, D]`. `ids` is None without segment conjuncts, else `(q_ids, kv_ids,
  batch_axis)`: one id per row and per key, padded (padding ids are arbitrary: padding
  keys are masked by `k < kv_len` and padding rows dropped), `[B, L_pad]` with
  `batch_axis` 0 when the ids are batched, else `[L_pad]` and None.
  """
  b, lq, lkv = q.shape[0], q.shape[1], k.shape[1]
  lq_pad, lkv_pad = bm.n_q_tiles * bm.block_q, bm.n_kv_tiles * bm.block_kv

  def pad(x, n):
    return jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))

  qh = jnp.swapaxes(pad(q * jnp.asarray(scale, q.dtype), lq_pad), 1, 2)   # [B, H, Lq_pad, D]
  kh, vh = jnp.swapaxes(pad(k, lkv_pad), 1, 2), jnp.swapaxes(pad(v, lkv_pad), 1, 2)
  if segment is None:
    return qh, kh, vh, None
  # Rows and columns agree on every segment conjunct exactly when they agree on
  # all of them at once: one id per distinct combination, per batch row.
  values = common.read_values(bm, 0)
  qs, ks = _combined_ids(values, segment)                    # [B', L]
  qs = jnp.pad(qs, ((0, 0), (0, lq_pad - lq)))
  ks = jnp.pad(ks, ((0, 0), (0, lkv_pad - lkv)))
  if qs.shape[0] == b and bm.batch is not None:
    return qh, kh, vh, (qs, ks, 0)
  return qh, kh, vh, (qs[0], ks[0], None)


# ----------------------------------------------------------------------------- log-sum-exp


@dataclasses.dataclass(frozen=True)
class _LseStatic:
  """The splash kernel's static settings (hashable: custom_vjp's nondiff argument)."""
  block_sizes: sk.BlockSizes
  mask_value: float
  cap: float | None
  mask_function: sk.MaskFunctionType | None
  interpret: bool


def _collapse(info):
  """Splash's `_collapse_partial_mask_blocks`: dynamic `[H, nq, nk, bq, bk]` blocks flattened."""
  if info is None or info.partial_mask_blocks is None:
    return info
  blocks = info.partial_mask_blocks
  return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))


def _splash_forward(st: _LseStatic, fwd_info, q, k, v, ids, sinks):
  return sk._splash_attention_forward(
      fwd_info, q, k, v, ids, sinks, mask_value=st.mask_value, is_mqa=False,
      block_sizes=st.block_sizes, residual_checkpoint_name=None, save_residuals=True,
      mask_function=st.mask_function, attn_logits_soft_cap=st.cap, interpret=st.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _splash_lse(st: _LseStatic, fwd_info, dq_info, dkv_info, q, k, v, ids, sinks):
  """`(out [H, L, Dv], lse [H, L])` of one batch row, differentiable through both."""
  out, (lse,) = _splash_forward(st, fwd_info, q, k, v, ids, sinks)
  return out, lse


def _splash_lse_fwd(st, fwd_info, dq_info, dkv_info, q, k, v, ids, sinks):
  out, (lse,) = _splash_forward(st, fwd_info, q, k, v, ids, sinks)
  return (out, lse), (q, k, v, ids, sinks, out, lse, dq_info, dkv_info)


def _splash_lse_bwd(st, res, cts):
  q, k, v, ids, sinks, out, lse, dq_info, dkv_info = res
  do, dlse = cts
  do = do.astype(q.dtype)
  # Splash's `di` is delta = rowsum(out * do); the lse cotangent adds p * dlse to ds.
  di = (jnp.einsum("hsd,hsd->hs", out.astype(jnp.float32), do.astype(jnp.float32))
        - dlse.astype(jnp.float32))
  sizes = st.block_sizes
  common_kw = dict(is_mqa=False, mask_value=st.mask_value, attn_logits_soft_cap=st.cap,
                   q_layout=sizes.q_layout, k_layout=sizes.k_layout, v_layout=sizes.v_layout,
                   mask_function=st.mask_function, interpret=st.interpret)
  _, dk, dv = sk._splash_attention_bwd_dkv(
      q, k, v, ids, sinks, lse, do, di, bq=sizes.block_q_dkv, bkv=sizes.block_kv_dkv,
      bkv_compute=sizes.block_kv_dkv_compute, mask_info=dkv_info, use_fused_bwd_kernel=False,
      **common_kw)
  dq = sk._splash_attention_bwd_dq(q, k, v, ids, sinks, lse, do, di, bq=sizes.block_q_dq,
                                   bkv=sizes.block_kv_dq, mask_info=dq_info, **common_kw)
  return (None, None, None, dq, dk, dv, None, None)


_splash_lse.defvjp(_splash_lse_fwd, _splash_lse_bwd)


def _combined_ids(values, segments):
  """One segment id per row and per column that is equal exactly when every pair is.

  With one conjunct the ids are the operand's own values. With several, each
  (row, column) id tuple is ranked among all tuples of that batch row.
  """
  qs = [values.q[:, a] for a, _ in segments]
  ks = [values.k[:, b] for _, b in segments]
  if len(segments) == 1:
    return qs[0], ks[0]
  lq = qs[0].shape[-1]
  both = jnp.concatenate([jnp.stack(qs, -1), jnp.stack(ks, -1)], axis=1)   # [B', L, S]

  def rank(rows):
    _, inverse = jnp.unique(rows, axis=0, return_inverse=True, size=rows.shape[0])
    return inverse.reshape(-1).astype(jnp.int32)

  ids = jax.vmap(rank)(both)
  return ids[:, :lq], ids[:, lq:]


__all__ = ["run", "run_with_lse", "make_kernel", "default_blocks"]
