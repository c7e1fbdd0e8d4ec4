"""The compiled predicate: what a kernel evaluates on a PARTIAL tile, as data.

The compiler (`maskc.compiled.predicate_compiler`) turns a mask into a `Predicate`: a
straight-line program over the positions `q`, `k` and a typed table of the
operand reads a tile needs. Kernels never see the mask language; they see

- `q_reads`: per-token reads at a term of `q` (`seg[q]`, `runs(img)[q]`,
  `doc[q // 2]`): one value per query position, gathered once outside the
  kernel and sliced per tile;
- `k_reads`: the same at a term of `k`;
- `scalars`: one value per batch row (`kv_len`, `prompt_len`);
- `pairs`: pairwise reads (`allowed[q, k]`): one value per (query, key)
  position, sliced per tile;
- `tile_pairs`: pairwise reads whose indices are constant on every tile
  (`sel[q // 64, k // 64]` with 64-aligned tiles): one value per tile.

`gather` computes those values from the operand arrays, and `evaluate` runs
the program with NumPy, jax.numpy, or inside a Pallas kernel: it only needs the
positions and a `fetch(kind, slot)` that returns the value of a read,
broadcastable against them. Run ids (`runs(x)`) are ordinary operand arrays
the compiler computed; a read names the array it indexes.

The compiler also records structural facts, found in the mask's conjunction
after expanding every definition, never by a mask's name: segment-id
equalities `s[q] == s[k]` (splash's `SegmentIds`), the band of `q - k` the
mask stays within (splash's `CausalMask`/`LocalMask`) and a chunk size
(`q // c == k // c`, splash's chunked masks).

This module imports nothing of maskc.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np


class Instr(NamedTuple):
  """One instruction: `op` applied to earlier results `args`, with a constant or slot `value`.

  Ops: `q`, `k`, `pos` (the position of an index program), `const`; reads
  `q_read`, `k_read`, `scalar`, `pair`, `tile_pair` (value = slot); integer
  `neg add sub mul floordiv mod abs min max`; comparisons `lt le eq ne ge gt`;
  boolean `true false nonzero and or xor not`.
  """
  op: str
  args: tuple[int, ...] = ()
  value: int = 0


Program = tuple[Instr, ...]


@dataclasses.dataclass(frozen=True)
class TokenRead:
  """`array[index(pos)]`: a per-token operand read at a term of one position.

  Attributes:
    array: the operand array it reads (a key of the compiled object's operands); the
      empty string for a read of no array, whose value is the index itself (the
      position of a row or column when the map has explicit positions).
    index: a program over `pos` (and scalar slots) giving the index; clipped to the array.
    text: the read as written, for messages.
  """
  array: str
  index: Program
  text: str


@dataclasses.dataclass(frozen=True)
class PairwiseRead:
  """`array[q_index(q), k_index(k)]`: a pairwise operand read.

  Attributes:
    array: the operand array it reads.
    q_index, k_index: programs over `pos` (and scalar slots) for the two indices.
    text: the read as written, for messages.
  """
  array: str
  q_index: Program
  k_index: Program
  text: str


@dataclasses.dataclass(frozen=True)
class Predicate:
  """A mask compiled for kernels: a program and the table of reads it needs.

  Attributes:
    program: instructions over `q`, `k` and read slots; the last one is the mask.
    q_reads, k_reads: per-token reads at a term of `q` / of `k` (`q_read`/`k_read` slots).
    scalars: arrays of scalar operands (`scalar` slots).
    pairs: pairwise reads evaluated per position (`pair` slots).
    tile_pairs: pairwise reads with one value per tile (`tile_pair` slots).
    segments: `(q_read slot, k_read slot)` of each conjunct `s[q] == s[k]`.
    rest: the mask without its segment conjuncts (None when it has none).
    band: `(lo, hi)`: the mask implies `lo <= q - k <= hi` (either may be None).
    chunk: `c` when the mask implies `q // c == k // c`, else None.
    text: the mask's canonical text.

  >>> import maskc
  >>> bm = maskc.compile("causal & document(seg)", 8, block_q=4, block_kv=4,
  ...                    operands={"seg": [0, 0, 0, 1, 1, 1, 1, 1]})
  >>> p = bm.predicates[0]
  >>> [r.text for r in p.q_reads], [r.text for r in p.k_reads], p.segments, p.band
  (['seg[q]'], ['seg[k]'], ((0, 0),), (0, None))
  """
  program: Program
  q_reads: tuple[TokenRead, ...] = ()
  k_reads: tuple[TokenRead, ...] = ()
  scalars: tuple[str, ...] = ()
  pairs: tuple[PairwiseRead, ...] = ()
  tile_pairs: tuple[PairwiseRead, ...] = ()
  segments: tuple[tuple[int, int], ...] = ()
  rest: Predicate | None = None
  band: tuple[int | None, int | None] = (None, None)
  chunk: int | None = None
  text: str = ""

  @property
  def reads_arrays(self) -> bool:
    """Whether a tile needs operand arrays (anything but scalars)."""
    return bool(self.q_reads or self.k_reads or self.pairs or self.tile_pairs)

  def __str__(self) -> str:
    return self.text


class ReadValues(NamedTuple):
  """The values of a predicate's reads at the positions of a shape (batch axis first).

  Attributes:
    q: `[B', n_q_reads, Lq]`: per-token reads at each query row.
    k: `[B', n_k_reads, Lkv]`: per-token reads at each key column.
    scalars: `[B', n_scalars]`.
    pairs: `[B', n_pairs, Lq, Lkv]`.
    tile_pairs: `[B', n_tile_pairs, n_q_tiles, n_kv_tiles]`.
  """
  q: Any
  k: Any
  scalars: Any
  pairs: Any
  tile_pairs: Any


Fetch = Callable[[str, int], Any]


def run(program: Program, xp, q, k, fetch: Fetch | None):
  """The value of `program`'s last instruction at positions `q`, `k` (broadcastable);
  `fetch` reads the operands (None for a program that reads none)."""
  vals: list[Any] = []
  for ins in program:
    op, a = ins.op, ins.args
    if op == "q":
      v = q
    elif op == "k" or op == "pos":
      v = k if op == "k" else q
    elif op == "const":
      v = ins.value
    elif op in ("q_read", "k_read", "scalar", "pair", "tile_pair"):
      if fetch is None:
        raise TypeError(f"the program reads an operand ({op!r}), and no fetch was given")
      v = fetch(op, ins.value)
    elif op == "neg":
      v = -vals[a[0]]
    elif op == "add":
      v = vals[a[0]] + vals[a[1]]
    elif op == "sub":
      v = vals[a[0]] - vals[a[1]]
    elif op == "mul":
      v = vals[a[0]] * vals[a[1]]
    elif op == "floordiv":
      v = xp.floor_divide(vals[a[0]], vals[a[1]])
    elif op == "mod":
      v = xp.remainder(vals[a[0]], vals[a[1]])
    elif op == "abs":
      v = xp.abs(vals[a[0]])
    elif op in ("min", "max"):
      pick = xp.minimum if op == "min" else xp.maximum
      v = vals[a[0]]
      for x in a[1:]:
        v = pick(v, vals[x])
    elif op in _COMPARE:
      v = _COMPARE[op](xp, vals[a[0]], vals[a[1]])
    elif op == "true" or op == "false":
      v = xp.asarray(op == "true")
    elif op == "nonzero":
      v = vals[a[0]] != 0
    elif op in ("and", "or", "xor"):
      fn = {"and": xp.logical_and, "or": xp.logical_or, "xor": xp.logical_xor}[op]
      v = vals[a[0]]
      for x in a[1:]:
        v = fn(v, vals[x])
    elif op == "not":
      v = xp.logical_not(vals[a[0]])
    else:
      raise ValueError(f"unknown predicate instruction {op!r}")
    vals.append(v)
  return vals[-1]


_COMPARE = {
    "lt": lambda xp, a, b: xp.less(a, b), "le": lambda xp, a, b: xp.less_equal(a, b),
    "eq": lambda xp, a, b: xp.equal(a, b), "ne": lambda xp, a, b: xp.not_equal(a, b),
    "ge": lambda xp, a, b: xp.greater_equal(a, b), "gt": lambda xp, a, b: xp.greater(a, b),
}


def evaluate(pred: Predicate, xp, q, k, fetch: Fetch):
  """The mask (bool) at positions `q`, `k`, broadcast to their common shape."""
  out = run(pred.program, xp, q, k, fetch)
  shape = np.broadcast_shapes(np.shape(q), np.shape(k))
  return xp.broadcast_to(xp.asarray(out, dtype=bool), np.broadcast_shapes(np.shape(out), shape))


def gather(pred: Predicate, operands: Mapping[str, Any], q_positions, kv_positions, xp, *,
           batch: int | None, block_q: int, block_kv: int, dtype=None) -> ReadValues:
  """The values of every read of `pred` at the given positions.

  Args:
    pred: the compiled predicate.
    operands: operand arrays by name, batch axis first (size B or 1).
    q_positions, kv_positions: `[Lq]` / `[Lkv]` positions of the rows and columns, or
      `[B', Lq]` / `[B', Lkv]` per batch row.
    xp: numpy or jax.numpy.
    batch: the batch size, or None.
    block_q, block_kv: tile sizes (for `tile_pairs`, read at each tile's first row/column).
    dtype: the integer type of the values (default: the operands' own).
  """
  nb = batch or 1
  cast = (lambda a: a) if dtype is None else (lambda a: a.astype(dtype))
  arrays = {n: cast(xp.asarray(a)) for n, a in operands.items()}
  scal = [xp.broadcast_to(arrays[n].reshape(arrays[n].shape[0]), (nb,)) for n in pred.scalars]
  scalars = xp.stack(scal, axis=1) if scal else xp.zeros((nb, 0), arrays_dtype(xp, dtype))

  def index(program, pos):
    def fetch(kind, slot):
      return scalars[:, slot][:, None]

    pos = pos if pos.ndim == 2 else pos[None, :]
    return xp.broadcast_to(run(program, xp, pos, None, fetch), (nb, pos.shape[-1]))

  def token(reads, pos):
    rows = []
    for r in reads:
      if not r.array:  # the position itself
        rows.append(cast(index(r.index, pos)))
        continue
      arr = arrays[r.array]
      idx = xp.clip(index(r.index, pos), 0, arr.shape[-1] - 1)
      rows.append(xp.take_along_axis(xp.broadcast_to(arr, (nb, arr.shape[-1])), idx, axis=-1))
    return xp.stack(rows, axis=1) if rows else xp.zeros((nb, 0, pos.shape[-1]),
                                                         arrays_dtype(xp, dtype))

  def pairwise(reads, qp, kp):
    out = []
    for r in reads:
      arr = xp.broadcast_to(arrays[r.array], (nb,) + arrays[r.array].shape[1:])
      qi = xp.clip(index(r.q_index, qp), 0, arr.shape[-2] - 1)
      ki = xp.clip(index(r.k_index, kp), 0, arr.shape[-1] - 1)
      b = xp.arange(nb)[:, None, None]
      out.append(arr[b, qi[:, :, None], ki[:, None, :]])
    return xp.stack(out, axis=1) if out else xp.zeros((nb, 0, qp.shape[-1], kp.shape[-1]),
                                                      arrays_dtype(xp, dtype))

  qp, kp = xp.asarray(q_positions), xp.asarray(kv_positions)
  return ReadValues(token(pred.q_reads, qp), token(pred.k_reads, kp), scalars,
                    pairwise(pred.pairs, qp, kp),
                    pairwise(pred.tile_pairs, qp[..., ::block_q], kp[..., ::block_kv]))


def arrays_dtype(xp, dtype):
  return dtype if dtype is not None else (np.int64 if xp is np else np.int32)


def dense_fetch(values: ReadValues, xp, *, block_q: int, block_kv: int, q_len: int,
                kv_len: int) -> Fetch:
  """A `fetch` for positions laid out `[B', Lq, 1]` × `[1, 1, Lkv]` (the whole mask)."""
  def fetch(kind: str, slot: int):
    if kind == "q_read":
      return values.q[:, slot][:, :, None]
    if kind == "k_read":
      return values.k[:, slot][:, None, :]
    if kind == "scalar":
      return values.scalars[:, slot][:, None, None]
    if kind == "pair":
      return values.pairs[:, slot]
    t = values.tile_pairs[:, slot]
    return xp.repeat(xp.repeat(t, block_q, axis=1), block_kv, axis=2)[:, :q_len, :kv_len]
  return fetch
