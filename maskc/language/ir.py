"""The mask IR: immutable, hashable nodes for integer terms and masks.

Nodes are data. Frozen, slotted dataclasses with structural equality and a
cached hash, so masks can be compared, cached, simplified and checked for
equivalence. Source spans ride along but take no part in equality.

Every node is built through the constructors at the bottom of this module
(`arith`, `compare`, `read`, `call`, ...). The parser, the Python builders and
template substitution all go through them, so the three give the same IR and
the same errors. Named masks (the prelude, user definitions) stay as `Call`
nodes holding their `Definition`; `expand(call)` gives the body with arguments
substituted, which is what evaluation and analysis look at.

This module is the ground floor of the compiler: it imports nothing of maskc but
the error hierarchy. Methods whose work lives in a stage above are declared here
and call the implementation that stage hands down (`install`): `str` and `repr`
(the printer), `Mask.simplify` (the simplifier), `Mask.bind` and `Mask.to_dense`
(the binding), and the parser that reads text operands such as `mask & "causal"`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, cast, dataclass_transform

from maskc.language.errors import (
  MaskLimitError,
  MaskNameError,
  MaskTypeError,
  MaskValueError,
  OperandError,
  Span,
  Unbound,
  nearest as nearest,
)

if TYPE_CHECKING:
  import numpy as np

CompareOp = Literal["<", "<=", "==", "!=", ">=", ">"]
ArithOp = Literal["+", "-", "*", "//", "%"]
FnName = Literal["abs", "min", "max"]
OperandKind = Literal["scalar", "token", "pair"]
COMPARE_OPS = ("<", "<=", "==", "!=", ">=", ">")
NEGATED_OP = {"<": ">=", "<=": ">", "==": "!=", "!=": "==", ">=": "<", ">": "<="}


_N = TypeVar("_N", bound="Node")


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def _node(cls: type[_N]) -> type[_N]:
  """Makes `cls` a frozen slotted dataclass with a cached structural hash."""
  cls = dataclasses.dataclass(frozen=True, slots=True, repr=False)(cls)
  generated_hash = cls.__hash__
  generated_eq = cls.__eq__

  def __hash__(self):
    try:
      return self._h
    except AttributeError:
      h = generated_hash(self)
      object.__setattr__(self, "_h", h)
      return h

  def __eq__(self, other):
    if self is other:
      return True
    if type(other) is not type(self):
      return NotImplemented
    if hash(self) != hash(other):
      return False
    return generated_eq(self, other)

  target: Any = cls  # the generated methods are replaced on purpose
  target.__hash__ = __hash__
  target.__eq__ = __eq__
  return cls


def _span_field():
  return dataclasses.field(default=None, compare=False, repr=False)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
  return tuple(f.name for f in dataclasses.fields(cls))


class Node:
  """Base of every IR node."""

  __slots__ = ("_h",)

  def children(self) -> tuple[Node, ...]:
    """The IR nodes directly below this one (not a Call's expansion)."""
    out = []
    cls: type = type(self)
    for name in _field_names(cls):
      v = getattr(self, name)
      if isinstance(v, Node):
        out.append(v)
      elif isinstance(v, tuple):
        out.extend(x for x in v if isinstance(x, Node))
    return tuple(out)

  def __str__(self) -> str:
    """The canonical text of the node; it parses back to an equal node
    (`maskc.language.printer.to_text`)."""
    return _above("text")(self)

  def __repr__(self) -> str:
    """The Python builder expression that constructs the node
    (`maskc.language.printer.to_python`)."""
    return _above("python")(self)

  def _repr_pretty_(self, p, cycle) -> None:  # IPython and hypothesis
    p.text(repr(self))


class Term(Node):
  """An integer term of the positions `q`, `k`, constants and operands.

  Python operators build terms: `maskc.ir.q - maskc.ir.k < 128` is a `Compare`.
  """

  __slots__ = ()
  span: Span | None  # every term has one (a field of each node class)

  def __add__(self, other): return arith("+", self, other)
  def __radd__(self, other): return arith("+", other, self)
  def __sub__(self, other): return arith("-", self, other)
  def __rsub__(self, other): return arith("-", other, self)
  def __mul__(self, other): return arith("*", self, other)
  def __rmul__(self, other): return arith("*", other, self)
  def __floordiv__(self, other): return arith("//", self, other)
  def __rfloordiv__(self, other): return arith("//", other, self)
  def __mod__(self, other): return arith("%", self, other)
  def __rmod__(self, other): return arith("%", other, self)
  def __neg__(self): return neg(self)
  def __abs__(self): return fn("abs", (self,))
  def __lt__(self, other): return compare((self, other), ("<",))
  def __le__(self, other): return compare((self, other), ("<=",))
  def __gt__(self, other): return compare((self, other), (">",))
  def __ge__(self, other): return compare((self, other), (">=",))

  def __and__(self, other): return and_((mask(self), mask(other)))
  def __rand__(self, other): return and_((mask(other), mask(self)))
  def __or__(self, other): return or_((mask(self), mask(other)))
  def __ror__(self, other): return or_((mask(other), mask(self)))
  def __xor__(self, other): return xor((mask(self), mask(other)))
  def __rxor__(self, other): return xor((mask(other), mask(self)))
  def __invert__(self): return not_(mask(self))

  def eq(self, other) -> Compare:
    """`self == other` as a mask (Python's `==` stays structural equality)."""
    return compare((self, other), ("==",))

  def ne(self, other) -> Compare:
    """`self != other` as a mask."""
    return compare((self, other), ("!=",))

  def __bool__(self):
    raise MaskTypeError(
        "an integer term has no truth value",
        hint="Compare it to make a mask: `maskc.ir.q - maskc.ir.k < 128`.")


class Mask(Node):
  """A boolean predicate over a query position `q` and a key position `k`.

  Combine masks with `&` (intersection), `|` (union), `^` (symmetric
  difference) and `~` (complement). `str(mask)` is its canonical text.

  >>> import maskc
  >>> str(maskc.causal() & maskc.chunk(8192))
  'causal & chunk(8192)'
  """

  __slots__ = ()
  span: Span | None  # every mask has one (a field of each node class)

  def __and__(self, other): return and_((self, _as_mask(other)))
  def __rand__(self, other): return and_((_as_mask(other), self))
  def __or__(self, other): return or_((self, _as_mask(other)))
  def __ror__(self, other): return or_((_as_mask(other), self))
  def __xor__(self, other): return xor((self, _as_mask(other)))
  def __rxor__(self, other): return xor((_as_mask(other), self))
  def __invert__(self): return not_(self)

  def __bool__(self):
    raise MaskTypeError(
        "a mask has no truth value",
        hint="Use `&`, `|` and `~` to combine masks, not `and`, `or` and `not`; "
             "for a chained comparison write `maskc.parse('a < b <= c')` or "
             "`(a < b) & (b <= c)`.")

  @property
  def operands(self) -> tuple[OperandSpec, ...]:
    """The runtime operands the mask needs, sorted by name."""
    return collect_operands(self)

  def simplify(self) -> Mask:
    """An equivalent mask in canonical simplified form (`maskc.language.simplify`).

    >>> import maskc
    >>> str(maskc.parse("~~causal & (sink(4) | causal)").simplify())
    'causal'
    """
    return _above("simplify")(self)

  def bind(self, q_len: int, kv_len: int | None = None, *, q_offset: int | None = None,
           operands: Mapping[str, Any] | None = None, q_positions: Any = None,
           kv_positions: Any = None) -> Bound:
    """This mask at a shape with static operands (and positions): a lazy `ComputableMask`
    (`maskc.semantics.bind`; typed here by what it offers, `Bound`).

    >>> import maskc
    >>> maskc.parse("causal").bind(3)[1:, :].astype(int)
    array([[1, 1, 0],
           [1, 1, 1]])
    """
    return _above("bind")(self, q_len, kv_len, q_offset=q_offset, operands=operands,
                          q_positions=q_positions, kv_positions=kv_positions)

  def to_dense(self, q_len: int, kv_len: int | None = None, *, q_offset: int | None = None,
               operands: Mapping[str, Any] | None = None, q_positions: Any = None,
               kv_positions: Any = None) -> np.ndarray:
    """The mask as a NumPy bool array `[..., q_len, kv_len]`.

    >>> import maskc
    >>> maskc.parse("causal").to_dense(2, 3).astype(int)
    array([[1, 1, 0],
           [1, 1, 1]])
    """
    return self.bind(q_len, kv_len, q_offset=q_offset, operands=operands,
                     q_positions=q_positions, kv_positions=kv_positions)[:, :]


class Bound(Protocol):
  """What `Mask.bind` returns (`maskc.ComputableMask`, built in `maskc.semantics.bind`): a
  mask at a shape, lazy and sliceable. `bound[q0:q1, k0:k1]` evaluates that tile alone.

  The IR is the ground floor and imports nothing above it, so it names the bound mask by
  what it offers rather than by its class.
  """

  @property
  def mask(self) -> Mask: ...

  @property
  def q_len(self) -> int: ...

  @property
  def kv_len(self) -> int: ...

  @property
  def q_offset(self) -> int: ...

  @property
  def shape(self) -> tuple[int, ...]: ...

  def __getitem__(self, idx: Any) -> np.ndarray: ...


# ----------------------------------------------------------------------------- from above

# The IR is the ground floor: the stages built on it (the printer, the simplifier, the
# parser, the binding) hand their implementations down through `install` when they are
# imported, and the methods above call them. `import maskc` imports them all.
_ABOVE: dict[str, Callable[..., Any]] = {}
_WHERE = {"text": "maskc.language.printer", "python": "maskc.language.printer",
          "simplify": "maskc.language.simplify", "parse": "maskc.language.parse",
          "mask_names": "maskc.language.parse", "bind": "maskc.semantics.bind"}


def install(**implementations: Callable[..., Any]) -> None:
  """Hands an implementation from a stage above down to the IR, by name: `text` and
  `python` (the printer), `simplify`, `parse` and `mask_names` (the parser), `bind`."""
  unknown = set(implementations) - set(_WHERE)
  if unknown:
    raise ValueError(f"no IR hook named {sorted(unknown)}")
  _ABOVE.update(implementations)


def _above(name: str) -> Callable[..., Any]:
  try:
    return _ABOVE[name]
  except KeyError:
    raise ImportError(f"the IR needs {_WHERE[name]} for this: `import maskc` first") from None


def _as_mask(value) -> Mask:
  if isinstance(value, (Mask, Read, PairRead)):
    return mask(value)
  if isinstance(value, str) and "parse" in _ABOVE:
    return _ABOVE["parse"](value)
  raise MaskTypeError(f"cannot combine a mask with {type(value).__name__} {quote(value)}",
                      hint="Combine masks with masks: `maskc.causal() & maskc.chunk(8192)`.")


# ----------------------------------------------------------------------------- terms


@_node
class Const(Term):
  """An integer literal or a parameter bound at parse time."""
  value: int
  span: Span | None = _span_field()


@_node
class Pos(Term):
  """The query position `q` or the key position `k`."""
  axis: Literal["q", "k"]
  span: Span | None = _span_field()


@_node
class Operand(Node):
  """A runtime operand by name, as passed to a definition: `document(seg)`."""
  name: str
  span: Span | None = _span_field()


@_node
class Param(Term, Mask):
  """A definition's parameter inside its body; replaced when the call expands."""
  name: str
  span: Span | None = _span_field()


@_node
class Scalar(Term):
  """A runtime scalar operand (shape `[]` or `[B]`): `k < kv_len`."""
  name: str
  span: Span | None = _span_field()


@_node
class Read(Term):
  """A per-token operand read at a term of one position: `seg[q]`, `doc[q // 2]`.

  With `runs=True` it reads `runs(x)`: the 1-based index of the run of true
  values of `x` the position lies in, 0 outside runs.
  """
  operand: Operand | Param
  index: Term
  runs: bool = False
  span: Span | None = _span_field()


@_node
class PairRead(Term):
  """A pairwise operand read: `allowed[q, k]`, `topk[q // 64, k // 64]`."""
  operand: Operand | Param
  q_index: Term
  k_index: Term
  span: Span | None = _span_field()


@_node
class Neg(Term):
  """`-t`."""
  arg: Term
  span: Span | None = _span_field()


@_node
class Arith(Term):
  """`lhs op rhs`; `*`, `//` and `%` take a constant on one side (the right for `//`, `%`)."""
  op: ArithOp
  lhs: Term
  rhs: Term
  span: Span | None = _span_field()


@_node
class Fn(Term):
  """`abs(t)`, `min(a, b, ...)` or `max(a, b, ...)`."""
  name: FnName
  args: tuple[Term, ...]
  span: Span | None = _span_field()


# ----------------------------------------------------------------------------- masks


@_node
class BoolConst(Mask):
  """`true` or `false` (the prelude names them `full` and `empty`)."""
  value: bool
  span: Span | None = _span_field()


@_node
class Compare(Mask):
  """A chain of comparisons `t0 op0 t1 op1 t2 ...`: true where every link holds.

  >>> import maskc
  >>> maskc.parse("q - k < 2").to_dense(3, 3).astype(int)
  array([[1, 1, 1],
         [1, 1, 1],
         [0, 1, 1]])
  """
  terms: tuple[Term, ...]
  ops: tuple[CompareOp, ...]
  span: Span | None = _span_field()


@_node
class Truth(Mask):
  """A boolean operand read used as a mask: `img[q]`, `allowed[q, k]` (nonzero is true)."""
  read: Read | PairRead
  span: Span | None = _span_field()


@_node
class And(Mask):
  """Intersection of two or more masks."""
  items: tuple[Mask, ...]
  span: Span | None = _span_field()


@_node
class Or(Mask):
  """Union of two or more masks."""
  items: tuple[Mask, ...]
  span: Span | None = _span_field()


@_node
class Xor(Mask):
  """Symmetric difference: true where an odd number of the masks is true."""
  items: tuple[Mask, ...]
  span: Span | None = _span_field()


@_node
class Not(Mask):
  """Complement."""
  item: Mask
  span: Span | None = _span_field()


@_node
class Definition(Node):
  """A named definition `name(params) = body where requirements`.

  The body and requirements are templates: they hold `Param` nodes for the
  parameters. `prelude` marks the standard masks of `maskc/grammar/prelude.mask`.
  """
  name: str
  params: tuple[str, ...]
  body: Node
  requirements: tuple[tuple[Mask, str], ...] = ()
  prelude: bool = False


@_node
class Call(Mask):
  """A named mask applied to arguments: `causal`, `chunk(8192)`, `document(seg)`.

  The canonical printer keeps the name; `expand(call)` gives its meaning.
  """
  name: str
  args: tuple[Node, ...]
  definition: Definition = dataclasses.field(repr=False)
  span: Span | None = _span_field()


@dataclasses.dataclass(frozen=True, slots=True)
class OperandSpec:
  """A runtime operand a mask needs.

  Attributes:
    name: the operand's name in the mask text.
    kind: "scalar" (shape `[]` or `[B]`), "token" (`[L]` or `[B, L]`, indexed by
      position) or "pair" (`[Lq', Lk']` or `[B, Lq', Lk']`, indexed by a term of
      `q` and one of `k`).
    boolean: whether it is read as a truth value (`img[q]`, `runs(img)`).
  """
  name: str
  kind: OperandKind
  boolean: bool = False


# ----------------------------------------------------------------------------- constructors

MAX_ABS_CONST = 2**40


def _const(value: int, span: Span | None) -> Const:
  if abs(value) > MAX_ABS_CONST:
    raise MaskValueError(f"integer {value} is out of range (|n| <= 2**40)", span=span)
  return Const(int(value), span)


def term(value: Any, span: Span | None = None) -> Term:
  """Coerces a Python int, operand name or term to a `Term`."""
  if isinstance(value, bool):
    raise MaskTypeError(f"expected an integer term, got the boolean {value}", span=span,
                        hint="Use `full` or `empty` for constant masks.")
  if isinstance(value, int):
    return _const(value, span)
  if isinstance(value, Term):
    return value
  if isinstance(value, Operand):
    return Scalar(value.name, value.span or span)
  if isinstance(value, str):
    return Scalar(value, span)
  if isinstance(value, Mask):
    raise MaskTypeError(f"expected an integer term, got the mask {quote(value)}", span=span,
                        hint="Masks combine with `&`, `|`, `^`, `~`; integer terms compare with "
                             "`<`, `<=`, `==`, ...")
  raise MaskTypeError(f"expected an integer term, got {type(value).__name__} {quote(value)}",
                      span=span)


def mask(value: Any, span: Span | None = None) -> Mask:
  """Coerces a value to a `Mask`, with a hint when it is something else."""
  if isinstance(value, Mask):
    return value
  if isinstance(value, (Read, PairRead)):
    return Truth(value, span)
  if isinstance(value, Term):
    raise MaskTypeError("expected a mask, got an integer term", span=span,
                        hint="Compare the term to make a mask, e.g. `q - k < 128`; a boolean "
                             "operand is a mask when indexed: `img[q]`.")
  if isinstance(value, Operand):
    raise MaskNameError(f"`{value.name}` is not a known mask", span=value.span or span,
                        hint=_mask_name_hint(value.name))
  raise MaskTypeError(f"expected a mask, got {type(value).__name__} {quote(value)}", span=span)


def _mask_name_hint(name: str) -> str:
  guess = nearest(name, _ABOVE["mask_names"]() if "mask_names" in _ABOVE else ())
  tail = (f"If `{name}` is a boolean operand, index it: `{name}[q]` or `{name}[k]`.")
  return f"Did you mean `{guess}`? {tail}" if guess else tail


def operand(value: Any, span: Span | None = None) -> Operand | Param:
  """Coerces a name or `Operand` to the operand a read indexes."""
  if isinstance(value, (Operand, Param)):
    return value
  if isinstance(value, str) and value.isidentifier():
    return Operand(value, span)
  if isinstance(value, Scalar):
    return Operand(value.name, value.span or span)
  raise MaskTypeError(f"only a named operand can be indexed, not {quote(value)}", span=span,
                      hint="Index an operand by name: `seg[q]`, `allowed[q, k]`.")


def run_ids_key(name: str) -> str:
  """The operand-table key of the run-id array computed for `runs(name)`: the one convention."""
  return f"runs({name})"


def is_run_ids_key(key: str) -> bool:
  """Whether an operand-table key names a computed run-id array (not a user operand)."""
  return key.startswith("runs(")


def array_key(r: Read) -> str:
  """The operand-table key a per-token read indexes: the operand, or its run ids."""
  return run_ids_key(r.operand.name) if r.runs else r.operand.name


@functools.lru_cache(maxsize=4096)
def positions_of(t: Node) -> frozenset[str]:
  """The positions (`q`, `k`) a term depends on (remembered: lowering asks it of every
  part and subterm, several times per compile)."""
  if isinstance(t, Pos):
    return frozenset(t.axis)
  out: frozenset[str] = frozenset()
  for c in t.children():
    if not isinstance(c, Operand):
      out |= positions_of(c)
  return out


def _has_read(t: Node) -> bool:
  return isinstance(t, (Read, PairRead)) or any(_has_read(c) for c in t.children())


def _check_index(index: Term, allowed: str, what: str, span: Span | None) -> None:
  pos = positions_of(index)
  if not pos <= {allowed}:
    raise MaskTypeError(
        f"{what} must be a term of `{allowed}` alone, but it uses {', '.join(sorted(pos))}",
        span=index.span or span,
        hint="A per-token operand is indexed by one position (`seg[q]`, `doc[k // 2]`); "
             "a pairwise operand by a term of q and a term of k: `allowed[q, k]`.")
  if _has_read(index):
    raise MaskTypeError(f"{what} cannot read another operand", span=index.span or span,
                        hint="Index operands with terms of q or k, constants and scalars.")


def read(opnd: Any, index: Any, runs: bool = False, span: Span | None = None) -> Read:
  """`opnd[index]`, or `runs(opnd)[index]`."""
  index = term(index, span)
  opnd = operand(opnd, span)
  if not isinstance(index, Param):
    pos = positions_of(index)
    if len(pos) > 1:
      raise MaskTypeError(
          f"the index of `{_name(opnd)}` uses both q and k", span=index.span or span,
          hint="A per-token operand is indexed by one position (`seg[q]`, `doc[k // 2]`); "
               "a pairwise operand by a term of q and a term of k: `allowed[q, k]`.")
    _check_index(index, min(pos) if pos else "q", f"the index of `{_name(opnd)}`", span)
  return Read(opnd, index, runs, span)


def pair_read(opnd: Any, q_index: Any, k_index: Any, span: Span | None = None) -> PairRead:
  """`opnd[q_index, k_index]`."""
  q_index, k_index = term(q_index, span), term(k_index, span)
  opnd = operand(opnd, span)
  if not isinstance(q_index, Param):
    _check_index(q_index, "q", f"the first index of `{_name(opnd)}`", span)
  if not isinstance(k_index, Param):
    _check_index(k_index, "k", f"the second index of `{_name(opnd)}`", span)
  return PairRead(opnd, q_index, k_index, span)


def _name(opnd: Operand | Param) -> str:
  return opnd.name


def _floordiv(a: int, b: int) -> int:
  return a // b


_FOLD = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
         "//": _floordiv, "%": lambda a, b: a % b}


def arith(op: ArithOp, lhs: Any, rhs: Any, span: Span | None = None) -> Term:
  """`lhs op rhs`, folding constants and checking that `*`, `//`, `%` have one."""
  lhs, rhs = term(lhs, span), term(rhs, span)
  if op in ("//", "%") and isinstance(rhs, Const) and rhs.value == 0:
    raise MaskValueError(f"division by zero in {quote(Arith(op, lhs, rhs))}",
                         span=rhs.span or span,
                         hint="Divide by a positive constant, e.g. `q // 64`.")
  if isinstance(lhs, Const) and isinstance(rhs, Const):
    return _const(_FOLD[op](lhs.value, rhs.value), span)
  if op == "*" and not (isinstance(lhs, (Const, Param)) or isinstance(rhs, (Const, Param))):
    raise MaskTypeError(
        f"`*` needs a constant on one side, got {quote(lhs)} and {quote(rhs)}", span=span,
        hint="Multiply by a literal or a parameter bound at parse time: `q * 2`.",
        unbound=[Unbound(t.name, "param", example=64) for t in (lhs, rhs)
                 if isinstance(t, Scalar)][:1])
  if op in ("//", "%") and not isinstance(rhs, (Const, Param)):
    raise MaskTypeError(
        f"`{op}` needs a constant divisor, got {quote(rhs)}", span=rhs.span or span,
        hint="Divide by a literal or a parameter bound at parse time.",
        unbound=[Unbound(rhs.name, "param", example=8192)] if isinstance(rhs, Scalar) else [])
  return Arith(op, lhs, rhs, span)


def neg(arg: Any, span: Span | None = None) -> Term:
  """`-arg`."""
  arg = term(arg, span)
  if isinstance(arg, Const):
    return _const(-arg.value, span)
  return Neg(arg, span)


def fn(name: str, args: Sequence[Any], span: Span | None = None) -> Term:
  """`abs(t)`, `min(...)`, `max(...)`."""
  args = tuple(term(a, span) for a in args)
  if name == "abs" and len(args) != 1:
    raise MaskTypeError(f"abs takes 1 argument, got {len(args)}", span=span)
  if name in ("min", "max") and len(args) < 2:
    raise MaskTypeError(f"{name} takes 2 or more arguments, got {len(args)}", span=span)
  if all(isinstance(a, Const) for a in args):
    vals = [a.value for a in args]
    return _const(abs(vals[0]) if name == "abs" else (min(vals) if name == "min" else max(vals)),
                  span)
  return Fn(cast(FnName, name), args, span)


def compare(terms: Sequence[Any], ops: Sequence[str], span: Span | None = None) -> Compare:
  """A (possibly chained) comparison of integer terms."""
  terms = tuple(term(t, span) for t in terms)
  ops = tuple(ops)
  if len(terms) != len(ops) + 1 or len(ops) < 1 or any(o not in COMPARE_OPS for o in ops):
    raise MaskTypeError(f"malformed comparison {quote(terms)} {quote(ops)}", span=span)
  return Compare(terms, cast(tuple[CompareOp, ...], ops), span)


def truth(value: Any, span: Span | None = None) -> Truth:
  """A boolean operand read as a mask."""
  if isinstance(value, Truth):
    return value
  if not isinstance(value, (Read, PairRead)):
    raise MaskTypeError(f"{quote(value)} is an integer term, not a mask", span=span,
                        hint="Compare it: `x < n`.")
  return Truth(value, span)


def _flatten(cls: type[Mask], items: Sequence[Any], span: Span | None) -> tuple[Mask, ...]:
  out: list[Mask] = []
  for it in items:
    it = mask(it, span)
    if type(it) is cls:
      out.extend(cast(And | Or | Xor, it).items)
    else:
      out.append(it)
  return tuple(out)


def and_(items: Sequence[Any], span: Span | None = None) -> Mask:
  """Intersection; nested intersections are flattened."""
  items = _flatten(And, items, span)
  return items[0] if len(items) == 1 else And(items, span)


def or_(items: Sequence[Any], span: Span | None = None) -> Mask:
  """Union; nested unions are flattened."""
  items = _flatten(Or, items, span)
  return items[0] if len(items) == 1 else Or(items, span)


def xor(items: Sequence[Any], span: Span | None = None) -> Mask:
  """Symmetric difference; nested ones are flattened."""
  items = _flatten(Xor, items, span)
  return items[0] if len(items) == 1 else Xor(items, span)


def operand_free_split(m: Mask):
  """`(operand-free items, the others, and_ or or_)` of an `&` / `|`; else None."""
  if not isinstance(m, (And, Or)):
    return None
  return ([x for x in m.items if not x.operands], [x for x in m.items if x.operands],
          and_ if isinstance(m, And) else or_)


def joined(items: Sequence[Mask], join: Callable[[Sequence[Mask]], Mask]) -> Mask:
  """`items` joined by `join` (`and_` or `or_`; one item alone)."""
  return items[0] if len(items) == 1 else join(items)


def not_(item: Any, span: Span | None = None) -> Mask:
  """Complement."""
  return Not(mask(item, span), span)


def call(definition: Definition, args: Sequence[Any], span: Span | None = None) -> Node:
  """Applies a definition to arguments, checking arity and its `where` requirements.

  Mask-valued definitions become `Call` nodes (so printing keeps the name);
  term-valued ones are substituted in place.
  """
  args = tuple(_call_arg(a, span) for a in args)
  if len(args) != len(definition.params):
    raise MaskTypeError(
        f"`{definition.name}` takes {len(definition.params)} argument"
        f"{'s' if len(definition.params) != 1 else ''}, got {len(args)}", span=span,
        hint=f"Write `{_signature(definition)}`.")
  _check_operand_args(definition, args, span)
  env = dict(zip(definition.params, args))
  for requirement, message in definition.requirements:
    verdict = const_truth(instantiate(requirement, env, span))
    if verdict is False:
      shown = f"{definition.name}({', '.join(arg_text(a) for a in args)})"
      raise MaskValueError(f"{message}, got {shown}", span=span,
                           hint=f"`{definition.name}` requires {quote(requirement)}.")
  if is_mask_definition(definition):
    return Call(definition.name, args, definition, span)
  return instantiate(definition.body, env, span)


def _check_operand_args(definition: Definition, args: tuple[Node, ...],
                        span: Span | None) -> None:
  """Refuses an argument that is not an operand's name where the body indexes the
  parameter (`document(seg[q])` for `document(s) = s[q] == s[k]`)."""
  indexed = operand_params(definition)
  for param, arg in zip(definition.params, args):
    if param in indexed and not isinstance(arg, (Operand, Param, Scalar)):
      shown = [a.operand.name if a is arg and isinstance(a, (Read, PairRead)) else arg_text(a)
               for a in args]
      hint = (f"Pass the operand's name: `{definition.name}({', '.join(shown)})`."
              if isinstance(arg, (Read, PairRead)) else
              f"Pass an operand's name, e.g. `{definition.name}(seg)`.")
      raise MaskTypeError(f"`{definition.name}` indexes its parameter `{param}`, so it takes an "
                          f"operand's name, not {quote(arg)}", span=span, hint=hint)


@functools.lru_cache(maxsize=1024)
def operand_params(definition: Definition) -> frozenset[str]:
  """The parameters of `definition` its body indexes as operands (`s` in `s[q]`), directly or
  through the definitions it calls."""
  out = set()
  for n in walk(definition.body, into_calls=False):
    if isinstance(n, (Read, PairRead)) and isinstance(n.operand, Param):
      out.add(n.operand.name)
    elif isinstance(n, Call):
      inner = operand_params(n.definition)
      out.update(a.name for p, a in zip(n.definition.params, n.args)
                 if p in inner and isinstance(a, Param))
  return frozenset(out)


def arg_text(a: Node) -> str:
  """A call's argument as it is written in a call: an operand's name, else its text."""
  if isinstance(a, Operand):
    return a.name
  quoted = quote(a)
  return quoted[1:-1] if quoted.startswith("`") else quoted


def _signature(d: Definition) -> str:
  return d.name + (f"({', '.join(d.params)})" if d.params else "")


def _call_arg(a: Any, span) -> Node:
  if isinstance(a, bool):
    return BoolConst(a, span)
  if isinstance(a, int):
    return _const(a, span)
  if isinstance(a, str):
    return Operand(a, span)
  if isinstance(a, Node):
    return a
  raise MaskTypeError(f"cannot pass {type(a).__name__} {quote(a)} to a mask definition",
                      span=span)


def is_mask_definition(d: Definition) -> bool:
  return isinstance(d.body, Mask) and not isinstance(d.body, Param)


def const_truth(m: Node) -> bool | None:
  """The truth of a mask that needs no positions or operands, else None."""
  if isinstance(m, BoolConst):
    return m.value
  if isinstance(m, Compare) and all(isinstance(t, Const) for t in m.terms):
    values = [t.value for t in m.terms if isinstance(t, Const)]  # all of them
    return all(_CMP[o](a, b) for o, a, b in zip(m.ops, values, values[1:]))
  if isinstance(m, Not):
    v = const_truth(m.item)
    return None if v is None else not v
  if isinstance(m, (And, Or)):
    vals = [const_truth(i) for i in m.items]
    if isinstance(m, And):
      return False if False in vals else (True if all(v is True for v in vals) else None)
    return True if True in vals else (False if all(v is False for v in vals) else None)
  return None


_CMP = {"<": lambda a, b: a < b, "<=": lambda a, b: a <= b, "==": lambda a, b: a == b,
        "!=": lambda a, b: a != b, ">=": lambda a, b: a >= b, ">": lambda a, b: a > b}


class _Budget:
  """How many more nodes `instantiate` may build in the current `build_budget` block."""

  __slots__ = ("left", "limit")

  def __init__(self, limit: int):
    self.left = self.limit = limit


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("maskc_ir_budget",
                                                                        default=None)


@contextlib.contextmanager
def build_budget(limit: int) -> Iterator[None]:
  """Bounds the nodes that expanding definitions may build inside the block, all calls together.

  Every call of a definition copies its body (`instantiate`), and a body that uses
  a definition twice holds two copies of it, so `d1 = d0 + d0`, `d2 = d1 + d1`, ...
  doubles the work with each line: sixty short lines ask for 2**60 nodes. The parser
  elaborates each program inside a budget, so any text is accepted or refused
  (`MaskLimitError`) after building at most `limit` nodes, whatever its shape. In a
  block inside another, the inner budget applies.

  >>> twice = Definition("twice", ("x",), arith("+", Param("x"), Param("x")))
  >>> with build_budget(100):
  ...   str(call(twice, [Pos("q") // 2]))
  'q // 2 + q // 2'
  >>> with build_budget(1):
  ...   call(twice, [Pos("q") // 2])  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  maskc.language.errors.MaskLimitError: expanding the definitions builds more than 1 nodes...
  """
  token = _BUDGET.set(_Budget(limit))
  try:
    yield
  finally:
    _BUDGET.reset(token)


def _over_budget(budget: _Budget, span: Span | None) -> MaskLimitError:
  return MaskLimitError(
      f"expanding the definitions builds more than {budget.limit} nodes", span=span,
      hint="Each use of a definition copies its body, so definitions that use others several "
           "times multiply; use each fewer times or simplify them.")


class NodeMemo:
  """Values remembered by node identity, each node kept alive while it is a key.

  Python reuses an object's `id` once the object is gone. A memo keyed by `id(node)`
  that lets its nodes die (a call's expansion, an item rewritten for one analysis)
  can meet a new node at the same address and hand it the value of the dead one: a
  verdict about `bidirectional(img)` answered for `bidirectional(g)`. Holding the
  node beside its value makes that impossible. Identity, not equality, is the key on
  purpose: equal nodes need no second visit, but hashing a deep tree costs a walk.
  """

  __slots__ = ("_items",)

  def __init__(self) -> None:
    self._items: dict[int, tuple[Any, Any]] = {}

  def __contains__(self, node: object) -> bool:
    return id(node) in self._items

  def __getitem__(self, node: object) -> Any:
    return self._items[id(node)][1]

  def __setitem__(self, node: object, value: Any) -> None:
    self._items[id(node)] = (node, value)

  def __len__(self) -> int:
    return len(self._items)


def instantiate(node: Node, env: dict[str, Node], span: Span | None = None) -> Node:
  """`node` with each `Param` replaced by its value in `env`, rebuilt and re-checked.

  Each node built counts against the current `build_budget`, if any.
  """
  memo = NodeMemo()
  budget = _BUDGET.get()

  def go(n: Node) -> Node:
    if n in memo:
      return memo[n]
    if budget is not None:
      budget.left -= 1
      if budget.left < 0:
        raise _over_budget(budget, span)
    out = _rebuild(n, go, env, span)
    memo[n] = out
    return out

  return go(node)


def _rebuild(n: Node, go, env, span) -> Node:
  # Errors inside an expanded body point at the call the user wrote.
  s = span if span is not None else getattr(n, "span", None)
  if isinstance(n, Param):
    return env.get(n.name, n)
  if isinstance(n, (Const, Pos, Scalar, Operand, BoolConst, Definition)):
    return n
  if isinstance(n, Read):
    return read(go(n.operand), go(n.index), n.runs, span or s)
  if isinstance(n, PairRead):
    return pair_read(go(n.operand), go(n.q_index), go(n.k_index), span or s)
  if isinstance(n, Neg):
    return neg(go(n.arg), s)
  if isinstance(n, Arith):
    return arith(n.op, go(n.lhs), go(n.rhs), span or s)
  if isinstance(n, Fn):
    return fn(n.name, [go(a) for a in n.args], s)
  if isinstance(n, Compare):
    return compare([go(t) for t in n.terms], n.ops, s)
  if isinstance(n, Truth):
    return truth(go(n.read), s)
  if isinstance(n, And):
    return and_([go(i) for i in n.items], s)
  if isinstance(n, Or):
    return or_([go(i) for i in n.items], s)
  if isinstance(n, Xor):
    return xor([go(i) for i in n.items], s)
  if isinstance(n, Not):
    return not_(go(n.item), s)
  if isinstance(n, Call):
    return call(n.definition, [go(a) for a in n.args], span or s)
  raise TypeError(f"unknown IR node {type(n).__name__}")


@functools.lru_cache(maxsize=4096)
def expand(c: Call) -> Mask:
  """The meaning of a named mask: its body with the arguments substituted."""
  body = instantiate(c.definition.body, dict(zip(c.definition.params, c.args)), c.span)
  return mask(body, c.span)


def walk(node: Node, *, into_calls: bool = True):
  """Yields every node below `node` once (by identity), expanding calls if asked."""
  seen = NodeMemo()  # holds expansions alive: a dead one's id could come back
  stack = [node]
  while stack:
    n = stack.pop()
    if n in seen:
      continue
    seen[n] = True
    yield n
    if isinstance(n, Call) and into_calls:
      stack.append(expand(n))
    elif isinstance(n, Definition):
      continue
    else:
      stack.extend(n.children())


def printed_size(node: Node, limit: int) -> int:
  """About how many nodes `str(node)` prints, counted up to `limit + 1` (so in bounded time).

  That is the node's tree, where a node used twice counts twice (a term shared by
  `d1 = d0 + d0` prints twice), plus once each the user definitions it calls.
  """
  count = 0
  seen: set[int] = set()
  stack: list[Node] = [node]
  while stack and count <= limit:
    n = stack.pop()
    count += 1
    if isinstance(n, Definition):
      stack.append(n.body)
      stack.extend(cond for cond, _ in n.requirements)
    elif isinstance(n, Call):
      stack.extend(n.args)
      if not n.definition.prelude and id(n.definition) not in seen:
        seen.add(id(n.definition))
        stack.append(n.definition)
    else:
      stack.extend(n.children())
  return min(count, limit + 1)


QUOTED_NODES = 200  # the largest node an error message quotes in full


def quote(value: Any) -> str:
  """`value` for an error message: a node's text in backticks, unless it is too large to quote.

  Errors quote what they refuse, and a term built by nested definitions can be
  far too large to print (`f(f(f(...)))` with `f(x) = x + x`), so large nodes are
  named by their size instead, and other values by a shortened `repr`.
  """
  if not isinstance(value, Node):
    text = repr(value)
    return text if len(text) <= 200 else text[:150] + " ... " + text[-40:]
  if printed_size(value, QUOTED_NODES) <= QUOTED_NODES:
    return f"`{value}`"
  kind = "mask" if isinstance(value, Mask) else "term"
  return f"a {kind} of more than {QUOTED_NODES} nodes"


@functools.lru_cache(maxsize=4096)
def collect_operands(m: Mask) -> tuple[OperandSpec, ...]:
  """The operands `m` reads, sorted by name; raises if one is used as two kinds.

  Memoized: lowering asks for the operands of each part of a mask several times.
  """
  kinds: dict[str, OperandKind] = {}
  boolean: dict[str, bool] = {}
  spans: dict[str, Span | None] = {}
  kind: OperandKind
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


@functools.lru_cache(maxsize=4096)
def expanded_size(node: Node, limit: int) -> int:
  """The node count of `node` with every call expanded, stopping once over `limit`
  (remembered: memory budgets ask it of the same mask in each step)."""
  sizes = NodeMemo()

  def size(n: Node) -> int:
    if n in sizes:
      return sizes[n]
    if isinstance(n, Call):
      s = 1 + size(expand(n))
    elif isinstance(n, Definition):
      s = 0
    else:
      s = 1
      for c in n.children():
        s += size(c)
        if s > limit:
          break
    s = min(s, limit + 1)
    sizes[n] = s
    return s

  return size(node)


def is_prelude_only(m: Mask) -> bool:
  """Whether `m` is built from prelude masks with `& | ^ ~` alone."""
  if isinstance(m, Call):
    # A user definition built from the prelude (`local = sliding(8) | sink(4)`) counts too.
    return m.definition.prelude or is_prelude_only(expand(m))
  if isinstance(m, (And, Or, Xor)):
    return all(is_prelude_only(i) for i in m.items)
  if isinstance(m, Not):
    return is_prelude_only(m.item)
  return isinstance(m, BoolConst)

