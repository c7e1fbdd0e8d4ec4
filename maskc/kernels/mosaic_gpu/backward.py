"""The backward pass of `backend="mosaic_gpu"` in Pallas Mosaic GPU (Hopper, sm90). Opt-in.

**Never run on a GPU.** It is cross-lowered for cuda from a CPU-only machine
(`tests/test_mosaic_gpu_lowering.py`), which checks that every primitive it uses has a Mosaic
GPU lowering and that its shared memory fits; ptxas, numerics and speed are unchecked until
`tests/test_gpu.py -k mosaic` runs on a GPU. So the default gradient of `backend="mosaic_gpu"`
stays flash's Triton backward; this one runs only after

    from maskc.kernels.mosaic_gpu import forward
    forward.BACKWARD = "mosaic_gpu"     # before tracing

It is FlashAttention-2's backward in two kernels, with the forward's machinery
(`maskc.kernels.mosaic_gpu.forward`: warp-specialized CTAs, a memory warpgroup TMA-copying tiles
into `stages` shared-memory slots, `wgmma` into float32 accumulators, scores in base 2),
and its tile code (`maskc.kernels.mosaic_gpu.tiles`). `mosaic_gpu`'s entry points call
`backward` from their `custom_vjp`s:

- **dq**, one CTA per (head, q rows, batch row): each compute warpgroup holds 64 query rows
  and their `do` in shared memory and walks its map row's FULL then PARTIAL key tiles (the
  forward's walk, `meta`); per key tile `s = q kᵀ`, `dp = do vᵀ`, `p = exp2(s − lse)`,
  `ds = p (dp − delta)`, `dq += ds k`. Two compute warpgroups share each key tile (128 rows,
  one map q tile) where shared memory allows, else one (head dim 256: 64 rows per CTA, two
  CTAs per map q tile).
- **dk/dv**, one CTA per (key head, key tile, batch row): each compute warpgroup holds 64
  keys and their values and walks the map column's FULL then PARTIAL q tiles (the map's
  `cols` runs, `walk(..., transpose=True)`), for every query head of the key head's group in
  turn, so GQA/MQA gradients are summed in the float32 accumulators, not afterwards. Scores
  are key-major (`sᵀ = k qᵀ`, the forward's tile transposed): per step of `q_sub` query rows
  `dv += pᵀ do`, `dpᵀ = v doᵀ`, `dk += dsᵀ q`. A 128-key tile takes two compute warpgroups
  sharing each q step, a 64-key tile one.

PARTIAL tiles evaluate the compiled predicate with the forward's code
(`tiles.tile_mask`), every read kind included: in the dk/dv kernel the tile's query
axis is 1, its key-side reads are loaded once per CTA, the q-side ones per step, and
pairwise reads come from the pairwise array transposed (built in the backward, not kept).

`delta = rowsum(out · do)` is computed outside the kernels (as flash and `attention_mgpu.py`
do). Rows with no allowed key have `lse = +inf`, so `p = 0` there and every gradient they
feed is zero; padded query rows get `lse = +inf` and `do = 0` too. The soft cap multiplies
`ds` by `1 − tanh²`. Sinks: `p` already carries the sink in its denominator (the forward's
`lse` includes it), so dq, dk and dv need nothing more, and the sinks' gradient
`−Σ exp(sink − lse) · delta` is a reduction outside the kernels (flash's formula).
`run_with_lse`'s `lse` cotangent enters as `delta − dlse`, as in flash.

What a first GPU run must watch (not checkable here): register pressure (dk and dv
accumulators are `64 × D` float32 each: at D = 256 that is 256 registers a thread before
scores, which ptxas will spill), and the walk's barrier parity over the group loop.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from maskc.kernels import compat
from maskc.kernels.mosaic_gpu.tiles import (
  BLOCK_Q,
  LOG2E,
  MAX_STAGES,
  SMEM_BYTES,
  WG_ROWS,
  Config,
  Inputs,
  ReadRefs,
  Stream,
  Tile,
  load_vec,
  pad_to,
  side_reads,
  softcap,
  stream,
  stream_row_keys,
  tile_mask,
)

# Query rows per step of the dk/dv kernel: 64 keeps `sᵀ` and `dpᵀ` at 32 registers a thread
# each beside the dk and dv accumulators (128 is the other choice, for tuning on a GPU).
Q_SUB = 64


@dataclasses.dataclass(frozen=True)
class BwdConfig:
  """The static shape of both backward kernels (hashable).

  Attributes:
    fwd: the forward's config (mask, tiles, lengths, groups, scale, cap, dtype).
    dq_wgs: compute warpgroups of the dq kernel (2: one map q tile a CTA; 1: half of one).
    dq_stages: key/value slots of the dq kernel.
    dkv_wgs: compute warpgroups of the dk/dv kernel, `block_kv // 64`.
    q_sub: query rows per step of the dk/dv kernel (64 or 128).
    dkv_stages: q/do slots of the dk/dv kernel.
  """
  fwd: Config
  dq_wgs: int
  dq_stages: int
  dkv_wgs: int
  q_sub: int
  dkv_stages: int


def dq_smem_bytes(d: int, block_kv: int, wgs: int, stages: int, itemsize: int = 2) -> int:
  """Shared memory of a dq CTA: q and do rows per warpgroup, k and v slots, Mosaic's extras."""
  return 2 * wgs * WG_ROWS * d * itemsize + 2 * stages * block_kv * d * itemsize + 4096


def dkv_smem_bytes(d: int, block_kv: int, q_sub: int, stages: int, itemsize: int = 2) -> int:
  """Shared memory of a dk/dv CTA: its keys and values, q and do slots, Mosaic's extras."""
  return 2 * block_kv * d * itemsize + 2 * stages * q_sub * d * itemsize + 4096


def _most_stages(fits) -> int:
  return next((s for s in range(MAX_STAGES, 1, -1) if fits(s)), 0)


def plan(cfg: Config, q_sub: int = Q_SUB) -> BwdConfig | None:
  """The backward's warpgroups and slots for a forward config, or None if nothing fits."""
  d, bk = cfg.head_dim, cfg.block_kv
  dq_wgs, dq_stages = next(
      ((w, s) for w in (2, 1)
       if (s := _most_stages(lambda s, w=w: dq_smem_bytes(d, bk, w, s) <= SMEM_BYTES))),
      (0, 0))
  dkv_stages = _most_stages(lambda s: dkv_smem_bytes(d, bk, q_sub, s) <= SMEM_BYTES)
  if not dq_stages or not dkv_stages or BLOCK_Q % q_sub or q_sub % WG_ROWS:
    return None
  return BwdConfig(cfg, dq_wgs, dq_stages, bk // WG_ROWS, q_sub, dkv_stages)


def refusal(cfg: Config) -> str | None:
  """Why the backward cannot run what the forward runs, or None (every forward shape fits
  today; kept for tile choices that would not)."""
  if plan(cfg) is None:
    return (f"its kernels do not fit {SMEM_BYTES // 1024} KiB of shared memory at head dim "
            f"{cfg.head_dim} with {cfg.block_kv}-key tiles")
  return None


def _dscores(cfg: Config, s, dp, lse2, delta, q_axis: int, mask):
  """`(p, ds)` of a score tile from the raw scores `s` and `dp = do vᵀ` (or their transposes,
  `q_axis = 1`): `p = exp2(logits − lse)` (zero where masked), `ds = p (dp − delta)`, times
  `1 − tanh²` under a soft cap. `lse2` (`lse · log2 e`) and `delta` are per query row."""
  logits, t = softcap(s, cfg)
  p = jnp.exp2(logits - lax.broadcast_in_dim(lse2, s.shape, [q_axis]))
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, [q_axis]))
  if t is not None:
    ds = ds * (1.0 - t * t)
  return p, ds


def _product(a, b, shape):
  """`a @ b` (shared-memory refs, or a register tile for `a`) into a fresh f32 accumulator."""
  plgpu = compat.mosaic_gpu()

  def body(acc_ref):
    plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]

  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def _accumulate(acc, a, b):
  """`acc + a @ b`, with `acc` a float32 register tile (WGMMA layout)."""
  plgpu = compat.mosaic_gpu()

  def body(acc_ref):
    plgpu.wgmma(acc_ref, a, b)

  return pl.run_state(body)(plgpu.ACC.init(acc))


def _zeros(shape):
  plgpu = compat.mosaic_gpu()
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _smem(shape, dtype):
  plgpu = compat.mosaic_gpu()
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                              plgpu.SwizzleTransform(128)))


def _registers(wgs: int) -> int:
  """Registers a thread of a compute warpgroup asks for (the memory one keeps 40)."""
  return 232 if wgs == 2 else 240


def _dq(bc: BwdConfig, q, k, v, do, lse2, delta, ins: Inputs):
  """`dq [B, Lq_pad, H, D]` in q's dtype, on padded inputs."""
  plgpu = compat.mosaic_gpu()
  cfg = bc.fwd
  b, _, h, d = q.shape
  bk, rows, wgs, stages = cfg.block_kv, WG_ROWS, bc.dq_wgs, bc.dq_stages
  per_tile = BLOCK_Q // (wgs * rows)                 # CTAs per map q tile
  dtype = q.dtype

  def kernel(meta_ref, scal_ref, qtok_ref, ktok_ref, pair_ref, tile_ref, q_ref, k_ref, v_ref,
             do_ref, lse_ref, delta_ref, dq_ref, scoped):
    batch = lax.axis_index("batch")
    head = lax.axis_index("heads")
    qt = lax.axis_index("q_rows")
    wg = lax.axis_index("wg")
    qi = qt if per_tile == 1 else lax.div(qt, jnp.int32(per_tile))
    mb = batch if cfg.batched_meta else 0
    (q_smem2, do_smem2, k_smem, v_smem), loaded, (k_consumed, v_consumed) = scoped
    q_loaded, do_loaded, k_loaded, v_loaded = loaded
    n_full, n_all = meta_ref[mb, qi, 0], meta_ref[mb, qi, 1]

    @pl.when(wg < wgs)
    def _compute():
      plgpu.set_max_registers(_registers(wgs), action="increase")
      q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
      q_base = qt * (wgs * rows) + wg * rows
      view = (batch, pl.ds(q_base, rows), head)
      plgpu.copy_gmem_to_smem(q_ref.at[view], q_smem, q_loaded.at[wg])
      plgpu.copy_gmem_to_smem(do_ref.at[view], do_smem, do_loaded.at[wg])
      lse = load_vec(lse_ref.at[batch, head, pl.ds(q_base, rows)], 0)
      delta = load_vec(delta_ref.at[batch, head, pl.ds(q_base, rows)], 0)
      refs = ReadRefs(scal_ref, qtok_ref, ktok_ref, pair_ref, tile_ref, mb)
      q_vecs = side_reads(refs, "q", len(cfg.pred.q_reads), q_base, rows, 0)
      plgpu.barrier_wait(q_loaded.at[wg])
      plgpu.barrier_wait(do_loaded.at[wg])

      def step(partial: bool):
        def body(t, dq):
          slot = lax.rem(t, jnp.int32(stages))
          j = meta_ref[mb, qi, 2 + t]
          plgpu.barrier_wait(k_loaded.at[slot])
          s = _product(q_smem, compat.mosaic_transpose(k_smem.at[slot], (1, 0)), (rows, bk))
          plgpu.barrier_wait(v_loaded.at[slot])
          dp = _product(do_smem, compat.mosaic_transpose(v_smem.at[slot], (1, 0)), (rows, bk))
          plgpu.barrier_arrive(v_consumed.at[slot])
          mask = tile_mask(cfg, refs, Tile((rows, bk), 0, q_base, j * bk, qi, j), partial,
                           q_vecs=q_vecs)
          _, ds = _dscores(cfg, s, dp, lse, delta, 0, mask)
          dq = _accumulate(dq, ds.astype(dtype), k_smem.at[slot])
          plgpu.barrier_arrive(k_consumed.at[slot])
          return dq
        return body

      dq = lax.fori_loop(0, n_full, step(False), _zeros((rows, d)))
      dq = lax.fori_loop(n_full, n_all, step(True), dq)
      q_smem[...] = (dq * cfg.scale).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[view])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == wgs)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")
      stream_row_keys(n_all, stages, (meta_ref, mb, qi), k_ref, v_ref, batch, head,
                      cfg.groups, bk, (k_smem, k_loaded, k_consumed),
                      (v_smem, v_loaded, v_consumed))

  def entry(*refs):
    pl.run_scoped(
        lambda *scoped: kernel(*refs, scoped),
        (_smem((wgs, rows, d), dtype), _smem((wgs, rows, d), dtype),
         _smem((stages, bk, d), dtype), _smem((stages, bk, d), dtype)),
        (plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=wgs),
         plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
        (plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),) * 2,
        collective_axes="wg",
    )

  return plgpu.kernel(
      entry, out_type=jax.ShapeDtypeStruct(q.shape, dtype),
      grid=(h, cfg.n_q_tiles * per_tile, b), grid_names=("heads", "q_rows", "batch"),
      num_threads=wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True))(
          ins.meta, ins.scal, ins.qtok, ins.ktok, ins.pair, ins.tile, q, k, v, do, lse2, delta)


def _dkv(bc: BwdConfig, q, k, v, do, lse2, delta, meta_b, ins: Inputs, pair_t):
  """`(dk, dv)`, each `[B, Lkv_pad, Hkv, D]` in k's dtype, summed over each group's heads."""
  plgpu = compat.mosaic_gpu()
  cfg = bc.fwd
  b, _, _, d = q.shape
  hkv = k.shape[2]
  bk, rows, wgs, stages = cfg.block_kv, WG_ROWS, bc.dkv_wgs, bc.dkv_stages
  qs, groups = bc.q_sub, cfg.groups
  per_tile = BLOCK_Q // qs                          # steps per map q tile
  dtype = k.dtype

  def kernel(meta_ref, scal_ref, qtok_ref, ktok_ref, pair_ref, tile_ref, q_ref, k_ref, v_ref,
             do_ref, lse_ref, delta_ref, dk_ref, dv_ref, scoped):
    batch = lax.axis_index("batch")
    kv_head = lax.axis_index("heads")
    kj = lax.axis_index("kv_tiles")
    wg = lax.axis_index("wg")
    mb = batch if cfg.batched_meta else 0
    (k_smem2, v_smem2, q_smem, do_smem), loaded, (q_consumed, do_consumed) = scoped
    k_loaded, v_loaded, q_loaded, do_loaded = loaded
    n_full, n_all = meta_ref[mb, kj, 0], meta_ref[mb, kj, 1]

    @pl.when(wg < wgs)
    def _compute():
      plgpu.set_max_registers(_registers(wgs), action="increase")
      k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
      k_base = kj * bk + wg * rows
      view = (batch, pl.ds(k_base, rows), kv_head)
      plgpu.copy_gmem_to_smem(k_ref.at[view], k_smem, k_loaded.at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[view], v_smem, v_loaded.at[wg])
      refs = ReadRefs(scal_ref, qtok_ref, ktok_ref, pair_ref, tile_ref, mb)
      k_vecs = side_reads(refs, "k", len(cfg.pred.k_reads), k_base, rows, 0)
      plgpu.barrier_wait(k_loaded.at[wg])
      plgpu.barrier_wait(v_loaded.at[wg])
      shape = (rows, qs)

      def step(partial: bool, g):
        head = kv_head * groups + g

        def body(n, carry):
          dk, dv = carry
          i = meta_ref[mb, kj, 2 + n]
          for sub in range(per_tile):
            t = (g * n_all + n) * per_tile + sub
            slot = lax.rem(t, jnp.int32(stages))
            q_start = i * BLOCK_Q + sub * qs
            plgpu.barrier_wait(q_loaded.at[slot])
            st = _product(k_smem, compat.mosaic_transpose(q_smem.at[slot], (1, 0)), shape)
            lse = load_vec(lse_ref.at[batch, head, pl.ds(q_start, qs)], 1)
            delta = load_vec(delta_ref.at[batch, head, pl.ds(q_start, qs)], 1)
            mask = tile_mask(cfg, refs, Tile(shape, 1, q_start, k_base, i, kj), partial,
                             k_vecs=k_vecs)
            plgpu.barrier_wait(do_loaded.at[slot])
            dpt = _product(v_smem, compat.mosaic_transpose(do_smem.at[slot], (1, 0)), shape)
            pt, dst = _dscores(cfg, st, dpt, lse, delta, 1, mask)
            dv = _accumulate(dv, pt.astype(dtype), do_smem.at[slot])
            plgpu.barrier_arrive(do_consumed.at[slot])
            dk = _accumulate(dk, dst.astype(dtype), q_smem.at[slot])
            plgpu.barrier_arrive(q_consumed.at[slot])
          return dk, dv
        return body

      def head_body(g, carry):
        carry = lax.fori_loop(0, n_full, step(False, g), carry)
        return lax.fori_loop(n_full, n_all, step(True, g), carry)

      dk, dv = lax.fori_loop(0, groups, head_body, (_zeros((rows, d)), _zeros((rows, d))))
      k_smem[...] = (dk * cfg.scale).astype(dtype)
      v_smem[...] = dv.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[view])
      plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[view])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == wgs)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")
      per_head = n_all * per_tile

      def q_rows(ref):
        def source(t):
          g, n = lax.div(t, per_head), lax.rem(t, per_head)
          i = meta_ref[mb, kj, 2 + lax.div(n, jnp.int32(per_tile))]
          start = i * BLOCK_Q + lax.rem(n, jnp.int32(per_tile)) * qs
          return ref.at[batch, pl.ds(start, qs), kv_head * groups + g]
        return source

      stream(groups * per_head, stages,
             [Stream(q_rows(q_ref), q_smem, q_loaded, q_consumed),
              Stream(q_rows(do_ref), do_smem, do_loaded, do_consumed)])

  def entry(*refs):
    pl.run_scoped(
        lambda *scoped: kernel(*refs, scoped),
        (_smem((wgs, rows, d), dtype), _smem((wgs, rows, d), dtype),
         _smem((stages, qs, d), dtype), _smem((stages, qs, d), dtype)),
        (plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=wgs),
         plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
        (plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),) * 2,
        collective_axes="wg",
    )

  out = jax.ShapeDtypeStruct(k.shape[:2] + (hkv, d), dtype)
  return plgpu.kernel(
      entry, out_type=(out, out), grid=(hkv, cfg.n_kv_tiles, b),
      grid_names=("heads", "kv_tiles", "batch"), num_threads=wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True))(
          meta_b, ins.scal, ins.qtok, ins.ktok, pair_t, ins.tile, q, k, v, do, lse2, delta)


def backward(bc: BwdConfig, d: int, q: jax.Array, k: jax.Array, v: jax.Array,
             sinks: jax.Array, out: jax.Array, lse: jax.Array, do: jax.Array, ins: Inputs,
             meta_b: jax.Array, dlse: jax.Array | None = None,
             ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """`(dq, dk, dv, dsinks)` for unpadded inputs, from the forward's `out` and `lse`.

  Args:
    bc, d: the plan and the padded head dim.
    q, k, v, sinks: the forward's inputs; out `[B, Lq, H, Dv]`, lse `[B, H, Lq]` (natural
      log, `+inf` on rows with no key): its outputs; do: the cotangent on `out`.
    ins, meta_b: the forward's inputs and the transposed walk (`walk(bm, u, transpose=True)`).
    dlse: a cotangent on `lse` (`run_with_lse`), or None.
  """
  cfg = bc.fwd
  lq, lkv = q.shape[1], k.shape[1]
  lq_pad, lkv_pad = cfg.n_q_tiles * BLOCK_Q, cfg.n_kv_tiles * cfg.block_kv
  delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32))
  if dlse is not None:
    delta = delta - dlse.astype(jnp.float32)
  rows = ((0, 0), (0, 0), (0, lq_pad - lq))
  # padded query rows get lse = +inf: zero weight, like rows with no key
  lse2 = jnp.pad(lse.astype(jnp.float32) * LOG2E, rows, constant_values=jnp.inf)
  delta_p = jnp.pad(delta, rows)
  dtype = q.dtype
  qp, dop = pad_to(q, lq_pad, d, dtype), pad_to(do, lq_pad, d, dtype)
  kp, vp = pad_to(k, lkv_pad, d, dtype), pad_to(v, lkv_pad, d, dtype)
  pair_t = jnp.swapaxes(ins.pair, -1, -2) if cfg.pred.pairs else ins.pair
  dq = _dq(bc, qp, kp, vp, dop, lse2, delta_p, ins)
  dk, dv = _dkv(bc, qp, kp, vp, dop, lse2, delta_p, meta_b, ins, pair_t)
  if cfg.has_sinks:
    # d out / d sink = −p_sink · out per row, with p_sink = exp(sink − lse)
    dsinks = -(jnp.exp(sinks[None, :, None] - lse) * delta).sum(axis=(0, 2))
  else:
    dsinks = jnp.zeros_like(sinks)
  return (dq[:, :lq, :, :q.shape[-1]], dk[:, :lkv, :, :k.shape[-1]].astype(k.dtype),
          dv[:, :lkv, :, :v.shape[-1]].astype(v.dtype), dsinks)
