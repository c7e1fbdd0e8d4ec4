"""Flash-decoding for the flash kernel: how many splits, and their log-sum-exp combine.

A decode step has one q tile (one query row, or a handful) per batch row and head, so
flash's forward launches `B · H` programs, each walking every key tile of its row in
sequence: 32 programs for 4 rows of 8 heads, on a GPU of 132 SMs, each walking
thousands of key tiles at long contexts. Flash-decoding (Dao et al., 2023) splits each
q tile's list of key tiles (FULL then PARTIAL, as `maskc.kernels.flash.kernel._meta` lists
them) into `S` contiguous shares, one program per `(batch, head, q tile, split)`, each
writing its rows' partial output and log-sum-exp; `combine` then merges the shares
exactly, the way ring attention merges `run_with_lse` parts:
`out = Σ_s exp(lse_s − LSE) out_s` with `LSE = log(Σ_s exp(lse_s) + exp(sink))`.

The kernel (`flash._fwd_kernel` with `splits > 1`) divides the tile's actual count of
key tiles, read from the list at run time, into `S` equal shares, so a traced map
(whose lists are padded to every key tile) stays balanced. Sinks join only the combine;
a share with no key of a row gives it `lse = +inf` (flash's convention inside the
kernel), weight zero here. The backward pass is flash's own: it needs only the output
and each row's log-sum-exp, which the combine returns in flash's conventions.

`splits` is the heuristic that picks `S`; it lives here, in one place, with its
constants. Not yet measured on a GPU: the constants are first guesses from the SM
count of an H100, to be tuned by `benchmarks/flax_decode.py --splits auto off`
(`benchmarks/gpu_check.sh` step 6). `MAX_SPLITS = 1` turns the split off everywhere.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Streaming multiprocessors of the GPU the heuristic fills (an H100 SXM has 132).
SMS = 132
# Programs a launch aims at: two per SM, so one stalled on memory leaves the SM busy.
TARGET_PROGRAMS = 2 * SMS
# Launches with at least this many programs already fill the GPU: no split (FlashAttention's
# own rule, 0.8 of the SMs).
FULL_LAUNCH = int(0.8 * SMS)
# Key tiles a split walks at least: below that, its launch, its partial output and the
# combine cost more than the parallelism gains.
MIN_TILES_PER_SPLIT = 8
# The most splits of one q tile (1: flash-decoding off).
MAX_SPLITS = 64


def splits(programs: int, key_tiles: int) -> int:
  """How many shares `S` to split each q tile's key tiles into (1: no split).

  Args:
    programs: the unsplit launch's programs, `batch · heads · q tiles`.
    key_tiles: the most key tiles a q tile visits (FULL and PARTIAL; for a traced map the
      static bound its lists are padded to).

  A launch of `FULL_LAUNCH` programs or more fills the GPU as it is. Otherwise
  `S = ceil(TARGET_PROGRAMS / programs)`, at most one split per `MIN_TILES_PER_SPLIT` key
  tiles and at most `MAX_SPLITS`.

  >>> splits(4 * 8, 512)      # a decode step: 4 rows, 8 heads, a 32K cache of 64-key tiles
  9
  >>> splits(16 * 512, 512)   # a prefill at 32K: already 8192 programs
  1
  """
  if programs >= FULL_LAUNCH or MAX_SPLITS <= 1:
    return 1
  s = min(math.ceil(TARGET_PROGRAMS / max(programs, 1)), key_tiles // MIN_TILES_PER_SPLIT,
          MAX_SPLITS)
  return max(1, s)


def combine(out: jax.Array, lse: jax.Array, sinks: jax.Array | None = None
            ) -> tuple[jax.Array, jax.Array]:
  """The splits' partial attentions merged into one softmax, in flash's conventions.

  Args:
    out: `[S, B, Lq, H, Dv]` float32, each split's output normalized over its own keys
      (zero on rows it saw no key of).
    lse: `[S, B, H, Lq]` float32, each split's log-sum-exp, `+inf` on rows it saw no key of.
    sinks: float32 `[H]` sink logits, which join each row's denominator once, or None.

  Returns:
    `(out [B, Lq, H, Dv] float32, lse [B, H, Lq] float32)`: the attention over every split's
    keys (and the sink), and its log-sum-exp, `+inf` on rows with no key and no sink
    (flash's backward gives those zero weight), where `out` is zero.
  """
  seen = jnp.isfinite(lse)
  part = jnp.where(seen, lse, -jnp.inf)
  top = part.max(axis=0)                                          # [B, H, Lq]
  if sinks is not None:
    top = jnp.maximum(top, sinks[None, :, None])
  any_ = jnp.isfinite(top)
  top = jnp.where(any_, top, 0.0)
  w = jnp.exp(part - top)                                         # 0 where unseen
  total = w.sum(axis=0)
  if sinks is not None:
    total = total + jnp.exp(sinks[None, :, None] - top)
  w = w / jnp.where(any_, total, 1.0)
  merged = jnp.einsum("sbhq,sbqhd->bqhd", w, out, precision=jax.lax.Precision.HIGHEST)
  return merged, jnp.where(any_, top + jnp.log(jnp.where(any_, total, 1.0)), jnp.inf)
