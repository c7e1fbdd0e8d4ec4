"""Equivalence of two masks: symbolically, or at a shape through their block maps.

Two masks are equivalent at a shape when they agree at every position. Deciding
that by materializing both costs `q_len × kv_len`, which at 128K tokens is
16 G elements. Most of that work is unnecessary: both masks lower to block maps
whose FULL and EMPTY tiles are sound, so

1. a tile FULL in both or EMPTY in both agrees, with no evaluation;
2. a tile FULL in one and EMPTY in the other disagrees everywhere: its first
   element is a counterexample;
3. any other tile is split in halves, and range analysis decides the halves the
   same way; only small rectangles that stay undecided are evaluated, in chunks.

The work is proportional to the masks' boundaries, not to the grid. The two maps
are merged run by run (`BlockMap.rows`), so the tile grid is never allocated.

Before any of that, two masks whose canonical forms (`Mask.simplify`) are equal,
as written or with every named mask expanded, are equivalent at every shape and
need no evaluation at all.

The counterexample reported is the first differing position in row-major
order `(batch, row, col)`, and it is always checked by evaluating both masks
there. Should a block map or the analysis ever claim a FULL or EMPTY verdict
that evaluation contradicts, the check warns (`UnsoundBlockMapWarning`) and
decides again by evaluating every tile where the maps disagree.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

import jax
import numpy as np
from jax.typing import ArrayLike

from maskc.compiled.tiles import runs_from_grid
from maskc.language import ir
from maskc.language.arguments import as_mask, integer
from maskc.language.errors import MaskTypeError, MaskValueError, OperandError
from maskc.lowering import compile as _lower
from maskc.lowering.grid.forms import unpacked
from maskc.semantics.evaluate import Env, evaluate_mask
from maskc.semantics.ranges import EMPTY, FULL, PARTIAL, Analyzer, Tables
from maskc.semantics.shape import Shape

_LEAF = 1024  # rectangles of at most this many positions are evaluated, not split further
_EVAL_CHUNK = 1 << 21  # positions evaluated at once
_TILE_CHUNK = 1 << 26  # positions of undecided tiles analyzed at once
_MAX_EXPANDED = 20_000  # nodes; larger masks skip the expanded symbolic check

_STATE_NAME = {EMPTY: "EMPTY", PARTIAL: "PARTIAL", FULL: "FULL"}

# What `equivalent` compares: a mask, its text, or a dense bool array.
MaskOrDense = ir.Mask | str | np.ndarray | jax.Array


class UnsoundBlockMapWarning(RuntimeWarning):
  """A block map or the range analysis claimed FULL or EMPTY where a position says otherwise."""


@dataclasses.dataclass(frozen=True)
class Counterexample:
  """A position where two masks differ.

  Attributes:
    batch: the batch row (None when no operand has a batch axis).
    row, col: the element's row and column indices.
    q, k: its query and key positions (`q = q_offset + row`, `k = col`).
    a, b: the value of each mask there.
    tile: `(tile_row, tile_col)` at the block sizes of the check.
    tile_rows, tile_cols: the `[start, stop)` rows and columns of that tile.
  """
  batch: int | None
  row: int
  col: int
  q: int
  k: int
  a: bool
  b: bool
  tile: tuple[int, int]
  tile_rows: tuple[int, int]
  tile_cols: tuple[int, int]

  @property
  def index(self) -> tuple[int, ...]:
    """The element's index into a dense mask: `(row, col)` or `(batch, row, col)`."""
    return (self.row, self.col) if self.batch is None else (self.batch, self.row, self.col)

  def __str__(self) -> str:
    where = "" if self.batch is None else f"batch {self.batch}, "
    return (f"{where}row {self.row}, col {self.col} (q={self.q}, k={self.k}): a is "
            f"{str(self.a).lower()}, b is {str(self.b).lower()}; tile {self.tile} = rows "
            f"{self.tile_rows[0]}:{self.tile_rows[1]}, cols {self.tile_cols[0]}:"
            f"{self.tile_cols[1]}")


@dataclasses.dataclass(frozen=True)
class Equivalence:
  """The verdict of `maskc.equivalent(a, b, ...)`.

  Attributes:
    equal: True (equivalent), False (they differ; see `counterexample`) or None
      (unknown: no shape was given and the masks are not symbolically equal).
    reason: how the verdict was reached, in words.
    counterexample: the first differing position in row-major order, when `equal`
      is False.
    a, b: the two masks as text (a dense array is described by its shape).
    shape: `(q_len, kv_len, q_offset)` of the check, or None for a symbolic one.
    block_q, block_kv: the tile sizes of the check (None for a symbolic one).
    stats: tiles decided by the block maps, positions evaluated, seconds taken.

  `bool(result)` is `equal` when it is known. An unknown verdict has no truth
  value: `bool()` raises `MaskTypeError`, so `assert maskc.equivalent(a, b)`
  cannot pass, or fail, silently without a shape. Test `result.equal is True`
  to accept only proven equivalence.
  """
  equal: bool | None
  reason: str
  counterexample: Counterexample | None = None
  a: str = ""
  b: str = ""
  shape: tuple[int, int, int] | None = None
  block_q: int | None = None
  block_kv: int | None = None
  stats: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

  @property
  def verdict(self) -> bool | None:
    """The tri-state verdict: True, False or None (unknown)."""
    return self.equal

  def __bool__(self) -> bool:
    if self.equal is None:
      raise MaskTypeError(
          "the equivalence of these masks is unknown: they are not symbolically equal and no "
          "shape was given",
          hint="Pass a shape to decide, e.g. `maskc.equivalent(a, b, 4096)`, or test "
               "`result.equal is True` to accept only a symbolic proof.")
    return self.equal

  def __str__(self) -> str:
    if self.equal is None:
      return f"unknown whether `{self.a}` and `{self.b}` are equivalent: {self.reason}"
    if self.equal:
      return f"`{self.a}` and `{self.b}` are equivalent: {self.reason}"
    return f"`{self.a}` and `{self.b}` differ at {self.counterexample}: {self.reason}"

  def __repr__(self) -> str:
    parts = [f"equal={self.equal}", f"a={self.a!r}", f"b={self.b!r}"]
    if self.shape is not None:
      parts.append(f"shape={self.shape}")
    if self.counterexample is not None:
      parts.append(f"counterexample={self.counterexample!r}")
    parts.append(f"reason={self.reason!r}")
    return f"Equivalence({', '.join(parts)})"


# ----------------------------------------------------------------------------- entry point


def equivalent(a: MaskOrDense, b: MaskOrDense, q_len: int | None = None,
               kv_len: int | None = None, *, q_offset: int | None = None,
               operands: Mapping[str, ArrayLike] | None = None, block_q: int = 128,
               block_kv: int = 128) -> Equivalence:
  """Whether two masks agree, at every shape (symbolically) or at one shape.

  Without a shape, only a symbolic proof is attempted: the masks are equivalent
  everywhere when their canonical forms (`simplify()`), as written or with named
  masks expanded, are equal; otherwise the verdict is unknown (`equal is None`),
  never False. With a shape, the verdict is always True or False: both masks are
  lowered to block maps, tiles both maps decide alike are skipped, FULL against
  EMPTY is an immediate counterexample, and only the undecided rest is split by
  range analysis and evaluated (see the module docstring). Long sequences are
  cheap: `sliding(1024)` against `causal & local(1023, 0)` at 128K tokens takes
  a fraction of a second.

  Args:
    a, b: masks: a `Mask`, mask text, or a dense NumPy bool array
      `[q_len, kv_len]` or `[B, q_len, kv_len]` (a reference to compare with;
      it gives the shape when none is passed, and must match one that is).
    q_len: query rows; None for a symbolic check only.
    kv_len: key columns (default `q_len`).
    q_offset: position of row 0 (default `kv_len - q_len`).
    operands: static operand values by name, shared by both masks (each reads
      the ones it needs).
    block_q, block_kv: tile sizes of the check; they only change the speed and
      the tile a counterexample is reported in.

  Returns:
    An `Equivalence`: truthy when the masks agree; else `equal is False` and
    `counterexample` holds the first differing position with both values.

  Raises:
    MaskTypeError: an argument is not a mask, mask text or bool array; or
      `bool()` of an unknown verdict.
    MaskValueError: a dense array's shape does not match, or a bad shape or tile size.
    OperandError: missing or misshapen operands (from lowering).

  >>> import maskc
  >>> bool(maskc.equivalent("global(4)", "sink(4) | q < 4"))
  True
  >>> r = maskc.equivalent("sliding(8)", "causal & local(8, 0)", 64)
  >>> r.equal, r.counterexample.row, r.counterexample.col
  (False, 8, 0)
  """
  start = time.perf_counter()
  bq, bk = integer("block_q", block_q, minimum=1), integer("block_kv", block_kv, minimum=1)
  da, db = _dense(a, "a"), _dense(b, "b")
  ma = None if da is not None else as_mask(a)
  mb = None if db is not None else as_mask(b)
  text_a = _describe(da) if da is not None else str(ma)
  text_b = _describe(db) if db is not None else str(mb)
  if ma is not None and mb is not None:
    proof = _symbolic(ma, mb)
    if proof is not None:
      shape_t = None
      if q_len is not None:
        s = Shape.of(q_len, kv_len, q_offset)
        shape_t = (s.q_len, s.kv_len, int(s.q_offset))
      return Equivalence(True, proof, a=text_a, b=text_b, shape=shape_t,
                         stats={"seconds": time.perf_counter() - start})
  if q_len is None:
    dense = da if da is not None else db
    if dense is None:
      if kv_len is not None or q_offset is not None:
        raise MaskValueError(f"kv_len or q_offset given without q_len ({kv_len=}, {q_offset=})",
                             hint="Pass q_len too, e.g. `maskc.equivalent(a, b, 4096)`.")
      return Equivalence(
          None, "simplification does not prove them equal (their canonical forms differ); "
          "pass a shape (q_len, and operands if they read any) to decide", a=text_a, b=text_b,
          stats={"seconds": time.perf_counter() - start})
    q_len = dense.shape[-2]
    kv_len = dense.shape[-1] if kv_len is None else kv_len
  shape = Shape.of(q_len, kv_len, q_offset)
  for d, name in ((da, "a"), (db, "b")):
    if d is not None and d.shape[-2:] != (shape.q_len, shape.kv_len):
      raise MaskValueError(
          f"the dense mask {name} has shape {d.shape}, but the check is at q_len={shape.q_len}, "
          f"kv_len={shape.kv_len}",
          hint="Pass the shape the array was built for, or leave q_len out to take it from "
               "the array.")
  if not shape.static or any(isinstance(v, jax.core.Tracer) for v in (operands or {}).values()):
    raise OperandError("equivalent needs static operand values and q_offset, got traced values",
                       hint="Call it outside jax.jit, with NumPy arrays or ints.")
  # each side is an array or a mask
  sides = [DenseSide(d, shape, bq, bk) if d is not None else
           MaskSide(cast(ir.Mask, m), shape, bq, bk, operands) for d, m in ((da, ma), (db, mb))]
  return compare_sides(sides[0], sides[1], shape, bq, bk, text_a=text_a, text_b=text_b,
                       start=start)


def compare_sides(a: Side, b: Side, shape: Shape, block_q: int, block_kv: int, *,
                  text_a: str, text_b: str, start: float | None = None) -> Equivalence:
  """The verdict on two sides at a static shape (see the module docstring).

  `equivalent` compares masks and dense arrays; other readers (`maskc.verify`'s block
  lists, mask functions and splash masks) bring their own `Side`.
  """
  start = time.perf_counter() if start is None else start
  sides = (a, b)
  batch = _common_batch(sides)
  result = _decide(sides, shape, block_q, block_kv, batch, trust=True)
  if result["counterexample"] is not None and result["counterexample"].a == \
      result["counterexample"].b:
    cx = result["counterexample"]
    warnings.warn(UnsoundBlockMapWarning(
        f"a block map or the range analysis of `{text_a}` or `{text_b}` at q_len={shape.q_len}, "
        f"kv_len={shape.kv_len}, q_offset={shape.q_offset}, tiles {block_q}x{block_kv}, claimed "
        f"a FULL or EMPTY verdict that position {cx.index} (q={cx.q}, k={cx.k}) contradicts "
        f"(both masks are {cx.a} there). This is a maskc bug; please report it. Deciding again "
        f"by evaluating every tile the maps do not decide alike."), stacklevel=3)
    result = _decide(sides, shape, block_q, block_kv, batch, trust=False)
    result["reason"] += " (decided again trusting no FULL/EMPTY disagreement; see the warning)"
  result["stats"]["seconds"] = time.perf_counter() - start
  shape_t = (shape.q_len, shape.kv_len, int(shape.q_offset))
  return Equivalence(result["counterexample"] is None, result["reason"],
                     result["counterexample"], a=text_a, b=text_b, shape=shape_t, block_q=block_q,
                     block_kv=block_kv, stats=result["stats"])


def _dense(x: Any, name: str) -> np.ndarray | None:
  """`x` as a `[B', q_len, kv_len]` bool array if it is an array, else None."""
  if isinstance(x, (ir.Mask, str)):
    return None
  if not isinstance(x, (np.ndarray, jax.Array)):
    raise MaskTypeError(
        f"{name} must be a mask, mask text or a dense bool array, got {type(x).__name__}",
        hint='Pass `maskc.parse("causal")`, "causal", or a NumPy array `[q_len, kv_len]`.')
  arr = np.asarray(x)
  if arr.ndim not in (2, 3):
    raise MaskValueError(f"the dense mask {name} must have shape [q_len, kv_len] or "
                         f"[B, q_len, kv_len], got shape {arr.shape}")
  if arr.dtype != np.bool_:
    if not (np.issubdtype(arr.dtype, np.integer) and np.isin(arr, (0, 1)).all()):
      raise MaskTypeError(f"the dense mask {name} must hold booleans (or 0/1), got {arr.dtype}",
                          hint="Pass `array.astype(bool)`.")
    arr = arr.astype(bool)
  return arr


def _describe(d: np.ndarray) -> str:
  return f"<dense {'x'.join(map(str, d.shape))} array>"


# ----------------------------------------------------------------------------- symbolic


def _canonical(m: ir.Mask) -> ir.Mask:
  """`m.simplify()`, repeated until it stops changing (a few rounds at most)."""
  s = m.simplify()
  for _ in range(4):
    t = s.simplify()
    if t == s:
      break
    s = t
  return s


def _symbolic(a: ir.Mask, b: ir.Mask) -> str | None:
  """Why `a` and `b` are equal at every shape, or None when simplification cannot tell."""
  sa, sb = _canonical(a), _canonical(b)
  if sa == sb:
    return f"symbolically equal: both simplify to `{sa}`"
  ea, eb = _expanded(a), _expanded(b)
  if ea is not None and eb is not None and ea == eb:
    return f"symbolically equal: with named masks expanded, both simplify to `{ea}`"
  return None


@functools.lru_cache(maxsize=1024)
def _expanded(m: ir.Mask) -> ir.Mask | None:
  """`m` with every named mask replaced by its body, simplified (None if too large)."""
  if ir.expanded_size(m, _MAX_EXPANDED) > _MAX_EXPANDED:
    return None

  def go(n: ir.Mask) -> ir.Mask:
    if isinstance(n, ir.Call):
      return go(ir.expand(n))
    if isinstance(n, ir.And):
      return ir.and_([go(i) for i in n.items])
    if isinstance(n, ir.Or):
      return ir.or_([go(i) for i in n.items])
    if isinstance(n, ir.Xor):
      return ir.xor([go(i) for i in n.items])
    if isinstance(n, ir.Not):
      return ir.not_(go(n.item))
    return n

  return _canonical(go(m))


# ----------------------------------------------------------------------------- sides


class Side(Protocol):
  """One side of a comparison at a shape: what the prover reads of it.

  Attributes:
    batch: its batch size, or None when it is the same for every batch row.
    runs: `(start, stop, state)` of its tiles' runs along each q tile, `[B', n_q_tiles, R]`
      each (`maskc.compiled.tiles.Runs` without the count; `B'` is 1 or `batch`). A FULL
      or EMPTY tile is a claim about every position of it, which `values` must honour.
  """
  batch: int | None
  runs: tuple[np.ndarray, ...]

  def states(self, b: np.ndarray | int, r0: np.ndarray, r1: np.ndarray, c0: np.ndarray,
             c1: np.ndarray) -> np.ndarray:
    """EMPTY/PARTIAL/FULL of the rectangles `rows [r0, r1) × cols [c0, c1)`, each inside one
    tile (PARTIAL when unknown: always sound)."""
    ...

  def values(self, b: np.ndarray | int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """The mask at broadcastable batch rows `b`, `rows` and `cols`."""
    ...


class MaskSide:
  """A mask at the shape: its block map, and range analysis or evaluation of rectangles."""

  def __init__(self, mask: ir.Mask, shape: Shape, bq: int, bk: int,
               operands: Mapping[str, ArrayLike] | None) -> None:
    self.mask, self.shape = mask, shape
    bm = _lower.compile(mask, shape.q_len, shape.kv_len, block_q=bq, block_kv=bk,
                  q_offset=shape.q_offset, operands=operands)
    self.batch = bm.batch
    self.arrays = bm.operands
    self.runs = tuple(np.asarray(x)[:, 0] for x in bm.rows[:3])  # [B', n_q_tiles, R]
    self.tables = Tables(np, self.arrays)

  def _b(self, b: np.ndarray | int) -> np.ndarray | int:
    return b if self.batch is not None else 0

  def states(self, b: np.ndarray | int, r0: np.ndarray, r1: np.ndarray, c0: np.ndarray,
             c1: np.ndarray) -> np.ndarray:
    """EMPTY/PARTIAL/FULL of the rectangles `rows [r0, r1) × cols [c0, c1)` by range analysis."""
    off = self.shape.q_offset
    t = Analyzer(np, self.tables, r0 + off, r1 - 1 + off, c0, c1 - 1, self._b(b)).truth(self.mask)
    return np.broadcast_to(np.asarray(t.state, np.int8), r0.shape)

  def values(self, b: np.ndarray | int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """The mask at broadcastable `rows`, `cols` (and batch rows `b`)."""
    env = Env(np, rows + self.shape.q_offset, cols, self.arrays, self._b(b))
    out: np.ndarray = evaluate_mask(self.mask, env)
    return out


class DenseSide:
  """A dense reference array: exact rectangle states from 2-D prefix sums."""

  def __init__(self, arr: np.ndarray, shape: Shape, bq: int, bk: int) -> None:
    self.arr = arr if arr.ndim == 3 else arr[None]
    self.batch = arr.shape[0] if arr.ndim == 3 else None
    c = np.cumsum(np.cumsum(self.arr, axis=-1, dtype=np.int64), axis=-2)
    self.prefix = np.pad(c, ((0, 0), (1, 0), (1, 0)))
    nq, nk = -(-shape.q_len // bq), -(-shape.kv_len // bk)
    i, j = np.arange(nq)[None, :, None], np.arange(nk)[None, None, :]
    bb = np.arange(self.arr.shape[0])[:, None, None]
    grid = self.states(bb, i * bq, np.minimum((i + 1) * bq, shape.q_len), j * bk,
                       np.minimum((j + 1) * bk, shape.kv_len))
    self.runs = tuple(np.asarray(x) for x in runs_from_grid(np, np.asarray(grid, np.int8)))[:3]

  def _b(self, b: np.ndarray | int) -> np.ndarray | int:
    return b if self.batch is not None else 0

  def states(self, b: np.ndarray | int, r0: np.ndarray, r1: np.ndarray, c0: np.ndarray,
             c1: np.ndarray) -> np.ndarray:
    """Exact EMPTY/PARTIAL/FULL of the rectangles `rows [r0, r1) × cols [c0, c1)`."""
    p, bb = self.prefix, self._b(b)
    count = p[bb, r1, c1] - p[bb, r0, c1] - p[bb, r1, c0] + p[bb, r0, c0]
    area = (r1 - r0) * (c1 - c0)
    return np.where(count == 0, EMPTY, np.where(count == area, FULL, PARTIAL)).astype(np.int8)

  def values(self, b: np.ndarray | int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    out: np.ndarray = self.arr[self._b(b), rows, cols]
    return out




def _common_batch(sides: Sequence[Side]) -> int | None:
  batches = {s.batch for s in sides if s.batch is not None}
  if len(batches) > 1:
    raise MaskValueError(f"the two masks disagree on the batch size: {sorted(batches)}",
                         hint="Give both the same batch of operands (or dense rows).")
  return batches.pop() if batches else None


# ----------------------------------------------------------------------------- deciding


def _lookup(flat: tuple[np.ndarray, np.ndarray, np.ndarray], g: np.ndarray) -> np.ndarray:
  """The state at global positions `g` of flattened runs (EMPTY outside every run)."""
  gs, ge, st = flat
  if gs.size == 0:
    return np.zeros(g.shape, np.int8)
  idx = np.searchsorted(gs, g, side="right") - 1
  safe = np.maximum(idx, 0)
  inside = (idx >= 0) & (g < ge[safe])
  return np.where(inside, st[safe], EMPTY).astype(np.int8)


def _segments(sides: Sequence[Side], nb: int, nq: int,
              nk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Elementary segments of tiles on which both maps are constant, with both states."""
  flats = [unpacked(s.runs, nb, nq, nk) for s in sides]
  points = np.unique(np.concatenate([x for f in flats for x in f[:2]]))
  width = nk + 1
  if points.size < 2:
    empty = np.zeros(0, np.int64)
    return empty, empty, empty, np.zeros(0, np.int8), np.zeros(0, np.int8)
  g0, g1 = points[:-1], points[1:]
  same = (g0 // width) == (g1 // width)
  g0, g1 = g0[same], g1[same]
  key, j0, j1 = g0 // width, g0 % width, g1 % width
  return key, j0, j1, _lookup(flats[0], g0), _lookup(flats[1], g0)


def _decide(sides: Sequence[Side], shape: Shape, bq: int, bk: int, batch: int | None, *,
            trust: bool) -> dict[str, Any]:
  """The first differing position (or none) and statistics; see the module docstring."""
  nb = batch or 1
  q_len, kv_len = shape.q_len, shape.kv_len
  nq, nk = -(-q_len // bq), -(-kv_len // bk)
  key, j0, j1, sa, sb = _segments(sides, nb, nq, nk)
  agree = (sa == sb) & (sa != PARTIAL)
  definite = (sa != PARTIAL) & (sb != PARTIAL) & (sa != sb)
  undecided = ~agree & ~definite if trust else ~agree
  n_tiles = nb * nq * nk
  stats: dict[str, Any] = {
      "tiles": n_tiles, "tiles_definite": int((j1 - j0)[definite].sum()) if trust else 0,
      "tiles_evaluated": 0, "rectangles_analyzed": 0, "positions_evaluated": 0}
  search = _Search(sides, shape, batch, stats)
  if trust and definite.any():
    kb, ki = key[definite] // nq, key[definite] % nq
    search.offer(kb, ki * bq, j0[definite] * bk)
  # Undecided tiles in (batch, tile row, tile col) order: their first positions increase.
  lengths = (j1 - j0)[undecided]
  stats["tiles_undecided"] = int(lengths.sum())
  stats["tiles_by_map"] = n_tiles - stats["tiles_undecided"]
  per_chunk = max(1, _TILE_CHUNK // (bq * bk))
  for kk, jj in _tiles(key[undecided], j0[undecided], lengths, per_chunk):
    tb, ti = kk // nq, kk % nq
    if search.order(tb[:1], ti[:1] * bq, jj[:1] * bk)[0] >= search.best:
      break
    stats["tiles_evaluated"] += kk.size
    search.rectangles(tb, ti * bq, np.minimum((ti + 1) * bq, q_len), jj * bk,
                      np.minimum((jj + 1) * bk, kv_len), analyze=trust)
  cx = search.counterexample(bq, bk)
  by_map = stats["tiles_by_map"] - stats["tiles_definite"]
  where = f"q_len={q_len}, kv_len={kv_len}, q_offset={shape.q_offset}, tiles {bq}x{bk}"
  if cx is None:
    reason = (f"equal at {where}: {by_map} of {n_tiles} tiles agree by the block maps; "
              f"{stats['tiles_evaluated']} tiles checked by range analysis and "
              f"{stats['positions_evaluated']} evaluated positions")
  else:
    ci, cj = cx.tile
    state_a = _tile_state(sides[0], cx.batch, ci, cj)
    state_b = _tile_state(sides[1], cx.batch, ci, cj)
    reason = (f"differ at {where}: tile ({ci}, {cj}) is {state_a} in a's block map and "
              f"{state_b} in b's" + ("" if {state_a, state_b} == {"FULL", "EMPTY"} else
                                      f"; found after {stats['positions_evaluated']} evaluated "
                                      f"positions"))
  return {"counterexample": cx, "reason": reason, "stats": stats}


def _tiles(key: np.ndarray, j0: np.ndarray, lengths: np.ndarray,
           per_chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Yields the tiles of segments `(key, j0, j0 + length)` in order, `per_chunk` at a time."""
  ends = np.cumsum(lengths)
  total = int(ends[-1]) if ends.size else 0
  for s in range(0, total, per_chunk):
    e = min(s + per_chunk, total)
    lo, hi = np.searchsorted(ends, s, "right"), np.searchsorted(ends, e, "left") + 1
    seg_len, seg_first = lengths[lo:hi], ends[lo:hi] - lengths[lo:hi]
    kk = np.repeat(key[lo:hi], seg_len)
    index = np.arange(kk.size) + seg_first[0]  # global tile index
    jj = np.repeat(j0[lo:hi] - seg_first, seg_len) + index
    keep = (index >= s) & (index < e)
    yield kk[keep], jj[keep]


def _tile_state(side: Side, batch: int | None, ti: int, tj: int) -> str:
  start, stop, state = side.runs
  b = 0 if side.batch is None or start.shape[0] == 1 else (batch or 0)  # runs broadcast
  hit = (start[b, ti] <= tj) & (tj < stop[b, ti]) & (state[b, ti] != EMPTY)
  return _STATE_NAME[int(state[b, ti][hit][0])] if hit.any() else "EMPTY"


class _Search:
  """Tracks the first differing position while rectangles are analyzed and evaluated."""

  def __init__(self, sides: Sequence[Side], shape: Shape, batch: int | None,
               stats: dict[str, Any]) -> None:
    self.sides, self.shape, self.batch, self.stats = sides, shape, batch, stats
    self.best = np.iinfo(np.int64).max

  def order(self, b: Any, row: Any, col: Any) -> Any:
    """Row-major rank of `(batch, row, col)`: smaller is earlier."""
    return (b * self.shape.q_len + row) * self.shape.kv_len + col

  def offer(self, b: np.ndarray, row: np.ndarray, col: np.ndarray) -> None:
    if len(b):
      self.best = min(self.best, int(self.order(b, row, col).min()))

  def rectangles(self, b: np.ndarray, r0: np.ndarray, r1: np.ndarray, c0: np.ndarray,
                 c1: np.ndarray, *, analyze: bool) -> None:
    """Decides rectangles: split and analyze until small, then evaluate the small ones."""
    leaves = []
    fresh = False  # the tiles themselves are already known undecided
    while b.size:
      keep = self.order(b, r0, c0) < self.best
      b, r0, r1, c0, c1 = b[keep], r0[keep], r1[keep], c0[keep], c1[keep]
      if fresh and analyze:
        self.stats["rectangles_analyzed"] += b.size
        sa, sb = (s.states(b, r0, r1, c0, c1) for s in self.sides)
        definite = (sa != PARTIAL) & (sb != PARTIAL) & (sa != sb)
        self.offer(b[definite], r0[definite], c0[definite])
        keep = ((sa == PARTIAL) | (sb == PARTIAL)) & (self.order(b, r0, c0) < self.best)
        b, r0, r1, c0, c1 = b[keep], r0[keep], r1[keep], c0[keep], c1[keep]
      fresh = True
      h, w = r1 - r0, c1 - c0
      small = (h * w <= _LEAF) | (not analyze)
      leaves.append((b[small], r0[small], r1[small], c0[small], c1[small]))
      big = ~small
      b, r0, r1, c0, c1, h, w = b[big], r0[big], r1[big], c0[big], c1[big], h[big], w[big]
      rows = h >= w
      rm = np.where(rows, r0 + h // 2, r1)  # end of the first half's rows
      cm = np.where(rows, c1, c0 + w // 2)  # end of the first half's cols
      b, r0, r1, c0, c1 = (np.concatenate(x) for x in (
          (b, b), (r0, np.where(rows, rm, r0)), (rm, r1), (c0, np.where(rows, c0, cm)),
          (cm, c1)))
    b, r0, r1, c0, c1 = (np.concatenate(x) for x in zip(*leaves))
    self._evaluate(b, r0, r1, c0, c1)

  def _evaluate(self, b: np.ndarray, r0: np.ndarray, r1: np.ndarray, c0: np.ndarray,
                c1: np.ndarray) -> None:
    """Evaluates both masks on rectangles, earliest first, in chunks of `_EVAL_CHUNK`."""
    if not b.size:
      return
    order = np.argsort(self.order(b, r0, c0), kind="stable")
    b, r0, r1, c0, c1 = b[order], r0[order], r1[order], c0[order], c1[order]
    hmax, wmax = int((r1 - r0).max()), int((c1 - c0).max())
    per_chunk = max(1, _EVAL_CHUNK // (hmax * wmax))
    for s in range(0, b.size, per_chunk):
      sl = slice(s, s + per_chunk)
      bb, a0, a1, d0, d1 = b[sl], r0[sl], r1[sl], c0[sl], c1[sl]
      if self.order(bb[:1], a0[:1], d0[:1])[0] >= self.best:
        return
      rows = a0[:, None, None] + np.arange(hmax)[None, :, None]
      cols = d0[:, None, None] + np.arange(wmax)[None, None, :]
      valid = (rows < a1[:, None, None]) & (cols < d1[:, None, None])
      rows = np.minimum(rows, a1[:, None, None] - 1)
      cols = np.minimum(cols, d1[:, None, None] - 1)
      b3 = bb[:, None, None]
      self.stats["positions_evaluated"] += int(valid.sum())
      va, vb = (np.asarray(s.values(b3, rows, cols), bool) for s in self.sides)
      diff = (va != vb) & valid
      if diff.any():
        t, r, c = np.nonzero(diff)
        self.offer(bb[t], rows[t, r, 0], cols[t, 0, c])

  def counterexample(self, bq: int, bk: int) -> Counterexample | None:
    if self.best == np.iinfo(np.int64).max:
      return None
    q_len, kv_len = self.shape.q_len, self.shape.kv_len
    b, rest = divmod(self.best, q_len * kv_len)
    row, col = divmod(rest, kv_len)
    one = (np.asarray([[[b]]]), np.asarray([[[row]]]), np.asarray([[[col]]]))
    va, vb = (bool(np.asarray(s.values(*one)).reshape(-1)[0]) for s in self.sides)
    ti, tj = row // bq, col // bk
    return Counterexample(
        batch=None if self.batch is None else int(b), row=int(row), col=int(col),
        q=int(row + self.shape.q_offset), k=int(col), a=va, b=vb, tile=(int(ti), int(tj)),
        tile_rows=(int(ti * bq), int(min((ti + 1) * bq, q_len))),
        tile_cols=(int(tj * bk), int(min((tj + 1) * bk, kv_len))))
