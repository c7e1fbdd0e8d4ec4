"""maskc.torch against PyTorch FlexAttention itself: `mask_mod` through `create_mask`,
`block_mask` against `create_block_mask` (sound always, equal where maskc is exact, the lists
in its layout), `flex_attention` against a float64 NumPy attention over `maskc.materialize`'s
dense mask, eagerly and compiled.

Needs torch (`make test-torch`, marker `torch`).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from hypothesis import given, settings, strategies as st  # noqa: E402
from torch.nn.attention import flex_attention as flex  # noqa: E402

import maskc  # noqa: E402
import maskc.torch  # noqa: E402
from maskc import testing  # noqa: E402
from maskc.semantics.shape import Shape  # noqa: E402
from maskc.torch import _attention, _lists  # noqa: E402
from tests.helpers import (  # noqa: E402
  EMPTY,
  FULL,
  PARTIAL,
  assert_close,
  assert_flex_layout,
  flex_grids,
  tile_states,
)

FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
OPERANDS = {"seg": "segments", "img": "image", "n": "scalar", "allowed": "pairwise"}


def offset_of(shape) -> int:
  return int(Shape.of(*shape).q_offset)


def dense(mask, q_len, kv_len, q_offset, operands) -> np.ndarray:
  """`[B, H, Lq, Lk]`: maskc.materialize's mask with a batch and head axis always."""
  d = np.asarray(maskc.materialize(mask, q_len, kv_len, q_offset=q_offset, operands=operands))
  multi = not isinstance(mask, (str, maskc.Mask))
  if not multi:
    d = d[..., None, :, :]
  return d if d.ndim == 4 else d[None]


def torch_ops(operands) -> dict:
  return {n: torch.as_tensor(np.asarray(v)) for n, v in operands.items()}


def reference_attention(q, k, v, allowed, scale=None) -> np.ndarray:
  """float64 softmax attention over `allowed [B?, H?, Lq, Lk]`; GQA by repeating key/value
  heads; rows with no allowed key give 0."""
  q, k, v = (np.asarray(x.detach().numpy(), np.float64) for x in (q, k, v))
  group = q.shape[1] // k.shape[1]
  k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
  s = np.einsum("bhqd,bhkd->bhqk", q, k) * (scale or 1 / np.sqrt(q.shape[-1]))
  allowed = np.broadcast_to(allowed, s.shape)
  s = np.where(allowed, s, -np.inf)
  m = np.max(s, axis=-1, keepdims=True)
  p = np.where(allowed, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
  den = p.sum(-1, keepdims=True)
  return np.einsum("bhqk,bhkd->bhqd", p / np.where(den > 0, den, 1), v)


# ----------------------------------------------------------------------------- mask_mod


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_create_mask_of_the_mask_mod_equals_materialize(data):
  mask = data.draw(testing.masks(max_depth=2, operands=OPERANDS), label="mask")
  shape = data.draw(testing.shapes(max_len=40), label="shape")
  ops = data.draw(testing.operand_values(mask, shape), label="operands")
  q_len, kv_len, off = shape[0], shape[1], offset_of(shape)
  want = dense(mask, q_len, kv_len, off, ops)
  mm = maskc.torch.mask_mod(mask, operands=torch_ops(ops), q_offset=off, q_len=q_len,
                            kv_len=kv_len)
  got = flex.create_mask(mm, want.shape[0], 1, q_len, kv_len, device="cpu").numpy()
  np.testing.assert_array_equal(got, want)


def test_mask_mod_counts_rows_from_zero_by_default():
  mm = maskc.torch.mask_mod("causal")
  got = flex.create_mask(mm, 1, 1, 3, 5, device="cpu")[0, 0].numpy()
  np.testing.assert_array_equal(got, np.tril(np.ones((3, 5), bool)))  # top-left: q = row
  mm = maskc.torch.mask_mod("causal", q_offset=2)
  got = flex.create_mask(mm, 1, 1, 3, 5, device="cpu")[0, 0].numpy()
  np.testing.assert_array_equal(got, np.tril(np.ones((3, 5), bool), 2))  # maskc's alignment


def test_mask_mod_per_head_and_per_batch():
  seg = np.array([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 2, 2]])
  mm = maskc.torch.mask_mod(["causal & document(seg)", "sliding(2)", "full"],
                            operands={"seg": torch.as_tensor(seg)})
  got = flex.create_mask(mm, 2, 3, 6, 6, device="cpu").numpy()
  i, j = np.arange(6)[:, None], np.arange(6)[None]
  for b in range(2):
    np.testing.assert_array_equal(got[b, 0], (j <= i) & (seg[b][:, None] == seg[b][None]))
    np.testing.assert_array_equal(got[b, 1], (j <= i) & (j > i - 2))
    assert got[b, 2].all()


def test_mask_mod_under_plain_vmap_and_called_directly():
  mm = maskc.torch.mask_mod("causal & chunk(C) | sink(1)", C=4)
  q, k = torch.arange(8).repeat_interleave(8), torch.arange(8).repeat(8)
  zero = torch.zeros(64, dtype=torch.int64)
  got = torch.vmap(mm)(zero, zero, q, k).reshape(8, 8).numpy()
  i, j = np.arange(8)[:, None], np.arange(8)[None]
  want = ((j <= i) & (i // 4 == j // 4)) | (j < 1)
  np.testing.assert_array_equal(got, want)
  one = mm(torch.tensor(0), torch.tensor(0), torch.tensor(5, dtype=torch.int32),
           torch.tensor(0, dtype=torch.int32))
  assert one.dtype == torch.bool and bool(one)


def test_mask_mod_takes_params_and_refuses_them_with_a_mask_object():
  mm = maskc.torch.mask_mod("sliding(W)", W=3)
  assert flex.create_mask(mm, 1, 1, 4, 4, device="cpu").sum() == 4 + 3 + 2
  with pytest.raises(maskc.MaskTypeError, match="Mask object"):
    maskc.torch.mask_mod(maskc.causal(), W=3)


def test_mask_mod_computes_in_int64_where_int32_would_wrap():
  mm = maskc.torch.mask_mod("q * 3 < k * 3 + 6000000000", q_len=2, kv_len=2, q_offset=3 << 30)
  got = flex.create_mask(mm, 1, 1, 2, 2, device="cpu")[0, 0].numpy()
  want = maskc.materialize("q * 3 < k * 3 + 6000000000", 2, 2, q_offset=3 << 30)
  np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------- block_mask


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_block_mask_is_sound_and_equal_to_create_block_mask_when_exact(data):
  mask = data.draw(testing.masks(max_depth=2, operands=OPERANDS), label="mask")
  shape = data.draw(testing.shapes(max_len=48), label="shape")
  ops = data.draw(testing.operand_values(mask, shape), label="operands")
  bs = data.draw(st.sampled_from([8, 16, (8, 16), (16, 4), 64]), label="block_size")
  q_len, kv_len, off = shape[0], shape[1], offset_of(shape)
  d = dense(mask, q_len, kv_len, off, ops)
  mm = maskc.torch.mask_mod(mask, operands=ops, q_offset=off, q_len=q_len, kv_len=kv_len)
  ref = flex.create_block_mask(mm, d.shape[0], 1, q_len, kv_len, device="cpu", BLOCK_SIZE=bs)
  ref_grid, _ = flex_grids(ref)
  exact = maskc.torch.block_mask(mask, q_len, kv_len, operands=ops, block_size=bs,
                                 q_offset=off, exact=True)
  for f in FIELDS:
    assert torch.equal(getattr(exact, f), getattr(ref, f)), f
  assert exact.seq_lengths == ref.seq_lengths and exact.BLOCK_SIZE == ref.BLOCK_SIZE
  bm = maskc.torch.block_mask(mask, q_len, kv_len, operands=ops, block_size=bs, q_offset=off)
  fwd, bwd = flex_grids(bm)
  np.testing.assert_array_equal(fwd, bwd)  # the backward lists are the forward's transpose
  # sound: only partial where torch's is full or empty; else the same
  assert ((fwd == ref_grid) | (fwd == PARTIAL)).all()
  for num, idx in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks,
                   bm.full_kv_indices), (bm.q_num_blocks, bm.q_indices)):
    assert_flex_layout(num, idx)
  np.testing.assert_array_equal(
      flex.create_mask(bm.mask_mod, d.shape[0], 1, q_len, kv_len, device="cpu").numpy(), d)


@settings(max_examples=20, deadline=None)
@given(testing.prelude_combinations(), st.integers(1, 90), st.integers(1, 90),
       st.sampled_from([8, (16, 8), 32]))
def test_block_mask_of_prelude_masks_equals_create_block_mask(mask, q_len, kv_len, bs):
  q_len = min(q_len, kv_len)
  ops = testing.seeded_operand_values(kv_len)
  bm = maskc.torch.block_mask(mask, q_len, kv_len, operands=ops, block_size=bs)
  mm = maskc.torch.mask_mod(mask, operands=ops, q_offset=kv_len - q_len, q_len=q_len,
                            kv_len=kv_len)
  ref = flex.create_block_mask(mm, 1, 1, q_len, kv_len, device="cpu", BLOCK_SIZE=bs)
  for f in FIELDS:
    assert torch.equal(getattr(bm, f), getattr(ref, f)), f


def test_block_mask_lengths_that_are_not_whole_blocks():
  # FULL tiles that reach past the end are partial, as create_block_mask pads with False
  bm = maskc.torch.block_mask("full", 100, 70, block_size=32)
  fwd, _ = flex_grids(bm)
  want = np.full((4, 3), FULL, np.int8)
  want[-1, :] = PARTIAL
  want[:, -1] = PARTIAL
  np.testing.assert_array_equal(fwd[0, 0], want)
  assert bm.shape == (1, 1, 100, 70)
  ref = flex.create_block_mask(lambda b, h, q, k: q >= 0, 1, 1, 100, 70, device="cpu",
                               BLOCK_SIZE=32)
  for f in FIELDS:
    assert torch.equal(getattr(bm, f), getattr(ref, f)), f


def test_block_mask_aligns_bottom_right_by_default():
  bm = maskc.torch.block_mask("causal", 128, 512, block_size=128)
  assert bm.kv_num_blocks.tolist() == [[[1]]] and bm.full_kv_num_blocks.tolist() == [[[3]]]
  top = maskc.torch.block_mask("causal", 128, 512, block_size=128, q_offset=0)
  assert top.kv_num_blocks.tolist() == [[[1]]] and top.full_kv_num_blocks.tolist() == [[[0]]]


def test_block_mask_batch_and_heads_follow_operands_and_lists():
  seg = np.stack([np.repeat(np.arange(4), 64), np.repeat(np.arange(8), 32)])
  masks = ["causal & document(seg)", "sliding(40)", "causal & document(seg)"]
  bm = maskc.torch.block_mask(masks, 256, operands={"seg": seg}, block_size=32)
  assert bm.kv_num_blocks.shape == (2, 3, 8) and bm.kv_indices.shape == (2, 3, 8, 8)
  d = dense(masks, 256, 256, 0, {"seg": seg})
  fwd, bwd = flex_grids(bm)
  np.testing.assert_array_equal(fwd, tile_states(d, 32, 32))
  np.testing.assert_array_equal(bwd, fwd)
  assert maskc.torch.block_mask("causal", 64).kv_num_blocks.shape == (1, 1, 1)


def test_block_mask_takes_numpy_jax_and_torch_operands_alike():
  import jax.numpy as jnp
  seg = np.repeat(np.arange(3), 50)
  got = [maskc.torch.block_mask("causal & document(seg)", 150, operands={"seg": s},
                                block_size=16) for s in (seg, jnp.asarray(seg),
                                                         torch.as_tensor(seg))]
  for f in FIELDS:
    assert torch.equal(getattr(got[0], f), getattr(got[1], f))
    assert torch.equal(getattr(got[0], f), getattr(got[2], f))


def test_block_mask_errors():
  with pytest.raises(maskc.MaskTypeError, match="block_size"):
    maskc.torch.block_mask("causal", 64, block_size="128")
  with pytest.raises(maskc.OperandError, match="missing operand `seg`"):
    maskc.torch.block_mask("document(seg)", 64)
  with pytest.raises(maskc.MaskSyntaxError):
    maskc.torch.block_mask("causal &", 64)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_ordered_lists_match_a_stable_argsort_of_the_grid(data):
  n_lines, n_other = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 9))
  grid = np.asarray(data.draw(st.lists(st.lists(st.sampled_from([EMPTY, PARTIAL, FULL]),
                                                min_size=n_other, max_size=n_other),
                                       min_size=n_lines, max_size=n_lines)), np.int8)
  line_ragged, other_ragged = data.draw(st.booleans()), data.draw(st.booleans())
  from maskc.compiled.tiles import runs_from_grid
  runs = runs_from_grid(np, grid[None, None])
  line, a, z, state = _lists.flat_runs(runs, n_other, last_line_ragged=line_ragged,
                                       last_other_ragged=other_ragged)
  want = grid.copy()
  if line_ragged:
    want[-1][want[-1] == FULL] = PARTIAL
  if other_ragged:
    want[:, -1][want[:, -1] == FULL] = PARTIAL
  for s in (PARTIAL, FULL):
    sel = state == s
    num, idx = _lists.ordered_lists(line[sel], a[sel], z[sel], n_lines, n_other)
    np.testing.assert_array_equal(num, (want == s).sum(-1))
    np.testing.assert_array_equal(idx, np.argsort(want != s, axis=-1, kind="stable"))


# ----------------------------------------------------------------------------- flex_attention


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_flex_attention_with_maskc_block_mask_equals_torch_and_float64(data):
  mask = data.draw(testing.masks(max_depth=2, operands=("seg", "img")), label="mask")
  q_len = data.draw(st.integers(1, 70), label="q_len")
  kv_len = data.draw(st.integers(q_len, 80), label="kv_len")
  ops = data.draw(testing.operand_values(mask, (q_len, kv_len, None), batch=None),
                  label="operands")
  g = torch.Generator().manual_seed(0)
  q, k, v = (torch.randn(2, 2, n, 8, generator=g) for n in (q_len, kv_len, kv_len))
  ours = maskc.torch.block_mask(mask, q_len, kv_len, operands=ops, block_size=16)
  theirs = flex.create_block_mask(ours.mask_mod, 1, 1, q_len, kv_len, device="cpu",
                                  BLOCK_SIZE=16)
  a = flex.flex_attention(q, k, v, block_mask=ours)
  b = flex.flex_attention(q, k, v, block_mask=theirs)
  torch.testing.assert_close(a, b, rtol=0, atol=0)
  want = reference_attention(q, k, v, dense(mask, q_len, kv_len, kv_len - q_len, ops))
  assert_close(a, want, 1e-5)


def test_flex_attention_per_head_masks_batch_operands_and_gqa():
  g = torch.Generator().manual_seed(1)
  q = torch.randn(2, 4, 96, 16, generator=g)
  k, v = torch.randn(2, 2, 160, 16, generator=g), torch.randn(2, 2, 160, 16, generator=g)
  seg = np.stack([np.repeat(np.arange(5), 32), np.repeat(np.arange(10), 16)])
  masks = ["causal & document(seg)", "sliding(20)", "causal | sink(4)", "full"]
  out = maskc.torch.flex_attention(q, k, v, masks, operands={"seg": torch.as_tensor(seg)},
                                   block_size=32, enable_gqa=True)
  want = reference_attention(q, k, v, dense(masks, 96, 160, 64, {"seg": seg}))
  assert_close(out, want, 1e-5)


def test_flex_attention_lengths_not_whole_blocks_and_top_left_alignment():
  g = torch.Generator().manual_seed(2)
  q, k, v = torch.randn(1, 1, 50, 8, generator=g), *(torch.randn(1, 1, 77, 8, generator=g)
                                                      for _ in range(2))
  out = maskc.torch.flex_attention(q, k, v, "causal", q_offset=0, block_size=32, scale=0.5)
  want = reference_attention(q, k, v, np.tril(np.ones((50, 77), bool)), scale=0.5)
  assert_close(out, want, 1e-5)


def test_flex_attention_caches_block_masks_by_operand_identity_and_version():
  _attention._CACHE.clear()
  q = k = v = torch.randn(1, 1, 64, 8)
  seg = torch.repeat_interleave(torch.arange(2), 32)
  ops = {"seg": seg}
  maskc.torch.flex_attention(q, k, v, "document(seg)", operands=ops, block_size=16)
  maskc.torch.flex_attention(q, k, v, "document(seg)", operands=ops, block_size=16)
  assert len(_attention._CACHE) == 1
  seg[40:] = 2  # in place: a new version
  out = maskc.torch.flex_attention(q, k, v, "document(seg)", operands=ops, block_size=16)
  assert len(_attention._CACHE) == 2
  want = reference_attention(q, k, v, dense("document(seg)", 64, 64, 0, {"seg": seg.numpy()}))
  assert_close(out, want, 1e-5)
  array = np.repeat(np.arange(2), 32)
  maskc.torch.flex_attention(q, k, v, "document(seg)", operands={"seg": array}, block_size=16)
  maskc.torch.flex_attention(q, k, v, "document(seg)", operands={"seg": array.copy()},
                             block_size=16)
  assert len(_attention._CACHE) == 3  # NumPy operands by value


def test_flex_attention_errors():
  q = k = v = torch.randn(2, 4, 32, 8)
  with pytest.raises(maskc.MaskValueError, match="2 heads, the query 4"):
    maskc.torch.flex_attention(q, k, v, ["causal", "full"])
  seg = np.zeros((3, 32), int)
  with pytest.raises(maskc.MaskValueError, match="batch of 3, the query 2"):
    maskc.torch.flex_attention(q, k, v, "document(seg)", operands={"seg": seg})
  with pytest.raises(maskc.MaskValueError, match=r"\[B, H, L, D\]"):
    maskc.torch.flex_attention(q[0], k[0], v[0], "causal")


def test_compiled_flex_attention_runs_maskc_lists_and_mask_mod():
  """torch.compile's CPU kernel reads the block lists (it skips left-out blocks and applies
  no mask_mod on full ones) and traces the mask_mod: the result must still match."""
  g = torch.Generator().manual_seed(3)
  q, k, v = (torch.randn(1, 2, 256, 16, generator=g) for _ in range(3))
  seg = torch.repeat_interleave(torch.arange(4), 64)
  mask = "causal & document(seg) | sink(3)"
  bm = maskc.torch.block_mask(mask, 256, operands={"seg": seg}, block_size=64)
  out = torch.compile(flex.flex_attention)(q, k, v, block_mask=bm)
  want = reference_attention(q, k, v, dense(mask, 256, 256, 0, {"seg": seg.numpy()}))
  assert_close(out, want, 1e-5)
