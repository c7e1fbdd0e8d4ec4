"""CPU: block-sparse XLA attention against dense masked attention, as density falls.

For each length and mask, times the forward pass of `maskc.kernels.attention`
with `backend="xla"` and with `backend="dense"` (a materialized mask), both
jitted, float32, and prints the times, the speed-ups and the largest difference
between the two outputs. A second baseline is `jax.nn.dot_product_attention`
(XLA implementation) with the materialized mask. Dense attention costs the same
whatever the mask, so the baselines are timed once per length and reused.

    python benchmarks/attention_speed.py                      # 4K, 8K, 16K
    python benchmarks/attention_speed.py --lengths 4096 8192  # quicker
    python benchmarks/attention_speed.py --heads 2 --head-dim 128 --block 256

Target: `sliding(1024)` at 16K at least 8x faster than dense.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import maskc
from maskc.kernels import attention

MASKS = ("full", "causal", "causal & chunk(4096)", "sliding(4096) | sink(4)", "sliding(1024)",
         "sliding(256)")


def best_time(fn, *args, repeats: int, budget_s: float) -> float:
  """Best wall time of `fn(*args)` over up to `repeats` runs (after one warm-up)."""
  jax.block_until_ready(fn(*args))
  best = float("inf")
  start = time.perf_counter()
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t)
    if time.perf_counter() - start > budget_s:
      break
  return best


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
  p.add_argument("--masks", nargs="+", default=list(MASKS))
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=1)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--block", type=int, default=128, help="tile size (block_q = block_kv)")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--budget", type=float, default=10.0, help="seconds of repeats per timing")
  args = p.parse_args(argv)

  print(f"jax {jax.__version__} on {jax.default_backend()}, {jax.device_count()} device(s); "
        f"B={args.batch} H={args.heads} D={args.head_dim} tiles={args.block} float32")
  header = (f"{'length':>7}  {'mask':<26}{'density':>8}{'dense ms':>10}{'jax.nn ms':>11}"
            f"{'xla ms':>9}{'vs dense':>10}{'vs jax.nn':>11}{'max |diff|':>12}")
  print(header)
  print("-" * len(header))
  total = time.perf_counter()
  for length in args.lengths:
    keys = jax.random.split(jax.random.key(length), 3)
    shape = (args.batch, length, args.heads, args.head_dim)
    q, k, v = (jax.random.normal(kk, shape, jnp.float32) for kk in keys)
    dense_s = jaxnn_s = None
    dense_out = None
    for text in args.masks:
      bm = maskc.compile(text, length, block_q=args.block, block_kv=args.block)
      xla_fn = jax.jit(lambda q, k, v, bm=bm: attention(q, k, v, bm, backend="xla"))
      xla_s = best_time(xla_fn, q, k, v, repeats=args.repeats, budget_s=args.budget)
      dense_fn = jax.jit(lambda q, k, v, bm=bm: attention(q, k, v, bm, backend="dense"))
      if dense_s is None:
        dense_s = best_time(dense_fn, q, k, v, repeats=args.repeats, budget_s=args.budget)
        allowed = jnp.asarray(maskc.materialize(text, length))[None, None]
        jaxnn_fn = jax.jit(lambda q, k, v, allowed=allowed: jax.nn.dot_product_attention(
            q, k, v, mask=allowed, implementation="xla"))
        jaxnn_s = best_time(jaxnn_fn, q, k, v, repeats=args.repeats, budget_s=args.budget)
        del allowed
      dense_out = dense_fn(q, k, v)
      diff = float(jnp.abs(xla_fn(q, k, v) - dense_out).max())
      print(f"{length:>7}  {text:<26}{bm.density:>8.3f}{dense_s * 1e3:>10.1f}"
            f"{jaxnn_s * 1e3:>11.1f}{xla_s * 1e3:>9.1f}{dense_s / xla_s:>9.1f}x"
            f"{jaxnn_s / xla_s:>10.1f}x{diff:>12.1e}", flush=True)
      del dense_out
  print(f"total {time.perf_counter() - total:.0f} s")


if __name__ == "__main__":
  main()
