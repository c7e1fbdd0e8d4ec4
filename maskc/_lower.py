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
from maskc._errors import MaskLimitError, MaskTypeError, MaskValueError
from maskc._evaluate import Env, evaluate_mask
from maskc._overflow import term_bounds
from maskc._operand_runs import Pieces, line_pieces, reads_at
from maskc._tiles import Runs, run_lengths, runs_from_grid

_CACHE: "collections.OrderedDict[Any, BlockMap]" = collections.OrderedDict()
_CACHE_SIZE = 32
_EVAL_CHUNK = 1 << 18  # elements evaluated at once when refining tiles
_PIECE_CHUNK = 1 << 16  # rectangles analysed at once when refining tiles
MEMORY_BUDGET = 256 << 20  # default bytes a lowering may allocate beyond its operands
_ITEM_BYTES = 256  # working memory per rectangle analysed at once (intervals, flags, indices)


class _Budget:
  """The memory a lowering may use; `charge` raises `MaskLimitError` before going over."""

  def __init__(self, limit: int):
    self.limit = limit

  def charge(self, nbytes: int, what: str) -> None:
    if nbytes > self.limit:
      raise MaskLimitError(
          f"lowering needs about {nbytes / 2**20:,.1f} MiB for {what}, over the memory budget "
          f"of {self.limit / 2**20:,.1f} MiB",
          hint="Use larger tiles (block_q, block_kv), fewer or shorter operand runs, or raise "
               "`memory_budget=` in maskc.compile.")

  def items(self, per_item: int) -> int:
    """How many items of `per_item` bytes fit in the budget (at least 1)."""
    return max(1, self.limit // max(1, per_item))


def compile(mask: Any, q_len: int, kv_len: int | None = None, *, block_q: int = 128,
            block_kv: int = 128, q_offset: int | None = None,
            operands: dict[str, Any] | None = None, exact: bool = False,
            refine_budget: int | None = None, memory_budget: int | None = None,
            q_positions: Any = None, kv_positions: Any = None) -> BlockMap:
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
    memory_budget: bytes the lowering may allocate beyond its operands and result
      (default `maskc._lower.MEMORY_BUDGET`, 256 MiB). Work is done in chunks that
      fit; a lowering that cannot fit raises `MaskLimitError` instead of running
      out of memory.
    q_positions, kv_positions: the position of each row / column, `[L]` or `[B, L]`
      (NumPy: static path; traced: dynamic path), instead of `q_offset + row` and
      `col`. Lowering is sound for any positions (a tile's positions are bounded by
      their min and max) and exact where each tile's positions are consecutive
      integers in order, as in zigzag and striped layouts with block-aligned chunks.

  Returns:
    A `BlockMap`. Static results are cached by (masks, shape, tiles, operand bytes).

  >>> import maskc
  >>> maskc.compile("causal & chunk(256)", 512, block_q=128, block_kv=128).grid.tolist()
  [[1, 0, 0, 0], [2, 1, 0, 0], [0, 0, 1, 0], [0, 0, 2, 1]]
  """
  block_q = _int("block_q", block_q, minimum=1)
  block_kv = _int("block_kv", block_kv, minimum=1)
  budget = _Budget(MEMORY_BUDGET if memory_budget is None else
                   _int("memory_budget", memory_budget, minimum=1))
  bound = bind_masks(mask, q_len, kv_len, q_offset=q_offset, operands=operands,
                     q_positions=q_positions, kv_positions=kv_positions)
  refine = [exact or ir.is_prelude_only(m) for m in bound.masks]
  if bound.traced:
    return _compile_dynamic(bound, block_q, block_kv, refine, refine_budget, budget)
  key = (bound.masks, bound.head_index, bound.q_len, bound.kv_len, bound.q_offset, block_q,
         block_kv, tuple(refine), tuple(p.static_bytes() for p in bound.prepared),
         tuple(None if p is None else p.tobytes()
               for p in (bound.shape.q_positions, bound.shape.kv_positions)))
  if key in _CACHE:
    _CACHE.move_to_end(key)
    return _CACHE[key]
  bm = _compile_static(bound, block_q, block_kv, refine, budget)
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
               operands: dict[str, Any] | None = None, q_positions: Any = None,
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
  batches = ({p.batch for p in prepared} | {shape.positions_batch}) - {None}
  if len(batches) > 1:
    raise MaskValueError(f"the heads' operands (and positions) disagree on the batch size: "
                         f"{sorted(batches)}")
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


class _Axis:
  """Per-tile position facts of one axis with explicit positions `[B', L]`.

  A tile's position interval is the min and max of its positions, so analysis over
  it is sound for any positions. A tile is *dense* when its positions are
  `p, p+1, ..., p+n-1` in row order: only then is the interval exact, and a
  sub-range of its rows a sub-range of positions (`first + row offset`), which the
  finer analyses (certainty, pieces, sub-rectangles) rely on. Hulls over runs of
  tiles come from sparse tables of the tiles' minima and maxima (static path).
  """

  def __init__(self, xp, positions, length: int, block: int):
    self.xp = xp
    n = -(-length // block)
    pad = n * block - length
    pos = xp.asarray(positions)
    padded = xp.concatenate([pos, xp.broadcast_to(pos[:, -1:], (pos.shape[0], pad))], axis=1)
    tiles = padded.reshape(pos.shape[0], n, block)
    self.positions = pos
    self.first = tiles[:, :, 0]
    self.tmin = tiles.min(axis=-1)
    self.tmax = tiles.max(axis=-1)
    step = xp.arange(block, dtype=pos.dtype)
    rows = xp.arange(n * block).reshape(n, block)
    ok = (tiles == self.first[..., None] + step) | (rows >= length)
    self.dense_tiles = ok.all(axis=-1)
    self.many = pos.shape[0] > 1
    self._mins, self._maxs = [self.tmin], [self.tmax]
    if xp is np:
      span = 1
      while 2 * span <= n:
        lo, hi = self._mins[-1], self._maxs[-1]
        self._mins.append(np.minimum(lo, np.concatenate([lo[:, span:], lo[:, -span:]], 1)))
        self._maxs.append(np.maximum(hi, np.concatenate([hi[:, span:], hi[:, -span:]], 1)))
        span *= 2

  def row(self, b):
    return b if self.many else 0

  def hull(self, b, a, z):
    """Inclusive position bounds of the tiles `[a, z)` (static, NumPy)."""
    a, z = np.asarray(a, np.int64), np.asarray(z, np.int64)
    n = np.maximum(z - a, 1)
    j = np.floor(np.log2(n)).astype(np.int64)
    j = np.where((1 << (j + 1)) <= n, j + 1, j)
    j = np.where((1 << j) > n, j - 1, j)
    j = np.clip(j, 0, len(self._mins) - 1)
    second = z - (1 << j)
    mins, maxs = np.stack(self._mins), np.stack(self._maxs)
    r = self.row(b)
    return (np.minimum(mins[j, r, a], mins[j, r, second]),
            np.maximum(maxs[j, r, a], maxs[j, r, second]))

  def dense(self, b, i):
    return self.dense_tiles[self.row(b), i]

  def start(self, b, i):
    return self.first[self.row(b), i]

  def at(self, b, idx):
    """Positions at row indices `idx` (clipped to the length), batch rows `b`."""
    return self.positions[self.row(b), idx]


class _Tile:
  """Tile geometry: inclusive position bounds of runs of tiles.

  Without explicit positions, row `r` is position `q_offset + r` and column `c`
  is `c`. With them (`shape.q_positions` / `kv_positions`), bounds are position
  hulls (see `_Axis`) and finer analyses are limited to dense tiles: `dense_q`,
  `dense_k` say which; `b` selects the batch row of batched positions.
  """

  def __init__(self, shape: Shape, block_q: int, block_kv: int, xp=np):
    self.shape, self.bq, self.bk = shape, block_q, block_kv
    self.nq = -(-shape.q_len // block_q)
    self.nk = -(-shape.kv_len // block_kv)
    self.qa = None if shape.q_positions is None else _Axis(
        xp, shape.q_positions, shape.q_len, block_q)
    self.ka = None if shape.kv_positions is None else _Axis(
        xp, shape.kv_positions, shape.kv_len, block_kv)
    # Whether every query position fits the integer type the analysis computes in
    # (int32 for a traced offset): where not, the analysis treats `q` as unknown.
    if shape.static or self.qa is not None:
      self.pos_ok = True
    else:
      top = int(np.iinfo(jnp.asarray(0).dtype).max) - (shape.q_len - 1)
      self.pos_ok = shape.q_offset <= top

  @property
  def positions(self) -> bool:
    return self.qa is not None or self.ka is not None

  @property
  def batched_positions(self) -> bool:
    return any(a is not None and a.many for a in (self.qa, self.ka))

  def q_bounds(self, a, z, b=0):
    if self.qa is not None:
      return self.qa.hull(b, a, z)
    lo = a * self.bq
    hi = np.minimum(z * self.bq, self.shape.q_len) - 1
    return lo + self.shape.q_offset, hi + self.shape.q_offset

  def k_bounds(self, a, z, b=0):
    if self.ka is not None:
      return self.ka.hull(b, a, z)
    return a * self.bk, np.minimum(z * self.bk, self.shape.kv_len) - 1

  def dense_q(self, b, i):
    return True if self.qa is None else self.qa.dense(b, i)

  def dense_k(self, b, j):
    return True if self.ka is None else self.ka.dense(b, j)

  def q_start(self, b, i):
    """Position of tile i's first row (rows of a dense tile follow it one by one)."""
    return i * self.bq + self.shape.q_offset if self.qa is None else self.qa.start(b, i)

  def k_start(self, b, j):
    return j * self.bk if self.ka is None else self.ka.start(b, j)

  def q_at(self, b, rows):
    return rows + self.shape.q_offset if self.qa is None else self.qa.at(b, rows)

  def k_at(self, b, cols):
    return cols if self.ka is None else self.ka.at(b, cols)


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
    bb = b[s:s + per_chunk][:, None, None] if not np.isscalar(b) else 0
    q = geo.q_at(bb, xp.minimum(rows, geo.shape.q_len - 1))
    k = geo.k_at(bb, xp.minimum(cols, geo.shape.kv_len - 1))
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
  Tiles whose positions are not dense (see `_Axis`) are left PARTIAL and ambiguous.
  """
  n = i.shape[0]
  sub = xp.arange(parts)
  bt = b if not np.isscalar(b) else 0
  dense = xp.asarray(geo.dense_q(bt, i)) & xp.asarray(geo.dense_k(bt, j))
  q_shift = geo.q_start(bt, i) - i * geo.bq   # position - row, on dense tiles
  k_shift = geo.k_start(bt, j) - j * geo.bk
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
  q_shift = xp.broadcast_to(xp.asarray(q_shift), (n,))[:, None, None]
  k_shift = xp.broadcast_to(xp.asarray(k_shift), (n,))[:, None, None]
  ql = xp.broadcast_to(q_lo[:, :, None], shape) + q_shift
  qh = xp.broadcast_to(q_hi[:, :, None], shape) + q_shift
  kl = xp.broadcast_to(k_lo[:, None, :], shape) + k_shift
  kh = xp.broadcast_to(k_hi[:, None, :], shape) + k_shift
  real = (qh >= ql) & (kh >= kl)
  bb = xp.broadcast_to(b[:, None, None], shape) if not np.isscalar(b) else 0
  t = Analyzer(xp, tables, ql, xp.maximum(qh, ql), kl, xp.maximum(kh, kl), bb,
               geo.pos_ok).truth(m)
  state = xp.broadcast_to(xp.asarray(t.state), shape)
  certain = xp.broadcast_to(xp.asarray(t.certain, bool), shape) & (state == PARTIAL)
  has_true = xp.any(real & ((state == FULL) | certain), axis=(1, 2))
  has_false = xp.any(real & ((state == EMPTY) | certain), axis=(1, 2))
  all_full = xp.all(~real | (state == FULL), axis=(1, 2))
  all_empty = xp.all(~real | (state == EMPTY), axis=(1, 2))
  out = xp.where(all_full, FULL, xp.where(all_empty, EMPTY, PARTIAL)).astype(xp.int8)
  out = xp.where(dense, out, PARTIAL).astype(xp.int8)
  ambiguous = ((out == PARTIAL) & ~(has_true & has_false)) | ~dense
  return out, ambiguous


def _combine_pieces(item, n_items: int, state, certain):
  """Per item, from its pieces' states: (state, has a true and a false position in every tile).

  Also returns whether each item holds a true and a false position somewhere
  (`mixed`), which decides single tiles.
  """
  state = np.broadcast_to(np.asarray(state, np.int8), item.shape)
  certain = np.broadcast_to(np.asarray(certain, bool), item.shape) & (state == PARTIAL)
  count = np.bincount(item, minlength=n_items)
  full = np.bincount(item, weights=state == FULL, minlength=n_items)
  empty = np.bincount(item, weights=state == EMPTY, minlength=n_items)
  sure = np.bincount(item, weights=certain, minlength=n_items)
  out = np.where(full == count, FULL, np.where(empty == count, EMPTY, PARTIAL)).astype(np.int8)
  # A piece spans its item's whole run along the other axis: a FULL piece puts a
  # true position in every tile of the run, an EMPTY piece a false one.
  uniform = (full > 0) & (empty > 0)
  mixed = (full + sure > 0) & (empty + sure > 0)
  return out, uniform, mixed


def _decide_by_pieces(m: ir.Mask, geo: _Tile, tables: Tables, b, i, j, pieces, nb: int):
  """States of tiles `(b, i, j)` from their operand pieces; and whether each stays ambiguous."""
  row_pieces, col_pieces = pieces
  bb = b if not np.isscalar(b) else np.zeros_like(i)
  fq, fk = bb * geo.nq + i, bb * geo.nk + j
  item, qlo, qhi = row_pieces.expand(fq)
  nk = col_pieces.count[fk][item]
  item2 = np.repeat(item, nk)
  offset = np.arange(item2.size) - np.repeat(np.cumsum(nk) - nk, nk)
  kp = col_pieces.first[fk][item2] + offset
  ql, qh = np.repeat(qlo, nk), np.repeat(qhi, nk)
  t = Analyzer(np, tables, ql, qh, col_pieces.lo[kp], col_pieces.hi[kp],
               bb[item2] if nb > 1 else 0).truth(m)
  out, _, mixed = _combine_pieces(item2, i.size, t.state, t.certain)
  dense = np.asarray(geo.dense_q(bb, i)) & np.asarray(geo.dense_k(bb, j))
  out = np.where(dense, out, PARTIAL).astype(np.int8)
  return out, ((out == PARTIAL) & ~mixed) | ~dense


def _decide_tiles(m: ir.Mask, geo: _Tile, tables: Tables, b, i, j, budget: _Budget,
                  pieces=None, nb: int = 1):
  """Exact states of ambiguous tiles: by finer analysis where it suffices, else by evaluation.

  Finer analysis first cuts tiles at their operands' changes (exact for prelude
  masks), then into 4 x 4 and 16 x 16 sub-rectangles; tiles still undecided are
  evaluated. Every step works in chunks that fit the memory budget.
  """
  out = np.full(i.shape, PARTIAL, np.int8)
  todo = np.ones(i.shape, bool)
  chunk_items = min(_PIECE_CHUNK, budget.items(_ITEM_BYTES))
  if pieces is not None:
    per_tile = max(1, int(pieces[0].count.max()) * int(pieces[1].count.max()))
    step = max(1, chunk_items // per_tile)
    for s0 in range(0, i.size, step):
      sl = slice(s0, s0 + step)
      state, ambiguous = _decide_by_pieces(m, geo, tables, b[sl] if not np.isscalar(b) else 0,
                                           i[sl], j[sl], pieces, nb)
      out[sl] = state
      todo[sl] = ambiguous
  for parts in (4, 16):
    if not todo.any() or parts > max(geo.bq, geo.bk):
      break
    idx = np.flatnonzero(todo)
    step = max(1, chunk_items // (parts * parts))
    for s0 in range(0, idx.size, step):
      sub = idx[s0:s0 + step]
      bb = b[sub] if not np.isscalar(b) else 0
      state, ambiguous = _subdivide(m, geo, tables, np, bb, i[sub], j[sub], parts)
      out[sub] = state
      todo[sub] = ambiguous
  idx = np.flatnonzero(todo)
  if idx.size:
    budget.charge(min(_EVAL_CHUNK, geo.bq * geo.bk) * 64, "evaluating a tile")
    out[idx] = _evaluate_tiles(m, geo, tables, np, b[idx] if not np.isscalar(b) else 0, i[idx],
                               j[idx])
  return out


def _frontier(m: ir.Mask, geo: _Tile, tables: Tables, batch: int | None, along_rows: bool,
              budget: _Budget, pieces: Pieces | None = None, by_pieces: bool = False,
              cuts: np.ndarray | None = None):
  """Decided runs `(b, line, a, z, state, ambiguous)` covering every line of tiles.

  Runs start as whole lines (cut before and after each tile of `cuts`, the
  tiles along the line where an operand changes, when given) and PARTIAL ones
  are bisected, a bounded chunk of runs at a time. With `pieces` (lines cut at
  their operands' changes), a run is also decided when one piece is FULL and
  another EMPTY over it: every tile of the run is then PARTIAL, so the run needs
  no bisection. With `by_pieces` the states come from the pieces, which is exact
  where the whole tile's analysis is not.
  """
  n_lines, n_span = (geo.nq, geo.nk) if along_rows else (geo.nk, geo.nq)
  nb = batch or 1
  bounds = np.asarray([0, n_span], np.int64)
  if cuts is not None and cuts.size:
    bounds = np.unique(np.concatenate([bounds, cuts, cuts + 1]))
    bounds = bounds[(bounds >= 0) & (bounds <= n_span)]
  per_line = bounds.size - 1
  use_pieces = pieces is not None and pieces.cut
  chunk = max(1, min(1 << 16, budget.items(_ITEM_BYTES * (2 if use_pieces else 1))))
  budget.charge(nb * n_lines * per_line * 40, "the initial runs")
  line = np.tile(np.repeat(np.arange(n_lines, dtype=np.int64), per_line), nb)
  b = np.repeat(np.arange(nb, dtype=np.int64), n_lines * per_line)
  a = np.tile(bounds[:-1], nb * n_lines)
  z = np.tile(bounds[1:], nb * n_lines)
  pending = [(b, line, a, z)]
  done = []
  while pending:
    b, line, a, z = pending.pop()
    if line.size > chunk:  # split the work, not the runs: bounded memory per step
      pending.append((b[chunk:], line[chunk:], a[chunk:], z[chunk:]))
      b, line, a, z = b[:chunk], line[:chunk], a[:chunk], z[:chunk]
    single = (z - a) == 1
    if use_pieces and by_pieces:
      state, certain, uniform = _frontier_pieces(m, geo, tables, batch, along_rows, pieces,
                                                 b, line, a, z)
    else:
      state, certain = _analyse_runs(m, geo, tables, batch, along_rows, b, line, a, z)
      uniform = np.zeros(line.shape, bool)
      if use_pieces:
        sel = np.flatnonzero((state == PARTIAL) & ~single)
        if sel.size:
          _, _, uni = _frontier_pieces(m, geo, tables, batch, along_rows, pieces, b[sel],
                                       line[sel], a[sel], z[sel])
          uniform[sel] = uni
    if geo.positions:  # certainty and uniformity need real positions (dense tiles)
      dq, dk = (line, a) if along_rows else (a, line)
      line_dense = np.asarray(geo.dense_q(b, dq) if along_rows else geo.dense_k(b, dk))
      other_dense = np.asarray(geo.dense_k(b, dk) if along_rows else geo.dense_q(b, dq))
      certain = np.asarray(certain) & line_dense & other_dense
      uniform = np.asarray(uniform) & line_dense
    fin = (state != PARTIAL) | single | uniform
    done.append((b[fin], line[fin], a[fin], z[fin], state[fin], (~certain[fin]) &
                 (state[fin] == PARTIAL) & ~uniform[fin]))
    split = ~fin
    if split.any():
      mid = (a[split] + z[split]) // 2
      pending.append((np.concatenate([b[split], b[split]]),
                      np.concatenate([line[split], line[split]]),
                      np.concatenate([a[split], mid]), np.concatenate([mid, z[split]])))
  return [np.concatenate(c) for c in zip(*done)]


def _change_tiles(pieces: Pieces, nb: int, limit: int = 64) -> np.ndarray | None:
  """Tiles (indices along a line) where an operand read along that axis changes, if few."""
  n = pieces.count.size // nb
  changed = np.flatnonzero((pieces.count > 1).reshape(nb, n).any(axis=0))
  return changed if 0 < changed.size <= limit else None


def _analyse_runs(m, geo: _Tile, tables: Tables, batch, along_rows: bool, b, line, a, z):
  """(state, certain) of runs `[a, z)` of tiles on lines `line`, by whole-rectangle analysis."""
  if along_rows:
    ql, qh = geo.q_bounds(line, line + 1, b)
    kl, kh = geo.k_bounds(a, z, b)
  else:
    ql, qh = geo.q_bounds(a, z, b)
    kl, kh = geo.k_bounds(line, line + 1, b)
  t = Analyzer(np, tables, ql, qh, kl, kh, b if batch else 0).truth(m)
  state = np.broadcast_to(np.asarray(t.state, np.int8), line.shape)
  certain = np.broadcast_to(np.asarray(t.certain, bool), line.shape)
  return state, certain


def _frontier_pieces(m, geo: _Tile, tables: Tables, batch, along_rows: bool, pieces: Pieces,
                     b, line, a, z):
  """(state, certain, uniform) of runs from the pieces of their lines (see `_combine_pieces`)."""
  n_lines = geo.nq if along_rows else geo.nk
  item, plo, phi = pieces.expand(b * n_lines + line)
  if along_rows:
    kl, kh = geo.k_bounds(a[item], z[item], b[item])
    ql, qh = plo, phi
  else:
    ql, qh = geo.q_bounds(a[item], z[item], b[item])
    kl, kh = plo, phi
  t = Analyzer(np, tables, ql, qh, kl, kh, b[item] if batch else 0).truth(m)
  state, uniform, mixed = _combine_pieces(item, line.size, t.state, t.certain)
  return state, mixed, uniform


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

  def __init__(self, m: ir.Mask, geo: _Tile, tables: Tables, batch: int | None, refine: bool,
               budget: _Budget | None = None):
    self.m, self.geo, self.tables, self.batch, self.refine = m, geo, tables, batch, refine
    self.budget = budget or _Budget(MEMORY_BUDGET)
    self.refined_keys = np.zeros(0, np.int64)  # flat ids of refined tiles, sorted
    self.refined_states = np.zeros(0, np.int8)
    # Pieces are cut in position space, the same for every batch row: not with
    # batched positions, whose ambiguous tiles are refined without them.
    self.pieces = None if geo.batched_positions else (
        _pieces(m, geo, tables, batch, True, self.budget),
        _pieces(m, geo, tables, batch, False, self.budget))

  def runs(self, along_rows: bool) -> Runs:
    geo, batch = self.geo, self.batch
    line_pieces_ = None if self.pieces is None else self.pieces[0 if along_rows else 1]
    cuts = None if self.pieces is None else _change_tiles(self.pieces[1 if along_rows else 0],
                                                          batch or 1)
    b, line, a, z, state, ambiguous = _frontier(self.m, geo, self.tables, batch, along_rows,
                                                self.budget, line_pieces_, self.refine, cuts)
    if self.refine and ambiguous.any():
      idx = np.flatnonzero(ambiguous)
      ti, tj = (line[idx], a[idx]) if along_rows else (a[idx], line[idx])
      key = (b[idx] * geo.nq + ti) * geo.nk + tj  # flat tile ids; decisions are shared
      known = np.isin(key, self.refined_keys)
      todo = np.flatnonzero(~known)
      if todo.size:
        new = _decide_tiles(self.m, geo, self.tables, b[idx][todo] if batch else 0, ti[todo],
                            tj[todo], self.budget, self.pieces, batch or 1)
        keys = np.concatenate([self.refined_keys, key[todo]])
        order = np.argsort(keys, kind="stable")
        self.refined_keys = keys[order]
        self.refined_states = np.concatenate([self.refined_states, new])[order]
      state = state.copy()
      state[idx] = self.refined_states[np.searchsorted(self.refined_keys, key)]
    self.budget.charge(state.size * 24, "the packed runs")
    return _pack_runs(b, line, a, z, state, batch or 1, geo.nq if along_rows else geo.nk)


def _pieces(m: ir.Mask, geo: _Tile, tables: Tables, batch: int | None, along_rows: bool,
            budget: _Budget) -> Pieces:
  """Each q tile row (or k tile column) cut at the changes of the operands read along it."""
  nb = batch or 1
  if along_rows:
    lo, hi = geo.q_bounds(np.arange(geo.nq), np.arange(1, geo.nq + 1))
  else:
    lo, hi = geo.k_bounds(np.arange(geo.nk), np.arange(1, geo.nk + 1))
  lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
  reads = reads_at(m, "q" if along_rows else "k")
  for name, _ in reads:
    t = tables.arrays[name]
    budget.charge(t.size * 2 + lo.size * nb * 64, f"the runs of operand `{name}`")
    tables.run_table(name)
  return line_pieces({n: tables.run_table(n) for n, _ in reads}, reads, nb, lo, hi)


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


def _compile_static(bound: Binding, block_q: int, block_kv: int, refine: list[bool],
                    budget: _Budget | None = None) -> BlockMap:
  geo = _Tile(bound.shape, block_q, block_kv)
  tables = Tables(np, bound.operands)  # shared: tables are built for the operands masks read
  per_mask = [_StaticRuns(m, geo, tables, bound.batch, ref, budget)
              for m, ref in zip(bound.masks, refine)]
  rows = _stack_runs([r.runs(along_rows=True) for r in per_mask])
  return _blockmap(bound, block_q, block_kv, rows=rows, backward=_Backward(per_mask))


def _predicates(bound: Binding, block_q: int, block_kv: int):
  """The compiled predicate of each distinct mask (pairwise reads per tile where they can be)."""
  out = []
  shape = bound.shape
  for m in bound.masks:
    pairwise = any(s.kind == "pair" for s in m.operands)
    q_pos = k_pos = None
    if pairwise and shape.static and (shape.positions_batch is None):
      q_pos, k_pos = shape.rows(np)[0], shape.cols(np)[0]
    out.append(compile_predicate(m, q_positions=q_pos, kv_len=bound.kv_len, block_q=block_q,
                                 block_kv=block_kv, kv_positions=k_pos,
                                 positions_read=shape.has_positions))
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
                   bound.kv_len, block_q=block_q, block_kv=block_kv,
                   q_offset=None if bound.shape.q_positions is not None else bound.q_offset,
                   **_positions_of(bound.shape))
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
                  segment_split=_segment_split(bound, block_q, block_kv, predicates),
                  int_range=term_bounds(bound.masks, bound.shape, bound.operands),
                  q_positions=bound.shape.q_positions, kv_positions=bound.shape.kv_positions)


def bind_map(mask: Any, q_len: int, kv_len: int | None = None, *, q_offset: Any = None,
             operands: dict[str, Any] | None = None, q_positions: Any = None,
             kv_positions: Any = None) -> BlockMap:
  """A map of one tile covering the whole mask, marked PARTIAL, without analysis.

  Sound (PARTIAL promises nothing) and free to build: for consumers that evaluate
  every position anyway, like the dense reference attention.
  """
  bound = bind_masks(mask, q_len, kv_len, q_offset=q_offset, operands=operands,
                     q_positions=q_positions, kv_positions=kv_positions)
  nb, u = bound.batch or 1, len(bound.masks)
  xp = jnp if bound.traced else np
  one = lambda v, t: xp.full((nb, u, 1, 1), v, t)
  rows = Runs(one(0, np.int32), one(1, np.int32), one(1, np.int8),
              xp.ones((nb, u, 1), np.int32))
  return _blockmap(bound, bound.q_len, bound.kv_len, rows=rows, col_runs=rows)


# ----------------------------------------------------------------------------- dynamic


def _dynamic_grid(m: ir.Mask, geo: _Tile, tables: Tables, batch: int | None, refine: bool,
                  budget: int | None, memory: _Budget):
  nb = batch or 1
  memory.charge(nb * geo.nq * geo.nk * _ITEM_BYTES, "the traced analysis of the tile grid")
  i = jnp.arange(geo.nq)[None, :, None]
  j = jnp.arange(geo.nk)[None, None, :]
  q_lo = i * geo.bq + geo.shape.q_offset
  q_hi = jnp.minimum((i + 1) * geo.bq, geo.shape.q_len) - 1 + geo.shape.q_offset
  k_lo = j * geo.bk
  k_hi = jnp.minimum((j + 1) * geo.bk, geo.shape.kv_len) - 1
  dense = True
  if geo.qa is not None:  # explicit positions: per-tile hulls, `[B', nq, 1]`
    q_lo, q_hi = geo.qa.tmin[:, :, None], geo.qa.tmax[:, :, None]
    dense = geo.qa.dense_tiles[:, :, None]
  if geo.ka is not None:
    k_lo, k_hi = geo.ka.tmin[:, None, :], geo.ka.tmax[:, None, :]
    dense = dense & geo.ka.dense_tiles[:, None, :]
  b = jnp.arange(nb)[:, None, None] if batch else 0
  t = Analyzer(jnp, tables, q_lo, q_hi, k_lo, k_hi, b, geo.pos_ok).truth(m)
  full_shape = (nb, geo.nq, geo.nk)
  state = jnp.broadcast_to(jnp.asarray(t.state, jnp.int8), full_shape)
  if not refine:
    return state
  certain = jnp.broadcast_to(jnp.asarray(t.certain, bool) & dense, full_shape)
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
      new, unresolved = decide(*coords(jnp.where(valid, idx, 0)))
      # Padding entries carry the out-of-bounds index `total` and are dropped: writing
      # them to a real tile would put its old value back over the real update.
      flat_state = flat_state.at[idx].set(new.astype(flat_state.dtype), mode="drop")
      todo = todo.at[idx].set(False, mode="drop")
      left = left.at[idx].set(unresolved, mode="drop")
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
  body, more = rounds(by_analysis, max(1, min(_PIECE_CHUNK, memory.items(_ITEM_BYTES)) // 256),
                     None)
  flat, _, left, _ = jax.lax.while_loop(more, body, (flat, ambiguous, none_left, 0))
  body, more = rounds(by_evaluation, _EVAL_CHUNK // (geo.bq * geo.bk), budget)
  flat, _, _, _ = jax.lax.while_loop(more, body, (flat, left, none_left, 0))
  return flat.reshape(full_shape)


def _compile_dynamic(bound: Binding, block_q: int, block_kv: int, refine: list[bool],
                     budget: int | None, memory: _Budget | None = None) -> BlockMap:
  geo = _Tile(bound.shape, block_q, block_kv, xp=jnp)
  memory = memory or _Budget(MEMORY_BUDGET)
  tables = Tables(jnp, bound.operands)
  for name, a in bound.operands.items():
    if a.ndim == 2:  # per-token: sparse tables of log2(L) levels
      memory.charge(a.size * 8 * max(1, a.shape[-1].bit_length()), f"the tables of `{name}`")
  grid = jnp.stack([_dynamic_grid(m, geo, tables, bound.batch, ref, budget, memory)
                    for m, ref in zip(bound.masks, refine)], axis=1)
  return _blockmap(bound, block_q, block_kv, rows=runs_from_grid(jnp, grid),
                   col_runs=runs_from_grid(jnp, jnp.swapaxes(grid, -1, -2)),
                   line_bounds=_line_bounds(bound, block_q, block_kv))
