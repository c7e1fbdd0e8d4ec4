"""`maskc.config.from_maxtext` against MaxText's own mask code.

MaxText does not install here without its heavy extras (its wheel declares every dependency
under `cuda12` / `tpu` extras, and `layers/attention_op.py` imports flax, aqt, tokamax and
qwix), so the references are its mask code transliterated to NumPy from MaxText 0.2.5
(`maxtext/layers/attention_op.py`, `maxtext/layers/attention_compressed.py`,
`maxtext/utils/max_utils.py`): `generate_attention_mask` (the dot-product path),
`ChunkedCausalMask`, `BlockCausalMask`, `HCAStaticMask`, `get_compressed_mask` and the
compressed segment ids, `reorder_sequence`. The splash path's CausalMask and LocalMask are
JAX's own classes.
"""

from __future__ import annotations

import numpy as np
import pytest

import maskc
from maskc.config import from_maxtext
from maskc.config.maxtext import maxtext_config_data

sm = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask")


def kinds(cfg):
  return [str(cfg.mask(i)).splitlines()[-1] for i in range(cfg.num_layers)]


G, L, C, F, D = ("global_attention", "local_sliding_attention", "chunk_attention",
                 "full_attention", "block_diffusion_attention")

# ----------------------------------------------------------------------------- MaxText in NumPy


def block_indices(bidirectional_mask):
  """_make_block_mask_indices."""
  padded = np.pad(bidirectional_mask, [(0, 0), (1, 0)])
  boundary = padded[..., 1:] > padded[..., :-1]
  return bidirectional_mask * np.cumsum(boundary, axis=-1)


def bidirectional_block_mask(bidirectional_mask):
  """_make_bidirectional_block_mask: [B, L] -> [B, L, L]."""
  idx = block_indices(bidirectional_mask.astype(np.int64))
  return (idx[:, None, :] == idx[..., None]) & (idx[..., None] > 0)


def generate_attention_mask(attention_type, seg, *, window=None, chunk=None, block=None,
                            bidirectional_mask=None, segment_positions=None):
  """AttentionOp.generate_attention_mask, training mode, no previous chunk: bool [B, Q, K]
  (True: attend), for every attention type but compressed."""
  b, n = seg.shape
  mask = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] >= 0)
  use_pos = segment_positions is not None
  if use_pos:
    rows, cols = segment_positions[:, :, None], segment_positions[:, None, :]
  else:
    rows, cols = np.arange(n)[None, :, None], np.arange(n)[None, None, :]
  causal = None
  if attention_type not in ("full", "compressed", "block_diffusion"):
    causal = cols <= rows
  out = mask & causal if causal is not None else mask
  if attention_type == "local_sliding":
    out = out & ((cols > rows - window) & (cols <= rows))
  elif attention_type == "chunk":
    out = out & ((rows // chunk == cols // chunk) & (rows >= cols))
  elif attention_type == "block_diffusion":
    out = out & (rows // block >= cols // block)
  if bidirectional_mask is not None:
    out = out | bidirectional_block_mask(bidirectional_mask)
  return np.broadcast_to(out, (b, n, n))


def maxtext_chunked_causal(n, chunk):
  """MaxText's ChunkedCausalMask (splash path), rows = q_sequence = arange."""
  q, k = np.arange(n)[:, None], np.arange(n)[None, :]
  return (q // chunk == k // chunk) & (q >= k)


def maxtext_block_causal(n, block):
  """MaxText's BlockCausalMask."""
  q, k = np.arange(n)[:, None], np.arange(n)[None, :]
  return q // block >= k // block


def compressed_segment_ids(seg, ratio):
  """attention_compressed: a compressed block keeps its segment when all its tokens share it."""
  b, n = seg.shape
  blocks = n // ratio
  chunks = seg[:, :blocks * ratio].reshape(b, blocks, ratio)
  return np.where(chunks.min(-1) == chunks.max(-1), chunks.min(-1), -1)


def compressed_dot_mask(seg, positions, ratio, window):
  """The dot-product path of a compressed layer: keys [L tokens | C blocks], bool [B, L, L+C]
  (get_sliding_mask, get_compressed_mask, the compressed segment mask)."""
  b, n = seg.shape
  cseg = compressed_segment_ids(seg, ratio)
  c = cseg.shape[1]
  seg_kv = np.concatenate([seg, cseg], axis=1)
  seg_mask = (seg[:, :, None] == seg_kv[:, None, :]) & (seg_kv[:, None, :] >= 0)
  rows, cols = np.arange(n)[:, None], np.arange(n)[None, :]
  distance = rows - cols
  local = (distance < window) & (distance >= 0)
  block_pos = positions[:, :c * ratio:ratio]
  is_future = block_pos[:, None, :] + ratio > positions[:, :, None] + 1
  comp = ~is_future
  dense = np.concatenate([np.broadcast_to(local, (b, n, n)), comp], axis=2)
  return dense & seg_mask, seg_kv


def hca_static_mask(n, kv_len, local_kv_len, pad, ratio, window):
  """HCAStaticMask.__getitem__ over the whole shape (n, kv_len)."""
  rows, cols = np.arange(n)[:, None], np.arange(kv_len)[None, :]
  compressed = kv_len - local_kv_len - pad
  valid_row = rows < local_kv_len
  diff = rows - cols
  local_m = valid_row & (diff >= 0) & (diff < window) & (cols < local_kv_len)
  c_idx = cols - local_kv_len - pad
  comp_m = valid_row & (c_idx >= 0) & (c_idx < (rows + 1) // ratio) & (c_idx < compressed)
  pad_cols = local_kv_len + ((rows - local_kv_len) % pad) if pad else None
  pad_m = (~valid_row) & (cols == pad_cols) if pad else np.zeros_like(local_m)
  return local_m | comp_m | pad_m


def reorder_sequence(x, cp_size):
  """max_utils.reorder_sequence (to load-balanced order) along axis 0."""
  n = x.shape[0]
  chunks = x.reshape(2 * cp_size, n // (2 * cp_size))
  first, second = chunks[:cp_size], chunks[cp_size:][::-1]
  return np.stack([first, second], axis=1).reshape(n)


# ----------------------------------------------------------------------------- inputs


def packed(b, n, rng, negative=False):
  """Segment ids of packed documents (1, 2, ...), padding 0 at the end, per MaxText's
  pipeline; `negative` adds runs of -1 (compressed-layer padding)."""
  seg = np.zeros((b, n), np.int32)
  pos = np.zeros((b, n), np.int32)
  for r in range(b):
    cuts = sorted(rng.choice(np.arange(1, n - 2), size=3, replace=False))
    bounds = [0, *cuts, n - int(rng.integers(0, 4))]
    for d, (a, z) in enumerate(zip(bounds[:-1], bounds[1:])):
      seg[r, a:z] = d + 1
      pos[r, a:z] = np.arange(z - a)
    pos[r, bounds[-1]:] = np.arange(n - bounds[-1])
    if negative:
      seg[r, bounds[1]:bounds[1] + 2] = -1
  return seg, pos


def images(b, n, rng):
  img = np.zeros((b, n), bool)
  for r in range(b):
    for _ in range(2):
      a = int(rng.integers(0, n - 6))
      img[r, a:a + int(rng.integers(1, 6))] = True
  return img


# ----------------------------------------------------------------------------- layer kinds


@pytest.mark.parametrize("config,expected", [
    ({"decoder_block": "gemma3", "base_num_decoder_layers": 8, "sliding_window_size": 4},
     [L] * 5 + [G, L, L]),
    ({"decoder_block": "gemma4", "base_num_decoder_layers": 6, "sliding_window_size": 4},
     [L] * 5 + [G]),
    ({"decoder_block": "gemma2", "base_num_decoder_layers": 2, "sliding_window_size": 4},
     [L, G, L, G]),
    ({"decoder_block": "gpt_oss", "base_num_decoder_layers": 3, "sliding_window_size": 4},
     [L, G, L]),
    ({"decoder_block": "olmo3", "base_num_decoder_layers": 5, "sliding_window_size": 4},
     [L, L, L, G, L]),
    ({"decoder_block": "llama4", "base_num_decoder_layers": 8, "nope_layer_interval": 4,
      "chunk_attn_window_size": 8}, [C, C, C, G] * 2),
    ({"decoder_block": "llama4", "base_num_decoder_layers": 2, "chunk_attn_window_size": 8},
     [C, C]),  # base.yml's nope_layer_interval -1: no NoPE layer
    ({"decoder_block": "llama2", "base_num_decoder_layers": 2}, [G, G]),
    # generic decoders pass no attention_type: AttentionOp's GLOBAL, whatever the config says
    ({"decoder_block": "mistral", "base_num_decoder_layers": 2, "attention_type": "local_sliding",
      "sliding_window_size": 4}, [G, G]),
    ({"decoder_block": "deepseek", "base_num_decoder_layers": 2, "attention_type": "mla"}, [G, G]),
    ({"decoder_block": "llama2", "base_num_decoder_layers": 1, "attention_type": "compressed"},
     [G]),
    ({"decoder_block": "deepseek", "base_num_decoder_layers": 1, "attention_type": "full"}, [F]),
    ({"decoder_block": "llama2", "base_num_decoder_layers": 2, "attention_type": "block_diffusion"},
     [D, D]),
    ({"decoder_block": "gemma3", "base_num_decoder_layers": 6, "sliding_window_size": 4,
      "attention_type": "block_diffusion"}, [L] * 5 + [D]),
    ({"decoder_block": "deepseek4", "base_num_decoder_layers": 3, "compress_ratios": [0, 4, 128],
      "sliding_window_size": 4, "attention_type": "compressed"},
     [L, "compressed_attention_4", "compressed_attention_128"]),
    ({"decoder_block": "llama2", "num_decoder_layers": 3, "base_num_decoder_layers": 9}, [G] * 3),
])
def test_layer_kinds_follow_each_decoder_block(config, expected):
  assert kinds(from_maxtext(config)) == expected


@pytest.mark.parametrize("config,field", [
    ({"decoder_block": "qwen3_next"}, "decoder_block"),
    ({"decoder_block": "gemma4_small"}, "decoder_block"),
    ({"decoder_block": "gemma3"}, "sliding_window_size"),  # base.yml: 0
    ({"decoder_block": "llama4", "chunk_attn_window_size": 0}, "chunk_attn_window_size"),
    ({"decoder_block": "llama2", "attention_type": "block_diffusion", "causal_block_size": 0},
     "causal_block_size"),
    ({"decoder_block": "llama2", "attention_type": "sparse"}, "attention_type"),
    ({"decoder_block": "deepseek", "attention_type": "compressed"}, "attention_type"),
    ({"decoder_block": "deepseek4", "base_num_decoder_layers": 3, "compress_ratios": [0]},
     "compress_ratios"),
    ({"decoder_block": "deepseek4", "base_num_decoder_layers": 1, "compress_ratios": [-4]},
     "compress_ratios[0]"),
    ({"decoder_block": "gemma3", "sliding_window_size": 8, "attention": "cudnn_flash_te",
      "hardware": "gpu"}, "attention"),
    ({"decoder_block": "gemma3", "sliding_window_size": 8, "attention": "flash",
      "hardware": "gpu"}, "attention"),
    ({"ici_context_parallelism": 2, "context_parallel_strategy": "ulysses"},
     "context_parallel_strategy"),
    ({"ici_context_parallelism": 2, "context_parallel_reorder_strategy": "striped"},
     "context_parallel_reorder_strategy"),
    ({"ici_context_parallelism": 2, "context_parallel_strategy": "ring", "hardware": "gpu"},
     "context_parallel_reorder_strategy"),  # auto picks striped there
    ({"decoder_block": "llama2", "use_multimodal": True}, "decoder_block"),
    ({"base_num_decoder_layers": "four"}, "base_num_decoder_layers"),
])
def test_refusals_name_the_field(config, field):
  with pytest.raises(maskc.ConfigError) as e:
    from_maxtext(config, images=True if config.get("use_multimodal") else None)
  assert e.value.path == field, e.value


def test_refuses_what_is_not_a_config_and_unknown_paths():
  with pytest.raises(maskc.ConfigError, match="MaxText config"):
    from_maxtext(3)
  with pytest.raises(maskc.ConfigError, match="path"):
    from_maxtext({}, path="gpu")


def test_paths_from_kernel_and_hardware():
  cfg = {"decoder_block": "llama2", "base_num_decoder_layers": 1}
  dot = "causal & document(decoder_segment_ids) & decoder_segment_ids[k] >= 0"
  splash = "causal & document(decoder_segment_ids)"
  for extra, text in [({}, splash), ({"attention": "dot_product"}, dot),
                      ({"hardware": "cpu"}, dot), ({"attention": "flash"}, splash),
                      ({"attention": "flash", "hardware": "gpu"}, splash)]:
    assert maxtext_config_data({**cfg, **extra})["definitions"][G] == text


# ----------------------------------------------------------------------------- dot-product path


@pytest.mark.parametrize("block,attention_type,extra", [
    ("gemma3", "global", {"sliding_window_size": 5}),
    ("gpt_oss", "global", {"sliding_window_size": 3}),
    ("llama4", "global", {"chunk_attn_window_size": 6, "nope_layer_interval": 2}),
    ("llama2", "block_diffusion", {"causal_block_size": 4}),
    ("deepseek", "full", {}),
    ("gemma4", "global", {"sliding_window_size": 4}),
])
@pytest.mark.parametrize("cp", [1, 2])
def test_dot_product_path_matches_generate_attention_mask(block, attention_type, extra, cp):
  rng = np.random.default_rng(len(block) + cp)
  n = 48
  config = {"decoder_block": block, "base_num_decoder_layers": 6, "attention": "dot_product",
            "attention_type": attention_type, "use_multimodal": block in ("gemma3", "gemma4"),
            "ici_context_parallelism": cp, **extra}
  cfg = from_maxtext(config)
  seg, pos = packed(2, n, rng, negative=True)
  img = images(2, n, rng)
  ops = {"decoder_segment_ids": seg, "bidirectional_mask": img, "decoder_positions": pos}
  ops = {d.name: ops[d.name] for d in cfg.operands}
  by_kind = {"global_attention": "global", "local_sliding_attention": "local_sliding",
             "chunk_attention": "chunk", "block_diffusion_attention": "block_diffusion",
             "full_attention": "full"}
  for i, kind in enumerate(kinds(cfg)):
    with_images = (block == "gemma3" or (block == "gemma4" and kind == L))
    expected = generate_attention_mask(
        by_kind[kind], seg, window=extra.get("sliding_window_size"),
        chunk=extra.get("chunk_attn_window_size"), block=extra.get("causal_block_size"),
        bidirectional_mask=img if with_images else None,
        segment_positions=pos if cp > 1 else None)
    got = maskc.materialize(cfg.mask(i), n, operands=ops)
    np.testing.assert_array_equal(got, expected, err_msg=f"layer {i} ({kind})")


def test_dot_product_and_splash_paths_differ_where_maxtext_differs():
  n = 24
  seg = np.array([[1] * 8 + [-1] * 4 + [2] * 12])
  img = np.zeros((1, n), bool)
  img[0, 14:18] = True
  config = {"decoder_block": "gemma3", "base_num_decoder_layers": 6, "sliding_window_size": 3,
            "use_multimodal": True}
  dot = from_maxtext(config, path="dot_product")
  splash = from_maxtext(config, path="splash")
  d = maskc.materialize(dot.mask(5), n, operands={"decoder_segment_ids": seg,
                                                  "bidirectional_mask": img})[0]
  s = maskc.materialize(splash.mask(5), n, operands={"decoder_segment_ids": seg})[0]
  # padding ids of -1 attend to each other on the splash path only
  assert s[9, 8:12].tolist() == [True, True, False, False] and not d[9].any()
  # image spans are bidirectional on the dot-product path only
  assert d[14, 17] and not s[14, 17]


# ----------------------------------------------------------------------------- splash path


@pytest.mark.parametrize("n,window,chunk,block", [(32, 5, 8, 4), (40, 1, 3, 7), (64, 16, 16, 16)])
def test_splash_path_matches_splash_mask_classes(n, window, chunk, block):
  rng = np.random.default_rng(n)
  seg, _ = packed(1, n, rng, negative=True)
  shape = (n, n)
  local = sm.LogicalAnd(sm.CausalMask(shape), sm.LocalMask(shape, (window - 1, window), offset=0))
  segments = seg[0][:, None] == seg[0][None, :]  # SegmentIds: equality only
  cases = [
      ({"decoder_block": "gpt_oss", "sliding_window_size": window}, [local, sm.CausalMask(shape)]),
      ({"decoder_block": "llama4", "chunk_attn_window_size": chunk, "nope_layer_interval": 2},
       [maxtext_chunked_causal(n, chunk), sm.CausalMask(shape)]),
      ({"decoder_block": "llama2", "attention_type": "block_diffusion",
        "causal_block_size": block}, [maxtext_block_causal(n, block)] * 2),
      ({"decoder_block": "deepseek", "attention_type": "full"}, [sm.FullMask(shape)] * 2),
  ]
  for config, references in cases:
    cfg = from_maxtext({"base_num_decoder_layers": 2, "attention": "flash", **config})
    for i, ref in enumerate(references):
      dense = ref if isinstance(ref, np.ndarray) else ref[:, :]
      got = maskc.materialize(cfg.mask(i), n, operands={"decoder_segment_ids": seg})[0]
      np.testing.assert_array_equal(got, dense & segments, err_msg=f"{config} layer {i}")


# ----------------------------------------------------------------------------- compressed layers


@pytest.mark.parametrize("ratio,window", [(4, 3), (8, 5), (128, 16)])
def test_compressed_layers_dot_product_path(ratio, window):
  rng = np.random.default_rng(ratio)
  n = 256 if ratio == 128 else 64
  seg, pos = packed(2, n, rng)
  cfg = from_maxtext({"decoder_block": "deepseek4", "base_num_decoder_layers": 2,
                      "compress_ratios": [0, ratio], "sliding_window_size": window,
                      "attention_type": "compressed", "attention": "dot_product"})
  expected, seg_kv = compressed_dot_mask(seg, pos, ratio, window)
  kv_len = seg_kv.shape[1]
  got = maskc.materialize(cfg.mask(1), n, kv_len, q_offset=0,
                          operands={"decoder_segment_ids_kv": seg_kv, "local_kv_len": n})
  np.testing.assert_array_equal(got, expected)
  # the ratio-0 layer is a local sliding layer
  local = maskc.materialize(cfg.mask(0), n, operands={"decoder_segment_ids": seg})
  np.testing.assert_array_equal(local, generate_attention_mask("local_sliding", seg,
                                                               window=window))


@pytest.mark.parametrize("pad", [0, 5])
def test_compressed_layers_splash_path_match_hca_static_mask(pad):
  n, ratio, window = 64, 8, 6
  c = n // ratio
  kv_len = n + pad + c
  cfg = from_maxtext({"decoder_block": "deepseek4", "base_num_decoder_layers": 1,
                      "compress_ratios": [ratio], "sliding_window_size": window,
                      "attention_type": "compressed", "attention": "flash"}, segments=False)
  got = maskc.materialize(cfg.mask(0), n, kv_len, q_offset=0,
                          operands={"local_kv_len": n, "pad_kv_total": pad})
  # HCAStaticMask's rows past local_kv_len (padding queries) are not part of the mask
  np.testing.assert_array_equal(got, hca_static_mask(n, kv_len, n, pad, ratio, window))


def test_sparse_csa_reads_the_indexer_mask():
  cfg = from_maxtext({"decoder_block": "deepseek4", "base_num_decoder_layers": 1,
                      "compress_ratios": [4], "sliding_window_size": 2, "use_indexer": True,
                      "indexer_sparse_training": True, "attention": "dot_product"},
                     segments=False)
  n, c = 8, 2
  sel = np.zeros((n, n + c), bool)
  sel[5:, n] = True
  got = maskc.materialize(cfg.mask(0), n, n + c, q_offset=0,
                          operands={"local_kv_len": n, "indexer_mask": sel})
  expected = np.concatenate([np.tri(n, dtype=bool) & ~np.tri(n, k=-2, dtype=bool),
                             sel[:, n:]], axis=1)
  np.testing.assert_array_equal(got, expected)


# ----------------------------------------------------------------------------- context parallel


def test_load_balanced_layout_is_zigzag():
  cfg = from_maxtext({"ici_context_parallelism": 2, "dcn_context_parallelism": 2})
  assert cfg.context_parallel.kwargs() == {"layout": "zigzag", "strategy": "all_gather"}
  cfg = from_maxtext({"ici_context_parallelism": 4, "context_parallel_strategy": "ring"})
  assert cfg.context_parallel.kwargs() == {"layout": "zigzag", "strategy": "ring"}
  cfg = from_maxtext({"ici_context_parallelism": 4, "context_parallel_load_balance": False})
  assert cfg.context_parallel.kwargs()["layout"] == "contiguous"
  assert from_maxtext({}).context_parallel is None


@pytest.mark.parametrize("cp,n", [(2, 64), (4, 256), (8, 1024)])
def test_maxtext_layout_is_maxtexts_reorder(cp, n):
  lay = maskc.parallel.maxtext_layout({"ici_context_parallelism": cp, "max_target_length": n})
  np.testing.assert_array_equal(lay.positions, reorder_sequence(np.arange(n), cp))
  assert lay.shards == cp and lay.method == "zigzag"
  assert maskc.parallel.maxtext_layout({"ici_context_parallelism": 1}) is None


@pytest.mark.parametrize("hf,maxtext", [
    ({"model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 7},
     {"decoder_block": "gemma3", "base_num_decoder_layers": 12, "sliding_window_size": 7}),
    ({"model_type": "gemma2", "num_hidden_layers": 6, "sliding_window": 5},
     {"decoder_block": "gemma2", "base_num_decoder_layers": 3, "sliding_window_size": 5}),
    ({"model_type": "gpt_oss", "num_hidden_layers": 4, "sliding_window": 9},
     {"decoder_block": "gpt_oss", "base_num_decoder_layers": 4, "sliding_window_size": 9}),
    ({"model_type": "llama4_text", "num_hidden_layers": 8, "attention_chunk_size": 12},
     {"decoder_block": "llama4", "base_num_decoder_layers": 8, "nope_layer_interval": 4,
      "chunk_attn_window_size": 12}),
])
def test_the_same_model_gets_the_same_text_masks_from_both_sources(hf, maxtext):
  # Without padding or packing, a model's layers are the same masks in transformers and in
  # MaxText (both count a sliding window's W tokens with the query, both chunk from 0).
  a = maskc.config.from_hf(hf, padding=False, packing=False)
  b = from_maxtext(maxtext, segments=False)
  assert a.num_layers == b.num_layers
  for i in range(a.num_layers):
    np.testing.assert_array_equal(maskc.materialize(a.mask(i), 40),
                                  maskc.materialize(b.mask(i), 40), err_msg=f"layer {i}")
