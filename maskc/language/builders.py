"""Python builders: the same IR as text, written in Python.

`maskc.causal() & maskc.chunk(8192)` equals `maskc.parse("causal & chunk(8192)")`.
Each prelude mask has a builder of the same name (`global_` for `global`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from maskc.language import (
  ir,
  printer,  # noqa: F401  (the docstrings below print bodies)
)
from maskc.language.parse import prelude

q = ir.Pos("q")
k = ir.Pos("k")


def scalar(name: str) -> ir.Scalar:
  """A runtime scalar operand (shape `[]` or `[B]`): `maskc.ir.k < maskc.scalar("kv_len")`."""
  return cast(ir.Scalar, ir.term(name))  # a name makes a Scalar


class _Indexable:
  def __init__(self, name: str, runs: bool) -> None:
    self.name, self.runs = name, runs

  def __getitem__(self, idx: Any) -> ir.Read | ir.PairRead:
    if isinstance(idx, tuple):
      if self.runs or len(idx) != 2:
        raise ir.MaskTypeError("runs(x) takes one index; operands take one or two")
      return ir.pair_read(self.name, idx[0], idx[1])
    return ir.read(self.name, idx, self.runs)

  def __repr__(self) -> str:
    return f"maskc.{'runs' if self.runs else 'operand'}({self.name!r})"


def operand(name: str) -> _Indexable:
  """A per-token or pairwise operand to index: `maskc.operand("seg")[maskc.ir.q]`."""
  ir.operand(name)
  return _Indexable(name, False)


def runs(name: str) -> _Indexable:
  """`runs(x)`: per position, the 1-based index of its run of true values, 0 outside."""
  ir.operand(name)
  return _Indexable(name, True)


def truth(read: ir.Term) -> ir.Truth:
  """A boolean operand read as a mask: `maskc.truth(maskc.operand("img")[maskc.ir.q])`."""
  return ir.truth(read)


def compare(terms: Sequence[Any], ops: Sequence[str]) -> ir.Compare:
  """A chained comparison: `compare((q - w, k, q), ("<", "<="))` is `q - w < k <= q`."""
  return ir.compare(terms, ops)


def minimum(*args: Any) -> ir.Term:
  """`min(a, b, ...)`."""
  return ir.fn("min", args)


def maximum(*args: Any) -> ir.Term:
  """`max(a, b, ...)`."""
  return ir.fn("max", args)


def _builder(name: str) -> Callable[..., ir.Mask]:
  definition = prelude()[name]

  def build(*args: Any) -> ir.Mask:
    return cast(ir.Mask, ir.call(definition, args))  # a mask's definition makes a Call

  params = ", ".join(definition.params)
  build.__name__ = build.__qualname__ = name if name != "global" else "global_"
  build.__doc__ = (f"The prelude mask `{name}{f'({params})' if params else ''}` = "
                   f"`{definition.body}`.\n\nArguments are ints, operand names (str) or terms.")
  return build


full = _builder("full")
empty = _builder("empty")
causal = _builder("causal")
sliding = _builder("sliding")
local = _builder("local")
chunk = _builder("chunk")
prefix = _builder("prefix")
sink = _builder("sink")
global_ = _builder("global")
document = _builder("document")
bidirectional = _builder("bidirectional")
tree = _builder("tree")
