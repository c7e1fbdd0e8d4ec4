"""Operands checked against a mask and normalized: `prepare_operands`.

Operands are checked here once, against the kinds the mask reads and the positions it
reads them at, so evaluation never indexes out of bounds and no integer term leaves
the type it is computed in (`maskc.semantics.overflow`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from maskc.language import ir
from maskc.language.errors import MaskValueError, OperandError, nearest
from maskc.semantics.evaluate import Env, evaluate
from maskc.semantics.integers import NUMPY_BITS, is_traced, jax_int, jax_int_bits, runs_of
from maskc.semantics.operand_arrays import OperandArrays, Unwritten
from maskc.semantics.operand_runs import RunForm
from maskc.semantics.overflow import check_fits
from maskc.semantics.ranges import Analyzer, Tables
from maskc.semantics.shape import Shape


def _digest(a: np.ndarray) -> bytes:
  """A digest of an array's bytes (SHA-256, hardware-accelerated on common CPUs): cache keys
  hold it instead of a copy of the array."""
  return hashlib.sha256(np.ascontiguousarray(a).data.cast("B"),
                        usedforsecurity=False).digest()



_EXPECT = {"scalar": "[] or [B]", "token": "[L] or [B, L]", "pair": "[Lq, Lk] or [B, Lq, Lk]"}
_NDIM = {"scalar": 0, "token": 1, "pair": 2}


@dataclasses.dataclass
class Operands:
  """Operands checked against a mask and normalized to a leading batch axis.

  Attributes:
    arrays: by name (and `"runs(x)"` for each `runs(x)` read), batch axis first; static
      per-token ones are written out from their runs when first read.
    batch: the batch size, or None when no operand has a batch axis.
    xp: `numpy` when every operand is static, else `jax.numpy`.
    int_range: the bounds of every integer sub-term of the mask they were checked
      against (`maskc.semantics.overflow.term_bounds`), or None where one is unknown (traced).
  """
  arrays: OperandArrays
  batch: int | None
  xp: Any
  forms: dict[str, RunForm] = dataclasses.field(default_factory=dict)
  int_range: tuple[int, int] | None = None

  def static_bytes(self) -> tuple[tuple[str, tuple[int, ...], str, bytes], ...]:
    """A hashable digest of static operand values, for caches.

    A per-token operand is digested in run form (its runs determine it), which
    costs the number of runs rather than the number of tokens.
    """
    def digest(n: str) -> bytes:
      return self.forms[n].digest() if n in self.forms else _digest(self.arrays[n])
    return tuple(sorted((n, self.arrays.shape(n), str(self.arrays.dtype(n)), digest(n))
                        for n in self.arrays if not ir.is_run_ids_key(n)))


def prepare_operands(m: ir.Mask, shape: Shape, operands: Mapping[str, Any] | None,
                     *, allow_traced: bool = True, xp: ModuleType | None = None) -> Operands:
  """Checks `operands` against what `m` reads at `shape` and normalizes them.

  Integer terms are computed in one wide type: int64 on the NumPy path, the
  jax.numpy path's type (int32, or int64 with `jax_enable_x64`) otherwise.
  Everything known here is checked so that the evaluation is exact:

  - static operand values must fit that type (`OperandError`);
  - a definition's `where` requirements on a runtime scalar argument
    (`sliding(n)`, `sink(n)`) hold for a static `n` (`MaskValueError` with the
    requirement's message);
  - every integer sub-term (positions, literals, reads, products, ...) stays in
    that type over the shape and the static operand values (`MaskValueError`
    naming the term and its range; see `maskc.semantics.overflow`);
  - reads stay inside their operands (`OperandError`).

  Values traced under `jit` cannot be checked at trace time. A traced operand is
  converted to the jax.numpy path's type (so a traced uint32 id of 2**31 or
  more wraps to a negative one; `==` and `!=` between such ids stay exact, as
  comparisons subtract nothing), a term built from traced values may wrap if
  its values leave that type, and a traced scalar that breaks a `where`
  requirement is used as given: the definition's body is computed literally
  (`sliding(n)` with `n = 0` is empty, `sink(n)` with `n < 0` allows no key).
  The static parts (literals, a static offset, static operands) are checked
  all the same.
  """
  operands = dict(operands or {})
  specs = m.operands
  traced = any(is_traced(operands.get(s.name)) for s in specs)
  if traced and not allow_traced:
    raise OperandError("this needs static operand values (NumPy arrays or ints), got JAX arrays",
                       hint="Use `maskc.materialize` or `maskc.compile` under jit for traced "
                            "operands.")
  xp = xp or (jnp if traced else np)
  bits = NUMPY_BITS if xp is np else jax_int_bits()
  lo_type, hi_type = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
  arrays: dict[str, Any] = {}
  forms: dict[str, RunForm] = {}
  batch: int | None = None
  batch_from = None
  for spec in specs:
    if spec.name not in operands:
      raise _missing(spec, operands, specs)
    value = operands[spec.name]
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and \
        spec.kind == "scalar":
      if not lo_type <= int(value) <= hi_type:
        raise _outside_type(spec.name, bits, xp)
      value = np.asarray(value)
    if not is_traced(value):
      value = np.asarray(value)
    dtype = value.dtype
    if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_)):
      raise OperandError(f"operand `{spec.name}` must hold integers or booleans, got {dtype}",
                         hint="Cast it: `seg.astype(np.int32)`.")
    nd = _NDIM[spec.kind]
    if value.ndim not in (nd, nd + 1):
      raise OperandError(
          f"operand `{spec.name}` has shape {tuple(value.shape)}; as a {spec.kind} operand it "
          f"must have shape {_EXPECT[spec.kind]}")
    if value.ndim == nd + 1:
      b = int(value.shape[0])
      if batch is not None and b != batch:
        raise OperandError(
            f"operands disagree on the batch size: `{batch_from}` has {batch}, "
            f"`{spec.name}` has {b}", hint="Give every batched operand the same leading size.")
      batch, batch_from = b, spec.name
    else:
      value = value[None]
    # Integer terms are computed in one wide type (int64, or int32 under jit), never in
    # an operand's own narrow dtype, where `seg[q] - seg[k]` would wrap around.
    if xp is np and spec.kind == "token":  # runs: one pass, then min and max over the runs
      forms[spec.name] = RunForm.of(value)
      extremes = value.reshape(-1)[forms[spec.name].starts]  # in its own dtype (uint64)
    else:
      extremes = None if isinstance(value, jax.core.Tracer) else value
    if extremes is not None and extremes.size and \
        (int(extremes.min()) < lo_type or int(extremes.max()) > hi_type):
      raise _outside_type(spec.name, bits, xp)
    if xp is jnp:
      value = jnp.asarray(value).astype(jax_int())
    elif spec.name in forms:  # written out from its runs (a copy) when first read
      value = _unwritten(forms[spec.name])
    else:
      value = value.astype(np.int64)
    arrays[spec.name] = value
  has_reads = False
  for n in ir.walk(m):
    if isinstance(n, (ir.Read, ir.PairRead)):
      has_reads = True
    if isinstance(n, ir.Read) and n.runs:
      key = ir.run_ids_key(n.operand.name)
      if key in arrays:
        continue
      if n.operand.name in forms:
        forms[key] = forms[n.operand.name].run_ids()
        arrays[key] = _unwritten(forms[key])
      else:
        arrays[key] = runs_of(xp, arrays[n.operand.name])
  prepared = OperandArrays(arrays)
  check_requirements(m, prepared, batch)
  what = "the NumPy evaluation" if xp is np else "the jax.numpy evaluation"
  int_range = check_fits(m, shape, prepared, bits=bits, what=what, hint=overflow_hint(xp),
                         forms=forms)
  result = Operands(prepared, batch, xp, forms, int_range)
  if has_reads:
    _check_reads(m, shape, result)
  return result


def _missing(spec: ir.OperandSpec, operands: Mapping[str, Any],
             specs: tuple[ir.OperandSpec, ...]) -> OperandError:
  """The error for an operand the mask reads but the call does not give, with the given
  name it most likely meant (`operands={"segs": ...}` for `seg`)."""
  read = {s.name for s in specs}
  guess = nearest(spec.name, [n for n in operands if isinstance(n, str) and n not in read])
  given = f"; `{guess}` was given, which the mask does not read" if guess else ""
  hint = f"Pass operands={{'{spec.name}': ...}}."
  if guess:
    hint = f"Did you mean `{spec.name}` where you wrote `{guess}`? " + hint
  return OperandError(f"missing operand `{spec.name}`: the mask reads it as a {spec.kind} "
                      f"operand of shape {_EXPECT[spec.kind]}{given}", hint=hint)


def _unwritten(form: RunForm) -> Unwritten:
  """A per-token operand written out from its runs (in int64) when first read."""
  return Unwritten((form.batch, form.length), np.dtype(np.int64),
                   lambda: form.to_array(np.int64))


def overflow_hint(xp: ModuleType) -> str:
  hint = ("Renumber operand ids to a smaller range (e.g. `np.unique(seg, return_inverse=True)"
          "[1]`), use smaller literals, or a smaller q_offset")
  if xp is not np and jax_int_bits() == 32:
    hint += ("; or enable `jax.config.update('jax_enable_x64', True)` so the jax.numpy path "
             "computes in int64, or pass NumPy operands and a static offset (int64)")
  return hint + "."


def _outside_type(name: str, bits: int, xp: ModuleType) -> OperandError:
  where = "NumPy computes in" if xp is np else \
      "JAX computes in" + (" (with jax_enable_x64 off)" if bits == 32 else "")
  hint = "Renumber the values to fit in int32." if bits == 32 else \
      "Renumber the values to fit in int64."
  return OperandError(f"operand `{name}` holds values outside int{bits}, which {where}",
                      hint=hint)


def check_requirements(m: ir.Mask, arrays: Mapping[str, Any], batch: int | None) -> None:
  """Checks the `where` requirements of calls whose arguments are static runtime scalars.

  The parser checks requirements on literal arguments (`sliding(0)` is refused
  as text); `sliding(n)` with an operand `n` can only be checked here, with the
  value of `n` (each batch row), exactly (Python ints). Requirements that
  depend on a traced scalar are not checked (see `prepare_operands`).

  Raises:
    MaskValueError: with the requirement's message, the call and the values.
  """
  for c, requirement, message, req, names in _scalar_requirements(m):
    if any(n not in arrays or isinstance(arrays[n], jax.core.Tracer) for n in names):
      continue
    exact = {n: np.asarray(arrays[n]).astype(object) for n in names}
    rows = np.arange(batch) if batch is not None else 0
    ok = np.asarray(evaluate(req, Env(np, 0, 0, exact, rows)), dtype=bool).reshape(-1)
    if ok.all():
      continue
    row = int(np.argmin(ok))
    values = ", ".join(
        f"{n} = {exact[n][row if exact[n].shape[0] > 1 else 0]}" for n in names)
    shown = f"{c.name}({', '.join(ir.arg_text(a) for a in c.args)})"
    at = f" in batch row {row}" if batch is not None else ""
    raise MaskValueError(f"{message}, got {shown} with {values}{at}",
                         hint=f"`{c.definition.name}` requires `{requirement}`; pass "
                              f"{'values' if batch is not None else 'a value'} that "
                              f"satisfy it.")


@functools.lru_cache(maxsize=1024)
def _scalar_requirements(
    m: ir.Mask) -> tuple[tuple[ir.Call, ir.Mask, str, ir.Node, list[str]], ...]:
  """`(call, requirement, message, instantiated requirement, scalar names)` of every `where`
  requirement in `m` that depends on scalar operands alone: what `check_requirements`
  evaluates, found once per mask."""
  found = []
  for c in ir.walk(m):
    if not isinstance(c, ir.Call) or not c.definition.requirements:
      continue
    env = dict(zip(c.definition.params, c.args))
    for requirement, message in c.definition.requirements:
      req = ir.instantiate(requirement, env)
      if ir.const_truth(req) is not None or ir.positions_of(req):
        continue
      nodes = list(ir.walk(req))
      if any(isinstance(n, (ir.Read, ir.PairRead)) for n in nodes):
        continue
      names = sorted({n.name for n in nodes if isinstance(n, ir.Scalar)})
      if names:
        found.append((c, requirement, message, req, names))
  return tuple(found)


# `(index, operand, axis of the operand it indexes, which index for messages)`
_ReadCheck = tuple[ir.Term, str, int, str]


@functools.lru_cache(maxsize=1024)
def _reads_of(m: ir.Mask) -> tuple[tuple[ir.Node, tuple[_ReadCheck, ...]], ...]:
  """Each read of `m` with the checks `_check_reads` makes of it: `(index, operand, axis of
  the operand it indexes, which index for messages)`, found once per mask."""
  reads: list[tuple[ir.Node, tuple[_ReadCheck, ...]]] = []
  for n in ir.walk(m):
    if isinstance(n, ir.Read):
      reads.append((n, ((n.index, n.operand.name, -1, ""),)))
    elif isinstance(n, ir.PairRead):
      reads.append((n, ((n.q_index, n.operand.name, -2, "first "),
                        (n.k_index, n.operand.name, -1, "second "))))
  return tuple(reads)


@functools.lru_cache(maxsize=1024)
def _position_indices(m: ir.Mask) -> bool:
  """Whether every index `m` reads at is arithmetic of positions and literals alone."""
  return all(not any(isinstance(x, (ir.Read, ir.PairRead, ir.Scalar, ir.Operand))
                     for x in ir.walk(index))
             for _, checks in _reads_of(m) for index, _, _, _ in checks)


def _check_reads(m: ir.Mask, shape: Shape, ops: Operands) -> None:
  """Raises when a read would index an operand outside its length.

  The bounds of each index come from range analysis over the whole shape (one
  rectangle: no per-token array). Only when those bounds are not attained
  (`tight`) and leave the operand are the indices evaluated, in chunks.
  """
  if not shape.static:
    return
  scalars = {n: ops.arrays[n] for n in ops.arrays if len(ops.arrays.shape(n)) == 1}
  if any(is_traced(a) for a in scalars.values()):
    return
  lengths = tuple(ops.arrays.shape(name)[axis]
                  for _, checks in _reads_of(m) for _, name, axis, _ in checks)
  if not shape.has_positions and _position_indices(m):
    _position_reads_fit(m, shape.q_len, shape.kv_len, int(shape.q_offset), lengths)
  else:
    _reads_fit(m, shape, lengths, scalars, np.arange(ops.batch) if ops.batch else 0)


@functools.lru_cache(maxsize=256)
def _position_reads_fit(m: ir.Mask, q_len: int, kv_len: int, q_offset: int,
                        lengths: tuple[int, ...]) -> bool:
  """`_reads_fit` where every index is arithmetic of positions and literals at consecutive
  positions: the verdict follows from the shape and the operands' lengths alone, so it is
  remembered once it passes (a read outside raises, and raises again next time)."""
  _reads_fit(m, Shape.of(q_len, kv_len, q_offset), lengths, {}, 0)
  return True


def _reads_fit(m: ir.Mask, shape: Shape, lengths: tuple[int, ...], scalars: dict[str, Any],
               batch: Any) -> None:
  """`_check_reads` of `m`'s reads (`_reads_of`, in order) into operands of `lengths` on the
  axes they index, with static `scalars` for batch rows `batch`."""
  (q0, q1), (k0, k1) = shape.q_hull(), shape.k_hull()
  analyzer = Analyzer(np, Tables(np, scalars), q0, q1, k0, k1, batch)
  checks = [(n,) + c for n, cs in _reads_of(m) for c in cs]
  for (n, index, name, _axis, which), length in zip(checks, lengths):
    axes = ir.positions_of(index)
    bounds = _index_bounds(analyzer, index)
    if bounds is not None and bounds[0] >= 0 and bounds[1] < length:
      continue  # sound bounds inside the operand: every index is
    if bounds is None or not bounds[2] or shape.has_positions:  # the exact range, in chunks
      lo, hi = _evaluated_bounds(index, shape, axes, scalars, batch)
    else:
      lo, hi = bounds[0], bounds[1]
    if lo < 0 or hi >= length:
      where = (f"positions q in [{q0}, {q1}]" if "q" in axes
               else f"positions k in [{k0}, {k1}]")
      raise OperandError(
          f"operand `{name}` has length {length} on its {which}axis, but the mask reads "
          f"`{n}` at indices {lo}..{hi} (for {where})",
          hint=f"Give `{name}` at least {hi + 1} entries on that axis"
               if lo >= 0 else "Indices below 0 cannot be read; check the offset.")


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
                      scalars: dict[str, Any], batch: Any,
                      chunk: int = 1 << 20) -> tuple[int, int]:
  """Exact min and max of an index over the positions of its axis, evaluated in chunks."""
  every = shape.rows(np) if "q" in axes else shape.cols(np)
  n = every.shape[-1]
  lo, hi = None, None
  b = batch[:, None] if not np.isscalar(batch) else 0
  if every.shape[0] > 1 and np.isscalar(batch):
    b = np.zeros((every.shape[0], 1), np.int64)
  for s0 in range(0, n, chunk):
    pos = every[:, s0:s0 + chunk]
    values = np.asarray(evaluate(index, Env(np, pos, pos, scalars, b)))
    lo = int(values.min()) if lo is None else min(lo, int(values.min()))
    hi = int(values.max()) if hi is None else max(hi, int(values.max()))
  return cast(int, lo), cast(int, hi)  # not None: the lengths are positive
