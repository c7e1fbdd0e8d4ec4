"""Facts about a mask proved from its IR alone: conjuncts, linear forms of terms, bands.

A band is `lo <= q - k <= hi`. `exact_band` says when a mask is exactly one (`causal`,
`sliding(w)`, `local(l, r)`): the lowering's closed forms for bands rest on it.
`implied_band` and `implied_chunk` are bounds any conjunction implies, which the
compiled predicate carries as facts for kernels. Nothing here reads an operand.
"""

from __future__ import annotations

import functools

from maskc.language import ir


def conjuncts(m: ir.Mask) -> list[ir.Mask]:
  """The items of `m` as a conjunction, with definitions expanded (`a & (b & c)` → a, b, c)."""
  if isinstance(m, ir.Call):
    return conjuncts(ir.expand(m))
  if isinstance(m, ir.And):
    return [x for item in m.items for x in conjuncts(item)]
  return [m]


def segment_conjunct(m: ir.Mask) -> tuple[ir.Read, ir.Read] | None:
  """`(read at q, read at k)` when `m` is `s[q] == s[k]` (either order), else None."""
  if not (isinstance(m, ir.Compare) and m.ops == ("==",)):
    return None
  a, b = m.terms
  if not (isinstance(a, ir.Read) and isinstance(b, ir.Read)):
    return None
  if a.operand.name != b.operand.name or a.runs != b.runs:
    return None
  if not (isinstance(a.index, ir.Pos) and isinstance(b.index, ir.Pos)):
    return None
  if {a.index.axis, b.index.axis} != {"q", "k"}:
    return None
  return (a, b) if a.index.axis == "q" else (b, a)


def linear_form(t: ir.Term) -> tuple[int, int, int] | None:
  """`(cq, ck, c)` with `t = cq*q + ck*k + c`, or None when `t` is not of that form."""
  if isinstance(t, ir.Const):
    return 0, 0, int(t.value)
  if isinstance(t, ir.Pos):
    return (1, 0, 0) if t.axis == "q" else (0, 1, 0)
  if isinstance(t, ir.Neg):
    a = linear_form(t.arg)
    return None if a is None else (-a[0], -a[1], -a[2])
  if isinstance(t, ir.Arith) and t.op in "+-":
    a, b = linear_form(t.lhs), linear_form(t.rhs)
    if a is None or b is None:
      return None
    s = 1 if t.op == "+" else -1
    return a[0] + s * b[0], a[1] + s * b[1], a[2] + s * b[2]
  if isinstance(t, ir.Arith) and t.op == "*":
    a, b = linear_form(t.lhs), linear_form(t.rhs)
    if a is None or b is None:
      return None
    if a[:2] == (0, 0):
      return b[0] * a[2], b[1] * a[2], b[2] * a[2]
    if b[:2] == (0, 0):
      return a[0] * b[2], a[1] * b[2], a[2] * b[2]
  return None


def implied_band(items: list[ir.Mask]) -> tuple[int | None, int | None]:
  """The tightest `lo <= q - k <= hi` implied by comparisons among the conjuncts."""
  lo, hi = None, None
  for m in items:
    if not isinstance(m, ir.Compare):
      continue
    for op, a, b in zip(m.ops, m.terms, m.terms[1:]):
      bounds = _pair_bound(op, a, b)
      if bounds is not None:
        lo, hi = _tighter((lo, hi), bounds)
  return lo, hi


@functools.lru_cache(maxsize=1024)
def exact_band(m: ir.Mask) -> tuple[int | None, int | None] | None:
  """`(lo, hi)` where `m` is exactly `lo <= q - k <= hi` (either may be None: unbounded),
  every conjunct a comparison of `q - k` with constants (`causal`, `sliding(w)`,
  `local(l, r)`); else None. Remembered: lowering asks it of each part of a mask.

  >>> import maskc
  >>> [exact_band(maskc.parse(t)) for t in ["causal", "sliding(8)", "causal & k > q - 4",
  ...                                       "causal & chunk(4)", "q - k != 2"]]
  [(0, None), (0, 7), (0, 3), None, None]
  """
  band = (None, None)
  for item in conjuncts(m):
    if not isinstance(item, ir.Compare):
      return None
    for op, a, b in zip(item.ops, item.terms, item.terms[1:]):
      bounds = _pair_bound(op, a, b)
      if bounds is None:
        return None
      band = _tighter(band, bounds)
  return band


def _pair_bound(op: str, a: ir.Term, b: ir.Term) -> tuple[int | None, int | None] | None:
  """The bounds `(lo, hi)` on `q - k` that `a op b` states, or None where it is no such
  bound."""
  la, lb = linear_form(a), linear_form(b)
  if la is None or lb is None:
    return None
  cq, ck, c = la[0] - lb[0], la[1] - lb[1], la[2] - lb[2]   # lhs - rhs = s*d + c
  if cq == 0 or cq != -ck or abs(cq) != 1:
    return None
  # s*d + c (op) 0  →  bounds on d = q - k
  bounds = {"<": (None, -c - 1), "<=": (None, -c), ">": (-c + 1, None), ">=": (-c, None),
            "==": (-c, -c)}.get(op)
  if bounds is None:
    return None
  b_lo, b_hi = bounds
  if cq < 0:
    b_lo, b_hi = (None if b_hi is None else -b_hi), (None if b_lo is None else -b_lo)
  return b_lo, b_hi


def _tighter(band, bounds):
  """The intersection of two `(lo, hi)` bands (None: unbounded)."""
  (lo, hi), (b_lo, b_hi) = band, bounds
  if b_lo is not None:
    lo = b_lo if lo is None else max(lo, b_lo)
  if b_hi is not None:
    hi = b_hi if hi is None else min(hi, b_hi)
  return lo, hi


def implied_chunk(items: list[ir.Mask]) -> int | None:
  """`c` when a conjunct is `q // c == k // c` (c > 0), else None."""
  for m in items:
    if not (isinstance(m, ir.Compare) and m.ops == ("==",)):
      continue
    a, b = (_divided(t) for t in m.terms)
    if a is None or b is None:
      continue
    if {a[0], b[0]} == {"q", "k"} and a[1] == b[1] > 0:
      return int(a[1])
  return None


def _divided(t: ir.Term) -> tuple[str, int] | None:
  """`(axis, c)` when `t` is `axis // c`, else None."""
  if (isinstance(t, ir.Arith) and t.op == "//" and isinstance(t.lhs, ir.Pos)
      and isinstance(t.rhs, ir.Const)):
    return t.lhs.axis, t.rhs.value
  return None
