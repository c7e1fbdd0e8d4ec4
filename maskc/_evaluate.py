"""Element-wise evaluation of a mask, with NumPy or jax.numpy.

One evaluator serves dense materialization, lazy tiles of a `ComputableMask`,
refinement of ambiguous tiles during lowering, and the in-kernel predicate.
Positions and the batch index are arrays that broadcast against each other,
so the caller picks the layout: `[Lq, 1]` × `[1, Lk]` for a dense mask,
`[T, bq, 1]` × `[T, 1, bk]` for T tiles at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from maskc import _ir as ir


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

  def __init__(self, xp, q, k, operands: dict[str, Any], batch: Any = 0):
    self.xp, self.q, self.k, self.operands, self.batch = xp, q, k, operands, batch
    self.memo: dict[int, Any] = {}


def evaluate(m: ir.Node, env: Env):
  """The value of a mask (bool array) or term (int array) at the positions of `env`."""
  key = id(m)
  if key in env.memo:
    return env.memo[key]
  out = _eval(m, env)
  env.memo[key] = out
  return out


def _eval(m: ir.Node, env: Env):
  xp = env.xp
  if isinstance(m, ir.Const):
    return m.value
  if isinstance(m, ir.Pos):
    return env.q if m.axis == "q" else env.k
  if isinstance(m, ir.Scalar):
    arr = _operand(env, m.name)
    return arr[_row(arr, env)]
  if isinstance(m, ir.Read):
    arr = _operand(env, ir.array_key(m))
    idx = xp.clip(evaluate(m.index, env), 0, arr.shape[-1] - 1)
    return arr[_row(arr, env), idx]
  if isinstance(m, ir.PairRead):
    arr = _operand(env, m.operand.name)
    qi = xp.clip(evaluate(m.q_index, env), 0, arr.shape[-2] - 1)
    ki = xp.clip(evaluate(m.k_index, env), 0, arr.shape[-1] - 1)
    return arr[_row(arr, env), qi, ki]
  if isinstance(m, ir.Neg):
    return -evaluate(m.arg, env)
  if isinstance(m, ir.Arith):
    a, b = evaluate(m.lhs, env), evaluate(m.rhs, env)
    if m.op == "+":
      return a + b
    if m.op == "-":
      return a - b
    if m.op == "*":
      return a * b
    if m.op == "//":
      return xp.floor_divide(a, b)
    return xp.mod(a, b)
  if isinstance(m, ir.Fn):
    args = [evaluate(a, env) for a in m.args]
    if m.name == "abs":
      return xp.abs(args[0])
    out = args[0]
    for a in args[1:]:
      out = xp.minimum(out, a) if m.name == "min" else xp.maximum(out, a)
    return out
  if isinstance(m, ir.BoolConst):
    return xp.asarray(m.value)
  if isinstance(m, ir.Compare):
    vals = [evaluate(t, env) for t in m.terms]
    out = None
    for op, a, b in zip(m.ops, vals, vals[1:]):
      r = _COMPARE[op](xp, a, b)
      out = r if out is None else xp.logical_and(out, r)
    return out
  if isinstance(m, ir.Truth):
    return evaluate(m.read, env) != 0
  if isinstance(m, ir.And):
    out = evaluate(m.items[0], env)
    for i in m.items[1:]:
      out = xp.logical_and(out, evaluate(i, env))
    return out
  if isinstance(m, ir.Or):
    out = evaluate(m.items[0], env)
    for i in m.items[1:]:
      out = xp.logical_or(out, evaluate(i, env))
    return out
  if isinstance(m, ir.Xor):
    out = evaluate(m.items[0], env)
    for i in m.items[1:]:
      out = xp.logical_xor(out, evaluate(i, env))
    return out
  if isinstance(m, ir.Not):
    return xp.logical_not(evaluate(m.item, env))
  if isinstance(m, ir.Call):
    return evaluate(ir.expand(m), env)
  raise TypeError(f"cannot evaluate {type(m).__name__}")


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
