"""Diagonal periods: how far a mask can be moved along the diagonal and stay the same.

Many masks depend on the positions only through `q - k` and through `q`, `k`
modulo or divided by constants: `causal`, `sliding(w)`, `chunk(n)`,
`(q - k) % 4 == 0`. Such a mask has a *diagonal period* `P`: `m(q + P, k + P) ==
m(q, k)` for every `q`, `k`. On a tile grid whose tile sizes divide `P`, tile
`(i + P / bq, j + P / bk)` then has the state of tile `(i, j)`, so the lowering
classifies one period of rows (and of columns) and repeats it, instead of
classifying every tile, whatever the period's fine structure (`%` terms make
every tile of a band PARTIAL).

The period is derived from the IR alone: each term shifts by `alpha * P` when
both positions shift by `P` (`q`, `k`: alpha 1; constants: 0; `a // n`: alpha / n,
when `n` divides the shift), and a comparison is invariant when its sides shift
alike. Operand reads are invariant only at an invariant index.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import cast

from maskc.language import ir

MAX_PERIOD = 1 << 40  # larger periods are not worth finding


class _NotPeriodic(Exception):
  pass


@functools.lru_cache(maxsize=4096)
def diagonal_period(m: ir.Mask) -> int | None:
  """The smallest diagonal period of `m` in positions, or None when it has none we can prove.

  >>> import maskc
  >>> [diagonal_period(maskc.parse(t)) for t in ["causal", "causal & chunk(8192)",
  ...                                            "(q - k) % 4 == 0", "q % 6 == k % 4", "q < 5"]]
  [1, 8192, 1, 12, None]
  """
  need: list[int] = []
  try:
    _mask(m, need, ir.NodeMemo())
  except _NotPeriodic:
    return None
  period = 1
  for n in need:
    period = math.lcm(period, n)
    if period > MAX_PERIOD:
      return None
  return period


def _mask(m: ir.Mask, need: list[int], memo: ir.NodeMemo) -> None:
  if isinstance(m, ir.BoolConst):
    return
  if isinstance(m, ir.Call):
    return _mask(ir.expand(m), need, memo)
  if isinstance(m, ir.Compare):
    shifts = {_term(t, need, memo) for t in m.terms}
    if len(shifts) > 1:
      raise _NotPeriodic
    return
  if isinstance(m, ir.Truth):
    if _term(m.read, need, memo) != 0:
      raise _NotPeriodic
    return
  if isinstance(m, ir.Not):
    return _mask(m.item, need, memo)
  if isinstance(m, (ir.And, ir.Or, ir.Xor)):
    for item in m.items:
      _mask(item, need, memo)
    return
  raise _NotPeriodic


def _require(alpha: Fraction, n: int, need: list[int]) -> None:
  """Asks that `alpha * P` be a multiple of `n`."""
  if alpha == 0:
    return
  a, b = abs(alpha.numerator), alpha.denominator
  need.append(n * b // math.gcd(a, n * b))


def _term(t: ir.Term, need: list[int], memo: ir.NodeMemo) -> Fraction:
  """`alpha`: the term moves by `alpha * P` when both positions move by `P`."""
  if t not in memo:
    memo[t] = _shift(t, need, memo)
  return memo[t]


def _shift(t: ir.Term, need: list[int], memo: ir.NodeMemo) -> Fraction:
  if isinstance(t, (ir.Const, ir.Scalar)):
    return Fraction(0)
  if isinstance(t, ir.Pos):
    return Fraction(1)
  if isinstance(t, ir.Read):
    if _term(t.index, need, memo) != 0:
      raise _NotPeriodic
    return Fraction(0)
  if isinstance(t, ir.PairRead):
    if _term(t.q_index, need, memo) != 0 or _term(t.k_index, need, memo) != 0:
      raise _NotPeriodic
    return Fraction(0)
  if isinstance(t, ir.Neg):
    return -_term(t.arg, need, memo)
  if isinstance(t, ir.Arith):
    a = _term(t.lhs, need, memo)
    b = _term(t.rhs, need, memo)
    if t.op == "+":
      return a + b
    if t.op == "-":
      return a - b
    if t.op == "*":
      c = t.lhs.value if isinstance(t.lhs, ir.Const) else cast(ir.Const, t.rhs).value
      other = b if isinstance(t.lhs, ir.Const) else a
      return other * c
    n = cast(ir.Const, t.rhs).value  # `//` and `%` divide by a constant (`ir.arith`)
    if n == 0:
      raise _NotPeriodic
    _require(a, abs(n), need)  # the shift must be a whole number of divisors
    return a / n if t.op == "//" else Fraction(0)
  if isinstance(t, ir.Fn):
    shifts = {_term(a, need, memo) for a in t.args}
    if t.name == "abs" and shifts != {0}:
      raise _NotPeriodic
    if len(shifts) > 1:
      raise _NotPeriodic
    return shifts.pop()
  raise _NotPeriodic
