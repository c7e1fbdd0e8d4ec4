"""Exact bounds of a mask's integer terms, to refuse evaluations that would wrap.

Evaluation computes integer terms in a fixed-width type: int64 with NumPy, int32
with jax.numpy (int64 when `jax_enable_x64` is on), int32 in the attention
kernels. A term that leaves that type wraps around silently and gives a wrong
mask. This module bounds every integer sub-term of a mask, with calls expanded,
by interval arithmetic over Python ints (exact, never wrapping) for one shape
and one set of operand values, so callers can either prove the fixed-width
evaluation exact or raise a `MaskValueError` before computing anything.

The bounds are conservative (`q - q` is bounded by the spread of `q`, not by
0), but they always contain every value a term takes. They need one pass over
each operand read (its minimum and maximum over the entries the read can
reach) and nothing per position. The module is independent of
`maskc.semantics.ranges`, which bounds terms per tile for lowering.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from maskc.language import ir
from maskc.language.errors import MaskValueError

Interval = tuple[int, int]
_MAX_QUOTED = 200  # characters of a term an error message quotes


def term_bounds(masks: Any, shape, arrays: dict[str, Any], batch: Any = None,
                forms: dict[str, Any] | None = None) -> tuple[int, int] | None:
  """The lowest and highest value any integer sub-term of `masks` takes, or None.

  Sub-terms are every integer node with calls expanded: positions, literals,
  scalar operands, operand reads, their indices, and each intermediate result
  of `+ - * // %`, `-t`, `abs`, `min`, `max`. Positions range over the shape
  (`q` in `[q_offset, q_offset + q_len - 1]`, `k` in `[0, kv_len - 1]`);
  reads range over the operand entries their (clipped) indices can reach.

  Args:
    masks: a mask or a sequence of masks.
    shape: a `maskc.semantics.shape.Shape`.
    arrays: operand arrays by name with a leading batch axis, and `"runs(x)"`
      run-id tables, as `maskc.semantics.operands.prepare_operands` returns them.
    batch: the batch rows evaluation reads (an int or an integer array, as in
      `maskc.semantics.evaluate.Env`), or None for every row. Rows only narrow the bounds;
      a traced or out-of-range value is treated as None.
    forms: the per-token operands in run form where known (as `check_fits`).

  Returns:
    `(lo, hi)` as Python ints, containing every value of every integer sub-term
    (conservatively, by interval arithmetic); `(0, 0)` for a mask with no
    integer terms. None when a term depends on a traced `q_offset` or a traced
    operand, whose values are unknown at trace time. (A `runs(x)` table is
    bounded by its length alone, so it is known even when `x` is traced.)
  """
  return _hull(bounds for _, bounds in _sub_terms(masks, shape, arrays, batch, forms))


def _hull(all_bounds) -> tuple[int, int] | None:
  """`(lo, hi)` containing 0 and every `(lo, hi)` of `all_bounds`; None if one is None."""
  lo = hi = 0
  for bounds in all_bounds:
    if bounds is None:
      return None
    lo, hi = min(lo, bounds[0]), max(hi, bounds[1])
  return lo, hi


def check_fits(masks: Any, shape, arrays: Mapping[str, Any], *, bits: int, what: str,
               hint: str | None = None, batch: Any = None,
               forms: dict[str, Any] | None = None) -> tuple[int, int] | None:
  """Raises `MaskValueError` when a known integer sub-term can leave the signed `bits`-bit type.

  Returns what `term_bounds` would for the same arguments (from the same pass): the
  bounds of every integer sub-term, or None where one is unknown.

  Terms whose bounds are unknown (they depend on a traced offset or operand)
  are not checked; every other term is, so literals and a static offset are
  checked even when an operand is traced. The error names the first such term
  in evaluation order (the innermost one that leaves the type) with its range.

  Args:
    masks, shape, arrays, batch: as for `term_bounds`.
    bits: the width of the signed integer type evaluation computes in.
    what: who computes, for the message, e.g. "the jax.numpy evaluation".
    hint: what the user can do; a default suggests renumbering and smaller
      literals or offsets.
    forms: per-token operands (and run ids) in run form (`maskc.semantics.operand_runs.RunForm`)
      where binding has them: reads over whole rows are bounded by their runs'
      values instead of a pass over the tokens.
  """
  lo_type, hi_type = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
  seen = []
  for node, bounds in _sub_terms(masks, shape, arrays, batch, forms):
    seen.append(bounds)
    if bounds is None or (lo_type <= bounds[0] and bounds[1] <= hi_type):
      continue
    text = str(node)
    if len(text) > _MAX_QUOTED:
      text = text[:_MAX_QUOTED - 3] + "..."
    raise MaskValueError(
        f"the term `{text}` takes values in [{bounds[0]}, {bounds[1]}] at this shape and these "
        f"operands, outside the {bits}-bit integers [{lo_type}, {hi_type}] that {what} "
        f"computes in, so it would wrap around",
        hint=hint or "Renumber operand ids to a smaller range (e.g. `np.unique(seg, "
                     "return_inverse=True)[1]`), use smaller literals, or a smaller q_offset.")
  return _hull(seen)


# ----------------------------------------------------------------------------- intervals


def _sub_terms(masks: Any, shape, arrays: Mapping[str, Any], batch: Any,
               forms: dict[str, Any] | None = None) -> Iterator[tuple[ir.Node, Interval | None]]:
  """Each distinct integer sub-term (post-order) with its bounds, None when unknown."""
  if isinstance(masks, ir.Node):
    masks = [masks]
  ctx = _Context(shape, arrays, batch, forms)
  out: list[tuple[ir.Node, Interval | None]] = []
  for m in masks:
    ctx.visit(m, out)
  return iter(out)


def _rows(batch: Any, size: int) -> Any:
  """A NumPy index for the batch rows to bound, or `slice(None)` for all of them."""
  if batch is None or size == 1 or isinstance(batch, jax.core.Tracer):
    return slice(None)
  rows = np.asarray(batch).reshape(-1)
  if rows.size == 0 or not np.issubdtype(rows.dtype, np.integer) or rows.min() < 0 or \
      rows.max() >= size:
    return slice(None)
  return np.unique(rows)


class _Context:
  """Interval evaluation of one mask family at one shape, memoized by node identity."""

  def __init__(self, shape, arrays: Mapping[str, Any], batch: Any,
               forms: dict[str, Any] | None = None):
    self.arrays, self.batch, self.forms = arrays, batch, forms or {}
    offset = shape.q_offset
    self.q: Interval | None = (None if isinstance(offset, jax.core.Tracer) else
                               (int(offset), int(offset) + shape.q_len - 1))
    self.k: Interval | None = (0, shape.kv_len - 1)
    # Explicit positions (`q_positions`, `kv_positions`) range over their own values.
    for side, pos, hull in (("q", getattr(shape, "q_positions", None), "q_hull"),
                            ("k", getattr(shape, "kv_positions", None), "k_hull")):
      if pos is not None:
        bounds = None if isinstance(pos, jax.core.Tracer) else getattr(shape, hull)()
        setattr(self, side, None if bounds is None else (int(bounds[0]), int(bounds[1])))
    self.memo = ir.NodeMemo()  # node -> Interval | None
    self.extremes: dict[tuple, Interval | None] = {}  # (operand, reachable slices) -> bounds

  def visit(self, n: ir.Node, out: list) -> Interval | None:
    if n in self.memo:
      return self.memo[n]
    if isinstance(n, ir.Call):
      self.visit(ir.expand(n), out)
      self.memo[n] = None
      return None
    if isinstance(n, ir.Mask) and not isinstance(n, ir.Param):
      for c in n.children():
        self.visit(c, out)
      self.memo[n] = None
      return None
    children = {id(c): self.visit(c, out) for c in n.children() if not isinstance(c, ir.Operand)}
    bounds = self._term(n, children)
    self.memo[n] = bounds
    out.append((n, bounds))
    return bounds

  def _term(self, n: ir.Node, child: dict[int, Interval | None]) -> Interval | None:
    if isinstance(n, ir.Const):
      return n.value, n.value
    if isinstance(n, ir.Pos):
      return self.q if n.axis == "q" else self.k
    if isinstance(n, ir.Scalar):
      return self._values(n.name, ())
    if isinstance(n, ir.Read):
      name = ir.array_key(n)
      return self._values(name, (child[id(n.index)],))
    if isinstance(n, ir.PairRead):
      return self._values(n.operand.name, (child[id(n.q_index)], child[id(n.k_index)]))
    args = [a for a in (child[id(c)] for c in n.children()) if a is not None]
    if len(args) < len(n.children()):  # a child without bounds
      return None
    if isinstance(n, ir.Neg):
      (lo, hi), = args
      return -hi, -lo
    if isinstance(n, ir.Arith):
      return _arith(n.op, args[0], args[1])
    if isinstance(n, ir.Fn):
      if n.name == "abs":
        (lo, hi), = args
        if lo >= 0:
          return lo, hi
        if hi <= 0:
          return -hi, -lo
        return 0, max(-lo, hi)
      f = min if n.name == "min" else max
      return f(a[0] for a in args), f(a[1] for a in args)
    raise TypeError(f"cannot bound {type(n).__name__}")

  def _values(self, name: str, index: Sequence[Interval | None]) -> Interval | None:
    """Bounds of an operand's entries at (clipped) indices in the given intervals."""
    form = self.forms.get(name)  # a per-token operand's runs: its tokens need not be written out
    arr = None if form is not None or name not in self.arrays else _raw(self.arrays, name)
    shape: tuple[int, ...]
    if form is not None:
      shape = (form.batch, form.length)
    elif arr is not None:
      shape = tuple(arr.shape)
    else:
      return None
    length = shape[-1] if len(shape) > 1 else 1
    if ir.is_run_ids_key(name) and isinstance(arr, jax.core.Tracer):
      return 0, (length + 1) // 2
    if isinstance(arr, jax.core.Tracer) or 0 in shape:
      return None
    sel: list[Any] = [_rows(self.batch, shape[0])]
    for axis, iv in zip(range(1, len(shape)), index):
      n = shape[axis]
      if iv is None:
        sel.append(slice(None))
      else:
        lo, hi = (min(max(v, 0), n - 1) for v in iv)
        sel.append(slice(lo, hi + 1))
    if arr is not None and arr.dtype == bool and len(shape) == 3:  # pairwise: its type's bounds,
      # with no pass over it (a per-token one's values, over the indices read, are cheap)
      return 0, 1
    key = (name, tuple((s.start, s.stop) if isinstance(s, slice) else s.tobytes() for s in sel))
    if key not in self.extremes:
      if form is not None:  # the runs' values: one per run, not per token
        part = form.values_in(None if isinstance(sel[0], slice) else sel[0],
                              sel[1].start or 0, shape[1] if sel[1].stop is None else sel[1].stop)
      else:
        part = np.asarray(arr)[tuple(sel)]
      self.extremes[key] = None if part.size == 0 else (int(part.min()), int(part.max()))
    return self.extremes[key]


def _arith(op: str, a: Interval, b: Interval) -> Interval:
  (al, ah), (bl, bh) = a, b
  if op == "+":
    return al + bl, ah + bh
  if op == "-":
    return al - bh, ah - bl
  if op == "*":
    corners = (al * bl, al * bh, ah * bl, ah * bh)
    return min(corners), max(corners)
  if op == "//":
    if bl <= 0 <= bh:  # a divisor that can be 0 is never built; bound by |a| to stay sound
      m = max(abs(al), abs(ah))
      return -m, m
    corners = (al // bl, al // bh, ah // bl, ah // bh)
    return min(corners), max(corners)
  # `%`: exact for a constant divisor whose quotient is the same over the whole range.
  if bl == bh and bl != 0:
    c = bl
    if al // c == ah // c:
      f = al // c
      return al - c * f, ah - c * f
    return (0, c - 1) if c > 0 else (c + 1, 0)
  m = max(abs(bl), abs(bh))
  return -m, m


def _raw(arrays: Any, name: str) -> Any:
  """Operand `name` in its own dtype where it is kept so (a static pairwise operand), without
  widening it (`maskc.semantics.operand_arrays.OperandArrays.raw`)."""
  raw = getattr(arrays, "raw", None)
  return raw(name) if raw is not None else arrays[name]
