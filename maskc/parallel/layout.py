"""Context-parallel layouts: which tokens each sequence shard holds, balanced for any mask.

A sequence of `seq_len` tokens is cut into chunks of `chunk` tokens (a multiple of
the tile size `block`) and stored in a new order; shard `r` holds the stored
chunks `r * per_shard .. (r + 1) * per_shard - 1`. A shard's attention work is
the tiles its rows visit: for every key tile a row tile is not EMPTY in, one
tile of work, PARTIAL tiles weighted by `partial_cost` (they evaluate the mask).

`balance` measures that work from the compiled runs of the mask at `seq_len`
(one `maskc.compile`, never the dense grid, never the tile grid) and orders the
chunks:

- `"contiguous"`: shard r holds tokens `[r L/s, (r+1) L/s)`;
- `"zigzag"`: MaxText's load-balanced order, `2 s` chunks, shard r holds chunks
  `r` and `2s - 1 - r` (balanced for causal masks, made for nothing else);
- `"balanced"`: chunks of `block` tokens assigned greedily, heaviest first, to
  the least loaded shard with room (LPT with equal shard sizes), then improved by
  swapping chunks between the heaviest and the lightest shard; the result is
  never worse than contiguous or zigzag, because those are candidates too.

Because a chunk is a whole number of tiles whose positions are consecutive, the
tiles of a shard's rows at the layout's positions are exactly the tiles of its
chunks in natural order: what `balance` reports is what a kernel visits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TypeVar, cast

import jax
import numpy as np
from jax.typing import ArrayLike

from maskc.compiled.tiles import FULL, PARTIAL, run_lengths
from maskc.language.arguments import MasksLike, integer
from maskc.language.errors import MaskValueError
from maskc.lowering.compile import compile as compile_

# An array the layout permutes along its sequence axis: NumPy in, NumPy out; jax, jax.
_Array = TypeVar("_Array", bound=ArrayLike)

METHODS = ("contiguous", "zigzag", "balanced")
PARTIAL_COST = 1.5  # a PARTIAL tile evaluates the mask on every position: costlier than FULL


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
  """Which tokens each sequence shard holds, and the attention work that gives it.

  Attributes:
    seq_len: tokens in the sequence.
    shards: sequence shards.
    chunk: tokens per chunk (a multiple of `block`).
    block: the tile size the work is counted in.
    order: `[n_chunks]`: stored chunk slot `i` holds natural chunk `order[i]`;
      shard `r` holds slots `r * per_shard .. (r + 1) * per_shard - 1`.
    inverse: `[n_chunks]`: natural chunk `c` is stored at slot `inverse[c]`.
    positions: `[seq_len]`: the natural position of each stored token (the token
      permutation; pass it as `q_positions` / `kv_positions`).
    work: `[shards]` float: tiles each shard's rows visit (FULL 1, PARTIAL
      `partial_cost`), summed over batch rows and heads.
    method: how the order was chosen.
    partial_cost: the weight of a PARTIAL tile.
  """
  seq_len: int
  shards: int
  chunk: int
  block: int
  order: np.ndarray
  inverse: np.ndarray
  positions: np.ndarray
  work: np.ndarray
  method: str
  partial_cost: float = PARTIAL_COST

  @property
  def per_shard(self) -> int:
    """Tokens per shard."""
    return self.seq_len // self.shards

  @property
  def imbalance(self) -> float:
    """The heaviest shard's work over the mean (1.0 is perfect balance)."""
    mean = float(np.mean(self.work))
    return float(np.max(self.work)) / mean if mean > 0 else 1.0

  @property
  def token_inverse(self) -> np.ndarray:
    """`[seq_len]`: natural token `p` is stored at index `token_inverse[p]`."""
    inv = np.empty_like(self.positions)
    inv[self.positions] = np.arange(self.seq_len)
    return inv

  def shard_positions(self, r: int) -> np.ndarray:
    """The natural positions of shard `r`'s tokens, in stored order."""
    return self.positions[r * self.per_shard:(r + 1) * self.per_shard]

  def permute(self, x: _Array, axis: int = 1) -> _Array:
    """`x` (natural token order along `axis`) in the layout's stored order.

    A jax array comes back sharded as it came (on any mesh, sharded along `axis` or not).
    """
    return _take(x, self.positions, axis)

  def unpermute(self, x: _Array, axis: int = 1) -> _Array:
    """`x` in stored order back to natural token order along `axis`."""
    return _take(x, self.token_inverse, axis)

  def __repr__(self) -> str:
    return (f"Layout({self.method}, seq_len={self.seq_len}, shards={self.shards}, "
            f"chunk={self.chunk}, imbalance={self.imbalance:.3f})")


def _take(x: _Array, idx: np.ndarray, axis: int) -> _Array:
  """`x` reordered by the permutation `idx` along `axis`; a jax array keeps its sharding.

  The gather names its output sharding (the input's): on an `Explicit` mesh JAX refuses a
  gather along a sharded axis without one, and on jax 0.12 the transpose of an unnamed
  one (a scatter) loses the sharding of batch or heads and is refused too.
  """
  if isinstance(x, np.ndarray):
    return cast(_Array, np.take(x, idx, axis=axis))
  import jax.numpy as jnp
  arr = jnp.asarray(x)
  where = (slice(None),) * (axis % arr.ndim) + (idx,)
  return cast(_Array, arr.at[where].get(out_sharding=jax.typeof(arr).sharding,
                                        unique_indices=True))


def on_devices(operands: Mapping[str, ArrayLike] | None) -> bool:
  """Whether some operand value cannot be read on this host, only on the devices: a tracer
  (inside a jax transformation), or a global `jax.Array` spanning other processes' devices."""
  return any(isinstance(v, jax.core.Tracer)
             or (isinstance(v, jax.Array) and not v.is_fully_addressable)
             for v in (operands or {}).values())


def tile_costs(mask: MasksLike, seq_len: int, *, block: int,
               operands: Mapping[str, ArrayLike] | None = None,
               partial_cost: float = PARTIAL_COST) -> np.ndarray:
  """Work of each row tile of `mask` at `seq_len` (`[seq_len / block]`), from compiled runs.

  Sums FULL + `partial_cost` x PARTIAL tiles over batch rows and heads. One static
  compile: O(the mask's boundary), no grid.
  """
  if on_devices(operands):
    raise MaskValueError("balance needs operand values it can read here, got traced ones or "
                         "global arrays this process holds only part of",
                         hint="Balance once, outside jit, with NumPy operands.")
  bm = compile_(mask, seq_len, block_q=block, block_kv=block, operands=operands)
  full = np.asarray(run_lengths(bm.rows, FULL), np.float64)      # [B', U, nq]
  part = np.asarray(run_lengths(bm.rows, PARTIAL), np.float64)
  per_mask = full + partial_cost * part
  heads: np.ndarray
  if bm.head_index is None:
    heads = np.ones(per_mask.shape[1])
  else:
    heads = np.bincount(np.asarray(bm.head_index), minlength=per_mask.shape[1])
  costs: np.ndarray = np.einsum("bun,u->n", per_mask, heads.astype(np.float64))
  return costs


def balance(mask: MasksLike, seq_len: int, shards: int, *, block: int,
            operands: Mapping[str, ArrayLike] | None = None, method: str = "balanced",
            chunk: int | None = None,
            partial_cost: float = PARTIAL_COST) -> Layout:
  """A layout of the sequence over `shards` context-parallel shards, balanced for `mask`.

  Args:
    mask: mask text, a Mask, or a per-head sequence of them.
    seq_len: tokens in the sequence (q_len = kv_len).
    shards: sequence shards.
    block: the tile size work is counted in (the attention kernel's block).
    operands: static operand values the mask reads (batched ones sum their rows' work).
    method: `"balanced"` (default), `"zigzag"` or `"contiguous"`.
    chunk: tokens per chunk, a multiple of `block` (default: `block` for balanced,
      `seq_len / (2 shards)` for zigzag, `seq_len / shards` for contiguous).
    partial_cost: the weight of a PARTIAL tile relative to a FULL one.

  Returns:
    A frozen `Layout`: the chunk order, its inverse, the token permutation, each
    shard's work and the imbalance (max / mean).

  Raises:
    MaskValueError: an unknown method, or lengths that do not divide into equal
      shards of whole chunks of whole tiles.

  >>> import maskc
  >>> lay = maskc.balance("causal", 1024, 4, block=64, method="zigzag")
  >>> lay.order.tolist(), round(lay.imbalance, 3)
  ([0, 7, 1, 6, 2, 5, 3, 4], 1.0)
  """
  seq_len = integer("seq_len", seq_len, minimum=1)
  shards = integer("shards", shards, minimum=1)
  block = integer("block", block, minimum=1)
  if method not in METHODS:
    raise MaskValueError(f"unknown balance method {method!r}",
                         hint=f"Use one of {', '.join(METHODS)}.")
  pieces = {"contiguous": shards, "zigzag": 2 * shards, "balanced": None}[method]
  if chunk is None:
    chunk = block if pieces is None else seq_len // pieces
  chunk = integer("chunk", chunk, minimum=1)
  if pieces is not None and chunk * pieces != seq_len:
    raise MaskValueError(f"{method} needs seq_len divisible into {pieces} chunks; got "
                         f"seq_len={seq_len}, chunk={chunk}",
                         hint=f"Use seq_len a multiple of {pieces * block}.")
  if chunk % block or seq_len % (chunk * shards):
    raise MaskValueError(
        f"seq_len={seq_len} does not split into {shards} shards of whole chunks of "
        f"{chunk} tokens that are whole tiles of {block}",
        hint=f"Use seq_len a multiple of {shards * block} (x2 for zigzag) and a chunk that "
             f"is a multiple of block.")
  costs = tile_costs(mask, seq_len, block=block, operands=operands, partial_cost=partial_cost)
  return _layout_from_costs(costs, seq_len, shards, block, chunk, method, partial_cost)


def _layout_from_costs(costs: np.ndarray, seq_len: int, shards: int, block: int, chunk: int,
                       method: str, partial_cost: float) -> Layout:
  """The layout of `method` from the row tiles' costs (see `balance`)."""
  per = chunk // block
  n_chunks = seq_len // chunk
  chunk_cost = costs.reshape(n_chunks, per).sum(axis=1)
  if method == "contiguous":
    order = np.arange(n_chunks)
  elif method == "zigzag":
    order = np.array([c for r in range(shards) for c in (r, 2 * shards - 1 - r)])
  else:
    order = _balanced_order(chunk_cost, shards)
    best = _make(order, costs, seq_len, shards, block, chunk, method, partial_cost)
    for other in ("contiguous", "zigzag"):
      size = seq_len // (shards if other == "contiguous" else 2 * shards)
      if size % block == 0 and size * (shards if other == "contiguous" else 2 * shards) \
          == seq_len:
        cand = _layout_from_costs(costs, seq_len, shards, block, size, other, partial_cost)
        if np.max(cand.work) < np.max(best.work) - 1e-9:
          best = dataclasses.replace(cand, method="balanced")
    return best
  return _make(order, costs, seq_len, shards, block, chunk, method, partial_cost)


def _make(order: ArrayLike, costs: np.ndarray, seq_len: int, shards: int, block: int,
          chunk: int, method: str, partial_cost: float) -> Layout:
  order = np.asarray(order, np.int64)
  n_chunks = order.size
  inverse = np.empty_like(order)
  inverse[order] = np.arange(n_chunks)
  positions = (order[:, None] * chunk + np.arange(chunk)[None, :]).reshape(-1)
  per = chunk // block
  chunk_cost = costs.reshape(n_chunks, per).sum(axis=1)
  work = chunk_cost[order].reshape(shards, n_chunks // shards).sum(axis=1)
  for a in (order, inverse, positions, work):
    a.setflags(write=False)
  return Layout(seq_len, shards, chunk, block, order, inverse, positions, work, method,
                partial_cost)


def _balanced_order(cost: np.ndarray, shards: int, sweeps: int = 4) -> np.ndarray:
  """Chunks into `shards` equal-size groups minimizing the heaviest: LPT, then swaps.

  Heaviest chunk first onto the least loaded shard that has room; then, a few
  sweeps, each swap between the heaviest and the lightest shard that lowers the
  heavier of the two. Returns the chunk order (each shard's chunks ascending).
  """
  n = cost.size
  cap = n // shards
  load = np.zeros(shards)
  room = np.full(shards, cap)
  owner = np.empty(n, np.int64)
  for c in np.argsort(-cost, kind="stable"):
    open_ = np.flatnonzero(room > 0)
    r = open_[np.argmin(load[open_])]
    owner[c] = r
    load[r] += cost[c]
    room[r] -= 1
  for _ in range(sweeps * shards):
    hi, lo = int(np.argmax(load)), int(np.argmin(load))
    gap = load[hi] - load[lo]
    if gap <= 0:
      break
    a = np.flatnonzero(owner == hi)
    b = np.flatnonzero(owner == lo)
    # swapping x (from hi) and y (from lo) moves d = cost[x] - cost[y]; the best d is
    # gap / 2, and any 0 < d < gap lowers the heavier of the two: for each x, the y
    # whose cost is nearest cost[x] - gap / 2 (sorted search, no |a| x |b| matrix).
    b = b[np.argsort(cost[b], kind="stable")]
    cb = cost[b]
    want = cost[a] - gap / 2
    at = np.clip(np.searchsorted(cb, want), 0, cb.size - 1)
    best_y, best_s = -1, np.inf
    for cand in (at, np.maximum(at - 1, 0)):
      d = cost[a] - cb[cand]
      score = np.where((d > 0) & (d < gap), np.abs(gap / 2 - d), np.inf)
      x = int(np.argmin(score))
      if score[x] < best_s:
        best_s, best_x, best_y = score[x], x, int(cand[x])
    if not np.isfinite(best_s):
      break
    d = cost[a[best_x]] - cost[b[best_y]]
    owner[a[best_x]], owner[b[best_y]] = lo, hi
    load[hi] -= d
    load[lo] += d
  return np.concatenate([np.flatnonzero(owner == r) for r in range(shards)])


def fixed_layout(seq_len: int, shards: int, *, block: int, method: str) -> Layout:
  """The contiguous or zigzag layout without reading the mask: its `work` is unknown (NaN).

  For masks whose operands are traced (inside `jax.jit`) or held across processes
  (`on_devices`), where `balance` cannot measure work: those two orders do not depend on
  the mask. The balanced order does, and needs operand values this host can read.

  Raises:
    MaskValueError: `method="balanced"`, or lengths that do not split (see `balance`).
  """
  if method not in ("contiguous", "zigzag"):
    raise MaskValueError(
        f"the {method!r} layout reads the mask's operands, which are traced here (or span "
        "other processes' devices)",
        hint="Balance once outside jit on representative operand values "
             "(`maskc.balance(mask, L, shards, block=..., operands=...)`) and pass the Layout, "
             "or use layout='zigzag' or 'contiguous'.")
  pieces = shards * (2 if method == "zigzag" else 1)
  chunk = seq_len // pieces
  if chunk * pieces != seq_len or chunk % block:
    raise MaskValueError(f"{method} needs seq_len={seq_len} divisible into {pieces} chunks of "
                         f"whole tiles of {block}",
                         hint=f"Use seq_len a multiple of {pieces * block}.")
  costs = np.full(seq_len // block, np.nan)
  return _layout_from_costs(costs, seq_len, shards, block, chunk, method, PARTIAL_COST)
