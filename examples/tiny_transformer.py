"""A tiny JAX transformer whose attention layers take their masks from a config file.

The masks live in `tiny_transformer.yaml` (Llama 4 style: three chunked layers,
then a global one, all within packed documents). `maskc.load_config` checks the
file before the model runs, `MaskConfig.compile` lowers each distinct layer mask
once, and every layer hands its BlockMap to `maskc.attention`. The model is
4 layers, d_model 32, 2 query heads sharing 1 key/value head (GQA), vocabulary 50;
forward and backward run on CPU in a few seconds.

    python examples/tiny_transformer.py
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import maskc

CONFIG = pathlib.Path(__file__).with_name("tiny_transformer.yaml")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes of the tiny model; `masks` says which mask each attention layer uses."""
  masks: maskc.MaskConfig
  vocab: int = 50
  d_model: int = 32
  heads: int = 2
  kv_heads: int = 1
  tile: int = 8  # block_q = block_kv: tiny, so the block maps have structure at L = 32

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads


def init_params(rng: np.random.Generator, cfg: ModelConfig) -> dict[str, Any]:
  """Random weights: an embedding (tied with the output) and per layer attention + MLP."""
  d, hd = cfg.d_model, cfg.head_dim

  def dense(shape):  # NumPy, not jax.random: no XLA compilation per shape
    return jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(shape[0]))

  layers = [{"wq": dense((d, cfg.heads * hd)), "wk": dense((d, cfg.kv_heads * hd)),
             "wv": dense((d, cfg.kv_heads * hd)), "wo": dense((cfg.heads * hd, d)),
             "w1": dense((d, 4 * d)), "w2": jnp.zeros((4 * d, d))}
            for _ in range(cfg.masks.num_layers)]
  return {"embed": jnp.asarray(rng.standard_normal((cfg.vocab, d), np.float32) * 0.1),
          "layers": layers}


def attend(q, k, v, blockmap, backend: str):
  """`maskc.attention` under the layer's BlockMap; q `[B, L, H, D]`, k/v `[B, L, Hkv, D]`.

  The BlockMap was compiled with the operands (segment ids) and carries them.
  """
  return maskc.attention(q, k, v, blockmap, backend=backend)


def _norm(x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def forward(params, tokens, cfg: ModelConfig, blockmaps, backend: str = "auto"):
  """Logits `[B, L, vocab]` for `tokens` `[B, L]`; the documents are in the BlockMaps."""
  b, length = tokens.shape
  hd = cfg.head_dim
  x = params["embed"][tokens]
  for i, layer in enumerate(params["layers"]):
    h = _norm(x)
    q = (h @ layer["wq"]).reshape(b, length, cfg.heads, hd)
    k = (h @ layer["wk"]).reshape(b, length, cfg.kv_heads, hd)
    v = (h @ layer["wv"]).reshape(b, length, cfg.kv_heads, hd)
    o = attend(q, k, v, blockmaps[i], backend)
    x = x + o.reshape(b, length, cfg.heads * hd) @ layer["wo"]
    x = x + jax.nn.gelu(_norm(x) @ layer["w1"]) @ layer["w2"]
  return _norm(x) @ params["embed"].T


def loss_fn(params, tokens, seg, cfg: ModelConfig, blockmaps, backend: str = "auto"):
  """Next-token cross entropy, not across document boundaries."""
  logits = forward(params, tokens, cfg, blockmaps, backend)[:, :-1]
  targets = tokens[:, 1:]
  same_doc = (seg[:, 1:] == seg[:, :-1]).astype(jnp.float32)
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
  return jnp.sum(nll * same_doc) / jnp.maximum(jnp.sum(same_doc), 1.0)


def run(config: Any = CONFIG, *, batch: int = 2, length: int = 32, backend: str = "auto",
        seed: int = 0, **params: Any):
  """Loads the mask config, builds the model and runs one forward and backward pass.

  Returns:
    (loss, grads, model config, block maps).
  """
  masks = maskc.load_config(config, **params)
  cfg = ModelConfig(masks=masks)
  rng = np.random.default_rng(seed)
  params_ = init_params(rng, cfg)
  tokens = rng.integers(0, cfg.vocab, (batch, length), dtype=np.int32)
  # Two packed documents per row, split at a different place in each row.
  seg = (np.arange(length)[None, :] >= (length * (np.arange(batch)[:, None] + 2)) // (batch + 3))
  seg = seg.astype(np.int32)
  blockmaps = masks.compile(length, block_q=cfg.tile, block_kv=cfg.tile, operands={"seg": seg})
  # The documents and block maps are fixed for this batch: close over them as constants.
  grad_fn = jax.jit(jax.value_and_grad(
      lambda p, t: loss_fn(p, t, seg, cfg, blockmaps, backend)))
  loss, grads = grad_fn(params_, tokens)
  return loss, grads, cfg, blockmaps


def main() -> None:
  loss, grads, cfg, blockmaps = run()
  print(cfg.masks)
  print(f"distinct block maps: {len({id(b) for b in blockmaps})} for {len(blockmaps)} layers")
  print("layer 0 tiles:\n" + np.array2string(np.asarray(blockmaps[0].grid)))
  norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
  print(f"loss {float(loss):.4f}, gradient norm {float(norm):.4f}")


if __name__ == "__main__":
  main()
