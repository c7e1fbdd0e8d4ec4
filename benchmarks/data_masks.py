"""Masks that change every step, against their floors, in one run: pairwise operands, block
selection under `jax.jit`, and trees.

- Pairwise: `maskc.compile("causal & anc[q, k]", n)` with a tree's ancestor matrix (bool
  `[n, n]`, a fresh one each call: no cache), against one NumPy pass over the operand giving
  any and all per 128 x 128 tile (what aligned tiles need); and the memory beyond the operand
  (tracemalloc peak minus the operand's own bytes) against the default budget.
- Block selection: `causal & sel[q // 128, k // 128]` at 64K tokens under `jit`, a fresh
  top-k selection each call (each query block picks `--topk` of the key blocks at or before
  it), against a plain jitted jax.numpy function computing the same tile states, and one
  rebuilding FlexAttention-style index lists (`kv_num_blocks`, `kv_indices`) from them by
  hand. The map is measured whole (forward and backward runs) and forward only.
- Trees: `tree(tin, tout)` of RL rollouts packed in DFS order (a prompt, then completions)
  at 64K tokens, fresh operands each call, against `causal & document(seg)` at the same
  length with fresh documents; and the same tree with its tokens out of DFS order (the
  generic analysis).

  python benchmarks/data_masks.py [--lengths 4096,8192,16384,32768] [--repeat 5]

Timings are the best of `--repeat` calls; the header gives the load average.
"""

from __future__ import annotations

import argparse
import os
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import maskc
from maskc.lowering import compile as _lower
from maskc.lowering.tuning import MEMORY_BUDGET


def best(fn: Callable[[int], Any], repeat: int) -> float:
  """The best wall time of `fn(i)` over `repeat` calls (after one unmeasured call)."""
  fn(repeat)
  out = float("inf")
  for i in range(repeat):
    t0 = time.perf_counter()
    fn(i)
    out = min(out, time.perf_counter() - t0)
  return out


def ancestors(n: int, seed: int) -> np.ndarray:
  """The ancestor-or-self matrix of a random tree in DFS order (parents within 64 tokens)."""
  rng = np.random.default_rng(seed)
  parent = np.concatenate([[-1], [int(rng.integers(max(0, i - 64), i)) for i in range(1, n)]])
  tin, tout = (maskc.trees.from_parents(parent)[k] for k in ("tin", "tout"))
  out = np.empty((n, n), bool)
  for a in range(0, n, 1024):  # rows at a time: no n x n temporaries of int64
    out[a:a + 1024] = (tin[None, :] <= tin[a:a + 1024, None]) & (tin[a:a + 1024, None] <
                                                                   tout[None, :])
  return out


def blocked_pass(a: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
  """One NumPy pass: any and all of each `block x block` tile (the floor)."""
  n = a.shape[-1]
  v = a.reshape(n // block, block, n // block, block)
  return v.any(axis=(1, 3)), v.all(axis=(1, 3))


def pairwise(lengths: list[int], repeat: int) -> None:
  print("\n# Pairwise operands: `causal & anc[q, k]`, 128 x 128 tiles, a fresh operand a call\n")
  print("| tokens | maskc | one NumPy pass | ratio | memory beyond the operand (peak) | "
        "budget |")
  print("|---:|---:|---:|---:|---:|---:|")
  maskc.parse("causal")
  for n in lengths:
    pairwise_row(n, repeat)


def pairwise_row(n: int, repeat: int) -> None:
  """One row of the pairwise table: operands as a data pipeline hands them over, read-only
  (a writeable one is copied first: a map must not change when its caller reuses it)."""
  ops = [ancestors(n, s) for s in range(2)]
  for a in ops:
    a.setflags(write=False)
  t_floor = best(lambda i: blocked_pass(ops[i % 2], 128), repeat)

  def run(i: int) -> None:
    _lower._CACHE.clear()
    maskc.compile("causal & anc[q, k]", n, block_q=128, block_kv=128,
                  operands={"anc": ops[i % 2]})

  t = best(run, repeat)
  tracemalloc.start()
  run(0)
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  print(f"| {n // 1024}K | {t * 1e3:.1f} ms | {t_floor * 1e3:.1f} ms | {t / t_floor:.1f}x | "
        f"{peak / 2**20:.1f} MiB | {MEMORY_BUDGET / 2**20:.0f} MiB |", flush=True)


def block_selection(n: int, topk: int, repeat: int) -> None:
  b = 128
  nt = n // b
  print(f"\n# Block selection under jit: `causal & sel[q // 128, k // 128]`, {n // 1024}K "
        f"tokens, top-{topk} of the key blocks each query block, fresh `sel` a call\n")
  rng = np.random.default_rng(0)

  def selection() -> jax.Array:
    s = rng.random((nt, nt))
    s[np.triu_indices(nt, 1)] = -1
    sel = np.zeros((nt, nt), bool)
    np.put_along_axis(sel, np.argsort(-s, axis=1)[:, :topk], True, 1)
    return jnp.asarray(sel & (s >= 0))

  sels = [selection() for _ in range(4)]
  causal = jnp.asarray(np.tri(nt, dtype=np.int8) * 2 - np.eye(nt, dtype=np.int8))
  text = "causal & sel[q // 128, k // 128]"
  whole = jax.jit(lambda sel: maskc.compile(text, n, block_q=b, block_kv=b,
                                            operands={"sel": sel}))
  forward = jax.jit(lambda sel: maskc.compile(text, n, block_q=b, block_kv=b,
                                              operands={"sel": sel}).rows)
  states = jax.jit(lambda sel: jnp.minimum(causal, jnp.where(sel, 2, 0).astype(jnp.int8)))

  @jax.jit
  def flex_lists(sel: jax.Array) -> tuple[jax.Array, ...]:
    g = jnp.minimum(causal, jnp.where(sel, 2, 0).astype(jnp.int8))
    out = []
    for state in (1, 2):  # PARTIAL, FULL: counts and ascending indices, as FlexAttention's
      hit = g == state
      idx = jnp.sort(jnp.where(hit, jnp.arange(nt, dtype=jnp.int32), nt), axis=-1)
      out += [hit.sum(-1, dtype=jnp.int32), jnp.where(idx < nt, idx, 0)]
    return tuple(out)

  t0 = time.perf_counter()
  jax.block_until_ready(whole(sels[0]))
  compile_s = time.perf_counter() - t0
  rows = [("maskc, the whole map (forward and backward runs)", whole),
          ("maskc, the forward runs", forward),
          ("FlexAttention-style index lists by hand (jax.numpy)", flex_lists),
          ("the tile states alone (jax.numpy)", states)]
  times = {}
  for label, f in rows:
    times[label] = best(lambda i, f=f: jax.block_until_ready(f(sels[i % 4])), repeat * 3)
  base = times["the tile states alone (jax.numpy)"]
  print(f"maskc's first call (trace and compile): {compile_s:.2f} s\n")
  print("| what | per call | vs the tile states |")
  print("|---|---:|---:|")
  for label, _ in rows:
    print(f"| {label} | {times[label] * 1e3:.2f} ms | {times[label] / base:.0f}x |", flush=True)


def trees(n: int, repeat: int) -> None:
  print(f"\n# Trees at {n // 1024}K tokens, fresh operands each call, 128 x 128 tiles\n")
  rng = np.random.default_rng(0)

  def rollout(seed: int) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    prompt = int(r.integers(n // 16, n // 4))
    cuts = np.sort(r.integers(prompt, n, 15))
    lens = np.diff(np.concatenate([[prompt], cuts, [n]]))
    return maskc.trees.rollout(prompt, lens.tolist())

  def shuffled(ops: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    # the same tree laid out out of DFS order: positions permuted by blocks of 64 tokens
    perm = np.random.default_rng(seed).permutation(n // 64)
    order = (perm[:, None] * 64 + np.arange(64)).reshape(-1)
    return {k: v[order] for k, v in ops.items()}

  def documents(seed: int) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    lengths = r.integers(1024, 8192, n // 1024 + 1)
    return {"seg": np.repeat(np.arange(lengths.size), lengths)[:n].astype(np.int32)}

  made = {"rollouts": [rollout(s) for s in range(2)],
          "documents": [documents(s) for s in range(2)]}
  made["shuffled"] = [shuffled(o, s) for s, o in enumerate(made["rollouts"])]
  del rng
  cases = [("`causal & document(seg)`, documents of 1K-8K", "causal & document(seg)",
            "documents"),
           ("`tree(tin, tout)`, a prompt and 16 completions, DFS order", "tree(tin, tout)",
            "rollouts"),
           ("`tree(tin, tout)`, the same out of DFS order (generic)", "tree(tin, tout)",
            "shuffled")]
  times = {}
  for label, text, key in cases:
    def run(i: int, text: str = text, key: str = key) -> None:
      _lower._CACHE.clear()
      maskc.compile(text, n, block_q=128, block_kv=128, operands=made[key][i % 2])
    times[label] = best(run, repeat)
  base = times[cases[0][0]]
  print("| mask | time | vs documents |")
  print("|---|---:|---:|")
  for label, _, _ in cases:
    print(f"| {label} | {times[label] * 1e3:.2f} ms | {times[label] / base:.1f}x |",
          flush=True)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--lengths", default="4096,8192,16384,32768",
                  help="pairwise operand lengths")
  ap.add_argument("--selection-length", type=int, default=65536)
  ap.add_argument("--topk", type=int, default=16)
  ap.add_argument("--tree-length", type=int, default=65536)
  ap.add_argument("--repeat", type=int, default=5)
  args = ap.parse_args()
  print(f"load average: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; jax "
        f"{jax.__version__}")
  pairwise([int(x) for x in args.lengths.split(",")], args.repeat)
  block_selection(args.selection_length, args.topk, args.repeat)
  trees(args.tree_length, args.repeat)


if __name__ == "__main__":
  main()
