"""Sharded attention on a JAX mesh: `jax.shard_map` over batch, heads and sequence.

The compiler (`maskc.parallel.sharding.plan`) hands over a `ShardPlan`: a layout and, per
head shard and head group, the block maps of every (data shard, sequence shard).
Here each device runs:

- `all_gather`: gathers K and V over the sequence axis (`lax.all_gather`, tiled:
  the layout's stored order) and attends with its shard's map on the chosen
  backend (`maskc.kernels.api.attention`).
- `ring`: S steps; at step t the device holds the K/V shard `(r - t) mod S`,
  attends with that step's map through the backend's `run_with_lse` (out and
  log-sum-exp), and passes K/V on with `lax.ppermute`. Partial results combine
  exactly: `out = sum_t exp(lse_t - LSE) out_t`, `LSE = logsumexp(lse_t, sinks)`.
  Steps no device has a tile in do no attention work, and a device whose step
  map is empty returns zeros there without touching the keys (`lax.cond`).

Which map a device uses is chosen at run time from its mesh index. Maps of one
structure are stacked into arrays (`_Stacked`): one kernel trace serves every
device. Otherwise, and always for splash (whose kernel takes a static MaskInfo:
each device's is built from its own shard's BlockMap), `lax.switch` picks among
the static maps. With traced operands there are no maps yet: each device
compiles its shard's map from the operands it holds (`ShardPlan.traced_map`).
Every device gets the traced operands whole along the sequence, in natural order
(a map needs its rows' and its keys' values, and they are `L` integers against
K/V's `L x H x D`); batched ones keep their batch split over `batch_axis`.

Inputs may arrive in any sharding: host arrays, replicated, sharded along any axis,
on a mesh with `Auto` or `Explicit` axes. Each enters the `shard_map` resharded to
the spec it needs (`_placed`), so a data pipeline's sharding never reaches a gather.

A per-head mask list gives each head shard its head groups (heads of one mask);
a device whose head shard differs from another's in its groups runs its own
branch of a `lax.switch` on the model-axis index.

Batch goes over `batch_axis`, heads and KV heads over `head_axis` (both must
divide), sequence over `seq_axis`. Gradients are JAX's through shard_map,
all_gather, ppermute, switch and the backends' own rules.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from maskc.compiled.blockmap import BlockMap
from maskc.compiled.tiles import Runs, run_lengths
from maskc.kernels import api
from maskc.language.errors import BackendError

# Log-sum-exp of a row with no allowed key (the contract of every `run_with_lse`).
NEG_LSE = -1e30


def _axis_size(mesh, axis) -> int:
  return 1 if axis is None else int(mesh.shape[axis])


def _index(axis):
  return 0 if axis is None else jax.lax.axis_index(axis)


def _pad_runs(runs: Runs, r: int) -> Runs:
  pad = [(0, 0)] * (runs.start.ndim - 1) + [(0, r - runs.start.shape[-1])]
  start, stop, state = (np.pad(np.asarray(a), pad) for a in runs[:3])
  return Runs(start, stop, state, np.asarray(runs.count))


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
  def build(maps) -> _Stacked | None:
    r = max(bm.rows.start.shape[-1] for bm in maps)
    rc = max(bm.cols.start.shape[-1] for bm in maps)
    bounds = _bounds(maps)
    flat: list[tuple[list[Any], jax.tree_util.PyTreeDef]] = []
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


class _Choice:
  """Static maps, one per device cell; `call(idx, fn, *args)` runs `fn(map, *args)` with
  the cell's map: a stacked pick (one trace) or a `lax.switch` among static maps."""

  def __init__(self, maps, stack: bool):
    self.maps = maps
    self.stacked = _Stacked.build(maps) if stack else None

  def call(self, idx, fn, *args):
    if self.stacked is not None:
      return fn(self.stacked.pick(idx), *args)
    if len(self.maps) == 1:
      return fn(self.maps[0], *args)
    return jax.lax.switch(idx, [functools.partial(fn, bm) for bm in self.maps], *args)


def _lse_runner(backend: str, interpret):
  """The backend's `run_with_lse(q, k, v, bm, *, scale, logits_soft_cap)` for ring steps."""
  mod = api.BACKENDS[backend].load()
  fn = mod.run_with_lse
  if fn is None:
    raise BackendError(f"the {backend} backend has no run_with_lse, which ring steps need",
                       hint="Use strategy='all_gather', or backend='flash' (GPU) or 'xla'; "
                            "backend='auto' runs rings on flash on a GPU.")
  return functools.partial(fn, interpret=interpret)


def _group_heads(q, k, v, heads, sink):
  """The group's query heads, their KV heads (one per query head) and sink logits."""
  if heads is None:
    return q, k, v, sink
  hs = np.asarray(heads)
  kv = hs // (q.shape[2] // k.shape[2])
  return q[:, :, hs], k[:, :, kv], v[:, :, kv], None if sink is None else sink[hs]


def _assemble(outs, groups):
  """Head groups' outputs back into the head shard's head order."""
  if len(outs) == 1 and groups[0].heads is None:
    return outs[0]
  order = np.concatenate([np.asarray(g.heads) for g in groups])
  return jnp.concatenate(outs, axis=2)[:, :, np.argsort(order)]


def run(q, k, v, plan, *, mesh, batch_axis=None, head_axis=None, seq_axis=None,
        backend: str = "auto", sinks=None, scale=None, logits_soft_cap=None, interpret=None,
        operands=None, operand_kinds=None):
  """Attention of `[B, L, H, D]` arrays stored in the layout's order; output in that order.

  `operands` (traced plans only) are the operand values at natural positions, in any
  sharding; `operand_kinds` maps each name to its kind (`"scalar"`, `"token"`, `"pair"`).
  """
  layout = plan.layout
  s = layout.shards
  if _axis_size(mesh, seq_axis) != s:
    raise ValueError(f"the layout has {s} shards but mesh axis {seq_axis!r} has "
                     f"{_axis_size(mesh, seq_axis)}")
  n_data, n_heads = plan.data_shards, plan.head_shards
  spec = P(batch_axis, seq_axis, head_axis, None)
  h = q.shape[2]
  sink_arr = jnp.zeros((h,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32)
  kw = dict(scale=scale, logits_soft_cap=logits_soft_cap)
  stack = not api.BACKENDS[backend].static_maps
  lse_fn = _lse_runner(backend, interpret) if plan.strategy == "ring" else None
  have_sinks = sinks is not None

  def cell(d, r, c=None):
    return d * s + r if c is None else (d * s + r) * s + c

  # Static per-cell choices, built once outside the trace: `(m, g)` -> a `_Choice` (all_gather),
  # `(m, g, t)` -> `(_Choice, live cells)` (ring).
  choices: dict[tuple[int, ...], Any] = {}
  if not plan.traced:
    for m, groups in enumerate(plan.groups):
      for gi, g in enumerate(groups):
        if plan.strategy == "all_gather":
          choices[m, gi] = _Choice([g.maps[d][r] for d in range(n_data) for r in range(s)],
                                   stack)
        else:
          for t in range(s):
            cells = [(d, r, (r - t) % s) for d in range(n_data) for r in range(s)]
            live = np.array([g.nonempty[d][r][c] for d, r, c in cells])
            if live.any():
              choices[m, gi, t] = (_Choice([g.maps[d][r][c] for d, r, c in cells], stack), live)
  empty = set(plan.empty_steps())

  # Traced operands enter whole along the sequence, in natural order: each device compiles
  # its maps from every position's values (`L` integers against K/V's `L x H x D`), and
  # `_placed` reshards them there from whatever sharding they arrive in. Batched ones keep
  # their batch split over the data axis.
  op_names = sorted(operands or {})
  op_vals, op_specs = [], []
  for name in op_names:
    val = jnp.asarray(operands[name])
    kind = (operand_kinds or {}).get(name, "scalar")
    batched = val.ndim == {"scalar": 0, "token": 1, "pair": 2}[kind] + 1
    lead = (batch_axis if batched and n_data > 1 else None,) if batched else ()
    op_specs.append(P(*lead, *([None] * (val.ndim - len(lead)))))
    op_vals.append(val)
  shard_pos = jnp.asarray(np.stack([layout.shard_positions(r) for r in range(s)]), jnp.int32)
  all_pos = np.asarray(layout.positions)

  def head_shard(m, q, k, v, sink, ops):
    """The program of head shard m (its head groups) on this device."""
    groups = plan.groups[m]
    d = _index(batch_axis) if n_data > 1 else 0
    r = _index(seq_axis)
    nat = dict(zip(op_names, ops))

    def traced_call(g, t, fn, *args):
      """`fn(map, *args)` with this device's map compiled here from its operands: at step
      t of the ring (None: against every key). Positions are picked by the device's index;
      for splash, whose MaskInfo must be static, each shard's positions are a static
      branch of a `lax.switch` (the operands stay traced)."""
      names = {o.name for o in g.mask.operands}
      ops_g = {k_: v_ for k_, v_ in nat.items() if k_ in names}
      kv_len = layout.seq_len if t is None else layout.per_shard

      def compiled(qp, kp, *args):
        return fn(plan.traced_map(g, qp, kp, kv_len, ops_g), *args)
      if stack:
        kp = all_pos if t is None else shard_pos[(r - t) % s]
        return compiled(shard_pos[r], kp, *args)
      branches = [functools.partial(
          compiled, layout.shard_positions(rr),
          all_pos if t is None else layout.shard_positions((rr - t) % s)) for rr in range(s)]
      return jax.lax.switch(r, branches, *args) if s > 1 else branches[0](*args)

    if plan.strategy == "all_gather":
      if seq_axis is not None:
        k = jax.lax.all_gather(k, seq_axis, axis=1, tiled=True)
        v = jax.lax.all_gather(v, seq_axis, axis=1, tiled=True)
      outs = []
      for gi, g in enumerate(groups):
        qg, kg, vg, sg = _group_heads(q, k, v, g.heads, sink if have_sinks else None)

        def one(bm, q, k, v, sg=sg):
          return api.attention(q, k, v, bm, backend=backend, sinks=sg, interpret=interpret,
                               **kw)
        if plan.traced:
          outs.append(traced_call(g, None, one, qg, kg, vg))
        else:
          outs.append(choices[m, gi].call(cell(d, r), one, qg, kg, vg))
      return _assemble(outs, groups)

    perm = [(i, (i + 1) % s) for i in range(s)]
    parts = [([], []) for _ in groups]
    for t in range(s):
      if t not in empty:
        for gi, g in enumerate(groups):
          qg, kg, vg, _ = _group_heads(q, k, v, g.heads, None)
          step = functools.partial(_step, lse_fn, **kw)
          if plan.traced:
            # Whether this step has a tile is known only on the device: skip it there.
            def live_step(bm, q, k, v, step=step):
              return jax.lax.cond(run_lengths(bm.rows).sum() > 0,
                                  lambda q, k, v: step(bm, q, k, v),
                                  lambda q, k, v: _zeros(q, v), q, k, v)
            o, lse = traced_call(g, t, live_step, qg, kg, vg)
          elif (m, gi, t) in choices:
            choice, live = choices[m, gi, t]
            idx = cell(d, r)

            def run_step(q, k, v, ch=choice, i=idx, f=step):
              return ch.call(i, f, q, k, v)

            if live.all():
              o, lse = run_step(qg, kg, vg)
            else:
              # A device whose step has no tile does no attention work at that step.
              o, lse = jax.lax.cond(jnp.asarray(live)[idx], run_step,
                                    lambda q, k, v: _zeros(q, v), qg, kg, vg)
          else:
            continue
          parts[gi][0].append(o)
          parts[gi][1].append(lse)
      if t + 1 < s:
        k = jax.lax.ppermute(k, seq_axis, perm)
        v = jax.lax.ppermute(v, seq_axis, perm)
    outs = []
    for g, (os_, ls) in zip(groups, parts):
      qg, _, vg, sg = _group_heads(q, k, v, g.heads, sink)
      outs.append(_combine(os_, ls, sg if have_sinks else None, qg, vg))
    return _assemble(outs, groups)

  def body(q, k, v, sink, *ops):
    if n_heads == 1:
      return head_shard(0, q, k, v, sink, ops)
    branches = [functools.partial(head_shard, m) for m in range(n_heads)]
    return jax.lax.switch(_index(head_axis), branches, q, k, v, sink, ops)

  in_specs = (spec, spec, spec, P(head_axis), *op_specs)
  f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False)

  def placed(*args):
    return f(*(_placed(x, mesh, p) for x, p in zip(args, in_specs)))

  # Compiled as one program (eager shard_map would dispatch the kernel op by op).
  return jax.jit(placed)(q, k, v, sink_arr, *op_vals)


def _explicit(mesh) -> bool:
  return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _placed(x, mesh, spec: P):
  """`x` laid out as `spec` on `mesh`, whatever it came as (NumPy, replicated, sharded).

  shard_map takes its inputs as they lie on an `Explicit` mesh (`jax.make_mesh`'s
  default): there they are resharded; on an `Auto` mesh a constraint suffices.
  """
  sharding = jax.sharding.NamedSharding(mesh, spec)
  if _explicit(mesh):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def _zeros(q, v):
  b, lq, h = q.shape[:3]
  return (jnp.zeros((b, lq, h, v.shape[-1]), jnp.float32),
          jnp.full((b, lq, h), NEG_LSE, jnp.float32))


def _step(lse_fn, bm, q, k, v, *, scale, logits_soft_cap):
  """One ring step: `(out f32, lse f32)` of q against this K/V shard."""
  out, lse = lse_fn(q, k, v, bm, scale=scale, logits_soft_cap=logits_soft_cap)
  return out.astype(jnp.float32), lse.astype(jnp.float32)


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
