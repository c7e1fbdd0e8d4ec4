"""FlexAttention's block lists, written from a map's runs of tiles (NumPy only).

FlexAttention stores, per line of tiles (a q tile for `kv_*`, a key tile for `q_*`), how
many tiles of a kind it has and their indices, ascending, followed by every other tile's
index, ascending too: `create_block_mask` sorts each line's 0/1 row with a stable argsort,
so `kv_indices[b, h, i]` is a permutation of `0..n-1`. These lists are written here from
runs, segment by segment, without sorting: a line is a few runs of selected tiles and the
gaps between them, each an interval of indices.

A tile that holds positions past `q_len` or `kv_len` (the last line or the last tile of a
line, when a length is not a whole number of blocks) is never FULL in `create_block_mask`,
which pads the dense mask with False before it counts; `demote` does the same to FULL
runs there, so the lists match.
"""

from __future__ import annotations

import numpy as np

from maskc.compiled.tiles import EMPTY, FULL, PARTIAL, Runs


def flat_runs(runs: Runs, n_other: int, *, last_line_ragged: bool,
              last_other_ragged: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The non-empty runs as flat `(line, start, stop, state)`, sorted by line and start, with
  FULL demoted to PARTIAL on tiles that reach past the end (see the module docstring).

  `line` numbers the lines of all leading axes together (`[B', U, n_lines]` flattened).
  """
  start, stop, state, count = (np.asarray(x) for x in runs)
  n_lines = count.shape[-1]
  r = start.shape[-1]
  count = count.reshape(-1)
  valid = (np.arange(r) < count[:, None]) & (state.reshape(-1, r) != EMPTY)
  line = np.broadcast_to(np.arange(count.size)[:, None], valid.shape)[valid].astype(np.int64)
  a = start.reshape(-1, r)[valid].astype(np.int64)
  z = stop.reshape(-1, r)[valid].astype(np.int64)
  st = state.reshape(-1, r)[valid].astype(np.int8)
  if last_line_ragged:
    st = np.where((line % n_lines == n_lines - 1) & (st == FULL), PARTIAL, st).astype(np.int8)
  if last_other_ragged:
    cut = (z == n_other) & (st == FULL)
    whole = cut & (z - a == 1)  # one tile: it becomes PARTIAL
    st = np.where(whole, PARTIAL, st).astype(np.int8)
    split = cut & ~whole  # FULL up to the last tile, which becomes a PARTIAL run of its own
    z = np.where(split, z - 1, z)
    line = np.concatenate([line, line[split]])
    a = np.concatenate([a, z[split]])
    z = np.concatenate([z, z[split] + 1])
    st = np.concatenate([st, np.full(int(split.sum()), PARTIAL, np.int8)])
    order = np.argsort(line * (n_other + 1) + a, kind="stable")
    line, a, z, st = line[order], a[order], z[order], st[order]
  return line, a, z, st


def ordered_lists(line: np.ndarray, start: np.ndarray, stop: np.ndarray, n_lines: int,
                  n_other: int) -> tuple[np.ndarray, np.ndarray]:
  """`(num_blocks int32[n_lines], indices int32[n_lines, n_other])` of the selected runs
  `[start, stop)` of each line (sorted by line and start, disjoint), in FlexAttention's
  layout: the selected indices ascending, then the others ascending."""
  length = stop - start
  num = np.bincount(line, weights=length, minlength=n_lines).astype(np.int64)
  # the gaps between selected runs: before each run, and after a line's last run
  first = np.ones(line.size, bool)
  first[1:] = line[1:] != line[:-1]
  prev_end = np.where(first, 0, np.concatenate([[0], stop[:-1]]))
  last_end = np.zeros(n_lines, np.int64)
  last_end[line] = stop  # runs are sorted: the last write of a line is its last run
  g_line = np.concatenate([line, np.arange(n_lines)])
  g_start = np.concatenate([prev_end, last_end])
  g_stop = np.concatenate([start, np.full(n_lines, n_other, np.int64)])
  keep = g_stop > g_start
  g_line, g_start, g_stop = g_line[keep], g_start[keep], g_stop[keep]
  order = np.argsort(g_line * (n_other + 1) + g_start, kind="stable")
  g_line, g_start, g_stop = g_line[order], g_start[order], g_stop[order]
  # where each segment lands in its line: selected runs from 0, gaps from `num`
  s_dest = _exclusive_cumsum(line, length)
  g_dest = num[g_line] + _exclusive_cumsum(g_line, g_stop - g_start)
  seg_line = np.concatenate([line, g_line])
  seg_dest = np.concatenate([s_dest, g_dest])
  seg_src = np.concatenate([start, g_start])
  seg_len = np.concatenate([length, g_stop - g_start])
  order = np.argsort(seg_line * (n_other + 1) + seg_dest, kind="stable")
  # the segments tile every line in order, so the flat output is one arange shifted per segment
  # (in int32: FlexAttention's type; a grid of 2**31 tiles is far beyond any shape it takes)
  shift = (seg_src - seg_dest - seg_line * n_other)[order].astype(np.int32)
  flat = np.repeat(shift, seg_len[order]) + np.arange(n_lines * n_other, dtype=np.int32)
  return num.astype(np.int32), flat.reshape(n_lines, n_other)


def _exclusive_cumsum(group: np.ndarray, values: np.ndarray) -> np.ndarray:
  """The sum of `values` before each element within its group (`group` sorted)."""
  if not group.size:
    return np.zeros(0, np.int64)
  total = np.cumsum(values) - values
  starts = np.ones(group.size, bool)
  starts[1:] = group[1:] != group[:-1]
  base = np.maximum.accumulate(np.where(starts, np.arange(group.size), 0))
  return total - total[base]
