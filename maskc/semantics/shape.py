"""A mask's shape and the positions of its rows and columns (docs/design.md, "Positions").

Row `i` has `q = q_offset + i`, column `j` has `k = j`, and `q_offset` defaults to
`kv_len - q_len` (bottom-right alignment); explicit position arrays replace both.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from maskc.language import ir
from maskc.language.arguments import integer
from maskc.language.errors import MaskTypeError, MaskValueError


@dataclasses.dataclass(frozen=True)
class Shape:
  """A mask's shape and the positions of its rows and columns.

  Row `i` is query position `q_positions[..., i]` when positions are given, else
  `q_offset + i`; column `j` is key position `kv_positions[..., j]`, else `j`.
  Given positions are stored as `[B', L]` integer arrays (`B'` is 1 without a
  batch axis): int64 NumPy when static, int32 jax arrays when traced.
  """
  q_len: int
  kv_len: int
  q_offset: Any  # int, or a traced scalar under jit
  q_positions: Any = None
  kv_positions: Any = None

  @staticmethod
  def of(q_len: Any, kv_len: Any = None, q_offset: Any = None, *, q_positions: Any = None,
         kv_positions: Any = None) -> Shape:
    q_len = integer("q_len", q_len, minimum=1)
    kv_len = q_len if kv_len is None else integer("kv_len", kv_len, minimum=1)
    if q_positions is not None and q_offset is not None:
      raise MaskValueError("both q_offset and q_positions were given",
                           hint="Pass q_positions = q_offset + arange(q_len) instead.")
    if q_offset is None:
      q_offset = kv_len - q_len
    elif not isinstance(q_offset, jax.core.Tracer):
      q_offset = integer("q_offset", q_offset)
    return Shape(q_len, kv_len, q_offset, _positions("q_positions", q_positions, q_len),
                 _positions("kv_positions", kv_positions, kv_len))

  @property
  def static(self) -> bool:
    return not any(isinstance(x, jax.core.Tracer)
                   for x in (self.q_offset, self.q_positions, self.kv_positions))

  @property
  def has_positions(self) -> bool:
    """Whether explicit positions were given for the rows or the columns."""
    return self.q_positions is not None or self.kv_positions is not None

  @property
  def positions_batch(self) -> int | None:
    """The batch size of batched (`[B, L]`) positions, else None."""
    sizes = {int(p.shape[0]) for p in (self.q_positions, self.kv_positions)
             if p is not None and p.shape[0] > 1}
    if len(sizes) > 1:
      raise MaskValueError(f"q_positions and kv_positions disagree on the batch size: "
                           f"{sorted(sizes)}")
    return sizes.pop() if sizes else None

  def rows(self, xp: ModuleType, dtype: DTypeLike | None = None) -> Any:
    """Query positions of every row, `[B', q_len]`."""
    if self.q_positions is not None:
      return self.q_positions if dtype is None else self.q_positions.astype(dtype)
    dtype = dtype or (np.int64 if xp is np else jnp.int32)
    return (xp.arange(self.q_len, dtype=dtype) + xp.asarray(self.q_offset, dtype))[None]

  def cols(self, xp: ModuleType, dtype: DTypeLike | None = None) -> Any:
    """Key positions of every column, `[B', kv_len]`."""
    if self.kv_positions is not None:
      return self.kv_positions if dtype is None else self.kv_positions.astype(dtype)
    return xp.arange(self.kv_len, dtype=dtype or (np.int64 if xp is np else jnp.int32))[None]

  def q_hull(self) -> tuple[int, int]:
    """Static smallest and largest query position."""
    if self.q_positions is None:
      return self.q_offset, self.q_offset + self.q_len - 1
    return int(self.q_positions.min()), int(self.q_positions.max())

  def k_hull(self) -> tuple[int, int]:
    """Static smallest and largest key position."""
    if self.kv_positions is None:
      return 0, self.kv_len - 1
    return int(self.kv_positions.min()), int(self.kv_positions.max())


def _positions(name: str, value: Any, length: int) -> Any:
  """Checked positions `[L]` or `[B, L]` as `[B', L]`: int64 NumPy, or int32 when traced."""
  if value is None:
    return None
  traced = isinstance(value, jax.core.Tracer)
  arr = value if traced else np.asarray(value)
  if not (jnp.issubdtype(arr.dtype, jnp.integer)):
    raise MaskTypeError(f"{name} must hold integers, got {arr.dtype}",
                        hint=f"Cast it: `{name}.astype(np.int32)`.")
  if arr.ndim not in (1, 2) or arr.shape[-1] != length:
    raise MaskValueError(f"{name} has shape {tuple(arr.shape)}; it must be [{length}] or "
                         f"[B, {length}], one position per row or column")
  if traced:
    return jnp.asarray(arr, jnp.int32).reshape((-1, length))
  if arr.size and (arr.min() < -2**62 or arr.max() >= 2**62):
    raise MaskValueError(f"{name} holds positions beyond +-2**62",
                         hint="Renumber the positions to fit in int64 with room to compute.")
  return arr.astype(np.int64).reshape((-1, length))



def batch_of(ops_batch: int | None, shape: Shape) -> int | None:
  """The batch size of operands and positions together (they must agree)."""
  pb = shape.positions_batch
  if ops_batch is not None and pb is not None and ops_batch != pb:
    raise MaskValueError(f"the operands' batch size {ops_batch} differs from the positions' "
                         f"{pb}", hint="Give operands and positions the same leading size.")
  return ops_batch if ops_batch is not None else pb


def uses_q(m: ir.Node) -> bool:
  """Whether `m` reads the query position (an offset it never reads need not fit a type)."""
  return any(isinstance(n, ir.Pos) and n.axis == "q" for n in ir.walk(m))
