"""GPU: sweep the flash kernel's tiles and Triton launch parameters, with cuDNN in the same run.

For each tile shape `(block_q, block_kv)` it times the forward kernel under each
`(num_warps, num_stages)`, keeps the best, then times forward+backward under each
setting of the two backward kernels. The last lines compare the best settings,
and the defaults in `kernels/flash.py` (`BLOCK_SIZES`, `launch_params`), with
`jax.nn.dot_product_attention(implementation="cudnn")` on the same inputs.

    python benchmarks/gpu_tuning.py --length 16384 --mask causal
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import maskc
from maskc.kernels import attention, flash

BLOCKS = [(64, 64), (128, 64), (64, 128), (128, 128)]
LAUNCH = [(4, 2), (4, 3), (8, 2), (8, 3), (8, 4)]


def median_ms(fn, *args, repeats: int = 10) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times) * 1e3


def timed(fn, args, grad: bool) -> float:
  if grad:
    fn = jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).astype(jnp.float32).sum(), (0, 1, 2))
  try:
    return median_ms(jax.jit(fn), *args)
  except Exception as e:  # noqa: BLE001 - a setting Triton refuses (shared memory) is skipped
    print(f"    failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    return float("inf")


def with_launch(fwd: tuple[int, int], bwd: tuple[int, int]):
  """Replace `flash.launch_params` (read when a kernel is traced)."""
  flash.launch_params = lambda kernel, d: fwd if kernel == "fwd" else bwd


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--length", type=int, default=16384)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--mask", default="causal")
  args = p.parse_args(argv)
  n, h, d = args.length, args.heads, args.head_dim
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(x, (1, n, h, d), jnp.bfloat16) for x in keys)
  default = flash.launch_params
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {args.mask!r} L={n} H={h} "
        f"D={d} bf16")

  def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

  ref = {g: timed(cudnn, (q, k, v), g) if args.mask == "causal" else float("nan")
         for g in (False, True)}
  results, all_fwd = [], {}
  for bq, bk in BLOCKS:
    bm = maskc.compile(args.mask, n, block_q=bq, block_kv=bk)
    fn = lambda q, k, v, bm=bm: attention(q, k, v, bm, backend="flash")
    fwd_times = {}
    for launch in LAUNCH:
      with_launch(launch, default("dq", d))
      fwd_times[launch] = timed(fn, (q, k, v), False)
      all_fwd[(bq, bk), launch] = fwd_times[launch]
      print(f"  {bq:>3}x{bk:<3} fwd {launch}: {fwd_times[launch]:.3f} ms", flush=True)
    best_fwd = min(fwd_times, key=fwd_times.get)
    for launch in LAUNCH:
      with_launch(best_fwd, launch)
      ms = timed(fn, (q, k, v), True)
      print(f"  {bq:>3}x{bk:<3} fwd {best_fwd} bwd {launch}: {ms:.3f} ms (fwd+bwd)", flush=True)
      results.append(((bq, bk), best_fwd, launch, fwd_times[best_fwd], ms))
  flash.launch_params = default
  print()
  print(f"cuDNN: fwd {ref[False]:.3f} ms, fwd+bwd {ref[True]:.3f} ms")
  fwd = min(results, key=lambda r: r[3])
  both = min(results, key=lambda r: r[4])
  print(f"best fwd:     tiles {fwd[0]} launch {fwd[1]}: {fwd[3]:.3f} ms "
        f"({fwd[3] / ref[False]:.2f}x cuDNN)")
  print(f"best fwd+bwd: tiles {both[0]} fwd {both[1]} bwd {both[2]}: {both[4]:.3f} ms "
        f"({both[4] / ref[True]:.2f}x cuDNN)")
  tiles, dflt = tuple(flash.BLOCK_SIZES), (default("fwd", d), default("dq", d))
  tf = all_fwd.get((tiles, dflt[0]), float("nan"))
  tb = [r[4] for r in results if r[0] == tiles and r[1] == dflt[0] and r[2] == dflt[1]]
  print(f"defaults:     tiles {tiles} launch {dflt}: fwd {tf:.3f} ms ({tf / ref[False]:.2f}x), "
        f"fwd+bwd {'n/a (fwd not best)' if not tb else f'{tb[0]:.3f} ms'}")


if __name__ == "__main__":
  main()
