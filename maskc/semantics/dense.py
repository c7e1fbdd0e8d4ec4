"""A mask as a dense array: `materialize` and `additive_bias`, under `jit` too."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from maskc.language import ir
from maskc.language.arguments import MasksLike, as_masks
from maskc.language.errors import MaskLimitError
from maskc.semantics.evaluate import Env, evaluate_mask
from maskc.semantics.integers import is_traced, jax_int
from maskc.semantics.operands import Operands, prepare_operands
from maskc.semantics.shape import Shape, batch_of, uses_q

MAX_DENSE_ELEMENTS = 1 << 32
MAX_DENSE_LENGTH = (1 << 31) - 1  # the longest q_len or kv_len a dense mask may have
DENSE_CHUNK = 1 << 22  # elements a NumPy dense evaluation computes at once


def materialize(mask: MasksLike, q_len: int, kv_len: int | None = None, *,
                q_offset: int | None = None, operands: Mapping[str, ArrayLike] | None = None,
                q_positions: ArrayLike | None = None,
                kv_positions: ArrayLike | None = None) -> np.ndarray | jax.Array:
  """The mask as a dense bool array `[..., q_len, kv_len]`.

  Works under `jax.jit` with traced operands (per-token `[L]` / `[B, L]`, scalars
  `[]` / `[B]`); a batch axis on any operand gives the result a leading `B`. A
  sequence of masks (one per head) adds a head axis before the last two.

  Integer terms are computed exactly or refused: NumPy evaluates in int64,
  jax.numpy (when an operand is a JAX array or the offset is traced) in int32
  (int64 with `jax_enable_x64`), and a term that could leave that type over
  the shape and the static values (literals, a static offset, static operands)
  raises `MaskValueError` naming it. Traced values cannot be checked at trace
  time: they are int32 (with x64 off), and a wrap is possible only for a term
  whose values, computed from traced ones, exceed int32; comparisons of reads
  (`seg[q] == seg[k]`) subtract nothing and stay exact. A traced scalar that
  breaks a definition's `where` requirement (`sliding(n)` with `n = 0`) is not
  refused; the body is computed as written (see `prepare_operands`).

  Args:
    mask: a Mask, mask text, or a sequence of them (one per head).
    q_len: query rows. kv_len: key columns (default `q_len`).
    q_offset: position of row 0 (default `kv_len - q_len`).
    operands: runtime operand values by name.
    q_positions, kv_positions: the position of each row / column, `[L]` or `[B, L]`
      (NumPy or traced; default `q_offset + i` and `j`). Row `i` is then query
      position `q_positions[i]`: a permutation of positions permutes the rows.

  Returns:
    A NumPy bool array when every operand and position is static, else a jax.Array.

  Raises:
    MaskLimitError: a length of 2**31 or more, or more than `MAX_DENSE_ELEMENTS`
      elements (before anything is allocated).
    MaskValueError: a term that would wrap, a broken `where` requirement, a bad
      operand (`OperandError`).

  >>> import maskc
  >>> maskc.materialize("sliding(2)", 3).astype(int)
  array([[1, 0, 0],
         [1, 1, 0],
         [0, 1, 1]])
  """
  masks, multi = as_masks(mask)
  shape = Shape.of(q_len, kv_len, q_offset, q_positions=q_positions,
                   kv_positions=kv_positions)
  _check_dense(shape.q_len, shape.kv_len, len(masks), multi)
  traced = not shape.static or any(is_traced(v) for v in (operands or {}).values())
  outs = []
  for m in masks:
    ops = prepare_operands(m, shape, operands, xp=jnp if traced else None)
    _check_dense(shape.q_len, shape.kv_len, len(masks) * (ops.batch or 1), multi)
    if shape.has_positions:
      outs.append(_evaluate_at_positions(m, shape, ops))
      continue
    if ops.xp is np:
      outs.append(_dense_numpy(m, shape, ops))
      continue
    dtype = jax_int()
    q = jnp.arange(shape.q_len, dtype=dtype)
    if uses_q(m):  # an offset the mask never reads need not fit the type
      q = q + shape.q_offset
    k = jnp.arange(shape.kv_len, dtype=dtype)
    batch = 0 if ops.batch is None else jnp.arange(ops.batch)[:, None, None]
    outs.append(evaluate_mask(m, Env(jnp, q[:, None], k[None, :], ops.arrays, batch)))
  xp = jnp if any(is_traced(o) for o in outs) else np
  if multi:
    lead = max(o.ndim for o in outs)
    outs = [xp.broadcast_to(o, outs[[p.ndim for p in outs].index(lead)].shape) for o in outs]
    dense: np.ndarray | jax.Array = xp.stack(outs, axis=-3)
  else:
    dense = outs[0]
  return dense


def _check_dense(q_len: int, kv_len: int, count: int, multi: bool) -> None:
  """Raises `MaskLimitError` for a dense mask too long or too large to allocate."""
  if max(q_len, kv_len) > MAX_DENSE_LENGTH:
    raise MaskLimitError(
        f"a dense {q_len} x {kv_len} mask has a length of 2**31 or more; dense masks allow "
        f"lengths up to {MAX_DENSE_LENGTH:,}",
        hint="Use `maskc.compile` for block-sparse metadata, or bind the mask and slice the "
             "tiles you need: `mask.bind(...)[q0:q1, k0:k1]`.")
  if q_len * kv_len * count > MAX_DENSE_ELEMENTS:
    raise MaskLimitError(
        f"a dense {q_len} x {kv_len} mask{' per head' if multi else ''}"
        f"{f' ({count} of them)' if count > 1 else ''} is over {MAX_DENSE_ELEMENTS:,} elements",
        hint="Use `maskc.compile` for block-sparse metadata, or bind the mask and slice the "
             "tiles you need: `mask.bind(...)[q0:q1, k0:k1]`.")



def _dense_numpy(m: ir.Mask, shape: Shape, ops: Operands) -> np.ndarray:
  """The whole mask with NumPy (int64), a band of rows at a time to bound temporaries."""
  offset = shape.q_offset if uses_q(m) else 0
  k = np.arange(shape.kv_len, dtype=np.int64)[None, :]
  batch = 0 if ops.batch is None else np.arange(ops.batch)[:, None, None]
  lead = () if ops.batch is None else (ops.batch,)
  out = np.empty(lead + (shape.q_len, shape.kv_len), dtype=bool)
  step = max(1, DENSE_CHUNK // (shape.kv_len * (ops.batch or 1)))
  for r0 in range(0, shape.q_len, step):
    r1 = min(r0 + step, shape.q_len)
    q = (np.arange(r0, r1, dtype=np.int64) + offset)[:, None]
    out[..., r0:r1, :] = evaluate_mask(m, Env(np, q, k, ops.arrays, batch))
  return out


def _evaluate_at_positions(m: ir.Mask, shape: Shape, ops: Operands) -> Any:
  """The dense mask with rows and columns at explicit positions, `[B?, Lq, Lkv]`."""
  traced = ops.xp is jnp or not shape.static
  xp = jnp if traced else np
  int_t = jnp.int32 if traced else np.int64
  q = xp.asarray(shape.rows(xp, int_t))
  k = xp.asarray(shape.cols(xp, int_t))
  arrays: Mapping[str, Any] = ops.arrays
  if traced:
    arrays = {n: jnp.asarray(a) for n, a in arrays.items()}
  batch = batch_of(ops.batch, shape)
  b = 0 if batch is None else xp.arange(batch)[:, None, None]
  out = evaluate_mask(m, Env(xp, q[:, :, None], k[:, None, :], arrays, b))
  return out if batch is not None else out[0]


def additive_bias(mask: MasksLike, q_len: int, kv_len: int | None = None, *,
                  q_offset: int | None = None, operands: Mapping[str, ArrayLike] | None = None,
                  dtype: DTypeLike = jnp.float32, q_positions: ArrayLike | None = None,
                  kv_positions: ArrayLike | None = None) -> jax.Array:
  """The mask as an additive attention bias: 0 where allowed, a large negative elsewhere.

  The negative is `-0.7 * finfo(dtype).max`, finite so that fully masked rows
  do not produce NaN. Same arguments (positions included), checks and errors as
  `materialize` (exact integer terms or `MaskValueError`); jittable.
  """
  dense = materialize(mask, q_len, kv_len, q_offset=q_offset, operands=operands,
                      q_positions=q_positions, kv_positions=kv_positions)
  neg = -0.7 * float(jnp.finfo(dtype).max)
  return jnp.where(jnp.asarray(dense), jnp.asarray(0, dtype), jnp.asarray(neg, dtype))


