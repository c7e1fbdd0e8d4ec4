"""`maskc.config.from_hf` against transformers itself: every layer's mask, as the model builds it.

Each family's config comes from transformers' own default constructor (small windows and
chunks, tiny widths, no download). The model runs one forward pass in eager attention with
hooks on its layers, which record the mask each layer receives (transformers'
`masking_utils`, called the way the model's own file calls it); maskc's mask for that layer,
with operands from `hf_operands` of the same inputs, must equal it at every position, for
inputs with left and right padding, packed sequences, and image spans.

Needs torch and transformers (`make test-torch`); skipped without them.
"""

from __future__ import annotations

import numpy as np
import pytest

import maskc
from maskc.config import from_hf, hf_operands

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
            head_dim=8, vocab_size=64)


def _config(name, **kw):
  cls = getattr(transformers, name)
  return cls(**kw)


# Family -> (config factory, model class name). Windows and chunks are small and odd where the
# family allows, so off-by-one errors show.
FAMILIES = {
    "gemma2": (lambda: _config("Gemma2Config", num_hidden_layers=4, sliding_window=7, **TINY),
               "Gemma2Model"),
    "gemma3_text": (lambda: _config("Gemma3TextConfig", num_hidden_layers=7, sliding_window=9,
                                    **TINY), "Gemma3TextModel"),
    "gemma3_text_bidirectional": (
        lambda: _config("Gemma3TextConfig", num_hidden_layers=7, sliding_window=10,
                        use_bidirectional_attention=True, **TINY), "Gemma3TextModel"),
    "llama4_text": (lambda: _config("Llama4TextConfig", num_hidden_layers=4,
                                    attention_chunk_size=24, intermediate_size_mlp=32,
                                    num_local_experts=2, **TINY), "Llama4TextModel"),
    "mistral": (lambda: _config("MistralConfig", num_hidden_layers=2, sliding_window=11, **TINY),
                "MistralModel"),
    "mistral_full": (lambda: _config("MistralConfig", num_hidden_layers=2, sliding_window=None,
                                     **TINY), "MistralModel"),
    "qwen2": (lambda: _config("Qwen2Config", num_hidden_layers=4, use_sliding_window=True,
                              sliding_window=13, max_window_layers=2, **TINY), "Qwen2Model"),
    "qwen3": (lambda: _config("Qwen3Config", num_hidden_layers=4, use_sliding_window=True,
                              sliding_window=6, max_window_layers=1, **TINY), "Qwen3Model"),
    "qwen3_no_window": (lambda: _config("Qwen3Config", num_hidden_layers=2, **TINY), "Qwen3Model"),
    "gpt_oss": (lambda: _config("GptOssConfig", num_hidden_layers=4, sliding_window=5,
                                num_local_experts=2, num_experts_per_tok=1, **TINY),
                "GptOssModel"),
    "cohere2": (lambda: _config("Cohere2Config", num_hidden_layers=5, sliding_window=8, **TINY),
                "Cohere2Model"),
    "llama": (lambda: _config("LlamaConfig", num_hidden_layers=2, **TINY), "LlamaModel"),
    "modernbert": (lambda: _config("ModernBertConfig", num_hidden_layers=4, local_attention=12,
                                   hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                   vocab_size=64, pad_token_id=0, eos_token_id=1,
                                   bos_token_id=2, cls_token_id=2, sep_token_id=1),
                   "ModernBertModel"),
    "bert": (lambda: _config("BertConfig", num_hidden_layers=2, hidden_size=16,
                             intermediate_size=32, num_attention_heads=2, vocab_size=64),
             "BertModel"),
}

NO_SDPA = {"gemma2", "gpt_oss"}  # transformers refuses attn_implementation="sdpa" for these


def _layers(model):
  for name in ("layers", "layer"):
    for owner in (model, getattr(model, "encoder", None)):
      layers = getattr(owner, name, None) if owner is not None else None
      if layers is not None:
        return list(layers)
  raise AssertionError(f"no layers found on {type(model).__name__}")


def transformers_masks(model, layers=None, **inputs) -> list[np.ndarray | None]:
  """The mask each layer receives in one forward pass: bool `[B, L, L]` (True: attend), or None
  where transformers passes no mask (sdpa's causal shortcut; no padding on a bidirectional
  layer)."""
  seen: list = []
  layers = _layers(model) if layers is None else layers

  def hook(module, args, kwargs):
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if mask is not None:  # eager: 0 or the dtype's min; sdpa: bool
      mask = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    seen.append(None if mask is None else mask.numpy())

  handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]
  try:
    with torch.no_grad():
      model(**inputs)
  finally:
    for h in handles:
      h.remove()
  return seen


def _model(family, attn="eager"):
  make, cls = FAMILIES[family]
  config = make()
  config._attn_implementation = attn
  torch.manual_seed(0)
  return getattr(transformers, cls)(config).eval(), config


def _padding(batch: int, n: int, rng: np.random.Generator) -> np.ndarray:
  """Rows with no padding, left padding and right padding."""
  am = np.ones((batch, n), np.int64)
  for b in range(1, batch):
    pad = int(rng.integers(1, n // 3))
    if b % 2:
      am[b, :pad] = 0
    else:
      am[b, n - pad:] = 0
  return am


def _packed_positions(batch: int, n: int, rng: np.random.Generator) -> np.ndarray:
  """Positions restarting at random points (packed sequences); some rows not packed."""
  pos = np.zeros((batch, n), np.int64)
  for b in range(batch):
    cuts = sorted(rng.choice(np.arange(1, n), size=int(rng.integers(0, 5)), replace=False))
    start = 0
    for stop in list(cuts) + [n]:
      pos[b, start:stop] = np.arange(stop - start) + (0 if b % 2 else int(rng.integers(0, 3)))
      start = stop
  return pos


def _compare(family, model, config, inputs, ops_inputs, n):
  theirs = transformers_masks(model, **inputs)
  cfg = from_hf(config)
  ops = hf_operands(cfg, **ops_inputs, length=n)
  assert len(theirs) == cfg.num_layers
  for i, expected in enumerate(theirs):
    ours = maskc.materialize(cfg.mask(i), n, operands=ops)
    if expected is None:  # transformers skipped the mask: full attention
      expected = np.ones_like(ours)
    expected = np.broadcast_to(expected, ours.shape)
    bad = np.argwhere(ours != expected)
    kind = getattr(config, "layer_types", [""] * len(theirs))[i]
    assert not len(bad), (f"{family} layer {i} ({kind}): {len(bad)} positions differ, first "
                          f"[b, q, k] = {bad[:5].tolist()}\n{cfg.mask(i)}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("n,attn", [(64, "eager"), (203, "eager"), (512, "eager"), (203, "sdpa")])
def test_padding_matches_transformers(family, n, attn):
  # sdpa and eager build the same boolean mask (eager adds it as 0 / -inf).
  if attn == "sdpa" and family in NO_SDPA:
    pytest.skip(f"transformers runs {family} in eager attention only")
  rng = np.random.default_rng(n)
  model, config = _model(family, attn)
  am = _padding(3, n, rng)
  ids = torch.tensor(rng.integers(3, 60, size=am.shape))
  inputs = {"input_ids": ids, "attention_mask": torch.tensor(am)}
  _compare(family, model, config, inputs, {"attention_mask": am}, n)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_sequences_match_transformers(family):
  n = 160
  rng = np.random.default_rng(7)
  model, config = _model(family)
  pos = _packed_positions(3, n, rng)
  ids = torch.tensor(rng.integers(3, 60, size=pos.shape))
  # transformers looks for packed sequences only without a KV cache, as in training.
  inputs = {"input_ids": ids, "position_ids": torch.tensor(pos), "use_cache": False}
  _compare(family, model, config, inputs, {"position_ids": pos}, n)


def _image_spans(batch: int, n: int, rng: np.random.Generator, window: int) -> np.ndarray:
  """token_type_ids with image spans (1) among text (0): one longer than the window, one
  short, one at the very start of a row."""
  tt = np.zeros((batch, n), np.int64)
  for b in range(batch):
    starts = [0] if b == 2 else []
    starts += [int(rng.integers(5, n // 3)), int(rng.integers(n // 2, n - 3 * window))]
    for i, s in enumerate(starts):
      tt[b, s:s + (3 * window if i % 2 else int(rng.integers(1, window)))] = 1
  return tt


def _gemma3_multimodal():
  text = dict(num_hidden_layers=7, sliding_window=6, **TINY)
  vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                image_size=28, patch_size=14)
  config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                     image_token_index=63)
  config._attn_implementation = "eager"
  config.text_config._attn_implementation = "eager"
  torch.manual_seed(0)
  return transformers.Gemma3Model(config).eval(), config


@pytest.mark.parametrize("n", [64, 300])
def test_gemma3_image_spans_with_padding_match_transformers(n):
  rng = np.random.default_rng(n)
  model, config = _gemma3_multimodal()
  am = _padding(3, n, rng)
  tt = _image_spans(3, n, rng, window=6)
  ids = torch.tensor(rng.integers(3, 60, size=am.shape))
  inputs = {"input_ids": ids, "attention_mask": torch.tensor(am),
            "token_type_ids": torch.tensor(tt)}
  seen = transformers_masks(model, model.language_model.layers, **inputs)
  cfg = from_hf(config)
  ops = hf_operands(cfg, attention_mask=am, token_type_ids=tt)
  assert [str(cfg.mask(i)).splitlines()[-1] for i in range(7)] == list(
      config.text_config.layer_types)
  for i, expected in enumerate(seen):
    ours = maskc.materialize(cfg.mask(i), n, operands=ops)
    np.testing.assert_array_equal(ours, expected, err_msg=f"layer {i}")


def test_gemma3_packed_image_spans_differ_only_where_transformers_reads_positions():
  # With packed sequences transformers evaluates the sliding layers' mask function, image
  # blocks included, at the packed positions, so it reads the image groups of the tokens
  # *at those positions* (of the first sequence), not of the tokens themselves; its full
  # layers read them by index. maskc reads them by index in every layer (docs/configs.md).
  n = 120
  rng = np.random.default_rng(3)
  model, config = _gemma3_multimodal()
  pos = _packed_positions(3, n, rng)
  tt = _image_spans(3, n, rng, window=6)
  ids = torch.tensor(rng.integers(3, 60, size=pos.shape))
  seen = transformers_masks(model, model.language_model.layers, input_ids=ids,
                            position_ids=torch.tensor(pos), token_type_ids=torch.tensor(tt),
                            use_cache=False)
  cfg = from_hf(config)
  ops = hf_operands(cfg, position_ids=pos, token_type_ids=tt)
  seq = ops["sequence_ids"]
  # image groups as transformers numbers them: 0, 1, ... per span, -1 on text
  img = tt == 1
  group = np.where(img, np.cumsum(img & ~np.pad(img, ((0, 0), (1, 0)))[:, :-1], axis=1) - 1, -1)

  def sliding(read):  # (causal | same image) & q - W < k & same sequence, at `read` positions
    gq, gk = (np.take_along_axis(group, read, 1)[:, :, None],
              np.take_along_axis(group, read, 1)[:, None, :])
    q, k = read[:, :, None], read[:, None, :]
    return (((k <= q) | ((gq == gk) & (gq >= 0))) & (k > q - 6)
            & (seq[:, :, None] == seq[:, None, :]))

  at_index = np.broadcast_to(np.arange(n), (3, n))
  for i, expected in enumerate(seen):
    ours = maskc.materialize(cfg.mask(i), n, operands=ops)
    if config.text_config.layer_types[i] == "full_attention":
      np.testing.assert_array_equal(ours, expected)
    else:
      np.testing.assert_array_equal(expected, sliding(pos))
      np.testing.assert_array_equal(ours, sliding(at_index))
      assert (ours != expected).any()


@pytest.mark.parametrize("name", [
    "Gemma2Config", "Gemma3TextConfig", "Gemma3Config", "Llama4TextConfig", "Llama4Config",
    "MistralConfig", "MixtralConfig", "Qwen2Config", "Qwen3Config", "GptOssConfig",
    "Cohere2Config", "ModernBertConfig", "BertConfig", "RobertaConfig", "LlamaConfig",
    "GemmaConfig"])
def test_family_defaults_are_transformers_defaults(name):
  # A config.json leaves out what the class defaults: from_hf must fill in the same values.
  config = getattr(transformers, name)()
  assert from_hf({"model_type": config.model_type}) == from_hf(config)
  assert from_hf(config.to_dict()) == from_hf(config)
