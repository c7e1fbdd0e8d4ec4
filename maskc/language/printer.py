"""The canonical printer: IR back to text that parses to an equal mask.

Named masks keep their names (`causal & chunk(8192)`), user definitions are
printed before the mask that uses them, and parentheses appear only where the
grammar's precedence needs them. `to_python` gives the Python builder form
used by `repr`.
"""

from __future__ import annotations

from maskc.language import ir
from maskc.language.errors import MaskLimitError

# `str` and `repr` print at most this many nodes, so that a term built by nested definitions
# (`f(f(f(...)))` with `f(x) = x + x` doubles with each level) raises instead of hanging.
MAX_PRINTED_NODES = 1_000_000

_OR, _XOR, _AND, _NOT, _CMP, _SUM, _PROD, _UNARY, _ATOM = range(1, 10)


def _prec(n: ir.Node) -> int:
  if isinstance(n, ir.Or):
    return _OR
  if isinstance(n, ir.Xor):
    return _XOR
  if isinstance(n, ir.And):
    return _AND
  if isinstance(n, ir.Not):
    return _NOT
  if isinstance(n, ir.Compare):
    return _CMP
  if isinstance(n, ir.Arith):
    return _SUM if n.op in "+-" else _PROD
  if isinstance(n, ir.Neg) or (isinstance(n, ir.Const) and n.value < 0):
    return _UNARY
  return _ATOM


class _Budget:
  """Nodes a printer call may still print: printing stops, in bounded time, past the limit."""

  __slots__ = ("left",)

  def __init__(self, limit: int):
    self.left = limit


def _too_large() -> MaskLimitError:
  return MaskLimitError(
      f"the mask is too large to print (more than {MAX_PRINTED_NODES} nodes)",
      hint="Nested definitions multiply: `f(f(f(q)))` with `f(x) = x + x` prints eight `q`s.")


def _text(n: ir.Node, min_prec: int, b: _Budget) -> str:
  s = _bare(n, b)
  return f"({s})" if _prec(n) < min_prec else s


def _bare(n: ir.Node, b: _Budget) -> str:
  b.left -= 1
  if b.left < 0:
    raise _too_large()
  if isinstance(n, ir.Or):
    return " | ".join(_text(i, _OR + 1, b) for i in n.items)
  if isinstance(n, ir.Xor):
    return " ^ ".join(_text(i, _XOR + 1, b) for i in n.items)
  if isinstance(n, ir.And):
    return " & ".join(_text(i, _AND + 1, b) for i in n.items)
  if isinstance(n, ir.Not):
    return "~" + _text(n.item, _NOT, b)
  if isinstance(n, ir.Compare):
    out = [_text(n.terms[0], _SUM, b)]
    for op, t in zip(n.ops, n.terms[1:]):
      out += [op, _text(t, _SUM, b)]
    return " ".join(out)
  if isinstance(n, ir.Arith):
    if n.op in "+-":
      return f"{_text(n.lhs, _SUM, b)} {n.op} {_text(n.rhs, _PROD, b)}"
    return f"{_text(n.lhs, _PROD, b)} {n.op} {_text(n.rhs, _UNARY, b)}"
  if isinstance(n, ir.Neg):
    return "-" + _text(n.arg, _UNARY, b)
  if isinstance(n, ir.Const):
    return str(n.value)
  if isinstance(n, ir.Pos):
    return n.axis
  if isinstance(n, (ir.Scalar, ir.Operand, ir.Param)):
    return n.name
  if isinstance(n, ir.BoolConst):
    return "true" if n.value else "false"
  if isinstance(n, ir.Fn):
    return f"{n.name}({', '.join(_text(a, 0, b) for a in n.args)})"
  if isinstance(n, ir.Read):
    base = f"runs({n.operand.name})" if n.runs else n.operand.name
    return f"{base}[{_text(n.index, 0, b)}]"
  if isinstance(n, ir.PairRead):
    return f"{n.operand.name}[{_text(n.q_index, 0, b)}, {_text(n.k_index, 0, b)}]"
  if isinstance(n, ir.Truth):
    return _bare(n.read, b)
  if isinstance(n, ir.Call):
    return n.name + (f"({', '.join(_text(a, 0, b) for a in n.args)})" if n.args else "")
  if isinstance(n, ir.Definition):
    return _definition_text(n, b)
  raise TypeError(f"cannot print {type(n).__name__}")


def _definition_text(d: ir.Definition, b: _Budget) -> str:
  head = d.name + (f"({', '.join(d.params)})" if d.params else "")
  lines = [f"{head} = {_text(d.body, 0, b)}"]
  for cond, message in d.requirements:
    lines.append(f'  where {_text(cond, 0, b)} "{message}"')
  return "\n".join(lines)


def user_definitions(n: ir.Node) -> list[ir.Definition]:
  """The non-prelude definitions `n` uses, each after those it depends on."""
  order: list[ir.Definition] = []
  seen: set[int] = set()

  def visit(node: ir.Node) -> None:
    for m in ir.walk(node, into_calls=False):
      if isinstance(m, ir.Call) and not m.definition.prelude and id(m.definition) not in seen:
        seen.add(id(m.definition))
        visit(m.definition.body)
        for cond, _ in m.definition.requirements:
          visit(cond)
        order.append(m.definition)

  visit(n)
  unique: dict[ir.Definition, None] = dict.fromkeys(order)
  return list(unique)


def to_text(n: ir.Node) -> str:
  """Canonical text: user definitions first (one per line), then the mask."""
  defs = user_definitions(n) if isinstance(n, ir.Mask) else []
  b = _Budget(MAX_PRINTED_NODES)
  return "\n".join([_definition_text(d, b) for d in defs] + [_text(n, 0, b)])


# ----------------------------------------------------------------------------- python form

_PY_NAMES = {"global": "global_"}


def to_python(n: ir.Node) -> str:
  """The Python builder expression that constructs `n`."""
  s = _py(n, _Budget(MAX_PRINTED_NODES))
  return s[1:-1] if s.startswith("(") and s.endswith(")") and _balanced(s[1:-1]) else s


def _balanced(s: str) -> bool:
  depth = 0
  for ch in s:
    depth += ch == "("
    depth -= ch == ")"
    if depth < 0:
      return False
  return depth == 0


def _py(n: ir.Node, b: _Budget) -> str:
  b.left -= 1
  if b.left < 0:
    raise _too_large()
  if isinstance(n, (ir.And, ir.Or, ir.Xor)):
    op = {ir.And: " & ", ir.Or: " | ", ir.Xor: " ^ "}[type(n)]
    return "(" + op.join(_py(i, b) for i in n.items) + ")"
  if isinstance(n, ir.Not):
    return "~" + _py(n.item, b)
  if isinstance(n, ir.Compare):
    terms = ", ".join(_py(t, b) for t in n.terms)
    if len(n.ops) == 1 and not isinstance(n.terms[0], ir.Const):
      lhs, rhs = _py(n.terms[0], b), _py(n.terms[1], b)
      op = n.ops[0]
      if op in ("==", "!="):
        return f"{lhs}.{'eq' if op == '==' else 'ne'}({rhs})"
      return f"({lhs} {op} {rhs})"
    return f"maskc.compare(({terms},), {n.ops!r})"
  if isinstance(n, ir.Arith):
    return f"({_py(n.lhs, b)} {n.op} {_py(n.rhs, b)})"
  if isinstance(n, ir.Neg):
    return f"(-{_py(n.arg, b)})"
  if isinstance(n, ir.Const):
    return str(n.value)
  if isinstance(n, ir.Pos):
    return f"maskc.ir.{n.axis}"
  if isinstance(n, ir.Scalar):
    return f"maskc.scalar({n.name!r})"
  if isinstance(n, ir.Operand):
    return repr(n.name)
  if isinstance(n, ir.Param):
    return f"<param {n.name}>"
  if isinstance(n, ir.Fn):
    name = {"abs": "abs", "min": "maskc.minimum", "max": "maskc.maximum"}[n.name]
    return f"{name}({', '.join(_py(a, b) for a in n.args)})"
  if isinstance(n, ir.Read):
    base = "runs" if n.runs else "operand"
    return f"maskc.{base}({n.operand.name!r})[{_py(n.index, b)}]"
  if isinstance(n, ir.PairRead):
    return f"maskc.operand({n.operand.name!r})[{_py(n.q_index, b)}, {_py(n.k_index, b)}]"
  if isinstance(n, ir.Truth):
    return f"maskc.truth({_py(n.read, b)})"
  if isinstance(n, ir.Call) and n.definition.prelude:
    return f"maskc.{_PY_NAMES.get(n.name, n.name)}({', '.join(_py(a, b) for a in n.args)})"
  if isinstance(n, ir.Definition):
    return f"<definition {n.name}>"
  return f"maskc.parse({to_text(n)!r})"


# ----------------------------------------------------------------------------- on the IR

ir.install(text=to_text, python=to_python)
