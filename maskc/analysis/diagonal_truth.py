"""Whether a mask holds at every pair on the diagonal `q == k`, proved from its IR.

`causal & document(seg)` holds wherever a query attends to its own key: `k <= q` and
`seg[q] == seg[k]` are true when `k` is `q`. Such a mask has a true pair in every tile
the diagonal crosses, which the static lowering would otherwise find by evaluating a
sampled pair per tile (`maskc.lowering.generic.sampling.sampled_mixed`): thousands of tiles where
short documents' edges cross the diagonal.

With `k` read as `q`, a comparison of two linear terms of the positions
(`maskc.compiled.predicate_compiler.linear_form`) is decided by the constant between them, and
so is one of two terms that become the same but for a constant (`seg[q] == seg[k]`,
`q // 8 == k // 8`, `seg[q] <= seg[k] + 1`). Masks combine three-valued: always true, always
false, or unknown (`None`), so a mask is proved only where every step is.
"""

from __future__ import annotations

from maskc.analysis.linear import linear_form
from maskc.language import ir

_CMP = {"<": lambda d: d < 0, "<=": lambda d: d <= 0, "==": lambda d: d == 0,
        "!=": lambda d: d != 0, ">=": lambda d: d >= 0, ">": lambda d: d > 0}


def true_on_diagonal(m: ir.Mask) -> bool:
  """Whether `m` is true at every pair `(p, p)`, for any operands: proved, never guessed."""
  return _truth(m) is True


def _truth(m: ir.Node) -> bool | None:
  if isinstance(m, ir.BoolConst):
    return m.value
  if isinstance(m, ir.Call):
    return _truth(ir.expand(m))
  if isinstance(m, ir.Not):
    v = _truth(m.item)
    return None if v is None else not v
  if isinstance(m, ir.And):
    return _all([_truth(i) for i in m.items])
  if isinstance(m, ir.Or):
    return _not(_all([_not(_truth(i)) for i in m.items]))
  if isinstance(m, ir.Compare):
    return _all([_link(op, a, b) for op, a, b in zip(m.ops, m.terms, m.terms[1:])])
  return None  # a truth read (`img[q]`), `^`: unknown


def _all(vals: list[bool | None]) -> bool | None:
  return False if False in vals else (True if all(v is True for v in vals) else None)


def _not(v: bool | None) -> bool | None:
  return None if v is None else not v


def _link(op: str, a: ir.Term, b: ir.Term) -> bool | None:
  """`a op b` with `k` read as `q`: decided, or None."""
  la, lb = linear_form(a), linear_form(b)
  if la is not None and lb is not None:
    if la[0] + la[1] != lb[0] + lb[1]:  # differ by a multiple of the position
      return None
    return _CMP[op](la[2] - lb[2])
  (ta, ca), (tb, cb) = _offset(a), _offset(b)  # `seg[q] <= seg[k] + 1`
  return _CMP[op](ca - cb) if _key(ta) == _key(tb) else None


def _offset(t: ir.Term) -> tuple[ir.Term, int]:
  """`t` as `base + c`, the constants it adds or subtracts taken off."""
  if isinstance(t, ir.Arith) and t.op in "+-":
    if isinstance(t.rhs, ir.Const):
      base, c = _offset(t.lhs)
      return base, c + (t.rhs.value if t.op == "+" else -t.rhs.value)
    if isinstance(t.lhs, ir.Const) and t.op == "+":
      base, c = _offset(t.rhs)
      return base, c + t.lhs.value
  return t, 0


def _key(t: ir.Node):
  """A term's structure with `k` read as `q`: equal keys, equal values on the diagonal."""
  if isinstance(t, ir.Pos):
    return ("pos",)
  if isinstance(t, (ir.Const, ir.Scalar, ir.Operand)):
    return (type(t).__name__, getattr(t, "value", None), getattr(t, "name", None))
  fields = tuple(getattr(t, f) for f in ("op", "name", "runs") if hasattr(t, f))
  return (type(t).__name__, fields) + tuple(_key(c) for c in t.children())
