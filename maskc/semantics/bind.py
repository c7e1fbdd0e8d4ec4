"""Binding a mask to a shape and operands: `ComputableMask`, `materialize`, `additive_bias`.

Positions follow docs/design.md ("Positions"): row `i` has `q = q_offset + i`, column `j` has
`k = j`, and `q_offset` defaults to `kv_len - q_len` (bottom-right alignment).
Operands are checked here once, against the kinds the mask reads and the
positions it reads them at, so evaluation never indexes out of bounds.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as _splash
from jax.typing import ArrayLike, DTypeLike

from maskc.arrays.bit_words import count_through
from maskc.language import ir
from maskc.language.errors import MaskLimitError, MaskTypeError, MaskValueError, OperandError
from maskc.language.parse import parse
from maskc.semantics.evaluate import Env, evaluate, evaluate_mask
from maskc.semantics.operand_arrays import OperandArrays, Unwritten
from maskc.semantics.operand_runs import RunForm
from maskc.semantics.overflow import check_fits
from maskc.semantics.ranges import Analyzer, Tables

MaskLike = ir.Mask | str
MasksLike = MaskLike | Sequence[MaskLike]  # one mask, or one per head (`maskc.MaskLike`)
MAX_DENSE_ELEMENTS = 1 << 32
MAX_DENSE_LENGTH = (1 << 31) - 1  # the longest q_len or kv_len a dense mask may have
_DENSE_CHUNK = 1 << 22  # elements a NumPy dense evaluation computes at once
NUMPY_BITS = 64


def as_mask(mask: Any) -> ir.Mask:
  """A `Mask` from a mask or its text."""
  if isinstance(mask, ir.Mask):
    return mask
  if isinstance(mask, str):
    return parse(mask)
  raise MaskTypeError(f"expected a mask or mask text, got {type(mask).__name__}",
                      hint='Pass `maskc.parse("causal")`, `maskc.causal()` or "causal".')


def _int(name: str, value: Any, *, minimum: int | None = None) -> int:
  try:
    v = operator.index(value)
  except TypeError:
    raise MaskTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
  if minimum is not None and v < minimum:
    bound = "positive" if minimum == 1 else f">= {minimum}"
    raise MaskValueError(f"{name} must be {bound}, got {name}={v}")
  return v


@dataclasses.dataclass(frozen=True)
class Shape:
  """A mask's shape and the positions of its rows and columns.

  Row `i` is query position `q_positions[..., i]` when positions are given, else
  `q_offset + i`; column `j` is key position `kv_positions[..., j]`, else `j`.
  Given positions are stored as `[B', L]` integer arrays (`B'` is 1 without a
  batch axis): int64 NumPy when static, int32 jax arrays when traced.
  """
  q_len: int
  kv_len: int
  q_offset: Any  # int, or a traced scalar under jit
  q_positions: Any = None
  kv_positions: Any = None

  @staticmethod
  def of(q_len: Any, kv_len: Any = None, q_offset: Any = None, *, q_positions: Any = None,
         kv_positions: Any = None) -> Shape:
    q_len = _int("q_len", q_len, minimum=1)
    kv_len = q_len if kv_len is None else _int("kv_len", kv_len, minimum=1)
    if q_positions is not None and q_offset is not None:
      raise MaskValueError("both q_offset and q_positions were given",
                           hint="Pass q_positions = q_offset + arange(q_len) instead.")
    if q_offset is None:
      q_offset = kv_len - q_len
    elif not isinstance(q_offset, jax.core.Tracer):
      q_offset = _int("q_offset", q_offset)
    return Shape(q_len, kv_len, q_offset, _positions("q_positions", q_positions, q_len),
                 _positions("kv_positions", kv_positions, kv_len))

  @property
  def static(self) -> bool:
    return not any(isinstance(x, jax.core.Tracer)
                   for x in (self.q_offset, self.q_positions, self.kv_positions))

  @property
  def has_positions(self) -> bool:
    """Whether explicit positions were given for the rows or the columns."""
    return self.q_positions is not None or self.kv_positions is not None

  @property
  def positions_batch(self) -> int | None:
    """The batch size of batched (`[B, L]`) positions, else None."""
    sizes = {int(p.shape[0]) for p in (self.q_positions, self.kv_positions)
             if p is not None and p.shape[0] > 1}
    if len(sizes) > 1:
      raise MaskValueError(f"q_positions and kv_positions disagree on the batch size: "
                           f"{sorted(sizes)}")
    return sizes.pop() if sizes else None

  def rows(self, xp: ModuleType, dtype: DTypeLike | None = None) -> Any:
    """Query positions of every row, `[B', q_len]`."""
    if self.q_positions is not None:
      return self.q_positions if dtype is None else self.q_positions.astype(dtype)
    dtype = dtype or (np.int64 if xp is np else jnp.int32)
    return (xp.arange(self.q_len, dtype=dtype) + xp.asarray(self.q_offset, dtype))[None]

  def cols(self, xp: ModuleType, dtype: DTypeLike | None = None) -> Any:
    """Key positions of every column, `[B', kv_len]`."""
    if self.kv_positions is not None:
      return self.kv_positions if dtype is None else self.kv_positions.astype(dtype)
    return xp.arange(self.kv_len, dtype=dtype or (np.int64 if xp is np else jnp.int32))[None]

  def q_hull(self) -> tuple[int, int]:
    """Static smallest and largest query position."""
    if self.q_positions is None:
      return self.q_offset, self.q_offset + self.q_len - 1
    return int(self.q_positions.min()), int(self.q_positions.max())

  def k_hull(self) -> tuple[int, int]:
    """Static smallest and largest key position."""
    if self.kv_positions is None:
      return 0, self.kv_len - 1
    return int(self.kv_positions.min()), int(self.kv_positions.max())


def _positions(name: str, value: Any, length: int) -> Any:
  """Checked positions `[L]` or `[B, L]` as `[B', L]`: int64 NumPy, or int32 when traced."""
  if value is None:
    return None
  traced = isinstance(value, jax.core.Tracer)
  arr = value if traced else np.asarray(value)
  if not (jnp.issubdtype(arr.dtype, jnp.integer)):
    raise MaskTypeError(f"{name} must hold integers, got {arr.dtype}",
                        hint=f"Cast it: `{name}.astype(np.int32)`.")
  if arr.ndim not in (1, 2) or arr.shape[-1] != length:
    raise MaskValueError(f"{name} has shape {tuple(arr.shape)}; it must be [{length}] or "
                         f"[B, {length}], one position per row or column")
  if traced:
    return jnp.asarray(arr, jnp.int32).reshape((-1, length))
  if arr.size and (arr.min() < -2**62 or arr.max() >= 2**62):
    raise MaskValueError(f"{name} holds positions beyond +-2**62",
                         hint="Renumber the positions to fit in int64 with room to compute.")
  return arr.astype(np.int64).reshape((-1, length))


def _digest(a: np.ndarray) -> bytes:
  """A digest of an array's bytes (SHA-256, hardware-accelerated on common CPUs): cache keys
  hold it instead of a copy of the array."""
  return hashlib.sha256(np.ascontiguousarray(a).data.cast("B"),
                        usedforsecurity=False).digest()


def is_traced(value: Any) -> bool:
  """Whether `value` is a JAX array (concrete or traced) rather than static data."""
  return isinstance(value, jax.Array)


def jax_int_bits() -> int:
  """The width of the integers the jax.numpy path computes in: 64 with `jax_enable_x64`, else 32."""
  # jax's config sets its options as attributes at runtime: the read follows `jax.enable_x64`.
  return 64 if jax.config.jax_enable_x64 else 32  # type: ignore[attr-defined]


def jax_int() -> Any:
  """The integer dtype of the jax.numpy path (see `jax_int_bits`)."""
  return jnp.int64 if jax_int_bits() == 64 else jnp.int32


def runs_of(xp: ModuleType, x: Any, dtype: DTypeLike | None = None) -> Any:
  """`runs(x)` along the last axis: 1-based index of each run of true values, 0 outside.

  Run ids are at most `(L + 1) // 2`; they are int64 with NumPy (the type the
  NumPy path computes in, so `runs(g)[q] + 2147483648` cannot overflow) and the
  jax.numpy path's integer type otherwise, unless `dtype` says.
  """
  dtype = dtype or (np.int64 if xp is np else jax_int())
  if xp is np:
    return _runs_of_numpy(np.asarray(x), dtype)
  x, starts = nonzero_run_starts(xp, x)
  return xp.where(x, count_through(xp, starts, dtype), 0).astype(dtype)


def nonzero_run_starts(xp: ModuleType, x: Any) -> tuple[Any, Any]:
  """`(x != 0, starts)`: where x is nonzero, and where a run of nonzeros starts, along the
  last axis (array form; a prefix sum of the starts numbers the runs)."""
  x = x != 0
  prev = xp.concatenate([xp.zeros_like(x[..., :1]), x[..., :-1]], axis=-1)
  return x, xp.logical_and(x, xp.logical_not(prev))


def _runs_of_numpy(x: np.ndarray, dtype: DTypeLike) -> np.ndarray:
  """`runs_of` from the runs of `x`: memory and time follow the output, not a cumsum's
  temporaries."""
  shape = x.shape
  if x.size == 0:
    return np.zeros(shape, dtype)
  flat = (x != 0).reshape(-1, shape[-1]) if x.ndim else (x != 0).reshape(1, 1)
  return RunForm.of(flat).run_ids().to_array(dtype).reshape(shape)


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
      raise OperandError(
          f"missing operand `{spec.name}`: the mask reads it as a {spec.kind} operand of "
          f"shape {_EXPECT[spec.kind]}",
          hint=f"Pass operands={{'{spec.name}': ...}}.")
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
  int_range = check_fits(m, shape, prepared, bits=bits, what=what, hint=_overflow_hint(xp),
                         forms=forms)
  result = Operands(prepared, batch, xp, forms, int_range)
  if has_reads:
    _check_reads(m, shape, result)
  return result


def _unwritten(form: RunForm) -> Unwritten:
  """A per-token operand written out from its runs (in int64) when first read."""
  return Unwritten((form.batch, form.length), np.dtype(np.int64),
                   lambda: form.to_array(np.int64))


def _overflow_hint(xp: ModuleType) -> str:
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
    shown = f"{c.name}({', '.join(ir._arg_text(a) for a in c.args)})"
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


class ComputableMask(_splash.Mask):
  """A mask bound to a shape, an offset and static operands; lazy and sliceable.

  Tiles are computed in int64 with NumPy and are exact: binding raises
  `MaskValueError` when a term of the mask could leave int64 at this shape with
  these operands (or a runtime scalar breaks a definition's `where` clause).

  `cm[q0:q1, k0:k1]` evaluates only that tile (a NumPy bool array), so a
  ComputableMask can be handed to JAX's splash attention wherever a splash
  `Mask` is accepted (`MultiHeadMask`, `process_mask`). Masks that read no
  array operands also expose `q_sequence` and `mask_function(q_ids, kv_ids)`
  (row and column indices), which splash evaluates inside its kernel.

  >>> import maskc
  >>> cm = maskc.parse("causal").bind(4)
  >>> cm[1:3, :].astype(int)
  array([[1, 1, 0, 0],
         [1, 1, 1, 0]])
  """

  def __init__(self, mask: MaskLike, q_len: int, kv_len: int | None = None, *,
               q_offset: int | None = None, operands: Mapping[str, ArrayLike] | None = None,
               q_positions: ArrayLike | None = None,
               kv_positions: ArrayLike | None = None) -> None:
    self.mask = as_mask(mask)
    if any(is_traced(p) for p in (q_positions, kv_positions)):
      raise MaskTypeError("a ComputableMask needs static positions (NumPy arrays)",
                          hint="Use `maskc.materialize` for traced positions.")
    self.bound = Shape.of(q_len, kv_len, q_offset, q_positions=q_positions,
                          kv_positions=kv_positions)
    self.ops = prepare_operands(self.mask, self.bound, operands, allow_traced=False)
    self._batch = _batch_of(self.ops.batch, self.bound)

  @property
  def q_len(self) -> int:
    return self.bound.q_len

  @property
  def kv_len(self) -> int:
    return self.bound.kv_len

  @property
  def q_offset(self) -> int:
    return int(self.bound.q_offset)  # an int: a ComputableMask is static

  @property
  def shape(self) -> tuple[int, ...]:
    lead = () if self._batch is None else (self._batch,)
    return lead + (self.bound.q_len, self.bound.kv_len)

  def __getitem__(self, idx: Any) -> np.ndarray:
    if not isinstance(idx, tuple):
      idx = (idx,)
    if len(idx) > len(self.shape):
      raise IndexError(f"too many indices for a mask of shape {self.shape}")
    idx = idx + (slice(None),) * (len(self.shape) - len(idx))
    *lead, qi, ki = idx
    rows = _index_array(qi, self.bound.q_len)
    cols = _index_array(ki, self.bound.kv_len)
    batch: np.ndarray | int
    if self._batch is None:
      batch = 0
    else:
      batch = _index_array(lead[0], self._batch)
    if self.bound.has_positions:
      return self._at_positions(batch, rows, cols)
    if not (np.isscalar(batch) or np.ndim(batch) == 0):  # rows x columns per batch row
      batch = np.asarray(batch).reshape((-1,) + (1,) * (np.ndim(rows) + np.ndim(cols)))
    b = batch
    if np.size(rows) * np.size(cols) * np.size(b) > MAX_DENSE_ELEMENTS:
      raise MaskLimitError(
          f"this slice has {np.size(rows)} x {np.size(cols)} positions"
          f"{f' x {np.size(b)} batch rows' if np.ndim(b) else ''}, over the "
          f"{MAX_DENSE_ELEMENTS:,} elements of a dense mask", hint="Slice smaller tiles.")
    offset = self.bound.q_offset if _uses_q(self.mask) else 0
    q = np.asarray(rows, dtype=np.int64) + offset
    k = np.asarray(cols, dtype=np.int64)
    # Outer indexing: the result is batch rows x rows x columns (each axis dropped for an int).
    ka = k.reshape((1,) * q.ndim + k.shape)
    tail = (1,) * k.ndim
    if q.ndim != 1:
      qa = q.reshape(q.shape + tail)
      return np.array(evaluate_mask(self.mask, Env(np, qa, ka, self.ops.arrays, b)), dtype=bool)
    # A band of rows at a time, so int64 temporaries stay small on big slices.
    step = max(1, _DENSE_CHUNK // max(1, k.size * np.size(b)))
    parts = [evaluate_mask(self.mask, Env(np, q[r:r + step].reshape((-1,) + tail), ka,
                                          self.ops.arrays, b))
             for r in range(0, max(q.size, 1), step)]
    return np.array(np.concatenate(parts, axis=-1 - k.ndim) if len(parts) > 1 else parts[0],
                    dtype=bool)

  def _at_positions(self, batch: np.ndarray | int, rows: np.ndarray | int,
                    cols: np.ndarray | int) -> np.ndarray:
    """`__getitem__` for explicit positions: rows and columns read their positions."""
    b = batch if np.isscalar(batch) or np.ndim(batch) == 0 else np.asarray(batch)[:, None, None]
    qp, kp = self.bound.rows(np), self.bound.cols(np)
    rows, cols = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
    if np.ndim(b):  # several batch rows: positions per row, `[nb, *rows, *cols]` out
      sel = np.asarray(batch).reshape(-1)
      q = qp[sel if qp.shape[0] > 1 else np.zeros_like(sel)][:, rows]
      k = kp[sel if kp.shape[0] > 1 else np.zeros_like(sel)][:, cols]
      nb = sel.size
      qa = q.reshape(q.shape + (1,) * cols.ndim)
      ka = k.reshape((nb,) + (1,) * rows.ndim + cols.shape)
      b = sel.reshape((nb,) + (1,) * (rows.ndim + cols.ndim))
      return np.array(evaluate_mask(self.mask, Env(np, qa, ka, self.ops.arrays, b)), dtype=bool)
    bi = int(batch)
    q = qp[bi if qp.shape[0] > 1 else 0][rows]
    k = kp[bi if kp.shape[0] > 1 else 0][cols]
    qa, ka = q.reshape(q.shape + (1,)), k.reshape((1,) * q.ndim + k.shape)
    out = evaluate_mask(self.mask, Env(np, qa, ka, self.ops.arrays, b))
    return np.array(out, dtype=bool)

  @property
  def q_sequence(self) -> np.ndarray:
    self._require_in_kernel()
    return np.arange(self.bound.q_len, dtype=np.int32)

  @property
  def mask_function(self) -> Callable[[Any, Any], Any]:
    """`f(q_ids, kv_ids)`: the mask at row and column indices (NumPy or jax.numpy arrays).

    NumPy ids are evaluated in int64 like the tiles; JAX ids (as inside splash's
    kernel) in the jax.numpy path's integer type, int32 unless `jax_enable_x64`
    is on, after checking that every term of the mask fits it at this shape
    (`MaskValueError` otherwise).
    """
    self._require_in_kernel()
    mask, shape, arrays = self.mask, self.bound, self.ops.arrays
    offset = shape.q_offset if _uses_q(mask) else 0
    checked: list[bool] = []

    def mask_function(q_ids: Any, kv_ids: Any) -> Any:
      if not (is_traced(q_ids) or is_traced(kv_ids)):
        q = np.asarray(q_ids, dtype=np.int64) + offset
        return evaluate_mask(mask, Env(np, q, np.asarray(kv_ids, dtype=np.int64), arrays, 0))
      if not checked:
        check_fits(mask, shape, arrays, bits=jax_int_bits(), what="the jax.numpy mask_function",
                   hint=_overflow_hint(jnp))
        checked.append(True)
      dtype = jax_int()
      scalars = {n: jnp.asarray(a).astype(dtype) for n, a in arrays.items()}
      qt = jnp.asarray(q_ids).astype(dtype) + offset
      return evaluate_mask(mask, Env(jnp, qt, jnp.asarray(kv_ids).astype(dtype), scalars, 0))

    return mask_function

  def _require_in_kernel(self) -> None:
    if any(s.kind != "scalar" for s in self.mask.operands) or self.ops.batch is not None:
      raise AttributeError("a mask that reads array operands has no in-kernel mask_function")
    if self.bound.has_positions:
      raise AttributeError("a mask with explicit positions has no in-kernel mask_function")

  def _key(self) -> tuple[Any, ...]:
    pos = tuple(None if p is None else p.tobytes()
                for p in (self.bound.q_positions, self.bound.kv_positions))
    return (self.mask, self.bound.q_len, self.bound.kv_len, self.bound.q_offset,
            self.ops.static_bytes(), pos)

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, ComputableMask):
      return NotImplemented
    return self._key() == other._key()

  def __hash__(self) -> int:
    return hash(self._key())

  def __bool__(self) -> bool:
    raise MaskTypeError("a ComputableMask has no truth value",
                        hint="Slice it (`cm[:, :]`) for the dense array.")

  def __repr__(self) -> str:
    ops = ", ".join(self.ops.arrays)
    return (f"ComputableMask({str(self.mask)!r}, q_len={self.q_len}, kv_len={self.kv_len}, "
            f"q_offset={self.q_offset}" + (f", operands=[{ops}]" if ops else "") + ")")


def _batch_of(ops_batch: int | None, shape: Shape) -> int | None:
  """The batch size of operands and positions together (they must agree)."""
  pb = shape.positions_batch
  if ops_batch is not None and pb is not None and ops_batch != pb:
    raise MaskValueError(f"the operands' batch size {ops_batch} differs from the positions' "
                         f"{pb}", hint="Give operands and positions the same leading size.")
  return ops_batch if ops_batch is not None else pb


def _index_array(i: Any, n: int) -> np.ndarray | int:
  if isinstance(i, slice):
    return np.arange(*i.indices(n))
  if isinstance(i, (int, np.integer)):
    j = int(i)
    if not -n <= j < n:
      raise IndexError(f"index {j} is out of bounds for size {n}")
    return np.asarray(j % n)
  arr = np.asarray(i)
  if arr.dtype == bool:
    return np.nonzero(arr)[0]
  if arr.size and (arr.min() < -n or arr.max() >= n):
    raise IndexError(f"index out of bounds for size {n}")
  return arr % n


def _masks(mask: Any) -> tuple[list[ir.Mask], bool]:
  if isinstance(mask, (ir.Mask, str)):
    return [as_mask(mask)], False
  if isinstance(mask, Sequence) and mask:
    return [as_mask(m) for m in mask], True
  raise MaskTypeError(f"expected a mask, mask text or a sequence of them, got {mask!r}")


def materialize(mask: MasksLike, q_len: int, kv_len: int | None = None, *,
                q_offset: int | None = None, operands: Mapping[str, ArrayLike] | None = None,
                q_positions: ArrayLike | None = None,
                kv_positions: ArrayLike | None = None) -> np.ndarray | jax.Array:
  """The mask as a dense bool array `[..., q_len, kv_len]`.

  Works under `jax.jit` with traced operands (per-token `[L]` / `[B, L]`, scalars
  `[]` / `[B]`); a batch axis on any operand gives the result a leading `B`. A
  sequence of masks (one per head) adds a head axis before the last two.

  Integer terms are computed exactly or refused: NumPy evaluates in int64,
  jax.numpy (when an operand is a JAX array or the offset is traced) in int32
  (int64 with `jax_enable_x64`), and a term that could leave that type over
  the shape and the static values (literals, a static offset, static operands)
  raises `MaskValueError` naming it. Traced values cannot be checked at trace
  time: they are int32 (with x64 off), and a wrap is possible only for a term
  whose values, computed from traced ones, exceed int32; comparisons of reads
  (`seg[q] == seg[k]`) subtract nothing and stay exact. A traced scalar that
  breaks a definition's `where` requirement (`sliding(n)` with `n = 0`) is not
  refused; the body is computed as written (see `prepare_operands`).

  Args:
    mask: a Mask, mask text, or a sequence of them (one per head).
    q_len: query rows. kv_len: key columns (default `q_len`).
    q_offset: position of row 0 (default `kv_len - q_len`).
    operands: runtime operand values by name.
    q_positions, kv_positions: the position of each row / column, `[L]` or `[B, L]`
      (NumPy or traced; default `q_offset + i` and `j`). Row `i` is then query
      position `q_positions[i]`: a permutation of positions permutes the rows.

  Returns:
    A NumPy bool array when every operand and position is static, else a jax.Array.

  Raises:
    MaskLimitError: a length of 2**31 or more, or more than `MAX_DENSE_ELEMENTS`
      elements (before anything is allocated).
    MaskValueError: a term that would wrap, a broken `where` requirement, a bad
      operand (`OperandError`).

  >>> import maskc
  >>> maskc.materialize("sliding(2)", 3).astype(int)
  array([[1, 0, 0],
         [1, 1, 0],
         [0, 1, 1]])
  """
  masks, multi = _masks(mask)
  shape = Shape.of(q_len, kv_len, q_offset, q_positions=q_positions,
                   kv_positions=kv_positions)
  _check_dense(shape.q_len, shape.kv_len, len(masks), multi)
  traced = not shape.static or any(is_traced(v) for v in (operands or {}).values())
  outs = []
  for m in masks:
    ops = prepare_operands(m, shape, operands, xp=jnp if traced else None)
    _check_dense(shape.q_len, shape.kv_len, len(masks) * (ops.batch or 1), multi)
    if shape.has_positions:
      outs.append(_evaluate_at_positions(m, shape, ops))
      continue
    if ops.xp is np:
      outs.append(_dense_numpy(m, shape, ops))
      continue
    dtype = jax_int()
    q = jnp.arange(shape.q_len, dtype=dtype)
    if _uses_q(m):  # an offset the mask never reads need not fit the type
      q = q + shape.q_offset
    k = jnp.arange(shape.kv_len, dtype=dtype)
    batch = 0 if ops.batch is None else jnp.arange(ops.batch)[:, None, None]
    outs.append(evaluate_mask(m, Env(jnp, q[:, None], k[None, :], ops.arrays, batch)))
  xp = jnp if any(is_traced(o) for o in outs) else np
  if multi:
    lead = max(o.ndim for o in outs)
    outs = [xp.broadcast_to(o, outs[[p.ndim for p in outs].index(lead)].shape) for o in outs]
    dense: np.ndarray | jax.Array = xp.stack(outs, axis=-3)
  else:
    dense = outs[0]
  return dense


def _check_dense(q_len: int, kv_len: int, count: int, multi: bool) -> None:
  """Raises `MaskLimitError` for a dense mask too long or too large to allocate."""
  if max(q_len, kv_len) > MAX_DENSE_LENGTH:
    raise MaskLimitError(
        f"a dense {q_len} x {kv_len} mask has a length of 2**31 or more; dense masks allow "
        f"lengths up to {MAX_DENSE_LENGTH:,}",
        hint="Use `maskc.compile` for block-sparse metadata, or bind the mask and slice the "
             "tiles you need: `mask.bind(...)[q0:q1, k0:k1]`.")
  if q_len * kv_len * count > MAX_DENSE_ELEMENTS:
    raise MaskLimitError(
        f"a dense {q_len} x {kv_len} mask{' per head' if multi else ''}"
        f"{f' ({count} of them)' if count > 1 else ''} is over {MAX_DENSE_ELEMENTS:,} elements",
        hint="Use `maskc.compile` for block-sparse metadata, or bind the mask and slice the "
             "tiles you need: `mask.bind(...)[q0:q1, k0:k1]`.")


def _uses_q(m: ir.Node) -> bool:
  return any(isinstance(n, ir.Pos) and n.axis == "q" for n in ir.walk(m))


def _dense_numpy(m: ir.Mask, shape: Shape, ops: Operands) -> np.ndarray:
  """The whole mask with NumPy (int64), a band of rows at a time to bound temporaries."""
  offset = shape.q_offset if _uses_q(m) else 0
  k = np.arange(shape.kv_len, dtype=np.int64)[None, :]
  batch = 0 if ops.batch is None else np.arange(ops.batch)[:, None, None]
  lead = () if ops.batch is None else (ops.batch,)
  out = np.empty(lead + (shape.q_len, shape.kv_len), dtype=bool)
  step = max(1, _DENSE_CHUNK // (shape.kv_len * (ops.batch or 1)))
  for r0 in range(0, shape.q_len, step):
    r1 = min(r0 + step, shape.q_len)
    q = (np.arange(r0, r1, dtype=np.int64) + offset)[:, None]
    out[..., r0:r1, :] = evaluate_mask(m, Env(np, q, k, ops.arrays, batch))
  return out


def _evaluate_at_positions(m: ir.Mask, shape: Shape, ops: Operands) -> Any:
  """The dense mask with rows and columns at explicit positions, `[B?, Lq, Lkv]`."""
  traced = ops.xp is jnp or not shape.static
  xp = jnp if traced else np
  int_t = jnp.int32 if traced else np.int64
  q = xp.asarray(shape.rows(xp, int_t))
  k = xp.asarray(shape.cols(xp, int_t))
  arrays: Mapping[str, Any] = ops.arrays
  if traced:
    arrays = {n: jnp.asarray(a) for n, a in arrays.items()}
  batch = _batch_of(ops.batch, shape)
  b = 0 if batch is None else xp.arange(batch)[:, None, None]
  out = evaluate_mask(m, Env(xp, q[:, :, None], k[:, None, :], arrays, b))
  return out if batch is not None else out[0]


def additive_bias(mask: MasksLike, q_len: int, kv_len: int | None = None, *,
                  q_offset: int | None = None, operands: Mapping[str, ArrayLike] | None = None,
                  dtype: DTypeLike = jnp.float32, q_positions: ArrayLike | None = None,
                  kv_positions: ArrayLike | None = None) -> jax.Array:
  """The mask as an additive attention bias: 0 where allowed, a large negative elsewhere.

  The negative is `-0.7 * finfo(dtype).max`, finite so that fully masked rows
  do not produce NaN. Same arguments (positions included), checks and errors as
  `materialize` (exact integer terms or `MaskValueError`); jittable.
  """
  dense = materialize(mask, q_len, kv_len, q_offset=q_offset, operands=operands,
                      q_positions=q_positions, kv_positions=kv_positions)
  neg = -0.7 * float(jnp.finfo(dtype).max)
  return jnp.where(jnp.asarray(dense), jnp.asarray(0, dtype), jnp.asarray(neg, dtype))


ir.install(bind=ComputableMask)
