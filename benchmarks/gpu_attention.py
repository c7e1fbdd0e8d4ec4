"""GPU: maskc's Pallas flash kernel against `jax.nn.dot_product_attention` (cuDNN and XLA).

bf16, head_dim 128, causal, sliding-window and document (packed sequence) masks
at 8K-32K tokens. Prints milliseconds and TFLOP/s counting only the unmasked
work (4 · D · allowed (q, k) pairs per head, forward), so a sparse mask is not
credited with work it skips.

    python benchmarks/gpu_attention.py
    python benchmarks/gpu_attention.py --lengths 16384 --heads 16 --backward

DESIGN.md §6 target: `causal` at 16K within 1.5x of the cuDNN time, and flash
time proportional to density for the sparse masks.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import maskc
from maskc.kernels import attention


def gpu_or_exit() -> None:
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    gpus = []
  if not gpus:
    sys.exit(f"gpu_attention.py needs a GPU, but jax {jax.__version__} sees only "
             f"{jax.devices()}. Install jax[cuda12] on a machine with an NVIDIA GPU, or run "
             "benchmarks/attention_speed.py for the CPU comparison.")


def best_ms(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t)
  return best * 1e3


def segments(length: int, seed: int = 0) -> np.ndarray:
  """Packed documents of 1K-8K tokens: sorted segment ids `[length]`."""
  rng = np.random.default_rng(seed)
  ids, pos, doc = np.zeros(length, np.int32), 0, 0
  while pos < length:
    n = int(rng.integers(1024, 8192))
    ids[pos:pos + n] = doc
    pos, doc = pos + n, doc + 1
  return ids


def allowed_pairs(text: str, length: int, ops: dict) -> int:
  """Exact count of allowed (q, k) pairs: FULL tiles by area, PARTIAL tiles evaluated."""
  bm = maskc.compile(text, length, block_q=512, block_kv=512, operands=ops)
  grid = np.asarray(bm.grid)
  total = int((grid == 2).sum()) * 512 * 512
  cm = maskc.parse(text).bind(length, operands=ops)
  for i, j in zip(*np.nonzero(grid == 1)):
    total += int(cm[i * 512:(i + 1) * 512, j * 512:(j + 1) * 512].sum())
  return total


def reference(impl: str, text: str, ops: dict, window: int | None):
  """`jax.nn.dot_product_attention` for the mask, or None where it has no form for it."""
  def fn(q, k, v):
    kw = dict(implementation=impl)
    if text == "causal":
      kw["is_causal"] = True
    elif text.startswith("sliding"):
      kw.update(is_causal=True, local_window_size=(window - 1, 0))
    else:
      seg = jnp.asarray(ops["seg"])
      mask = (seg[:, None] == seg[None, :]) & jnp.tri(seg.shape[0], dtype=bool)
      kw["mask"] = mask[None, None]
    return jax.nn.dot_product_attention(q, k, v, **kw)
  return fn


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=None)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--window", type=int, default=4096)
  p.add_argument("--block-q", type=int, default=64)
  p.add_argument("--block-kv", type=int, default=64)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--backward", action="store_true", help="time forward + backward instead")
  args = p.parse_args(argv)
  gpu_or_exit()
  hkv = args.kv_heads or args.heads
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; B={args.batch} H={args.heads} "
        f"Hkv={hkv} D={args.head_dim} bf16, flash tiles {args.block_q}x{args.block_kv}"
        f"{', forward+backward' if args.backward else ', forward'}")
  masks = ["causal", f"sliding({args.window})", "causal & document(seg)"]
  impls = ["flash", "cudnn", "xla"]
  header = f"{'length':>7}  {'mask':<24}{'density':>8}" + "".join(
      f"{n + ' ms':>12}{n + ' TF/s':>12}" for n in impls)
  print(header)
  print("-" * len(header))
  for length in args.lengths:
    keys = jax.random.split(jax.random.key(length), 3)
    q = jax.random.normal(keys[0], (args.batch, length, args.heads, args.head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (args.batch, length, hkv, args.head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (args.batch, length, hkv, args.head_dim), jnp.bfloat16)
    ops = {"seg": segments(length)}
    for text in masks:
      used = ops if "seg" in text else {}
      bm = maskc.compile(text, length, block_q=args.block_q, block_kv=args.block_kv,
                         operands=used)
      pairs = allowed_pairs(text, length, used)
      flops = 4 * args.head_dim * pairs * args.batch * args.heads * (3.5 if args.backward else 1)
      fns = {"flash": lambda q, k, v, bm=bm: attention(q, k, v, bm, backend="flash")}
      for impl in ("cudnn", "xla"):
        fns[impl] = reference(impl, text, ops, args.window)
      row = f"{length:>7}  {text:<24}{bm.density:>8.3f}"
      for name in impls:
        fn = fns[name]
        if args.backward:
          fn = jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).astype(jnp.float32).sum(), (0, 1, 2))
        try:
          ms = best_ms(jax.jit(fn), q, k, v, repeats=args.repeats)
          row += f"{ms:>12.2f}{flops / ms / 1e9:>12.1f}"
        except Exception as e:  # noqa: BLE001 - report and keep going (OOM, unsupported)
          row += f"{'n/a':>12}{type(e).__name__[:11]:>12}"
      print(row, flush=True)


if __name__ == "__main__":
  main()
