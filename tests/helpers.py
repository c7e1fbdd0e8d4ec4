"""Helpers shared by the test modules (test modules import from here, never from each other).

Tiles: a compiled map is *sound* when no EMPTY tile holds an allowed pair and no FULL
tile a disallowed one, and *exact* when, besides, no PARTIAL tile is uniform. The
reference for both is the dense mask (`maskc.materialize`, or one written in NumPy by
the test), cut into tiles here by NumPy alone: `tile_truth`, `tile_states`,
`unsound_tiles`, `inexact_tiles`, `assert_sound`, `assert_exact`; and the references
for runs, `runs_reference` (`runs(x)`) and `assert_maximal_runs` (a map's run lists).

Kernels: `assert_close` (max error relative to the array's scale) and
`assert_norm_close` / `rel_err` (error relative to the reference's norm, the GPU tests').

Splash: `assert_same_info`, two `MaskInfo`s equal up to the numbering of partial blocks.

FlexAttention: `flex_grids` rebuilds a `BlockMask`'s tile grid from its lists by the loop of
its docstring, and `assert_flex_layout` checks the lists' layout (what `create_block_mask`
writes); both take the tensors as NumPy, so they import no torch.
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
  """`grid` has a state for every tile of `dense` (its last two axes), and no unsound one;
  fails naming the first unsound tiles and their claimed and true states. Leading axes
  (batch, heads) broadcast."""
  grid = np.asarray(grid)
  truth = tile_states(dense, bq, bk)
  assert grid.shape[-2:] == truth.shape[-2:], (
      f"{what}: grid of {grid.shape[-2:]} tiles, the dense mask has {truth.shape[-2:]}")
  assert np.isin(grid, (EMPTY, PARTIAL, FULL)).all(), f"{what}: states other than 0, 1, 2"
  bad = unsound_tiles(grid, dense, bq, bk)
  if bad.any():
    claimed, truth = np.broadcast_to(grid, bad.shape), np.broadcast_to(truth, bad.shape)
    at = [tuple(int(x) for x in i) for i in np.argwhere(bad)[:5]]
    raise AssertionError(f"{int(bad.sum())} unsound tiles {what}: at {at}, claimed "
                         f"{[int(claimed[i]) for i in at]}, true "
                         f"{[int(truth[i]) for i in at]} (0 EMPTY, 1 PARTIAL, 2 FULL)")


def assert_exact(grid: np.ndarray, dense: np.ndarray, bq: int, bk: int, what: str = "") -> None:
  """`assert_sound`, and no PARTIAL tile that is uniform."""
  assert_sound(grid, dense, bq, bk, what)
  bad = inexact_tiles(grid, dense, bq, bk)
  if bad.any():
    at = [tuple(int(x) for x in i) for i in np.argwhere(bad)[:5]]
    raise AssertionError(f"{int(bad.sum())} PARTIAL tiles are uniform {what}: at {at}")


def runs_reference(x: np.ndarray) -> np.ndarray:
  """`runs(x)` by a plain loop: along the last axis, the 1-based index of each run of
  nonzero values of `x`, 0 outside them (independent of maskc's run ids)."""
  x = np.asarray(x) != 0
  out = np.zeros(x.shape, np.int64)
  for row, flat in zip(out.reshape(-1, x.shape[-1]), x.reshape(-1, x.shape[-1])):
    r = 0
    for i, v in enumerate(flat):
      if v and (i == 0 or not flat[i - 1]):
        r += 1
      row[i] = r if v else 0
  return out


def assert_maximal_runs(rows, expected: np.ndarray) -> None:
  """Each line's runs (`Runs` `[B, 1, n_lines, R]`, e.g. `BlockMap.rows`) are the maximal
  runs of one state of the tiles `expected` (`[B, n_lines, n_span]`): merged, in order,
  EMPTY left out."""
  count = np.asarray(rows.count)[:, 0]
  for b, i in np.ndindex(*count.shape):
    line = expected[b, i]
    edges = np.flatnonzero(np.diff(line)) + 1
    want = [(int(a), int(z), int(line[a])) for a, z in
            zip(np.concatenate([[0], edges]), np.concatenate([edges, [line.size]]))
            if line[a] != EMPTY]
    got = [(int(rows.start[b, 0, i, r]), int(rows.stop[b, 0, i, r]),
            int(rows.state[b, 0, i, r])) for r in range(count[b, i])]
    assert got == want, (b, i)


# ----------------------------------------------------------------------------- kernel outputs


def _float64(x) -> np.ndarray:
  """`x` (a NumPy or JAX array of any float dtype, bfloat16 included) as float64 NumPy."""
  return np.asarray(x).astype(np.float64)


def assert_close(x, ref, tol: float, what: str = "") -> None:
  """`x` is finite, of `ref`'s shape, and `max |x - ref| <= tol * max(max |ref|, 1)`.

  The error is relative to the array's scale, not to each element: the kernel tests' inputs
  are N(0, 1), so outputs and gradients are O(1), and below 1 the scale is 1.
  """
  x, ref = _float64(x), _float64(ref)
  assert x.shape == ref.shape, f"{what}: shape {x.shape} != {ref.shape}"
  assert np.isfinite(x).all(), f"{what}: non-finite values"
  scale = max(float(np.abs(ref).max(initial=0.0)), 1.0)
  err = float(np.abs(x - ref).max(initial=0.0))
  assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} x scale {scale:.3g}"


def rel_err(x, ref) -> float:
  """`||x - ref|| / ||ref||` (Frobenius norms, float64), after checking that `x` is finite
  and of `ref`'s shape."""
  x, ref = _float64(x), _float64(ref)
  assert x.shape == ref.shape, (x.shape, ref.shape)
  assert np.isfinite(x).all(), "non-finite values"
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_norm_close(x, ref, tol: float, what: str = "") -> None:
  """`rel_err(x, ref) <= tol`: an error relative to the reference's norm, as the GPU tests
  state their tolerances (a few large errors weigh less than in `assert_close`)."""
  err = rel_err(x, ref)
  assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


# ----------------------------------------------------------------------------- splash


def assert_same_info(a, b) -> None:
  """Equal splash `MaskInfo`s up to the numbering of their partial blocks: `block_mask` and
  `data_next` exactly, the same set of partial blocks, and `mask_next` pointing at equal
  blocks everywhere."""
  for field in ("block_mask", "data_next"):
    x, y = getattr(a, field), getattr(b, field)
    assert x.shape == y.shape, (field, x.shape, y.shape)
    assert x.dtype == y.dtype, (field, x.dtype, y.dtype)
    np.testing.assert_array_equal(x, y, err_msg=field)
  assert (a.mask_next is None) == (b.mask_next is None)
  assert (a.partial_mask_blocks is None) == (b.partial_mask_blocks is None)
  if a.partial_mask_blocks is not None:
    pa, pb = np.asarray(a.partial_mask_blocks), np.asarray(b.partial_mask_blocks)
    assert pa.shape == pb.shape
    assert {x.tobytes() for x in pa} == {x.tobytes() for x in pb}
    assert a.mask_next.dtype == b.mask_next.dtype
    np.testing.assert_array_equal(pa[a.mask_next.astype(int)], pb[b.mask_next.astype(int)])
  assert (a.q_sequence is None) == (b.q_sequence is None)
  if a.q_sequence is not None:
    np.testing.assert_array_equal(a.q_sequence, b.q_sequence)


# ----------------------------------------------------------------------------- FlexAttention


def _lists(num, idx) -> tuple[np.ndarray, np.ndarray]:
  return np.asarray(num.cpu().numpy() if hasattr(num, "cpu") else num), \
      np.asarray(idx.cpu().numpy() if hasattr(idx, "cpu") else idx)


def flex_grids(block_mask) -> tuple[np.ndarray, np.ndarray | None]:
  """`(forward, backward)` tile grids of a FlexAttention `BlockMask`, `int8[B, H, nq, nk]`:
  FULL where a `full_*` list names the tile, PARTIAL where the other list does, by a plain
  loop over the lists (the backward grid from the `q_*` lists, transposed; None without
  them)."""
  def grid(pairs, n_lines, n_other, transposed):
    out = None
    for state, (num, idx) in pairs:
      num, idx = _lists(num, idx)
      if out is None:
        out = np.zeros(num.shape + (n_other,), np.int8)
      for b, h, i in np.ndindex(*num.shape):
        for s in range(num[b, h, i]):
          out[b, h, i, idx[b, h, i, s]] = state
    return out.transpose(0, 1, 3, 2) if transposed else out

  q_len, kv_len = block_mask.seq_lengths
  bq, bk = block_mask.BLOCK_SIZE
  nq, nk = -(-q_len // bq), -(-kv_len // bk)
  fwd = grid([(PARTIAL, (block_mask.kv_num_blocks, block_mask.kv_indices)),
              (FULL, (block_mask.full_kv_num_blocks, block_mask.full_kv_indices))], nq, nk, False)
  if block_mask.q_num_blocks is None:
    return fwd, None
  bwd = grid([(PARTIAL, (block_mask.q_num_blocks, block_mask.q_indices)),
              (FULL, (block_mask.full_q_num_blocks, block_mask.full_q_indices))], nk, nq, True)
  return fwd, bwd


def assert_flex_layout(num, idx) -> None:
  """Each line of `idx` lists its first `num` tiles ascending, then every other tile ascending:
  a permutation of the line's tiles, as `create_block_mask` writes it."""
  num, idx = _lists(num, idx)
  n = idx.shape[-1]
  for line in np.ndindex(*num.shape):
    row, k = idx[line], int(num[line])
    assert sorted(row.tolist()) == list(range(n)), (line, row)
    assert (np.diff(row[:k]) > 0).all() and (np.diff(row[k:]) > 0).all(), (line, k, row)
