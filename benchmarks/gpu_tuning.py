"""GPU: sweep the flash kernel's tiles and Triton launch parameters, with cuDNN in the same run.

For each tile shape `(block_q, block_kv)` it times the forward kernel under each
`(num_warps, num_stages)`, keeps the best, then times forward+backward under each
setting of the two backward kernels. The last lines compare the best settings,
and the defaults in `maskc/kernels/flash/kernel.py` (`BLOCK_SIZES`, `launch_params`), with
`jax.nn.dot_product_attention(implementation="cudnn")` on the same inputs.

    python benchmarks/gpu_tuning.py --length 16384 --mask causal
    python benchmarks/gpu_tuning.py --compare 64x64:4,2:4,2 128x64:4,3:8,2 \
        --lengths 32768 131072 --masks causal "causal & document(seg)"

`--compare` times named settings (`BQxBK:fwd_warps,fwd_stages:bwd_warps,bwd_stages`)
forward and forward+backward at several lengths and masks instead of sweeping.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import gpu_attention
import maskc
from maskc.kernels import attention
from maskc.kernels.flash import kernel as flash

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
  flash.launch_params = lambda kernel, *_: fwd if kernel == "fwd" else bwd


def parse_setting(text: str):
  """`"128x64:4,3:8,2"` -> ((128, 64), (4, 3), (8, 2))."""
  tiles, fwd, bwd = text.split(":")
  bq, bk = (int(x) for x in tiles.split("x"))
  return (bq, bk), tuple(int(x) for x in fwd.split(",")), tuple(int(x) for x in bwd.split(","))


def compare(settings: list[str], lengths: list[int], masks: list[str], h: int, d: int) -> None:
  """Each setting forward and forward+backward, per length and mask, in one table."""
  default = flash.launch_params
  print(f"{'length':>7}  {'mask':<24}{'setting':<18}{'fwd ms':>10}{'fwd+bwd ms':>12}")
  for n in lengths:
    keys = jax.random.split(jax.random.key(n), 3)
    q, k, v = (jax.random.normal(x, (1, n, h, d), jnp.bfloat16) for x in keys)
    seg = gpu_attention.operands(n)["seg"]
    for text in masks:
      for setting in settings:
        (bq, bk), fwd, bwd = parse_setting(setting)
        ops = {"seg": seg} if "seg" in text else {}
        bm = maskc.compile(text, n, block_q=bq, block_kv=bk, operands=ops)
        def fn(q, k, v, bm=bm):
          return attention(q, k, v, bm, backend="flash")
        with_launch(fwd, bwd)
        tf, tb = timed(fn, (q, k, v), False), timed(fn, (q, k, v), True)
        print(f"{n:>7}  {text:<24}{setting:<18}{tf:>10.2f}{tb:>12.2f}", flush=True)
  flash.launch_params = default


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--length", type=int, default=16384)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--mask", default="causal")
  p.add_argument("--compare", nargs="+", help="settings BQxBK:fw,fs:bw,bs to compare")
  p.add_argument("--lengths", type=int, nargs="+", default=[32768])
  p.add_argument("--masks", nargs="+", default=["causal"])
  args = p.parse_args(argv)
  if args.compare:
    compare(args.compare, args.lengths, args.masks, args.heads, args.head_dim)
    return
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
    def fn(q, k, v, bm=bm):
      return attention(q, k, v, bm, backend="flash")
    fwd_times = {}
    for launch in LAUNCH:
      with_launch(launch, default("dq", d, bq, bk))
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
  tiles = tuple(flash.BLOCK_SIZES)
  dflt = (default("fwd", d, *tiles), default("dq", d, *tiles))
  tf = all_fwd.get((tiles, dflt[0]), float("nan"))
  tb = [r[4] for r in results if r[0] == tiles and r[1] == dflt[0] and r[2] == dflt[1]]
  print(f"defaults:     tiles {tiles} launch {dflt}: fwd {tf:.3f} ms ({tf / ref[False]:.2f}x), "
        f"fwd+bwd {'n/a (fwd not best)' if not tb else f'{tb[0]:.3f} ms'}")


if __name__ == "__main__":
  main()
