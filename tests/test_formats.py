"""`maskc.formats`: FlashInfer BSR, varlen `cu_seqlens`, FlashMask columns.

Each format is decoded here by its documented meaning (FlashInfer's `plan` docstring and
SciPy's bsr_matrix; flash-attention's varlen `cu_seqlens`; PaddlePaddle's
`flashmask_attention` docstring), independently of the encoder, back to a dense mask, and
compared with `maskc.materialize`. Each refusal has a test.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import maskc
from maskc.formats import bsr, cu_seqlens, flashmask

# ----------------------------------------------------------------------------- decoders


def decode_bsr(m) -> np.ndarray:
  """FlashInfer BSR back to dense: block row i holds blocks indices[indptr[i]:indptr[i+1]],
  each R x C, all allowed without a mask, else mask[n] (flattened order per SciPy bsr)."""
  (big_m, big_n), (r, c) = m.shape, m.block
  mb = -(-big_m // r)
  assert m.indptr.shape == (mb + 1,) and m.indptr[0] == 0 and m.indptr[-1] == m.indices.size
  assert m.indptr.dtype == np.int32 and m.indices.dtype == np.int32
  dense = np.zeros((mb * r, big_n), bool)
  for i in range(mb):
    row = m.indices[m.indptr[i]:m.indptr[i + 1]]
    assert (np.diff(row) > 0).all()  # sorted, no duplicates
    for n in range(m.indptr[i], m.indptr[i + 1]):
      j = m.indices[n]
      dense[i * r:(i + 1) * r, j * c:(j + 1) * c] = True if m.mask is None else m.mask[n]
  return dense[:big_m]


def decode_varlen(v, total: int) -> np.ndarray:
  """Varlen sequences back to dense over the packed axis of `total` tokens."""
  assert v.cu_seqlens_q[0] == 0 and v.cu_seqlens_q[-1] == total
  assert (v.cu_seqlens_q == v.cu_seqlens_k).all()
  dense = np.zeros((total, total), bool)
  lengths = np.diff(v.cu_seqlens_q)
  assert v.max_seqlen_q == v.max_seqlen_k == lengths.max()
  for a, b in zip(v.cu_seqlens_q[:-1], v.cu_seqlens_q[1:]):
    n = b - a
    dense[a:b, a:b] = np.tril(np.ones((n, n), bool)) if v.causal else True
  return dense


def decode_flashmask(fm) -> np.ndarray:
  """FlashMask `startend_row_indices` back to dense `[B, H, S, S]`, by the docstring of
  paddle.nn.functional.flashmask_attention: per key column j, lower-left triangle rows
  (i >= j) and upper-right rows (i < j) masked by the ranges r1..r4."""
  idx = fm.startend_row_indices
  assert idx.dtype == np.int32
  b, h, s, n = idx.shape
  i = np.arange(s)[:, None]  # rows
  j = np.arange(s)[None, :]  # columns
  lower, upper = i >= j, i < j
  out = np.zeros((b, h, s, s), bool)
  for bb in range(b):
    for hh in range(h):
      r = [idx[bb, hh, :, x][None, :] for x in range(n)]
      if fm.causal and n == 1:
        masked = upper | (lower & (i >= r[0]))
      elif fm.causal and n == 2:
        masked = upper | (lower & (r[0] <= i) & (i < r[1]))
      elif not fm.causal and n == 2:
        masked = (lower & (i >= r[0])) | (upper & (i < r[1]))
      else:
        assert not fm.causal and n == 4
        masked = (lower & (r[0] <= i) & (i < r[1])) | (upper & (r[2] <= i) & (i < r[3]))
      out[bb, hh] = ~masked
  return out


# ----------------------------------------------------------------------------- BSR


BSR_MASKS = ["causal", "sliding(5)", "causal & chunk(6)", "full", "empty", "local(3, 2)",
             "document(seg)", "causal | bidirectional(img)", "allowed[q, k]", "k % 3 == 0"]


def _operands(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
  return {"seg": np.sort(rng.integers(0, 4, n)), "img": rng.random(n) < 0.3,
          "allowed": rng.random((n, n)) < 0.5}


@pytest.mark.parametrize("text", BSR_MASKS)
@pytest.mark.parametrize("shape,blocks", [((24, 24), (4, 4)), ((23, 32), (8, 4)),
                                          ((8, 24), (4, 8)), ((30, 12), (16, 3))])
def test_bsr_decodes_to_the_mask(text, shape, blocks):
  rng = np.random.default_rng(0)
  q_len, kv_len = shape
  ops = _operands(max(shape), rng)
  ops["allowed"] = ops["allowed"][:q_len, :kv_len]
  ops = {k: v for k, v in ops.items() if k in text}
  bm = maskc.compile(text, q_len, kv_len, block_q=blocks[0], block_kv=blocks[1], operands=ops,
                     q_offset=0)
  m = bsr(bm)
  expected = maskc.materialize(text, q_len, kv_len, operands=ops, q_offset=0)
  np.testing.assert_array_equal(decode_bsr(m), expected)
  assert m.plan_args()[2:] == (q_len, kv_len, *blocks)
  assert m.nnz == int((np.asarray(bm.grid) != 0).sum())


def test_bsr_leaves_out_the_mask_when_every_block_is_full():
  m = bsr(maskc.compile("chunk(4)", 16, block_q=4, block_kv=4))
  assert m.mask is None and m.indices.tolist() == [0, 1, 2, 3]
  assert bsr(maskc.compile("chunk(4)", 16, block_q=4, block_kv=4), with_mask=True).mask.all()


def test_bsr_picks_a_batch_row_and_a_head():
  seg = np.array([[0] * 8 + [1] * 8, [0] * 4 + [1] * 12])
  bm = maskc.compile(["document(seg)", "causal & document(seg)"], 16, block_q=4, block_kv=4,
                     operands={"seg": seg})
  for b in range(2):
    for h, text in enumerate(["document(seg)", "causal & document(seg)"]):
      got = decode_bsr(bsr(bm, batch=b, head=h))
      np.testing.assert_array_equal(got, maskc.materialize(text, 16, operands={"seg": seg[b]}))
  same = maskc.compile(["causal", "causal"], 8, block_q=4, block_kv=4)
  np.testing.assert_array_equal(decode_bsr(bsr(same)), maskc.materialize("causal", 8))


@pytest.mark.parametrize("kwargs,call,match", [
    ({}, lambda bm: bsr(bm), "batch of 2"),
    ({}, lambda bm: bsr(bm, batch=0), "different masks"),
    ({}, lambda bm: bsr(bm, batch=5, head=0), "out of range"),
    ({}, lambda bm: bsr(bm, batch=0, head=7), "out of range"),
])
def test_bsr_refuses_a_batch_or_heads_not_picked(kwargs, call, match):
  seg = np.array([[0] * 8 + [1] * 8, [0] * 16])
  bm = maskc.compile(["document(seg)", "causal"], 16, block_q=4, block_kv=4,
                     operands={"seg": seg})
  with pytest.raises(maskc.MaskValueError, match=match):
    call(bm)


def test_bsr_refuses_partial_blocks_without_a_mask():
  with pytest.raises(maskc.MaskValueError, match="PARTIAL"):
    bsr(maskc.compile("causal", 16, block_q=4, block_kv=4), with_mask=False)


def test_bsr_refuses_masks_over_the_limit(monkeypatch):
  import importlib
  module = importlib.import_module("maskc.formats.block_sparse_rows")
  monkeypatch.setattr(module, "MAX_MASK_ELEMENTS", 10 * 16)
  bm = maskc.compile("causal", 16, block_q=4, block_kv=4)  # 10 blocks of 16
  assert bsr(bm).mask.shape == (10, 4, 4)
  monkeypatch.setattr(module, "MAX_MASK_ELEMENTS", 10 * 16 - 1)
  with pytest.raises(maskc.MaskLimitError, match="10 x 4 x 4"):
    bsr(bm)


def test_bsr_refuses_keys_not_a_multiple_of_the_block():
  with pytest.raises(maskc.MaskValueError, match="N % C"):
    bsr(maskc.compile("causal", 10, block_q=4, block_kv=4))


def test_bsr_refuses_traced_operands():
  import jax
  import jax.numpy as jnp

  @jax.jit
  def f(seg):
    bm = maskc.compile("document(seg)", 8, block_q=4, block_kv=4, operands={"seg": seg})
    bsr(bm)
    return seg

  with pytest.raises(maskc.MaskValueError, match="static"):
    f(jnp.zeros(8, jnp.int32))


# ----------------------------------------------------------------------------- varlen


def _doc_ids(lengths) -> np.ndarray:
  return np.repeat(np.arange(len(lengths)), lengths)


@given(st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=6), min_size=1, max_size=3),
       st.booleans())
@settings(max_examples=40, deadline=None)
def test_cu_seqlens_decode_to_the_mask(rows, causal):
  n = max(sum(r) for r in rows)
  seg = np.stack([_doc_ids(r + [n - sum(r)] if sum(r) < n else r) for r in rows])
  text = "causal & document(seg)" if causal else "document(seg)"
  v = cu_seqlens(text, n, operands={"seg": seg})
  dense = maskc.materialize(text, n, operands={"seg": seg})  # [B, n, n]
  expected = np.zeros((seg.shape[0] * n,) * 2, bool)
  for b in range(seg.shape[0]):  # a batch is packed row after row
    expected[b * n:(b + 1) * n, b * n:(b + 1) * n] = dense[b]
  np.testing.assert_array_equal(decode_varlen(v, seg.shape[0] * n), expected)
  # documents of one token are causal and full alike: the full form is given then
  assert v.causal == (causal and any((np.bincount(r) > 1).any() for r in seg))


def test_cu_seqlens_of_other_forms_of_documents():
  # the same documents, written other ways: chunks, equal ids that are not sorted
  v = cu_seqlens("causal & chunk(4)", 10)
  assert v.cu_seqlens_q.tolist() == [0, 4, 8, 10] and v.causal
  v = cu_seqlens("document(seg)", 6, operands={"seg": np.array([5, 5, 1, 1, 1, 7])})
  assert v.cu_seqlens_q.tolist() == [0, 2, 5, 6] and not v.causal and v.max_seqlen_q == 3
  v = cu_seqlens("full", 5)
  assert v.cu_seqlens_q.tolist() == [0, 5] and not v.causal
  v = cu_seqlens("causal", 5)
  assert v.cu_seqlens_q.tolist() == [0, 5] and v.causal
  assert not cu_seqlens("document(seg)", 3, operands={"seg": np.arange(3)}).causal
  assert cu_seqlens("document(seg)", 3, operands={"seg": np.arange(3)}, causal=True).causal


@pytest.mark.parametrize("text,ops,kw,match", [
    ("sliding(3)", {}, {}, "not packed"),
    ("document(seg) & seg[q] > 0", {"seg": np.array([0, 0, 1, 1])}, {}, "row 0 .*no allowed key"),
    ("document(seg)", {"seg": np.array([0, 1, 0, 1])}, {}, "separate runs"),
    ("document(seg)", {"seg": np.array([0, 0, 1, 1])}, {"causal": True}, "causal"),
    ("causal & document(seg)", {"seg": np.array([0, 0, 1, 1])}, {"causal": False}, "full"),
    ("causal | prefix(2)", {}, {}, "not packed"),
])
def test_cu_seqlens_refusals(text, ops, kw, match):
  with pytest.raises(maskc.MaskValueError, match=match):
    cu_seqlens(text, 4, operands=ops, **kw)


def test_cu_seqlens_refuses_heads_with_different_masks():
  with pytest.raises(maskc.MaskValueError, match="heads"):
    cu_seqlens(["causal", "full"], 4)
  assert cu_seqlens(["causal", "causal"], 4).causal


# ----------------------------------------------------------------------------- FlashMask


FLASHMASK_MASKS = [
    ("causal", 1), ("sliding(4)", 1), ("causal & chunk(5)", 1), ("causal & document(seg)", 1),
    ("full", 2), ("document(seg)", 2), ("causal | prefix(6)", 2), ("local(2, 3)", 2),
    ("causal & ~(k >= 3 & k < 6 & q >= 9 & q < 14)", 2),  # a causal hole: LTS, LTE
    ("sliding(3) | sink(2)", 2),
    ("global(3) & causal | sliding(2)", 1),
    ("(causal | bidirectional(img)) & document(seg)", 2),
    ("k > q | q - k > 5", 4),  # above the diagonal and far below it
]


@pytest.mark.parametrize("text,width", FLASHMASK_MASKS)
@pytest.mark.parametrize("n", [17, 32])
def test_flashmask_decodes_to_the_mask(text, width, n):
  rng = np.random.default_rng(n)
  ops = {"seg": np.sort(rng.integers(0, 3, n)), "img": np.isin(np.arange(n), [4, 5, 6, 11])}
  ops = {k: v for k, v in ops.items() if k in text}
  fm = flashmask(text, n, operands=ops)
  expected = maskc.materialize(text, n, operands=ops)
  np.testing.assert_array_equal(decode_flashmask(fm)[0, 0], expected)
  assert fm.startend_row_indices.shape == (1, 1, n, width)


def test_flashmask_causal_forms_match_the_docstring_examples():
  # paddle's docstring, figure (a): causal, LTS = 5 in every column: rows 5.. masked
  fm = flashmask("causal & (q < 5 | k >= 5)", 10)
  assert fm.causal and fm.startend_row_indices[0, 0, :, 0].tolist() == [5] * 5 + [10] * 5
  # figure (b): causal documents [0, 4), [4, 7), [7, 10)
  seg = np.repeat([0, 1, 2], [4, 3, 3])
  fm = flashmask("causal & document(seg)", 10, operands={"seg": seg})
  assert fm.startend_row_indices[0, 0, :, 0].tolist() == [4] * 4 + [7] * 3 + [10] * 3
  # figure (f): the same documents, bidirectional: [LTS, UTE]
  fm = flashmask("document(seg)", 10, operands={"seg": seg})
  assert not fm.causal
  assert fm.startend_row_indices[0, 0].tolist() == [[4, 0]] * 4 + [[7, 4]] * 3 + [[10, 7]] * 3


def test_flashmask_batches_and_heads():
  seg = np.array([np.repeat([0, 1], [5, 7]), np.repeat([0, 1, 2], [2, 2, 8])])
  masks = ["causal & document(seg)", "sliding(3) & document(seg)", "causal & document(seg)"]
  fm = flashmask(masks, 12, operands={"seg": seg})
  assert fm.startend_row_indices.shape == (2, 3, 12, 1)
  dense = maskc.materialize(masks, 12, operands={"seg": seg})
  np.testing.assert_array_equal(decode_flashmask(fm), dense)


def test_flashmask_asked_form():
  fm = flashmask("causal", 8, causal=False)
  assert not fm.causal
  np.testing.assert_array_equal(decode_flashmask(fm)[0, 0], maskc.materialize("causal", 8))


@pytest.mark.parametrize("text,kw,match", [
    ("q % 2 == 0 & causal", {}, "column 0 allows rows"),
    ("causal & ~(q == 5) & ~(q == 7)", {}, "column 0"),
    ("full", {"causal": True}, "above the diagonal"),
    ("bidirectional(img) | causal", {"operands": {"img": np.isin(np.arange(12), [2, 3, 8, 9])},
                                     "causal": True}, "above the diagonal"),
])
def test_flashmask_refusals(text, kw, match):
  with pytest.raises(maskc.MaskValueError, match=match):
    flashmask(text, 12, **kw)
