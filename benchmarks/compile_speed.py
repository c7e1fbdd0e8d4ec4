"""Static lowering speed: maskc.compile against JAX splash `process_mask`, side by side.

For each mask and length, both build block-sparsity metadata for the same mask
and tiles in the same run; the table shows both times and their ratio. Where
splash has a mask class (causal, local windows, chunked causal) it gets that
class; elsewhere it gets maskc's `ComputableMask` as a lazy splash `Mask`
(`maskc.kernels.splash.as_splash_mask`). Then maskc alone at 1M tokens with 128-tiles
(`--operand-block`; peak memory by tracemalloc), and the traced path under `jax.jit`.

Splash at 128K takes minutes per mask on a 2-core machine, so by default it
runs there for `causal` only; `--splash-128k-all` runs every mask.

  python benchmarks/compile_speed.py [--block 512] [--lengths 8192,32768,131072]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import (
  splash_attention_mask as sm,
  splash_attention_mask_info as smi,
)

import maskc
from maskc.kernels.splash import as_splash_mask
from maskc.lowering import compile as _lower

OPERAND_REPEATS = 7  # calls per mask at 1M tokens: the best is what this machine can do

MASKS = ["causal", "sliding(1024)", "causal & chunk(8192)", "causal | prefix(4096)",
         "sliding(4096) | sink(4)", "causal & document(seg)"]


def packed_segments(n: int, seed: int = 0, lo: int = 1024, hi: int = 8192) -> np.ndarray:
  """Segment ids of documents of `lo`-`hi` tokens (default 1K-8K) packed into `n` tokens."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(lo, hi, n // lo + 1)
  return np.repeat(np.arange(lengths.size), lengths)[:n].astype(np.int32)


def image_spans(n: int, count: int, lo: int, hi: int, seed: int) -> np.ndarray:
  """Image-token flags: `count` spans of `lo`-`hi` tokens at random places in `n` tokens."""
  rng = np.random.default_rng(seed)
  img = np.zeros(n, bool)
  slots = n // (2 * hi)
  for s in np.sort(rng.choice(slots, count, replace=False)) * (n // slots):
    img[s:s + rng.integers(lo, hi + 1)] = True
  return img


def global_tokens(n: int, count: int, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  g = np.zeros(n, bool)
  g[rng.choice(n, count, replace=False)] = True
  return g


def operand_cases():
  """(label, mask, operands(n, seed)) of issue 11's table; `causal` first as the baseline."""
  return [
      ("no operands", "causal", lambda n, s: {}),
      ("2 image spans", "causal & chunk(8192) | bidirectional(img)",
       lambda n, s: {"img": image_spans(n, 2, 1024, 4096, s)}),
      ("64 image spans of 256-4096", "causal & chunk(8192) | bidirectional(img)",
       lambda n, s: {"img": image_spans(n, 64, 256, 4096, s)}),
      ("documents of 1K-8K", "causal & document(seg)",
       lambda n, s: {"seg": packed_segments(n, s)}),
      ("documents of 50-200 (fine-tuning packs)", "causal & document(seg)",
       lambda n, s: {"seg": packed_segments(n, s, 50, 200)}),
      ("32 global tokens", "local(64, 64) | g[q] | g[k]",
       lambda n, s: {"g": global_tokens(n, 32, s)}),
      ("no operands", "causal & (q - k) % 4 == 0 & q - k < 4096", lambda n, s: {}),
      ("documents, 64 image spans", "document(seg) & (causal | bidirectional(img))",
       lambda n, s: {"seg": packed_segments(n, s), "img": image_spans(n, 64, 256, 4096, s)}),
  ]


def splash_mask(text: str, n: int, operands: dict) -> sm.Mask:
  shape = (n, n)
  if text == "causal":
    return sm.CausalMask(shape)
  if text == "sliding(1024)":
    return sm.LocalMask(shape, window_size=(1023, 0), offset=0)
  if text == "causal & chunk(8192)":
    return sm.ChunkedCausalMask(shape, chunk_size=8192)
  return as_splash_mask(maskc.parse(text).bind(n, operands=operands))


def time_splash(text: str, n: int, block: int, operands: dict) -> float:
  mask = sm.MultiHeadMask((splash_mask(text, n, operands),))
  smi._process_mask.cache_clear()
  t0 = time.perf_counter()
  smi.process_mask(mask, (block, block))
  return time.perf_counter() - t0


def time_maskc(text: str, n: int, block: int, operands: dict, repeat: int = 3) -> float:
  best = float("inf")
  for _ in range(repeat):
    _lower._CACHE.clear()
    t0 = time.perf_counter()
    maskc.compile(text, n, block_q=block, block_kv=block, operands=operands)
    best = min(best, time.perf_counter() - t0)
  return best


def fmt(seconds: float) -> str:
  return f"{seconds * 1e3:9.2f} ms" if seconds < 10 else f"{seconds:9.1f} s "


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--block", type=int, default=512)
  ap.add_argument("--lengths", default="8192,32768,131072")
  ap.add_argument("--splash-128k-all", action="store_true")
  ap.add_argument("--skip-splash", action="store_true")
  ap.add_argument("--only-operands", action="store_true",
                  help="run only the 1M-token table of masks with operands")
  ap.add_argument("--operand-block", type=int, default=128,
                  help="tile size of the 1M-token table of masks with operands (issue 11: 128)")
  args = ap.parse_args()
  lengths = [int(x) for x in args.lengths.split(",")]
  maskc.parse("causal")  # load the prelude outside the timings
  if args.only_operands:
    lengths = []

  print(f"# Static lowering, {args.block}x{args.block} tiles: maskc vs splash process_mask\n")
  print("| mask | tokens | maskc | splash | speed-up |")
  print("|---|---:|---:|---:|---:|")
  for n in lengths:
    ops = {"seg": packed_segments(n)}
    for text in MASKS:
      operands = ops if "seg" in text else {}
      t_m = time_maskc(text, n, args.block, operands)
      run_splash = not args.skip_splash and (n < 100_000 or text == "causal" or
                                             args.splash_128k_all)
      if run_splash:
        t_s = time_splash(text, n, args.block, operands)
        print(f"| `{text}` | {n // 1024}K | {fmt(t_m)} | {fmt(t_s)} | {t_s / t_m:,.0f}x |",
              flush=True)
      else:
        print(f"| `{text}` | {n // 1024}K | {fmt(t_m)} | (not run) | |", flush=True)

  print("\n# maskc alone at 1M tokens, 128x128 tiles (8192 x 8192 tiles)\n")
  print("| mask | time | peak memory | tile grid size |")
  print("|---|---:|---:|---:|")
  n = 1 << 20
  for text in ["causal & chunk(8192)", "sliding(4096) | sink(4)", "causal"]:
    dt = time_maskc(text, n, 128, {})
    _lower._CACHE.clear()
    tracemalloc.start()  # a separate call: tracing allocations slows them down
    bm = maskc.compile(text, n, block_q=128, block_kv=128)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    grid = bm.n_q_tiles * bm.n_kv_tiles
    print(f"| `{text}` | {fmt(dt)} | {peak / 2**20:.1f} MiB | {grid / 2**20:.0f} MiB (int8) |",
          flush=True)

  ob = args.operand_block
  print(f"\n# Masks with operands at 1M tokens, {ob}x{ob} tiles: cold (new operands each call)\n")
  print(f"| mask (operands) | time (best of {OPERAND_REPEATS}) | peak memory (tracemalloc, max) "
        "| vs causal |")
  print("|---|---:|---:|---:|")
  n = 1 << 20
  cases = operand_cases()
  made = [[make(n, seed) for seed in range(2)] for _, _, make in cases]
  best = [float("inf")] * len(cases)
  failed: dict[int, str] = {}
  # One round unmeasured, then rounds over every mask in turn: each mask meets the
  # allocator in the same state (a first call after fresh pages costs up to twice as
  # much), so the ratios to `causal` compare like with like.
  for round_ in range(OPERAND_REPEATS + 1):
    for c, (_, text, _) in enumerate(cases):
      if c in failed:
        continue
      _lower._CACHE.clear()
      t0 = time.perf_counter()
      try:
        maskc.compile(text, n, block_q=ob, block_kv=ob, operands=made[c][round_ % 2])
      except maskc.MaskError as e:
        failed[c] = type(e).__name__
        continue
      if round_:
        best[c] = min(best[c], time.perf_counter() - t0)
  for c, (label, text, _) in enumerate(cases):
    if c in failed:
      print(f"| `{text}` ({label}) | {failed[c]} | | |", flush=True)
      continue
    peak = 0
    for operands in made[c]:
      _lower._CACHE.clear()
      tracemalloc.start()  # separate calls: tracing allocations slows them down
      maskc.compile(text, n, block_q=ob, block_kv=ob, operands=operands)
      peak = max(peak, tracemalloc.get_traced_memory()[1])
      tracemalloc.stop()
    print(f"| `{text}` ({label}) | {fmt(best[c])} | {peak / 2**20:.1f} MiB | "
          f"{best[c] / best[0]:.1f}x |", flush=True)

  print("\n# Traced path under jax.jit: `causal & document(seg)`, 32K tokens, batch 8\n")
  n, batch = 32768, 8
  segs = np.stack([packed_segments(n, seed) for seed in range(batch)])
  for block in (128, 512):
    fn = jax.jit(lambda s, block=block: maskc.compile(
        "causal & document(seg)", n, block_q=block, block_kv=block, operands={"seg": s}).rows)
    jax.block_until_ready(fn(jnp.asarray(segs)))  # trace and compile once
    best = float("inf")
    for seed in range(3):
      s = jnp.asarray(np.roll(segs, 1000 * (seed + 1), axis=-1))
      t0 = time.perf_counter()
      jax.block_until_ready(fn(s))
      best = min(best, time.perf_counter() - t0)
    print(f"- {block}x{block} tiles: {fmt(best)} per call (after one compilation)", flush=True)


if __name__ == "__main__":
  main()
