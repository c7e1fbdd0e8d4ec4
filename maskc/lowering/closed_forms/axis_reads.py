"""Masks of one axis that read per-token operands at the bare position: their tiles
from the operands' runs, with no analysis.

`g[k]`, `~pad[k]`, `img[q] & ~pad[q]`, `seg[k] == 0`: the position enters only as
the index of reads (`x[k]`, not `x[k + 1]` or `k < n`), so the mask is constant
between the tokens where one of the operands read starts a run. One evaluation
per such stretch gives its value; a tile is FULL or EMPTY where one value covers
it and PARTIAL where the value changes inside it, exactly. The cost follows the
operands' runs plus the tiles of one axis, where the analysis of each tile costs a
pass over the mask per tile (`local(64, 64) | g[q] | g[k]`: two such parts, every
tile of each axis).
"""

from __future__ import annotations

import numpy as np

from maskc.compiled.tiles import EMPTY, FULL, PARTIAL
from maskc.language import ir
from maskc.lowering.tuning import CUT_BYTES
from maskc.semantics.evaluate import Env, evaluate_mask


def bare_reads_only(m: ir.Node) -> bool:
  """Whether positions enter `m` only as the whole index of per-token reads (`x[k]`), of
  operands (not run ids, not pairwise): `g[k] | ~pad[k]`, not `g[k] & k < n`."""
  if isinstance(m, ir.Read):
    return isinstance(m.index, ir.Pos) and not m.runs and isinstance(m.operand, ir.Operand)
  if isinstance(m, (ir.Pos, ir.PairRead, ir.Param)):
    return False
  if isinstance(m, ir.Call):
    return bare_reads_only(ir.expand(m))
  return all(bare_reads_only(c) for c in m.children() if not isinstance(c, ir.Operand))


def read_tile_states(m: ir.Mask, n: int, block: int, offset: int, nb: int, tables,
                     reads, budget) -> np.ndarray:
  """The states `[nb, ceil(n / block)]` of the tiles of one axis of `m` (`bare_reads_only`,
  reading positions of one axis only): `n` tokens at positions `offset + t`, tiles of
  `block`; `tables` give the operands' runs (`maskc.semantics.ranges.Tables.run_table`),
  `reads` the operands to evaluate with (`maskc.lowering.sampling._RunReads`); the stretches
  are charged to `budget` (the tiles are the caller's).
  """
  names = sorted({ir.array_key(r) for r in ir.walk(m) if isinstance(r, ir.Read)})
  n_tiles = -(-n // block)
  # each batch row's tokens where an operand read starts a run (clipped reads keep
  # the first and last token's value beyond the operand's ends): the stretches
  cuts = [np.arange(nb, dtype=np.int64) * n]
  for name in names:
    table = tables.run_table(name)  # of `nb` rows: forms come broadcast to the batch
    row, t = np.divmod(table.starts, table.length)
    t -= offset
    inside = (t > 0) & (t < n)
    cuts.append(row[inside] * n + t[inside])
  budget.charge(sum(c.size for c in cuts) * CUT_BYTES, "the reads of one axis")
  cut = np.unique(np.concatenate(cuts))
  b, t = np.divmod(cut, n)
  pos = t + offset
  env = Env(np, pos, pos, reads, b if nb > 1 else 0)
  value = np.asarray(evaluate_mask(m, env), bool)
  # where the value changes (a stretch of another value begins inside a row)
  change = np.flatnonzero((value[1:] != value[:-1]) & (b[1:] == b[:-1])) + 1
  # a tile's state: the value of the stretch holding its first token, PARTIAL where the
  # value changes past that token
  first = np.arange(nb, dtype=np.int64)[:, None] * n + np.arange(n_tiles) * block
  states = np.where(value[np.searchsorted(cut, first, "right") - 1], FULL, EMPTY)
  states = states.astype(np.int8)
  c = cut[change]
  inner = c % n % block != 0
  states.reshape(-1)[(c // n * n_tiles + c % n // block)[inner]] = PARTIAL
  return states
