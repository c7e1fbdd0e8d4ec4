"""The prelude and the language's examples, each against an independent NumPy formula.

Every reference here is written from the mask's definition in docs/design.md ("The language",
"Positions") (row `i` has `q = q_offset + i`, column `j` has `k = j`, `q_offset` defaults to
`kv_len - q_len`) or from the formula of the code it reproduces (MaxText, splash), never from
maskc's own evaluator.
"""

import jax
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash

import maskc

# (q_len, kv_len, q_offset): square, decode-like, prefill-like, explicit offsets.
SHAPES = [(8, 8, None), (5, 12, None), (12, 5, None), (1, 9, None), (4, 10, 2), (6, 6, 3),
          (7, 7, 0), (3, 16, 13)]


def positions(q_len, kv_len=None, q_offset=None):
  """Query and key positions of a mask of this shape, per docs/design.md ("Positions")."""
  kv_len = q_len if kv_len is None else kv_len
  q_offset = kv_len - q_len if q_offset is None else q_offset
  return np.arange(q_len) + q_offset, np.arange(kv_len)


def reference(predicate, q_len, kv_len=None, q_offset=None):
  """The dense mask of `predicate(q, k)` over Python ints, one pair at a time."""
  qs, ks = positions(q_len, kv_len, q_offset)
  return np.array([[bool(predicate(int(q), int(k))) for k in ks] for q in qs], dtype=bool)


def dense(mask, q_len, kv_len=None, q_offset=None, /, **operands):
  return np.asarray(maskc.materialize(mask, q_len, kv_len, q_offset=q_offset, operands=operands))


def check(mask, predicate, q_len, kv_len=None, q_offset=None, /, **operands):
  expected = reference(predicate, q_len, kv_len, q_offset)
  got = dense(mask, q_len, kv_len, q_offset, **operands)
  np.testing.assert_array_equal(got, expected, err_msg=f"{mask} at {q_len, kv_len, q_offset}")


# ----------------------------------------------------------------------------- the prelude

PRELUDE_CASES = [
    ("full", lambda q, k: True),
    ("empty", lambda q, k: False),
    ("causal", lambda q, k: k <= q),
    ("sliding(1)", lambda q, k: k == q),
    ("sliding(3)", lambda q, k: q - 3 < k <= q),
    ("local(0, 0)", lambda q, k: k == q),
    ("local(2, 1)", lambda q, k: q - 2 <= k <= q + 1),
    ("local(0, 4)", lambda q, k: q <= k <= q + 4),
    ("chunk(1)", lambda q, k: q == k),
    ("chunk(3)", lambda q, k: q // 3 == k // 3),
    ("chunk(4)", lambda q, k: q // 4 == k // 4),
    ("prefix(0)", lambda q, k: False),
    ("prefix(3)", lambda q, k: q < 3 and k < 3),
    ("sink(0)", lambda q, k: False),
    ("sink(2)", lambda q, k: k < 2),
    ("global(0)", lambda q, k: q < 0 or k < 0),  # negative q when q_len > kv_len
    ("global(2)", lambda q, k: q < 2 or k < 2),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("text,predicate", PRELUDE_CASES, ids=[c[0] for c in PRELUDE_CASES])
def test_prelude_mask(text, predicate, shape):
  check(text, predicate, *shape)


def test_every_prelude_name_is_covered():
  covered = {"full", "empty", "causal", "sliding", "local", "chunk", "prefix", "sink", "global",
             "document", "bidirectional", "tree"}
  from maskc.language.parse import known_mask_names
  assert set(known_mask_names()) == covered


# Per-token operands are read at q, so only shapes whose query positions are >= 0.
OPERAND_SHAPES = [s for s in SHAPES if positions(*s)[0].min() >= 0]


@pytest.mark.parametrize("shape", OPERAND_SHAPES, ids=str)
def test_document(shape):
  q_len, kv_len, q_offset = shape
  qs, ks = positions(q_len, kv_len, q_offset)
  length = max(kv_len, int(qs.max()) + 1)
  seg = np.sort(np.random.default_rng(length).integers(0, 3, length)).astype(np.int32)
  check("document(seg)", lambda q, k: seg[q] == seg[k], *shape, seg=seg)


@pytest.mark.parametrize("shape", OPERAND_SHAPES, ids=str)
def test_tree(shape):
  """`tree(tin, tout)`: a query sees itself and its ancestors, found by walking parents (the
  entry and exit times of `maskc.trees` are tested against the same walk in test_trees)."""
  q_len, kv_len, q_offset = shape
  qs, _ = positions(q_len, kv_len, q_offset)
  length = max(kv_len, int(qs.max()) + 1)
  rng = np.random.default_rng(length)
  parent = np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, length)])
  ops = maskc.trees.from_parents(parent)

  def ancestor_or_self(q, k):
    while q >= 0 and q != k:
      q = parent[q]
    return q == k

  check("tree(tin, tout)", ancestor_or_self, *shape, **ops)


@pytest.mark.parametrize("shape", [(8, 8, 0), (5, 12, None), (4, 10, 2), (1, 16, 15)], ids=str)
@pytest.mark.parametrize("w", [1, 2, 5])
def test_streaming_window_with_sinks(w, shape):
  check(f"sliding({w}) | sink(2)", lambda q, k: q - w < k <= q or k < 2, *shape)


# ----------------------------------------------------------------------------- against splash


@pytest.mark.parametrize("q_len,kv_len", [(8, 8), (6, 10), (16, 16)])
def test_causal_matches_splash(q_len, kv_len):
  offset = kv_len - q_len
  expected = splash.CausalMask((q_len, kv_len), offset=offset)[:, :]
  np.testing.assert_array_equal(dense("causal", q_len, kv_len), expected)


@pytest.mark.parametrize("window", [(0, 0), (3, 0), (2, 5), (7, 1)])
def test_local_matches_splash(window):
  expected = splash.LocalMask((12, 12), window, offset=0)[:, :]
  np.testing.assert_array_equal(dense(f"local({window[0]}, {window[1]})", 12), expected)


@pytest.mark.parametrize("c", [1, 3, 4, 16])
def test_chunked_causal_matches_splash(c):
  expected = splash.ChunkedCausalMask((16, 16), chunk_size=c)[:, :]
  np.testing.assert_array_equal(dense(f"causal & chunk({c})", 16), expected)


# ----------------------------------------------------------------------------- MaxText formulas


def maxtext_chunked_causal(q_len, kv_len, q_offset, chunk_size):
  """MaxText `_generate_chunk_attention_mask`, in NumPy."""
  row_ids = np.arange(q_len)[:, None] + q_offset
  col_ids = np.arange(kv_len)[None, :]
  same_chunk = (row_ids // chunk_size) == (col_ids // chunk_size)
  return same_chunk & (row_ids >= col_ids)


@pytest.mark.parametrize("shape", [(16, 16, 0), (8, 16, 8), (5, 13, 8), (4, 16, 3), (1, 20, 19)],
                         ids=str)
@pytest.mark.parametrize("c", [1, 2, 3, 4, 8])
def test_chunked_causal_matches_maxtext(c, shape):
  q_len, kv_len, q_offset = shape
  expected = maxtext_chunked_causal(q_len, kv_len, q_offset, c)
  np.testing.assert_array_equal(dense(f"causal & chunk({c})", q_len, kv_len, q_offset), expected)


def maxtext_block_indices(bidirectional_mask):
  """MaxText `_make_block_mask_indices`: 1-based index of each run of image tokens, 0 elsewhere."""
  padded = np.pad(bidirectional_mask, [(0, 0), (1, 0)], constant_values=0)
  boundary = padded[..., 1:] > padded[..., :-1]
  return bidirectional_mask * np.cumsum(boundary, axis=-1)


def maxtext_bidirectional(bidirectional_mask):
  """MaxText `_make_bidirectional_block_mask`: [B, L] image flags to a [B, L, L] mask."""
  idx = maxtext_block_indices(bidirectional_mask)
  return (idx[:, None, :] == idx[..., None]) & (idx[..., None] > 0)


def runs_by_hand(x):
  """The image-block id of each token, by walking the sequence (a second reference)."""
  out, block, prev = [], 0, False
  for v in x:
    if v and not prev:
      block += 1
    out.append(block if v else 0)
    prev = bool(v)
  return np.array(out)


IMAGE_PATTERNS = {
    "maxtext_docstring": [0, 1, 1, 1, 0, 0],
    "image_at_start": [1, 1, 1, 0, 0, 0, 0, 0],
    "image_at_end": [0, 0, 0, 0, 0, 1, 1, 1],
    "start_and_end": [1, 1, 0, 0, 0, 0, 1, 1],
    "runs_split_by_one_text_token": [0, 1, 1, 0, 1, 1, 1, 0, 1, 0],
    "single_image_tokens": [1, 0, 1, 0, 1, 0, 1],
    "all_image": [1] * 9,
    "no_image": [0] * 9,
    "one_token": [1],
    "long": [0] * 3 + [1] * 5 + [0] * 4 + [1] * 6 + [0] + [1] * 2,
}


@pytest.mark.parametrize("pattern", list(IMAGE_PATTERNS.values()), ids=list(IMAGE_PATTERNS))
def test_bidirectional_matches_maxtext(pattern):
  img = np.array(pattern, dtype=bool)
  expected = maxtext_bidirectional(img[None].astype(np.int32))[0]
  np.testing.assert_array_equal(dense("bidirectional(img)", len(img), img=img), expected)
  ids = runs_by_hand(img)
  check("bidirectional(img)", lambda q, k: ids[q] > 0 and ids[q] == ids[k], len(img), img=img)


def test_bidirectional_maxtext_docstring_example():
  img = np.array([0, 1, 1, 1, 0, 0], dtype=bool)
  expected = np.zeros((6, 6), dtype=bool)
  expected[1:4, 1:4] = True
  np.testing.assert_array_equal(dense("bidirectional(img)", 6, img=img), expected)


@pytest.mark.parametrize("pattern", list(IMAGE_PATTERNS.values()), ids=list(IMAGE_PATTERNS))
def test_causal_or_bidirectional_matches_maxtext(pattern):
  # MaxText's multimodal mask: causal, plus full attention inside each image.
  img = np.array(pattern, dtype=np.int32)
  n = len(img)
  expected = maxtext_chunked_causal(n, n, 0, n) | maxtext_bidirectional(img[None])[0]
  np.testing.assert_array_equal(dense("causal | bidirectional(img)", n, img=img), expected)


@pytest.mark.parametrize("q_len,q_offset", [(4, None), (3, 2), (1, 9)])
def test_bidirectional_with_offset(q_len, q_offset):
  img = np.array([1, 1, 0, 0, 1, 1, 1, 0, 1, 1], dtype=bool)
  ids = runs_by_hand(img)
  check("bidirectional(img)", lambda q, k: ids[q] > 0 and ids[q] == ids[k], q_len, len(img),
        q_offset, img=img)


def test_bidirectional_with_integer_flags():
  img = np.array([0, 2, 5, 0, 1, 0], dtype=np.int32)  # nonzero is an image token
  ids = runs_by_hand(img != 0)
  check("bidirectional(img)", lambda q, k: ids[q] > 0 and ids[q] == ids[k], 6, img=img)


def test_chunk_causal_bidirectional_demo():
  img = np.array([0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0], dtype=bool)
  ids = runs_by_hand(img)
  check("causal & chunk(4) | bidirectional(img)",
        lambda q, k: (k <= q and q // 4 == k // 4) or (ids[q] > 0 and ids[q] == ids[k]), 12,
        img=img)


# ----------------------------------------------------------------------------- batched operands


def test_batched_segment_ids():
  seg = np.array([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3], [5, 5, 5, 5, 5, 5, 5, 5]])
  got = dense("causal & document(seg)", 8, seg=seg)
  assert got.shape == (3, 8, 8)
  for b in range(3):
    expected = reference(lambda q, k, b=b: k <= q and seg[b, q] == seg[b, k], 8)
    np.testing.assert_array_equal(got[b], expected)


def test_batched_bidirectional():
  img = np.array([[0, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=bool)
  got = dense("bidirectional(img)", 6, img=img)
  np.testing.assert_array_equal(got, maxtext_bidirectional(img.astype(np.int32)))


@pytest.mark.parametrize("kv_len_value", [np.array([3, 8, 0, 5]), np.array(4), 6])
def test_scalar_padding_lengths(kv_len_value):
  got = dense("causal & k < kv_len", 8, kv_len=kv_len_value)
  lengths = np.atleast_1d(kv_len_value)
  if np.ndim(kv_len_value) == 1:
    assert got.shape == (len(lengths), 8, 8)
  else:
    got = got[None]
  for b, n in enumerate(lengths):
    np.testing.assert_array_equal(got[b], reference(lambda q, k, n=n: k <= q and k < n, 8))


def test_batched_scalar_prefix_length():
  plen = np.array([0, 2, 5])
  got = dense("causal | prefix(plen)", 6, plen=plen)
  for b, n in enumerate(plen):
    expected = reference(lambda q, k, n=n: k <= q or (q < n and k < n), 6)
    np.testing.assert_array_equal(got[b], expected)


def test_batched_and_unbatched_operands_mix():
  seg = np.array([[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]])
  img = np.array([0, 1, 1, 0, 0, 0], dtype=bool)
  got = dense("causal & document(seg) | bidirectional(img)", 6, seg=seg, img=img)
  ids = runs_by_hand(img)
  for b in range(2):
    expected = reference(lambda q, k, b=b: (k <= q and seg[b, q] == seg[b, k])
                         or (ids[q] > 0 and ids[q] == ids[k]), 6)
    np.testing.assert_array_equal(got[b], expected)


# ----------------------------------------------------------------------------- language examples
# docs/design.md ("The language"): the language expresses every mask in use today in a few lines.


@pytest.mark.parametrize("w,d", [(3, 2), (4, 3), (2, 1)])
def test_dilated_sliding_window(w, d):
  # w keys, every d-th position back from the query (Longformer's dilated window).
  text = "causal & q - k < w * d & (q - k) % d == 0"
  check(maskc.parse(text, w=w, d=d), lambda q, k: 0 <= q - k < w * d and (q - k) % d == 0, 16)


def test_global_plus_sliding_window():
  text = "sliding(4) | global(2)"
  check(text, lambda q, k: q - 4 < k <= q or q < 2 or k < 2, 12)
  check(text, lambda q, k: q - 4 < k <= q or q < 2 or k < 2, 4, 12)


def test_shared_prefix_mask():
  # A shared prompt [0, p) followed by several completions (segments 1, 2, 3); each
  # completion sees the prompt and itself, causally.
  text = """
  shared = k < p | document(seg)
  causal & shared
  """
  seg = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3])
  check(maskc.parse(text, p=4), lambda q, k: k <= q and (k < 4 or seg[q] == seg[k]), 12, seg=seg)


def test_prefix_lm_single_document():
  check("causal | prefix(5)", lambda q, k: k <= q or (q < 5 and k < 5), 10)


def test_prefix_lm_packed_documents():
  # Packed documents, each with its own bidirectional prefix (`pre` marks prefix tokens).
  text = "document(seg) & (causal | pre[q] & pre[k])"
  seg = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2])
  pre = np.array([1, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 1], dtype=bool)
  check(text, lambda q, k: seg[q] == seg[k] and (k <= q or (pre[q] and pre[k])), 12,
        seg=seg, pre=pre)


@pytest.mark.parametrize("b", [1, 2, 4])
def test_block_causal_diffusion(b):
  # Block diffusion: bidirectional inside a block, causal across blocks.
  check(maskc.parse("k // b <= q // b", b=b), lambda q, k: k // b <= q // b, 12)


def test_bd3lm_training_mask():
  # BD3-LM training: noisy x_t in [0, L) and clean x_0 in [L, 2L), blocks of b tokens.
  text = """
  block_diagonal = q < L & k < L & q // b == k // b
  offset_block_causal = q < L & k >= L & (k - L) // b < q // b
  block_causal = q >= L & k >= L & (k - L) // b <= (q - L) // b
  block_diagonal | offset_block_causal | block_causal
  """
  L, b = 8, 2

  def bd3lm(q, k):
    if q < L and k < L:
      return q // b == k // b
    if q < L <= k:
      return (k - L) // b < q // b
    if q >= L and k >= L:
      return (k - L) // b <= (q - L) // b
    return False

  check(maskc.parse(text, L=L, b=b), bd3lm, 2 * L)


@pytest.mark.parametrize("W,r", [(4, 1), (5, 2), (3, 0)])
def test_natten_neighbourhood(W, r):
  text = "abs(q // W - k // W) <= r & abs(q % W - k % W) <= r"
  n = W * 4
  check(maskc.parse(text, W=W, r=r),
        lambda q, k: abs(q // W - k // W) <= r and abs(q % W - k % W) <= r, n)


def tree_ancestors(parent):
  """anc[i, j]: token j is token i or one of its ancestors, from a parent array (-1: root)."""
  n = len(parent)
  anc = np.zeros((n, n), dtype=bool)
  for i in range(n):
    j = i
    while j >= 0:
      anc[i, j] = True
      j = parent[j]
  return anc


def test_speculative_decoding_tree():
  # A prompt of P tokens, then a draft tree of T tokens; each draft token sees the prompt
  # and its ancestors. `anc` covers every position, as a pairwise operand.
  P = 5
  parent = [-1, 0, 1, 2, 3, 4, 4, 5, 5, 6]  # prompt chain 0..4, then the tree
  anc = tree_ancestors(parent)
  T = len(parent) - P
  check("k < P | anc[q, k]", lambda q, k: k < P or anc[q, k], T, len(parent), anc=anc, P=P)
  check("anc[q, k]", lambda q, k: anc[q, k], len(parent), anc=anc)


def test_per_batch_padding_lengths():
  kv_len = np.array([10, 4, 7])
  got = dense("causal & k < kv_len & q < kv_len", 10, kv_len=kv_len)
  assert got.shape == (3, 10, 10)
  for b, n in enumerate(kv_len):
    np.testing.assert_array_equal(got[b], reference(lambda q, k, n=n: k <= q < n and k < n, 10))


def test_moba_block_selection():
  # MoBA: each query block attends the key blocks its gate picked, plus its own block.
  bs, n = 4, 16
  topk = np.random.default_rng(0).random((n // bs, n // bs)) < 0.4
  text = "causal & (topk[q // B, k // B] | q // B == k // B)"
  check(maskc.parse(text, B=bs), lambda q, k: k <= q and (topk[q // bs, k // bs]
                                                          or q // bs == k // bs), n, topk=topk)


def test_user_definitions_compose():
  text = """
  local = causal & chunk(4)
  streaming(w, s) = sliding(w) | sink(s)
  local | streaming(2, 1)
  """
  check(text, lambda q, k: (k <= q and q // 4 == k // 4) or (q - 2 < k <= q) or k < 1, 12)


def test_prelude_materializes_under_jit():
  img = np.array([0, 1, 1, 0, 1, 0], dtype=bool)
  f = jax.jit(lambda x: maskc.materialize("causal | bidirectional(img)", 6, operands={"img": x}))
  expected = maxtext_chunked_causal(6, 6, 0, 6) | maxtext_bidirectional(img[None])[0]
  np.testing.assert_array_equal(np.asarray(f(img)), expected)
