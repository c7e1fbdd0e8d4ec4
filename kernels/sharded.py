"""Sharded attention on a JAX mesh: `jax.shard_map` over batch, heads and sequence.

The compiler (`maskc._sharding.plan`) hands over a `ShardPlan`: a layout and the
block maps of every (data shard, sequence shard). Here each device runs:

- `all_gather`: gathers K and V over the sequence axis (`lax.all_gather`, tiled:
  the layout's stored order) and attends with its shard's map. Which map is a
  static choice per device, made with `lax.switch` on the device's mesh index,
  so every map stays static and its tiles are known at trace time.
- `ring`: S steps; at step t the device holds the K/V shard `(r - t) mod S`,
  attends with that step's map on the xla backend, which also returns the
  log-sum-exp, and passes K/V on with `lax.ppermute`. Partial results combine
  exactly: `out = sum_t exp(lse_t - LSE) out_t`, `LSE = logsumexp(lse_t, sinks)`.
  Steps no device has a tile in do no attention work, and a device whose step
  map is empty returns zeros there without touching the keys (`lax.cond`).

Each device's map is picked by its mesh index from the per-shard maps stacked
into arrays (`_Stacked`): one kernel trace serves every device.

Batch goes over `batch_axis`, heads and KV heads over `head_axis` (both must
divide), sequence over `seq_axis`. Gradients are JAX's through shard_map,
all_gather, ppermute and switch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from maskc._blockmap import BlockMap
from maskc._tiles import Runs, run_lengths
from maskc.kernels import api
from maskc.kernels import xla


def _axis_size(mesh, axis) -> int:
  return 1 if axis is None else int(mesh.shape[axis])


def _index(axis):
  return 0 if axis is None else jax.lax.axis_index(axis)


def _pad_runs(runs: Runs, r: int) -> Runs:
  pad = [(0, 0)] * (runs.start.ndim - 1) + [(0, r - runs.start.shape[-1])]
  return Runs(*(np.pad(np.asarray(a), pad) for a in runs[:3]), np.asarray(runs.count))


def _bounds(maps) -> tuple:
  """Per mask, `(fwd_max, fwd_total, bwd_max, bwd_total)` over every map (per batch row)."""
  out = []
  for u in range(len(maps[0].predicates)):
    vals = []
    for runs in ("rows", "cols"):
      lengths = [np.asarray(run_lengths(getattr(bm, runs)))[:, u] for bm in maps]
      vals += [max(1, max(int(x.max()) for x in lengths)),
               max(1, max(int(x.sum(-1).max()) for x in lengths))]
    out.append(tuple(vals))
  return tuple(out)


class _Stacked:
  """Static maps of one structure stacked along a leading axis, one picked per device.

  Every device runs the same program; stacking the maps' arrays (runs padded to
  the widest, positions, operands) and indexing them with the device's mesh index
  gives each device its own map as a traced `BlockMap`, traced once, with static
  list sizes from the widest map. Maps whose static parts differ (predicates that
  specialise on positions) cannot stack: `None` from `build`, and the caller picks
  with `lax.switch` instead.
  """

  def __init__(self, aux, leaves):
    self.aux, self.leaves = aux, leaves

  @staticmethod
  def build(maps) -> "_Stacked | None":
    r = max(bm.rows.start.shape[-1] for bm in maps)
    rc = max(bm.cols.start.shape[-1] for bm in maps)
    bounds = _bounds(maps)
    flat = []
    for bm in maps:
      norm = BlockMap(bm.masks, bm.head_index, bm.q_len, bm.kv_len, bm.q_offset, bm.block_q,
                      bm.block_kv, bm.batch, _pad_runs(bm.rows, r), bm.operands,
                      bm.predicates, col_runs=_pad_runs(bm.cols, rc), line_bounds=bounds,
                      q_positions=bm.q_positions, kv_positions=bm.kv_positions)
      flat.append(jax.tree_util.tree_flatten(norm))
    aux = flat[0][1]
    if any(a != aux for _, a in flat):
      return None
    leaves = [np.stack([np.asarray(x) for x in xs]) for xs in zip(*(f[0] for f in flat))]
    return _Stacked(aux, leaves)

  def pick(self, idx) -> BlockMap:
    return jax.tree_util.tree_unflatten(self.aux, [jnp.asarray(x)[idx] for x in self.leaves])


def run(q, k, v, plan, *, mesh, batch_axis=None, head_axis=None, seq_axis=None,
        backend: str = "auto", sinks=None, scale=None, logits_soft_cap=None, interpret=None):
  """Attention of `[B, L, H, D]` arrays stored in the layout's order; output in that order."""
  layout = plan.layout
  seq_shards = _axis_size(mesh, seq_axis)
  if seq_shards != layout.shards:
    raise ValueError(f"the layout has {layout.shards} shards but mesh axis {seq_axis!r} has "
                     f"{seq_shards}")
  data_shards = plan.data_shards
  s = layout.shards
  spec = P(batch_axis, seq_axis, head_axis, None)
  h = q.shape[2]
  sink_arr = jnp.zeros((h,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32)
  kw = dict(scale=scale, logits_soft_cap=logits_soft_cap)

  def device():
    """This device's index over (data shard, sequence shard)."""
    d = _index(batch_axis) if data_shards > 1 else 0
    return d * s + _index(seq_axis)

  if plan.strategy == "all_gather":
    maps = [plan.maps[d][r] for d in range(data_shards) for r in range(s)]
    stacked = _Stacked.build(maps)

    def body(q, k, v, sink):
      if seq_axis is not None:
        k = jax.lax.all_gather(k, seq_axis, axis=1, tiled=True)
        v = jax.lax.all_gather(v, seq_axis, axis=1, tiled=True)
      one = functools.partial(_one, backend=backend, sinks=None if sinks is None else sink,
                              interpret=interpret, **kw)
      if stacked is not None:
        return one(q, k, v, bm=stacked.pick(device()))
      return jax.lax.switch(device(), [functools.partial(one, bm=bm) for bm in maps], q, k, v)
  else:
    empty = set(plan.empty_steps())
    steps = {}
    for t in range(s):
      if t in empty:
        continue
      cells = [(d, r, (r - t) % s) for d in range(data_shards) for r in range(s)]
      maps = [plan.maps[d][r][c] for d, r, c in cells]
      live = np.array([plan.nonempty[d][r][c] for d, r, c in cells])
      steps[t] = (maps, _Stacked.build(maps), live)

    def body(q, k, v, sink):
      perm = [(i, (i + 1) % s) for i in range(s)]
      outs, lses = [], []
      for t in range(s):
        if t in steps:
          maps, stacked, live = steps[t]
          idx = device()
          if stacked is not None:
            run_step = lambda q, k, v, st=stacked, i=idx: _step(q, k, v, bm=st.pick(i), **kw)
          else:
            branches = [functools.partial(_step, bm=bm, **kw) for bm in maps]
            run_step = lambda q, k, v, br=branches, i=idx: jax.lax.switch(i, br, q, k, v)
          # A device whose step has no tile does no attention work at that step.
          o, lse = jax.lax.cond(jnp.asarray(live)[idx], run_step,
                                lambda q, k, v: _step(q, k, v, bm=None, **kw), q, k, v)
          outs.append(o)
          lses.append(lse)
        if t + 1 < s:
          k = jax.lax.ppermute(k, seq_axis, perm)
          v = jax.lax.ppermute(v, seq_axis, perm)
      return _combine(outs, lses, None if sinks is None else sink, q, v)

  f = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, P(head_axis)),
                    out_specs=spec, check_vma=False)
  # Compiled as one program (eager shard_map would dispatch the kernel op by op).
  return jax.jit(f)(q, k, v, sink_arr)


def _one(q, k, v, *, bm, backend, sinks, interpret, scale, logits_soft_cap):
  return api.attention(q, k, v, bm, backend=backend, sinks=sinks, interpret=interpret,
                       scale=scale, logits_soft_cap=logits_soft_cap)


def _step(q, k, v, *, bm, scale, logits_soft_cap):
  """One ring step: `(out f32, lse)` of q against this K/V shard; zeros when the map is empty."""
  b, lq, h = q.shape[:3]
  if bm is None:
    return (jnp.zeros((b, lq, h, v.shape[-1]), jnp.float32),
            jnp.full((b, lq, h), xla.NEG_LSE, jnp.float32))
  return xla.run_with_lse(q, k, v, bm, scale=scale, logits_soft_cap=logits_soft_cap)


def _combine(outs, lses, sink, q, v):
  """Partial attentions over disjoint key sets (and sink logits) into one softmax."""
  if not outs:
    return jnp.zeros(q.shape[:3] + (v.shape[-1],), q.dtype)
  lse = jnp.stack(lses)                                         # [T, B, Lq, H]
  top = jax.lax.stop_gradient(jnp.max(lse, axis=0))
  if sink is not None:
    top = jnp.maximum(top, jax.lax.stop_gradient(sink)[None, None, :])
  total = jnp.sum(jnp.exp(lse - top), axis=0)
  if sink is not None:
    total = total + jnp.exp(sink[None, None, :] - top)
  w = jnp.exp(lse - top) / jnp.where(total > 0, total, 1.0)   # [T, B, Lq, H]
  out = jnp.sum(w[..., None] * jnp.stack(outs), axis=0)
  return out.astype(q.dtype)
