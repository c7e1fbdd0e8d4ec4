"""What a KV cache needs from a mask: how far back its rows reach, and where cached keys sit.

Pure functions of `maskc`'s public API and `jax.numpy`, shared by `maskc.flax.Attention`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import maskc

CACHE_LEN = "maskc_cache_len"
"""The scalar operand `k < maskc_cache_len` that keeps a decode step off unwritten slots."""


def masks_of(spec: maskc.MaskSpec) -> tuple[maskc.Mask, ...]:
  """The spec's masks, one per distinct head entry (a tuple of one for a single mask)."""
  m = spec.mask
  return (m,) if isinstance(m, maskc.Mask) else tuple(m)


def lookback(mask: maskc.Mask) -> int | None:
  """`w` such that the mask implies `q - k < w` (every allowed key at most `w - 1` back), or
  None when the compiler proves no such bound.

  Read from the compiled predicate's facts, never from the mask's name: a band `q - k <= hi`
  gives `hi + 1` (`sliding(w)`: `w`); a chunk `q // c == k // c` gives `c`.
  """
  dummy: dict[str, Any] = {}
  for spec in mask.operands:  # the facts are structural: any valid values do
    if spec.kind == "token":
      dummy[spec.name] = np.zeros(1, bool if spec.boolean else np.int32)
    elif spec.kind == "scalar":
      dummy[spec.name] = np.int32(1)
    else:
      dummy[spec.name] = np.zeros((1, 1), bool if spec.boolean else np.int32)
  try:
    predicate = maskc.compile(mask, 1, block_q=1, block_kv=1, operands=dummy).predicates[0]
  except maskc.MaskValueError:  # a `where` the dummy scalars break: prove nothing
    return None
  bounds = []
  if predicate.band[1] is not None:
    bounds.append(predicate.band[1] + 1)
  if predicate.chunk is not None:
    bounds.append(predicate.chunk)
  return max(1, min(bounds)) if bounds else None


def window_of(masks: Sequence[maskc.Mask]) -> int | None:
  """The largest lookback over the heads, or None when a head has none."""
  found = [lookback(m) for m in masks]
  if any(w is None for w in found):
    return None
  return max(w for w in found if w is not None)


def with_cache_bound(masks: Sequence[maskc.Mask], rows: bool = False) -> tuple[maskc.Mask, ...]:
  """Each mask `& k < maskc_cache_len`: unwritten cache slots are never attended.

  With `rows`, also `& q < maskc_cache_len`: a ragged call's padding rows (placed at or past
  their row's new length) attend nothing.
  """
  length = maskc.scalar(CACHE_LEN)
  bound = maskc.ir.k < length
  if rows:
    bound = bound & (maskc.ir.q < length)
  return tuple(m & bound for m in masks)


def ring_positions(index: jax.Array, size: int, sentinel: int) -> jax.Array:
  """The position held by each slot of a ring of `size` slots after `index` tokens.

  Position `p` lives in slot `p % size`, so slot `s` holds the latest `p < index` with
  `p % size == s`; a slot never written (`index < size`) gets `sentinel`, a position
  at or past the cache's end, which the `k < maskc_cache_len` bound masks out.
  """
  slots = jnp.arange(size, dtype=jnp.int32)
  last = index.astype(jnp.int32)[..., None] - 1  # a per-row index `[B]` gives `[B, size]`
  held = last - jnp.mod(last - slots, size)
  return jnp.where(held >= 0, held, jnp.int32(sentinel))


def ragged_ring_slots(index: jax.Array, count: jax.Array, n: int, size: int) -> jax.Array:
  """Per row, the ring slot each of a call's `n` tokens goes to, `[B, n]`, or `size`
  (out of range: not written) for padding and for tokens the row's own later tokens
  evict from the ring in this call. The written slots of a row are distinct.

  Args:
    index: each row's tokens before the call, `[B]`.
    count: each row's real tokens in the call, `[B]` (the rest are padding).
    n: the call's tokens. size: the ring's slots.
  """
  steps = jnp.arange(n, dtype=jnp.int32)[None]
  keep = (steps < count[:, None]) & (steps >= count[:, None] - size)
  return jnp.where(keep, jnp.mod(index[:, None] + steps, size), size)


def ring_slots(end: jax.Array, count: int, size: int) -> jax.Array:
  """The slots of positions `end - count .. end - 1` (distinct, as `count <= size`)."""
  first = end.astype(jnp.int32) - count
  return jnp.mod(first + jnp.arange(count, dtype=jnp.int32), size)
