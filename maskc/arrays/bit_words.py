"""Boolean flags along a line packed into 32-bit words, and counts read from them (jax.numpy).

Under `jit` on a CPU, XLA compiles every fused kernel separately, and a prefix
sum (`jnp.cumsum`: a tree of reduce-windows) is eight of them and the slowest
step of a traced lowering that numbers runs. Flags packed 32 to a word give the
same counts from population counts: how many flags are set up to each place is
the set bits of the words before it plus those of its own word at or below it.
Each level of words is one small reduction (a kernel), and everything else is
elementwise, fused into the kernels that read it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

WORD = 32  # flags per word


def bit_words(flags: Any) -> Any:
  """`flags` (`[..., m]` bool) as `[..., ceil(m / 32)]` uint32 words: flag `32 w + b` is
  bit `b` of word `w` (the last word padded with zeros)."""
  m = flags.shape[-1]
  n_words = -(-m // WORD)
  padded = jnp.pad(flags, [(0, 0)] * (flags.ndim - 1) + [(0, n_words * WORD - m)])
  bit = jnp.left_shift(jnp.uint32(1), jnp.arange(WORD, dtype=jnp.uint32))
  return jnp.sum(jnp.where(padded.reshape(flags.shape[:-1] + (n_words, WORD)), bit,
                           jnp.uint32(0)), axis=-1, dtype=jnp.uint32)


def count_through(xp: ModuleType, flags: Any, dtype: Any) -> Any:
  """How many of `flags` are set at or before each place along the last axis: the
  inclusive prefix sum, from bit words under jax.numpy (three kernels where `cumsum`
  compiles to eight, and about a tenth of its time on a CPU)."""
  if xp is np:
    return np.cumsum(flags, axis=-1, dtype=dtype)
  m = flags.shape[-1]
  if m == 0:
    return jnp.zeros(flags.shape, dtype)
  words = bit_words(flags)
  per_word = jax.lax.population_count(words).astype(dtype)
  before = prefix_sums(per_word) - per_word
  # the bits at or below each place of its word: masks 1, 3, 7, ..., 2**32 - 1 (wraps)
  upto = jnp.left_shift(jnp.uint32(2), jnp.arange(WORD, dtype=jnp.uint32)) - jnp.uint32(1)
  within = jax.lax.population_count(words[..., None] & upto).astype(dtype)
  return (before[..., None] + within).reshape(flags.shape[:-1] + (-1,))[..., :m]


def prefix_sums(v: Any) -> Any:
  """Inclusive prefix sums of `v` (small counts) along the last axis, by levels of 32:
  each level one compare-and-sum over 32 (a reduction over more would compile to
  three kernels)."""
  m = v.shape[-1]
  if m <= WORD:
    return _prefix_sums_few(v)
  chunks = -(-m // WORD)
  inner = _prefix_sums_few(jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, chunks * WORD - m)])
                      .reshape(v.shape[:-1] + (chunks, WORD)))
  totals = inner[..., -1]
  outer = prefix_sums(totals) - totals  # the chunks before each chunk
  return (inner + outer[..., None]).reshape(v.shape[:-1] + (-1,))[..., :m]


def _prefix_sums_few(v):
  """Inclusive prefix sums of `v` (`[..., m]`, m at most 32) by one compare-and-sum."""
  i = jnp.arange(v.shape[-1])
  return jnp.sum(jnp.where(i[None, :] <= i[:, None], v[..., None, :], 0), axis=-1,
                 dtype=v.dtype)
