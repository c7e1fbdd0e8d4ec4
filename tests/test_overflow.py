"""No silent integer wrap: every dense result is exact, or a `MaskValueError` (issue 14).

Masks with literals, offsets and operand values near and past 2**31 and 2**63
are evaluated by `materialize`, `to_dense` (NumPy, int64), by `materialize` on
the jax.numpy path with static values (int32) and under `jit` with traced
operands or a traced offset, and compared with a reference written here: a
per-position evaluator over Python ints (never wrapping) that also records the
range of every integer sub-term. `maskc.semantics.overflow.term_bounds` must contain
that range, and results must equal the reference unless maskc refuses the mask
with a `MaskValueError`. Small magnitudes must never be refused.
"""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import maskc
from maskc.language import ir
from maskc.semantics.operands import prepare_operands
from maskc.semantics.overflow import _sub_terms, check_fits, term_bounds
from maskc.semantics.shape import Shape
from sampling import PARTS, count

I32 = (-2**31, 2**31 - 1)
I64 = (-2**63, 2**63 - 1)
SEG_LEN, PAIR = 6, 3


# ----------------------------------------------------------------------------- reference


def _runs(x) -> list[int]:
  out, run, prev = [], 0, False
  for v in x:
    v = bool(v)
    if v and not prev:
      run += 1
    out.append(run if v else 0)
    prev = v
  return out


class Reference:
  """Exact evaluation with Python ints, one position at a time; unbatched operands."""

  def __init__(self, operands: dict):
    self.ops = {n: np.asarray(v).tolist() for n, v in operands.items()}
    self.lo = self.hi = None

  def _seen(self, v: int) -> int:
    self.lo = v if self.lo is None else min(self.lo, v)
    self.hi = v if self.hi is None else max(self.hi, v)
    return v

  def term(self, t, q: int, k: int) -> int:
    return self._seen(self._term(t, q, k))

  def _term(self, t, q, k) -> int:
    if isinstance(t, ir.Const):
      return t.value
    if isinstance(t, ir.Pos):
      return q if t.axis == "q" else k
    if isinstance(t, ir.Scalar):
      return int(self.ops[t.name])
    if isinstance(t, ir.Read):
      i = self.term(t.index, q, k)
      values = self.ops[t.operand.name]
      values = _runs(values) if t.runs else values
      if not 0 <= i < len(values):
        raise IndexError(i)
      return int(values[i])
    if isinstance(t, ir.PairRead):
      i, j = self.term(t.q_index, q, k), self.term(t.k_index, q, k)
      return int(self.ops[t.operand.name][i][j])
    if isinstance(t, ir.Neg):
      return -self.term(t.arg, q, k)
    if isinstance(t, ir.Arith):
      a, b = self.term(t.lhs, q, k), self.term(t.rhs, q, k)
      return {"+": a + b, "-": a - b, "*": a * b}.get(t.op) if t.op in "+-*" else \
          (a // b if t.op == "//" else a % b)
    if isinstance(t, ir.Fn):
      vals = [self.term(a, q, k) for a in t.args]
      return abs(vals[0]) if t.name == "abs" else (min(vals) if t.name == "min" else max(vals))
    raise TypeError(type(t).__name__)

  def mask(self, m, q: int, k: int) -> bool:
    if isinstance(m, ir.BoolConst):
      return m.value
    if isinstance(m, ir.Compare):
      vals = [self.term(t, q, k) for t in m.terms]
      ops = {"<": lambda a, b: a < b, "<=": lambda a, b: a <= b, "==": lambda a, b: a == b,
             "!=": lambda a, b: a != b, ">=": lambda a, b: a >= b, ">": lambda a, b: a > b}
      return all(ops[o](a, b) for o, a, b in zip(m.ops, vals, vals[1:]))
    if isinstance(m, ir.Truth):
      return self.term(m.read, q, k) != 0
    if isinstance(m, ir.Not):
      return not self.mask(m.item, q, k)
    if isinstance(m, (ir.And, ir.Or, ir.Xor)):
      vals = [self.mask(i, q, k) for i in m.items]  # every item, as evaluation computes them all
      return all(vals) if isinstance(m, ir.And) else \
          (any(vals) if isinstance(m, ir.Or) else sum(vals) % 2 == 1)
    if isinstance(m, ir.Call):
      return self.mask(ir.expand(m), q, k)
    raise TypeError(type(m).__name__)

  def dense(self, m, q_len: int, kv_len: int, q_offset: int) -> np.ndarray:
    return np.array([[self.mask(m, q_offset + i, k) for k in range(kv_len)]
                     for i in range(q_len)], dtype=bool)


def reference(text: str, q_len: int, kv_len: int, q_offset: int, operands: dict):
  """(dense mask, lowest and highest value of any integer sub-term) in exact arithmetic."""
  ref = Reference(operands)
  out = ref.dense(maskc.parse(text), q_len, kv_len, q_offset)
  return out, (ref.lo if ref.lo is not None else 0, ref.hi if ref.hi is not None else 0)


def fits(bounds, rng) -> bool:
  return rng[0] <= bounds[0] and bounds[1] <= rng[1]


# ----------------------------------------------------------------------------- strategies

BIG = [2**31 - 1, 2**31, 2**31 + 1, 2**32, 2**37, 2**40, 1073741824, 65536, 12345679,
       615586615747]
BIG_VALUES = BIG + [2**62, 2**63 - 1, 2**63 - 6, 2**53 + 1]


def _signed(values):
  return st.sampled_from(values).flatmap(lambda v: st.sampled_from([v, -v]))


def literals(big: bool):
  small = st.integers(-16, 16)
  return st.one_of(small, _signed(BIG)) if big else small


def values(big: bool):
  small = st.integers(-16, 16)
  return st.one_of(small, _signed(BIG_VALUES), st.sampled_from([-2**63])) if big else small


def offsets(big: bool):
  small = st.integers(0, 16)
  huge = st.sampled_from([2**31 - 8, 2**31 - 3, 2**31, 2**37, 2**62, 2**63 - 8, 2**63 - 2,
                          2**63, 2**64, -2**31, -2**31 - 4, -2**63])
  return st.one_of(small, huge) if big else small


def term_texts(big: bool, depth: int = 3):
  leaves = st.one_of(
      st.sampled_from(["q", "k", "n", "seg[k]", f"seg[q % {SEG_LEN}]", "runs(g)[k]",
                       f"runs(g)[q % {SEG_LEN}]", f"a[q % {PAIR}, k % {PAIR}]"]),
      literals(big).map(str))
  nonzero = literals(big).filter(lambda c: c != 0)

  def extend(t):
    return st.one_of(
        st.tuples(t, st.sampled_from(["+", "-"]), t).map(lambda x: f"({x[0]} {x[1]} {x[2]})"),
        st.tuples(t, literals(big)).map(lambda x: f"({x[0]} * {x[1]})"),
        st.tuples(literals(big), t).map(lambda x: f"({x[0]} * {x[1]})"),
        st.tuples(t, st.sampled_from(["//", "%"]), nonzero).map(
            lambda x: f"({x[0]} {x[1]} {x[2]})"),
        t.map(lambda x: f"(-{x})"), t.map(lambda x: f"abs({x})"),
        st.tuples(st.sampled_from(["min", "max"]), t, t).map(lambda x: f"{x[0]}({x[1]}, {x[2]})"))

  return st.recursive(leaves, extend, max_leaves=depth + 1)


def mask_texts(big: bool):
  op = st.sampled_from(["<", "<=", "==", "!=", ">=", ">"])
  cmp = st.tuples(term_texts(big), op, term_texts(big)).map(lambda x: f"{x[0]} {x[1]} {x[2]}")
  return st.one_of(
      cmp,
      st.tuples(cmp, st.sampled_from(["&", "|", "^"]), cmp).map(
          lambda x: f"({x[0]}) {x[1]} ({x[2]})"),
      cmp.map(lambda x: f"~({x})"),
      st.just("seg[q % 6] == seg[k]"), st.just("runs(g)[q % 6] == runs(g)[k] & g[k]"))


@st.composite
def cases(draw, big: bool = True):
  """(text, q_len, kv_len, q_offset, operands) with every read in bounds."""
  text = draw(mask_texts(big))
  q_len, kv_len = draw(st.integers(1, 4)), draw(st.integers(1, SEG_LEN))
  q_offset = draw(offsets(big))
  ops = {
      "seg": np.array(draw(st.lists(values(big), min_size=SEG_LEN, max_size=SEG_LEN)),
                      dtype=np.int64),
      "g": np.array(draw(st.lists(st.booleans(), min_size=SEG_LEN, max_size=SEG_LEN))),
      "a": np.array(draw(st.lists(values(big), min_size=PAIR * PAIR, max_size=PAIR * PAIR)),
                    dtype=np.int64).reshape(PAIR, PAIR),
      "n": np.int64(draw(values(big))),
  }
  return text, q_len, kv_len, q_offset, ops


def _parse_or_none(text):
  try:
    return maskc.parse(text)
  except maskc.MaskValueError:  # a folded literal past 2**40: refused as text, fine
    return None


def _used(m, ops):
  return {s.name: ops[s.name] for s in m.operands}


def _outcome(f):
  """f()'s value as a bool array, or the MaskValueError it raised; nothing else may escape."""
  try:
    return np.asarray(f(), dtype=bool)
  except maskc.MaskValueError as e:
    return e


# ----------------------------------------------------------------------------- properties


@given(cases(big=True))
def test_numpy_results_are_exact_or_refused(case):
  text, q_len, kv_len, q_offset, ops = case
  m = _parse_or_none(text)
  if m is None:
    return
  ops = _used(m, ops)
  want, bounds = reference(text, q_len, kv_len, q_offset, ops)
  got = _outcome(lambda: maskc.materialize(m, q_len, kv_len, q_offset=q_offset, operands=ops))
  tiles = _outcome(lambda: m.to_dense(q_len, kv_len, q_offset=q_offset, operands=ops))
  for out in (got, tiles):
    if isinstance(out, Exception):
      # Refused only when interval arithmetic finds a term that can leave int64, and
      # interval bounds contain the exact ones: a term whose exact range leaves int64
      # is always refused.
      assert "64-bit" in str(out), out
    else:
      assert fits(bounds, I64), (text, bounds)
      np.testing.assert_array_equal(out, want, err_msg=text)
  if not fits(bounds, I64):
    assert isinstance(got, Exception) and isinstance(tiles, Exception)


@given(cases(big=True))
def test_term_bounds_contain_every_value(case):
  text, q_len, kv_len, q_offset, ops = case
  m = _parse_or_none(text)
  if m is None:
    return
  ops = _used(m, ops)
  _, exact = reference(text, q_len, kv_len, q_offset, ops)
  arrays = {n: np.asarray(v, dtype=object)[None] for n, v in ops.items()}
  if "g" in arrays:
    arrays["runs(g)"] = np.asarray(_runs(ops["g"]), dtype=object)[None]
  bounds = term_bounds(m, Shape.of(q_len, kv_len, q_offset), arrays)
  assert bounds is not None
  assert bounds[0] <= exact[0] and exact[1] <= bounds[1], (text, bounds, exact)


@given(cases(big=False), st.sampled_from([None, 0, 1, [1, 0]]))
def test_bounds_from_run_forms_equal_bounds_from_tokens(case, batch):
  """Binding bounds per-token reads by the operands' runs (`RunForm.values_in`), whole rows
  or not: the same bounds as a pass over the tokens, for every batch-row selection."""
  text, q_len, kv_len, q_offset, ops = case
  m = _parse_or_none(text)
  if m is None:
    return
  ops = _used(m, ops)
  if batch is not None:  # two different rows per per-token operand
    ops = {n: (np.stack([v, ~v if v.dtype == bool else v * 3 + 1]) if np.ndim(v) == 1 else v)
           for n, v in ops.items()}
  shape = Shape.of(q_len, kv_len, q_offset)
  try:
    prepared = prepare_operands(m, shape, ops)
  except maskc.MaskError:
    return
  rows = None if batch is None else np.asarray(batch)
  by_forms = list(_sub_terms(m, shape, prepared.arrays, rows, prepared.forms))
  assert by_forms == list(_sub_terms(m, shape, prepared.arrays, rows))  # every sub-term's
  assert term_bounds(m, shape, prepared.arrays, rows, forms=prepared.forms) == term_bounds(
      m, shape, prepared.arrays, rows)


# Eager jax.numpy per example: the default run draws a share of the profile's examples,
# `-m slow` all of them (sampling.py).
@pytest.mark.parametrize("part", PARTS)
def test_small_magnitudes_are_never_refused(part):
  settings(max_examples=count(None, part))(given(cases(big=False))(_check_small_magnitudes))()


def _check_small_magnitudes(case):
  text, q_len, kv_len, q_offset, ops = case
  m = _parse_or_none(text)
  assert m is not None
  ops = _used(m, ops)
  want, _ = reference(text, q_len, kv_len, q_offset, ops)
  np.testing.assert_array_equal(
      maskc.materialize(m, q_len, kv_len, q_offset=q_offset, operands=ops), want)
  np.testing.assert_array_equal(m.to_dense(q_len, kv_len, q_offset=q_offset, operands=ops), want)
  jops = {n: jnp.asarray(v) for n, v in ops.items()}
  np.testing.assert_array_equal(
      np.asarray(maskc.materialize(m, q_len, kv_len, q_offset=q_offset, operands=jops)), want)


@settings(max_examples=40)
@given(cases(big=True))
def test_jax_static_results_are_exact_or_refused(case):
  """JAX arrays as operands take the jax.numpy path (int32): static values are all checked."""
  text, q_len, kv_len, q_offset, ops = case
  m = _parse_or_none(text)
  if m is None:
    return
  ops = _used(m, ops)
  want, bounds = reference(text, q_len, kv_len, q_offset, ops)
  # A JAX operand `zero` puts the mask on the jax.numpy path; operands beyond int32 stay
  # NumPy (JAX would wrap them on conversion) and must be refused there.
  jops = {n: _jax_or_np(v) for n, v in ops.items()} | {"zero": jnp.asarray(0)}
  got = _outcome(lambda: maskc.materialize(f"({text}) & k >= zero", q_len, kv_len,
                                           q_offset=q_offset, operands=jops))
  if isinstance(got, Exception):
    assert "32-bit" in str(got) or "int32" in str(got), got
  else:
    assert fits(bounds, I32), (text, bounds)
    np.testing.assert_array_equal(got, want, err_msg=text)
  if not fits(bounds, I32):
    assert isinstance(got, Exception)


def _jax_or_np(v):
  """A JAX array when the values fit int32 (JAX would wrap others), else the NumPy array."""
  return jnp.asarray(v) if fits((int(np.min(v)), int(np.max(v))), I32) else v


@settings(max_examples=30)
@given(cases(big=True))
def test_traced_operands_are_exact_where_values_fit_int32(case):
  """Traced operand values cannot be checked: results are exact when no term leaves int32."""
  text, q_len, kv_len, q_offset, ops = case
  m = _parse_or_none(text)
  if m is None or not m.operands:
    return
  ops = _used(m, ops)
  if not all(fits((int(np.min(v)), int(np.max(v))), I32) for v in ops.values()):
    return  # such values cannot even be made JAX int32 arrays without wrapping
  want, bounds = reference(text, q_len, kv_len, q_offset, ops)
  f = jax.jit(lambda o: maskc.materialize(m, q_len, kv_len, q_offset=q_offset, operands=o))
  got = _outcome(lambda: f({n: jnp.asarray(v, jnp.int32) for n, v in ops.items()}))
  if isinstance(got, Exception):
    assert "32-bit" in str(got), got  # a literal or the static offset leaves int32
  elif fits(bounds, I32):
    np.testing.assert_array_equal(got, want, err_msg=text)


@settings(max_examples=30)
@given(cases(big=True))
def test_traced_offset_is_exact_where_values_fit_int32(case):
  text, q_len, kv_len, q_offset, ops = case
  m = _parse_or_none(text)
  if m is None or not fits((q_offset, q_offset), I32):
    return
  ops = _used(m, ops)
  want, bounds = reference(text, q_len, kv_len, q_offset, ops)
  f = jax.jit(lambda off: maskc.materialize(m, q_len, kv_len, q_offset=off, operands=ops))
  got = _outcome(lambda: f(jnp.int32(q_offset)))
  if isinstance(got, Exception):
    assert "32-bit" in str(got) or "int32" in str(got), got
  elif fits(bounds, I32):
    np.testing.assert_array_equal(got, want, err_msg=text)


# ----------------------------------------------------------------------------- issue 14 cases

ISSUE_CASES = [
    # text, q_len, kv_len, q_offset, operands
    ("q - k < 3", 4, 4, 2**37, {}),
    ("q - k < 3", 4, 4, 2**63 - 4, {}),
    ("q - k < 3", 4, 4, 2**63 - 3, {}),
    ("1099511627776 * seg[k] > q", 4, 4, None, {"seg": np.array([3, -1, 0, 2**22])}),
    ("1099511627776 * seg[k] > q", 4, 4, None, {"seg": np.array([3, -1, 0, 2**23])}),
    ("1073741824 * runs(g)[q] > k", 6, 6, 0, {"g": np.array([1, 0, 1, 0, 1, 1], bool)}),
    ("12345679 * (runs(img)[q + 60] * 1099511627776 // 2) > k", 4, 70, 0,
     {"img": np.ones(70, bool)}),
    ("12345679 * (runs(img)[q + 60] * 1099511627776 // 2) > k", 4, 70, 0,
     {"img": np.tile([True, False], 35)}),
    ("runs(g)[q] + 2147483648 > k", 4, 4, None, {"g": np.array([1, 0, 1, 1], bool)}),
    ("q + seg[k] > 0", 4, 4, None, {"seg": np.full(4, 2**31 - 1)}),
    ("document(seg)", 4, 4, None, {"seg": np.array([2**63 - 1, 0, -2**63, 5])}),
    ("seg[q] == seg[k]", 4, 4, None, {"seg": np.array([2**63 - 1, 0, -2**63, 5])}),
    ("seg[q] - seg[k] == 0", 4, 4, None, {"seg": np.array([2**63 - 1, 0, -2**63, 5])}),
    ("q * 65536 < k * 65536 + 5 & k < n", 4, 4, 40000, {"n": 3}),
    ("q - k < n", 8, 8, 2**31 - 8, {"n": 3}),
    ("q * 615586615747 > k", 3, 3, None, {}),
    ("k < 2", 3, 3, 2**70, {}),
]


@pytest.mark.parametrize("text,q_len,kv_len,q_offset,ops", ISSUE_CASES,
                         ids=[f"{c[0]}@{c[3]}" for c in ISSUE_CASES])
def test_issue_cases_numpy(text, q_len, kv_len, q_offset, ops):
  offset = kv_len - q_len if q_offset is None else q_offset
  want, bounds = reference(text, q_len, kv_len, offset, ops)
  for run in (lambda: maskc.materialize(text, q_len, kv_len, q_offset=q_offset, operands=ops),
              lambda: maskc.parse(text).to_dense(q_len, kv_len, q_offset=q_offset, operands=ops)):
    out = _outcome(run)
    if fits(bounds, I64):  # these terms are tight: interval bounds equal the exact ones
      np.testing.assert_array_equal(out, want)
    else:
      assert isinstance(out, maskc.MaskValueError)


@pytest.mark.parametrize("text,q_len,kv_len,q_offset,ops", ISSUE_CASES,
                         ids=[f"{c[0]}@{c[3]}" for c in ISSUE_CASES])
def test_issue_cases_jax_static(text, q_len, kv_len, q_offset, ops):
  """On the jax.numpy path (a JAX operand, or a dummy one) it is int32: exact or refused."""
  offset = kv_len - q_len if q_offset is None else q_offset
  want, bounds = reference(text, q_len, kv_len, offset, ops)
  jops = {n: _jax_or_np(v) for n, v in ops.items()} | {"zero": jnp.asarray(0)}
  out = _outcome(lambda: maskc.materialize(f"({text}) & k >= zero", q_len, kv_len,
                                           q_offset=q_offset, operands=jops))
  if fits(bounds, I32):
    np.testing.assert_array_equal(out, want)
  else:
    assert isinstance(out, maskc.MaskValueError), text
    assert "int32" in str(out) or "32-bit" in str(out)


def test_refusal_names_the_term_and_its_range():
  seg = np.array([3, -1, 0, 2**23])
  with pytest.raises(maskc.MaskValueError) as e:
    maskc.materialize("1099511627776 * seg[k] > q", 4, operands={"seg": seg})
  msg = str(e.value)
  assert "`1099511627776 * seg[k]`" in msg and f"[{-2**40}, {2**63}]" in msg
  assert "64-bit" in msg and "Renumber" in msg
  with pytest.raises(maskc.MaskValueError) as e:
    maskc.materialize("q * 615586615747 > k & k < n", 3, operands={"n": jnp.asarray(2)})
  assert "`615586615747`" in str(e.value) and "jax_enable_x64" in str(e.value)


def test_jax_overflow_is_a_mask_value_error_not_overflow_error():
  for q_offset in (2**31, 615586615747):
    with pytest.raises(maskc.MaskValueError):
      maskc.materialize("q - k < n", 3, q_offset=q_offset, operands={"n": jnp.asarray(2)})
    with pytest.raises(maskc.MaskValueError):
      def bound(n, q_offset=q_offset):
        return maskc.materialize("q - k < n", 3, q_offset=q_offset, operands={"n": n})
      jax.jit(bound)(2)
  with pytest.raises(maskc.MaskValueError):
    jax.jit(lambda n: maskc.additive_bias("q * 615586615747 > k + n", 3, operands={"n": n}))(1)
  # A large offset the mask never reads is no term at all.
  out = maskc.materialize("k < n", 2, 3, q_offset=2**40, operands={"n": jnp.asarray(2)})
  np.testing.assert_array_equal(np.asarray(out), [[1, 1, 0], [1, 1, 0]])


def test_traced_equality_of_extreme_int32_ids_is_exact():
  seg = np.array([2**31 - 1, 0, -2**31, 5], np.int32)
  f = jax.jit(lambda s: maskc.materialize("document(s)", 4, operands={"s": s}))
  np.testing.assert_array_equal(np.asarray(f(jnp.asarray(seg))), np.eye(4, dtype=bool))
  # uint32 ids past int32 wrap to negative int32 values one to one: `==` stays exact.
  useg = np.array([2**32 - 1, 2**31, 2**31, 7], np.uint32)
  want = useg[:, None] == useg[None, :]
  np.testing.assert_array_equal(np.asarray(f(jnp.asarray(useg))), want)


def test_concrete_jax_operands_outside_int32_are_refused_not_wrapped():
  useg = jnp.asarray(np.array([2**31, 0, 2**32 - 1, 5], np.uint32))
  with pytest.raises(maskc.OperandError, match="outside int32"):
    maskc.materialize("seg[q] < seg[k]", 4, operands={"seg": useg})
  small = jnp.asarray(np.array([2**31 - 1, 0, 7, 5], np.uint32))
  want = np.array([2**31 - 1, 0, 7, 5])
  np.testing.assert_array_equal(
      np.asarray(maskc.materialize("seg[q] < seg[k]", 4, operands={"seg": small})),
      want[:, None] < want[None, :])


def test_dense_lengths_of_2_31_are_a_limit_error_before_allocating():
  for q_len, kv_len in [(1, 2**31), (2**31, 1), (2**31, 2**31), (1, 2**40)]:
    with pytest.raises(maskc.MaskLimitError):
      maskc.materialize("causal", q_len, kv_len)
    with pytest.raises(maskc.MaskLimitError):
      maskc.additive_bias("causal", q_len, kv_len)
  with pytest.raises(maskc.MaskLimitError):
    maskc.parse("causal").bind(2**17, 2**17 + 1)[:, :]
  # The batch counts towards the element limit.
  with pytest.raises(maskc.MaskLimitError):
    maskc.materialize("document(seg)", 2**16, operands={"seg": np.zeros((2, 2**16), np.int8)})


def test_runs_tables_are_int64_on_the_numpy_path():
  m = maskc.parse("runs(g)[q] + 2147483648 > k")
  ops = prepare_operands(m, Shape.of(4), {"g": np.array([1, 0, 1, 1], bool)})
  assert ops.arrays["runs(g)"].dtype == np.int64
  np.testing.assert_array_equal(maskc.materialize(m, 4, operands={"g": [1, 0, 1, 1]}),
                                np.ones((4, 4), bool))


def test_banded_numpy_evaluation_equals_one_shot(monkeypatch):
  from maskc.semantics import dense as _dense
  seg = np.repeat(np.arange(5), 7)[:33]
  text = "causal & document(seg) | q - k < 3"
  whole = maskc.materialize(text, 33, operands={"seg": seg})
  monkeypatch.setattr(_dense, "DENSE_CHUNK", 40)  # about one row per band
  np.testing.assert_array_equal(maskc.materialize(text, 33, operands={"seg": seg}), whole)
  np.testing.assert_array_equal(maskc.parse(text).to_dense(33, operands={"seg": seg}), whole)
  want, _ = reference(text, 33, 33, 0, {"seg": seg})
  np.testing.assert_array_equal(whole, want)


# ----------------------------------------------------------------------------- term_bounds


def test_term_bounds_of_simple_terms_are_exact():
  shape = Shape.of(4, 10, 100)
  assert term_bounds(maskc.parse("q - k < 3"), shape, {}) == (0, 103)
  assert term_bounds(maskc.parse("k - q < 3"), shape, {}) == (-103, 103)
  seg = np.array([[5, -7, 2, 9, 0, 1, 1, 1, 1, 1]], np.int64)
  assert term_bounds(maskc.parse("seg[k] * 3 > 0"), shape, {"seg": seg}) == (-21, 27)
  # `seg[q % 3]` reaches seg[0:3] only.
  assert term_bounds(maskc.parse("seg[q % 3] < 4"), shape, {"seg": seg}) == (-7, 103)
  assert term_bounds(maskc.parse("(q - 200) // 7 == abs(k - 20) % 4"), Shape.of(4, 10, 100),
                     {}) == (-100, 200)
  assert term_bounds(maskc.parse("causal"), shape, {}) == (0, 103)
  assert term_bounds(maskc.parse("full"), shape, {}) == (0, 0)


def test_term_bounds_respect_batch_rows():
  seg = np.array([[0, 1, 2], [0, 2**40, 1]], np.int64)
  m = maskc.parse("document(seg)")
  shape = Shape.of(3)
  assert term_bounds(m, shape, {"seg": seg}) == (0, 2**40)
  assert term_bounds(m, shape, {"seg": seg}, batch=0) == (0, 2)
  assert term_bounds(m, shape, {"seg": seg}, batch=np.array([1])) == (0, 2**40)


def test_term_bounds_are_none_for_traced_values():
  m = maskc.parse("q - k < n")
  seen = []

  def f(n, off):
    seen.append(term_bounds(m, Shape.of(4, 4, off), {"n": n[None]}))
    seen.append(term_bounds(m, Shape.of(4, 4, 0), {"n": n[None]}))
    seen.append(term_bounds(maskc.parse("q - k < 2"), Shape.of(4, 4, off), {}))
    seen.append(term_bounds(maskc.parse("k < 2"), Shape.of(4, 4, off), {}))
    seen.append(term_bounds(maskc.parse("runs(g)[k] < 2"), Shape.of(4, 4, 0),
                            {"runs(g)": jnp.zeros((1, 5), jnp.int32) + n}))
    return n

  jax.jit(f)(jnp.int32(1), jnp.int32(0))
  assert seen == [None, None, None, (0, 3), (0, 3)]


def test_check_fits_names_the_innermost_term():
  m = maskc.parse("(q * 1099511627776) * 4194304 + 1 > k")
  with pytest.raises(maskc.MaskValueError) as e:
    check_fits(m, Shape.of(4), {}, bits=64, what="the test")
  assert "`q * 1099511627776 * 4194304`" in str(e.value)
  assert f"[0, {3 * 2**62}]" in str(e.value)
  assert "the test" in str(e.value)
  with pytest.raises(maskc.MaskValueError) as e:
    check_fits(m, Shape.of(4), {}, bits=32, what="the kernels", hint="do X")
  assert "`1099511627776`" in str(e.value) and "do X" in str(e.value)
  check_fits(maskc.parse("q * 1099511627776 > k"), Shape.of(4), {}, bits=64, what="x")


# ----------------------------------------------------------------------------- where clauses

WHERE_CASES = [
    ("sliding(n)", {"n": 0}, "a sliding window holds at least the query itself"),
    ("sliding(n)", {"n": -5}, "a sliding window holds at least the query itself"),
    ("sink(n)", {"n": -4}, "a sink count cannot be negative"),
    ("causal & sink(n)", {"n": np.array([3, -4])}, "a sink count cannot be negative"),
    ("local(l, r)", {"l": 2, "r": -1}, "the right reach of a local window cannot be negative"),
    ("prefix(n) | causal", {"n": -1}, "a prefix length cannot be negative"),
    ("global(n)", {"n": np.int8(-3)}, "a global-token count cannot be negative"),
    ("win(n) = k < n\n  where n >= 2 \"win needs two keys\"\nwin(m)", {"m": 1},
     "win needs two keys"),
]


@pytest.mark.parametrize("text,ops,message", WHERE_CASES, ids=[c[0][:20] for c in WHERE_CASES])
def test_static_runtime_values_breaking_where_are_refused(text, ops, message):
  runs = [lambda: maskc.materialize(text, 6, operands=ops),
          lambda: maskc.parse(text).bind(6, operands=ops),
          lambda: maskc.compile(text, 6, block_q=2, block_kv=2, operands=ops),
          lambda: maskc.materialize(text, 6, operands={n: jnp.asarray(v) for n, v in ops.items()})]
  for run in runs:
    with pytest.raises(maskc.MaskValueError, match=message) as e:
      run()
    assert "got" in str(e.value) and "requires" in str(e.value)


@pytest.mark.parametrize("text,ops", [("sliding(n)", {"n": 1}), ("sink(n)", {"n": 0}),
                                      ("causal & sink(n)", {"n": np.array([3, 0])}),
                                      ("local(l, r)", {"l": 0, "r": 2})])
def test_runtime_values_meeting_where_are_accepted(text, ops):
  out = maskc.materialize(text, 5, operands=ops)
  first = {n: np.asarray(v).reshape(-1)[-1] for n, v in ops.items()}
  want, _ = reference(text, 5, 5, 0, first)
  np.testing.assert_array_equal(out[-1] if out.ndim == 3 else out, want)


def test_traced_runtime_values_are_not_checked_and_compute_the_body():
  f = jax.jit(lambda n: maskc.materialize("sliding(n)", 4, operands={"n": n}))
  np.testing.assert_array_equal(np.asarray(f(0)), np.zeros((4, 4), bool))  # q - 0 < k <= q
  g = jax.jit(lambda n: maskc.materialize("causal | sink(n)", 4, operands={"n": n}))
  np.testing.assert_array_equal(np.asarray(g(-4)), np.tril(np.ones((4, 4), bool)))


def test_mask_function_checks_int32_for_jax_ids():
  cm = maskc.parse("q + n > 2147483647").bind(4, operands={"n": 2**31 - 2})
  q_ids, kv_ids = np.arange(4)[:, None], np.arange(4)[None, :]
  want = np.broadcast_to((np.arange(4) + 2**31 - 2 > 2**31 - 1)[:, None], (4, 4))
  np.testing.assert_array_equal(cm.mask_function(q_ids, kv_ids), want)
  with pytest.raises(maskc.MaskValueError, match="32-bit"):
    cm.mask_function(jnp.asarray(q_ids), jnp.asarray(kv_ids))
  ok = maskc.parse("q + n > 6").bind(4, operands={"n": 5})
  np.testing.assert_array_equal(np.asarray(ok.mask_function(jnp.asarray(q_ids),
                                                            jnp.asarray(kv_ids))),
                                np.broadcast_to((np.arange(4) + 5 > 6)[:, None], (4, 4)))


@given(cases(big=False))
def test_a_maps_integer_range_is_its_term_bounds(case):
  """`BlockMap.int_range`, taken from the bounds the operands' check found when bound, is
  `term_bounds` of the mask and its operands computed afresh."""
  text, q_len, kv_len, q_offset, ops = case
  m = _parse_or_none(text)
  if m is None:
    return
  ops = _used(m, ops)
  try:
    bm = maskc.compile(m, q_len, kv_len, q_offset=q_offset, operands=ops, block_q=2,
                       block_kv=2)
  except maskc.MaskValueError:
    return
  from maskc.lowering import compile as _lower
  bound = _lower.bind_masks(m, q_len, kv_len, q_offset=q_offset, operands=ops)
  assert bm.int_range == term_bounds(bound.masks, bound.shape, bound.operands,
                                     forms=bound.forms)
