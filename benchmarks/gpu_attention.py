"""GPU: maskc's Pallas flash kernel against `jax.nn.dot_product_attention` (cuDNN and XLA).

bf16, head_dim 128, masks `causal`, `sliding(W)`, `causal & chunk(C)`, packed
documents (`causal & document(seg)`) and image spans (`causal | bidirectional(img)`)
at 8K-128K tokens, forward and forward+backward. Prints milliseconds and TFLOP/s
counting only the unmasked work (4 · D · allowed (q, k) pairs per head forward,
3.5× that forward+backward), so a sparse mask is not credited with work it skips.

    python benchmarks/gpu_attention.py
    python benchmarks/gpu_attention.py --lengths 16384 --heads 16 --modes fwd
    python benchmarks/gpu_attention.py --dry-run --lengths 8192   # no GPU: setup only

The references get each mask in the form they take: `is_causal` and
`local_window_size` where those express it, else a dense boolean mask
`[1, 1, L, L]`, which costs L² bytes and fails (reported "n/a") where memory runs
out. `--dry-run` builds every BlockMap, counts allowed pairs and traces every
function abstractly (`jax.eval_shape`), so the CPU-side path is checked without a
GPU.

Targets (issue 13): on an H100/H200, `causal` within 1.5× of cuDNN's time, and the
sparse masks' time proportional to their density. Measured on an H100 (README,
"GPU: an H100, measured"): the second holds, the first does not (1.7-2.6×).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import maskc
from maskc.compiled import predicate as _predicate
from maskc.kernels import attention, flash
from maskc.kernels import common as _common

IMPLS = ("flash", "cudnn", "xla")


def masks(window: int, chunk: int) -> dict[str, str]:
  """Benchmark name → mask text."""
  return {"causal": "causal", "sliding": f"sliding({window})",
          "chunked": f"causal & chunk({chunk})", "documents": "causal & document(seg)",
          "image spans": "causal | bidirectional(img)"}


def gpu_or_exit() -> None:
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    gpus = []
  if not gpus:
    sys.exit(f"gpu_attention.py needs a GPU, but jax {jax.__version__} sees only "
             f"{jax.devices()}. Install jax[cuda12] on a machine with an NVIDIA GPU, run with "
             "--dry-run to check the setup, or run benchmarks/attention_speed.py for CPU.")


def best_ms(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t)
  return best * 1e3


def operands(length: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Packed documents of 1K-8K tokens (`seg`) and image spans of 256-1024 tokens (`img`)."""
  rng = np.random.default_rng(seed)
  seg, pos, doc = np.zeros(length, np.int32), 0, 0
  while pos < length:
    n = int(rng.integers(1024, 8192))
    seg[pos:pos + n] = doc
    pos, doc = pos + n, doc + 1
  img, pos = np.zeros(length, bool), 0
  while pos < length:
    pos += int(rng.integers(512, 4096))                 # text, then an image
    n = int(rng.integers(256, 1024))
    img[pos:pos + n] = True
    pos += n
  return {"seg": seg, "img": img}


def allowed_pairs(bm) -> int:
  """Exact count of allowed (q, k) pairs: FULL tiles by area, PARTIAL tiles evaluated."""
  bq, bk = bm.block_q, bm.block_kv
  total = 0
  values = bm.read_values(0)
  for state in (_common.FULL, _common.PARTIAL):
    i, j, count, _ = _common.tile_pairs(bm, 0, state)
    i, j = np.asarray(i[0, :count[0]]), np.asarray(j[0, :count[0]])
    rows_in = np.minimum((i + 1) * bq, bm.q_len) - i * bq
    cols_in = np.minimum((j + 1) * bk, bm.kv_len) - j * bk
    if state == _common.FULL:
      total += int((rows_in.astype(np.int64) * cols_in).sum())
      continue
    for s in range(0, i.size, 256):                   # 256 tiles at a time
      ii, jj = i[s:s + 256], j[s:s + 256]
      rows = ii[:, None, None] * bq + np.arange(bq)[None, :, None]
      cols = jj[:, None, None] * bk + np.arange(bk)[None, None, :]
      rr, cc = np.minimum(rows, bm.q_len - 1), np.minimum(cols, bm.kv_len - 1)

      def fetch(kind, slot, rr=rr, cc=cc, ii=ii, jj=jj):
        if kind == "q_read":
          return values.q[0, slot][rr]
        if kind == "k_read":
          return values.k[0, slot][cc]
        if kind == "scalar":
          return values.scalars[0, slot]
        if kind == "pair":
          return values.pairs[0, slot][rr, cc]
        return values.tile_pairs[0, slot][ii, jj][:, None, None]

      ok = _predicate.evaluate(bm.predicates[0], np, rows + int(bm.q_offset), cols, fetch)
      inside = (rows < bm.q_len) & (cols < bm.kv_len)
      total += int((np.asarray(ok) & inside).sum())
  return total


def reference(impl: str, name: str, bm, window: int):
  """`jax.nn.dot_product_attention` for the mask (a dense mask where no flag expresses it)."""
  def fn(q, k, v):
    kw = dict(implementation=impl)
    if name == "causal":
      kw["is_causal"] = True
    elif name == "sliding":
      kw.update(is_causal=True, local_window_size=(window - 1, 0))
    else:
      kw["mask"] = _common.dense_allowed(bm, 0)[:, None]     # built on the device, in jit
    return jax.nn.dot_product_attention(q, k, v, **kw)
  return fn


def cell(fn, args, flops: float, repeats: int, dry_run: bool) -> str:
  try:
    if dry_run:
      jax.eval_shape(fn, *args)
      return f"{'traced':>12}{'-':>12}"
    ms = best_ms(jax.jit(fn), *args, repeats=repeats)
    return f"{ms:>12.2f}{flops / ms / 1e9:>12.1f}"
  except Exception as e:  # noqa: BLE001 - report and keep going (OOM, unsupported)
    return f"{'n/a':>12}{type(e).__name__[:11]:>12}"


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
  p.add_argument("--masks", nargs="+", default=list(masks(0, 0)),
                 choices=list(masks(0, 0)))
  p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
  p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS),
                 help="which to time (xla's dense mask needs L^2 memory: drop it at 32K+)")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=None)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--window", type=int, default=4096)
  p.add_argument("--chunk", type=int, default=8192)
  p.add_argument("--block-q", type=int, default=flash.BLOCK_SIZES[0])
  p.add_argument("--block-kv", type=int, default=flash.BLOCK_SIZES[1])
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--dry-run", action="store_true",
                 help="no GPU needed: build the maps, count pairs, trace every function")
  args = p.parse_args(argv)
  if not args.dry_run:
    gpu_or_exit()
  hkv = args.kv_heads or args.heads
  device = jax.devices()[0].device_kind
  print(f"jax {jax.__version__}, {device}{' (dry run)' if args.dry_run else ''}; "
        f"B={args.batch} H={args.heads} Hkv={hkv} D={args.head_dim} bf16, flash tiles "
        f"{args.block_q}x{args.block_kv}")
  header = f"{'mode':<8}{'length':>7}  {'mask':<12}{'density':>8}" + "".join(
      f"{n + ' ms':>12}{n + ' TF/s':>12}" for n in args.impls)
  print(header)
  print("-" * len(header))
  texts = masks(args.window, args.chunk)
  for length in args.lengths:
    shape_q = (args.batch, length, args.heads, args.head_dim)
    shape_k = (args.batch, length, hkv, args.head_dim)
    if args.dry_run:
      q = jax.ShapeDtypeStruct(shape_q, jnp.bfloat16)
      k = v = jax.ShapeDtypeStruct(shape_k, jnp.bfloat16)
    else:
      keys = jax.random.split(jax.random.key(length), 3)
      q = jax.random.normal(keys[0], shape_q, jnp.bfloat16)
      k = jax.random.normal(keys[1], shape_k, jnp.bfloat16)
      v = jax.random.normal(keys[2], shape_k, jnp.bfloat16)
    ops = operands(length)
    for name in args.masks:
      text = texts[name]
      m = maskc.parse(text)
      used = {s.name: ops[s.name] for s in m.operands}
      bm = maskc.compile(m, length, block_q=args.block_q, block_kv=args.block_kv,
                         operands=used)
      pairs = allowed_pairs(bm)
      fns = {"flash": lambda q, k, v, bm=bm: attention(q, k, v, bm, backend="flash")}
      for impl in ("cudnn", "xla"):
        fns[impl] = reference(impl, name, bm, args.window)
      for mode in args.modes:
        factor = 3.5 if mode == "fwd+bwd" else 1.0
        flops = 4 * args.head_dim * pairs * args.batch * args.heads * factor
        row = f"{mode:<8}{length:>7}  {name:<12}{bm.density:>8.3f}"
        for impl in args.impls:
          fn = fns[impl]
          if mode == "fwd+bwd":
            fn = jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).astype(jnp.float32).sum(),
                          (0, 1, 2))
          row += cell(fn, (q, k, v), flops, args.repeats, args.dry_run)
        print(row, flush=True)


if __name__ == "__main__":
  main()
