"""Masks from MaxText configs: `from_maxtext`.

`from_maxtext(config)` reads a MaxText config (its keys as `configs/base.yml` and the model
files spell them) and returns a `MaskConfig` whose layers hold the masks MaxText's
`AttentionOp` builds (MaxText 0.2.5, `layers/attention_op.py`): the layer kinds come from
the decoder block's own pattern (`gemma3.get_attention_type`, `gpt_oss`, `olmo3`, Llama 4's
NoPE interval, DeepSeek-V4's `compress_ratios`), the sizes from `sliding_window_size`,
`chunk_attn_window_size` and `causal_block_size`. MaxText is not imported.

MaxText computes a layer's mask in one of two ways, and they differ:

- the dot-product path (`attention: dot_product`, and `autoselected` on CPU, for short
  sequences and decoding): `generate_attention_mask`. Packed documents:
  `seg[q] == seg[k] & seg[k] >= 0` (a negative segment id attends to nothing); image
  spans (`bidirectional_mask`, Gemma 3 and 4) are OR-ed in last, across windows and
  documents alike; with load-balanced context parallelism every position term reads
  `decoder_positions` (the per-document positions), so chunks and diffusion blocks restart
  with each packed document.
- the splash path (`attention: flash` on TPU): splash's mask classes and `SegmentIds`.
  Packed documents: `seg[q] == seg[k]` only (equal negative ids attend to each other);
  `bidirectional_mask` is not applied at all; load-balanced layouts permute the rows and
  keep the index positions, so chunks follow the packed sequence, not its documents.

The operands are MaxText's own inputs: `decoder_segment_ids` (`[B, L]`),
`bidirectional_mask` (`[B, L]` bool, image tokens), `decoder_positions` (`[B, L]`, for the
dot-product path under load-balanced context parallelism); for compressed layers
(DeepSeek-V4) `decoder_segment_ids_kv` (`[B, L + C]`: the segment of each key, compressed
blocks `-1` when they straddle documents), `local_kv_len` (scalar: L, where the compressed
keys start) and, on the splash path, `pad_kv_total` (scalar: padding keys between the two).
Compressed layers are compiled at `q_len = L`, `kv_len = L + (padding) + C` with
`q_offset=0`.

Load-balanced context parallelism (`context_parallel_load_balance` with a context axis over
1) is MaxText's DUAL_CHUNK_SWAP order, maskc's `zigzag` layout: the config's
`context_parallel` says so, and `maskc.parallel.maxtext_layout` builds the `maskc.Layout`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from maskc.config.files import read_config
from maskc.config.model import MaskConfig, load_config
from maskc.language.errors import ConfigError, short_repr

MAXTEXT_VERSION = "0.2.5"  # the attention_op.py these masks were read from

SEGMENT_IDS = "decoder_segment_ids"
SEGMENT_IDS_KV = "decoder_segment_ids_kv"
IMAGES = "bidirectional_mask"
POSITIONS = "decoder_positions"
LOCAL_KV_LEN = "local_kv_len"
PAD_KV_TOTAL = "pad_kv_total"
INDEXER_MASK = "indexer_mask"

PATHS = ("dot_product", "splash")

# configs/base.yml's values of the keys read here.
BASE = {
    "decoder_block": "llama2", "base_num_decoder_layers": 16, "attention": "autoselected",
    "attention_type": "global", "sliding_window_size": 0, "chunk_attn_window_size": 0,
    "causal_block_size": 32, "nope_layer_interval": -1, "use_multimodal": False,
    "compress_ratios": [], "use_indexer": False, "indexer_sparse_training": False,
    "indexer_loss_scaling_factor": 0.0, "hardware": "tpu", "context_parallel_load_balance": True,
    "context_parallel_strategy": "all_gather", "context_parallel_reorder_strategy": "auto",
    "ici_context_parallelism": 1, "dcn_context_parallelism": 1, "packing": True,
    "max_target_length": 2048,
}

GLOBAL, LOCAL, CHUNK, FULL, DIFFUSION, COMPRESSED = (
    "global", "local_sliding", "chunk", "full", "block_diffusion", "compressed")
# The definition each kind gets in the MaskConfig (`global` and `chunk` are prelude names).
_NAMES = {GLOBAL: "global_attention", LOCAL: "local_sliding_attention", CHUNK: "chunk_attention",
          FULL: "full_attention", DIFFUSION: "block_diffusion_attention"}

_GENERIC = ("default", "llama2", "mistral", "mixtral", "gemma", "gpt3", "qwen2", "qwen3",
            "qwen3_moe", "simple", "simple_mlp")
_PATTERNS = {
    "gemma3": (LOCAL,) * 5 + (GLOBAL,),
    "gemma4": (LOCAL,) * 5 + (GLOBAL,),
    "gpt_oss": (LOCAL, GLOBAL),
    "olmo3": (LOCAL,) * 3 + (GLOBAL,),
}
DECODER_BLOCKS = tuple(sorted(set(_GENERIC) | set(_PATTERNS) | {"gemma2", "llama4", "deepseek",
                                                                 "deepseek4"}))


@dataclasses.dataclass(frozen=True)
class _Layer:
  kind: str
  ratio: int = 0  # compressed layers: compress_ratio


class _Reader:
  def __init__(self, data: Mapping[str, Any], file: str | None):
    self.data, self.file = data, file

  def get(self, key: str) -> Any:
    value = self.data.get(key)
    return BASE.get(key) if value is None else value

  def error(self, message: str, key: str, hint: str | None = None) -> ConfigError:
    return ConfigError(message, path=key, file=self.file, hint=hint)

  def integer(self, key: str, minimum: int | None = None, why: str = "") -> int:
    value = self.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
      raise self.error(f"{key} must be an integer, got {short_repr(value)}", key)
    if minimum is not None and value < minimum:
      raise self.error(f"{key} must be >= {minimum}{why}, got {value}", key)
    return value

  def flag(self, key: str) -> bool:
    value = self.get(key)
    if not isinstance(value, bool):
      raise self.error(f"{key} must be true or false, got {short_repr(value)}", key)
    return value

  def choice(self, key: str, choices: Sequence[str]) -> str:
    value = self.get(key)
    if not isinstance(value, str) or value.lower() not in choices:
      raise self.error(f"{key} must be one of {', '.join(choices)}, got {short_repr(value)}", key)
    return value.lower()


def _layers(r: _Reader) -> list[_Layer]:
  """Each layer's attention kind, as MaxText's decoder builds them."""
  block = r.get("decoder_block")
  n = r.integer("num_decoder_layers" if r.data.get("num_decoder_layers") is not None
                else "base_num_decoder_layers", 1)
  configured = r.choice("attention_type", (GLOBAL, LOCAL, CHUNK, "mla", FULL, COMPRESSED,
                                           DIFFUSION))
  if block in _GENERIC:
    kinds = [GLOBAL] * n  # these blocks never pass attention_type: AttentionOp's GLOBAL
  elif block == "deepseek":
    kinds = [GLOBAL if configured == "mla" else configured] * n
  elif block in _PATTERNS:
    pattern = _PATTERNS[block]
    kinds = [pattern[i % len(pattern)] for i in range(n)]
  elif block == "gemma2":
    kinds = [LOCAL, GLOBAL] * n  # a MaxText Gemma 2 layer is a local and a global attention
  elif block == "llama4":
    every = r.integer("nope_layer_interval")
    kinds = [GLOBAL if every > 0 and (i + 1) % every == 0 else CHUNK for i in range(n)]
  elif block == "deepseek4":
    ratios = r.get("compress_ratios")
    if isinstance(ratios, str) or not isinstance(ratios, Sequence) or len(ratios) < n:
      raise r.error(f"compress_ratios must list a ratio for each of the {n} layers, got "
                    f"{short_repr(ratios)}", "compress_ratios")
    out = []
    for i, ratio in enumerate(ratios[:n]):
      if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 0:
        raise r.error(f"a compress ratio is an integer >= 0, got {short_repr(ratio)}",
                      f"compress_ratios[{i}]")
      out.append(_Layer(LOCAL) if ratio == 0 else _Layer(COMPRESSED, ratio))
    return out
  else:
    raise r.error(f"decoder_block {short_repr(block)} is not one maskc reads", "decoder_block",
                  hint=f"Supported: {', '.join(DECODER_BLOCKS)}. Others (linear-attention "
                       f"hybrids, per-model patterns such as gemma4_small) need their masks "
                       f"written with maskc.load_config.")
  if configured == DIFFUSION:  # _resolve_attention_type: block diffusion replaces GLOBAL
    kinds = [DIFFUSION if k == GLOBAL else k for k in kinds]
  if COMPRESSED in kinds:
    raise r.error("attention_type compressed needs a deepseek4 decoder block (compress_ratios)",
                  "attention_type")
  return [_Layer(k) for k in kinds]


def _path(r: _Reader, path: str | None, kinds: set[str]) -> str:
  if path is not None:
    if path not in PATHS:
      raise ConfigError(f"path must be one of {', '.join(PATHS)}, got {short_repr(path)}")
    return path
  kernel = r.choice("attention", ("autoselected", "dot_product", "flash", "cudnn_flash_te",
                                  "cudnn_flash_jax", "paged", "vllm_rpa", "vllm_batched_rpa"))
  hardware = r.choice("hardware", ("tpu", "gpu", "gpu_multiprocess", "cpu"))
  if kernel == "dot_product" or hardware == "cpu":
    return "dot_product"
  if kernel in ("flash", "autoselected") and hardware == "tpu":
    return "splash"
  if kernel in ("flash", "autoselected") and kinds <= {GLOBAL}:
    return "splash"  # GPU flash: causal & segment equality, as splash's global layers
  raise r.error(f"maskc does not model MaxText's {kernel} kernel on {hardware} for "
                f"{', '.join(sorted(kinds))} layers", "attention",
                hint="MaxText's GPU flash path masks every layer causal & segments, whatever its "
                     "attention type, and the cuDNN / paged kernels take their own masks. Pass "
                     "path='dot_product' or path='splash' for the masks of those paths.")


def _text(layer: _Layer, r: _Reader, path: str, segments: bool, images: bool,
          positions: bool) -> str:
  """One layer's mask, as MaxText builds it on `path`."""
  kind = layer.kind
  # position terms: under load-balanced CP the dot-product path reads segment positions
  q, k = (f"{POSITIONS}[q]", f"{POSITIONS}[k]") if positions else ("q", "k")
  if kind == GLOBAL:
    body = "causal" if not positions else f"{k} <= {q}"
  elif kind == LOCAL:
    w = r.integer("sliding_window_size", 1, " for local sliding layers")
    body = f"sliding({w})" if not positions else f"{q} - {w} < {k} & {k} <= {q}"
  elif kind == CHUNK:
    c = r.integer("chunk_attn_window_size", 1, " for chunked layers")
    body = f"causal & chunk({c})" if not positions else f"{k} <= {q} & {q} // {c} == {k} // {c}"
  elif kind == DIFFUSION:
    b = r.integer("causal_block_size", 1, " for block diffusion")
    body = f"{q} // {b} >= {k} // {b}"
  elif kind == FULL:
    body = "full"
  else:
    return _compressed(layer, r, path, segments)
  parts = [body]
  if segments:
    parts.append(f"document({SEGMENT_IDS})")
    if path == "dot_product":
      parts.append(f"{SEGMENT_IDS}[k] >= 0")
  if len(parts) > 1 and parts[0] == "full":
    parts = parts[1:]
  text = " & ".join(parts)
  if images:
    text = f"({text}) | bidirectional({IMAGES})"
  return text


def _compressed(layer: _Layer, r: _Reader, path: str, segments: bool) -> str:
  """A DeepSeek-V4 compressed layer: keys are the L tokens, then compressed blocks of R."""
  ratio = layer.ratio
  w = r.integer("sliding_window_size", 1, " for compressed layers' local window")
  local = f"k <= q & q - k < {w}"
  c = f"k - {LOCAL_KV_LEN}" if path == "dot_product" else f"k - {LOCAL_KV_LEN} - {PAD_KV_TOTAL}"
  sparse = (ratio == 4 and r.flag("use_indexer") and not (
      r.get("indexer_loss_scaling_factor") > 0 and not r.flag("indexer_sparse_training")))
  if sparse:  # CSA with its indexer: the selected compressed blocks, a runtime operand
    far = f"{c} >= 0 & {INDEXER_MASK}[q, k]"
  else:  # a block is seen once all its R tokens are at or before the query
    far = f"{c} >= 0 & {c} < (q + 1) // {ratio}"
  text = f"{local} | {far}"
  if segments:
    seg = f"{SEGMENT_IDS_KV}[q] == {SEGMENT_IDS_KV}[k]"
    if path == "dot_product":
      seg += f" & {SEGMENT_IDS_KV}[k] >= 0"
    text = f"({text}) & {seg}"
  return text


def _context_parallel(r: _Reader) -> dict[str, str] | None:
  shards = r.integer("ici_context_parallelism", 1) * r.integer("dcn_context_parallelism", 1)
  if shards <= 1:
    return None
  strategy = r.choice("context_parallel_strategy", ("all_gather", "ring", "ulysses", "usp"))
  if strategy not in ("all_gather", "ring"):
    raise r.error(f"context_parallel_strategy {strategy} has no maskc layout",
                  "context_parallel_strategy",
                  hint="Ulysses (and USP) exchange heads with an all-to-all: every device then "
                       "holds whole sequences. maskc.sharded_attention splits the sequence "
                       "(all_gather or ring).")
  if not r.flag("context_parallel_load_balance"):
    return {"layout": "contiguous", "strategy": strategy}
  order = r.choice("context_parallel_reorder_strategy", ("auto", "dual_chunk_swap", "striped"))
  if order == "auto":
    gpu = r.get("hardware") in ("gpu", "gpu_multiprocess")
    order = "striped" if r.flag("packing") and strategy == "ring" and gpu else "dual_chunk_swap"
  if order == "striped":
    raise r.error("the striped reorder puts token i on device i % cp: a layout of single "
                  "tokens, not of whole tiles", "context_parallel_reorder_strategy",
                  hint="Use dual_chunk_swap (maskc's zigzag), or load balance with "
                       "maskc.balance.")
  return {"layout": "zigzag", "strategy": strategy}


def maxtext_config_data(config: Any, *, path: str | None = None, segments: bool = True,
                        images: bool | None = None) -> dict[str, Any]:
  """The maskc config (`maskc.load_config`'s schema, as plain data) of a MaxText config.

  Arguments as in `from_maxtext`.
  """
  r = _reader(config)
  layers = _layers(r)
  kinds = {layer.kind for layer in layers}
  chosen = _path(r, path, kinds)
  block = r.get("decoder_block")
  if images is None:
    images = r.flag("use_multimodal") and block in ("gemma3", "gemma4")
  if images and block not in ("gemma3", "gemma4"):
    raise r.error(f"MaxText passes bidirectional_mask to gemma3 and gemma4 decoders only, not "
                  f"{block}", "decoder_block")
  cp = _context_parallel(r)
  positions = chosen == "dot_product" and cp is not None and cp["layout"] == "zigzag"
  definitions: dict[str, str] = {}
  names = []
  for layer in layers:
    name = _NAMES.get(layer.kind, f"compressed_attention_{layer.ratio}")
    # MaxText applies image spans on the dot-product path only; Gemma 4 in local layers only
    with_images = images and chosen == "dot_product" and (
        block == "gemma3" or layer.kind == LOCAL)
    definitions.setdefault(name, _text(layer, r, chosen, segments, with_images, positions))
    names.append(name)
  texts = " ".join(definitions.values())
  operands: dict[str, Any] = {}
  for name, kind, dtype in ((SEGMENT_IDS, "token", "int32"), (SEGMENT_IDS_KV, "token", "int32"),
                            (IMAGES, "token", "bool"), (POSITIONS, "token", "int32"),
                            (LOCAL_KV_LEN, "scalar", "int32"), (PAD_KV_TOTAL, "scalar", "int32"),
                            (INDEXER_MASK, "pair", "bool")):
    if f"{name}[" in texts or f"({name})" in texts or f" {name}" in texts:
      operands[name] = {"kind": kind, "dtype": dtype}
  period = next(p for p in range(1, len(names) + 1)
                if all(names[i] == names[i % p] for i in range(len(names))))
  data: dict[str, Any] = {"num_layers": len(names), "definitions": definitions,
                          "layers": {"pattern": names[:period]} if period < len(names) else names}
  if operands:
    data["operands"] = operands
  if cp is not None:
    data["context_parallel"] = cp
  return data


def _reader(config: Any) -> _Reader:
  file = None
  if isinstance(config, (str, os.PathLike)):
    data, file, _ = read_config(config, None)
  elif isinstance(config, Mapping):
    data = config
  elif callable(getattr(config, "get_keys", None)):
    data = config.get_keys()  # MaxText's pyconfig.HyperParameters
  else:
    raise ConfigError(f"from_maxtext takes a MaxText config (a mapping, a YAML path or "
                      f"pyconfig's HyperParameters), got {type(config).__name__}")
  if not isinstance(data, Mapping):
    raise ConfigError(f"a MaxText config is a mapping, got {type(data).__name__}", file=file)
  return _Reader(data, file)


def from_maxtext(config: Any, *, path: str | None = None, segments: bool = True,
                 images: bool | None = None) -> MaskConfig:
  """The attention masks of a MaxText model, one per layer.

  Args:
    config: MaxText's config: a mapping of its keys (missing ones take
      `configs/base.yml`'s values), a YAML file, or `pyconfig`'s `HyperParameters`.
    path: `"dot_product"` or `"splash"`: which of MaxText's two mask paths (module
      docstring). None: the one `attention` and `hardware` select (`flash` or
      `autoselected` on TPU: splash; `dot_product` or CPU: dot-product).
    segments: read packed documents (`decoder_segment_ids`), as MaxText's training does.
    images: read image spans (`bidirectional_mask`); None: `use_multimodal` on a Gemma 3 or
      Gemma 4 decoder.

  Returns:
    A `MaskConfig` whose `context_parallel` is the load-balanced layout (`zigzag`) when the
    config splits the sequence over a context axis.

  Raises:
    ConfigError: a decoder block, attention type, kernel or context-parallel strategy
      maskc does not model, or a missing window, chunk or block size; naming the field.

  >>> import maskc
  >>> cfg = maskc.config.from_maxtext({"decoder_block": "gemma3", "base_num_decoder_layers": 6,
  ...                                  "sliding_window_size": 1024}, segments=False)
  >>> [str(cfg.mask(i)).splitlines()[-1] for i in (0, 5)]
  ['local_sliding_attention', 'global_attention']
  >>> str(cfg.mask(0)).splitlines()[0]
  'local_sliding_attention = sliding(1024)'
  """
  return load_config(maxtext_config_data(config, path=path, segments=segments, images=images))
