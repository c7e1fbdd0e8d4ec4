"""Whether a mask holds at every pair on the diagonal `q == k`, proved from its IR.

`causal & document(seg)` holds wherever a query attends to its own key: `k <= q` and
`seg[q] == seg[k]` are true when `k` is `q`. Such a mask has a true pair in every tile
the diagonal crosses, which the static lowering would otherwise find by evaluating a
sampled pair per tile (`maskc._lower_static._sampled_mixed`): thousands of tiles where
short documents' edges cross the diagonal.

With `k` read as `q`, each comparison's sides are sums of the positions, constants
and opaque terms (operand reads, products, divisions); a comparison whose sides
differ by a constant is decided. Masks combine three-valued: always true, always
false, or unknown (`None`), so a mask is proved only where every step is.
"""

from __future__ import annotations

from collections import Counter

from maskc import _ir as ir

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
    vals = [_truth(i) for i in m.items]
    return False if False in vals else (True if all(v is True for v in vals) else None)
  if isinstance(m, ir.Or):
    vals = [_truth(i) for i in m.items]
    return True if True in vals else (False if all(v is False for v in vals) else None)
  if isinstance(m, ir.Compare):
    vals = []
    for op, a, b in zip(m.ops, m.terms, m.terms[1:]):
      d = _linear(a) - _linear(b)
      vals.append(None if d.atoms else _CMP[op](d.const))
    return False if False in vals else (True if all(v is True for v in vals) else None)
  return None  # a truth read (`img[q]`), `^`: unknown


class _Linear:
  """`const + sum(coef * atom)` with `k` read as `q`: atoms are `q` and opaque terms."""

  def __init__(self, const: int = 0, atoms: Counter | None = None):
    self.const = const
    self.atoms = Counter({a: c for a, c in (atoms or {}).items() if c})

  def __add__(self, other: "_Linear") -> "_Linear":
    atoms = Counter(self.atoms)
    atoms.update(other.atoms)
    return _Linear(self.const + other.const, atoms)

  def __mul__(self, c: int) -> "_Linear":
    return _Linear(self.const * c, Counter({a: v * c for a, v in self.atoms.items()}))

  def __sub__(self, other: "_Linear") -> "_Linear":
    return self + other * -1


def _linear(t: ir.Term) -> _Linear:
  if isinstance(t, ir.Const):
    return _Linear(t.value)
  if isinstance(t, ir.Pos):
    return _Linear(0, Counter({"q": 1}))
  if isinstance(t, ir.Neg):
    return _linear(t.arg) * -1
  if isinstance(t, ir.Arith) and t.op in "+-":
    a, b = _linear(t.lhs), _linear(t.rhs)
    return a + b if t.op == "+" else a - b
  if isinstance(t, ir.Arith) and t.op == "*":
    a, b = _linear(t.lhs), _linear(t.rhs)
    if not b.atoms:
      return a * b.const
    if not a.atoms:
      return b * a.const
  return _Linear(0, Counter({_key(t): 1}))


def _key(t: ir.Node):
  """A term's structure with `k` read as `q`: equal keys, equal values on the diagonal."""
  if isinstance(t, ir.Pos):
    return ("pos",)
  if isinstance(t, (ir.Const, ir.Scalar, ir.Operand)):
    return (type(t).__name__, getattr(t, "value", None), getattr(t, "name", None))
  fields = tuple(getattr(t, f) for f in ("op", "name", "runs") if hasattr(t, f))
  return (type(t).__name__, fields) + tuple(_key(c) for c in t.children())
