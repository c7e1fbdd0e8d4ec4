"""Rule `aligned_pairs`: pairwise reads aligned with the tiles analysed through one blocked
pass over the operand (any and all per tile), not through 2-D prefix counts.

`anc[q, k]` (a tree's ancestor matrix), `sel[q // 64, k // 64]` (a block selection) and
`a[(q + s) // r, (k + t) // c]` in general read one block of the operand per tile where the
tiles start at the blocks' edges: `(q_offset + s) % r == 0` and `block_q % r == 0`, and the
same for keys (`t % c == 0`, `block_kv % c == 0`), on consecutive positions with a static
offset. A rectangle of whole tiles then reads whole blocks, and its verdict is exact from
how many of them hold a nonzero and how many only nonzeros (`maskc.semantics.pair_blocks`).
The general read keeps 2-D prefix counts of the operand, one int32 per entry: 256 MiB
beside an 8K x 8K boolean operand of 64 MiB, over the default memory budget.

An analysis rule at step "tables": it registers the aligned reads with the tables the
analysis reads, on both paths (`maskc.lowering.static`, `maskc.lowering.traced`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from maskc.language import ir
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.rules import Rule
from maskc.semantics.operand_runs import unit_read
from maskc.semantics.pair_blocks import BlockAxis
from maskc.semantics.ranges import Tables


def floor_read(t: ir.Term) -> tuple[str, int, int] | None:
  """`(axis, s, r)` where index `t` is `(axis + s) // r` (r >= 1), or `axis + s` (r = 1)."""
  found = unit_read(t)
  if found is not None:
    return found[0], found[1], 1
  if (isinstance(t, ir.Arith) and t.op == "//" and isinstance(t.rhs, ir.Const) and
      t.rhs.value >= 1):
    inner = unit_read(t.lhs)
    if inner is not None:
      return inner[0], inner[1], int(t.rhs.value)
  return None


def blocks_of(read: ir.PairRead, geo: TileGeometry,
              shape: tuple[int, ...]) -> tuple[BlockAxis, BlockAxis] | None:
  """The blocks a pairwise read of an operand of `shape` (`[B', Q, K]`) reads per tile of
  `geo`, where its indices are aligned with the tiles; else None."""
  if geo.positions or not geo.shape.static:
    return None
  axes = []
  for index, axis, origin, block, length, size in (
      (read.q_index, "q", int(geo.shape.q_offset), geo.bq, geo.shape.q_len, shape[-2]),
      (read.k_index, "k", 0, geo.bk, geo.shape.kv_len, shape[-1])):
    found = floor_read(index)
    if found is None or found[0] != axis:
      return None
    _, s, r = found
    if (origin + s) % r or block % r:
      return None
    axes.append(BlockAxis((origin + s) // r, block // r, (origin + s + length - 1) // r + 1,
                          size))
  return axes[0], axes[1]


def lower(tables: Tables, masks: Sequence[ir.Mask], geo: TileGeometry) -> Callable[[], bool]:
  """Registers the aligned pairwise reads of `masks` with `tables`; gives whether any was."""
  aligned = False
  for m in masks:
    for n in ir.walk(m):
      if isinstance(n, ir.PairRead):
        blocks = blocks_of(n, geo, tables.shape(n.operand.name))
        if blocks is not None:
          tables.align_pair(n, *blocks)
          aligned = True
  return lambda: aligned


ALIGNED_PAIRS = Rule(
    "aligned_pairs", "pairwise reads aligned with the tiles (`anc[q, k]`, `sel[q // 64, k // "
    "64]`) analysed through any and all per tile, from one blocked pass "
    "(maskc.lowering.closed_forms.aligned_pairs)", "analysis", "tables", exact=True,
    lower=lower)
