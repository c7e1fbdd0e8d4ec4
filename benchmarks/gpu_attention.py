"""GPU: maskc's engines (flash, cudnn, tokamax, mosaic_gpu, auto) against jax's attention.

bf16, head_dim 128, masks `causal`, `sliding(W)`, `causal & chunk(C)`, packed
documents (`causal & document(seg)`) and image spans (`causal | bidirectional(img)`)
at 8K-128K tokens, forward and forward+backward. Prints milliseconds and TFLOP/s
counting only the unmasked work (4 · D · allowed (q, k) pairs per head forward,
3.5× that forward+backward), so a sparse mask is not credited with work it skips.

    python benchmarks/gpu_attention.py
    python benchmarks/gpu_attention.py --lengths 16384 --heads 16 --modes fwd
    python benchmarks/gpu_attention.py --dry-run --lengths 8192   # no GPU: setup only

Columns (`--impls`):

- `flash`: maskc's Pallas Triton kernel on the map;
- `cudnn`, `xla`: `jax.nn.dot_product_attention` given each mask in the form it takes,
  `is_causal` and `local_window_size` where those express it, else a dense boolean
  mask `[1, 1, L, L]`, which costs L² bytes and fails ("n/a") where memory runs out;
- `be-cudnn`: maskc's `cudnn` backend (bands only; other masks are refused: "n/a");
- `tokamax`: maskc's `tokamax` backend (exact key intervals; needs tokamax installed):
  tokamax's forward, flash's backward;
- `mosaic_gpu`: maskc's `mosaic_gpu` backend (Pallas Mosaic GPU forward, flash's
  backward) on a map of its own tiles (`--mosaic-blocks`, 128 × 128); not yet validated:
  its first GPU run is `tests/test_gpu.py` (benchmarks/gpu_check.sh runs both);
- `mosaic_gpu-bwd`: the same with its own Mosaic GPU backward
  (`mosaic_gpu.BACKWARD = "mosaic_gpu"`, opt-in, never run before `tests/test_gpu.py`):
  its `fwd+bwd` rows time that backward (its `fwd` rows repeat the `mosaic_gpu` ones);
- `auto`: `backend="auto"` on the map; the `auto picks` column says what `choose` took.

Masks: the five above by default; `--masks sliding-sink` adds `sliding(W) | sink(4)`,
whose rows have a hole between the sink and the window.

After the table, the rates the engines declare (`GPU_COST`, `maskc.kernels.api.gpu_costs()`)
are printed as measured here: TFLOP/s on each engine's work (its `forward_work`), forward and
backward (tokamax's backward is flash's), the median over the rows an engine ran.
`--dry-run` builds every BlockMap, counts allowed pairs and traces every function
abstractly (`jax.eval_shape`), so the CPU-side path is checked without a GPU.

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
from maskc.kernels import api, attention, common as _common
from maskc.kernels.flash import kernel as flash

IMPLS = ("flash", "cudnn", "xla", "be-cudnn", "tokamax", "mosaic_gpu", "mosaic_gpu-bwd", "auto")
DEFAULT_IMPLS = ("flash", "cudnn", "xla", "be-cudnn", "tokamax", "auto")
DEFAULT_MASKS = ("causal", "sliding", "chunked", "documents", "image spans")
ENGINES = {"flash": "flash", "be-cudnn": "cudnn", "tokamax": "tokamax"}


def masks(window: int, chunk: int) -> dict[str, str]:
  """Benchmark name → mask text."""
  return {"causal": "causal", "sliding": f"sliding({window})",
          "chunked": f"causal & chunk({chunk})", "documents": "causal & document(seg)",
          "image spans": "causal | bidirectional(img)",
          "sliding-sink": f"sliding({window}) | sink(4)"}


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


def cell(fn, args, flops: float, repeats: int, dry_run: bool) -> tuple[str, float | None]:
  """The table's two columns for one function, and its time in ms (None: did not run)."""
  try:
    if dry_run:
      jax.eval_shape(fn, *args)
      return f"{'traced':>14}{'-':>14}", None
    ms = best_ms(jax.jit(fn), *args, repeats=repeats)
    return f"{ms:>14.2f}{flops / ms / 1e9:>14.1f}", ms
  except Exception as e:  # noqa: BLE001 - report and keep going (OOM, unsupported)
    return f"{'n/a':>14}{type(e).__name__[:13]:>14}", None


def print_costs(times: dict, work: dict) -> None:
  """The cost model's rates as measured: TFLOP/s on tile work, forward and backward.

  An engine whose gradients run another engine's backward (its `BACKWARD_ENGINE`: tokamax
  runs flash's) has its backward rate measured on that engine's work and printed with it.
  """
  costs = api.gpu_costs()
  print("\nGPU_COSTS as measured here (TFLOP/s on tile work; median over rows run):")
  for impl, engine in ENGINES.items():
    back = api.BACKENDS[engine].load().BACKWARD_ENGINE or engine
    fwd, bwd = [], []
    for (name, length), w in work.items():
      t_f, t_fb = times.get((impl, name, length, "fwd")), times.get((impl, name, length,
                                                                      "fwd+bwd"))
      if t_f:
        fwd.append(w[engine] * HEADS_BATCH[0] / t_f / 1e9)
      if t_f and t_fb and t_fb > t_f:
        bwd.append(api.BACKWARD_WORK * w[back] * HEADS_BATCH[0] / (t_fb - t_f) / 1e9)
    rates = [f"{np.median(x):.0f}" if x else "-" for x in (fwd, bwd)]
    whose = "" if back == engine else f" ({back}'s)"
    print(f"  {engine:<8} fwd {rates[0]:>5}  bwd {rates[1]:>5}{whose}   (in code: "
          f"{costs[engine][0]:.0f}, {costs[back][1]:.0f})")
  # mosaic_gpu is not in the cost model yet (auto never picks it): its forward rate alone,
  # on the work of its own map (the non-EMPTY tiles at its tiles).
  fwd = [w["mosaic_gpu"] * HEADS_BATCH[0] / t / 1e9 for (name, length), w in work.items()
         if "mosaic_gpu" in w and (t := times.get(("mosaic_gpu", name, length, "fwd")))]
  if fwd:
    print(f"  {'mosaic_gpu':<8} fwd {np.median(fwd):>5.0f}  (not in the cost model)")
  # its own backward (mosaic_gpu-bwd): fwd+bwd less the forward, on the same tile work
  bwd = []
  for (name, length), w in work.items():
    t_f = times.get(("mosaic_gpu-bwd", name, length, "fwd")) or times.get(
        ("mosaic_gpu", name, length, "fwd"))
    t_fb = times.get(("mosaic_gpu-bwd", name, length, "fwd+bwd"))
    if "mosaic_gpu" in w and t_f and t_fb and t_fb > t_f:
      bwd.append(api.BACKWARD_WORK * w["mosaic_gpu"] * HEADS_BATCH[0] / (t_fb - t_f) / 1e9)
  if bwd:
    print(f"  {'mosaic_gpu':<8} bwd {np.median(bwd):>5.0f}  (its own Mosaic GPU backward; "
          f"not in the cost model)")


HEADS_BATCH = [1]


def _label(impl: str) -> str:
  return {"mosaic_gpu": "mosaic", "mosaic_gpu-bwd": "mg-bwd"}.get(impl, impl)


def mosaic_fn(bm, backward: str):
  """`backend="mosaic_gpu"` on `bm`, differentiated by `backward` ("flash" or "mosaic_gpu":
  `mosaic_gpu.BACKWARD`, which is read when the call is traced, so set around the call)."""
  from maskc.kernels.mosaic_gpu import forward as mosaic_gpu

  def fn(q, k, v):
    saved, mosaic_gpu.BACKWARD = mosaic_gpu.BACKWARD, backward
    try:
      return attention(q, k, v, bm, backend="mosaic_gpu")
    finally:
      mosaic_gpu.BACKWARD = saved
  return fn


def _mosaic_blocks() -> tuple[int, int]:
  from maskc.kernels.mosaic_gpu import forward as mosaic_gpu
  return mosaic_gpu.BLOCK_SIZES


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
  p.add_argument("--masks", nargs="+", default=list(DEFAULT_MASKS),
                 choices=list(masks(0, 0)))
  p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
  p.add_argument("--impls", nargs="+", default=list(DEFAULT_IMPLS), choices=list(IMPLS),
                 help="which to time (xla's dense mask needs L^2 memory: drop it at 32K+)")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=None)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--window", type=int, default=4096)
  p.add_argument("--chunk", type=int, default=8192)
  p.add_argument("--block-q", type=int, default=flash.BLOCK_SIZES[0])
  p.add_argument("--block-kv", type=int, default=flash.BLOCK_SIZES[1])
  p.add_argument("--mosaic-blocks", type=int, nargs=2, default=list(_mosaic_blocks()),
                 help="the mosaic_gpu column's tiles (block_q must be 128)")
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
      f"{_label(n) + ' ms':>14}{_label(n) + ' TF/s':>14}" for n in args.impls) + "  auto picks"
  HEADS_BATCH[0] = args.heads * args.batch
  times: dict = {}
  work: dict = {}
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
      fns = {impl: (lambda q, k, v, bm=bm, b=b: attention(q, k, v, bm, backend=b))
             for impl, b in list(ENGINES.items()) + [("auto", "auto")]}
      for impl in ("cudnn", "xla"):
        fns[impl] = reference(impl, name, bm, args.window)
      pick = api.choose(bm, platform="gpu", head_dim=args.head_dim, dtype=jnp.bfloat16)
      work[name, length] = {e: api.BACKENDS[e].load().forward_work(bm, args.head_dim)
                            for e in ENGINES.values()}
      if {"mosaic_gpu", "mosaic_gpu-bwd"} & set(args.impls):
        bm_mg = maskc.compile(m, length, block_q=args.mosaic_blocks[0],
                              block_kv=args.mosaic_blocks[1], operands=used)
        fns["mosaic_gpu"] = mosaic_fn(bm_mg, "flash")
        fns["mosaic_gpu-bwd"] = mosaic_fn(bm_mg, "mosaic_gpu")
        work[name, length]["mosaic_gpu"] = api.BACKENDS["mosaic_gpu"].load().forward_work(
            bm_mg, args.head_dim)
      for mode in args.modes:
        factor = 3.5 if mode == "fwd+bwd" else 1.0
        flops = 4 * args.head_dim * pairs * args.batch * args.heads * factor
        row = f"{mode:<8}{length:>7}  {name:<12}{bm.density:>8.3f}"
        for impl in args.impls:
          fn = fns[impl]
          if mode == "fwd+bwd":
            fn = jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).astype(jnp.float32).sum(),
                          (0, 1, 2))
          text, ms = cell(fn, (q, k, v), flops, args.repeats, args.dry_run)
          row += text
          times[impl, name, length, mode] = ms
        print(row + f"  {pick.backend}", flush=True)
  if not args.dry_run:
    print_costs(times, work)


if __name__ == "__main__":
  main()
