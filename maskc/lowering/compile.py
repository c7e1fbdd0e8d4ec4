"""Lowering: a mask at a shape → `BlockMap`.

This module binds masks to a shape and their operands, picks the path, caches
static results and assembles the map; the paths themselves live beside it:

- static (every operand a NumPy value): `maskc.lowering.static`, runs of tiles
  classified by range analysis, the tile grid never allocated;
- dynamic (traced operands or offset, under `jit`): `maskc.lowering.traced`, the
  same analysis over the whole tile grid with static shapes.

Both refine *ambiguous* PARTIAL tiles (where the analysis cannot prove the tile
mixed), by default for prelude-only masks and always with `exact=True`
(`maskc.lowering.grid.refine`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from maskc.analysis.linear import conjuncts, segment_conjunct
from maskc.compiled.blockmap import BlockMap
from maskc.compiled.intervals import KeyIntervals, one_run_each
from maskc.compiled.predicate import Predicate
from maskc.compiled.predicate_compiler import compile_predicate
from maskc.compiled.tiles import Runs, run_lengths
from maskc.language import ir
from maskc.language.arguments import MasksLike, as_mask, integer as _int
from maskc.language.errors import MaskTypeError, MaskValueError
from maskc.lowering import rules as lowering_rules
from maskc.lowering.grid.refine import Budget
from maskc.lowering.registry import RULESET
from maskc.lowering.static import compile_static
from maskc.lowering.traced import compile_dynamic
from maskc.lowering.tuning import MEMORY_BUDGET
from maskc.semantics.operand_arrays import OperandArrays
from maskc.semantics.operand_runs import RunForm
from maskc.semantics.operands import DIGEST_PAIR_BYTES, Operands, prepare_operands
from maskc.semantics.shape import Shape

# compiled static maps, with the lowering rules that made them (`maskc.lowering.rules.taken`)
_CACHE: collections.OrderedDict[Any, tuple[BlockMap, frozenset[str]]] = collections.OrderedDict()
_CACHE_SIZE = 32


def compile(mask: MasksLike, q_len: int, kv_len: int | None = None, *, block_q: int = 128,
            block_kv: int = 128, q_offset: int | None = None,
            operands: Mapping[str, ArrayLike] | None = None, exact: bool = False,
            refine_budget: int | None = None, memory_budget: int | None = None,
            q_positions: ArrayLike | None = None,
            kv_positions: ArrayLike | None = None,
            contiguous: Collection[str] = ()) -> BlockMap:
  """Lowers a mask to block-sparsity metadata.

  The tiles are always sound: a FULL tile holds only allowed pairs, an EMPTY tile
  none. For masks built from prelude masks with `& | ^ ~` and static operands they
  are exact too: no tile is PARTIAL that is all allowed or all disallowed (with
  `exact=True`, for any mask with static operands).

  Args:
    mask: a Mask, mask text, or a sequence of them (one per head; identical heads
      are compiled and stored once).
    q_len: query rows. kv_len: key columns (default `q_len`). Neither needs to be
      a multiple of its tile size.
    block_q, block_kv: tile sizes.
    q_offset: position of row 0 (default `kv_len - q_len`).
    operands: runtime operand values. NumPy values take the static path; traced
      JAX values (inside `jax.jit`) take the dynamic path.
    exact: refine ambiguous tiles of any mask by evaluating them (prelude-only
      masks are refined anyway).
    refine_budget: traced path only: at most how many ambiguous tiles to refine by
      evaluation (default: all, so the map equals the static one); tiles beyond
      it stay PARTIAL, which is still sound.
    memory_budget: bytes the static lowering may hold at once beyond its operands
      (default `maskc.lowering.compile.MEMORY_BUDGET`, 256 MiB): what it keeps (run tables,
      decided rectangles of tiles) plus the work of the current step, done in
      chunks that fit. A lowering that cannot fit raises `MaskLimitError` instead
      of running out of memory. Under `jit` (XLA owns the memory) the budget is
      checked against an upper bound per tile of XLA's need for the whole grid.
    q_positions, kv_positions: the position of each row / column, `[L]` or `[B, L]`
      (NumPy: static path; traced: dynamic path), instead of `q_offset + row` and
      `col`. Lowering is sound for any positions (a tile's positions are bounded by
      their min and max) and exact where each tile's positions are consecutive
      integers in order, as in zigzag and striped layouts with block-aligned chunks.
    contiguous: names of per-token operands whose every value is one run of each batch
      row (packed documents, each in one piece). Static values are checked; traced ones
      are taken at their word, so that `bm.key_intervals()` can call `causal &
      document(seg)` exact under `jit`.

  Returns:
    A `BlockMap`. Static results are cached by (masks, shape, tiles, operand bytes).

  >>> import maskc
  >>> maskc.compile("causal & chunk(256)", 512, block_q=128, block_kv=128).grid.tolist()
  [[1, 0, 0, 0], [2, 1, 0, 0], [0, 0, 1, 0], [0, 0, 2, 1]]
  """
  block_q = _int("block_q", block_q, minimum=1)
  block_kv = _int("block_kv", block_kv, minimum=1)
  budget = Budget(MEMORY_BUDGET if memory_budget is None else
                   _int("memory_budget", memory_budget, minimum=1))
  with lowering_rules.step("bind"):
    bound = bind_masks(mask, q_len, kv_len, q_offset=q_offset, operands=operands,
                       q_positions=q_positions, kv_positions=kv_positions)
    declared = _contiguous(bound, contiguous, operands or {})
  refine = [exact or ir.is_prelude_only(m) for m in bound.masks]
  if bound.traced:
    rows, cols = compile_dynamic(bound.masks, bound.shape, bound.operands, bound.batch, block_q,
                                 block_kv, refine, refine_budget, budget)
    return _blockmap(bound, block_q, block_kv, rows=rows, col_runs=cols,
                     line_bounds=_line_bounds(bound, block_q, block_kv), contiguous=declared)
  digests = tuple(p.static_bytes(DIGEST_PAIR_BYTES) for p in bound.prepared)
  key = None if None in digests else (
      bound.masks, bound.head_index, bound.q_len, bound.kv_len, bound.q_offset, block_q,
      block_kv, tuple(refine), lowering_rules.disabled_now(), digests,
      tuple(None if p is None else p.tobytes()
            for p in (bound.shape.q_positions, bound.shape.kv_positions)), declared)
  rules: Collection[str]
  if key is not None and key in _CACHE and lowering_rules.recorder() is None:  # `explain`: anew
    _CACHE.move_to_end(key)
    bm, rules = _CACHE[key]
  else:
    with lowering_rules.taken() as rules:
      rows, backward = compile_static(bound.masks, bound.shape, bound.operands, bound.batch,
                                      block_q, block_kv, refine, budget, forms=bound.forms)
      with lowering_rules.step("assemble"):
        bm = _blockmap(bound, block_q, block_kv, rows=rows, backward=backward,
                       contiguous=declared)
    if key is not None:  # large pairwise operands are not digested: no entry
      _CACHE[key] = bm, frozenset(rules)
      if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
  for rule in rules:  # a cached map reports the rules that lowered it
    lowering_rules.took(rule)
  return bm


@dataclasses.dataclass(frozen=True)
class Binding:
  """Masks bound to a shape with checked operands: what lowering and kernels start from.

  Attributes:
    masks: the distinct masks (identical heads once).
    head_index: per head, its index into `masks`; None for a single mask.
    shape: lengths and offset.
    prepared: per distinct mask, its checked operands.
    batch: the batch size when an operand has a batch axis, else None.
    traced: whether an operand (or the offset) is traced under jit.
    operands: all prepared operand arrays, broadcast to the batch.
    forms: the static per-token operands (and run ids) in run form, broadcast likewise.
  """
  masks: tuple[ir.Mask, ...]
  head_index: tuple[int, ...] | None
  shape: Shape
  prepared: tuple[Operands, ...]
  batch: int | None
  traced: bool
  operands: OperandArrays
  forms: dict[str, RunForm] = dataclasses.field(default_factory=dict)

  @property
  def q_len(self) -> int:
    return self.shape.q_len

  @property
  def kv_len(self) -> int:
    return self.shape.kv_len

  @property
  def q_offset(self) -> Any:
    return self.shape.q_offset


def bind_masks(mask: MasksLike, q_len: int, kv_len: int | None = None, *, q_offset: Any = None,
               operands: Mapping[str, Any] | None = None, q_positions: Any = None,
               kv_positions: Any = None) -> Binding:
  """Binds a mask (text, Mask or a per-head sequence) to a shape and checks its operands.

  Concrete JAX arrays become NumPy (the static path); traced ones stay traced.
  """
  masks, multi = _masks(mask)
  q_positions, kv_positions = (np.asarray(p) if isinstance(p, jax.Array) and not isinstance(
      p, jax.core.Tracer) else p for p in (q_positions, kv_positions))
  shape = Shape.of(q_len, kv_len, q_offset, q_positions=q_positions, kv_positions=kv_positions)
  operands = dict(operands or {})
  traced = not shape.static or any(isinstance(v, jax.core.Tracer) for v in operands.values())
  if not traced:
    operands = {n: (np.asarray(v) if isinstance(v, jax.Array) else v) for n, v in operands.items()}
  unique: dict[ir.Mask, int] = {}
  head_index = [unique.setdefault(m, len(unique)) for m in masks]
  uniq = tuple(unique)
  prepared = tuple(prepare_operands(m, shape, operands, xp=jnp if traced else np) for m in uniq)
  batches = {b for b in {p.batch for p in prepared} | {shape.positions_batch} if b is not None}
  if len(batches) > 1:
    raise MaskValueError(f"the heads' operands (and positions) disagree on the batch size: "
                         f"{sorted(batches)}")
  batch = batches.pop() if batches else None
  return Binding(uniq, tuple(head_index) if multi else None, shape, prepared, batch, traced,
                 _merge_operands(list(prepared), batch), _merge_forms(list(prepared), batch))


def _masks(mask: Any) -> tuple[list[ir.Mask], bool]:
  if isinstance(mask, (ir.Mask, str)):
    return [as_mask(mask)], False
  if isinstance(mask, Sequence) and len(mask) > 0:
    return [as_mask(m) for m in mask], True
  raise MaskTypeError(f"expected a mask, mask text or a non-empty sequence of them, got {mask!r}")


def _merge_operands(prepared: list[Operands], batch: int | None) -> OperandArrays:
  """Every mask's operands in one mapping, broadcast to the batch; static per-token ones
  stay unwritten until read."""
  out = {}
  for p in prepared:
    for n in p.arrays:
      shape = p.arrays.shape(n)
      if batch is not None and shape[0] == 1:
        shape = (batch,) + shape[1:]

        def broadcast(a: Any, xp: Any = p.xp, shape: tuple[int, ...] = shape) -> Any:
          return xp.broadcast_to(a, shape)

        out[n] = p.arrays.later(n, broadcast, shape)
      else:
        out[n] = p.arrays.later(n)
  return OperandArrays(out)


def _merge_forms(prepared: list[Operands], batch: int | None) -> dict[str, RunForm]:
  return {n: f.broadcast(batch or 1) for p in prepared for n, f in p.forms.items()}


def _predicates(bound: Binding, block_q: int, block_kv: int) -> tuple[Predicate, ...]:
  """The compiled predicate of each distinct mask (pairwise reads per tile where they can be)."""
  out = []
  shape = bound.shape
  for m in bound.masks:
    pairwise = any(s.kind == "pair" for s in m.operands)
    q_pos = k_pos = None
    if pairwise and shape.static and (shape.positions_batch is None):
      q_pos, k_pos = shape.rows(np)[0], shape.cols(np)[0]
    if q_pos is None:  # a function of the mask and the tiles alone
      out.append(_predicate(m, bound.kv_len, block_q, block_kv, shape.has_positions))
      continue
    out.append(compile_predicate(m, q_positions=q_pos, kv_len=bound.kv_len, block_q=block_q,
                                 block_kv=block_kv, kv_positions=k_pos,
                                 positions_read=shape.has_positions))
  return tuple(out)


@functools.lru_cache(maxsize=256)
def _predicate(m: ir.Mask, kv_len: int, block_q: int, block_kv: int,
               positions_read: bool) -> Predicate:
  """`compile_predicate` without static positions, remembered (a frozen `Predicate`)."""
  return compile_predicate(m, kv_len=kv_len, block_q=block_q, block_kv=block_kv,
                           positions_read=positions_read)


def _segment_split(bound: Binding, block_q: int, block_kv: int,
                   predicates: tuple[Predicate, ...]) -> BlockMap | None:
  """The static map of the masks without their segment conjuncts, for splash's SegmentIds.

  Only when it is needed (the map is batched or traced), every distinct mask has a
  segment conjunct, and what remains reads only static operands without a batch axis.
  """
  if bound.batch is None and not bound.traced:
    return None
  if not bound.shape.static or not all(p.segments for p in predicates):
    return None
  rests = []
  for m in bound.masks:
    items = [i for i in conjuncts(m) if segment_conjunct(i) is None]
    rests.append(ir.and_(items) if items else ir.BoolConst(True))
  ops = {}
  for rest, prepared in zip(rests, bound.prepared):
    for spec in rest.operands:
      a = prepared.arrays[spec.name]                  # before broadcasting to the batch
      if isinstance(a, jax.core.Tracer) or a.shape[0] != 1:
        return None
      ops[spec.name] = np.asarray(a)[0]
  masks = [rests[u] for u in bound.head_index] if bound.head_index is not None else rests[0]
  return compile(masks, bound.q_len, bound.kv_len, block_q=block_q, block_kv=block_kv,
                 q_offset=None if bound.shape.q_positions is not None else bound.q_offset,
                 operands=ops, **_positions_of(bound.shape))


def _positions_of(shape: Shape) -> dict[str, Any]:
  """The explicit positions of a shape as `compile` keywords (`[B', L]` kept as given)."""
  out = {}
  for name in ("q_positions", "kv_positions"):
    p = getattr(shape, name)
    if p is not None:
      out[name] = p if p.shape[0] > 1 else p[0]
  return out


def _line_bounds(bound: Binding, block_q: int,
                 block_kv: int) -> tuple[tuple[int, int, int, int] | None, ...]:
  """Static bounds on a traced map's non-empty tiles, from each mask's operand-free conjuncts.

  A mask `a & b & ...` has no more non-empty tiles than its conjuncts that read no
  operands, which compile statically. Per mask: `(fwd_max, fwd_total, bwd_max,
  bwd_total)`, or None when the mask has no such conjunct (or the offset is traced).
  """
  out: list[tuple[int, int, int, int] | None] = []
  for m in bound.masks:
    static = [i for i in conjuncts(m) if not i.operands]
    if not static or not bound.shape.static:
      out.append(None)
      continue
    part = compile(ir.and_(static) if len(static) > 1 else static[0], bound.q_len,
                   bound.kv_len, block_q=block_q, block_kv=block_kv,
                   q_offset=None if bound.shape.q_positions is not None else bound.q_offset,
                   **_positions_of(bound.shape))
    fwd, bwd = run_lengths(part.rows), run_lengths(part.cols)
    out.append((max(1, int(fwd.max())), max(1, int(fwd.sum())), max(1, int(bwd.max())),
                max(1, int(bwd.sum()))))
  return tuple(out)


def _int_range(bound: Binding) -> tuple[int, int] | None:
  """`term_bounds` of the masks and their operands, from their checks when bound (the
  same pass over the same values: broadcasting to the batch changes none; a term unknown
  there, traced, is unknown here)."""
  ranges = [p.int_range for p in bound.prepared if p.int_range is not None]
  if len(ranges) < len(bound.prepared):  # one unknown
    return None
  return min(r[0] for r in ranges), max(r[1] for r in ranges)


def _contiguous(bound: Binding, names: Collection[str],
                operands: Mapping[str, Any]) -> frozenset[str]:
  """The operands declared contiguous (`compile(contiguous=...)`), checked: each a
  per-token operand of the masks, and where static, each value one run of each row."""
  if isinstance(names, str):
    names = (names,)
  tokens = {s.name for m in bound.masks for s in m.operands if s.kind == "token"}
  for name in names:
    if name not in tokens:
      raise MaskValueError(
          f"contiguous={sorted(names)} names {name!r}, which the mask reads as no "
          f"per-token operand (its per-token operands: {sorted(tokens) or 'none'})",
          hint="Declare only segment ids the mask compares, as in `document(seg)`.")
    value = operands.get(name)
    if value is None or isinstance(value, jax.core.Tracer):
      continue
    rows = np.asarray(value)
    for b, row in enumerate(rows.reshape(-1, rows.shape[-1])):
      if not one_run_each(row):
        raise MaskValueError(
            f"operand {name!r} was declared contiguous, but batch row {b} holds an id in "
            f"more than one run",
            hint=f"Give each document one id and keep its tokens together, or leave "
                 f"{name!r} out of contiguous=.")
  return frozenset(names)


def _intervals(bound: Binding, contiguous: frozenset[str]) -> tuple[KeyIntervals, ...] | None:
  """Each distinct mask's interval form, by the first interval rule (step "intervals");
  None with explicit positions, where rows and columns are no runs of consecutive
  positions."""
  if bound.shape.has_positions:
    return None
  for rule in RULESET.at("intervals"):
    if rule.enabled():
      rule.took()
      return tuple(rule.run(m, contiguous) for m in bound.masks)
  return None


def _blockmap(bound: Binding, block_q: int, block_kv: int, *, rows: Runs,
              col_runs: Runs | None = None, backward: Callable[[], Runs] | None = None,
              line_bounds: tuple[tuple[int, int, int, int] | None, ...] | None = None,
              contiguous: frozenset[str] = frozenset()) -> BlockMap:
  predicates = _predicates(bound, block_q, block_kv)
  with lowering_rules.unrecorded():  # its own compile is no part of the mask explained
    split = _segment_split(bound, block_q, block_kv, predicates)
  return BlockMap(masks=bound.masks, head_index=bound.head_index, q_len=bound.q_len,
                  kv_len=bound.kv_len, q_offset=bound.q_offset, block_q=block_q,
                  block_kv=block_kv, batch=bound.batch, rows=rows, operands=bound.operands,
                  predicates=predicates, col_runs=col_runs, backward=backward,
                  line_bounds=line_bounds,
                  segment_split=split,
                  int_range=_int_range(bound),
                  q_positions=bound.shape.q_positions, kv_positions=bound.shape.kv_positions,
                  intervals=_intervals(bound, contiguous))


def bind_map(mask: MasksLike, q_len: int, kv_len: int | None = None, *, q_offset: Any = None,
             operands: Mapping[str, Any] | None = None, q_positions: Any = None,
             kv_positions: Any = None) -> BlockMap:
  """A map of one tile covering the whole mask, marked PARTIAL, without analysis.

  Sound (PARTIAL promises nothing) and free to build: for consumers that evaluate
  every position anyway, like the dense reference attention.
  """
  bound = bind_masks(mask, q_len, kv_len, q_offset=q_offset, operands=operands,
                     q_positions=q_positions, kv_positions=kv_positions)
  nb, u = bound.batch or 1, len(bound.masks)
  xp = jnp if bound.traced else np

  def one(v: int, t: DTypeLike) -> Any:
    return xp.full((nb, u, 1, 1), v, t)

  rows = Runs(one(0, np.int32), one(1, np.int32), one(1, np.int8),
              xp.ones((nb, u, 1), np.int32))
  return _blockmap(bound, bound.q_len, bound.kv_len, rows=rows, col_runs=rows)
