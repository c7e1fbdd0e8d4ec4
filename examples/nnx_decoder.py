"""A small Flax NNX decoder whose attention layers take their masks from a config file.

Each layer is a `maskc.flax.Attention` whose mask comes from a `maskc.load_config` file:

- `gemma3.yaml`: five sliding-window layers to one global layer, image tokens
  bidirectional within their image in every layer (Gemma 3);
- `llama4.yaml`: three chunked layers to one global layer, all inside packed
  documents, one layer with per-head masks (Llama 4).

The model learns a toy language: each document is an arithmetic progression
`t[i + 1] = t[i] + s (mod vocab)` with its own start and step `s`, so predicting a
token needs the two before it. An image is a run of random tokens inside the text;
the progression resumes after it, so the first token after an image must look back
past the image. The script trains a few steps, then generates with the KV cache (a
prefill of the prompt, then one compiled step per token) and checks that the cached
decoding gives the logits of a full forward pass over the generated text.

    python examples/nnx_decoder.py                  # Gemma 3 style
    python examples/nnx_decoder.py --config llama4  # Llama 4 style

It needs the flax extra (`pip install -e ".[flax]"`) and runs on a CPU in under a
minute. `benchmarks/flax_decode.py` times its decode step against the same model
decoding with `jax.nn.dot_product_attention` and a dense mask.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import pathlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import maskc
from maskc.flax import Attention

HERE = pathlib.Path(__file__).parent
CONFIGS = {"gemma3": HERE / "gemma3.yaml", "llama4": HERE / "llama4.yaml"}
SUFFIXES = (".yaml", ".yml", ".json", ".toml")


def config_source(config: Any) -> Any:
  """What `maskc.load_config` reads for `config`: a named config's file, else `config` (a
  file or a mapping); a name that is neither is a `ConfigError` listing the configs."""
  if isinstance(config, str) and config in CONFIGS:
    return CONFIGS[config]
  if isinstance(config, str) and pathlib.Path(config).suffix.lower() not in SUFFIXES:
    guess = difflib.get_close_matches(config, CONFIGS, n=1)
    raise maskc.ConfigError(
        f"unknown config {config!r}",
        hint=(f"Did you mean `{guess[0]}`? " if guess else "") + "The configs are "
             f"{', '.join(CONFIGS)}; or give a config file ({', '.join(SUFFIXES)}).")
  return config

Array = jax.Array
Operands = Mapping[str, Any]
# attend(attention module, normed input, layer index) -> the attention's output: a hook
# that replaces the module's own call (benchmarks/flax_decode.py's dense baseline).
Attend = Callable[[Attention, Array, int], Array]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes of the decoder; `masks` gives each layer's mask and the heads per layer."""
  masks: maskc.MaskConfig
  vocab: int = 64
  d_model: int = 64
  kv_heads: int = 2  # key/value heads: GQA with the config's num_heads query heads
  tile: int = 16  # block_q = block_kv: small, so the block maps have structure at L = 64
  backend: str = "auto"  # maskc.attention's backend in every layer

  @property
  def heads(self) -> int:
    return self.masks.num_heads or 4

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads


def rope(x: Array, positions: Array, base: float = 10_000.0) -> Array:
  """Rotary embeddings of `x` `[B, L, H, D]` at `positions` `[B, L]` (halves rotated)."""
  half = x.shape[-1] // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions[..., None, None].astype(jnp.float32) * freq  # [B, L, 1, half]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


class Block(nnx.Module):
  """Pre-norm attention and MLP; the attention's mask is the config's mask of the layer."""

  def __init__(self, cfg: ModelConfig, layer: int, *, cache_window: Any, rngs: nnx.Rngs):
    d = cfg.d_model
    self.layer = layer
    self.attn_norm = nnx.RMSNorm(d, rngs=rngs)
    self.attn = Attention(cfg.heads, d, num_kv_heads=cfg.kv_heads, mask=cfg.masks.mask(layer),
                          rope=rope, use_bias=False, backend=cfg.backend, block_q=cfg.tile,
                          block_kv=cfg.tile, cache_window=cache_window, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, 4 * d, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(4 * d, d, use_bias=False, rngs=rngs)

  def __call__(self, x: Array, *, operands: Operands | None, decode: bool,
               attend: Attend | None = None) -> Array:
    h = self.attn_norm(x)
    if attend is None:
      h = self.attn(h, operands=operands, decode=decode)
    else:
      h = attend(self.attn, h, self.layer)
    x = x + h
    return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class Decoder(nnx.Module):
  """Token embedding (tied with the output), `num_layers` blocks, a final norm.

  Args:
    cfg: sizes and the mask config.
    cache_windows: ring sizes you vouch for, by layer (see `maskc.flax.Attention`'s
      `cache_window`); other layers read theirs from the compiled mask ("auto").
    rngs: parameter initialization keys.
  """

  def __init__(self, cfg: ModelConfig, *, cache_windows: Mapping[int, int] | None = None,
               rngs: nnx.Rngs):
    windows = dict(cache_windows or {})
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, i, cache_window=windows.get(i, "auto"), rngs=rngs)
                            for i in range(cfg.masks.num_layers)])
    self.norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)

  def __call__(self, tokens: Array, *, operands: Operands | None = None,
               decode: bool = False, attend: Attend | None = None) -> Array:
    """Logits `[B, L, vocab]` of `tokens` `[B, L]`; with `decode`, appended to the cache."""
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, operands=operands, decode=decode, attend=attend)
    logits: Array = self.embed.attend(self.norm(x))
    return logits

  def init_cache(self, batch: int, max_length: int, dtype: Any = jnp.float32) -> None:
    """An empty KV cache in every layer for `batch` sequences of up to `max_length` tokens."""
    for block in self.blocks:
      block.attn.init_cache((batch, max_length, self.cfg.d_model), dtype)


# ----------------------------------------------------------------------------- the data


@dataclasses.dataclass(frozen=True)
class Batch:
  """Token ids `[B, L]`, the mask's operands, and which targets the loss counts."""
  tokens: np.ndarray
  operands: dict[str, np.ndarray]
  weights: np.ndarray  # [B, L]: 1 where the token follows from the two text tokens before
  step: np.ndarray  # [B]: the step of each row's last document


def make_batch(rng: np.random.Generator, cfg: ModelConfig, batch: int, length: int) -> Batch:
  """Random rows of the toy language, with the operands the config declares.

  A boolean per-token operand marks one image span per row (4 to 8 random tokens); an
  integer one numbers packed documents (one to three per row). Each document is a
  progression with its own start and step; text resumes the progression after an image.
  """
  images = [o.name for o in cfg.masks.operands if o.kind == "token" and o.dtype == "bool"]
  documents = [o.name for o in cfg.masks.operands if o.kind == "token" and o.dtype != "bool"]
  tokens = np.zeros((batch, length), np.int32)
  weights = np.zeros((batch, length), np.float32)
  image = np.zeros((batch, length), bool)
  seg = np.zeros((batch, length), np.int32)
  steps = np.zeros(batch, np.int32)
  for b in range(batch):
    if documents:
      cuts = np.sort(rng.choice(np.arange(8, length - 8), rng.integers(0, 3), replace=False))
      seg[b] = np.searchsorted(cuts, np.arange(length), side="right")
    if images:
      start = rng.integers(2, length - 12)
      image[b, start:start + rng.integers(4, 9)] = True
    for doc in np.unique(seg[b]):
      text = np.flatnonzero((seg[b] == doc) & ~image[b])
      start, step = rng.integers(cfg.vocab), rng.integers(1, 4)
      tokens[b, text] = (start + step * np.arange(len(text))) % cfg.vocab
      weights[b, text[2:]] = 1.0
      steps[b] = step
    tokens[b, image[b]] = rng.integers(cfg.vocab, size=int(image[b].sum()))
  operands = {**{name: image for name in images}, **{name: seg for name in documents}}
  return Batch(tokens, operands, weights, steps)


def loss_fn(model: Decoder, tokens: Array, operands: Operands, weights: Array) -> Array:
  """Next-token cross entropy over the targets the batch's weights count."""
  logits = model(tokens, operands=operands)[:, :-1]
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  w = weights[:, 1:]
  return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


# ----------------------------------------------------------------------------- the run


@dataclasses.dataclass(frozen=True)
class Result:
  """What `run` measured."""
  losses: list[float]
  prompt: np.ndarray  # [B, P]
  generated: np.ndarray  # [B, N]
  accuracy: float  # generated tokens that continue the last document's progression
  decode_error: float  # max |decoded logits - full-forward logits| over generated rows
  seconds: float
  windows: list[int | None]  # each layer's ring size (None: the full cache)


def continues(prompt: np.ndarray, generated: np.ndarray, step: np.ndarray, vocab: int) -> float:
  """The fraction of generated tokens that are the previous token plus the row's step."""
  previous = np.concatenate([prompt[:, -1:], generated[:, :-1]], axis=1)
  return float(np.mean(generated == (previous + step[:, None]) % vocab))


def run(config: Any = "gemma3", *, steps: int = 120, batch: int = 8, length: int = 64,
        prompt: int = 40, generate: int = 16, learning_rate: float = 3e-3, seed: int = 0,
        **params: Any) -> Result:
  """Trains the decoder `steps` steps, then generates `generate` tokens after a prompt.

  Args:
    config: "gemma3", "llama4", or a config file or mapping for `maskc.load_config`.
    params: overrides of the config's parameters (`W=32`).
  """
  t0 = time.perf_counter()
  masks = maskc.load_config(config_source(config), **params)
  cfg = ModelConfig(masks=masks)
  rng = np.random.default_rng(seed)
  model = Decoder(cfg, rngs=nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)

  @nnx.jit
  def train_step(model: Decoder, optimizer: nnx.Optimizer, tokens: Array, operands: Operands,
                 weights: Array) -> Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, operands, weights)
    optimizer.update(model, grads)
    return loss

  losses = []
  for _ in range(steps):
    data = make_batch(rng, cfg, batch, length)
    losses.append(float(train_step(model, optimizer, data.tokens, data.operands,
                                   data.weights)))

  # Generation: prefill the prompt (its operands go into the cache), then one compiled
  # step per token. Generated tokens are text of the prompt's last document.
  data = make_batch(rng, cfg, batch, prompt)
  model.init_cache(batch, prompt + generate)
  # Donating the model lets each step write its cache in place instead of copying it.
  prefill = nnx.jit(lambda m, t, ops: m(t, operands=ops, decode=True), donate_argnums=0)
  step = nnx.jit(lambda m, t: m(t, decode=True), donate_argnums=0)
  logits = [prefill(model, data.tokens, data.operands)[:, -1]]
  out = []
  for _ in range(generate):
    out.append(jnp.argmax(logits[-1], axis=-1).astype(jnp.int32))
    if len(out) < generate:
      logits.append(step(model, out[-1][:, None])[:, 0])
  generated = np.stack([np.asarray(t) for t in out], axis=1)

  # The law: cached decoding gives the full forward's logits at the generated rows.
  tokens = np.concatenate([data.tokens, generated], axis=1)
  operands = {name: np.concatenate(
      [value, np.repeat(np.zeros_like(value[:, -1:]) if value.dtype == bool else value[:, -1:],
                        generate, axis=1)], axis=1) for name, value in data.operands.items()}
  full = nnx.jit(lambda m, t, ops: m(t, operands=ops))(model, tokens, operands)
  decoded = jnp.stack(logits, axis=1)
  error = float(jnp.max(jnp.abs(decoded - full[:, prompt - 1:prompt + generate - 1])))
  return Result(losses, data.tokens, generated,
                continues(data.tokens, generated, data.step, cfg.vocab), error,
                time.perf_counter() - t0, [b.attn.window for b in model.blocks])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="gemma3",
                      help=f"{', '.join(CONFIGS)}, or a config file (default gemma3)")
  parser.add_argument("--steps", type=int, default=120, help="training steps (default 120)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  try:
    result = run(args.config, steps=args.steps, seed=args.seed)
  except maskc.MaskError as e:  # an unknown config, or a config file that does not load
    parser.exit(1, f"{parser.prog}: error: {e}\n")
  print(maskc.load_config(config_source(args.config)))
  print("KV cache per layer: " + ", ".join(
      "full" if w is None else f"ring of {w}" for w in result.windows))
  print(f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} in {len(result.losses)} steps")
  print(f"generated (row 0): {result.prompt[0, -4:].tolist()} -> "
        f"{result.generated[0].tolist()}")
  print(f"generated tokens that continue their progression: {result.accuracy:.0%}")
  print(f"cached decoding vs full forward, max |logit difference|: {result.decode_error:.2e}")
  print(f"{result.seconds:.1f} s")


if __name__ == "__main__":
  main()
