"""Lowering: a mask at a shape → `BlockMap`.

Static path (every operand a NumPy value): for all q tiles at once, classify the
whole run of key tiles with range analysis, keep runs that are EMPTY or FULL,
and bisect the PARTIAL ones, until every run is decided or a single tile. The
work is proportional to the tiles on the mask's boundary times the log of the
grid width, the tile grid is never allocated, and no `q_len × kv_len` array
ever exists. The same runs are computed per key tile for the backward pass.

Dynamic path (traced operands, under `jit`): the same analysis over the whole
tile grid in jax.numpy, with shapes from the lengths and tile sizes only.

Both paths refine *ambiguous* PARTIAL tiles (where the analysis cannot prove
the tile mixed) by evaluating them, by default for prelude-only masks and
always with `exact=True`. The dynamic path refines them in rounds of a fixed
number of tiles inside a `while_loop`, so its cost follows the number of
ambiguous tiles; `refine_budget` caps it, leaving any beyond PARTIAL (sound).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maskc import _ir as ir
from maskc._analysis import EMPTY, FULL, PARTIAL, Analyzer, Tables
from maskc._bind import Operands, Shape, _int, as_mask, prepare_operands
from maskc._blockmap import BlockMap
from maskc._compile_predicate import compile_predicate, conjuncts, segment_conjunct
from maskc._errors import MaskTypeError, MaskValueError
from maskc._evaluate import Env, evaluate_mask
from maskc._tiles import Runs, run_lengths, runs_from_grid

_CACHE: "collections.OrderedDict[Any, BlockMap]" = collections.OrderedDict()
_CACHE_SIZE = 32
_EVAL_CHUNK = 1 << 22  # elements evaluated at once when refining tiles


def compile(mask: Any, q_len: int, kv_len: int | None = None, *, block_q: int = 128,
            block_kv: int = 128, q_offset: int | None = None,
            operands: dict[str, Any] | None = None, exact: bool = False,
            refine_budget: int | None = None) -> BlockMap:
  """Lowers a mask to block-sparsity metadata.

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

  Returns:
    A `BlockMap`. Static results are cached by (masks, shape, tiles, operand bytes).

  >>> import maskc
  >>> maskc.compile("causal & chunk(256)", 512, block_q=128, block_kv=128).grid.tolist()
  [[1, 0, 0, 0], [2, 1, 0, 0], [0, 0, 1, 0], [0, 0, 2, 1]]
  """
  block_q = _int("block_q", block_q, minimum=1)
  block_kv = _int("block_kv", block_kv, minimum=1)
  bound = bind_masks(mask, q_len, kv_len, q_offset=q_offset, operands=operands)
  refine = [exact or ir.is_prelude_only(m) for m in bound.masks]
  if bound.traced:
    return _compile_dynamic(bound, block_q, block_kv, refine, refine_budget)
  key = (bound.masks, bound.head_index, bound.q_len, bound.kv_len, bound.q_offset, block_q,
         block_kv, tuple(refine), tuple(p.static_bytes() for p in bound.prepared))
  if key in _CACHE:
    _CACHE.move_to_end(key)
    return _CACHE[key]
  bm = _compile_static(bound, block_q, block_kv, refine)
  _CACHE[key] = bm
  if len(_CACHE) > _CACHE_SIZE:
    _CACHE.popitem(last=False)
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
  """
  masks: tuple[ir.Mask, ...]
  head_index: tuple[int, ...] | None
  shape: Shape
  prepared: tuple[Operands, ...]
  batch: int | None
  traced: bool
  operands: dict[str, Any]

  @property
  def q_len(self) -> int:
    return self.shape.q_len

  @property
  def kv_len(self) -> int:
    return self.shape.kv_len

  @property
  def q_offset(self) -> Any:
    return self.shape.q_offset


def bind_masks(mask: Any, q_len: int, kv_len: int | None = None, *, q_offset: Any = None,
               operands: dict[str, Any] | None = None) -> Binding:
  """Binds a mask (text, Mask or a per-head sequence) to a shape and checks its operands.

  Concrete JAX arrays become NumPy (the static path); traced ones stay traced.
  """
  masks, multi = _masks(mask)
  shape = Shape.of(q_len, kv_len, q_offset)
  operands = dict(operands or {})
  traced = not shape.static or any(isinstance(v, jax.core.Tracer) for v in operands.values())
  if not traced:
    operands = {n: (np.asarray(v) if isinstance(v, jax.Array) else v) for n, v in operands.items()}
  unique: dict[ir.Mask, int] = {}
  head_index = [unique.setdefault(m, len(unique)) for m in masks]
  uniq = tuple(unique)
  prepared = tuple(prepare_operands(m, shape, operands, xp=jnp if traced else np) for m in uniq)
  batches = {p.batch for p in prepared} - {None}
  if len(batches) > 1:
    raise MaskValueError(f"the heads' operands disagree on the batch size: {sorted(batches)}")
  batch = batches.pop() if batches else None
  return Binding(uniq, tuple(head_index) if multi else None, shape, prepared, batch, traced,
                 _merge_operands(list(prepared), batch))


def _masks(mask: Any) -> tuple[list[ir.Mask], bool]:
  if isinstance(mask, (ir.Mask, str)):
    return [as_mask(mask)], False
  if isinstance(mask, Sequence) and len(mask) > 0:
    return [as_mask(m) for m in mask], True
  raise MaskTypeError(f"expected a mask, mask text or a non-empty sequence of them, got {mask!r}")


def _merge_operands(prepared: list[Operands], batch: int | None) -> dict[str, Any]:
  out = {}
  for p in prepared:
    for n, a in p.arrays.items():
      if batch is not None and a.shape[0] == 1:
        a = p.xp.broadcast_to(a, (batch,) + a.shape[1:])
      out[n] = a
  return out


# ----------------------------------------------------------------------------- static


class _Tile:
  """Tile geometry: inclusive position bounds of runs of tiles."""

  def __init__(self, shape: Shape, block_q: int, block_kv: int):
    self.shape, self.bq, self.bk = shape, block_q, block_kv
    self.nq = -(-shape.q_len // block_q)
    self.nk = -(-shape.kv_len // block_kv)

  def q_bounds(self, a, z):
    lo = a * self.bq
    hi = np.minimum(z * self.bq, self.shape.q_len) - 1
    return lo + self.shape.q_offset, hi + self.shape.q_offset

  def k_bounds(self, a, z):
    return a * self.bk, np.minimum(z * self.bk, self.shape.kv_len) - 1


def _evaluate_tiles(m: ir.Mask, geo: _Tile, tables: Tables, xp, b, i, j):
  """Exact states of tiles `(b, i, j)` by evaluating them, in chunks."""
  bq, bk = geo.bq, geo.bk
  per_chunk = max(1, _EVAL_CHUNK // (bq * bk))
  out = []
  for s in range(0, len(i), per_chunk):
    ii, jj = i[s:s + per_chunk], j[s:s + per_chunk]
    rows = ii[:, None, None] * bq + xp.arange(bq)[None, :, None]
    cols = jj[:, None, None] * bk + xp.arange(bk)[None, None, :]
    valid = (rows < geo.shape.q_len) & (cols < geo.shape.kv_len)
    q = xp.minimum(rows, geo.shape.q_len - 1) + geo.shape.q_offset
    k = xp.minimum(cols, geo.shape.kv_len - 1)
    bb = b[s:s + per_chunk][:, None, None] if not np.isscalar(b) else 0
    v = evaluate_mask(m, Env(xp, q, k, tables.arrays, bb))
    any_ = xp.any(v & valid, axis=(1, 2))
    all_ = xp.all(v | ~valid, axis=(1, 2))
    out.append(xp.where(all_, FULL, xp.where(any_, PARTIAL, EMPTY)).astype(xp.int8))
  return xp.concatenate(out) if out else xp.zeros(0, xp.int8)


def _subdivide(m: ir.Mask, geo: _Tile, tables: Tables, xp, b, i, j, parts: int):
  """Decides tiles `(b, i, j)` from their `parts × parts` sub-rectangles, without evaluating.

  A sub-rectangle that is FULL (or certainly PARTIAL) witnesses a true
  position, one that is EMPTY (or certainly PARTIAL) a false one. Returns the
  tiles' states and whether each is still ambiguous (no witness of one kind).
  """
  n = i.shape[0]
  sub = xp.arange(parts)
  q0 = i * geo.bq
  q_len = xp.minimum(geo.bq, geo.shape.q_len - q0)
  k0 = j * geo.bk
  k_len = xp.minimum(geo.bk, geo.shape.kv_len - k0)
  # sub-rectangle bounds, [n, parts] per axis; empty ones (tile smaller than parts) are dropped
  q_lo = q0[:, None] + (sub[None, :] * q_len[:, None]) // parts
  q_hi = q0[:, None] + ((sub[None, :] + 1) * q_len[:, None]) // parts - 1
  k_lo = k0[:, None] + (sub[None, :] * k_len[:, None]) // parts
  k_hi = k0[:, None] + ((sub[None, :] + 1) * k_len[:, None]) // parts - 1
  shape = (n, parts, parts)
  ql = xp.broadcast_to(q_lo[:, :, None], shape) + geo.shape.q_offset
  qh = xp.broadcast_to(q_hi[:, :, None], shape) + geo.shape.q_offset
  kl = xp.broadcast_to(k_lo[:, None, :], shape)
  kh = xp.broadcast_to(k_hi[:, None, :], shape)
  real = (qh >= ql) & (kh >= kl)
  bb = xp.broadcast_to(b[:, None, None], shape) if not np.isscalar(b) else 0
  t = Analyzer(xp, tables, ql, xp.maximum(qh, ql), kl, xp.maximum(kh, kl), bb).truth(m)
  state = xp.broadcast_to(xp.asarray(t.state), shape)
  certain = xp.broadcast_to(xp.asarray(t.certain, bool), shape) & (state == PARTIAL)
  has_true = xp.any(real & ((state == FULL) | certain), axis=(1, 2))
  has_false = xp.any(real & ((state == EMPTY) | certain), axis=(1, 2))
  all_full = xp.all(~real | (state == FULL), axis=(1, 2))
  all_empty = xp.all(~real | (state == EMPTY), axis=(1, 2))
  out = xp.where(all_full, FULL, xp.where(all_empty, EMPTY, PARTIAL)).astype(xp.int8)
  ambiguous = (out == PARTIAL) & ~(has_true & has_false)
  return out, ambiguous


def _decide_tiles(m: ir.Mask, geo: _Tile, tables: Tables, b, i, j):
  """Exact states of ambiguous tiles: by finer analysis where it suffices, else by evaluation."""
  out = np.full(i.shape, PARTIAL, np.int8)
  todo = np.ones(i.shape, bool)
  for parts in (4, 16):
    if not todo.any() or parts > max(geo.bq, geo.bk):
      break
    idx = np.flatnonzero(todo)
    bb = b[idx] if not np.isscalar(b) else 0
    state, ambiguous = _subdivide(m, geo, tables, np, bb, i[idx], j[idx], parts)
    out[idx] = state
    todo[idx] = ambiguous
  idx = np.flatnonzero(todo)
  if idx.size:
    out[idx] = _evaluate_tiles(m, geo, tables, np, b[idx] if not np.isscalar(b) else 0, i[idx],
                               j[idx])
  return out


def _frontier(m: ir.Mask, geo: _Tile, tables: Tables, batch: int | None, along_rows: bool):
  """Decided runs `(b, line, a, z, state, ambiguous)` covering every line of tiles."""
  n_lines, n_span = (geo.nq, geo.nk) if along_rows else (geo.nk, geo.nq)
  nb = batch or 1
  line = np.tile(np.arange(n_lines, dtype=np.int64), nb)
  b = np.repeat(np.arange(nb, dtype=np.int64), n_lines)
  a = np.zeros_like(line)
  z = np.full_like(line, n_span)
  done = []
  while line.size:
    if along_rows:
      ql, qh = geo.q_bounds(line, line + 1)
      kl, kh = geo.k_bounds(a, z)
    else:
      ql, qh = geo.q_bounds(a, z)
      kl, kh = geo.k_bounds(line, line + 1)
    t = Analyzer(np, tables, ql, qh, kl, kh, b if batch else 0).truth(m)
    state = np.broadcast_to(np.asarray(t.state, np.int8), line.shape)
    certain = np.broadcast_to(np.asarray(t.certain, bool), line.shape)
    single = (z - a) == 1
    fin = (state != PARTIAL) | single
    done.append((b[fin], line[fin], a[fin], z[fin], state[fin], (~certain[fin]) &
                 (state[fin] == PARTIAL)))
    split = ~fin
    mid = (a[split] + z[split]) // 2
    line = np.concatenate([line[split], line[split]])
    b = np.concatenate([b[split], b[split]])
    a, z = np.concatenate([a[split], mid]), np.concatenate([mid, z[split]])
  return [np.concatenate(c) for c in zip(*done)]


def _pack_runs(b, line, a, z, state, nb: int, n_lines: int) -> Runs:
  """Sorted, merged runs of non-empty tiles packed into `[nb, n_lines, R]` arrays."""
  keep = state != EMPTY
  b, line, a, z, state = b[keep], line[keep], a[keep], z[keep], state[keep]
  order = np.lexsort((a, line, b))
  b, line, a, z, state = b[order], line[order], a[order], z[order], state[order]
  if b.size:
    new = np.ones(b.size, bool)
    new[1:] = (b[1:] != b[:-1]) | (line[1:] != line[:-1]) | (state[1:] != state[:-1]) | (
        a[1:] != z[:-1])
    starts = np.flatnonzero(new)
    b, line, state, a = b[starts], line[starts], state[starts], a[starts]
    z = np.maximum.reduceat(z, starts)
  flat_line = b * n_lines + line
  count = np.bincount(flat_line, minlength=nb * n_lines).astype(np.int32)
  r = max(1, int(count.max()) if count.size else 1)
  first = np.concatenate([[0], np.cumsum(count)[:-1]])
  slot = np.arange(flat_line.size) - first[flat_line]
  shape = (nb * n_lines, r)
  start = np.zeros(shape, np.int32)
  stop = np.zeros(shape, np.int32)
  st = np.zeros(shape, np.int8)
  start[flat_line, slot] = a
  stop[flat_line, slot] = z
  st[flat_line, slot] = state
  return Runs(start.reshape(nb, n_lines, r), stop.reshape(nb, n_lines, r),
              st.reshape(nb, n_lines, r), count.reshape(nb, n_lines))


class _StaticRuns:
  """The runs of one mask along rows now and along columns on demand.

  Backward passes need the per-key-tile runs; a forward-only user never pays for
  them. Tiles refined for the rows are remembered, so the columns reuse them.
  """

  def __init__(self, m: ir.Mask, geo: _Tile, tables: Tables, batch: int | None, refine: bool):
    self.m, self.geo, self.tables, self.batch, self.refine = m, geo, tables, batch, refine
    self.refined: dict[tuple[int, int, int], int] = {}

  def runs(self, along_rows: bool) -> Runs:
    geo, batch = self.geo, self.batch
    b, line, a, z, state, ambiguous = _frontier(self.m, geo, self.tables, batch, along_rows)
    if self.refine and ambiguous.any():
      idx = np.flatnonzero(ambiguous)
      tiles = [(int(b[x]), int(line[x]), int(a[x])) if along_rows else
               (int(b[x]), int(a[x]), int(line[x])) for x in idx]
      todo = [t for t in tiles if t not in self.refined]
      if todo:
        tb, ti, tj = (np.asarray(c, np.int64) for c in zip(*todo))
        new = _decide_tiles(self.m, geo, self.tables, tb if batch else 0, ti, tj)
        self.refined.update(zip(todo, new.tolist()))
      state = state.copy()
      state[idx] = [self.refined[t] for t in tiles]
    return _pack_runs(b, line, a, z, state, batch or 1, geo.nq if along_rows else geo.nk)


def _stack_runs(runs: list[Runs]) -> Runs:
  r = max(x.start.shape[-1] for x in runs)
  def pad(arr):
    return np.pad(arr, [(0, 0)] * (arr.ndim - 1) + [(0, r - arr.shape[-1])])
  return Runs(*(np.stack([pad(getattr(x, f)) for x in runs], axis=1) for f in ("start", "stop",
                                                                                "state")),
              np.stack([x.count for x in runs], axis=1))


class _Backward:
  """Computes the per-key-tile runs of a static map once, when a backward pass first asks.

  The compiler's memo, handed to the `BlockMap` as a function: the map never changes.
  """

  def __init__(self, per_mask: list[_StaticRuns]):
    self.per_mask = per_mask
    self.runs: Runs | None = None

  def __call__(self) -> Runs:
    if self.runs is None:
      self.runs = _stack_runs([r.runs(along_rows=False) for r in self.per_mask])
      self.per_mask = []
    return self.runs


def _compile_static(bound: Binding, block_q: int, block_kv: int, refine: list[bool]) -> BlockMap:
  geo = _Tile(bound.shape, block_q, block_kv)
  tables = Tables(np, bound.operands)  # shared: tables are built for the operands masks read
  per_mask = [_StaticRuns(m, geo, tables, bound.batch, ref) for m, ref in zip(bound.masks, refine)]
  rows = _stack_runs([r.runs(along_rows=True) for r in per_mask])
  return _blockmap(bound, block_q, block_kv, rows=rows, backward=_Backward(per_mask))


def _predicates(bound: Binding, block_q: int, block_kv: int):
  """The compiled predicate of each distinct mask (pairwise reads per tile where they can be)."""
  out = []
  for m in bound.masks:
    pairwise = any(s.kind == "pair" for s in m.operands)
    q_pos = None
    if pairwise and bound.shape.static:
      q_pos = np.arange(bound.q_len, dtype=np.int64) + bound.q_offset
    out.append(compile_predicate(m, q_positions=q_pos, kv_len=bound.kv_len, block_q=block_q,
                                 block_kv=block_kv))
  return tuple(out)


def _segment_split(bound: Binding, block_q: int, block_kv: int,
                   predicates) -> BlockMap | None:
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
  names = {s.name for r in rests for s in r.operands}
  ops = {}
  for n in names:
    a = bound.operands[n]
    if isinstance(a, jax.core.Tracer) or a.shape[0] != 1:
      return None
    ops[n] = np.asarray(a)[0]
  masks = [rests[u] for u in bound.head_index] if bound.head_index is not None else rests[0]
  return compile(masks, bound.q_len, bound.kv_len, block_q=block_q, block_kv=block_kv,
                 q_offset=bound.q_offset, operands=ops)


def _line_bounds(bound: Binding, block_q: int, block_kv: int):
  """Static bounds on a traced map's non-empty tiles, from each mask's operand-free conjuncts.

  A mask `a & b & ...` has no more non-empty tiles than its conjuncts that read no
  operands, which compile statically. Per mask: `(fwd_max, fwd_total, bwd_max,
  bwd_total)`, or None when the mask has no such conjunct (or the offset is traced).
  """
  out = []
  for m in bound.masks:
    static = [i for i in conjuncts(m) if not i.operands]
    if not static or not bound.shape.static:
      out.append(None)
      continue
    part = compile(ir.and_(static) if len(static) > 1 else static[0], bound.q_len,
                   bound.kv_len, block_q=block_q, block_kv=block_kv, q_offset=bound.q_offset)
    fwd, bwd = run_lengths(part.rows), run_lengths(part.cols)
    out.append((max(1, int(fwd.max())), max(1, int(fwd.sum())), max(1, int(bwd.max())),
                max(1, int(bwd.sum()))))
  return tuple(out)


def _blockmap(bound: Binding, block_q: int, block_kv: int, *, rows: Runs, col_runs=None,
              backward=None, line_bounds=None) -> BlockMap:
  predicates = _predicates(bound, block_q, block_kv)
  return BlockMap(masks=bound.masks, head_index=bound.head_index, q_len=bound.q_len,
                  kv_len=bound.kv_len, q_offset=bound.q_offset, block_q=block_q,
                  block_kv=block_kv, batch=bound.batch, rows=rows, operands=bound.operands,
                  predicates=predicates, col_runs=col_runs, backward=backward,
                  line_bounds=line_bounds,
                  segment_split=_segment_split(bound, block_q, block_kv, predicates))


def bind_map(mask: Any, q_len: int, kv_len: int | None = None, *, q_offset: Any = None,
             operands: dict[str, Any] | None = None) -> BlockMap:
  """A map of one tile covering the whole mask, marked PARTIAL, without analysis.

  Sound (PARTIAL promises nothing) and free to build: for consumers that evaluate
  every position anyway, like the dense reference attention.
  """
  bound = bind_masks(mask, q_len, kv_len, q_offset=q_offset, operands=operands)
  nb, u = bound.batch or 1, len(bound.masks)
  xp = jnp if bound.traced else np
  one = lambda v, t: xp.full((nb, u, 1, 1), v, t)
  rows = Runs(one(0, np.int32), one(1, np.int32), one(1, np.int8),
              xp.ones((nb, u, 1), np.int32))
  return _blockmap(bound, bound.q_len, bound.kv_len, rows=rows, col_runs=rows)


# ----------------------------------------------------------------------------- dynamic


def _dynamic_grid(m: ir.Mask, geo: _Tile, tables: Tables, batch: int | None, refine: bool,
                  budget: int | None):
  nb = batch or 1
  i = jnp.arange(geo.nq)[None, :, None]
  j = jnp.arange(geo.nk)[None, None, :]
  q_lo = i * geo.bq + geo.shape.q_offset
  q_hi = jnp.minimum((i + 1) * geo.bq, geo.shape.q_len) - 1 + geo.shape.q_offset
  k_lo = j * geo.bk
  k_hi = jnp.minimum((j + 1) * geo.bk, geo.shape.kv_len) - 1
  b = jnp.arange(nb)[:, None, None] if batch else 0
  t = Analyzer(jnp, tables, q_lo, q_hi, k_lo, k_hi, b).truth(m)
  full_shape = (nb, geo.nq, geo.nk)
  state = jnp.broadcast_to(jnp.asarray(t.state, jnp.int8), full_shape)
  if not refine:
    return state
  certain = jnp.broadcast_to(jnp.asarray(t.certain, bool), full_shape)
  ambiguous = ((state == PARTIAL) & ~certain).reshape(-1)
  total = ambiguous.size
  tiles = geo.nq * geo.nk

  def coords(idx):
    tb, rest = jnp.divmod(idx, tiles)
    ti, tj = jnp.divmod(rest, geo.nk)
    return (tb if batch else 0), ti, tj

  def rounds(decide, chunk, budget_tiles):
    """Applies `decide` to the ambiguous tiles, `chunk` at a time, in a while_loop."""
    chunk = max(1, min(total, chunk))
    limit = -(-total // chunk) if budget_tiles is None else max(0, -(-int(budget_tiles) // chunk))

    def body(carry):
      flat_state, todo, left, n = carry
      (idx,) = jnp.nonzero(todo, size=chunk, fill_value=total)
      valid = idx < total
      safe = jnp.where(valid, idx, 0)
      new, unresolved = decide(*coords(safe))
      flat_state = flat_state.at[safe].set(jnp.where(valid, new, flat_state[safe]))
      todo = todo.at[safe].set(jnp.where(valid, False, todo[safe]))
      left = left.at[safe].set(jnp.where(valid, unresolved, left[safe]))
      return flat_state, todo, left, n + 1

    def more(carry):
      return jnp.logical_and(carry[1].any(), carry[3] < limit)

    return body, more

  def by_analysis(b, i, j):
    out, amb = _subdivide(m, geo, tables, jnp, b, i, j, 4)
    if max(geo.bq, geo.bk) >= 16:
      out16, amb16 = _subdivide(m, geo, tables, jnp, b, i, j, 16)
      out = jnp.where(amb, out16, out)
      amb = amb & amb16
    return out, amb

  def by_evaluation(b, i, j):
    return _evaluate_tiles(m, geo, tables, jnp, b, i, j), jnp.zeros(i.shape, bool)

  flat = state.reshape(-1)
  none_left = jnp.zeros_like(ambiguous)
  # Cost follows the number of ambiguous tiles: finer analysis first, then evaluation.
  body, more = rounds(by_analysis, max(1, (1 << 16) // 256), None)
  flat, _, left, _ = jax.lax.while_loop(more, body, (flat, ambiguous, none_left, 0))
  body, more = rounds(by_evaluation, _EVAL_CHUNK // (geo.bq * geo.bk), budget)
  flat, _, _, _ = jax.lax.while_loop(more, body, (flat, left, none_left, 0))
  return flat.reshape(full_shape)


def _compile_dynamic(bound: Binding, block_q: int, block_kv: int, refine: list[bool],
                     budget: int | None) -> BlockMap:
  geo = _Tile(bound.shape, block_q, block_kv)
  tables = Tables(jnp, bound.operands)
  grid = jnp.stack([_dynamic_grid(m, geo, tables, bound.batch, ref, budget)
                    for m, ref in zip(bound.masks, refine)], axis=1)
  return _blockmap(bound, block_q, block_kv, rows=runs_from_grid(jnp, grid),
                   col_runs=runs_from_grid(jnp, jnp.swapaxes(grid, -1, -2)),
                   line_bounds=_line_bounds(bound, block_q, block_kv))
