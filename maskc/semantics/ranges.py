"""Range analysis: what a mask can be over whole rectangles of positions.

For a batch of rectangles `q in [ql, qh] × k in [kl, kh]` (arrays, one entry per
rectangle) every integer term yields an interval `[lo, hi]` that holds all its
values, and every predicate a three-valued truth: EMPTY (0, false everywhere),
PARTIAL (1), FULL (2, true everywhere). The analysis is sound for every IR node:
one mechanism serves every primitive and user definition, with no code for any
named mask.

Two flags make it exact on the prelude. An interval is *tight* when both ends
are attained somewhere in the rectangle, and *dense* when every integer between
them is. A PARTIAL verdict is *certain* when the rectangle provably holds both
a true and a false position: a comparison whose difference of sides is tight
(dense for `==`, `!=`) gives certainty, as does an operand read whose any/all is
known exactly. `&`, `|`, `^` keep certainty only when at most one operand is
PARTIAL; otherwise the verdict is ambiguous and the lowering may refine it by
evaluating the tile.

Operands contribute through precomputed tables: per-token operands through
their runs (static path, `maskc.semantics.operand_runs`) or blocked range tables (traced
path, `BlockedRange`), either giving exact min and max over any index interval, pairwise
operands through 2-D prefix sums of their nonzero entries. Everything is
written against an array module `xp` (NumPy or jax.numpy), so the static and
the traced lowering share it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from maskc.arrays.bit_words import count_through
from maskc.language import ir
from maskc.language.errors import MaskLimitError
from maskc.semantics.operand_runs import RunForm, RunTable, floor_log2, may_index, unit_read
from maskc.semantics.pair_blocks import BlockAxis, PairBlocks

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclasses.dataclass
class Interval:
  """Values of an integer term over each rectangle: `lo <= value <= hi`."""
  lo: Any
  hi: Any
  tight: Any  # bool or bool array: lo and hi are attained
  dense: Any  # bool or bool array: every integer in [lo, hi] is attained
  axes: frozenset  # which positions the term depends on ("q", "k")
  source: tuple | None = None  # ("read", operand name) for a monotone-aware read
  ok: Any = True  # bool or bool array: False where the bounds left the integer type (unknown)


@dataclasses.dataclass
class Truth3:
  """A predicate over each rectangle: EMPTY / PARTIAL / FULL, and whether PARTIAL is certain."""
  state: Any
  certain: Any


class Tables:
  """Operand tables for the analysis, built once per lowering.

  Attributes:
    xp: the array module.
    arrays: operands as prepared by `maskc.semantics.operands.prepare_operands`.
    forms: static path: per-token operands in run form where already known (else
      built from `arrays` when first needed).
    budget: static path: the lowering's memory budget, which holds the run tables
      (`maskc.semantics.operand_runs.RunTable`) and their indices of each token's run, built
      only where they fit; None for no run-table index.
    same_runs: static path: analyse `runs(x)[a] == runs(x)[b]` beside `x[a]` by the
      ids of x's runs of zeros and nonzeros (`same_runs`), which decides more
      rectangles than the traced path's analysis does.

  Pairwise reads aligned with the tiles (`align_pair`, registered by the lowering) are
  analysed through per-block counts (`maskc.semantics.pair_blocks`), the others through
  2-D prefix counts (`prefix`).
  """

  def __init__(self, xp, arrays: Mapping[str, Any], forms: dict[str, RunForm] | None = None,
               budget: Any = None, same_runs: bool = False):
    self.xp = xp
    self.arrays = arrays
    self.forms = forms or {}  # static path: per-token operands' runs, when already known
    self.budget = budget
    self.same_runs = same_runs and xp.__name__ == "numpy"
    self.same_runs_used = False  # whether an analysis read ids of runs (`same_runs`)
    self._blocked: dict[str, BlockedRange] = {}
    self._whole: dict[str, tuple] = {}
    self._prefix: dict[str, Any] = {}
    self._mono: dict[str, Any] = {}
    self._runs: dict[str, RunTable] = {}
    self._aligned: dict[ir.PairRead, tuple[BlockAxis, BlockAxis]] = {}
    self._pair_blocks: dict[ir.PairRead, PairBlocks] = {}

  def shape(self, name: str) -> tuple[int, ...]:
    """Operand `name`'s shape, without writing it out."""
    shape = getattr(self.arrays, "shape", None)
    return tuple(shape(name)) if callable(shape) else tuple(self.arrays[name].shape)

  def raw(self, name: str) -> Any:
    """Operand `name` in its own dtype where it is kept so (a static pairwise operand: see
    `maskc.semantics.operand_arrays`), else as prepared."""
    raw = getattr(self.arrays, "raw", None)
    return raw(name) if raw is not None else self.arrays[name]

  def reads(self) -> Mapping[str, Any]:
    """Operand arrays for evaluating a few pairs without writing any out: a per-token
    operand not written out yet is read through its run table, a pairwise one through its
    values as given (widened as they are gathered)."""
    return _Reads(self)

  def align_pair(self, read: ir.PairRead, rows: BlockAxis, cols: BlockAxis) -> None:
    """Analyse `read` through its blocks along rows and columns (`PairBlocks`): the
    lowering registers the reads whose indices are aligned with its tiles."""
    self._aligned[read] = (rows, cols)

  def pair_blocks(self, read: ir.PairRead) -> PairBlocks | None:
    """The block verdicts of an aligned pairwise read (`align_pair`), built once; None for a
    read that is not aligned."""
    if read not in self._aligned:
      return None
    if read not in self._pair_blocks:
      rows, cols = self._aligned[read]
      if self.budget is not None:
        a = self.raw(read.operand.name)
        self.budget.charge(a.shape[0] * rows.count * a.shape[-1] * 4,
                           f"the row blocks of operand `{read.operand.name}`")
        self.budget.hold(a.shape[0] * (rows.count + 1) * (cols.count + 1) * 8,
                         f"the block counts of operand `{read.operand.name}`")
      self._pair_blocks[read] = PairBlocks(self.xp, self.raw(read.operand.name), rows, cols)
    return self._pair_blocks[read]

  def size(self, name: str) -> int:
    """Entries of operand `name` (all batch rows), without writing a per-token one out."""
    form = self.forms.get(name)
    return form.batch * form.length if form is not None else int(np.size(self.arrays[name]))

  def run_table(self, name: str) -> RunTable:
    """Static path: operand `name` (`[B, L]`) in run-length form (for `same-run(x)`,
    the ids of x's runs of zero and nonzero values: see `same_runs`)."""
    if name not in self._runs:
      base = name[len(_SAME_RUN):-1] if name.startswith(_SAME_RUN) else None
      form = self.forms.get(base or name) or RunForm.of(self.arrays[base or name])
      if base is not None:
        form = form.truth_run_ids()
      self._runs[name] = RunTable(form, self._runs.values(), self._index_bytes(form, name))
    return self._runs[name]

  def _index_bytes(self, form: RunForm, name: str) -> int:
    """Holds a run table's memory in the budget, and its token index's where one may be built
    and fits (the index is built later, if at all: held now so that it is never over)."""
    if self.budget is None:
      return 0
    self.budget.hold(RunTable.bytes_for(form), f"the run table of operand `{name}`")
    index = form.batch * form.length * 4
    if not may_index(form.starts.size) or self.budget.held + index > self.budget.limit:
      return 0
    self.budget.hold(index, f"an index of the runs of operand `{name}`")
    return index

  def blocked(self, name: str) -> BlockedRange:
    """Traced path: operand `name` (`[B, L]`) as a `BlockedRange`, built once."""
    if name not in self._blocked:
      self._blocked[name] = BlockedRange(self.xp, self.arrays[name])
    return self._blocked[name]

  def range_min_max(self, name: str, b, lo, hi):
    """Min and max of operand `name` over indices `[lo, hi]` (clipped to its length)."""
    if self.xp.__name__ == "numpy":  # static: binary search over the operand's runs
      return self.run_table(name).range_min_max(b, lo, hi)
    return self.blocked(name).range_min_max(b, lo, hi)

  def window_min_max(self, name: str, b, lo, hi, ok, span: int):
    """Traced path: min and max over indices `[lo, hi]`, an interval of at most `span` tokens.

    Reads the interval's tokens directly (clipped to the length, as `range_min_max`);
    where `ok` is False (the index left the integer type) the whole operand's.
    """
    xp = self.xp
    a = self.arrays[name]
    length = a.shape[-1]
    lo = xp.clip(xp.asarray(lo), 0, length - 1)
    hi = xp.maximum(xp.clip(xp.asarray(hi), 0, length - 1), lo)
    idx = lo[..., None] + xp.arange(span)
    inside = idx <= hi[..., None]
    bi = b if np.isscalar(b) else xp.asarray(b)[..., None]
    vals = a[bi, xp.minimum(idx, length - 1)]
    info = np.iinfo(a.dtype)
    vmin, vmax = reduce_many(xp, [(xp.where(inside, vals, info.max), "min"),
                                  (xp.where(inside, vals, info.min), "max")], -1)
    if ok is True:
      return vmin, vmax
    whole_min, whole_max = self.whole(name)
    return xp.where(ok, vmin, whole_min[b]), xp.where(ok, vmax, whole_max[b])

  def whole(self, name: str):
    """Min and max of operand `name` per batch row (`[B]` each)."""
    if name not in self._whole:
      a = self.arrays[name]
      self._whole[name] = tuple(reduce_many(self.xp, [(a, "min"), (a, "max")], -1))
    return self._whole[name]

  def monotone(self, name: str):
    """Per batch row: whether the operand is nondecreasing (`[B]` bool)."""
    if name not in self._mono:
      xp = self.xp
      if xp.__name__ == "numpy":
        self._mono[name] = self.run_table(name).monotone()
        return self._mono[name]
      a = self.arrays[name]
      # Nondecreasing: the first decrease (argmin, one kernel under jit, where `all` over
      # more than 32 elements compiles to three) is the sentinel past the end.
      up = xp.concatenate([a[..., 1:] >= a[..., :-1], xp.zeros(a.shape[:-1] + (1,), bool)], -1)
      self._mono[name] = xp.argmin(up, axis=-1) == a.shape[-1] - 1
    return self._mono[name]

  def prefix(self, name: str):
    """2-D prefix sums of `operand != 0`: `[B, Q+1, K+1]`.

    int32 counts where a batch row has fewer than 2**31 entries (a count never wraps),
    else int64 (NumPy) or a `MaskLimitError` (under `jit`, whose integers are int32).
    NumPy sums in place into the table, held in the budget: the table and the
    operand's flags are all it allocates.
    """
    if name not in self._prefix:
      xp = self.xp
      a = self.raw(name)
      *lead, rows, cols = a.shape
      wide = rows * cols >= 1 << 31
      if xp is np:
        dtype = np.dtype(np.int64 if wide else np.int32)
        if self.budget is not None:
          self.budget.hold(math.prod(lead) * (rows + 1) * (cols + 1) * dtype.itemsize,
                           f"the 2-D counts of operand `{name}`")
          self.budget.charge(a.size, f"the nonzeros of operand `{name}`")
        c = np.zeros((*lead, rows + 1, cols + 1), dtype)
        inner = c[..., 1:, 1:]
        np.cumsum(a != 0, axis=-1, dtype=dtype, out=inner)
        np.cumsum(inner, axis=-2, out=inner)
      else:
        if wide:
          raise MaskLimitError(
              f"pairwise operand `{name}` has {rows} x {cols} entries per batch row, 2**31 or "
              "more: under jit its counts would wrap in int32",
              hint="Lower it with NumPy operands (the static path counts in int64).")
        # along each row from bit words, then down the columns
        c = _down_columns(count_through(xp, a != 0, xp.int32))
        c = xp.concatenate([xp.zeros(c.shape[:-2] + (1, c.shape[-1]), c.dtype), c], axis=-2)
        c = xp.concatenate([xp.zeros(c.shape[:-1] + (1,), c.dtype), c], axis=-1)
      self._prefix[name] = c
    return self._prefix[name]


def _down_columns(c):
  """Prefix sums of `c` (jax.numpy) down its second-to-last axis.

  On a CPU, a scan over the rows, one add a row: XLA's CPU cumsum along a major
  axis is a tree of reduce-windows, 434 against 102 ms for `[2, 4096, 4096]`.
  Elsewhere `cumsum`, which a GPU or TPU runs in parallel where the scan would be
  a step per row (`lax.platform_dependent` lowers only the target's branch).
  """
  def by_rows(c):
    rows = jnp.moveaxis(c, -2, 0)
    _, out = jax.lax.scan(lambda total, row: (total + row, total + row),
                          jnp.zeros_like(rows[0]), rows)
    return jnp.moveaxis(out, 0, -2)

  return jax.lax.platform_dependent(c, cpu=by_rows, default=lambda c: jnp.cumsum(c, axis=-2))


RANGE_BLOCK = 8  # tokens per block of a `BlockedRange`


class BlockedRange:
  """Traced path: exact min and max of a per-token operand `[B, L]` over any index interval.

  Tokens are grouped in blocks of `RANGE_BLOCK`. Per token it keeps the min and
  max from its block's start to it (prefix) and from it to its block's end
  (suffix); per block, sparse tables over whole blocks (log2(L / RANGE_BLOCK)
  levels of `L / RANGE_BLOCK` entries). An interval over several blocks is its
  first token's suffix, its last token's prefix and the whole blocks between; an
  interval inside one block is read token by token (at most `RANGE_BLOCK` reads).

  Why not a sparse table over tokens: its log2(L) levels of `[B, L]` cost as much
  memory, and XLA takes seconds to compile their construction; these tables are a
  few operand-sized arrays built in a few passes.

  Args:
    xp: the array module (jax.numpy; NumPy works the same, for checks).
    a: the operand, integer `[B, L]`.
  """

  def __init__(self, xp, a):
    self.xp, self.a = xp, a
    nb, length = a.shape
    g = RANGE_BLOCK
    n = -(-length // g)
    self.length, self.g, self.n = length, g, n
    pad = n * g - length
    # Padding repeats the last token: no query reads it except with that token.
    padded = xp.concatenate([a, xp.broadcast_to(a[:, -1:], (nb, pad))], axis=1) if pad else a
    blocks = padded.reshape(nb, n, g)
    flat = (nb, n * g)
    self.pre_min = _block_scan(xp, xp.minimum, blocks, False).reshape(flat)
    self.pre_max = _block_scan(xp, xp.maximum, blocks, False).reshape(flat)
    self.suf_min = _block_scan(xp, xp.minimum, blocks, True).reshape(flat)
    self.suf_max = _block_scan(xp, xp.maximum, blocks, True).reshape(flat)
    mins, maxs = [blocks.min(axis=-1)], [blocks.max(axis=-1)]
    span = 1
    while 2 * span <= n:  # level j covers 2**j blocks; entries past the end are never read
      lo, hi = mins[-1], maxs[-1]
      mins.append(xp.minimum(lo, xp.concatenate([lo[:, span:], lo[:, -span:]], axis=1)))
      maxs.append(xp.maximum(hi, xp.concatenate([hi[:, span:], hi[:, -span:]], axis=1)))
      span *= 2
    self.mins, self.maxs = xp.stack(mins), xp.stack(maxs)

  @property
  def nbytes(self) -> int:
    """Bytes of the tables (beyond the operand)."""
    return int(4 * self.pre_min.size + 2 * self.mins.size) * self.a.dtype.itemsize

  def range_min_max(self, b, lo, hi):
    """Min and max over tokens `[lo, hi]` (clipped to the length) of batch rows `b`."""
    xp, g, length = self.xp, self.g, self.length
    lo = xp.clip(xp.asarray(lo), 0, length - 1)
    hi = xp.maximum(xp.clip(xp.asarray(hi), 0, length - 1), lo)
    bl, bh = lo // g, hi // g
    # inside one block: its tokens one by one
    idx = lo[..., None] + xp.arange(g)
    inside = idx <= hi[..., None]
    bi = b if np.isscalar(b) else xp.asarray(b)[..., None]
    vals = self.a[bi, xp.minimum(idx, length - 1)]
    info = np.iinfo(self.a.dtype)
    one_min = xp.where(inside, vals, info.max).min(axis=-1)
    one_max = xp.where(inside, vals, info.min).max(axis=-1)
    # over blocks: the ends' suffix and prefix, and the whole blocks between
    many_min = xp.minimum(self.suf_min[b, lo], self.pre_min[b, hi])
    many_max = xp.maximum(self.suf_max[b, lo], self.pre_max[b, hi])
    first, last = bl + 1, bh - 1
    between = last >= first
    count = xp.maximum(last - first + 1, 1)
    j = xp.clip(floor_log2(xp, count), 0, self.mins.shape[0] - 1)
    first = xp.clip(first, 0, self.n - 1)
    second = xp.clip(last - (1 << j) + 1, 0, self.n - 1)
    mid_min = xp.minimum(self.mins[j, b, first], self.mins[j, b, second])
    mid_max = xp.maximum(self.maxs[j, b, first], self.maxs[j, b, second])
    many_min = xp.where(between, xp.minimum(many_min, mid_min), many_min)
    many_max = xp.where(between, xp.maximum(many_max, mid_max), many_max)
    same = bl == bh
    return xp.where(same, one_min, many_min), xp.where(same, one_max, many_max)


def _block_scan(xp, op, blocks, reverse: bool):
  """Running `op` (minimum or maximum) along each block's last axis, from its start or end."""
  x, step, g = blocks, 1, blocks.shape[-1]
  while step < g:
    if reverse:
      x = xp.concatenate([op(x[..., :-step], x[..., step:]), x[..., -step:]], axis=-1)
    else:
      x = xp.concatenate([x[..., :step], op(x[..., step:], x[..., :-step])], axis=-1)
    step *= 2
  return x


_IDENTITY = {"min": lambda i: i.max, "max": lambda i: i.min, "sum": lambda i: 0,
             "or": lambda i: 0, "and": lambda i: -1}


def reduce_many(xp: ModuleType, terms: Sequence[tuple[Any, str]], axis: Any) -> list[Any]:
  """Reductions `[(array, op)]` (op: "min", "max", "sum", "or", "and") over `axis`, together.

  In NumPy each is its own reduction. Under jax.numpy they are one variadic
  `lax.reduce`: XLA's CPU compiler splits a single reduction over more than 32
  elements into three kernels (a tree reduction), but keeps a variadic one as one
  kernel fused with what it reads, and compiling kernels is most of a traced
  lowering's cost. Integer or bool arrays; under jit "sum" adds in the array's dtype.
  """
  axes = tuple(np.atleast_1d(axis))
  if xp.__name__ == "numpy":
    ufunc = {"min": np.minimum, "max": np.maximum, "sum": np.add, "or": np.bitwise_or,
             "and": np.bitwise_and}
    return [ufunc[op].reduce(np.asarray(a), axis=axes) for a, op in terms]
  arrays = [xp.asarray(a) for a, _ in terms]
  shape = np.broadcast_shapes(*(a.shape for a in arrays))
  axes = tuple(x % len(shape) for x in axes)
  full = tuple(xp.broadcast_to(a, shape) for a in arrays)
  ops = [op for _, op in terms]
  inits = tuple(
      xp.array(op in ("and", "min") if a.dtype == bool else _IDENTITY[op](np.iinfo(a.dtype)),
               a.dtype)
      for a, op in zip(full, ops))
  fn = {"min": jax.lax.min, "max": jax.lax.max, "sum": jax.lax.add, "or": jax.lax.bitwise_or,
        "and": jax.lax.bitwise_and}

  def combine(x, y):
    return tuple(fn[op](u, v) for op, u, v in zip(ops, x, y))

  return list(jax.lax.reduce(full, inits, combine, axes))


class Analyzer:
  """Analyzes one mask over many rectangles at once.

  Args:
    xp: the array module.
    tables: operand tables.
    ql, qh, kl, kh: inclusive position bounds of each rectangle (broadcastable arrays).
    b: batch row of each rectangle (array) or 0.
    pos_ok: False where the positions themselves left the integer type.
    spans: traced path: static bounds `{"q": n, "k": m}` on every rectangle's extent
      (`qh - ql + 1 <= n`), or None. A read at `q + c` (or `k + c`) then covers at
      most that many tokens, which are read directly: no range tables at all.
    known: traced path: `{(table name, axis, c): (lo, hi)}`, the exact min and max of
      the read at `axis + c` over each rectangle (arrays broadcastable to the
      rectangles), computed by the caller; used where the index stays in the type.
  """

  def __init__(self, xp, tables: Tables, ql, qh, kl, kh, b=0, pos_ok=True,
               spans: dict[str, int] | None = None, known: dict | None = None):
    self.xp, self.tables = xp, tables
    self.ql, self.qh, self.kl, self.kh, self.b = ql, qh, kl, kh, b
    self.pos_ok = pos_ok
    self.spans = spans or {}
    self.known = known or {}
    self.info = np.iinfo(xp.asarray(0).dtype)  # int64, or int32 under jit without x64
    # verdicts by node; callers may seed exact ones (`maskc.lowering.closed_forms.same_run_ids`
    # under `jit`)
    self.memo = ir.NodeMemo()

  def truth(self, m: ir.Mask) -> Truth3:
    if m not in self.memo:
      # Bounds that leave the integer type are detected and made unknown below; the
      # wrapped values computed on the way are never used, so NumPy need not warn.
      with np.errstate(over="ignore", invalid="ignore"):
        self.memo[m] = self._truth(m)
    return self.memo[m]

  def term(self, t: ir.Term) -> Interval:
    if t not in self.memo:
      self.memo[t] = self._term(t)
    return self.memo[t]

  # ------------------------------------------------------------------ terms
  #
  # Interval ends are computed in the analysis' integer type. Every operation that
  # could leave it checks its operands' ends first and marks the result not `ok`
  # where it could; comparisons with a not-ok side are PARTIAL and never certain,
  # which is sound whatever the exact values are.

  def _fits(self, v: int) -> bool:
    return self.info.min <= v <= self.info.max

  def _unknown(self, axes, like=None) -> Interval:
    return Interval(0, 0, False, False, axes, None, False)

  def _term(self, t: ir.Term) -> Interval:
    xp = self.xp
    if isinstance(t, ir.Const):
      if not self._fits(t.value):
        return self._unknown(frozenset())
      return Interval(t.value, t.value, True, True, frozenset())
    if isinstance(t, ir.Pos):
      if t.axis == "q":
        return Interval(self.ql, self.qh, True, True, frozenset("q"), None, self.pos_ok)
      return Interval(self.kl, self.kh, True, True, frozenset("k"))
    if isinstance(t, ir.Scalar):
      v = self.tables.arrays[t.name][self.b]
      return Interval(v, v, True, True, frozenset())
    if isinstance(t, ir.Read):
      idx = self.term(t.index)
      name = ir.array_key(t)
      # An unknown index still reads an operand value: bound it by the whole operand.
      i_lo = _where(xp, idx.ok, idx.lo, 0)
      i_hi = _where(xp, idx.ok, idx.hi, self.info.max)
      unit = unit_read(t.index)
      span = self.spans.get(unit[0]) if unit else None
      if unit and (name,) + unit in self.known:
        lo, hi = self.known[(name,) + unit]
        if idx.ok is not True:
          whole_min, whole_max = self.tables.whole(name)
          lo = xp.where(idx.ok, lo, whole_min[self.b])
          hi = xp.where(idx.ok, hi, whole_max[self.b])
      elif span is not None and xp.__name__ != "numpy":
        lo, hi = self.tables.window_min_max(name, self.b, idx.lo, idx.hi, idx.ok, span)
      else:
        lo, hi = self.tables.range_min_max(name, self.b, i_lo, i_hi)
      # A read that is constant over the rectangle is one attained value: tight and dense.
      point = lo == hi
      dense_idx = _and(xp, True, idx.dense, idx.ok)
      tight = xp.logical_or(dense_idx, point) if dense_idx is not True else True
      source = ("read", name) if not t.runs else None
      return Interval(lo, hi, tight, point, idx.axes, source if _is_true(dense_idx) else None)
    if isinstance(t, ir.PairRead):
      a = self.tables.raw(t.operand.name)
      lo = xp.min(a, axis=(-2, -1)).astype(self.info.dtype)[self.b]
      hi = xp.max(a, axis=(-2, -1)).astype(self.info.dtype)[self.b]
      axes = self.term(t.q_index).axes | self.term(t.k_index).axes
      return Interval(lo, hi, False, False, axes)
    if isinstance(t, ir.Neg):
      return self._neg(self.term(t.arg))
    if isinstance(t, ir.Arith):
      return self._arith(t)
    if isinstance(t, ir.Fn):
      return self._fn(t)
    raise TypeError(f"cannot analyze term {type(t).__name__}")

  def _neg(self, a: Interval) -> Interval:
    ok = _and(self.xp, True, a.ok, _gt(self.xp, a.lo, self.info.min))
    return Interval(-a.hi, -a.lo, a.tight, a.dense, a.axes, None, ok)

  def _add(self, x, y):
    """`x + y` and whether it did not wrap."""
    if isinstance(x, int) and isinstance(y, int):
      r = x + y
      return (r, True) if self._fits(r) else (0, False)
    xp = self.xp
    x, y = xp.asarray(x), xp.asarray(y)
    r = x + y
    return r, (((x ^ r) & (y ^ r)) >= 0)

  def _arith(self, t: ir.Arith) -> Interval:
    xp = self.xp
    a, b = self.term(t.lhs), self.term(t.rhs)
    if t.op in "+-":
      if t.op == "-":
        b = self._neg(b)
      independent = not (a.axes & b.axes)
      lo, ok_lo = self._add(a.lo, b.lo)
      hi, ok_hi = self._add(a.hi, b.hi)
      return Interval(lo, hi, _and(xp, independent, a.tight, b.tight),
                      _and(xp, independent, a.dense, b.dense), a.axes | b.axes, None,
                      _and(xp, True, a.ok, b.ok, ok_lo, ok_hi))
    if t.op == "*":
      const, other = (t.lhs, b) if isinstance(t.lhs, ir.Const) else (t.rhs, a)
      c = cast(ir.Const, const).value  # `*` has a constant side (`ir.arith`)
      if c == 0:
        return Interval(0, 0, True, True, other.axes)
      if not self._fits(c):
        return self._unknown(other.axes)
      lim = self.info.max // abs(c)
      ok = _and(xp, True, other.ok, _ge(xp, other.lo, -lim), _ge(xp, lim, other.hi))
      lo, hi = (other.lo * c, other.hi * c) if c >= 0 else (other.hi * c, other.lo * c)
      return Interval(lo, hi, other.tight, _and(xp, abs(c) <= 1, other.dense), other.axes, None,
                      ok)
    c = cast(ir.Const, t.rhs).value  # `//` and `%` divide by a constant (`ir.arith`)
    if t.op == "//":
      if not self._fits(c):  # |c| beyond every value: the quotient is -1 or 0
        return Interval(-1, 0, False, False, a.axes)
      lo, hi = xp.floor_divide(a.lo, c), xp.floor_divide(a.hi, c)
      if c < 0:
        lo, hi = hi, lo
      ok = a.ok if c != -1 else _and(xp, True, a.ok, _gt(xp, a.lo, self.info.min))
      return Interval(lo, hi, a.tight, a.dense, a.axes, None, ok)
    # `%`: Python semantics, the result takes the divisor's sign.
    m = abs(c)
    if not self._fits(m) or a.ok is False:
      lo, hi = (0, m - 1) if c > 0 else (-(m - 1), 0)
      if self._fits(m):
        return Interval(lo, hi, False, False, a.axes)
      return self._unknown(a.axes)
    if c > 0:
      x_lo, x_hi, x_ok = a.lo, a.hi, a.ok
    else:
      x = self._neg(a)
      x_lo, x_hi, x_ok = x.lo, x.hi, x.ok
    r_lo, r_hi = xp.mod(x_lo, m), xp.mod(x_hi, m)
    # `x_hi - x_lo + 1 >= m` without leaving the type
    room = _ge(xp, self.info.max - (m - 1), x_lo)
    covers = xp.logical_and(room, x_hi >= _where(xp, room, x_lo, self.info.min) + (m - 1))
    covers = xp.logical_or(covers, xp.logical_not(xp.asarray(x_ok)))  # unknown: any residue
    no_wrap = xp.logical_and(xp.logical_not(covers), r_lo <= r_hi)
    lo = xp.where(no_wrap, r_lo, 0)
    hi = xp.where(no_wrap, r_hi, m - 1)
    x_dense = _and(xp, True, a.dense, x_ok)
    x_tight = _and(xp, True, a.tight, x_ok)
    tight = xp.where(no_wrap, x_tight, x_dense)
    dense = xp.where(no_wrap, x_dense, xp.logical_and(covers, x_dense))
    if c < 0:
      lo, hi = -hi, -lo
    return Interval(lo, hi, tight, dense, a.axes)

  def _fn(self, t: ir.Fn) -> Interval:
    xp = self.xp
    args = [self.term(a) for a in t.args]
    if t.name == "abs":
      a = args[0]
      pos = a.lo >= 0
      neg = a.hi <= 0
      lo = xp.where(pos, a.lo, xp.where(neg, -a.hi, 0))
      hi = xp.where(pos, a.hi, xp.where(neg, -a.lo, xp.maximum(-a.lo, a.hi)))
      straddle = xp.logical_not(xp.logical_or(pos, neg))
      tight = xp.where(straddle, a.dense, a.tight)
      ok = _and(xp, True, a.ok, _gt(xp, a.lo, self.info.min))
      return Interval(lo, hi, tight, a.dense, a.axes, None, ok)
    pick = xp.minimum if t.name == "min" else xp.maximum
    lo, hi, axes = args[0].lo, args[0].hi, args[0].axes
    tight, dense, ok = args[0].tight, args[0].dense, args[0].ok
    for a in args[1:]:
      independent = not (axes & a.axes)
      lo, hi = pick(lo, a.lo), pick(hi, a.hi)
      tight = _and(xp, independent, tight, a.tight)
      dense = _and(xp, independent, dense, a.dense)
      ok = _and(xp, True, ok, a.ok)
      axes = axes | a.axes
    return Interval(lo, hi, tight, dense, axes, None, ok)

  # ------------------------------------------------------------------ predicates

  def _truth(self, m: ir.Mask) -> Truth3:
    xp = self.xp
    if isinstance(m, ir.BoolConst):
      return Truth3(FULL if m.value else EMPTY, True)
    if isinstance(m, ir.Call):
      return self.truth(ir.expand(m))
    if isinstance(m, ir.Compare):
      links = [self._link(op, a, b) for op, a, b in zip(m.ops, m.terms, m.terms[1:])]
      return _conjoin(xp, links)
    if isinstance(m, ir.Truth):
      return self._operand_truth(m.read)
    if isinstance(m, ir.Not):
      t = self.truth(m.item)
      return Truth3(FULL - t.state, t.certain)
    if isinstance(m, ir.And):
      items = m.items
      if self.tables.same_runs:
        items = same_runs(m.items)
        if any(a is not b for a, b in zip(items, m.items)):
          self.tables.same_runs_used = True
      return _conjoin(xp, [self.truth(i) for i in items])
    if isinstance(m, ir.Or):
      parts = [self.truth(i) for i in m.items]
      neg = _conjoin(xp, [Truth3(FULL - p.state, p.certain) for p in parts])
      return Truth3(FULL - neg.state, neg.certain)
    if isinstance(m, ir.Xor):
      return self._xor([self.truth(i) for i in m.items])
    raise TypeError(f"cannot analyze mask {type(m).__name__}")

  def _link(self, op: str, lhs: ir.Term, rhs: ir.Term) -> Truth3:
    xp = self.xp
    a, b = self.term(lhs), self.term(rhs)
    independent = not (a.axes & b.axes)
    tight = _and(xp, independent, a.tight, b.tight)
    dense = _and(xp, independent, a.dense, b.dense)
    ok = _and(xp, True, a.ok, b.ok)
    # Compared end to end, never subtracted: `a.lo - b.hi` could leave the type.
    if op in ("==", "!="):
      eq_full = xp.logical_and(xp.logical_and(a.lo == a.hi, b.lo == b.hi), a.lo == b.lo)
      eq_empty = xp.logical_or(a.hi < b.lo, a.lo > b.hi)
      # Attained ends on independent axes: an end of one side equal to an end of the
      # other is a pair of equal values, and a side that is not one value has another
      # that differs from it, so a PARTIAL rectangle holds both.
      ends_meet = xp.logical_or(xp.logical_or(a.lo == b.lo, a.lo == b.hi),
                                xp.logical_or(a.hi == b.lo, a.hi == b.hi))
      certain = _or(xp, dense, _and(xp, True, tight, ends_meet))
      if (a.source is not None and a.source == b.source and independent):
        # Both sides read one nondecreasing operand over whole index ranges: the
        # value sets are the operand's values within [lo, hi], and they meet
        # exactly when the intervals overlap.
        certain = xp.logical_or(certain, self.tables.monotone(a.source[1])[self.b])
      state = xp.where(eq_full, FULL, xp.where(eq_empty, EMPTY, PARTIAL))
      if op == "!=":
        state = FULL - state
      return _unless_ok(xp, ok, state, certain)
    if op == "<":
      full, empty = a.hi < b.lo, a.lo >= b.hi
    elif op == "<=":
      full, empty = a.hi <= b.lo, a.lo > b.hi
    elif op == ">":
      full, empty = a.lo > b.hi, a.hi <= b.lo
    else:
      full, empty = a.lo >= b.hi, a.hi < b.lo
    return _unless_ok(xp, ok, xp.where(full, FULL, xp.where(empty, EMPTY, PARTIAL)), tight)

  def _operand_truth(self, r: ir.Term) -> Truth3:
    xp = self.xp
    if isinstance(r, ir.PairRead):
      qi, ki = self.term(r.q_index), self.term(r.k_index)
      blocks = self.tables.pair_blocks(r)
      if blocks is not None:  # aligned with the tiles: whole blocks, or no verdict
        state, aligned = blocks.verdict(self.b, qi.lo, qi.hi, ki.lo, ki.hi)
        return Truth3(state, _and(xp, True, aligned, qi.dense, ki.dense))
      p = self.tables.prefix(r.operand.name)
      rows, cols = p.shape[-2] - 1, p.shape[-1] - 1
      q0 = xp.clip(qi.lo, 0, rows - 1)
      q1 = xp.clip(qi.hi, 0, rows - 1) + 1
      k0 = xp.clip(ki.lo, 0, cols - 1)
      k1 = xp.clip(ki.hi, 0, cols - 1) + 1
      count = p[self.b, q1, k1] - p[self.b, q0, k1] - p[self.b, q1, k0] + p[self.b, q0, k0]
      area = (q1 - q0) * (k1 - k0)
      state = xp.where(count == 0, EMPTY, xp.where(count == area, FULL, PARTIAL))
      return Truth3(state, _and(xp, True, qi.dense, ki.dense))
    v = self.term(r)
    if v.ok is not True:
      t = self._operand_truth_known(v)
      return _unless_ok(xp, v.ok, t.state, t.certain)
    return self._operand_truth_known(v)

  def _operand_truth_known(self, v: Interval) -> Truth3:
    xp = self.xp
    all_nonzero = xp.logical_or(v.lo > 0, v.hi < 0)
    all_zero = xp.logical_and(v.lo == 0, v.hi == 0)
    state = xp.where(all_nonzero, FULL, xp.where(all_zero, EMPTY, PARTIAL))
    # min and max are attained; one of them is 0 or they straddle 0 without
    # proof that 0 occurs, unless the range is dense.
    certain = xp.logical_and(v.tight, xp.logical_or(xp.logical_or(v.lo == 0, v.hi == 0), v.dense))
    return Truth3(state, certain)

  def _xor(self, parts: list[Truth3]) -> Truth3:
    xp = self.xp
    state, certain = parts[0].state, parts[0].certain
    for p in parts[1:]:
      a_known = state != PARTIAL
      b_known = p.state != PARTIAL
      both = xp.logical_and(a_known, b_known)
      known_state = xp.where((state == FULL) != (p.state == FULL), FULL, EMPTY)
      new_state = xp.where(both, known_state, PARTIAL)
      new_certain = xp.where(a_known, p.certain, xp.where(b_known, certain, False))
      state, certain = new_state, new_certain
    return Truth3(state, certain)


_SAME_RUN = "same-run("  # static tables: `same-run(x)` holds the ids of x's runs of (non)zeros


def same_runs(items: tuple[ir.Mask, ...]) -> tuple[ir.Mask, ...]:
  """The items of an `&`, where `runs(x)[a] == runs(x)[b]` stands beside `x[a]`, with
  `runs(x)` in that equality replaced by ids of x's maximal runs of zeros and nonzeros.

  Beside `x[a]`, the two are equal at every position where the `&` can hold: with
  `x[a]` nonzero, `runs(x)[a]` is the index of a's run of nonzero values, so the
  equality says that b lies in that run, as equal new ids do; with `x[a]` zero the
  `&` is false either way. The analysis gains from it: `runs(x)` is 0 at every zero
  token, so a rectangle over several runs holds equal ids (0 == 0) on both sides and
  stays PARTIAL, while the new ids increase from run to run (a nondecreasing
  operand, as sorted segment ids), so rectangles over different runs are EMPTY at
  once. `bidirectional(img)` is this pattern. Static path only (`Tables.same_runs`:
  run tables).
  """
  out = []
  for i in items:
    name = next((n for w in items if (n := same_run_read(i, w)) is not None), None)
    if name is not None:
      same = ir.Operand(f"{_SAME_RUN}{name})")
      eq = cast(ir.Compare, i)  # `same_run_read`: a comparison of reads
      i = ir.Compare(tuple(ir.Read(same, cast(ir.Read, t).index) for t in eq.terms), eq.ops,
                     eq.span)
    out.append(i)
  return tuple(out)


def same_run_read(eq: ir.Mask, truth: ir.Mask) -> str | None:
  """x, when `eq` is `runs(x)[a] == runs(x)[b]` and `truth` is `x[a]` or `x[b]`: the pattern whose
  equality means "a and b lie in one run of x's nonzeros" wherever the `&` of the two holds
  (`same_runs`; `maskc.lowering.closed_forms.same_run_ids` on the traced path)."""
  if not (isinstance(eq, ir.Compare) and eq.ops == ("==",) and isinstance(truth, ir.Truth) and
          isinstance(truth.read, ir.Read) and not truth.read.runs and
          isinstance(truth.read.operand, ir.Operand)):
    return None
  name = truth.read.operand.name
  if all(isinstance(t, ir.Read) and t.runs and isinstance(t.operand, ir.Operand) and
         t.operand.name == name for t in eq.terms) and \
      truth.read.index in (t.index for t in eq.terms if isinstance(t, ir.Read)):
    return name
  return None


def _is_true(x) -> bool:
  return x is True


def _where(xp, cond, a, b):
  if cond is True:
    return a
  if cond is False:
    return b
  return xp.where(cond, a, b)


def _gt(xp, a, b):
  if isinstance(a, int) and isinstance(b, int):
    return a > b
  return xp.asarray(a) > b


def _ge(xp, a, b):
  if isinstance(a, int) and isinstance(b, int):
    return a >= b
  return xp.asarray(a) >= xp.asarray(b)


def _unless_ok(xp, ok, state, certain) -> Truth3:
  """The verdict where the compared bounds are known; PARTIAL, not certain, elsewhere."""
  if ok is True:
    return Truth3(state, certain)
  if ok is False:
    return Truth3(PARTIAL, False)
  return Truth3(xp.where(ok, state, PARTIAL), _and(xp, True, certain, ok))


def _or(xp, *flags):
  return _fold(xp.logical_or, False, flags)


def _and(xp, flag: bool, *flags):
  return _fold(xp.logical_and, True, flags) if flag else False


def _fold(op, unit: bool, flags):
  """`op` over flags that may be Python bools, which short-cut: `unit` drops out, its
  opposite decides, so constant verdicts stay Python bools (`x is True` tests)."""
  out = unit
  for a in flags:
    if a is unit:
      continue
    if a is (not unit):
      return not unit
    out = a if out is unit else op(out, a)
  return out


def _conjoin(xp, parts: list[Truth3]) -> Truth3:
  """Intersection: EMPTY if any is, FULL if all are; certain if one PARTIAL and the rest FULL."""
  state = parts[0].state
  partials = xp.asarray(parts[0].state == PARTIAL).astype(xp.int32)
  certain_partial = xp.logical_and(parts[0].state == PARTIAL, parts[0].certain)
  for p in parts[1:]:
    state = xp.minimum(state, p.state)
    partials = partials + (p.state == PARTIAL)
    certain_partial = xp.logical_or(certain_partial, xp.logical_and(p.state == PARTIAL, p.certain))
  certain = xp.logical_and(partials == 1, certain_partial)
  return Truth3(state, certain)


class _Reads(Mapping[str, Any]):
  """`Tables.reads`: operand arrays for evaluating a few pairs, nothing written out."""

  def __init__(self, tables: Tables):
    self.tables = tables

  def __getitem__(self, name: str) -> Any:
    arrays = self.tables.arrays
    if getattr(arrays, "written", lambda _: True)(name):
      return arrays[name]
    if len(self.tables.shape(name)) == 3:  # pairwise, as given
      return _WidenedReads(self.tables.raw(name))
    return _TokenReads(self.tables.run_table(name))

  def __iter__(self) -> Any:
    return iter(self.tables.arrays)

  def __len__(self) -> int:
    return len(self.tables.arrays)


class _TokenReads:
  """`a[row, idx]` of a per-token operand `a`, read from its run table (`values_at`)."""

  def __init__(self, table: RunTable):
    self.table = table
    self.shape = (table.batch, table.length)

  def __getitem__(self, at: tuple[Any, Any]) -> Any:
    return self.table.values_at(*at)


class _WidenedReads:
  """`a[at]` of an operand kept in its own dtype, widened to int64 as it is gathered."""

  def __init__(self, raw: Any):
    self.raw = raw
    self.shape = raw.shape

  def __getitem__(self, at: Any) -> Any:
    return np.asarray(self.raw[at]).astype(np.int64)
