"""Per-shard block maps for context-parallel attention, compiled for each shard's rows only.

A `Layout` (`maskc.parallel.layout`) says which natural positions each sequence shard
holds. For `all_gather`, shard r's queries attend to every key, gathered in the
layout's stored order: its map is the mask compiled for its `L / S` rows at
positions `layout.shard_positions(r)` against keys at `layout.positions`. For
`ring`, keys arrive one shard at a time: the map of step `(r, s)` is compiled
for shard r's rows against shard s's keys, and a step whose map has no tile is
skipped. Each compile is the static frontier over that shard's tile lines
only, so its work follows the shard's boundary, never the whole mask.

Batched operands (segment ids `[B, L]`, ...) are split over the data axis: data
shard d's maps read batch rows `d B/D .. (d+1) B/D - 1`.

Heads: a per-head mask list is cut over the head shards (heads over the model
axis); each head shard's heads are grouped by distinct mask (`HeadGroup`), and
every group has its own maps, so a device attends its heads with their masks.

Traced operands (the caller is inside `jax.jit` with operands as arguments), and
global arrays spanning other processes' devices, cannot be read here
(`maskc.parallel.layout.on_devices`): the plan then holds no maps, and each device
compiles its shard's (or its ring step's) map inside `shard_map` from the operands it
holds (`ShardPlan.traced_map`, the dynamic path of `maskc.compile`).

This module is compiler-side: it builds `BlockMap`s and imports no kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np

from maskc.compiled.blockmap import BlockMap
from maskc.compiled.tiles import run_lengths
from maskc.language import ir
from maskc.language.arguments import as_mask
from maskc.language.errors import MaskTypeError, MaskValueError, OperandError
from maskc.lowering.compile import compile as compile_
from maskc.parallel.layout import Layout, on_devices

STRATEGIES = ("all_gather", "ring")
_NDIM = {"scalar": 0, "token": 1, "pair": 2}


@dataclasses.dataclass(frozen=True, eq=False)
class HeadGroup:
  """The heads of one head shard that share one mask, and that mask's per-shard maps.

  Attributes:
    mask: the mask.
    heads: the group's heads, indices into the head shard's local heads; None when
      the group is every local head (GQA stays intact).
    maps: all_gather: `maps[d][r]`; ring: `maps[d][r][s]` (see `ShardPlan`); None
      when the operands are traced (maps are then compiled on the device).
    nonempty: ring: `nonempty[d][r][s]`, whether that map has a tile (None otherwise).
  """
  mask: ir.Mask
  heads: tuple[int, ...] | None
  maps: tuple | None
  nonempty: tuple | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class ShardPlan:
  """The block maps every device of a context-parallel attention needs.

  Attributes:
    layout: the sequence layout.
    strategy: `"all_gather"` or `"ring"`.
    data_shards: how many batch shards the operands were split into (1 if unbatched).
    groups: per head shard, its `HeadGroup`s (one head shard unless a per-head mask
      list is cut over the head axis).
    block_q, block_kv: the tile sizes.
    traced: the operands are traced (or span other processes): no static maps, compile
      on the device.
  """
  layout: Layout
  strategy: str
  data_shards: int
  groups: tuple[tuple[HeadGroup, ...], ...]
  block_q: int = 0
  block_kv: int = 0
  traced: bool = False

  @property
  def head_shards(self) -> int:
    """Head shards with their own groups (1 when every head shard attends alike)."""
    return len(self.groups)

  @property
  def maps(self) -> tuple | None:
    """The maps of the only group (one mask for every head): `maps[d][r]` or `maps[d][r][s]`."""
    return self._only().maps

  @property
  def nonempty(self) -> tuple | None:
    """Ring: `nonempty[d][r][s]` of the only group."""
    return self._only().nonempty

  def _only(self) -> HeadGroup:
    if len(self.groups) != 1 or len(self.groups[0]) != 1:
      raise ValueError("this plan has several head groups; read plan.groups")
    return self.groups[0][0]

  def step_map(self, d: int, r: int, t: int, group: HeadGroup | None = None) -> BlockMap | None:
    """Ring step t of q shard r: the map against the keys of shard `(r - t) mod S`, or None
    when it has no tile (the step is skipped)."""
    g = self._only() if group is None else group
    c = (r - t) % self.layout.shards
    maps, nonempty = cast(tuple, g.maps), cast(tuple, g.nonempty)  # a static ring plan's
    return maps[d][r][c] if nonempty[d][r][c] else None

  def empty_steps(self) -> list[int]:
    """Ring steps no device has a tile in (skipped entirely); none are known when traced
    (and all_gather has no steps)."""
    if self.traced or self.strategy != "ring":
      return []
    s = self.layout.shards
    return [t for t in range(s) if all(
        self.step_map(d, r, t, g) is None for gs in self.groups for g in gs
        for d in range(self.data_shards) for r in range(s))]

  def traced_map(self, group: HeadGroup, q_positions, kv_positions, kv_len: int,
                 operands: Mapping[str, Any]) -> BlockMap:
    """A shard's map compiled on the device from traced positions and operands.

    Args:
      group: the head group whose mask to compile.
      q_positions: `[L / S]` natural positions of this shard's rows (traced).
      kv_positions: `[kv_len]` natural positions of the keys it attends to.
      kv_len: the number of those keys.
      operands: the device's operand values at natural positions (its batch rows).
    """
    return compile_(group.mask, self.layout.per_shard, kv_len, block_q=self.block_q,
                    block_kv=self.block_kv, q_positions=q_positions, kv_positions=kv_positions,
                    operands=operands)


def operand_kinds(masks: Sequence[ir.Mask]) -> dict[str, str]:
  """`{operand name: kind}` over every mask (`"scalar"`, `"token"` or `"pair"`)."""
  out: dict[str, str] = {}
  for m in masks:
    out.update({s.name: s.kind for s in m.operands})
  return out


def is_batched(kinds: dict[str, str], name: str, value: Any) -> bool:
  """Whether operand `name` carries a leading batch axis."""
  return name in kinds and np.ndim(value) == _NDIM[kinds[name]] + 1


def split_operands(mask: ir.Mask | Sequence[ir.Mask], operands: Mapping[str, Any] | None,
                   batch: int, data_shards: int) -> list[dict[str, Any]]:
  """Operands per data shard: batched ones cut along their batch axis, the rest shared."""
  operands = dict(operands or {})
  if on_devices(operands):
    raise OperandError("static per-shard maps need operands read on the host; got traced "
                       "ones or global arrays spanning other processes",
                       hint="Use maskc.sharded_attention, which compiles the maps on the "
                            "devices when the operands are traced.")
  kinds = operand_kinds([mask] if isinstance(mask, ir.Mask) else mask)
  out: list[dict[str, Any]] = [{} for _ in range(data_shards)]
  for name, value in operands.items():
    arr = np.asarray(value)
    if is_batched(kinds, name, arr) and data_shards > 1:
      if arr.shape[0] != batch:
        raise OperandError(f"operand `{name}` has batch size {arr.shape[0]}, but q has {batch}")
      per = batch // data_shards
      for d in range(data_shards):
        out[d][name] = arr[d * per:(d + 1) * per]
    else:
      for d in range(data_shards):
        out[d][name] = arr
  return out


def head_groups(mask: Any, heads: int | None, head_shards: int) -> list[list[tuple]]:
  """Per head shard, `(mask, local heads or None)` for each distinct mask of its heads.

  One mask (text or a Mask) gives one head shard with one group of every head. A
  per-head sequence is cut into `head_shards` equal runs of heads (the model axis
  holds heads `m H/M .. (m+1) H/M - 1`); head shards that hold the same masks in the
  same order share one program, so a list of equal masks costs what one mask does.
  """
  if isinstance(mask, (str, ir.Mask)):
    return [[(as_mask(mask), None)]]
  if not isinstance(mask, Sequence) or not len(mask):
    raise MaskTypeError(f"expected a mask, mask text or a per-head sequence of them, got "
                        f"{type(mask).__name__}", hint='Pass "causal" or ["causal", ...].')
  masks = [as_mask(m) for m in mask]
  if heads is not None and len(masks) != heads:
    raise MaskValueError(f"the mask list has {len(masks)} masks but q has {heads} heads",
                         hint="Pass one mask per query head, or a single mask for all heads.")
  if all(m == masks[0] for m in masks):
    return [[(masks[0], None)]]
  if len(masks) % head_shards:
    raise MaskValueError(f"{len(masks)} head masks do not divide over {head_shards} head shards")
  per = len(masks) // head_shards
  out: list[list[tuple[ir.Mask, tuple[int, ...] | None]]] = []
  for m in range(head_shards):
    local = masks[m * per:(m + 1) * per]
    distinct: list[ir.Mask] = []
    for x in local:
      if not any(x == y for y in distinct):
        distinct.append(x)
    if len(distinct) == 1:
      out.append([(distinct[0], None)])
    else:
      out.append([(u, tuple(i for i, x in enumerate(local) if x == u)) for u in distinct])
  if all(_same(o, out[0]) for o in out):
    return [out[0]]
  return out


def _same(a: list[tuple], b: list[tuple]) -> bool:
  return len(a) == len(b) and all(x[0] == y[0] and x[1] == y[1] for x, y in zip(a, b))


def plan(mask: Any, layout: Layout, *, strategy: str = "all_gather", block_q: int,
         block_kv: int, operands: Mapping[str, Any] | None = None, batch: int = 1,
         data_shards: int = 1, heads: int | None = None, head_shards: int = 1) -> ShardPlan:
  """Compiles the per-shard maps of `mask` under `layout` (see the module docstring).

  Args:
    mask: mask text or a Mask (one mask for every head), or a sequence of them, one
      per query head.
    layout: the sequence layout (`maskc.balance`).
    strategy: `"all_gather"` or `"ring"`.
    block_q, block_kv: tile sizes; they must divide the layout's chunk.
    operands: operand values at natural positions. Static ones are read here; when
      any is traced, the plan holds no maps (`traced`) and devices compile them.
    batch: the global batch size (to split batched operands).
    data_shards: batch shards.
    heads: the query heads (checked against a per-head mask list).
    head_shards: head shards a per-head mask list is cut into.
  """
  if strategy not in STRATEGIES:
    raise MaskValueError(f"unknown strategy {strategy!r}", hint="Use 'all_gather' or 'ring'.")
  per_head = head_groups(mask, heads, head_shards)
  if layout.chunk % block_q or layout.chunk % block_kv:
    raise MaskValueError(f"the layout's chunk of {layout.chunk} tokens is not a whole number "
                         f"of tiles {block_q}x{block_kv}",
                         hint="Balance with `block` a multiple of the attention's tiles.")
  if batch % data_shards:
    raise MaskValueError(f"batch {batch} does not split over {data_shards} data shards")
  if on_devices(operands):
    groups = tuple(tuple(HeadGroup(m, hs, None) for m, hs in gs) for gs in per_head)
    return ShardPlan(layout, strategy, data_shards, groups, block_q, block_kv, traced=True)
  masks = [m for gs in per_head for m, _ in gs]
  per_data = split_operands(masks, operands, batch, data_shards)
  groups = tuple(tuple(_group(m, hs, layout, strategy, block_q, block_kv, per_data)
                       for m, hs in gs) for gs in per_head)
  return ShardPlan(layout, strategy, len(per_data), groups, block_q, block_kv)


def _group(m: ir.Mask, heads, layout: Layout, strategy: str, block_q: int, block_kv: int,
           per_data: list[dict[str, Any]]) -> HeadGroup:
  s, n = layout.shards, layout.seq_len
  names = {o.name for o in m.operands}
  maps: list[tuple[Any, ...]] = []
  nonempty: list[tuple[tuple[bool, ...], ...]] = []
  for all_ops in per_data:
    ops = {k: v for k, v in all_ops.items() if k in names}
    if strategy == "all_gather":
      maps.append(tuple(compile_(m, layout.per_shard, n, block_q=block_q, block_kv=block_kv,
                                 q_positions=layout.shard_positions(r),
                                 kv_positions=layout.positions, operands=ops)
                        for r in range(s)))
    else:
      rows = tuple(tuple(compile_(m, layout.per_shard, layout.per_shard, block_q=block_q,
                                  block_kv=block_kv, q_positions=layout.shard_positions(r),
                                  kv_positions=layout.shard_positions(c), operands=ops)
                         for c in range(s)) for r in range(s))
      maps.append(rows)
      nonempty.append(tuple(tuple(bool(np.asarray(run_lengths(bm.rows)).sum()) for bm in row)
                            for row in rows))
  return HeadGroup(m, heads, tuple(maps), tuple(nonempty) if strategy == "ring" else None)
