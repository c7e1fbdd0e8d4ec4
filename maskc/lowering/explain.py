"""`maskc.explain`: which rule lowered each part of a mask, the tiles each left, and the time
each step took.

A user asks "why is my mask slow to compile?" and gets an answer: the static lowering
splits an `&` / `|` into parts where that pays, lowers each by a closed form (a rule of
`maskc.lowering.rules`) where its precondition holds, and otherwise by the generic range
analysis, whose cost follows the tiles on the mask's boundary. The explanation comes from
the lowering itself (`maskc.lowering.rules.recording`), not from a model of it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np
from jax.typing import ArrayLike

from maskc.compiled.blockmap import BlockMap
from maskc.compiled.tiles import FULL, PARTIAL, Runs, run_lengths
from maskc.language import ir
from maskc.language.arguments import MasksLike, as_mask
from maskc.language.errors import MaskValueError
from maskc.lowering import rules as lowering_rules
from maskc.lowering.compile import compile as compile_
from maskc.lowering.grid.forms import pack_runs
from maskc.lowering.registry import RULES


@dataclasses.dataclass(frozen=True, slots=True)
class PartReport:
  """One part of a mask as the static lowering lowered it.

  Attributes:
    mask: the part's text (the whole mask at depth 0).
    depth: 0 for a whole mask, 1 for a part split off it, 2 for a part of that, ...
    rule: the part rule that lowered it (`band`, `periodic`, `one_axis`, `equal_reads`,
      `tree`, `distribute`, `parts`: `maskc/lowering/closed_forms/`), or `generic` for the
      range analysis. A part `distribute` rewrote is followed by the rewritten mask, one deeper.
    reason: for `generic`, why no rule matched; else the rule's description.
    rules: every rule taken while it lowered, its own parts' included (`tile_cover`,
      `met_bounds`, ...), sorted.
    full, partial, empty: its tiles in each state, over all batch rows.
    seconds: the time it took to lower, its parts' included; an `&` / `|` lowered in parts
      combines them when its runs are packed, in the step `combine`.
  """
  mask: str
  depth: int
  rule: str
  reason: str
  rules: tuple[str, ...]
  full: int
  partial: int
  empty: int
  seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class Explanation:
  """What `maskc.explain` found: the parts of the mask, in the order they were lowered
  (each part after the `&` / `|` it belongs to), and the steps of the compile.

  Attributes:
    mask: the mask's text (the distinct masks of a sequence, joined by `; `).
    shape: `(q_len, kv_len)` tokens. tiles: `(block_q, block_kv)`. grid: `(nq, nk)` tiles
      of each batch row.
    parts: one `PartReport` per part, depth first.
    steps: `(step, seconds)`: `parse` (mask text), `bind` (shape and operands checked),
      `lower` (every part: `PartReport.seconds`), `combine` (the runs packed, parts lowered
      apart combined), `assemble` (the `BlockMap`).
    rules: every rule the compile took, sorted.
    block_map: the compiled map, as `maskc.compile` gives it.
  """
  mask: str
  shape: tuple[int, int]
  tiles: tuple[int, int]
  grid: tuple[int, int]
  parts: tuple[PartReport, ...]
  steps: tuple[tuple[str, float], ...]
  rules: tuple[str, ...]
  block_map: BlockMap = dataclasses.field(repr=False, compare=False)

  @property
  def generic(self) -> tuple[PartReport, ...]:
    """The parts the generic range analysis lowered: where the time goes on large grids."""
    return tuple(p for p in self.parts if p.rule == "generic")

  def __str__(self) -> str:
    width = min(48, max([len("part")] + [2 * p.depth + len(p.mask) for p in self.parts]))
    head = (f"{'part':<{width}}  {'rule':<12} {'FULL':>9} {'PARTIAL':>9} {'EMPTY':>11} "
            f"{'time':>9}")
    lines = [f"{self.mask}: {self.shape[0]} x {self.shape[1]} tokens, {self.tiles[0]} x "
             f"{self.tiles[1]} tiles ({self.grid[0]} x {self.grid[1]})", "", head,
             "-" * len(head)]
    for p in self.parts:
      name = _clipped("  " * p.depth + p.mask, width)
      lines.append(f"{name:<{width}}  {p.rule:<12} {p.full:>9,} {p.partial:>9,} "
                   f"{p.empty:>11,} {_ms(p.seconds):>9}")
    lines.append("")
    lines.append("steps: " + ", ".join(f"{name} {_ms(s).strip()}" for name, s in self.steps))
    lines.append("rules taken: " + (", ".join(self.rules) or "none"))
    for p in self.generic:
      lines.append(f"generic `{_clipped(p.mask, 60)}`: {p.reason}")
    return "\n".join(lines)


def explain(mask: MasksLike, q_len: int, kv_len: int | None = None, *, block_q: int = 128,
            block_kv: int = 128, operands: Mapping[str, ArrayLike] | None = None,
            **compile_kwargs: Any) -> Explanation:
  """Compiles a mask as `maskc.compile` does and says how: which rule lowered each part.

  For each part of the mask (the whole mask, and each `&` / `|` part the static lowering
  split off and lowered apart), the rule that lowered it, or why the generic range analysis
  did; the tiles it left FULL, PARTIAL and EMPTY; and the time each step took. The compile
  skips `maskc.compile`'s cache (its timings are of a fresh lowering) and stores its map
  there as usual.

  Args:
    mask: a Mask, mask text, or a sequence of them (one per head), as for `maskc.compile`.
    q_len, kv_len, block_q, block_kv, operands: as for `maskc.compile`; the operands must
      be static (NumPy or concrete JAX arrays): the traced path lowers the whole grid under
      `jit`, with no parts to explain.
    **compile_kwargs: the other keywords of `maskc.compile` (`q_offset`, `exact`,
      `memory_budget`, `q_positions`, ...).

  Returns:
    An `Explanation`; `print()` it for a table.

  Raises:
    MaskError: what `maskc.compile` raises for the same input (`MaskSyntaxError` for bad
      text, `MaskValueError` for a bad shape), and `MaskValueError` for traced operands.

  >>> import maskc
  >>> e = maskc.explain("causal & chunk(256)", 1024, block_q=128, block_kv=128)
  >>> [(p.rule, p.partial) for p in e.parts]
  [('periodic', 8)]
  """
  start = time.perf_counter()
  masks: ir.Mask | list[ir.Mask]
  if isinstance(mask, (str, ir.Mask)):
    masks = as_mask(mask)
  elif isinstance(mask, Sequence):
    masks = [as_mask(m) for m in mask]
  else:
    masks = as_mask(mask)  # raises MaskTypeError with its hint
  parsed = time.perf_counter() - start
  if any(_traced(v) for v in (operands or {}).values()) or any(
      _traced(compile_kwargs.get(k)) for k in ("q_offset", "q_positions", "kv_positions")):
    raise MaskValueError("maskc.explain needs static operands, offset and positions; got a "
                         "traced value",
                         hint="Call maskc.explain outside jax.jit, with the operands' values.")
  with lowering_rules.recording() as rec, lowering_rules.taken() as fired:
    bm = compile_(masks, q_len, kv_len, block_q=block_q, block_kv=block_kv, operands=operands,
                  **compile_kwargs)
  nb = bm.batch or 1
  nq, nk = -(-bm.q_len // block_q), -(-bm.kv_len // block_kv)
  parts = tuple(_report(r, nb, nq, nk) for r in rec.parts)
  text = "; ".join(str(m) for m in bm.masks)
  steps = ((("parse", parsed),) if _has_text(mask) else ()) + tuple(rec.steps)
  return Explanation(text, (bm.q_len, bm.kv_len), (block_q, block_kv), (nq, nk), parts, steps,
                     tuple(sorted(fired)), bm)


def _report(record: lowering_rules.PartRecord, nb: int, nq: int, nk: int) -> PartReport:
  runs = _row_runs(record.runs, nb, nq)
  full = int(np.sum(run_lengths(runs, FULL)))
  partial = int(np.sum(run_lengths(runs, PARTIAL)))
  reason = record.reason or RULES.get(record.way, "")
  return PartReport(str(record.mask), record.depth, record.way, reason,
                    tuple(sorted(record.rules)), full, partial, nb * nq * nk - full - partial,
                    record.seconds)


def _row_runs(part: Any, nb: int, nq: int) -> Runs:
  """A part's per-q-tile runs: packed by the part where it packs them (a band's closed form
  gives merged runs only)."""
  packed = getattr(part, "runs", None)
  if packed is not None:
    return cast(Runs, packed(along_rows=True))
  b, line, a, z, state = part.merged(True)
  return pack_runs(b, line, a, z, state, nb, nq)


def _traced(value: Any) -> bool:
  return isinstance(value, jax.core.Tracer)


def _has_text(mask: Any) -> bool:
  if isinstance(mask, str):
    return True
  return isinstance(mask, Sequence) and any(isinstance(m, str) for m in mask)


def _clipped(text: str, width: int) -> str:
  return text if len(text) <= width else text[:width - 1] + "…"


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:7.2f} ms"
