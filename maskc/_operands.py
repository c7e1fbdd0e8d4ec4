"""Which runtime operands a mask needs, and of what kind."""

from __future__ import annotations

from maskc._errors import OperandError
from maskc._ir import Mask, OperandSpec, PairRead, Read, Scalar, Truth, walk


def collect_operands(m: Mask) -> tuple[OperandSpec, ...]:
  """The operands `m` reads, sorted by name; raises if one is used as two kinds."""
  kinds: dict[str, str] = {}
  boolean: dict[str, bool] = {}
  spans = {}
  for n in walk(m):
    if isinstance(n, Scalar):
      name, kind, is_bool = n.name, "scalar", False
    elif isinstance(n, Read):
      name, kind, is_bool = n.operand.name, "token", n.runs
    elif isinstance(n, PairRead):
      name, kind, is_bool = n.operand.name, "pair", False
    elif isinstance(n, Truth):
      boolean[n.read.operand.name] = True
      continue
    else:
      continue
    if name in kinds and kinds[name] != kind:
      raise OperandError(
          f"operand `{name}` is used both as a {kinds[name]} and as a {kind} operand",
          span=getattr(n, "span", None) or spans.get(name),
          hint="Give the two operands different names.")
    kinds[name] = kind
    spans.setdefault(name, getattr(n, "span", None))
    boolean[name] = boolean.get(name, False) or is_bool
  return tuple(OperandSpec(name, kinds[name], boolean.get(name, False)) for name in sorted(kinds))
