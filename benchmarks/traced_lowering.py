"""The traced lowering path (`jax.jit`) against the static one, same masks, same batch.

For each mask and tile size: the time of one jit compilation (trace + XLA
compile), the XLA kernels it compiled (fusions and sorts of the optimized module,
loop bodies included: on a CPU most of the compile time is per kernel, and the
count does not depend on the machine's load), the best per-call time of the
compiled function on fresh operands,
and the best time of the static path (NumPy operands, lowering cache cleared
each time) for the same batch, with their ratio. Issue 11's target: traced at
most 2x static per call, compile under 1 s.

  python benchmarks/traced_lowering.py [--repeat 15] [--length 32768] [--batch 8]

Other processes on the machine change every time but the kernel count; the header
gives the load average the figures were taken at.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import maskc
from compile_speed import image_spans, packed_segments
from maskc.lowering import compile as _lower


def cases(n: int, batch: int):
  """(label, mask, operands for seed s as `{name: [batch, n]}`)."""
  def segs(s):
    return {"seg": np.stack([packed_segments(n, s * batch + r) for r in range(batch)])}

  def imgs(s):
    return {"img": np.stack([image_spans(n, 4, 256, 2048, s * batch + r) for r in range(batch)])}

  def rolled(s):  # as in compile_speed.py: the last document wraps to the front (unsorted)
    return {"seg": np.stack([np.roll(packed_segments(n, s * batch + r), 1000 * (s + 1))
                             for r in range(batch)])}

  return [("documents of 1K-8K", "causal & document(seg)", segs),
          ("documents, rolled: unsorted ids", "causal & document(seg)", rolled),
          ("4 image spans of 256-2048", "causal & chunk(8192) | bidirectional(img)", imgs)]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--length", type=int, default=32768)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--repeat", type=int, default=15)
  ap.add_argument("--blocks", default="128,512")
  args = ap.parse_args()
  n, batch = args.length, args.batch
  load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
  print(f"# Traced vs static lowering, {n} tokens, batch {batch} ({jax.default_backend()}, "
        f"load average {load})\n")
  print("| mask (operands) | tiles | jit compile | kernels | traced / call | static / call "
        "| ratio |")
  print("|---|---|---:|---:|---:|---:|---:|")
  for label, text, make in cases(n, batch):
    for block in (int(b) for b in args.blocks.split(",")):
      def lower(ops, block=block, text=text):
        return maskc.compile(text, n, block_q=block, block_kv=block, operands=ops).rows

      fn = jax.jit(lambda ops, lower=lower: lower(ops))
      first = {k: jnp.asarray(v) for k, v in make(0).items()}
      t0 = time.perf_counter()
      compiled = fn.lower(first).compile()
      t_compile = time.perf_counter() - t0
      kernels = len(re.findall(r"^\s*\S+ = \S+ (?:fusion|sort)\(", compiled.as_text(),
                                 re.MULTILINE))
      traced = static = float("inf")
      for s in range(1, args.repeat + 1):
        ops = make(s)
        dev = {k: jnp.asarray(v) for k, v in ops.items()}
        jax.block_until_ready(dev)
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(dev))
        traced = min(traced, time.perf_counter() - t0)
        _lower._CACHE.clear()
        t0 = time.perf_counter()
        lower(ops)
        static = min(static, time.perf_counter() - t0)
      print(f"| `{text}` ({label}) | {block}x{block} | {t_compile * 1e3:.0f} ms | {kernels} | "
            f"{traced * 1e3:.1f} ms | {static * 1e3:.1f} ms | {traced / static:.2f}x |",
            flush=True)


if __name__ == "__main__":
  main()
