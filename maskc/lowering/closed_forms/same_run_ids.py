"""Rule `same_run_ids`: `runs(x)[q + s] == runs(x)[k + t] & x[q + s]` (`bidirectional(img)`'s
body) analysed by the ids of x's runs of zeros and nonzeros (static) or by run labels,
exactly (traced).

`bidirectional(img)`'s body. Analysed as written, a tile line that crosses the
start of an image span reads run ids {0, s} and `img` {0, 1}: both halves of the
`&` are mixed, and the analysis cannot tell that they never hold together, so
every tile of that line across text stays ambiguous and goes to refinement
(thousands of tiles for a few spans a row: `docs/lowering.md`, "Measurements behind the design").

Label x's runs of zeros and nonzeros in order: `L = 2 c + (x == 0)`, where c
counts the runs of nonzeros started at or before the token (nonzero run j is 2j,
the zeros after it 2j + 1). Then the mask is `L[a] == L[b]` with `L[a]` even. L
steps by one at every run boundary, so a tile line reads every label between its
min and max, and a tile follows from its rows' labels `[a, b]` and its columns'
`[c, d]` alone, for any operand: it holds somewhere exactly when `[max(a, c),
min(b, d)]` holds an even label, everywhere when `a = b = c = d` is even, and is
otherwise certainly mixed. The traced path seeds the analysis with that verdict
(`Analyzer.memo`); refinement and evaluation read the mask as written.

On the static path the analysis reads the ids of x's runs of zeros and nonzeros instead
(`maskc.semantics.ranges.Tables(same_runs=True)`, which decides more tiles of the
pattern than the run ids as written), and rule `equal_reads` lowers the pattern alone
exactly. An analysis rule (step "tables"): its static lower builds the tables the
analysis reads (`maskc.lowering.static`), its traced lower expands the pattern's places.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, cast

import numpy as np
from jax.typing import DTypeLike

from maskc.arrays.bit_words import count_through
from maskc.language import ir
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.rules import Rule
from maskc.semantics.integers import nonzero_run_starts
from maskc.semantics.operand_runs import unit_shift
from maskc.semantics.ranges import EMPTY, FULL, PARTIAL, Tables, Truth3, same_run_read


@dataclasses.dataclass(frozen=True)
class SameRun:
  """One `runs(x)[q + s] == runs(x)[k + t] & x[q + s]` in a mask (`node`, the `&`), or the
  same with `& x[k + t]`: where the ids are equal, both reads are in one run of nonzeros."""
  node: ir.Mask
  operand: str
  s: int
  t: int

  @property
  def key(self) -> str:
    """The operand-table key of x's run labels. Not a valid operand name: no clash."""
    return label_key(self.operand)


def label_key(name: str) -> str:
  return f"run-labels({name})"


def same_runs(m: ir.Mask) -> tuple[ir.Mask, list[SameRun]]:
  """`m` with the calls that hold the pattern expanded (the same mask), and the pattern's
  places in it, as `&` nodes of exactly an equality of run ids and the truth read."""
  found: list[SameRun] = []
  return _expand(m, found), found


def labels(xp: ModuleType, x: Any, dtype: DTypeLike) -> Any:
  """Run labels of `x` along its last axis: `2 c + (x == 0)`, c the nonzero runs started
  at or before each token."""
  nz, starts = nonzero_run_starts(xp, x)
  started = count_through(xp, starts, dtype)
  return 2 * started + xp.logical_not(nz).astype(dtype)


def run_ids(xp: ModuleType, labels: Any) -> Any:
  """`runs(x)` from x's run labels (nonzero run j is labelled 2j; zeros are odd)."""
  return xp.where(labels % 2 == 0, labels // 2, xp.zeros_like(labels))


def same_run_truth(xp: ModuleType, q_lo: Any, q_hi: Any, k_lo: Any, k_hi: Any) -> Truth3:
  """Exact verdicts from the labels each tile's rows and columns read (inclusive ranges)."""
  lo, hi = xp.maximum(q_lo, k_lo), xp.minimum(q_hi, k_hi)
  meets = (lo < hi) | ((lo == hi) & (lo % 2 == 0))
  full = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo) & (q_lo % 2 == 0)
  state = xp.where(full, FULL, xp.where(meets, PARTIAL, EMPTY)).astype(xp.int8)
  return Truth3(state, True)


def _expand(m: ir.Mask, found: list[SameRun]) -> ir.Mask:
  if isinstance(m, ir.Call):
    before = len(found)
    body = _expand(ir.expand(m), found)
    return body if len(found) > before else m
  if isinstance(m, ir.Not):
    item = _expand(m.item, found)
    return m if item is m.item else ir.Not(item, m.span)
  if isinstance(m, (ir.And, ir.Or, ir.Xor)):
    if isinstance(m, ir.And):
      pattern = _pattern(m)
      if pattern is not None:
        found.append(pattern)
        return m
    items = tuple(_expand(i, found) for i in m.items)
    same = all(a is b for a, b in zip(items, m.items))
    return m if same else type(m)(items, m.span)
  return m


def _pattern(m: ir.And) -> SameRun | None:
  """The pattern when `m` is exactly `runs(x)[q + s] == runs(x)[k + t] & x[q + s]` (or
  `& x[k + t]`)."""
  if len(m.items) != 2:
    return None
  for eq, truth in (m.items, m.items[::-1]):
    name = same_run_read(eq, truth)
    if name is None:
      continue
    reads = cast(tuple[ir.Read, ir.Read], cast(ir.Compare, eq).terms)  # `same_run_read`
    for a, b in (reads, reads[::-1]):
      s, t = unit_shift(a.index, "q"), unit_shift(b.index, "k")
      if s is not None and t is not None:
        return SameRun(m, name, s, t)
  return None


def configure(tables: Tables, masks: Sequence[ir.Mask],
              geo: TileGeometry) -> Callable[[], bool]:
  """The static lower: the analysis reads the pattern by the ids of x's runs of zeros and
  nonzeros (NumPy tables only); gives whether it did, once the lowering is done."""
  tables.same_runs = tables.xp is np
  return lambda: tables.same_runs_used


SAME_RUN_IDS = Rule(
    "same_run_ids", "`runs(x)[a] == runs(x)[b]` beside `x[a]` analysed by ids of x's "
    "runs of zeros and nonzeros (static) or by run labels (traced, "
    "maskc.lowering.closed_forms.same_run_ids)", "analysis", "tables", exact=False,
    lower=configure, traced=same_runs)
