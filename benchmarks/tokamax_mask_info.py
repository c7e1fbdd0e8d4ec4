"""tokamax splash's MaskInfo built by maskc against tokamax's own `process_mask`, in one run.

For each mask and length both sides build the forward and dkv MaskInfo for the same
mask and tiles: tokamax's `process_mask` + `process_mask_dkv` (its default dkv full grid)
on tokamax's own mask class where it has one (causal, local window, chunked causal) and on
`as_tokamax(cm)` (maskc's bound mask, which tokamax slices tile by tile) elsewhere; maskc's
`maskc.compile` + `maskc.kernels.splash.tokamax_mask_info(bm)`, stored partial blocks (no
mask function, so both sides evaluate and deduplicate the same blocks). The maskc columns are
the best of 3 runs (compile cache cleared each time), tokamax's one run (its cache cleared).

tokamax's `process_mask` slices every tile of the mask in Python: at 128K with 512-tiles
that is 65,536 tiles per call, two calls. `--tokamax-limit` (seconds, default 300) skips
tokamax where an earlier mask at the same length already took longer than the limit / 2.

  python benchmarks/tokamax_mask_info.py [--block 512] [--lengths 32768,131072]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from tokamax._src.ops.experimental.tpu.splash_attention import (
  splash_attention_mask as tm,
  splash_attention_mask_info as tmi,
)

import maskc
from maskc.kernels.splash import tokamax_mask_info
from maskc.kernels.splash.tokamax_kernel import as_tokamax
from maskc.lowering import compile as _lower


def packed_segments(n: int, seed: int = 0, lo: int = 1024, hi: int = 8192) -> np.ndarray:
  """Segment ids of documents of `lo`-`hi` tokens packed into `n` tokens."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(lo, hi, n // lo + 1)
  return np.repeat(np.arange(lengths.size), lengths)[:n].astype(np.int32)


def image_spans(n: int, count: int, lo: int, hi: int, seed: int = 0) -> np.ndarray:
  """Image-token flags: `count` spans of `lo`-`hi` tokens at random places in `n` tokens."""
  rng = np.random.default_rng(seed)
  img = np.zeros(n, bool)
  slots = n // (2 * hi)
  for s in np.sort(rng.choice(slots, count, replace=False)) * (n // slots):
    img[s:s + rng.integers(lo, hi + 1)] = True
  return img


# (label, mask text, operands(n), tokamax's own mask(n) or None for as_tokamax(cm))
CASES = [
    ("causal", "causal", lambda n: {}, lambda n: tm.CausalMask((n, n))),
    ("sliding window 4096", "sliding(4096)", lambda n: {},
     lambda n: tm.LocalMask((n, n), (4095, 0), 0)),
    ("causal & chunk 8192", "causal & chunk(8192)", lambda n: {},
     lambda n: tm.ChunkedCausalMask((n, n), 8192)),
    ("packed documents 1K-8K", "causal & document(seg)",
     lambda n: {"seg": packed_segments(n)}, None),
    ("chunk 8192, an image of 256-4096 per 8K", "causal & chunk(8192) | bidirectional(img)",
     lambda n: {"img": image_spans(n, max(1, n // 8192), 256, min(4096, n // 4))}, None),
]


def time_maskc(text: str, n: int, block: int, ops: dict, repeat: int = 3) -> tuple[float, float]:
  """Best of `repeat`: (compile + MaskInfo, MaskInfo alone) in seconds."""
  best_total = best_info = float("inf")
  for _ in range(repeat):
    _lower._CACHE.clear()
    t0 = time.perf_counter()
    bm = maskc.compile(text, n, block_q=block, block_kv=block, operands=ops, q_offset=0)
    t1 = time.perf_counter()
    tokamax_mask_info(bm, use_mask_function=False)
    t2 = time.perf_counter()
    best_total, best_info = min(best_total, t2 - t0), min(best_info, t2 - t1)
  return best_total, best_info


def time_tokamax(mask, block: int) -> float:
  tmi._process_mask.cache_clear()
  t0 = time.perf_counter()
  tmi.process_mask(mask, (block, block))
  tmi.process_mask_dkv(mask, (block, block))
  return time.perf_counter() - t0


def fmt(seconds: float) -> str:
  return f"{seconds * 1e3:,.2f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--block", type=int, default=512)
  ap.add_argument("--lengths", default="32768,131072")
  ap.add_argument("--tokamax-limit", type=float, default=300.0)
  args = ap.parse_args()
  print(f"# tokamax splash MaskInfo (fwd + dkv), {args.block}x{args.block} tiles\n")
  print("| mask | tokens | maskc compile + MaskInfo | maskc MaskInfo | tokamax process_mask "
        "| speed-up |")
  print("|---|---:|---:|---:|---:|---:|")
  for n in (int(x) for x in args.lengths.split(",")):
    slowest = 0.0
    for label, text, ops_of, theirs_of in CASES:
      ops = ops_of(n)
      total, info = time_maskc(text, n, args.block, ops)
      if slowest > args.tokamax_limit / 2:
        t_s, ratio = "skipped", "-"
      else:
        theirs = theirs_of(n) if theirs_of else as_tokamax(maskc.parse(text).bind(n, operands=ops,
                                                                                 q_offset=0))
        secs = time_tokamax(theirs, args.block)
        slowest = max(slowest, secs)
        t_s, ratio = fmt(secs), f"{secs / total:,.0f}×"
      shown = text.replace("|", "\\|")                      # inside a Markdown table
      print(f"| {label} (`{shown}`) | {n // 1024}K | {fmt(total)} | {fmt(info)} | {t_s} "
            f"| {ratio} |", flush=True)


if __name__ == "__main__":
  main()
