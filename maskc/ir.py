"""The mask IR, public: the node classes a parsed or built mask is made of, and the
position atoms `q` and `k`.

A mask is a tree of these nodes (`maskc.parse` builds one; so do the builders and
Python operators). They are frozen and hashable, compare structurally, print as
their canonical text (`str`) and as the builder expression that makes them
(`repr`). Build masks with `maskc.parse` and the builders rather than with the
classes' constructors; match on the classes to inspect a mask.

>>> import maskc
>>> from maskc.ir import And, q, k
>>> m = maskc.parse("causal & chunk(8)")
>>> isinstance(m, And), str(q - k < 8)
(True, 'q - k < 8')
"""

from maskc.language.builders import k as k, q as q
from maskc.language.ir import (
  And as And,
  Arith as Arith,
  BoolConst as BoolConst,
  Call as Call,
  Compare as Compare,
  Const as Const,
  Definition as Definition,
  Fn as Fn,
  Mask as Mask,
  Neg as Neg,
  Node as Node,
  Not as Not,
  Operand as Operand,
  OperandSpec as OperandSpec,
  Or as Or,
  PairRead as PairRead,
  Pos as Pos,
  Read as Read,
  Scalar as Scalar,
  Term as Term,
  Truth as Truth,
  Xor as Xor,
)

__all__ = ["And", "Arith", "BoolConst", "Call", "Compare", "Const", "Definition", "Fn", "Mask",
           "Neg", "Node", "Not", "Operand", "OperandSpec", "Or", "PairRead", "Pos", "Read",
           "Scalar", "Term", "Truth", "Xor", "k", "q"]
