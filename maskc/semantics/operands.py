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
from typing import Any

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
from maskc.semantics.reads import check_reads
from maskc.semantics.shape import Shape


def _digest(a: np.ndarray) -> bytes:
  """A digest of an array's bytes (SHA-256, hardware-accelerated on common CPUs): cache keys
  hold it instead of a copy of the array."""
  return hashlib.sha256(np.ascontiguousarray(a).data.cast("B"),
                        usedforsecurity=False).digest()



# Pairwise operands of more bytes than this are not digested for `maskc.compile`'s cache.
DIGEST_PAIR_BYTES = 1 << 22

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

  def static_bytes(self, pair_limit: int | None = None
                   ) -> tuple[tuple[str, tuple[int, ...], str, bytes], ...] | None:
    """A hashable digest of static operand values, for caches; None where a pairwise operand
    holds more than `pair_limit` bytes (`maskc.compile` passes `DIGEST_PAIR_BYTES`).

    A per-token operand is digested in run form (its runs determine it), which costs the
    number of runs rather than the number of tokens, or as given where its runs are at least
    half its tokens; a pairwise one in its own dtype. A
    pairwise operand of an 8K x 8K mask takes as long to digest as its whole lowering
    (about 50 ms), and such operands change every step (a tree, a block selection), so a
    map built from one is not cached.
    """
    def digest(n: str) -> bytes:
      if n in self.forms and not _many_runs(self.forms[n]):
        return b"runs" + self.forms[n].digest()
      raw = self.arrays.raw(n)  # kept as given (pairwise, or runs as many as the tokens)
      return str(raw.dtype).encode() + _digest(raw)
    if pair_limit is not None and any(
        self.arrays.raw(n).nbytes > pair_limit for n in self.arrays
        if n not in self.forms and len(self.arrays.shape(n)) == 3):
      return None
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
    if extremes is not None and extremes.size and not _fits_type(extremes.dtype, bits) and \
        (int(extremes.min()) < lo_type or int(extremes.max()) > hi_type):
      raise _outside_type(spec.name, bits, xp)
    if xp is jnp:
      value = jnp.asarray(value).astype(jax_int())
    elif spec.name in forms:  # written out from its runs (a copy) when first read
      value = _unwritten(forms[spec.name], value)
    elif spec.kind == "pair":  # kept as given, widened (a copy) when first indexed
      value = _widened_later(value)
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
    check_reads(m, shape, result.arrays, result.batch)
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


def _fits_type(dtype: np.dtype, bits: int) -> bool:
  """Whether every value of `dtype` fits the signed integer type of `bits` bits (no pass over
  an operand's values is needed to know)."""
  if dtype == np.bool_:
    return True
  info = np.iinfo(dtype)
  return -(1 << (bits - 1)) <= info.min and info.max < 1 << (bits - 1)


def _widened_later(value: np.ndarray) -> Unwritten:
  """A static pairwise operand kept in its own dtype (`raw`), widened to int64 when first
  indexed. A caller's writeable array is copied first (the copy of a bool operand, an eighth
  of the widened one): a map must not change when the caller reuses its buffer."""
  kept = np.array(value) if value.flags.writeable else value
  return Unwritten(tuple(kept.shape), np.dtype(np.int64), lambda: kept.astype(np.int64), kept)


def _unwritten(form: RunForm, value: np.ndarray | None = None) -> Unwritten:
  """A per-token operand written out (in int64) when first read: from its runs, or, where
  runs are at least half the tokens (`value`, the tokens as given: entry times, positions),
  from the tokens, kept in their own dtype as `raw` (copied if the caller's buffer is
  writeable: a map must not change when its caller reuses it)."""
  shape, int64 = (form.batch, form.length), np.dtype(np.int64)
  if value is None or not _many_runs(form):
    return Unwritten(shape, int64, lambda: form.to_array(np.int64))
  kept = np.array(value) if value.flags.writeable else value
  return Unwritten(shape, int64, lambda: kept.astype(np.int64), kept)


def _many_runs(form: RunForm) -> bool:
  """Whether runs are at least half of `form`'s tokens: its tokens are then the smaller
  thing to keep and to digest."""
  return form.starts.size * 2 >= form.batch * form.length


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


