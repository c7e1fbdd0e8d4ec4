"""Per-shard block maps for context-parallel attention, compiled for each shard's rows only.

A `Layout` (`maskc._layout`) says which natural positions each sequence shard
holds. For `all_gather`, shard r's queries attend to every key, gathered in the
layout's stored order: its map is the mask compiled for its `L / S` rows at
positions `layout.shard_positions(r)` against keys at `layout.positions`. For
`ring`, keys arrive one shard at a time: the map of step `(r, s)` is compiled
for shard r's rows against shard s's keys, and a step whose map has no tile is
skipped. Each compile is the static frontier over that shard's tile lines
only, so its work follows the shard's boundary, never the whole mask.

Batched operands (segment ids `[B, L]`, ...) are split over the data axis: data
shard d's maps read batch rows `d B/D .. (d+1) B/D - 1`.

This module is compiler-side: it builds `BlockMap`s and imports no kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from maskc import _ir as ir
from maskc._bind import as_mask
from maskc._blockmap import BlockMap
from maskc._errors import MaskTypeError, MaskValueError, OperandError
from maskc._layout import Layout
from maskc._tiles import run_lengths

STRATEGIES = ("all_gather", "ring")
_NDIM = {"scalar": 0, "token": 1, "pair": 2}


@dataclasses.dataclass(frozen=True, eq=False)
class ShardPlan:
  """The block maps every device of a context-parallel attention needs.

  Attributes:
    layout: the sequence layout.
    strategy: `"all_gather"` or `"ring"`.
    data_shards: how many batch shards the operands were split into (1 if unbatched).
    maps: all_gather: `maps[d][r]`, shard r's rows against all keys in stored order;
      ring: `maps[d][r][s]`, shard r's rows against shard s's keys.
    nonempty: ring: `nonempty[d][r][s]`, whether that map has a tile (None for all_gather).
  """
  layout: Layout
  strategy: str
  data_shards: int
  maps: tuple
  nonempty: tuple | None = None

  def step_map(self, d: int, r: int, t: int) -> BlockMap | None:
    """Ring step t of q shard r: the map against the keys of shard `(r - t) mod S`, or None
    when it has no tile (the step is skipped)."""
    c = (r - t) % self.layout.shards
    return self.maps[d][r][c] if self.nonempty[d][r][c] else None

  def empty_steps(self) -> list[int]:
    """Ring steps no device has a tile in (skipped entirely)."""
    s = self.layout.shards
    return [t for t in range(s) if all(self.step_map(d, r, t) is None
                                       for d in range(self.data_shards) for r in range(s))]


def split_operands(mask: ir.Mask, operands: dict[str, Any] | None, batch: int,
                   data_shards: int) -> list[dict[str, Any]]:
  """Operands per data shard: batched ones cut along their batch axis, the rest shared."""
  operands = dict(operands or {})
  if any(isinstance(v, jax.core.Tracer) for v in operands.values()):
    raise OperandError("sharded attention compiles per-shard maps from static operands; got "
                       "traced ones", hint="Pass NumPy operand values (they are read outside "
                                           "jit, once per mask and layout).")
  kinds = {s.name: s.kind for s in mask.operands}
  out = [dict() for _ in range(data_shards)]
  for name, value in operands.items():
    arr = np.asarray(value)
    batched = name in kinds and arr.ndim == _NDIM[kinds[name]] + 1
    if batched and data_shards > 1:
      if arr.shape[0] != batch:
        raise OperandError(f"operand `{name}` has batch size {arr.shape[0]}, but q has {batch}")
      per = batch // data_shards
      for d in range(data_shards):
        out[d][name] = arr[d * per:(d + 1) * per]
    else:
      for d in range(data_shards):
        out[d][name] = arr
  return out


def plan(mask: Any, layout: Layout, *, strategy: str = "all_gather", block_q: int,
         block_kv: int, operands: dict[str, Any] | None = None, batch: int = 1,
         data_shards: int = 1) -> ShardPlan:
  """Compiles the per-shard maps of `mask` under `layout` (see the module docstring).

  Args:
    mask: mask text or a Mask (one mask for every head).
    layout: the sequence layout (`maskc.balance`).
    strategy: `"all_gather"` or `"ring"`.
    block_q, block_kv: tile sizes; they must divide the layout's chunk.
    operands: static operand values at natural positions.
    batch: the global batch size (to split batched operands).
    data_shards: batch shards.
  """
  if strategy not in STRATEGIES:
    raise MaskValueError(f"unknown strategy {strategy!r}", hint="Use 'all_gather' or 'ring'.")
  if not isinstance(mask, (str, ir.Mask)):
    raise MaskTypeError("sharded attention takes one mask for every head",
                        hint="Per-head masks are not supported here; pass one mask.")
  m = as_mask(mask)
  if layout.chunk % block_q or layout.chunk % block_kv:
    raise MaskValueError(f"the layout's chunk of {layout.chunk} tokens is not a whole number "
                         f"of tiles {block_q}x{block_kv}",
                         hint="Balance with `block` a multiple of the attention's tiles.")
  if batch % data_shards:
    raise MaskValueError(f"batch {batch} does not split over {data_shards} data shards")
  from maskc._lower import compile as compile_
  per_data = split_operands(m, operands, batch, data_shards)
  s, n = layout.shards, layout.seq_len
  maps, nonempty = [], []
  for ops in per_data:
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
  return ShardPlan(layout, strategy, len(per_data), tuple(maps),
                   tuple(nonempty) if strategy == "ring" else None)
