"""Helpers shared by the test modules: tile truth from a dense mask, soundness and exactness.

A compiled map is *sound* when no EMPTY tile holds an allowed pair and no FULL tile a
disallowed one, and *exact* when, besides, no PARTIAL tile is uniform. The reference
for both is the dense mask (`maskc.materialize`), cut into tiles here by NumPy alone.
"""

from __future__ import annotations

import numpy as np

EMPTY, PARTIAL, FULL = 0, 1, 2


def tile_truth(dense: np.ndarray, bq: int, bk: int) -> tuple[np.ndarray, np.ndarray]:
  """Per tile of a dense bool mask `[..., Lq, Lk]`: (any pair allowed, every pair allowed),
  over the tile's in-bounds part."""
  dense = np.asarray(dense, bool)
  q_len, kv_len = dense.shape[-2:]
  nq, nk = -(-q_len // bq), -(-kv_len // bk)
  pad = np.zeros(dense.shape[:-2] + (nq * bq, nk * bk), bool)
  valid = np.zeros_like(pad)
  pad[..., :q_len, :kv_len] = dense
  valid[..., :q_len, :kv_len] = True
  t = pad.reshape(dense.shape[:-2] + (nq, bq, nk, bk))
  v = valid.reshape(t.shape)
  return t.any(axis=(-3, -1)), (t | ~v).all(axis=(-3, -1))


def tile_states(dense: np.ndarray, bq: int, bk: int) -> np.ndarray:
  """The exact EMPTY / PARTIAL / FULL state of every tile of a dense bool mask."""
  any_, all_ = tile_truth(dense, bq, bk)
  return np.where(all_, FULL, np.where(any_, PARTIAL, EMPTY)).astype(np.int8)


def unsound_tiles(grid: np.ndarray, dense: np.ndarray, bq: int, bk: int) -> np.ndarray:
  """Where `grid` claims EMPTY over an allowed pair or FULL over a disallowed one."""
  any_, all_ = tile_truth(dense, bq, bk)
  grid = np.asarray(grid)
  return ((grid == FULL) & ~all_) | ((grid == EMPTY) & any_)


def inexact_tiles(grid: np.ndarray, dense: np.ndarray, bq: int, bk: int) -> np.ndarray:
  """Where `grid` says PARTIAL over a tile that is all allowed or all disallowed."""
  any_, all_ = tile_truth(dense, bq, bk)
  return (np.asarray(grid) == PARTIAL) & (all_ | ~any_)


def assert_sound(grid: np.ndarray, dense: np.ndarray, bq: int, bk: int, what: str = "") -> None:
  """Fails naming the first unsound tiles and their claimed and true states."""
  bad = unsound_tiles(grid, dense, bq, bk)
  if bad.any():
    truth = tile_states(dense, bq, bk)
    at = [tuple(int(x) for x in i) for i in np.argwhere(bad)[:5]]
    raise AssertionError(f"{int(bad.sum())} unsound tiles {what}: at {at}, claimed "
                         f"{[int(np.asarray(grid)[i]) for i in at]}, true "
                         f"{[int(truth[i]) for i in at]} (0 EMPTY, 1 PARTIAL, 2 FULL)")


def assert_exact(grid: np.ndarray, dense: np.ndarray, bq: int, bk: int, what: str = "") -> None:
  """`assert_sound`, and no PARTIAL tile that is uniform."""
  assert_sound(grid, dense, bq, bk, what)
  bad = inexact_tiles(grid, dense, bq, bk)
  if bad.any():
    at = [tuple(int(x) for x in i) for i in np.argwhere(bad)[:5]]
    raise AssertionError(f"{int(bad.sum())} PARTIAL tiles are uniform {what}: at {at}")
