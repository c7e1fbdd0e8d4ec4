"""`BlockMap`: a mask lowered to tiles, and the formats kernels read.

The canonical format is *compact*: for every q tile, the runs of consecutive
non-empty key tiles that share a state, padded to a static maximum; and the
same per key tile over q tiles, for backward passes. It costs memory in
proportion to the mask's boundary, never the tile grid. The grid, the
FlexAttention index lists and the splash `MaskInfo` derive from it on demand.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np


EMPTY, PARTIAL, FULL = 0, 1, 2


class Runs(NamedTuple):
  """Runs of non-empty tiles along one axis, per line (q tile, or key tile for `cols`).

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


@jax.tree_util.register_pytree_node_class
class BlockMap:
  """A mask lowered to `block_q × block_kv` tiles: EMPTY (0), PARTIAL (1) or FULL (2).

  Sound always: a FULL tile is all true and an EMPTY tile all false within the
  mask's bounds (positions past `q_len`/`kv_len` belong to no tile's verdict;
  kernels mask them out). Exact on prelude masks with static operands: no
  PARTIAL tile is really FULL or EMPTY.

  Attributes:
    masks: the distinct masks, one per unique head.
    head_index: for each head, its index into `masks` (None for one mask).
    q_len, kv_len, q_offset: the bound shape (see DESIGN.md §3).
    block_q, block_kv: tile sizes.
    batch: the batch size when an operand is batched, else None.
    rows: `Runs` per q tile over key tiles (forward and dq).
    cols: `Runs` per key tile over q tiles (dk/dv).
    operands: the prepared operand arrays (for partial tiles and `to_dense`).

  Leading axes of every per-tile array it hands out are `[B, H]`, each present
  only when the mask has a batch (operands with a batch axis) or heads (a
  sequence of masks was compiled).

  >>> import maskc
  >>> bm = maskc.compile("causal", 512, block_q=128, block_kv=128)
  >>> bm.grid.tolist()
  [[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]]
  """

  def __init__(self, *, masks, head_index, q_len, kv_len, q_offset, block_q, block_kv, batch,
               rows: Runs, cols: "Runs | Callable[[], Runs]", operands: dict[str, Any],
               grid=None):
    self.masks = tuple(masks)
    self.head_index = None if head_index is None else tuple(head_index)
    self.q_len, self.kv_len, self.q_offset = q_len, kv_len, q_offset
    self.block_q, self.block_kv = block_q, block_kv
    self.batch = batch
    self.rows = rows
    self._cols = cols  # or a function computing them on first use (static maps)
    self.operands = operands
    self._grid = grid

  @property
  def cols(self) -> Runs:
    """Runs per key tile over q tiles, for the dk/dv pass (computed on first use)."""
    if callable(self._cols):
      self._cols = self._cols()
    return self._cols

  # ------------------------------------------------------------------ pytree

  def tree_flatten(self):
    children = (self.rows, self.cols, self.operands, self._grid, self.q_offset)
    aux = (self.masks, self.head_index, self.q_len, self.kv_len, self.block_q, self.block_kv,
           self.batch)
    return children, aux

  @classmethod
  def tree_unflatten(cls, aux, children):
    rows, cols, operands, grid, q_offset = children
    masks, head_index, q_len, kv_len, block_q, block_kv, batch = aux
    return cls(masks=masks, head_index=head_index, q_len=q_len, kv_len=kv_len,
               q_offset=q_offset, block_q=block_q, block_kv=block_kv, batch=batch, rows=rows,
               cols=cols, operands=operands, grid=grid)

  # ------------------------------------------------------------------ shape

  @property
  def n_q_tiles(self) -> int:
    return -(-self.q_len // self.block_q)

  @property
  def n_kv_tiles(self) -> int:
    return -(-self.kv_len // self.block_kv)

  @property
  def heads(self) -> int | None:
    return None if self.head_index is None else len(self.head_index)

  @property
  def lead_shape(self) -> tuple[int, ...]:
    """The leading `[B, H]` axes, each present only when it exists."""
    return ((self.batch,) if self.batch is not None else ()) + (
        (self.heads,) if self.heads is not None else ())

  @property
  def is_static(self) -> bool:
    return isinstance(self.rows.count, np.ndarray)

  @property
  def xp(self):
    if self.is_static:
      return np
    import jax.numpy as jnp
    return jnp

  def _public(self, arr):
    """`[B', U, ...]` internal storage → `[B?, H?, ...]` public axes."""
    xp = self.xp
    if self.head_index is not None:
      arr = arr[:, xp.asarray(np.asarray(self.head_index))]
    else:
      arr = arr[:, 0]
    if self.batch is None:
      arr = arr[0]
    return arr

  # ------------------------------------------------------------------ formats

  @property
  def grid(self):
    """`int8[..., n_q_tiles, n_kv_tiles]`: 0 empty, 1 partial, 2 full (built on first use)."""
    if self._grid is None:
      self._grid = grid_from_runs(self.xp, self.rows, self.n_kv_tiles)
    return self._public(self._grid)

  @property
  def compact(self) -> dict[str, Any]:
    """The compact runs with public leading axes: `q_*` per q tile, `kv_*` per key tile."""
    out = {}
    for prefix, runs in (("q", self.rows), ("kv", self.cols)):
      for field in Runs._fields:
        out[f"{prefix}_run_{field}"] = self._public(getattr(runs, field))
    return out

  def flex(self) -> dict[str, Any]:
    """FlexAttention `BlockMask` fields (as arrays; batch and head axes always present).

    `kv_num_blocks[b, h, i]` counts the PARTIAL key tiles of q tile i and
    `kv_indices[b, h, i, :n]` lists them in order; `full_kv_*` do the same for
    FULL tiles. `q_*` and `full_q_*` are the transpose, for the backward pass.
    Index lists are padded with zeros to the number of tiles.
    """
    xp = self.xp
    g = self.grid
    g = g.reshape(((self.batch or 1), (self.heads or 1)) + g.shape[-2:])
    out = {}
    for name, gg in (("kv", g), ("q", xp.swapaxes(g, -1, -2))):
      for prefix, state in (("", PARTIAL), ("full_", FULL)):
        hit = gg == state
        n = gg.shape[-1]
        order = xp.argsort(xp.where(hit, 0, 1) * n + xp.arange(n), axis=-1)
        count = hit.sum(-1).astype(xp.int32)
        idx = xp.where(xp.arange(n) < count[..., None], order, 0).astype(xp.int32)
        out[f"{prefix}{name}_num_blocks"] = count
        out[f"{prefix}{name}_indices"] = idx
    out["block_size"] = (self.block_q, self.block_kv)
    return out

  def splash(self, *, downcast_smem_data: bool = True):
    """Splash `MaskInfo`s `(fwd, dq, dkv, mask_function)` for JAX's splash kernel."""
    from maskc._splash_info import splash_mask_info
    return splash_mask_info(self, downcast_smem_data=downcast_smem_data)

  def to_dense(self):
    """The mask this map was compiled from, dense: bool `[..., q_len, kv_len]`."""
    from maskc._bind import materialize
    masks = [self.masks[i] for i in self.head_index] if self.head_index is not None else \
        self.masks[0]
    ops = {n: (a if self.batch is not None else a[0]) for n, a in self.operands.items()
           if not n.startswith("runs(")}
    return materialize(masks, self.q_len, self.kv_len, q_offset=self.q_offset, operands=ops)

  # ------------------------------------------------------------------ statistics

  @property
  def counts(self) -> dict[str, int]:
    """How many tiles are in each state (over all batch rows and heads)."""
    g = np.asarray(self.grid)
    return {"empty": int((g == EMPTY).sum()), "partial": int((g == PARTIAL).sum()),
            "full": int((g == FULL).sum())}

  @property
  def density(self) -> float:
    """The fraction of tiles that are not EMPTY: the work a block-sparse kernel does."""
    c = self.counts
    total = sum(c.values())
    return (c["partial"] + c["full"]) / total if total else 0.0

  @property
  def flops_saved(self) -> float:
    """The fraction of dense attention FLOPs skipped by never visiting EMPTY tiles.

    Counts in-bounds elements of non-empty tiles against `q_len × kv_len` per
    batch row and head; the same for any head dimension.
    """
    g = np.asarray(self.grid)
    rows = np.minimum(self.block_q, self.q_len - np.arange(self.n_q_tiles) * self.block_q)
    cols = np.minimum(self.block_kv, self.kv_len - np.arange(self.n_kv_tiles) * self.block_kv)
    area = rows[:, None] * cols[None, :]
    work = ((g != EMPTY) * area).sum()
    dense = self.q_len * self.kv_len * (g.size // area.size)
    return 1.0 - work / dense

  def attention_flops(self, head_dim: int) -> tuple[int, int]:
    """`(block_sparse, dense)` forward attention FLOPs (2 matmuls) per batch and head total."""
    dense = 4 * self.q_len * self.kv_len * head_dim * int(np.prod(self.lead_shape or (1,)))
    return int(round(dense * (1 - self.flops_saved))), dense

  # ------------------------------------------------------------------ pictures

  def to_text(self, width: int = 80) -> str:
    """A header and text art of the tile map, downsampled to `width` columns."""
    from maskc._render import render_text
    return render_text(self, width=width)

  def _repr_html_(self) -> str:
    from maskc._render import render_svg
    return render_svg(self)

  def to_svg(self) -> str:
    """An SVG picture of the tile map (no extra dependency)."""
    from maskc._render import render_svg
    return render_svg(self)

  def plot(self, ax=None):
    """Draws the tile map with matplotlib (the `plot` extra); returns the axes."""
    from maskc._render import plot
    return plot(self, ax=ax)

  # ------------------------------------------------------------------ identity

  def _key(self):
    arrays = tuple(np.asarray(a).tobytes() for a in self.rows)  # the columns follow from them
    ops = tuple(sorted((n, np.asarray(a).tobytes()) for n, a in self.operands.items()))
    return (self.masks, self.head_index, self.q_len, self.kv_len, int(self.q_offset),
            self.block_q, self.block_kv, self.batch, arrays, ops)

  def __eq__(self, other):
    if not isinstance(other, BlockMap):
      return NotImplemented
    if not (self.is_static and other.is_static):
      return self is other
    return self._key() == other._key()

  def __hash__(self):
    if not self.is_static:
      raise TypeError("a BlockMap built under jit (traced) is not hashable")
    return hash(self._key())

  def __repr__(self) -> str:
    heads = "" if self.heads is None else f", heads={self.heads}"
    batch = "" if self.batch is None else f", batch={self.batch}"
    masks = " ; ".join(str(m) for m in self.masks)
    if not self.is_static:
      return (f"BlockMap({masks!r}, q_len={self.q_len}, kv_len={self.kv_len}, tiles="
              f"{self.block_q}x{self.block_kv}{heads}{batch}, traced)")
    c = self.counts
    return (f"BlockMap({masks!r}, q_len={self.q_len}, kv_len={self.kv_len}, tiles="
            f"{self.block_q}x{self.block_kv}{heads}{batch}, density={self.density:.3f}, "
            f"full={c['full']}, partial={c['partial']}, empty={c['empty']})")


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
