"""Context-parallel load balance: contiguous vs zigzag vs balanced layouts, and balance's speed.

For each mask at `--length` tokens (default 1M) with `--block`-token tiles, the
imbalance (heaviest shard's visited tiles / mean, PARTIAL tiles weighted 1.5) of
each layout at 8, 16 and 64 sequence shards. The tile costs come from one
compile per mask (the same one `maskc.balance` does); the layouts are then built
for every shard count and method from those costs. Then the time of a whole
`maskc.balance(..., method="balanced")` call at 64 shards, from a cold compile
cache. Last, the wall time of sharded attention on 8 fake CPU devices against
unsharded attention on the same backend (xla at `--cpu-length` tokens, flash and
splash in Pallas interpret mode at `--pallas-length`), static and traced segment
ids: the fake devices share the machine's cores, so this shows the overhead of the
sharded program, not a speedup.

  python benchmarks/sharding.py [--length 1048576] [--block 128] [--cpu-length 8192]
      [--cpu-backends xla,flash,splash] [--pallas-length 2048] [--cpu-only]
"""

from __future__ import annotations

import argparse
import os
import time

# 8 fake CPU devices for the sharded CPU run; must be set before JAX starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import maskc  # noqa: E402
from maskc.lowering import compile as _lower  # noqa: E402
from maskc.parallel import layout as _layout  # noqa: E402


def packed_segments(n: int, seed: int = 0) -> np.ndarray:
  """Segment ids of documents of 1K-64K tokens packed into `n` tokens."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1024, 65536, n // 1024 + 1)
  return np.repeat(np.arange(lengths.size), lengths)[:n].astype(np.int32)


def image_spans(n: int, seed: int = 0) -> np.ndarray:
  """Image-token flags: one span of 1K-16K tokens per 64K tokens, at random places."""
  rng = np.random.default_rng(seed)
  img = np.zeros(n, bool)
  for start in range(0, n, 65536):
    s = start + int(rng.integers(0, 65536 - 16384))
    img[s:s + int(rng.integers(1024, 16385))] = True
  return img


def cases(n: int):
  return [("causal", "causal", {}),
          ("sliding(4096) | global(64)", "sliding(4096) | global(64)", {}),
          ("causal & chunk(8192)", "causal & chunk(8192)", {}),
          ("packed documents", "causal & document(seg)", {"seg": packed_segments(n)}),
          ("image spans", "causal | bidirectional(img)", {"img": image_spans(n)})]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--length", type=int, default=1 << 20)
  ap.add_argument("--block", type=int, default=128)
  ap.add_argument("--shards", default="8,16,64")
  ap.add_argument("--cpu-length", type=int, default=8192)
  ap.add_argument("--cpu-backends", default="xla,flash,splash")
  ap.add_argument("--pallas-length", type=int, default=2048)
  ap.add_argument("--cpu-only", action="store_true", help="only the sharded CPU wall times")
  args = ap.parse_args()
  if args.cpu_only:
    cpu_run(args.cpu_length, args.block, args.cpu_backends.split(","), args.pallas_length)
    return
  n, block = args.length, args.block
  shard_counts = [int(s) for s in args.shards.split(",")]
  methods = ("contiguous", "zigzag", "balanced")
  print(f"imbalance (max / mean visited tiles, PARTIAL x{_layout.PARTIAL_COST}) at {n:,} "
        f"tokens, {block}x{block} tiles\n")
  head = "| mask | " + " | ".join(f"{s} shards: contiguous / zigzag / balanced"
                                   for s in shard_counts) + " |"
  print(head)
  print("|---|" + "---|" * len(shard_counts))
  timing = []
  for label, mask, ops in cases(n):
    costs = _layout.tile_costs(mask, n, block=block, operands=ops)
    cells = []
    for s in shard_counts:
      vals = []
      for m in methods:
        chunk = {"contiguous": n // s, "zigzag": n // (2 * s), "balanced": block}[m]
        lay = _layout._layout_from_costs(costs, n, s, block, chunk, m, _layout.PARTIAL_COST)
        vals.append(f"{lay.imbalance:.3f}")
      cells.append(" / ".join(vals))
    name = label.replace("|", "\\|")
    print(f"| `{name}` | " + " | ".join(cells) + " |", flush=True)
    _lower._CACHE.clear()
    t0 = time.perf_counter()
    maskc.balance(mask, n, max(shard_counts), block=block, operands=ops)
    timing.append((label, time.perf_counter() - t0))
  print(f"\ntime of maskc.balance(..., {n:,} tokens, {max(shard_counts)} shards, block={block}),"
        " cold compile cache\n")
  print("| mask | seconds |")
  print("|---|---|")
  for label, sec in timing:
    name = label.replace('|', '\\|')
    print(f"| `{name}` | {sec:.2f} |")
  cpu_run(args.cpu_length, block, args.cpu_backends.split(","), args.pallas_length)


def _best(fn, *args, repeat: int = 3) -> float:
  jax.block_until_ready(fn(*args))  # compile
  times = []
  for _ in range(repeat):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return min(times)


def cpu_run(n: int, block: int, backends=("xla",), pallas_n: int = 2048) -> None:
  """Sharded (8 fake devices, context axis) vs unsharded attention: ms per call.

  Per backend (xla at `n` tokens with `block`-tiles; flash and splash in Pallas
  interpret mode at `pallas_n` tokens with their own tiles), the unsharded call on
  one device against `sharded_attention` with each strategy; `causal & document(seg)`
  also with its segment ids traced (jit arguments: the maps compile on the devices).
  """
  devices = jax.devices()
  if len(devices) < 8:
    print("\n(sharded CPU run skipped: fewer than 8 devices)")
    return
  mesh = Mesh(np.array(devices[:8]), ("context",))
  print("\nwall time, B=1, H=4, D=64, fp32, 8 fake CPU devices sharing the machine's cores "
        "(ms per call, after compilation; flash and splash in Pallas interpret mode)\n")
  print("| backend, L | mask | unsharded | all_gather | ring |")
  print("|---|---|---|---|---|")
  for backend in backends:
    length = n if backend == "xla" else pallas_n
    blocks = {"xla": dict(block_q=block, block_kv=block), "flash": {}, "splash": {}}[backend]
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, length, 4, 64)), jnp.float32)
               for _ in range(3))
    lengths = np.random.default_rng(1).integers(length // 32, length // 4, 64)
    seg = np.repeat(np.arange(64), lengths)[:length].astype(np.int32)  # ~8 documents
    masks = [("causal", None, False), ("causal & document(seg)", seg, False),
             ("causal & document(seg)", seg, True)]
    if backend == "xla":
      masks.insert(1, ("sliding(1024) | global(64)", None, False))
    interp = True if backend != "xla" else None
    for mask, ops, traced in masks:
      row = _timings(mesh, backend, blocks, interp, (q, k, v), mask, ops, traced)
      name = mask.replace("|", "\\|") + (", traced seg" if traced else "")
      cells = [c if isinstance(c, str) else f"{1e3 * c:.1f}" for c in row]
      print(f"| {backend}, {length:,} | `{name}` | " + " | ".join(cells) + " |", flush=True)


def _timings(mesh, backend, blocks, interp, qkv, mask, ops, traced) -> list:
  """Seconds per call of one mask, unsharded then per strategy (a string where it raises)."""
  def plain(q, k, v, seg):
    return maskc.attention(q, k, v, mask, backend=backend, interpret=interp,
                           operands=None if seg is None else {"seg": seg}, **blocks)

  def timed(f):
    """ms of `f`: its operands jit arguments when traced, else constants of the jit."""
    if traced:
      return _best(jax.jit(f), *qkv, ops)
    return _best(jax.jit(lambda q, k, v: f(q, k, v, ops)), *qkv)

  def sharded(strategy):
    def run(q, k, v, seg):
      return maskc.sharded_attention(
          q, k, v, mask, mesh=mesh, seq_axis="context", strategy=strategy,
          layout="zigzag" if traced else "balanced",
          operands=None if seg is None else {"seg": seg}, backend=backend,
          interpret=interp, **blocks)
    return run

  row = [timed(plain)]
  for strategy in ("all_gather", "ring"):
    try:
      row.append(timed(sharded(strategy)))
    except maskc.MaskError as e:   # e.g. a backend without run_with_lse for ring
      row.append(f"({type(e).__name__})")
  return row


if __name__ == "__main__":
  main()
