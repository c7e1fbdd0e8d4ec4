"""Tile states and runs of tiles: the vocabulary every format of a `BlockMap` shares.

A lowered mask is, per line of tiles (a q tile, or a key tile for backward
passes), a list of *runs*: consecutive tiles `[start, stop)` in one state,
PARTIAL or FULL. Every other format (the grid, FlexAttention's index lists,
splash's `MaskInfo`, the pictures, the kernels' tile lists) is derived from the
runs here, by one expansion (`expand_runs`), so no consumer re-derives it.

This module imports nothing of maskc: the compiler, the formats and the
kernels all stand on it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

EMPTY, PARTIAL, FULL = 0, 1, 2


class Runs(NamedTuple):
  """Runs of non-empty tiles along one axis, per line.

  Attributes:
    start: `int32[B', U, n_lines, R]`: first tile of each run.
    stop: `int32[B', U, n_lines, R]`: one past its last tile.
    state: `int8[B', U, n_lines, R]`: PARTIAL (1) or FULL (2); 0 in padding.
    count: `int32[B', U, n_lines]`: how many of the R slots are runs.

  `B'` is the batch size or 1, `U` the number of distinct masks. Runs of a
  line are sorted, disjoint and maximal (neighbours differ in state or are
  separated by empty tiles). Rebuilding the grid:

      grid = zeros((B', U, n_lines, n_other), int8)
      for b, u, i in ndindex(count.shape):
        for r in range(count[b, u, i]):
          grid[b, u, i, start[b, u, i, r]:stop[b, u, i, r]] = state[b, u, i, r]
  """
  start: Any
  stop: Any
  state: Any
  count: Any


class Tiles(NamedTuple):
  """Non-empty tiles listed one by one (NumPy), sorted by (lead, line, other).

  Attributes:
    lead: flat index over the leading axes of the runs (`[B', U]` flattened).
    line: the tile's line (q tile for row runs, key tile for column runs).
    other: its index along the line.
    state: PARTIAL or FULL.
  """
  lead: np.ndarray
  line: np.ndarray
  other: np.ndarray
  state: np.ndarray


def expand_runs(runs: Runs, want: int | None = None) -> Tiles:
  """Every tile of `runs` (static, NumPy) in state `want` (or any non-empty state).

  Work and memory are proportional to the tiles listed, never to the grid.
  """
  start = np.asarray(runs.start)
  stop = np.asarray(runs.stop)
  state = np.asarray(runs.state)
  count = np.asarray(runs.count)
  r = start.shape[-1]
  valid = np.arange(r) < count[..., None]
  keep = valid & (state != EMPTY) if want is None else valid & (state == want)
  length = np.where(keep, stop.astype(np.int64) - start, 0).reshape(-1)
  total = int(length.sum())
  lines = count.size
  n_lines = count.shape[-1] if count.ndim else 1
  slot_line = np.repeat(np.arange(lines, dtype=np.int64), r)
  first = np.repeat(np.cumsum(length) - length, length)
  other = np.repeat(start.reshape(-1).astype(np.int64), length) + np.arange(total) - first
  flat_line = np.repeat(slot_line, length)
  st = np.repeat(state.reshape(-1), length).astype(np.int8)
  return Tiles(flat_line // n_lines, flat_line % n_lines, other, st)


def tile_lists(runs: Runs, want: int) -> tuple[np.ndarray, np.ndarray]:
  """Per line, the sorted indices of its tiles in state `want` (static runs).

  Returns `(idx [..., n_lines, M], count [..., n_lines])`: `idx[..., i, :count[..., i]]`
  lists line i's tiles, the rest is 0; M is the largest count (at least 1).
  """
  lead_shape = np.shape(runs.count)
  t = expand_runs(runs, want)
  n_lines = lead_shape[-1]
  flat = t.lead * n_lines + t.line
  count = np.bincount(flat, minlength=int(np.prod(lead_shape))).astype(np.int32)
  m = max(1, int(np.max(count)) if count.size else 1)
  first = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
  slot = np.arange(flat.size) - first[flat]
  idx = np.zeros((count.size, m), np.int32)
  idx[flat, slot] = t.other
  return idx.reshape(lead_shape + (m,)), count.reshape(lead_shape)


def run_lengths(runs: Runs, want: int | None = None):
  """Tiles per line in state `want` (or non-empty), `[..., n_lines]`; NumPy or jax.numpy."""
  xp = _xp(runs.start)
  r = runs.start.shape[-1]
  valid = xp.arange(r) < runs.count[..., None]
  keep = (runs.state != EMPTY) if want is None else (runs.state == want)
  return xp.where(valid & keep, runs.stop - runs.start, 0).sum(-1)


def grid_from_runs(xp, runs: Runs, n_other: int):
  """The dense tile grid `[B', U, n_lines, n_other]` described by `runs`."""
  j = xp.arange(n_other)
  start, stop, state = runs.start[..., None], runs.stop[..., None], runs.state[..., None]
  inside = (j >= start) & (j < stop)
  return xp.max(xp.where(inside, state, 0), axis=-2).astype(xp.int8) if runs.start.shape[-1] \
      else xp.zeros(runs.count.shape + (n_other,), xp.int8)


def runs_from_grid(xp, grid, max_runs: int | None = None) -> Runs:
  """Maximal runs of equal non-empty states along the last axis of `grid`."""
  n = grid.shape[-1]
  pad = xp.zeros(grid.shape[:-1] + (1,), grid.dtype)
  prev = xp.concatenate([pad, grid[..., :-1]], axis=-1)
  nxt = xp.concatenate([grid[..., 1:], pad], axis=-1)
  is_start = (grid != prev) & (grid != EMPTY)
  is_end = (grid != nxt) & (grid != EMPTY)
  j = xp.arange(n, dtype=xp.int32)
  r = n if max_runs is None else max_runs
  starts = xp.sort(xp.where(is_start, j, n), axis=-1)[..., :r]
  stops = xp.sort(xp.where(is_end, j + 1, n + 1), axis=-1)[..., :r]
  count = is_start.sum(-1).astype(xp.int32)
  valid = xp.arange(r) < count[..., None]
  state = xp.take_along_axis(grid, xp.clip(starts, 0, n - 1), axis=-1)
  return Runs(xp.where(valid, starts, 0).astype(xp.int32), xp.where(valid, stops, 0).astype(
      xp.int32), xp.where(valid, state, 0).astype(xp.int8), count)


def _xp(a):
  return np if isinstance(a, np.ndarray) else jnp
