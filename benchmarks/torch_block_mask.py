"""FlexAttention BlockMasks: `maskc.torch.block_mask` against torch's `create_block_mask`.

For each mask and length, in one process on one CPU, both build the `BlockMask` of the same
mask (maskc from its text, torch from a hand-written `mask_mod`, as a user writes it), and
the table gives each side's time and their ratio:

- torch without compiling (`_compile=False`: the dense mask is evaluated, then reduced),
  only up to `--eager-max` tokens (its `Lq × Lk` temporaries need several GiB at 64K);
- torch compiled (`_compile=True`), its first call (compiling) and its second (compiled);
  dynamo's caches are reset before each mask and length, so every first call compiles;
- maskc cold: its compile caches cleared before each call (the grammar and prelude that a
  process builds once are kept), best of `--repeats`;
- maskc in a fresh process: the first `block_mask` call of a new Python process that has
  imported `maskc.torch` (it parses the prelude and lowers the mask from nothing).

Both sides' lists are compared (all eight tensors): `equal` says whether they matched.

  python benchmarks/torch_block_mask.py [--lengths 32768,65536,131072] [--repeats 5]
  python benchmarks/torch_block_mask.py --maskc-only --repeats 20    # maskc's columns alone
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask

import maskc
import maskc.torch

FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
# lru caches a process builds once whatever the mask: the grammar, the prelude, IR field names
KEEP = [("maskc.language.parse", "_parser"), ("maskc.language.parse", "prelude"),
        ("maskc.language.ir", "_field_names")]


def packed_documents(n: int, lo: int = 50, hi: int = 2000, seed: int = 0) -> np.ndarray:
  """Segment ids of documents of `lo`-`hi` tokens packed into `n` tokens."""
  lengths = np.random.default_rng(seed).integers(lo, hi + 1, n // lo + 1)
  return np.repeat(np.arange(lengths.size), lengths)[:n].astype(np.int32)


def cases(n: int) -> list[tuple[str, str, dict, object]]:
  """(label, maskc text, operands, torch mask_mod) for `n` tokens."""
  seg = packed_documents(n)
  seg_t = torch.as_tensor(seg)
  return [
      ("causal", "causal", {}, lambda b, h, q, k: q >= k),
      ("sliding 4096", "sliding(4096)", {}, lambda b, h, q, k: (q >= k) & (q - k < 4096)),
      ("chunked 8192", "causal & chunk(8192)", {},
       lambda b, h, q, k: (q >= k) & (q // 8192 == k // 8192)),
      ("documents of 50-2000", "causal & document(seg)", {"seg": seg},
       lambda b, h, q, k: (q >= k) & (seg_t[q] == seg_t[k])),
  ]


def clear_maskc_caches() -> None:
  """Every cache maskc fills while compiling a mask, but the grammar and prelude (wherever a
  module imported them)."""
  keep = [getattr(sys.modules[module], attr) for module, attr in KEEP]
  for name, module in list(sys.modules.items()):
    if name != "maskc" and not name.startswith("maskc."):
      continue
    for value in list(vars(module).values()):
      if hasattr(value, "cache_clear") and not any(value is k for k in keep):
        value.cache_clear()
  from maskc.lowering import compile as lower
  lower._CACHE.clear()


def maskc_cold(text: str, n: int, operands: dict, repeats: int) -> list[float]:
  times = []
  for _ in range(repeats):
    clear_maskc_caches()
    t0 = time.perf_counter()
    maskc.torch.block_mask(text, n, operands=operands)
    times.append(time.perf_counter() - t0)
  return times


FRESH = """
import json, sys, time
import numpy as np
import maskc.torch
ops = {k: np.load(v) for k, v in json.loads(sys.argv[2]).items()}
t0 = time.perf_counter()
maskc.torch.block_mask(sys.argv[1], int(sys.argv[3]), operands=ops)
print(time.perf_counter() - t0)
"""


def maskc_fresh(text: str, n: int, operands: dict) -> float:
  with tempfile.TemporaryDirectory() as tmp:
    paths = {}
    for name, value in operands.items():
      paths[name] = f"{tmp}/{name}.npy"
      np.save(paths[name], value)
    out = subprocess.run([sys.executable, "-c", FRESH, text, json.dumps(paths), str(n)],
                         check=True, capture_output=True, text=True)
  return float(out.stdout.strip().splitlines()[-1])


def timed(fn):
  t0 = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - t0


def equal(a, b) -> bool:
  return all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS)


def fmt(seconds: float | None) -> str:
  if seconds is None:
    return "(not run)"
  return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--lengths", default="32768,65536,131072")
  p.add_argument("--repeats", type=int, default=5, help="cold maskc calls per case (best)")
  p.add_argument("--eager-max", type=int, default=32768,
                 help="longest length torch runs without compiling")
  p.add_argument("--only", help="run only the masks whose label contains this")
  p.add_argument("--maskc-only", action="store_true", help="skip torch (its columns empty)")
  args = p.parse_args()
  warnings.filterwarnings("ignore", category=DeprecationWarning)  # `_compile=True`
  print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; maskc "
        f"{maskc.__version__}")
  print("| mask | tokens | torch eager | torch compiled, 1st | torch compiled, 2nd | "
        "maskc cold (best / median) | maskc fresh process | 2nd / maskc cold | equal |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|:---:|")
  for n in (int(x) for x in args.lengths.split(",")):
    for label, text, ops, mod in cases(n):
      if args.only and args.only not in label:
        continue
      ours = maskc.torch.block_mask(text, n, operands=ops)
      cold = maskc_cold(text, n, ops, args.repeats)
      fresh = maskc_fresh(text, n, ops)
      best = min(cold)
      if args.maskc_only:
        print(f"| {label} | {n // 1024}K | | | | {fmt(best)} / {fmt(statistics.median(cold))} | "
              f"{fmt(fresh)} | | |", flush=True)
        continue
      eager = None
      if n <= args.eager_max:
        _, eager = timed(functools.partial(create_block_mask, mod, 1, 1, n, n, device="cpu"))
      torch._dynamo.reset()
      make = functools.partial(create_block_mask, mod, 1, 1, n, n, device="cpu", _compile=True)
      _, first = timed(make)
      theirs, second = timed(make)
      same = equal(ours, theirs)
      print(f"| {label} | {n // 1024}K | {fmt(eager)} | {fmt(first)} | {fmt(second)} | "
            f"{fmt(best)} / {fmt(statistics.median(cold))} | {fmt(fresh)} | "
            f"{second / best:,.0f}× | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
  main()
