"""Decode tokens per second: maskc.flax's cached decoding against dense-mask attention.

The model is `examples/nnx_decoder.py`'s decoder (its masks from `gemma3.yaml` or
`llama4.yaml`) at d_model 256, 4 query heads of 64, 2 key/value heads. Its cache holds
`length` tokens when the timing starts; each step appends one token per row.

- **maskc**: `Decoder(..., decode=True)`, one `nnx.jit`-compiled step that donates the
  model, so the caches are written in place. Layers whose mask
  bounds their lookback (`causal & chunk(C)`, `sliding(W)` alone) keep a ring of that many
  slots; the others (`causal`, `sliding(W) | bidirectional(img)`, whose images may reach
  further back) attend over the whole cache. `gemma3-vouched` is Gemma 3 as its users
  decode it: images shorter than W, each prefilled in one call, so the layers that share
  layer 0's mask (`sliding(W) | bidirectional(img)`) are given a ring of W
  (`cache_window=W`, which the user vouches for).
- **dense**: the same model and weights, each layer's cache the full length, and
  `jax.nn.dot_product_attention` with the layer's dense mask (`maskc.materialize` of the
  whole cache once, the step's row sliced from it), as a model without maskc decodes.

- **maskc splits=...** (`--splits auto off`): maskc again with flash-decoding
  (`maskc.kernels.flash.decode`) as the heuristic picks it (`auto`), off (`off`:
  `MAX_SPLITS = 1`, one program walks all of a row's key tiles) or capped at `N`
  (`MAX_SPLITS = N`). Each maskc cell names the largest split flash took in the step
  (`S 17`), or `no flash` where the step ran on another engine (on a CPU: xla, and the
  columns agree). Not yet measured on a GPU.

All are timed in the same run, alternating, best of `--rounds` rounds of `--steps` steps
after one warm-up round; the cache contents are random (speed does not depend on them).
The cached decoding's correctness is tested in tests/test_flax.py and
tests/test_nnx_decoder.py, not here.

    python benchmarks/flax_decode.py                        # both configs, 1K and 8K
    python benchmarks/flax_decode.py --lengths 32768        # on a GPU
    python benchmarks/flax_decode.py --lengths 8192 32768 --splits auto off   # on a GPU
"""

from __future__ import annotations

import argparse
import functools
import importlib
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import maskc
from maskc.kernels.flash import decode as flash_decode

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARAMS = {"gemma3": {"W": 512}, "gemma3-vouched": {"W": 512}, "llama4": {"C": 512, "W": 256}}


def load_example() -> Any:
  """examples/nnx_decoder.py as a module (examples/ is not a package)."""
  sys.path.insert(0, str(ROOT / "examples"))
  return importlib.import_module("nnx_decoder")


def build(example: Any, config: str, backend: str) -> Any:
  masks = maskc.load_config(example.CONFIGS[config.split("-")[0]], **PARAMS[config])
  cfg = example.ModelConfig(masks=masks, vocab=256, d_model=256, kv_heads=2, tile=128,
                            backend=backend)
  windows = {}
  if config.endswith("-vouched"):
    windows = {i: PARAMS[config]["W"] for i in range(masks.num_layers)
               if masks.mask(i) == masks.mask(0)}
  return example.Decoder(cfg, cache_windows=windows, rngs=nnx.Rngs(0))


def fill(model: Any, batch: int, length: int, capacity: int, rng: np.random.Generator) -> None:
  """A cache of `capacity` tokens, the first `length` written with random keys and values."""
  model.init_cache(batch, capacity)
  for block in model.blocks:
    attn = block.attn
    for cache in (attn.cached_key, attn.cached_value):
      cache[...] = jnp.asarray(rng.standard_normal(cache[...].shape, np.float32))
    attn.cache_index[...] = jnp.array(length, jnp.int32)


def dense_decoder(example: Any, model: Any, batch: int, length: int, capacity: int,
                  rng: np.random.Generator):
  """A decode step of `model` with full caches and `jax.nn.dot_product_attention`."""
  masks = model.cfg.masks
  zeros = {o.name: np.zeros((batch, capacity), bool if o.dtype == "bool" else np.int32)
           for o in masks.operands}
  dense = {}
  for i in range(masks.num_layers):
    key = str(masks.mask(i))
    if key not in dense:
      m = masks.mask(i)
      dense[key] = jnp.asarray(maskc.materialize(list(m) if isinstance(m, tuple) else m,
                                                 capacity, operands=zeros))[0]
  layer_mask = [dense[str(masks.mask(i))] for i in range(masks.num_layers)]
  shape = (batch, capacity, model.cfg.kv_heads, model.cfg.head_dim)
  caches = [(jnp.asarray(rng.standard_normal(shape, np.float32)),
             jnp.asarray(rng.standard_normal(shape, np.float32)))
            for _ in range(masks.num_layers)]

  @functools.partial(nnx.jit, donate_argnums=1)  # the caches, written in place
  def step(model, caches, token, pos):
    new = list(caches)

    def attend(attn, h, layer):
      q, k, v = attn.query(h), attn.key(h), attn.value(h)
      p = jnp.broadcast_to(pos, h.shape[:2])
      q, k = example.rope(q, p), example.rope(k, p)
      keys = jax.lax.dynamic_update_slice(caches[layer][0], k, (0, pos, 0, 0))
      values = jax.lax.dynamic_update_slice(caches[layer][1], v, (0, pos, 0, 0))
      new[layer] = (keys, values)
      row = jax.lax.dynamic_slice_in_dim(layer_mask[layer], pos, 1, axis=-2)
      row = row[None, None] if row.ndim == 2 else row[None]  # [1, H or 1, 1, S]
      return attn.out(jax.nn.dot_product_attention(q, keys, values, mask=row))

    return model(token, attend=attend), new

  state = {"caches": caches, "pos": length}

  def run(token):
    logits, state["caches"] = step(model, state["caches"], token, jnp.int32(state["pos"]))
    state["pos"] += 1
    return logits

  return run


def with_splits(run, setting: str, picks: list[int]):
  """`run` with flash-decoding as `setting` says ("auto", "off" or a cap `N`) while it runs,
  its first call (which traces the step) included; the splits flash picks while tracing are
  appended to `picks` (none: the step did not run on flash)."""
  cap = {"auto": flash_decode.MAX_SPLITS, "off": 1}.get(setting) or int(setting)
  choose = flash_decode.splits

  def recorded(*a, **kw):
    picks.append(choose(*a, **kw))
    return picks[-1]

  def call(token):
    saved, flash_decode.MAX_SPLITS = flash_decode.MAX_SPLITS, cap
    flash_decode.splits = recorded
    try:
      return run(token)
    finally:
      flash_decode.MAX_SPLITS, flash_decode.splits = saved, choose
  return call


def time_steps(run, token, steps: int) -> float:
  t = time.perf_counter()
  for _ in range(steps):
    out = run(token)
  jax.block_until_ready(out)
  return (time.perf_counter() - t) / steps


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--configs", nargs="+", default=["gemma3", "gemma3-vouched", "llama4"])
  parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--steps", type=int, default=16, help="steps per timed round")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--backend", default="auto", help="maskc's backend (default auto)")
  parser.add_argument("--splits", nargs="+", default=["auto"],
                      help="flash-decoding settings to time maskc with, each a column: auto "
                           "(the heuristic), off, or a cap N (default: auto)")
  args = parser.parse_args(argv)
  example = load_example()
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, batch {args.batch}, "
        f"backend {args.backend}")
  names = ["maskc"] if args.splits == ["auto"] else [f"maskc splits={s}" for s in args.splits]
  print(f"| config | cache | KV cache per layer | {' | '.join(f'{n} tok/s' for n in names)} | "
        f"dense tok/s | {names[0]} / dense |")
  print("|---|---:|---|" + "---:|" * (len(names) + 2))
  for config in args.configs:
    for length in args.lengths:
      rng = np.random.default_rng(0)
      capacity = length + (args.rounds + 1) * args.steps
      token = jnp.zeros((args.batch, 1), jnp.int32)
      runs, picks = {}, {}
      for name, setting in zip(names, args.splits):
        model = build(example, config, args.backend)
        fill(model, args.batch, length, capacity, rng)
        step = nnx.jit(lambda m, t: m(t, decode=True), donate_argnums=0)
        picks[name] = []
        runs[name] = with_splits(lambda t, m=model, step=step: step(m, t), setting, picks[name])
      runs["dense"] = dense_decoder(example, build(example, config, args.backend), args.batch,
                                    length, capacity, rng)
      best = {name: float("inf") for name in runs}
      for r in range(args.rounds + 1):
        for name, run in runs.items():
          seconds = time_steps(run, token, args.steps)
          if r:  # round 0 compiles and warms up
            best[name] = min(best[name], seconds)
      tps = {name: args.batch / s for name, s in best.items()}
      rings = ", ".join("full" if b.attn.window is None else str(b.attn.window)
                        for b in model.blocks)
      # each maskc column says the largest split flash took (no flash: the step ran elsewhere)
      cols = " | ".join(f"{tps[n]:,.0f} ({f'S {max(picks[n])}' if picks[n] else 'no flash'})"
                        for n in names)
      print(f"| {config} {PARAMS[config]} | {length} | {rings} | {cols} | "
            f"{tps['dense']:,.0f} | {tps[names[0]] / tps['dense']:.2f}x |", flush=True)


if __name__ == "__main__":
  main()
