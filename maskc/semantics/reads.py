"""Reads stay inside their operands: `check_reads`, and the guards that keep them there.

Every read of an operand (`seg[q]`, `anc[q, k]`) is checked once, when a mask is bound to a
shape and static operands: each index must stay inside the operand's axis it indexes at
every position where the read matters. A read matters only where the other items of each
`&` around it hold: `k >= 3 & anc[q, k - 3]` reads `anc` at `k - 3` only for keys `k >= 3`,
since the `&` is false elsewhere whatever the read gives. Those items are its *guards*.
Where the index can leave the operand, the positions the read's guards allow are checked
instead of all positions: a guard counts where it is a comparison of the read's own position
(`k` for the key index), literals, parameters and scalar operands (`q < n & x[q]`).

Evaluation reads every index clipped into its operand (`maskc.semantics.evaluate`, the
compiled predicate), so where a guard is false the clipped value is read and then ignored:
the result never depends on it. An unguarded read that can leave its operand is refused,
with the guard that would keep it inside in the hint.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from maskc.language import ir
from maskc.language.errors import OperandError
from maskc.semantics.evaluate import Env, evaluate
from maskc.semantics.integers import is_traced
from maskc.semantics.ranges import Analyzer, Tables
from maskc.semantics.shape import Shape


class Check(NamedTuple):
  """One index of a read: the index term, the operand, the operand's axis it indexes, and
  which index for messages ("first ", "second " or "")."""
  term: ir.Term
  operand: str
  axis: int
  which: str


class Occurrence(NamedTuple):
  """A read where it occurs in a mask: the read, its checks, and its guards (the other items
  of each `&` around it)."""
  read: ir.Node
  checks: tuple[Check, ...]
  guards: tuple[ir.Mask, ...]


@functools.lru_cache(maxsize=1024)
def reads_of(m: ir.Mask) -> tuple[Occurrence, ...]:
  """Each read of `m` where it occurs (calls expanded), with its checks and its guards."""
  out: list[Occurrence] = []

  def visit(n: ir.Node, guards: tuple[ir.Mask, ...]) -> None:
    if isinstance(n, ir.Call):
      visit(ir.expand(n), guards)
      return
    if isinstance(n, ir.And):
      for i, item in enumerate(n.items):
        visit(item, guards + n.items[:i] + n.items[i + 1:])
      return
    if isinstance(n, ir.Read):
      out.append(Occurrence(n, (Check(n.index, n.operand.name, -1, ""),), guards))
    elif isinstance(n, ir.PairRead):
      out.append(Occurrence(n, (Check(n.q_index, n.operand.name, -2, "first "),
                                Check(n.k_index, n.operand.name, -1, "second ")), guards))
    if not isinstance(n, ir.Definition):
      for c in n.children():
        visit(c, guards)

  visit(m, ())
  return tuple(dict.fromkeys(out))  # a read under the same guards once


def _static_guards(guards: tuple[ir.Mask, ...]) -> bool:
  """Whether every guard is free of operand reads (positions, literals, scalars only)."""
  return all(not isinstance(x, (ir.Read, ir.PairRead)) for g in guards for x in ir.walk(g))


@functools.lru_cache(maxsize=1024)
def _position_indices(m: ir.Mask) -> bool:
  """Whether every index `m` reads at, and every guard of a read, is arithmetic of positions
  and literals alone: the verdict then follows from the shape and the lengths."""
  return all(not any(isinstance(x, (ir.Read, ir.PairRead, ir.Scalar, ir.Operand))
                     for node in (c.term,) + o.guards for x in ir.walk(node))
             for o in reads_of(m) for c in o.checks)


def check_reads(m: ir.Mask, shape: Shape, arrays: Mapping[str, Any], batch: int | None) -> None:
  """Raises `OperandError` when a read of `m` could index an operand outside its length at a
  position its guards allow, with static operands `arrays` (`[B', ...]`).

  The bounds of each index come from range analysis over the whole shape (one rectangle:
  no per-token array). Only when those bounds leave the operand are the indices evaluated,
  in chunks, at the positions the read's guards allow. Traced shapes and scalars are not
  checked (evaluation clips every index).
  """
  if not shape.static:
    return
  shape_of = getattr(arrays, "shape", None)  # `OperandArrays.shape`: nothing written out
  shapes = {n: tuple(shape_of(n)) if callable(shape_of) else tuple(arrays[n].shape)
            for n in arrays}
  scalars = {n: arrays[n] for n in arrays if len(shapes[n]) == 1}
  if any(is_traced(a) for a in scalars.values()):
    return
  lengths = tuple(shapes[c.operand][c.axis] for o in reads_of(m) for c in o.checks)
  if not shape.has_positions and _position_indices(m):
    _position_reads_fit(m, shape.q_len, shape.kv_len, int(shape.q_offset), lengths)
  else:
    _reads_fit(m, shape, lengths, scalars, np.arange(batch) if batch else 0)


@functools.lru_cache(maxsize=256)
def _position_reads_fit(m: ir.Mask, q_len: int, kv_len: int, q_offset: int,
                        lengths: tuple[int, ...]) -> bool:
  """`_reads_fit` where every index and guard is arithmetic of positions and literals at
  consecutive positions: the verdict follows from the shape and the operands' lengths alone,
  so it is remembered once it passes (a read outside raises, and raises again next time)."""
  _reads_fit(m, Shape.of(q_len, kv_len, q_offset), lengths, {}, 0)
  return True


def _reads_fit(m: ir.Mask, shape: Shape, lengths: tuple[int, ...], scalars: dict[str, Any],
               batch: Any) -> None:
  """`check_reads` of `m`'s reads (`reads_of`, in order) into operands of `lengths` on the
  axes they index, with static `scalars` for batch rows `batch`."""
  (q0, q1), (k0, k1) = shape.q_hull(), shape.k_hull()
  analyzer = Analyzer(np, Tables(np, scalars), q0, q1, k0, k1, batch)
  checks = [(o, c) for o in reads_of(m) for c in o.checks]
  for (o, c), length in zip(checks, lengths):
    axes = ir.positions_of(c.term)
    bounds = _index_bounds(analyzer, c.term)
    if bounds is not None and bounds[0] >= 0 and bounds[1] < length:
      continue  # sound bounds inside the operand: every index is
    guards = tuple(g for g in o.guards if ir.positions_of(g) <= axes and _static_guards((g,)))
    if guards or bounds is None or not bounds[2] or shape.has_positions:
      found = _evaluated_bounds(c.term, shape, axes, scalars, batch, guards)
      if found is None:
        continue  # the guards hold nowhere: the read never matters
      lo, hi = found
    else:
      lo, hi = bounds[0], bounds[1]
    if lo < 0 or hi >= length:
      where = (f"positions q in [{q0}, {q1}]" if "q" in axes
               else f"positions k in [{k0}, {k1}]")
      guard = (f"`{c.term} >= 0 & {o.read}`" if lo < 0 else
               f"`{c.term} < {length} & {o.read}`")
      fix = (f"Give `{c.operand}` at least {hi + 1} entries on that axis, or guard the read "
             f"in the same `&`: {guard}" if lo >= 0 else
             f"Indices below 0 cannot be read: check the offset, or guard the read in the "
             f"same `&`: {guard}")
      raise OperandError(
          f"operand `{c.operand}` has length {length} on its {c.which}axis, but the mask reads "
          f"`{o.read}` at indices {lo}..{hi} (for {where}"
          f"{', where its guards hold' if guards else ''})", hint=fix)


def _index_bounds(analyzer: Analyzer, index: ir.Term) -> tuple[int, int, bool] | None:
  """`(lo, hi, attained)` of an index over the shape by range analysis, or None if unknown."""
  try:
    with np.errstate(over="ignore", invalid="ignore"):
      t = analyzer.term(index)
  except (KeyError, TypeError, OverflowError):
    return None  # reads another per-token operand, or beyond the analysis' type
  ok = np.all(np.asarray(t.ok))
  if not ok:
    return None
  return (int(np.min(t.lo)), int(np.max(t.hi)), bool(np.all(np.asarray(t.tight))))


def _evaluated_bounds(index: ir.Term, shape: Shape, axes: frozenset[str],
                      scalars: dict[str, Any], batch: Any, guards: tuple[ir.Mask, ...] = (),
                      chunk: int = 1 << 20) -> tuple[int, int] | None:
  """Exact min and max of an index over the positions of its axis where `guards` hold (all
  of its axis: none given), evaluated in chunks; None where the guards hold nowhere."""
  every = shape.rows(np) if "q" in axes else shape.cols(np)
  n = every.shape[-1]
  lo: int | None = None
  hi: int | None = None
  b = batch[:, None] if not np.isscalar(batch) else 0
  if every.shape[0] > 1 and np.isscalar(batch):
    b = np.zeros((every.shape[0], 1), np.int64)
  for s0 in range(0, n, chunk):
    pos = every[:, s0:s0 + chunk]
    env = Env(np, pos, pos, scalars, b)
    values = np.asarray(evaluate(index, env))
    if guards:
      held = np.asarray(True)
      for g in guards:
        held = held & np.asarray(evaluate(g, env), bool)
      values, held = np.broadcast_arrays(values, held)
      values = values[held]
    if not values.size:
      continue
    lo = int(values.min()) if lo is None else min(lo, int(values.min()))
    hi = int(values.max()) if hi is None else max(hi, int(values.max()))
  if lo is None or hi is None:
    return None
  return lo, hi

