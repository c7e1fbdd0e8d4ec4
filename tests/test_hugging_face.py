"""`maskc.config.from_hf` and `hf_operands` without transformers: configs as dicts.

The layer masks are checked against transformers' mask functions written out here in NumPy
(`masking_utils`: `causal_mask_function`, `sliding_window_overlay`, `chunked_overlay`,
`padding_mask_function`, `find_packed_sequence_indices`, Gemma 3's block ids), the layer
kinds against each family's config defaults, and every refusal names its field.
tests/test_hugging_face_torch.py compares with transformers itself.
"""

from __future__ import annotations

import numpy as np
import pytest

import maskc
from maskc.config import from_hf, hf_operands
from maskc.config.hugging_face import hf_config_data


def kinds(cfg):
  return [str(cfg.mask(i)).splitlines()[-1] for i in range(cfg.num_layers)]


def definition(cfg, i):
  return str(cfg.mask(i)).splitlines()[0].split(" = ", 1)[1]


S, F, C = "sliding_attention", "full_attention", "chunked_attention"


# ----------------------------------------------------------------------------- layer kinds


@pytest.mark.parametrize("config,expected", [
    ({"model_type": "gemma2", "num_hidden_layers": 5}, [S, F, S, F, S]),
    ({"model_type": "gemma3_text", "num_hidden_layers": 8}, [S] * 5 + [F] + [S] * 2),
    ({"model_type": "gemma3_text", "num_hidden_layers": 4, "sliding_window_pattern": 2},
     [S, F, S, F]),
    ({"model_type": "gemma3", "text_config": {"num_hidden_layers": 7}}, [S] * 5 + [F, S]),
    ({"model_type": "llama4_text", "num_hidden_layers": 8}, [C, C, C, F] * 2),
    ({"model_type": "llama4_text", "num_hidden_layers": 4, "no_rope_layers": [1, 0, 0, 1]},
     [C, F, F, C]),
    ({"model_type": "llama4_text", "num_hidden_layers": 3, "attention_chunk_size": None}, [F] * 3),
    ({"model_type": "llama4", "text_config": {"num_hidden_layers": 4}}, [C, C, C, F]),
    ({"model_type": "mistral", "num_hidden_layers": 2}, [S, S]),
    ({"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": None}, [F, F]),
    ({"model_type": "mixtral", "num_hidden_layers": 2}, [F, F]),
    ({"model_type": "qwen2", "num_hidden_layers": 3}, [F] * 3),
    ({"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": True,
      "max_window_layers": 2}, [F, F, S, S]),
    ({"model_type": "qwen3", "num_hidden_layers": 2, "use_sliding_window": True,
      "max_window_layers": 0, "sliding_window": 5}, [S, S]),
    ({"model_type": "gpt_oss", "num_hidden_layers": 4}, [S, F, S, F]),
    ({"model_type": "cohere2", "num_hidden_layers": 5}, [S, S, S, F, S]),
    ({"model_type": "cohere2", "num_hidden_layers": 4, "sliding_window_pattern": 2},
     [S, F, S, F]),
    ({"model_type": "modernbert", "num_hidden_layers": 6}, [F, S, S, F, S, S]),
    ({"model_type": "modernbert", "num_hidden_layers": 4, "global_attn_every_n_layers": 2},
     [F, S, F, S]),
    ({"model_type": "bert", "num_hidden_layers": 2}, [F, F]),
    ({"model_type": "llama", "num_hidden_layers": 2}, [F, F]),
    ({"model_type": "gemma2", "num_hidden_layers": 3, "layer_types": [F, F, S]}, [F, F, S]),
])
def test_layer_kinds_follow_each_familys_fields(config, expected):
  assert kinds(from_hf(config)) == expected


def test_default_layer_counts_and_windows():
  cfg = from_hf({"model_type": "gemma3_text"}, padding=False, packing=False)
  assert cfg.num_layers == 26 and definition(cfg, 0) == "sliding(4096)"
  cfg = from_hf({"model_type": "llama4_text"}, padding=False, packing=False)
  assert cfg.num_layers == 48 and definition(cfg, 0) == "causal & chunk(8192)"
  cfg = from_hf({"model_type": "gpt_oss"}, padding=False, packing=False)
  assert cfg.num_layers == 36 and definition(cfg, 0) == "sliding(128)"


def test_texts_of_each_layer_kind():
  gemma3 = from_hf({"model_type": "gemma3", "text_config": {"num_hidden_layers": 6,
                                                            "sliding_window": 512}})
  assert definition(gemma3, 0) == ("(causal | bidirectional(image_tokens)) & q - 512 < k & "
                                   "document(sequence_ids) & attention_mask[k]")
  assert definition(gemma3, 5) == ("(causal | bidirectional(image_tokens)) & "
                                   "document(sequence_ids) & attention_mask[k]")
  llama4 = from_hf({"model_type": "llama4_text", "num_hidden_layers": 4,
                    "attention_chunk_size": 64})
  assert definition(llama4, 0) == (
      "causal & (positions[q] - left_padding) // 64 == (positions[k] - left_padding) // 64 & "
      "document(sequence_ids) & attention_mask[k]")
  assert definition(from_hf({"model_type": "llama4_text", "num_hidden_layers": 1,
                             "attention_chunk_size": 64}, packing=False), 0) == (
      "causal & (q - left_padding) // 64 == (k - left_padding) // 64 & attention_mask[k]")
  bert = from_hf({"model_type": "modernbert", "num_hidden_layers": 2, "local_attention": 64})
  assert [definition(bert, i) for i in range(2)] == ["attention_mask[k]",
                                                     "abs(q - k) <= 32 & attention_mask[k]"]
  embed = from_hf({"model_type": "gemma3_text", "num_hidden_layers": 6, "sliding_window": 512,
                   "use_bidirectional_attention": True}, padding=False)
  assert [definition(embed, i) for i in (0, 5)] == [
      "abs(q - k) < 257 & document(sequence_ids)", "document(sequence_ids)"]
  gpt_oss = from_hf({"model_type": "gpt_oss", "num_hidden_layers": 2})
  assert definition(gpt_oss, 0) == "sliding(128) & attention_mask[k]"  # never packed


def test_config_objects_and_files_read_like_dicts(tmp_path):
  class Config:  # what from_hf reads of a PretrainedConfig: to_dict()
    def to_dict(self):
      return {"model_type": "cohere2", "num_hidden_layers": 4, "sliding_window": 16}
  path = tmp_path / "config.json"
  path.write_text('{"model_type": "cohere2", "num_hidden_layers": 4, "sliding_window": 16}')
  assert from_hf(Config()) == from_hf(Config().to_dict()) == from_hf(str(path))


def test_config_data_repeats_the_shortest_pattern():
  data = hf_config_data({"model_type": "gemma3_text", "num_hidden_layers": 14})
  assert data["layers"] == {"pattern": [S] * 5 + [F]} and data["num_layers"] == 14
  assert hf_config_data({"model_type": "llama", "num_hidden_layers": 3})["layers"] == {
      "pattern": [F]}
  assert hf_config_data({"model_type": "gemma2", "num_hidden_layers": 3,
                         "layer_types": [F, F, S]})["layers"] == [F, F, S]


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("config,field", [
    ({"model_type": "falcon"}, "model_type"),
    ({}, "model_type"),
    ({"model_type": "gemma2", "num_hidden_layers": 2,
      "layer_types": ["sliding_attention", "linear_attention"]}, "layer_types[1]"),
    ({"model_type": "gemma2", "num_hidden_layers": 2, "layer_types": [F]}, "layer_types"),
    ({"model_type": "gemma2", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "llama", "is_causal": False}, "is_causal"),
    ({"model_type": "qwen2", "num_hidden_layers": 2, "layer_types": [S, F]}, "use_sliding_window"),
    ({"model_type": "gemma2", "num_hidden_layers": 2, "sliding_window": None}, "sliding_window"),
    ({"model_type": "gemma2", "num_hidden_layers": 2, "sliding_window": 0}, "sliding_window"),
    ({"model_type": "gemma2", "num_hidden_layers": 1, "layer_types": [C]}, "layer_types[0]"),
    ({"model_type": "llama4_text", "num_hidden_layers": 1, "layer_types": [C],
      "attention_chunk_size": None}, "attention_chunk_size"),
    ({"model_type": "llama4_text", "num_hidden_layers": 1, "layer_types": [S]}, "layer_types[0]"),
    ({"model_type": "llama4_text", "num_hidden_layers": 2, "no_rope_layers": [1]},
     "no_rope_layers"),
    ({"model_type": "qwen2", "use_sliding_window": "yes"}, "use_sliding_window"),
    ({"model_type": "gemma3", "text_config": {"model_type": "llama"}}, "text_config.model_type"),
    ({"model_type": "gemma3", "text_config": {"num_hidden_layers": 1,
                                              "layer_types": ["hybrid"]}},
     "text_config.layer_types[0]"),
])
def test_refusals_name_the_field(config, field):
  with pytest.raises(maskc.ConfigError) as e:
    from_hf(config)
  assert e.value.path == field, e.value


def test_refuses_what_is_not_a_config():
  with pytest.raises(maskc.ConfigError, match="transformers config"):
    from_hf(42)


# ----------------------------------------------------------------------------- operands


def packed_ids(position_ids):
  """transformers' find_packed_sequence_indices, in NumPy (None: not packed)."""
  first = position_ids[:, :1] - 1
  diff = np.diff(position_ids, prepend=first, axis=-1)
  ids = np.cumsum(diff != 1, axis=-1)
  return None if (ids[:, -1] == 0).all() else ids


def test_operands_from_padding():
  cfg = from_hf({"model_type": "llama4_text", "num_hidden_layers": 4,
                 "attention_chunk_size": 4})
  am = np.array([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0], [1] * 7])
  ops = hf_operands(cfg, attention_mask=am)
  assert set(ops) == {"attention_mask", "sequence_ids", "positions", "left_padding"}
  assert ops["left_padding"].tolist() == [2, 0, 0]
  assert ops["sequence_ids"].tolist() == [[0] * 7] * 3  # no packing with an attention_mask
  assert ops["positions"].tolist() == [list(range(7))] * 3
  np.testing.assert_array_equal(ops["attention_mask"], am.astype(bool))


def test_operands_from_packed_positions():
  cfg = from_hf({"model_type": "llama4_text", "num_hidden_layers": 4, "attention_chunk_size": 4})
  pos = np.array([[0, 1, 2, 0, 1, 5, 6], [3, 4, 5, 6, 7, 8, 9]])
  ops = hf_operands(cfg, position_ids=pos)
  np.testing.assert_array_equal(ops["sequence_ids"], packed_ids(pos))
  np.testing.assert_array_equal(ops["positions"], pos)
  assert ops["attention_mask"].all() and ops["left_padding"].tolist() == [0, 0]
  # one row, broadcast over the batch; not packed: the indices
  ops = hf_operands(cfg, position_ids=np.arange(5)[None] + 3, batch=2)
  assert ops["sequence_ids"].shape == (2, 5) and not ops["sequence_ids"].any()
  assert ops["positions"].tolist() == [list(range(5))] * 2
  # a KV cache, or an attention_mask, turns packing detection off (as in transformers)
  for kw in ({"use_cache": True}, {"attention_mask": np.ones((2, 7), int)}):
    assert not hf_operands(cfg, position_ids=pos, **kw)["sequence_ids"].any()


def test_operands_for_image_spans():
  cfg = from_hf({"model_type": "gemma3", "text_config": {"num_hidden_layers": 2}})
  tt = np.array([[0, 1, 1, 0, 1, 2]])
  ops = hf_operands(cfg, token_type_ids=tt)
  assert ops["image_tokens"].tolist() == [[False, True, True, False, True, False]]
  assert not hf_operands(cfg, length=3)["image_tokens"].any()


def test_operand_refusals():
  cfg = from_hf({"model_type": "llama", "num_hidden_layers": 1}, padding=False)
  with pytest.raises(maskc.OperandError, match="padding"):
    hf_operands(cfg, attention_mask=np.array([[0, 1, 1]]))
  ops = hf_operands(cfg, attention_mask=np.ones((1, 3), int))  # no padding: nothing to read
  assert list(ops) == ["sequence_ids"] and not ops["sequence_ids"].any()
  padded = from_hf({"model_type": "llama", "num_hidden_layers": 1})
  with pytest.raises(maskc.OperandError, match="disagree"):
    hf_operands(padded, attention_mask=np.ones((2, 3)), position_ids=np.arange(4))
  with pytest.raises(maskc.OperandError, match="0 and 1"):
    hf_operands(padded, attention_mask=np.array([[0, 2, 1]]))
  with pytest.raises(maskc.OperandError, match="rank"):
    hf_operands(padded, attention_mask=np.ones(3))
  with pytest.raises(maskc.OperandError, match="length"):
    hf_operands(padded)


# ----------------------------------------------------------------------------- masks


def reference(kind, n, am, pos, *, window=None, chunk=None, group=None):
  """transformers' layer mask in NumPy: its mask functions (masking_utils) at packed positions
  when packed, and with the padding mask on the keys (sdpa_mask)."""
  b = am.shape[0]
  ids = packed_ids(pos) if pos is not None else None
  at = pos if ids is not None else np.broadcast_to(np.arange(n), (b, n))
  q, k = at[:, :, None], at[:, None, :]
  m = k <= q
  if kind == "sliding":
    m = m & (k > q - window)
  if kind == "chunked":
    lp = (np.cumsum(am, -1) == 0).sum(-1)[:, None, None]
    m = m & ((k - lp) // chunk == (q - lp) // chunk)
  if group is not None:
    m = m | ((group[:, :, None] == group[:, None, :]) & (group[:, :, None] >= 0))
  if ids is not None:
    m = m & (ids[:, :, None] == ids[:, None, :])
  return m & am[:, None, :].astype(bool)


@pytest.mark.parametrize("seed", range(4))
def test_layers_match_transformers_mask_functions(seed):
  rng = np.random.default_rng(seed)
  n, window, chunk = 48, int(rng.integers(1, 9)), int(rng.integers(1, 12))
  cfg = from_hf({"model_type": "llama4_text", "num_hidden_layers": 4,
                 "attention_chunk_size": chunk})
  sw = from_hf({"model_type": "cohere2", "num_hidden_layers": 4, "sliding_window": window})
  am = np.ones((2, n), int)
  am[0, :int(rng.integers(1, 10))] = 0
  am[1, n - int(rng.integers(1, 10)):] = 0
  pos = np.concatenate([np.arange(20), np.arange(28) + int(rng.integers(0, 3))])[None]
  pos = np.repeat(pos, 2, 0)
  for inputs in ({"attention_mask": am}, {"position_ids": pos}):
    a = inputs.get("attention_mask", np.ones((2, n), int))
    p = None if "attention_mask" in inputs else pos
    for c, layer, kind in ((cfg, 0, "chunked"), (cfg, 3, "causal"), (sw, 0, "sliding")):
      ops = hf_operands(c, **inputs, length=n)
      got = maskc.materialize(c.mask(layer), n, operands=ops)
      np.testing.assert_array_equal(got, reference(kind, n, a, p, window=window, chunk=chunk))
