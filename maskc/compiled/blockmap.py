"""`BlockMap`: the compiled object every consumer reads.

A mask lowered to tiles, with everything a kernel needs and nothing of the
language: the compact runs of tiles (canonical format), one compiled
`Predicate` per distinct mask for its PARTIAL tiles, the operand arrays those
predicates read, and the structural facts the compiler found. The grid and the
FlexAttention index lists derive from the runs on demand; none of them is stored
on the object, which never changes after the compiler built it.

No kernel's format lives here: the kernels build theirs from the map
(`maskc.kernels.splash.mask_info(bm)` for JAX's splash `MaskInfo`,
`maskc.kernels.splash.tokamax_mask_info(bm)` for tokamax's), so the compiled
contract, and `import maskc`, load no Pallas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from maskc.compiled import intervals as _intervals, predicate as _predicate, render as _render
from maskc.compiled.intervals import KeyIntervals
from maskc.compiled.predicate import Predicate, ReadValues
from maskc.compiled.tiles import (
  EMPTY as EMPTY,
  FULL as FULL,
  PARTIAL as PARTIAL,
  Runs as Runs,
  grid_from_runs as grid_from_runs,
  runs_from_grid as runs_from_grid,
)

if TYPE_CHECKING:
  from maskc.language.ir import Mask

# What a map hands out per tile: NumPy arrays for a static map, jax arrays for a traced one.
TileArray = np.ndarray | jax.Array
# Kernel formats the map once built itself, and where they are built now.
_MOVED = {"splash": "`maskc.kernels.splash.mask_info(bm, ...)` (same arguments)",
          "tokamax_splash": "`maskc.kernels.splash.tokamax_mask_info(bm, ...)` (same arguments)"}


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class BlockMap:
  """A mask lowered to `block_q × block_kv` tiles: EMPTY (0), PARTIAL (1) or FULL (2).

  Sound always: a FULL tile is all true and an EMPTY tile all false within the
  mask's bounds (positions past `q_len`/`kv_len` belong to no tile's verdict;
  kernels mask them out). Exact on prelude masks with static operands: no
  PARTIAL tile is really FULL or EMPTY.

  Built by `maskc.compile`, frozen, and a pytree: its leaves are the runs, the
  operand arrays and `q_offset`; its static part (masks, shape, tiles, heads,
  batch, predicates) hashes without reading an operand byte.

  Attributes:
    masks: the distinct masks, one per unique head (IR data, for printing).
    head_index: for each head, its index into `masks` (None for one mask).
    q_len, kv_len, q_offset: the bound shape (see docs/design.md, "Positions").
    block_q, block_kv: tile sizes.
    batch: the batch size when an operand is batched, else None.
    rows: `Runs` per q tile over key tiles (forward and dq), `[B', U, n_q_tiles, R]`.
    operands: the operand arrays the predicates read (batch axis first), run ids included.
    predicates: per distinct mask, its compiled `Predicate` for PARTIAL tiles.
    line_bounds: traced maps only: per distinct mask, static bounds
      `(fwd_max, fwd_total, bwd_max, bwd_total)` on the non-empty tiles per line and
      in all (None where unknown), from the mask's operand-free conjuncts.
    segment_split: when every distinct mask has segment conjuncts `s[q] == s[k]` and
      the map is batched or traced: the static map of the masks without them (what
      splash needs besides `SegmentIds`), else None.
    int_range: the lowest and highest value any integer term of the masks takes at
      this shape and these operands (exact, from `maskc.semantics.overflow`), or None when an
      operand or the offset is traced. Kernels compute in int32 and refuse a map
      whose range leaves it.
    q_positions, kv_positions: explicit positions of the rows / columns, `[B', L]`
      (None: `q_offset + row` and `col`). The predicates then read positions as
      per-token reads (`read_values` gathers them), never the bare `q`/`k`.
    intervals: per distinct mask, its interval form (`maskc.compiled.intervals`: one
      interval of keys per row, proved from the mask's structure), or None (explicit
      positions, or a map built without them); read by `key_intervals()`.

  Leading axes of every per-tile array it hands out are `[B, H]`, each present
  only when the mask has a batch (operands with a batch axis) or heads (a
  sequence of masks was compiled).

  >>> import maskc
  >>> bm = maskc.compile("causal", 512, block_q=128, block_kv=128)
  >>> bm.grid.tolist()
  [[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]]
  """
  masks: tuple[Mask, ...]
  head_index: tuple[int, ...] | None
  q_len: int
  kv_len: int
  q_offset: Any
  block_q: int
  block_kv: int
  batch: int | None
  rows: Runs
  operands: Mapping[str, Any]
  predicates: tuple[Predicate, ...]
  col_runs: Runs | None = None
  backward: Callable[[], Runs] | None = None
  line_bounds: tuple[tuple[int, int, int, int] | None, ...] | None = None
  segment_split: BlockMap | None = None
  int_range: tuple[int, int] | None = None
  q_positions: Any = None
  kv_positions: Any = None
  intervals: tuple[KeyIntervals | None, ...] | None = None

  @property
  def cols(self) -> Runs:
    """Runs per key tile over q tiles, for the dk/dv pass (compiled when first asked for).

    The compiler memoizes them, so asking again costs nothing; the map itself never changes.
    """
    if self.col_runs is not None:
      return self.col_runs
    if self.backward is None:
      raise ValueError("this BlockMap was built without backward runs")
    return self.backward()

  # ------------------------------------------------------------------ pytree

  def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    # a plain dict (every operand written out): the same tree however the map was built
    children = (self.q_offset, self.rows, self.col_runs, dict(self.operands), self.q_positions,
                self.kv_positions)
    aux = (self.masks, self.head_index, self.q_len, self.kv_len, self.block_q, self.block_kv,
           self.batch, self.predicates, self.backward, self.line_bounds, self.segment_split,
           self.int_range, self.intervals)
    return children, aux

  @classmethod
  def tree_unflatten(cls, aux: tuple[Any, ...], children: tuple[Any, ...]) -> BlockMap:
    q_offset, rows, col_runs, operands, q_positions, kv_positions = children
    (masks, head_index, q_len, kv_len, block_q, block_kv, batch, predicates, backward,
     line_bounds, segment_split, int_range, intervals) = aux
    return cls(masks, head_index, q_len, kv_len, q_offset, block_q, block_kv, batch, rows,
               operands, predicates, col_runs, backward, line_bounds, segment_split, int_range,
               q_positions, kv_positions, intervals)

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
  def xp(self) -> ModuleType:
    return np if self.is_static else jnp

  def _public(self, arr: Any) -> TileArray:
    """`[B', U, ...]` internal storage → `[B?, H?, ...]` public axes."""
    xp = self.xp
    if self.head_index is not None:
      arr = arr[:, xp.asarray(np.asarray(self.head_index))]
    else:
      arr = arr[:, 0]
    if self.batch is None:
      arr = arr[0]
    elif arr.shape[0] != self.batch:
      arr = xp.broadcast_to(arr, (self.batch,) + arr.shape[1:])
    public: TileArray = arr
    return public

  # ------------------------------------------------------------------ reads

  def read_values(self, u: int, *, dtype: DTypeLike | None = None,
                  rest: bool = False) -> ReadValues:
    """The values of mask `u`'s reads at this map's positions (see `maskc.compiled.predicate`).

    `dtype` is the integer type (default: int64 for a static map, int32 when traced);
    `rest` gives those of the predicate without its segment conjuncts.
    """
    # `rest` is asked of predicates with segment conjuncts, which have one
    pred = cast(Predicate, self.predicates[u].rest) if rest else self.predicates[u]
    xp = np if self.is_static and all(isinstance(a, np.ndarray) for a in (
        list(self.operands.values()) + self._positions())) else jnp
    int_t = xp.int32 if xp is jnp else np.int64
    q = xp.arange(self.q_len, dtype=int_t) + xp.asarray(self.q_offset, int_t)
    k = xp.arange(self.kv_len, dtype=int_t)
    if self.q_positions is not None:
      q = xp.asarray(self.q_positions).astype(int_t)
    if self.kv_positions is not None:
      k = xp.asarray(self.kv_positions).astype(int_t)
    return _predicate.gather(pred, self.operands, q, k, xp, batch=self.batch,
                             block_q=self.block_q, block_kv=self.block_kv,
                             dtype=dtype or int_t)

  # ------------------------------------------------------------------ formats

  @property
  def grid(self) -> TileArray:
    """`int8[..., n_q_tiles, n_kv_tiles]`: 0 empty, 1 partial, 2 full (built when asked)."""
    return self._public(grid_from_runs(self.xp, self.rows, self.n_kv_tiles))

  @property
  def compact(self) -> dict[str, TileArray]:
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
    Each index list has one entry per tile of the line: after its `n` tiles it goes on
    with the line's other tiles, in order, as torch's `create_block_mask` lays them out
    (a stable descending argsort of the tile grid), so every array equals torch's.
    Built from the runs: memory follows the output, never more.
    """
    out: dict[str, Any] = {}
    lead = ((self.batch or 1), (self.heads or 1))
    for name, runs, n_other in (("kv", self.rows, self.n_kv_tiles),
                                ("q", self.cols, self.n_q_tiles)):
      for prefix, state in (("", PARTIAL), ("full_", FULL)):
        idx: TileArray
        count: TileArray
        g = grid_from_runs(self.xp, runs, n_other) != state  # the line's chosen tiles first
        if self.is_static:
          idx = np.argsort(g, axis=-1, kind="stable").astype(np.int32)
          count = (~g).sum(-1).astype(np.int32)
        else:
          idx = jnp.argsort(g, axis=-1, stable=True).astype(jnp.int32)
          count = (~g).sum(-1).astype(jnp.int32)
        out[f"{prefix}{name}_num_blocks"] = self._public(count).reshape(lead + count.shape[-1:])
        out[f"{prefix}{name}_indices"] = self._public(idx).reshape(lead + idx.shape[-2:])
    out["block_size"] = (self.block_q, self.block_kv)
    return out

  def to_dense(self) -> TileArray:
    """The mask this map was compiled from, dense: bool `[..., q_len, kv_len]`.

    Evaluates the compiled predicates on every position (the map's own verdicts
    are not used), so it is an independent view of what the kernels compute.
    """
    xp = self.xp
    outs = []
    for u, pred in enumerate(self.predicates):
      values = self.read_values(u)
      int_t = values.q.dtype
      q = (xp.arange(self.q_len, dtype=int_t) + xp.asarray(self.q_offset, int_t))[None, :, None]
      k = xp.arange(self.kv_len, dtype=int_t)[None, None, :]
      fetch = _predicate.dense_fetch(values, xp, block_q=self.block_q, block_kv=self.block_kv,
                                     q_len=self.q_len, kv_len=self.kv_len)
      out = _predicate.evaluate(pred, xp, q, k, fetch)
      outs.append(xp.broadcast_to(out, ((self.batch or 1), self.q_len, self.kv_len)))
    return self._public(xp.stack(outs, axis=1))

  def key_intervals(self) -> tuple[TileArray, TileArray, bool]:
    """`(start, stop, exact)`: one interval of keys per query row.

    `start` and `stop` are int32 `[..., q_len]` (leading `[B, H]` axes as the map has
    them): every allowed key of row `i` lies in `[start[i], stop[i])`, and a row with no
    allowed key has `start == stop` wherever `exact`. `exact` is a Python bool: True when
    every key in those ranges is allowed, for every value the operands could take (under
    `jit` too), so a kernel needs no mask evaluation. The intervals come from the mask's
    structure as the compiler proved it (`maskc.compiled.intervals`: bands, chunks, runs
    of equal reads, masks of one position, joined where they share a key), never from its
    name; where that proves nothing they are each row's hull of the non-EMPTY tiles, with
    `exact=False`. Segment ids are one interval per row only when each document is one
    run: proved on static values, declared under `jit` (`maskc.compile(...,
    contiguous=["seg"])`).

    >>> import maskc
    >>> start, stop, exact = maskc.compile("causal & chunk(4)", 8).key_intervals()
    >>> start.tolist(), stop.tolist(), exact
    ([0, 0, 0, 0, 4, 4, 4, 4], [1, 2, 3, 4, 5, 6, 7, 8], True)
    """
    xp = self.xp
    static = self.is_static and all(isinstance(a, np.ndarray) for a in (
        list(self.operands.values()) + self._positions()))
    if not static:
      xp = jnp
    int_t = np.int64 if xp is np else np.int32
    nb = self.batch or 1
    hull_lo, hull_hi = self._tile_hull(xp)
    los, his, exact = [], [], True
    for u, form in enumerate(self.intervals or (None,) * len(self.predicates)):
      if form is None or self.q_positions is not None or self.kv_positions is not None:
        lo, hi, ok = hull_lo[:, u], hull_hi[:, u], False
      else:
        positions = xp.arange(self.q_len, dtype=int_t) + xp.asarray(self.q_offset, int_t)
        env = _intervals.Env(xp, positions, self.kv_len, self.operands, nb, static)
        lo, hi, ok = _intervals.evaluate(form.form, env)
        if not ok:  # the tiles may say more
          lo, hi = xp.maximum(lo, hull_lo[:, u]), xp.minimum(hi, hull_hi[:, u])
      exact = exact and ok
      lo = xp.broadcast_to(lo, (nb, self.q_len))
      hi = xp.broadcast_to(hi, (nb, self.q_len))
      stop = xp.maximum(hi + 1, lo)
      los.append(xp.minimum(lo, stop))
      his.append(stop)
    start = self._public(xp.stack(los, axis=1).astype(np.int32))
    stop = self._public(xp.stack(his, axis=1).astype(np.int32))
    return start, stop, exact

  def band(self) -> tuple[int | None, int | None, TileArray | None] | None:
    """`(lo, hi, kv_lengths)` when the mask of every head is exactly the band
    `lo <= q - k <= hi` (either end None: unbounded), alone or with `& k < n`; else None.

    The compiler's interval form says so (`maskc.compiled.intervals.band_of`), never the
    mask's name: `causal`, `sliding(w)`, `local(l, r)`, `full`, `causal & k < kv_len`.
    `kv_lengths` is None for a band alone, else int32 `[B]` (or `[1]`): the keys each batch
    row keeps, `0..n-1`. For engines that take a band and key lengths as arguments
    (cuDNN). None with explicit positions.
    """
    if not self.intervals or self.q_positions is not None or self.kv_positions is not None:
      return None
    found = {None if f is None else _intervals.band_of(f.form) for f in self.intervals}
    if len(found) != 1 or (one := found.pop()) is None:
      return None
    band, keys = one
    if keys is None:
      return band.lo, band.hi, None
    xp = self.xp if self.is_static and all(
        isinstance(a, np.ndarray) for a in self.operands.values()) else jnp
    int_t = np.int64 if xp is np else np.int32
    positions = xp.arange(1, dtype=int_t) + xp.asarray(self.q_offset, int_t)
    env = _intervals.Env(xp, positions, self.kv_len, self.operands, self.batch or 1,
                         xp is np)
    return band.lo, band.hi, _intervals.key_lengths(keys, env).astype(np.int32)

  def _tile_hull(self, xp: ModuleType) -> tuple[Any, Any]:
    """Each row's first and last key of its line's non-EMPTY tiles, `[B', U, q_len]`
    (first > last where the line has none): sound for every mask."""
    runs = self.rows
    count = xp.asarray(runs.count)
    if runs.start.shape[-1] == 0:  # no run anywhere
      empty = xp.zeros(count.shape[:-1] + (self.q_len,), np.int64 if xp is np else np.int32)
      return empty + self.kv_len, empty - 1
    first = xp.asarray(runs.start)[..., 0] * self.block_kv
    last_run = xp.clip(count - 1, 0, None)[..., None]
    last = xp.take_along_axis(xp.asarray(runs.stop), last_run, axis=-1)[..., 0] * self.block_kv
    last = xp.minimum(last, self.kv_len) - 1
    first = xp.where(count > 0, first, self.kv_len)
    last = xp.where(count > 0, last, -1)
    rows = np.arange(self.q_len) // self.block_q
    return first[..., rows], last[..., rows]

  if not TYPE_CHECKING:  # type checkers see no catch-all attribute
    def __getattr__(self, name: str) -> Any:
      # Only reached for names the class does not have: the kernel formats that left it.
      if name in _MOVED:
        raise AttributeError(f"BlockMap.{name}() moved to the kernels: call {_MOVED[name]}")
      raise AttributeError(f"'BlockMap' object has no attribute {name!r}")

  # ------------------------------------------------------------------ statistics

  @property
  def counts(self) -> dict[str, int]:
    """How many tiles are in each state (over all batch rows and heads), from the runs."""
    s = _render.stats(self)
    return {"empty": s["empty"], "partial": s["partial"], "full": s["full"]}

  @property
  def density(self) -> float:
    """The fraction of tiles that are not EMPTY: the work a block-sparse kernel does."""
    return _render.stats(self)["density"]

  @property
  def flops_saved(self) -> float:
    """The fraction of dense attention FLOPs skipped by never visiting EMPTY tiles.

    Counts in-bounds elements of non-empty tiles against `q_len × kv_len` per
    batch row and head; the same for any head dimension.
    """
    return _render.stats(self)["flops_saved"]

  def attention_flops(self, head_dim: int) -> tuple[int, int]:
    """`(block_sparse, dense)` forward attention FLOPs (2 matmuls) per batch and head total."""
    dense = 4 * self.q_len * self.kv_len * head_dim * int(np.prod(self.lead_shape or (1,)))
    return int(round(dense * (1 - self.flops_saved))), dense

  # ------------------------------------------------------------------ pictures

  def to_text(self, width: int = 80) -> str:
    """A header and text art of the tile map, downsampled to `width` columns."""
    return _render.render_text(self, width=width)

  def _repr_html_(self) -> str:
    return _render.render_svg(self)

  def to_svg(self) -> str:
    """An SVG picture of the tile map (no extra dependency)."""
    return _render.render_svg(self)

  def plot(self, ax: Any = None) -> Any:
    """Draws the tile map with matplotlib (the `plot` extra); returns the axes."""
    return _render.plot(self, ax=ax)

  # ------------------------------------------------------------------ identity

  def _positions(self) -> list[Any]:
    return [p for p in (self.q_positions, self.kv_positions) if p is not None]

  def static_key(self) -> tuple[Any, ...]:
    """What the map is, without its arrays: masks, shape, tiles, heads, batch, predicates."""
    offset = int(self.q_offset) if not isinstance(self.q_offset, jax.core.Tracer) else None
    return (self.masks, self.head_index, self.q_len, self.kv_len, offset, self.block_q,
            self.block_kv, self.batch, self.predicates, self.q_positions is not None,
            self.kv_positions is not None)

  def _arrays(self) -> tuple[Any, ...]:
    return tuple(self.rows) + tuple(self.operands[n] for n in sorted(self.operands)) + tuple(
        self._positions())

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, BlockMap):
      return NotImplemented
    if self is other:
      return True
    if not (self.is_static and other.is_static) or self.static_key() != other.static_key():
      return False
    if sorted(self.operands) != sorted(other.operands):
      return False
    return all(np.array_equal(a, b) for a, b in zip(self._arrays(), other._arrays()))

  def __hash__(self) -> int:
    return hash(self.static_key())

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
