"""Element-wise evaluation of a mask, with NumPy or jax.numpy.

One evaluator serves dense materialization, lazy tiles of a `ComputableMask`,
refinement of ambiguous tiles during lowering, and the in-kernel predicate.
Positions and the batch index are arrays that broadcast against each other,
so the caller picks the layout: `[Lq, 1]` × `[1, Lk]` for a dense mask,
`[T, bq, 1]` × `[T, 1, bk]` for T tiles at once.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from maskc.language import ir


class OperandReads(Protocol):
  """What evaluation reads operands from: a dict, an `OperandArrays`, or a view that reads
  some through their runs."""

  def __getitem__(self, name: str, /) -> Any: ...


class Env:
  """What evaluation needs besides the mask.

  Attributes:
    xp: `numpy` or `jax.numpy`.
    q: query positions (integer array).
    k: key positions, broadcastable with `q`.
    operands: normalized operands by name, each with a leading batch axis
      (`[B]` scalars, `[B, L]` per-token, `[B, Lq', Lk']` pairwise), and
      `runs(x)` under the key `"runs(x)"`.
    batch: batch indices broadcastable with `q` and `k`, or 0 when unbatched.
  """

  def __init__(self, xp, q, k, operands: OperandReads, batch: Any = 0):
    self.xp, self.q, self.k, self.operands, self.batch = xp, q, k, operands, batch
    self.memo = ir.NodeMemo()


def evaluate(m: ir.Node, env: Env):
  """The value of a mask (bool array) or term (int array) at the positions of `env`."""
  if m in env.memo:
    return env.memo[m]
  out = _eval(m, env)
  env.memo[m] = out
  return out


def _eval(m: ir.Node, env: Env):
  rule = _RULES.get(type(m))
  if rule is None:
    raise TypeError(f"cannot evaluate {type(m).__name__}")
  return rule(m, env)


def _clip(xp, i, hi: int):
  """`i` clipped to `[0, hi]`: NumPy's ufuncs directly, not `np.clip`'s checks, which cost
  several times the operation on the few hundred pairs a lowering samples."""
  if xp is np:
    return np.minimum(np.maximum(i, 0), hi)
  return xp.clip(i, 0, hi)


def _scalar(m: ir.Scalar, env: Env):
  arr = _operand(env, m.name)
  return arr[_row(arr, env)]


def _read(m: ir.Read, env: Env):
  arr = _operand(env, ir.array_key(m))
  return arr[_row(arr, env), _clip(env.xp, evaluate(m.index, env), arr.shape[-1] - 1)]


def _pair_read(m: ir.PairRead, env: Env):
  arr = _operand(env, m.operand.name)
  qi = _clip(env.xp, evaluate(m.q_index, env), arr.shape[-2] - 1)
  ki = _clip(env.xp, evaluate(m.k_index, env), arr.shape[-1] - 1)
  return arr[_row(arr, env), qi, ki]


def _arith(m: ir.Arith, env: Env):
  a, b = evaluate(m.lhs, env), evaluate(m.rhs, env)
  if m.op == "+":
    return a + b
  if m.op == "-":
    return a - b
  if m.op == "*":
    return a * b
  if m.op == "//":
    return env.xp.floor_divide(a, b)
  return env.xp.mod(a, b)


def _fn(m: ir.Fn, env: Env):
  xp = env.xp
  args = [evaluate(a, env) for a in m.args]
  if m.name == "abs":
    return xp.abs(args[0])
  out = args[0]
  for a in args[1:]:
    out = xp.minimum(out, a) if m.name == "min" else xp.maximum(out, a)
  return out


def _compare(m: ir.Compare, env: Env):
  xp = env.xp
  vals = [evaluate(t, env) for t in m.terms]
  out = None
  for op, a, b in zip(m.ops, vals, vals[1:]):
    r = _COMPARE[op](xp, a, b)
    out = r if out is None else xp.logical_and(out, r)
  return out


def _joined(op: str):
  """The rule of an n-ary `&`, `|` or `^`: `op` (a logical ufunc's name) folded over the items."""
  def rule(m, env: Env):
    fold = getattr(env.xp, op)
    out = evaluate(m.items[0], env)
    for i in m.items[1:]:
      out = fold(out, evaluate(i, env))
    return out
  return rule


# One rule per node type, looked up by its exact type (the IR's node classes are final).
_RULES = {
    ir.Const: lambda m, env: m.value,
    ir.Pos: lambda m, env: env.q if m.axis == "q" else env.k,
    ir.Scalar: _scalar,
    ir.Read: _read,
    ir.PairRead: _pair_read,
    ir.Neg: lambda m, env: -evaluate(m.arg, env),
    ir.Arith: _arith,
    ir.Fn: _fn,
    ir.BoolConst: lambda m, env: env.xp.asarray(m.value),
    ir.Compare: _compare,
    ir.Truth: lambda m, env: evaluate(m.read, env) != 0,
    ir.And: _joined("logical_and"),
    ir.Or: _joined("logical_or"),
    ir.Xor: _joined("logical_xor"),
    ir.Not: lambda m, env: env.xp.logical_not(evaluate(m.item, env)),
    ir.Call: lambda m, env: evaluate(ir.expand(m), env),
}


def _operand(env: Env, name: str):
  """An operand as an array of the evaluation's module (NumPy cannot be indexed by tracers)."""
  arr = env.operands[name]
  if env.xp is not np and isinstance(arr, np.ndarray):
    arr = env.xp.asarray(arr)
  return arr


def _row(arr, env: Env):
  """The batch rows to read: operands without a batch axis (size 1) serve every row."""
  return env.batch if arr.shape[0] > 1 else 0


_COMPARE = {
    "<": lambda xp, a, b: xp.less(a, b), "<=": lambda xp, a, b: xp.less_equal(a, b),
    "==": lambda xp, a, b: xp.equal(a, b), "!=": lambda xp, a, b: xp.not_equal(a, b),
    ">=": lambda xp, a, b: xp.greater_equal(a, b), ">": lambda xp, a, b: xp.greater(a, b),
}


def evaluate_mask(m: ir.Mask, env: Env):
  """`evaluate` for a mask, broadcast to the full shape of the positions."""
  xp = env.xp
  out = evaluate(m, env)
  shape = xp.broadcast_shapes(xp.shape(env.q), xp.shape(env.k), xp.shape(env.batch))
  return xp.broadcast_to(xp.asarray(out, dtype=bool), _full_shape(xp, out, shape))


def _full_shape(xp, out, shape):
  return xp.broadcast_shapes(xp.shape(out), shape)
