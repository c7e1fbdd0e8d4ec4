"""Masks from Hugging Face transformers configs: `from_hf` and `hf_operands`.

`from_hf(config)` reads a transformers `PretrainedConfig` (or its `to_dict()`, or a
`config.json`) and returns a `MaskConfig` whose layers hold the masks transformers'
`masking_utils` builds for that model (transformers 5.24): the layer kinds come from
`layer_types` or from the older fields each family still reads (`sliding_window_pattern`,
`use_sliding_window` / `max_window_layers`, `no_rope_layers`, `global_attn_every_n_layers`),
with the family's own defaults for missing keys. transformers is not imported: the config is
plain data.

The masks read the model's own inputs, so a user binds what the model already receives:

- `attention_mask` (`[B, L]`, 1 at real tokens): padding. transformers' sdpa, eager and flex
  paths mask padded *keys* only (a padding query row still sees the real keys before it);
  its flash-attention path drops padding tokens altogether. The masks here follow the
  first (the masks `masking_utils` materializes): the two differ only on the rows of
  padding tokens, whose outputs no loss reads.
- `sequence_ids`, derived from `position_ids`: packed sequences. transformers detects them
  where `position_ids` restart (a step other than +1) and only when no `attention_mask` is
  given; then it evaluates each layer's mask at the positions instead of the indices and
  keeps every token inside its sequence.
- `positions` (the positions where packed, else the indices) and `left_padding` (leading
  padding tokens per row): chunked layers start their chunks there, as transformers does.
- `image_tokens`, derived from `token_type_ids == 1`: Gemma 3's image spans, which attend
  to themselves bidirectionally.

`hf_operands(cfg, attention_mask=..., position_ids=..., token_type_ids=...)` derives every
operand a config's masks read from those inputs alone, exactly as transformers does.

A config whose attention maskc cannot express, or which transformers' own attention paths
read differently, raises `ConfigError` naming the field: never a silent full mask.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from maskc.config.files import read_config
from maskc.config.model import MaskConfig, load_config
from maskc.language.errors import ConfigError, OperandError, short_repr

TRANSFORMERS_VERSION = "5.24.0"  # the masking_utils these masks were checked against

# Operand names: transformers' own input names, and the arrays derived from them.
ATTENTION_MASK = "attention_mask"
SEQUENCE_IDS = "sequence_ids"
POSITIONS = "positions"
LEFT_PADDING = "left_padding"
IMAGE_TOKENS = "image_tokens"

# The layer kinds transformers' `layer_types` name, as `from_hf` names the definitions.
FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
_KNOWN_KINDS = (FULL, SLIDING, CHUNKED)


@dataclasses.dataclass(frozen=True)
class _Model:
  """What one model's masks depend on, read from its config."""
  family: str
  kinds: tuple[str, ...]  # per layer: FULL, SLIDING or CHUNKED
  window: int | None = None  # sliding_window, in tokens (the query included)
  chunk: int | None = None  # attention_chunk_size
  encoder: bool = False  # bidirectional full layers; sliding layers are |q - k| <= window
  bidirectional: bool = False  # Gemma 3 use_bidirectional_attention (embedding models)
  images: bool = False  # Gemma 3 multimodal: image spans attend bidirectionally
  packing: bool = True  # transformers detects packed sequences for this model


# ----------------------------------------------------------------------------- reading configs


class _Reader:
  """Reads fields of one config dict, naming the key path in errors."""

  def __init__(self, data: Mapping[str, Any], root: str, file: str | None):
    self.data, self.root, self.file = data, root, file

  def where(self, key: str) -> str:
    return f"{self.root}.{key}" if self.root else key

  def error(self, message: str, key: str, hint: str | None = None) -> ConfigError:
    return ConfigError(message, path=self.where(key), file=self.file, hint=hint)

  def get(self, key: str, default: Any = None) -> Any:
    value = self.data.get(key, default)
    return default if value is None and default is not None else value

  def integer(self, key: str, default: int | None, minimum: int = 1) -> int | None:
    value = self.data.get(key, default)
    if value is None:
      return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
      raise self.error(f"{key} must be an integer >= {minimum} or null, got "
                       f"{short_repr(value)}", key)
    return int(value)

  def flag(self, key: str, default: bool) -> bool:
    value = self.data.get(key, default)
    if value is None:
      return default
    if not isinstance(value, bool):
      raise self.error(f"{key} must be true or false, got {short_repr(value)}", key)
    return value

  def layer_types(self, n: int) -> tuple[str, ...] | None:
    value = self.data.get("layer_types")
    if value is None:
      return None
    if isinstance(value, str) or not isinstance(value, Sequence):
      raise self.error(f"layer_types must be a list, got {short_repr(value)}", "layer_types")
    if len(value) != n:
      raise self.error(f"layer_types lists {len(value)} layers but num_hidden_layers is {n}",
                       "layer_types")
    for i, kind in enumerate(value):
      if kind not in _KNOWN_KINDS:
        raise self.error(
            f"layer type {short_repr(kind)} has no maskc mask",
            f"layer_types[{i}]",
            hint=f"maskc reads {', '.join(_KNOWN_KINDS)}; transformers builds the other kinds "
                 f"(linear, recurrent, compressed or indexed attention) with state or scores "
                 f"a mask cannot hold.")
    return tuple(value)

  def num_layers(self, default: int) -> int:
    n = self.integer("num_hidden_layers", default)
    assert n is not None
    return n


def _pattern(n: int, period: int) -> tuple[str, ...]:
  """transformers' old pattern fields: every `period`-th layer is full, the rest sliding."""
  return tuple(SLIDING if (i + 1) % period else FULL for i in range(n))


def _check_causal(r: _Reader) -> None:
  # `is_causal: false` makes `create_causal_mask` build a bidirectional mask, but the
  # attention modules keep `is_causal=True`, so sdpa without padding (the mask skipped)
  # runs causal while eager runs bidirectional: transformers gives no single mask.
  if r.data.get("is_causal") is False:
    raise r.error("is_causal is false on a decoder", "is_causal",
                  hint="transformers' attention paths disagree here: its eager path masks "
                       "bidirectionally, its sdpa path without padding runs causal. Drop the "
                       "field, or write the masks with maskc.load_config.")


def _sliding_kinds(r: _Reader, n: int, window: int | None, default: Callable[[], tuple[str, ...]],
                   window_key: str = "sliding_window") -> tuple[str, ...]:
  kinds = r.layer_types(n) or default()
  if SLIDING in kinds and window is None:
    raise r.error(f"layer {kinds.index(SLIDING)} is a sliding layer but {window_key} is null",
                  window_key, hint=f"Set {window_key} to the window in tokens.")
  if CHUNKED in kinds:
    raise r.error(f"layer {kinds.index(CHUNKED)} is a chunked layer, which this model has not",
                  f"layer_types[{kinds.index(CHUNKED)}]",
                  hint="Only Llama 4 has chunked attention layers in transformers.")
  return kinds


def _llama(r: _Reader) -> _Model:
  _check_causal(r)
  n = r.num_layers(32)
  return _Model("llama", (FULL,) * n)


def _gemma(r: _Reader) -> _Model:
  _check_causal(r)
  return _Model("gemma", (FULL,) * r.num_layers(28))


def _mistral(r: _Reader, family: str, default_window: int | None) -> _Model:
  # Mistral and Mixtral give every layer the same mask; they ignore `layer_types`.
  _check_causal(r)
  n = r.num_layers(32)
  window = r.integer("sliding_window", default_window)
  return _Model(family, ((SLIDING if window is not None else FULL),) * n, window=window)


def _qwen(r: _Reader, family: str) -> _Model:
  _check_causal(r)
  n = r.num_layers(32)
  use = r.flag("use_sliding_window", False)
  window = r.integer("sliding_window", 4096) if use else None
  first = r.integer("max_window_layers", 28, minimum=0)
  assert first is not None

  def default() -> tuple[str, ...]:
    return tuple(SLIDING if window is not None and i >= first else FULL for i in range(n))

  kinds = r.layer_types(n) or default()
  if SLIDING in kinds and window is None:
    raise r.error(f"layer {kinds.index(SLIDING)} is a sliding layer but use_sliding_window is "
                  f"false", "use_sliding_window",
                  hint="transformers sets sliding_window to null without use_sliding_window, "
                       "and then cannot build the sliding layers' mask.")
  return _Model(family, _sliding_kinds(r, n, window, default), window=window)


def _gemma2(r: _Reader) -> _Model:
  _check_causal(r)
  if r.data.get("use_bidirectional_attention"):
    raise r.error("use_bidirectional_attention is true on Gemma 2", "use_bidirectional_attention",
                  hint="transformers' Gemma 2 masks stay causal while its attention modules run "
                       "with is_causal=False when sdpa skips the mask (no padding): its paths "
                       "disagree. Gemma 3 supports the flag.")
  n = r.num_layers(26)
  window = r.integer("sliding_window", 4096)
  kinds = _sliding_kinds(r, n, window, lambda: _pattern(n, 2))
  return _Model("gemma2", kinds, window=window)


def _gemma3_text(r: _Reader, images: bool = False) -> _Model:
  _check_causal(r)
  n = r.num_layers(26)
  window = r.integer("sliding_window", 4096)
  bidirectional = r.flag("use_bidirectional_attention", False)
  if bidirectional and window is not None:
    window = window // 2 + 1  # Gemma3TextConfig.__post_init__: an exclusive half window
  period = r.integer("sliding_window_pattern", 6)
  assert period is not None
  kinds = _sliding_kinds(r, n, window, lambda: _pattern(n, period))
  return _Model("gemma3" if images else "gemma3_text", kinds, window=window,
                bidirectional=bidirectional, images=images)


def _llama4_text(r: _Reader) -> _Model:
  _check_causal(r)
  n = r.num_layers(48)
  chunk = r.integer("attention_chunk_size", 8192)
  interval = r.integer("no_rope_layer_interval", 4)
  assert interval is not None
  no_rope = r.get("no_rope_layers")
  if not no_rope:
    no_rope = [int((i + 1) % interval != 0) for i in range(n)]
  if isinstance(no_rope, str) or not isinstance(no_rope, Sequence) or len(no_rope) != n:
    raise r.error(f"no_rope_layers must list one 0 or 1 per layer, got {short_repr(no_rope)}",
                  "no_rope_layers")
  kinds = r.layer_types(n) or tuple(CHUNKED if flag and chunk is not None else FULL
                                    for flag in no_rope)
  if SLIDING in kinds:
    raise r.error(f"layer {kinds.index(SLIDING)} is a sliding layer, which Llama 4 has not",
                  f"layer_types[{kinds.index(SLIDING)}]")
  if CHUNKED in kinds and chunk is None:
    raise r.error(f"layer {kinds.index(CHUNKED)} is a chunked layer but attention_chunk_size is "
                  f"null", "attention_chunk_size",
                  hint="Set attention_chunk_size to the chunk in tokens.")
  return _Model("llama4_text", kinds, chunk=chunk)


def _gpt_oss(r: _Reader) -> _Model:
  _check_causal(r)
  n = r.num_layers(36)
  window = r.integer("sliding_window", 128)
  # GptOssModel passes no position_ids to its mask functions: packing is never detected.
  return _Model("gpt_oss", _sliding_kinds(r, n, window, lambda: _pattern(n, 2)), window=window,
                packing=False)


def _cohere2(r: _Reader) -> _Model:
  _check_causal(r)
  n = r.num_layers(40)
  window = r.integer("sliding_window", 4096)
  period = r.integer("sliding_window_pattern", 4)
  assert period is not None
  return _Model("cohere2", _sliding_kinds(r, n, window, lambda: _pattern(n, period)),
                window=window)


def _modernbert(r: _Reader) -> _Model:
  n = r.num_layers(22)
  local = r.integer("local_attention", 128)
  every = r.integer("global_attn_every_n_layers", 3)
  assert every is not None
  # ModernBertConfig.sliding_window is local_attention // 2: keys within that distance.
  window = None if local is None else local // 2
  kinds = r.layer_types(n) or tuple(SLIDING if i % every else FULL for i in range(n))
  if SLIDING in kinds and window is None:
    raise r.error("a sliding layer needs local_attention", "local_attention")
  if CHUNKED in kinds:
    raise r.error(f"layer {kinds.index(CHUNKED)} is a chunked layer, which ModernBERT has not",
                  f"layer_types[{kinds.index(CHUNKED)}]")
  return _Model("modernbert", kinds, window=window, encoder=True, packing=False)


def _bert(r: _Reader, family: str) -> _Model:
  n = r.num_layers(12)
  # A BERT decoder (`is_decoder`) is causal; neither reads position_ids for packing.
  return _Model(family, (FULL,) * n, encoder=not r.flag("is_decoder", False), packing=False)


_TEXT_FAMILIES: dict[str, Callable[[_Reader], _Model]] = {
    "llama": _llama,
    "gemma": _gemma,
    "mistral": lambda r: _mistral(r, "mistral", 4096),
    "mixtral": lambda r: _mistral(r, "mixtral", None),
    "qwen2": lambda r: _qwen(r, "qwen2"),
    "qwen3": lambda r: _qwen(r, "qwen3"),
    "gemma2": _gemma2,
    "gemma3_text": _gemma3_text,
    "llama4_text": _llama4_text,
    "gpt_oss": _gpt_oss,
    "cohere2": _cohere2,
    "modernbert": _modernbert,
    "bert": lambda r: _bert(r, "bert"),
    "roberta": lambda r: _bert(r, "roberta"),
}
# Composite (multimodal) configs: their text model's config sits under `text_config`.
_COMPOSITE = {"gemma3": "gemma3_text", "llama4": "llama4_text"}
FAMILIES = tuple(sorted(set(_TEXT_FAMILIES) | set(_COMPOSITE)))


def _read_model(config: Any) -> tuple[_Model, str | None]:
  """The model's mask facts, and the file it came from."""
  file = None
  if isinstance(config, (str, os.PathLike)):
    data, file, _ = read_config(config, None)
  elif isinstance(config, Mapping):
    data = config
  elif callable(getattr(config, "to_dict", None)):
    data = config.to_dict()  # a transformers PretrainedConfig, read as its dict
  else:
    raise ConfigError(f"from_hf takes a transformers config, its to_dict() or a config.json "
                      f"path, got {type(config).__name__}")
  if not isinstance(data, Mapping):
    raise ConfigError(f"a transformers config is a mapping, got {type(data).__name__}", file=file)
  r = _Reader(data, "", file)
  model_type = data.get("model_type")
  if model_type in _COMPOSITE:
    text = data.get("text_config") or {}
    if not isinstance(text, Mapping):
      raise r.error(f"text_config must be a mapping, got {short_repr(text)}", "text_config")
    inner = text.get("model_type", _COMPOSITE[model_type])
    if inner != _COMPOSITE[model_type]:
      raise r.error(f"a {model_type} config's text model is {_COMPOSITE[model_type]}, got "
                    f"{short_repr(inner)}", "text_config.model_type")
    sub = _Reader(text, "text_config", file)
    if model_type == "gemma3":
      return _gemma3_text(sub, images=True), file
    return dataclasses.replace(_llama4_text(sub), family=model_type), file
  family = _TEXT_FAMILIES.get(model_type) if isinstance(model_type, str) else None
  if family is None:
    raise r.error(f"model_type {short_repr(model_type)} is not a family maskc reads", "model_type",
                  hint=f"Supported: {', '.join(FAMILIES)}. For another model, write its masks "
                       f"with maskc.load_config.")
  return family(r), file


# ----------------------------------------------------------------------------- masks as text


def _layer_text(model: _Model, kind: str, padding: bool, packing: bool) -> str:
  """The maskc text of one layer kind, as transformers' masking_utils builds it."""
  packing = packing and model.packing
  if model.encoder:  # create_bidirectional_mask / create_bidirectional_sliding_window_mask
    parts = ["full" if kind == FULL else "abs(q - k) <= W"]
  elif model.bidirectional:
    # Gemma 3 embedding models: full layers are causal | true, sliding layers
    # sliding | |q - k| < window, both through create_causal_mask (so packing applies).
    parts = ["full" if kind == FULL else "abs(q - k) < W"]
  elif kind == CHUNKED:
    # chunked_overlay: (k - left_padding) // C == (q - left_padding) // C, at the packed
    # positions when transformers detected packing.
    pos_q, pos_k = (f"{POSITIONS}[q]", f"{POSITIONS}[k]") if packing else ("q", "k")
    if padding:
      pos_q, pos_k = f"({pos_q} - {LEFT_PADDING})", f"({pos_k} - {LEFT_PADDING})"
    if not padding and not packing:
      parts = ["causal & chunk(C)"]
    else:
      parts = ["causal", f"{pos_q} // C == {pos_k} // C"]
  elif model.images:
    # Gemma 3 with images: full layers OR the image blocks into the causal mask; sliding
    # layers AND the window's lower edge after that OR (create_masks_for_vision_model).
    block = f"(causal | bidirectional({IMAGE_TOKENS}))"
    parts = [block] if kind == FULL else [block, "q - W < k"]
  else:
    parts = ["causal" if kind == FULL else "sliding(W)"]
  if packing:
    parts.append(f"document({SEQUENCE_IDS})")
  if padding:
    parts.append(f"{ATTENTION_MASK}[k]")
  if len(parts) > 1 and parts[0] == "full":
    parts = parts[1:]
  return " & ".join(parts)


def _period(items: Sequence[str]) -> int:
  """The shortest p with items[i] == items[i % p] for every i."""
  n = len(items)
  return next(p for p in range(1, n + 1) if all(items[i] == items[i % p] for i in range(n)))


def hf_config_data(config: Any, *, padding: bool = True, packing: bool = True) -> dict[str, Any]:
  """The maskc config (`maskc.load_config`'s schema, as plain data) of a transformers config.

  What `from_hf` loads and `maskc config --from-hf` prints. Arguments as in `from_hf`.
  """
  model, _ = _read_model(config)
  kinds = sorted(set(model.kinds), key=_KNOWN_KINDS.index)
  definitions = {kind: _layer_text(model, kind, padding, packing) for kind in kinds}
  params = {}
  if SLIDING in kinds and model.window is not None:
    params["W"] = model.window
  if CHUNKED in kinds and model.chunk is not None:
    params["C"] = model.chunk
  operands: dict[str, Any] = {}
  texts = " ".join(definitions.values())
  for name, kind, dtype in ((ATTENTION_MASK, "token", "bool"), (SEQUENCE_IDS, "token", "int32"),
                            (POSITIONS, "token", "int32"), (LEFT_PADDING, "scalar", "int32"),
                            (IMAGE_TOKENS, "token", "bool")):
    if name in texts:
      operands[name] = {"kind": kind, "dtype": dtype}
  period = _period(model.kinds)
  layers: Any = list(model.kinds)
  if period < len(model.kinds):
    layers = {"pattern": list(model.kinds[:period])}
  data: dict[str, Any] = {"num_layers": len(model.kinds)}
  if params:
    data["params"] = params
  data["definitions"] = definitions
  data["layers"] = layers
  if operands:
    data["operands"] = operands
  return data


def from_hf(config: Any, *, padding: bool = True, packing: bool = True) -> MaskConfig:
  """The attention masks of a Hugging Face transformers model, one per layer.

  Args:
    config: a transformers `PretrainedConfig`, its `to_dict()`, or the path of a
      `config.json`. Missing keys take the family's transformers defaults.
    padding: read padding from `attention_mask` (`[B, L]`, 1 at real tokens). False
      gives masks for inputs without padding.
    packing: read packed sequences (from `position_ids`, as transformers detects them).
      False gives masks for one sequence per row.

  Returns:
    A `MaskConfig`: `cfg.mask(i)` is layer i's mask, named after transformers' layer
    type (`full_attention`, `sliding_attention`, `chunked_attention`); `cfg.operands`
    are the inputs it reads, which `hf_operands` derives from the model's inputs.

  Raises:
    ConfigError: a family maskc does not read, a layer type with no maskc mask, or a
      field transformers' own attention paths read differently; naming the field.

  >>> import maskc
  >>> cfg = maskc.config.from_hf({"model_type": "gpt_oss", "num_hidden_layers": 4},
  ...                            padding=False, packing=False)
  >>> [str(cfg.mask(i)).splitlines()[-1] for i in range(2)]
  ['sliding_attention', 'full_attention']
  >>> str(cfg.mask(0)).splitlines()[0]
  'sliding_attention = sliding(128)'
  """
  data = hf_config_data(config, padding=padding, packing=packing)
  return load_config(data)


# ----------------------------------------------------------------------------- operands


def _as_array(name: str, value: Any, ndim: tuple[int, ...], kinds: str = "biu") -> np.ndarray:
  try:
    arr = np.asarray(value)
  except Exception as e:  # a tensor on an accelerator, or not array-like
    raise OperandError(f"{name} must be array-like (NumPy, or a CPU tensor), got "
                       f"{type(value).__name__}: {e}") from None
  if arr.ndim not in ndim or arr.dtype.kind not in kinds:
    raise OperandError(f"{name} must be an integer or bool array of rank "
                       f"{' or '.join(map(str, ndim))}, got shape {arr.shape} dtype {arr.dtype}")
  return arr


def hf_operands(cfg: MaskConfig, attention_mask: Any = None, position_ids: Any = None,
                token_type_ids: Any = None, *, use_cache: bool = False,
                length: int | None = None, batch: int | None = None) -> dict[str, np.ndarray]:
  """Every operand `cfg`'s masks read, from the inputs a transformers model receives.

  As transformers derives them: `sequence_ids` numbers the packed sequences, found where
  `position_ids` do not step by +1, and only when there is neither an `attention_mask` nor
  a KV cache (transformers looks for packing only then, as in training); `positions` are
  the packed positions where packed, else the indices; `left_padding` counts each row's
  leading zeros of `attention_mask`; `image_tokens` is `token_type_ids == 1`. An input the
  config's masks do not read is ignored (`position_ids` of an encoder, whose masks never
  read packing; those of a config built with `packing=False`), except padding, which every
  family reads: padding for a config built with `padding=False` is refused.

  Args:
    cfg: a config from `from_hf`.
    attention_mask: `[B, L]`, 1 (or True) at real tokens, 0 at padding; None: no padding.
    position_ids: `[B, L]`, `[1, L]` or `[L]`; None: `0 .. L-1`.
    token_type_ids: `[B, L]`; 1 marks image tokens (Gemma 3).
    use_cache: the model runs with a KV cache (`use_cache=True`, transformers' default
      outside training): transformers then never detects packed sequences.
    length, batch: L and B when no input gives them.

  Returns:
    NumPy arrays by operand name, batched `[B, L]` (`left_padding`: `[B]`), for
    `cfg.compile(L, operands=...)` or `maskc.attention(..., operands=...)`.

  Raises:
    OperandError: inputs of mismatched shapes or values, or padding for a config built
      with `padding=False`.
  """
  needs = {d.name for d in cfg.operands}
  am = None if attention_mask is None else _as_array(ATTENTION_MASK, attention_mask, (2,), "biuf")
  pos = None if position_ids is None else _as_array("position_ids", position_ids, (1, 2))
  tt = None if token_type_ids is None else _as_array("token_type_ids", token_type_ids, (2,))
  shapes = [a.shape for a in (am, tt) if a is not None]
  if pos is not None:
    shapes.append(((pos.shape[0] if pos.ndim == 2 and pos.shape[0] != 1 else None), pos.shape[-1]))
  if length is not None:
    shapes.append((None, length))
  if batch is not None:
    shapes.append((batch, None))
  ls = {s[1] for s in shapes if s[1] is not None}
  bs = {s[0] for s in shapes if s[0] is not None}
  if len(ls) > 1 or len(bs) > 1:
    raise OperandError(f"the inputs disagree on their shape: {shapes}",
                       hint="Pass attention_mask, position_ids and token_type_ids for the same "
                            "[B, L] batch.")
  if not ls:
    raise OperandError("hf_operands needs an input or length= to know L")
  n, b = ls.pop(), (bs.pop() if bs else 1)
  out: dict[str, np.ndarray] = {}

  valid = np.ones((b, n), bool) if am is None else am.astype(bool)
  if am is not None and not np.isin(am, (0, 1)).all():
    raise OperandError("attention_mask must hold 0 and 1 only",
                       hint="A 4-D or float mask is a custom mask: write it as maskc text.")
  if ATTENTION_MASK in needs:
    out[ATTENTION_MASK] = valid
  elif not valid.all():
    raise OperandError("attention_mask has padding but the config reads none",
                       hint="Build the config with maskc.config.from_hf(..., padding=True).")

  ids = np.zeros((b, n), np.int32)
  positions = np.broadcast_to(np.arange(n, dtype=np.int32), (b, n))
  if pos is not None and am is None and not use_cache:  # find_packed_sequence_indices
    p = np.broadcast_to(pos.reshape((-1, n)), (b, n)).astype(np.int64)
    step = np.diff(p, prepend=p[:, :1] - 1, axis=-1)
    found = np.cumsum(step != 1, axis=-1).astype(np.int32)
    if (found[:, -1] != 0).any():
      ids, positions = found, p.astype(np.int32)
  if SEQUENCE_IDS in needs:
    out[SEQUENCE_IDS] = ids
  if POSITIONS in needs:
    out[POSITIONS] = np.ascontiguousarray(positions)
  if LEFT_PADDING in needs:
    out[LEFT_PADDING] = (np.cumsum(valid, axis=-1) == 0).sum(-1).astype(np.int32)
  if IMAGE_TOKENS in needs:
    out[IMAGE_TOKENS] = np.zeros((b, n), bool) if tt is None else (tt == 1)
  return out
