"""`Mask.bind`: a mask bound to a shape and static operands, the lazy `ComputableMask`.

Slicing a `ComputableMask` evaluates only that tile, in int64 with NumPy; masks that
read no array operands also evaluate at row and column indices (`mask_function`), as a
kernel does. It is a plain sliceable mask: the compiler imports no kernel, so a kernel
that takes masks of its own wraps it (`maskc.kernels.splash.as_splash_mask`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from maskc.language import ir
from maskc.language.arguments import MaskLike, as_mask
from maskc.language.errors import MaskLimitError, MaskTypeError
from maskc.semantics import dense as _dense
from maskc.semantics.evaluate import Env, evaluate_mask
from maskc.semantics.integers import is_traced, jax_int, jax_int_bits
from maskc.semantics.operands import overflow_hint, prepare_operands
from maskc.semantics.overflow import check_fits
from maskc.semantics.shape import Shape, batch_of, uses_q


class ComputableMask:
  """A mask bound to a shape, an offset and static operands; lazy and sliceable.

  Tiles are computed in int64 with NumPy and are exact: binding raises
  `MaskValueError` when a term of the mask could leave int64 at this shape with
  these operands (or a runtime scalar breaks a definition's `where` clause).

  `cm[q0:q1, k0:k1]` evaluates only that tile (a NumPy bool array). Masks that
  read no array operands also expose `q_sequence` and `mask_function(q_ids,
  kv_ids)` (row and column indices), which a kernel can evaluate inside itself.
  Splash attention takes it wrapped as its own `Mask`
  (`maskc.kernels.splash.as_splash_mask(cm)`, `as_tokamax_mask(cm)`).

  >>> import maskc
  >>> cm = maskc.parse("causal").bind(4)
  >>> cm[1:3, :].astype(int)
  array([[1, 1, 0, 0],
         [1, 1, 1, 0]])
  """

  def __init__(self, mask: MaskLike, q_len: int, kv_len: int | None = None, *,
               q_offset: int | None = None, operands: Mapping[str, ArrayLike] | None = None,
               q_positions: ArrayLike | None = None,
               kv_positions: ArrayLike | None = None) -> None:
    self.mask = as_mask(mask)
    if any(is_traced(p) for p in (q_positions, kv_positions)):
      raise MaskTypeError("a ComputableMask needs static positions (NumPy arrays)",
                          hint="Use `maskc.materialize` for traced positions.")
    self.bound = Shape.of(q_len, kv_len, q_offset, q_positions=q_positions,
                          kv_positions=kv_positions)
    self.ops = prepare_operands(self.mask, self.bound, operands, allow_traced=False)
    self._batch = batch_of(self.ops.batch, self.bound)

  @property
  def q_len(self) -> int:
    return self.bound.q_len

  @property
  def kv_len(self) -> int:
    return self.bound.kv_len

  @property
  def q_offset(self) -> int:
    return int(self.bound.q_offset)  # an int: a ComputableMask is static

  @property
  def shape(self) -> tuple[int, ...]:
    lead = () if self._batch is None else (self._batch,)
    return lead + (self.bound.q_len, self.bound.kv_len)

  def __getitem__(self, idx: Any) -> np.ndarray:
    if not isinstance(idx, tuple):
      idx = (idx,)
    if len(idx) > len(self.shape):
      raise IndexError(f"too many indices for a mask of shape {self.shape}")
    idx = idx + (slice(None),) * (len(self.shape) - len(idx))
    *lead, qi, ki = idx
    rows = _index_array(qi, self.bound.q_len)
    cols = _index_array(ki, self.bound.kv_len)
    batch: np.ndarray | int
    if self._batch is None:
      batch = 0
    else:
      batch = _index_array(lead[0], self._batch)
    if self.bound.has_positions:
      return self._at_positions(batch, rows, cols)
    if not (np.isscalar(batch) or np.ndim(batch) == 0):  # rows x columns per batch row
      batch = np.asarray(batch).reshape((-1,) + (1,) * (np.ndim(rows) + np.ndim(cols)))
    b = batch
    if np.size(rows) * np.size(cols) * np.size(b) > _dense.MAX_DENSE_ELEMENTS:
      raise MaskLimitError(
          f"this slice has {np.size(rows)} x {np.size(cols)} positions"
          f"{f' x {np.size(b)} batch rows' if np.ndim(b) else ''}, over the "
          f"{_dense.MAX_DENSE_ELEMENTS:,} elements of a dense mask", hint="Slice smaller tiles.")
    offset = self.bound.q_offset if uses_q(self.mask) else 0
    q = np.asarray(rows, dtype=np.int64) + offset
    k = np.asarray(cols, dtype=np.int64)
    # Outer indexing: the result is batch rows x rows x columns (each axis dropped for an int).
    ka = k.reshape((1,) * q.ndim + k.shape)
    tail = (1,) * k.ndim
    if q.ndim != 1:
      qa = q.reshape(q.shape + tail)
      return np.array(evaluate_mask(self.mask, Env(np, qa, ka, self.ops.arrays, b)), dtype=bool)
    # A band of rows at a time, so int64 temporaries stay small on big slices.
    step = max(1, _dense.DENSE_CHUNK // max(1, k.size * np.size(b)))
    parts = [evaluate_mask(self.mask, Env(np, q[r:r + step].reshape((-1,) + tail), ka,
                                          self.ops.arrays, b))
             for r in range(0, max(q.size, 1), step)]
    return np.array(np.concatenate(parts, axis=-1 - k.ndim) if len(parts) > 1 else parts[0],
                    dtype=bool)

  def _at_positions(self, batch: np.ndarray | int, rows: np.ndarray | int,
                    cols: np.ndarray | int) -> np.ndarray:
    """`__getitem__` for explicit positions: rows and columns read their positions."""
    b = batch if np.isscalar(batch) or np.ndim(batch) == 0 else np.asarray(batch)[:, None, None]
    qp, kp = self.bound.rows(np), self.bound.cols(np)
    rows, cols = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
    if np.ndim(b):  # several batch rows: positions per row, `[nb, *rows, *cols]` out
      sel = np.asarray(batch).reshape(-1)
      q = qp[sel if qp.shape[0] > 1 else np.zeros_like(sel)][:, rows]
      k = kp[sel if kp.shape[0] > 1 else np.zeros_like(sel)][:, cols]
      nb = sel.size
      qa = q.reshape(q.shape + (1,) * cols.ndim)
      ka = k.reshape((nb,) + (1,) * rows.ndim + cols.shape)
      b = sel.reshape((nb,) + (1,) * (rows.ndim + cols.ndim))
      return np.array(evaluate_mask(self.mask, Env(np, qa, ka, self.ops.arrays, b)), dtype=bool)
    bi = int(batch)
    q = qp[bi if qp.shape[0] > 1 else 0][rows]
    k = kp[bi if kp.shape[0] > 1 else 0][cols]
    qa, ka = q.reshape(q.shape + (1,)), k.reshape((1,) * q.ndim + k.shape)
    out = evaluate_mask(self.mask, Env(np, qa, ka, self.ops.arrays, b))
    return np.array(out, dtype=bool)

  @property
  def q_sequence(self) -> np.ndarray:
    self._require_in_kernel()
    return np.arange(self.bound.q_len, dtype=np.int32)

  @property
  def mask_function(self) -> Callable[[Any, Any], Any]:
    """`f(q_ids, kv_ids)`: the mask at row and column indices (NumPy or jax.numpy arrays).

    NumPy ids are evaluated in int64 like the tiles; JAX ids (as inside splash's
    kernel) in the jax.numpy path's integer type, int32 unless `jax_enable_x64`
    is on, after checking that every term of the mask fits it at this shape
    (`MaskValueError` otherwise).
    """
    self._require_in_kernel()
    mask, shape, arrays = self.mask, self.bound, self.ops.arrays
    offset = shape.q_offset if uses_q(mask) else 0
    checked: list[bool] = []

    def mask_function(q_ids: Any, kv_ids: Any) -> Any:
      if not (is_traced(q_ids) or is_traced(kv_ids)):
        q = np.asarray(q_ids, dtype=np.int64) + offset
        return evaluate_mask(mask, Env(np, q, np.asarray(kv_ids, dtype=np.int64), arrays, 0))
      if not checked:
        check_fits(mask, shape, arrays, bits=jax_int_bits(), what="the jax.numpy mask_function",
                   hint=overflow_hint(jnp))
        checked.append(True)
      dtype = jax_int()
      scalars = {n: jnp.asarray(a).astype(dtype) for n, a in arrays.items()}
      qt = jnp.asarray(q_ids).astype(dtype) + offset
      return evaluate_mask(mask, Env(jnp, qt, jnp.asarray(kv_ids).astype(dtype), scalars, 0))

    return mask_function

  def _require_in_kernel(self) -> None:
    if any(s.kind != "scalar" for s in self.mask.operands) or self.ops.batch is not None:
      raise AttributeError("a mask that reads array operands has no in-kernel mask_function")
    if self.bound.has_positions:
      raise AttributeError("a mask with explicit positions has no in-kernel mask_function")

  def _key(self) -> tuple[Any, ...]:
    pos = tuple(None if p is None else p.tobytes()
                for p in (self.bound.q_positions, self.bound.kv_positions))
    return (self.mask, self.bound.q_len, self.bound.kv_len, self.bound.q_offset,
            self.ops.static_bytes(), pos)

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, ComputableMask):
      return NotImplemented
    return self._key() == other._key()

  def __hash__(self) -> int:
    return hash(self._key())

  def __bool__(self) -> bool:
    raise MaskTypeError("a ComputableMask has no truth value",
                        hint="Slice it (`cm[:, :]`) for the dense array.")

  def __repr__(self) -> str:
    ops = ", ".join(self.ops.arrays)
    return (f"ComputableMask({str(self.mask)!r}, q_len={self.q_len}, kv_len={self.kv_len}, "
            f"q_offset={self.q_offset}" + (f", operands=[{ops}]" if ops else "") + ")")


def _index_array(i: Any, n: int) -> np.ndarray | int:
  if isinstance(i, slice):
    return np.arange(*i.indices(n))
  if isinstance(i, (int, np.integer)):
    j = int(i)
    if not -n <= j < n:
      raise IndexError(f"index {j} is out of bounds for size {n}")
    return np.asarray(j % n)
  arr = np.asarray(i)
  if arr.dtype == bool:
    return np.nonzero(arr)[0]
  if arr.size and (arr.min() < -n or arr.max() >= n):
    raise IndexError(f"index out of bounds for size {n}")
  return arr % n




ir.install(bind=ComputableMask)

