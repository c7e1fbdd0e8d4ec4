"""Exact allowed intervals per row or per column of a compiled map, from its tiles.

A format that lists, for each row (or column), where the allowed positions are needs the
mask exactly, but never the dense `q_len × kv_len` array: FULL tiles give their whole span,
EMPTY tiles nothing, and only PARTIAL tiles are evaluated, with the map's compiled
predicate (what the kernels evaluate). Cost: the tiles on the mask's boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from maskc.compiled import predicate as _predicate
from maskc.compiled.blockmap import BlockMap
from maskc.compiled.tiles import FULL
from maskc.language.errors import MaskValueError


def require_static(bm: BlockMap, what: str) -> None:
  """Refuses a map built from traced operands: its facts are not known here."""
  if not bm.is_static:
    raise MaskValueError(f"{what} needs static operand values; this map was compiled under jit",
                         hint="Compile it outside jit, with NumPy operands.")


def _positions(bm: BlockMap, b: int) -> tuple[np.ndarray, np.ndarray]:
  if bm.q_positions is not None:
    qp = np.asarray(bm.q_positions)
    qp = qp[min(b, qp.shape[0] - 1)] if qp.ndim == 2 else qp
  else:
    qp = np.arange(bm.q_len, dtype=np.int64) + int(bm.q_offset)
  if bm.kv_positions is not None:
    kp = np.asarray(bm.kv_positions)
    kp = kp[min(b, kp.shape[0] - 1)] if kp.ndim == 2 else kp
  else:
    kp = np.arange(bm.kv_len, dtype=np.int64)
  return qp.astype(np.int64), kp.astype(np.int64)


def tile_evaluator(bm: BlockMap, u: int, b: int) -> Callable[[int, int], np.ndarray]:
  """`tile(i, j)`: mask `u` of batch row `b` on tile (i, j), bool `[rows, cols]` cut at the
  map's bounds (the last tile of a row or column may be smaller)."""
  values = bm.read_values(u)
  pred = bm.predicates[u]
  bb = min(b, values.q.shape[0] - 1)
  qp, kp = _positions(bm, b)

  def tile(i: int, j: int) -> np.ndarray:
    rows = np.arange(i * bm.block_q, min((i + 1) * bm.block_q, bm.q_len))
    cols = np.arange(j * bm.block_kv, min((j + 1) * bm.block_kv, bm.kv_len))

    def fetch(kind: str, slot: int) -> Any:
      if kind == "q_read":
        return values.q[bb, slot][rows][:, None]
      if kind == "k_read":
        return values.k[bb, slot][cols][None, :]
      if kind == "scalar":
        return values.scalars[bb, slot]
      if kind == "pair":
        return values.pairs[bb, slot][np.ix_(rows, cols)]
      return values.tile_pairs[bb, slot, i, j]

    out = _predicate.evaluate(pred, np, qp[rows][:, None], kp[cols][None, :], fetch)
    return np.asarray(out, bool)

  return tile


def line_intervals(bm: BlockMap, u: int, b: int, *, columns: bool = False
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Every maximal interval of allowed positions along each row (or each column).

  Returns:
    `(line, start, stop)`, int64 arrays sorted by line then start: row (column) `line[n]`
    allows exactly the key columns (query rows) `[start[n], stop[n])` of its intervals.
  """
  runs = bm.cols if columns else bm.rows
  bu = (min(b, runs.count.shape[0] - 1), u)
  start, stop = np.asarray(runs.start[bu]), np.asarray(runs.stop[bu])
  state, count = np.asarray(runs.state[bu]), np.asarray(runs.count[bu])
  # the line's own axis, the other axis
  size, other = (bm.kv_len, bm.q_len) if columns else (bm.q_len, bm.kv_len)
  block, other_block = (bm.block_kv, bm.block_q) if columns else (bm.block_q, bm.block_kv)
  tile = tile_evaluator(bm, u, b)
  lines, starts, stops = [], [], []
  for t in range(count.shape[0]):
    first = t * block
    here = np.arange(first, min(first + block, size))
    for r in range(int(count[t])):
      s, e = int(start[t, r]), int(stop[t, r])
      if state[t, r] == FULL:
        lines.append(here)
        starts.append(np.full(here.size, s * other_block))
        stops.append(np.full(here.size, min(e * other_block, other)))
        continue
      for o in range(s, e):
        m = tile(o, t) if columns else tile(t, o)
        m = m.T if columns else m  # [lines of this tile, positions along the other axis]
        padded = np.pad(m, ((0, 0), (1, 1)))
        edge = np.diff(padded.astype(np.int8), axis=1)
        li, lo = np.nonzero(edge == 1)
        _, hi = np.nonzero(edge == -1)
        lines.append(first + li)
        starts.append(o * other_block + lo)
        stops.append(o * other_block + hi)
  if not lines:
    z = np.zeros(0, np.int64)
    return z, z, z
  line = np.concatenate(lines).astype(np.int64)
  lo = np.concatenate(starts).astype(np.int64)
  hi = np.concatenate(stops).astype(np.int64)
  order = np.lexsort((lo, line))
  line, lo, hi = line[order], lo[order], hi[order]
  # merge intervals of a line that touch (a run split at a tile edge, FULL next to PARTIAL)
  new = np.ones(line.size, bool)
  new[1:] = (line[1:] != line[:-1]) | (lo[1:] > hi[:-1])
  group = np.cumsum(new) - 1
  out_hi = np.zeros(int(group[-1]) + 1, np.int64)
  np.maximum.at(out_hi, group, hi)
  return line[new], lo[new], out_hi


def distinct(bm: BlockMap) -> list[int]:
  """The distinct mask index of each head (one entry when the map has no heads)."""
  return list(bm.head_index) if bm.head_index is not None else [0]
