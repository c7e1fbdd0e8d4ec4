"""Tile geometry: which positions a tile, or a run of tiles, covers.

Rows are query positions `q_offset + row` and columns key positions `col`, unless
explicit positions are given (context-parallel layouts): then a run of tiles
covers the hull of its positions, which keeps every analysis over it sound.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from maskc.semantics.shape import Shape


class Axis:
  """Per-tile position facts of one axis with explicit positions `[B', L]`.

  A tile's position interval is the min and max of its positions, so analysis over
  it is sound for any positions. A tile is *dense* when its positions are
  `p, p+1, ..., p+n-1` in row order: only then is the interval exact, and a
  sub-range of its rows a sub-range of positions (`first + row offset`), which the
  finer analyses (certainty, pieces, sub-rectangles) rely on. Hulls over runs of
  tiles come from sparse tables of the tiles' minima and maxima (static path).
  """

  def __init__(self, xp: Any, positions: Any, length: int, block: int) -> None:
    self.xp = xp
    n = -(-length // block)
    pad = n * block - length
    pos = xp.asarray(positions)
    padded = xp.concatenate([pos, xp.broadcast_to(pos[:, -1:], (pos.shape[0], pad))], axis=1)
    tiles = padded.reshape(pos.shape[0], n, block)
    self.positions = pos
    self.first = tiles[:, :, 0]
    self.tmin = tiles.min(axis=-1)
    self.tmax = tiles.max(axis=-1)
    step = xp.arange(block, dtype=pos.dtype)
    rows = xp.arange(n * block).reshape(n, block)
    ok = (tiles == self.first[..., None] + step) | (rows >= length)
    self.dense_tiles = ok.all(axis=-1)
    self.many = pos.shape[0] > 1
    # the levels' minima and maxima: a list, stacked into one array on the static path
    self._mins: Any = [self.tmin]
    self._maxs: Any = [self.tmax]
    if xp is np:
      span = 1
      while 2 * span <= n:
        lo, hi = self._mins[-1], self._maxs[-1]
        self._mins.append(np.minimum(lo, np.concatenate([lo[:, span:], lo[:, -span:]], 1)))
        self._maxs.append(np.maximum(hi, np.concatenate([hi[:, span:], hi[:, -span:]], 1)))
        span *= 2
      self._mins, self._maxs = np.stack(self._mins), np.stack(self._maxs)  # [levels, B', n]

  def row(self, b: Any) -> Any:
    return b if self.many else 0

  def hull(self, b: Any, a: Any, z: Any) -> Any:
    """Inclusive position bounds of the tiles `[a, z)` (static, NumPy)."""
    a, z = np.asarray(a, np.int64), np.asarray(z, np.int64)
    n = np.maximum(z - a, 1)
    j = np.floor(np.log2(n)).astype(np.int64)
    j = np.where((1 << (j + 1)) <= n, j + 1, j)
    j = np.where((1 << j) > n, j - 1, j)
    j = np.clip(j, 0, len(self._mins) - 1)
    second = z - (1 << j)
    mins, maxs = self._mins, self._maxs
    r = self.row(b)
    return (np.minimum(mins[j, r, a], mins[j, r, second]),
            np.maximum(maxs[j, r, a], maxs[j, r, second]))

  def dense(self, b: Any, i: Any) -> Any:
    return self.dense_tiles[self.row(b), i]

  def start(self, b: Any, i: Any) -> Any:
    return self.first[self.row(b), i]

  def at(self, b: Any, idx: Any) -> Any:
    """Positions at row indices `idx` (clipped to the length), batch rows `b`."""
    return self.positions[self.row(b), idx]


class TileGeometry:
  """Tile geometry: inclusive position bounds of runs of tiles.

  Without explicit positions, row `r` is position `q_offset + r` and column `c`
  is `c`. With them (`shape.q_positions` / `kv_positions`), bounds are position
  hulls (see `Axis`) and finer analyses are limited to dense tiles: `dense_q`,
  `dense_k` say which; `b` selects the batch row of batched positions.
  """

  def __init__(self, shape: Shape, block_q: int, block_kv: int, xp: Any = np) -> None:
    self.shape, self.bq, self.bk = shape, block_q, block_kv
    self.nq = -(-shape.q_len // block_q)
    self.nk = -(-shape.kv_len // block_kv)
    self.qa = None if shape.q_positions is None else Axis(
        xp, shape.q_positions, shape.q_len, block_q)
    self.ka = None if shape.kv_positions is None else Axis(
        xp, shape.kv_positions, shape.kv_len, block_kv)
    # Whether every query position fits the integer type the analysis computes in
    # (int32 for a traced offset): where not, the analysis treats `q` as unknown.
    if shape.static or self.qa is not None:
      self.pos_ok = True
    else:
      top = int(np.iinfo(jnp.asarray(0).dtype).max) - (shape.q_len - 1)
      self.pos_ok = shape.q_offset <= top

  @property
  def positions(self) -> bool:
    return self.qa is not None or self.ka is not None

  @property
  def batched_positions(self) -> bool:
    return any(a is not None and a.many for a in (self.qa, self.ka))

  def q_bounds(self, a: Any, z: Any, b: Any = 0) -> Any:
    if self.qa is not None:
      return self.qa.hull(b, a, z)
    lo = a * self.bq
    hi = np.minimum(z * self.bq, self.shape.q_len) - 1
    return lo + self.shape.q_offset, hi + self.shape.q_offset

  def k_bounds(self, a: Any, z: Any, b: Any = 0) -> Any:
    if self.ka is not None:
      return self.ka.hull(b, a, z)
    return a * self.bk, np.minimum(z * self.bk, self.shape.kv_len) - 1

  def dense_q(self, b: Any, i: Any) -> Any:
    return True if self.qa is None else self.qa.dense(b, i)

  def dense_k(self, b: Any, j: Any) -> Any:
    return True if self.ka is None else self.ka.dense(b, j)

  def q_start(self, b: Any, i: Any) -> Any:
    """Position of tile i's first row (rows of a dense tile follow it one by one)."""
    return i * self.bq + self.shape.q_offset if self.qa is None else self.qa.start(b, i)

  def k_start(self, b: Any, j: Any) -> Any:
    return j * self.bk if self.ka is None else self.ka.start(b, j)

  def q_at(self, b: Any, rows: Any) -> Any:
    return rows + self.shape.q_offset if self.qa is None else self.qa.at(b, rows)

  def k_at(self, b: Any, cols: Any) -> Any:
    return cols if self.ka is None else self.ka.at(b, cols)
