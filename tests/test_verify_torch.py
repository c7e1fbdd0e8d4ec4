"""maskc.verify on torch objects: dense tensors, FlexAttention BlockMasks (their lists and their
mask_mod) and bare mask_mods, equal and unequal, with the bugs users meet (a window one token
off, padding ids attending each other, a `B=None` block mask built from batch 0, lists edited
by hand). Every counterexample is checked to be a real disagreement: the foreign mask is read
at it directly (a BlockMask through its own lists and mask_mod, as its kernels use them) and
compared with `maskc.materialize`.

Needs torch (`make test-torch`, marker `torch`).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from hypothesis import given, settings, strategies as st  # noqa: E402
from torch.nn.attention.flex_attention import BlockMask, create_block_mask  # noqa: E402

import maskc  # noqa: E402
import maskc.torch  # noqa: E402
from maskc import testing  # noqa: E402
from maskc.cli import main  # noqa: E402
from tests.helpers import EMPTY, FULL, flex_grids  # noqa: E402

L = 256


def one(fn, b, h, i, j) -> bool:
  return bool(fn(*(torch.tensor(x) for x in (b, h, i, j))))


def block_mask_at(bm, b, h, i, j) -> bool:
  """A BlockMask's value as FlexAttention's kernels take it: its lists, then its mask_mod."""
  fwd, _ = flex_grids(bm)
  bq, bk = bm.BLOCK_SIZE
  state = fwd[b if fwd.shape[0] > 1 else 0, h if fwd.shape[1] > 1 else 0, i // bq, j // bk]
  return state == FULL or (state != EMPTY and one(bm.mask_mod, b, h, i, j))


def assert_real(result, mask, foreign_at, q_len, kv_len, q_offset=None, operands=None):
  assert not result.ok and result.counterexample is not None
  b, h, i, j = result.counterexample
  m = mask[h] if isinstance(mask, list) else mask
  d = np.asarray(maskc.materialize(m, q_len, kv_len, q_offset=q_offset, operands=operands))
  want = bool(d[b, i, j] if d.ndim == 3 else d[i, j])
  assert want != bool(foreign_at(b, h, i, j))
  assert (result.expected, result.found) == (want, not want)


def test_dense_tensor():
  d = torch.from_numpy(np.asarray(maskc.materialize("causal & sliding(10)", 100)))
  assert maskc.verify("causal & sliding(10)", d).ok
  r = maskc.verify("sliding(9)", d)
  assert r.counterexample == (0, 0, 9, 0) and r.foreign == "a dense torch tensor"
  assert_real(r, "sliding(9)", lambda b, h, i, j: d[i, j], 100, 100)
  assert maskc.verify("causal & sliding(10)", d[None, None].expand(1, 2, 100, 100)).ok


def test_block_mask_from_create_block_mask_and_a_window_one_token_off():
  def window(b, h, q, k):  # meant: 64 keys, self included
    return (k <= q) & (q - k <= 64)

  bm = create_block_mask(window, 1, 1, L, L, device="cpu", BLOCK_SIZE=32)
  assert maskc.verify("sliding(65)", bm).ok
  r = maskc.verify("sliding(64)", bm)
  assert r.counterexample == (0, 0, 64, 0) and "mask_mod allows" in r.why
  assert_real(r, "sliding(64)", lambda *p: block_mask_at(bm, *p), L, L)


def test_padding_ids_attending_each_other_in_a_mask_mod_and_its_block_mask():
  seg = torch.tensor([1] * 100 + [2] * 120 + [0] * 36)  # 0: padding, which attends nothing

  def doc(b, h, q, k):
    return (seg[q] == seg[k]) & (k <= q)

  mask = "causal & document(seg) & seg[q] > 0"
  r = maskc.verify(mask, doc, L, operands={"seg": seg})
  assert r.counterexample == (0, 0, 220, 220)
  assert_real(r, mask, lambda *p: one(doc, *p), L, L, operands={"seg": seg.numpy()})
  bm = create_block_mask(doc, 1, 1, L, L, device="cpu", BLOCK_SIZE=32)
  r = maskc.verify(mask, bm, operands={"seg": seg})
  assert r.counterexample == (0, 0, 220, 220) and "mask_mod allows" in r.why
  assert_real(r, mask, lambda *p: block_mask_at(bm, *p), L, L, operands={"seg": seg.numpy()})

  def fixed(b, h, q, k):
    return doc(b, h, q, k) & (seg[q] > 0)

  assert maskc.verify(mask, fixed, L, operands={"seg": seg}).ok
  assert maskc.verify(mask, create_block_mask(fixed, 1, 1, L, L, device="cpu"),
                      operands={"seg": seg}).ok


def test_a_block_mask_built_from_batch_zero_for_every_row():
  segs = torch.stack([torch.repeat_interleave(torch.arange(4), 64),
                      torch.repeat_interleave(torch.arange(8), 32)])

  def doc(b, h, q, k):
    return (segs[b, q] == segs[b, k]) & (k <= q)

  per_batch = create_block_mask(doc, 2, 1, L, L, device="cpu", BLOCK_SIZE=32)
  assert maskc.verify("causal & document(seg)", per_batch, operands={"seg": segs}).ok
  batch0 = create_block_mask(lambda b, h, q, k: doc(b * 0, h, q, k), None, None, L, L,
                             device="cpu", BLOCK_SIZE=32)
  r = maskc.verify("causal & document(seg)", batch0, operands={"seg": segs})
  assert r.counterexample[0] == 1
  ops = {"seg": segs.numpy()}
  assert_real(r, "causal & document(seg)", lambda *p: block_mask_at(batch0, *p), L, L,
              operands=ops)
  # the lists of batch 0 with a mask_mod that reads each row's ids: the lists are wrong
  mixed = create_block_mask(lambda b, h, q, k: doc(b * 0, h, q, k), None, None, L, L,
                            device="cpu", BLOCK_SIZE=32)
  mixed.mask_mod = doc
  r = maskc.verify("causal & document(seg)", mixed, operands={"seg": segs})
  assert not r.ok and r.counterexample[0] == 1
  assert_real(r, "causal & document(seg)", lambda *p: block_mask_at(mixed, *p), L, L,
              operands=ops)


def _edited(bm, **fields):
  """A BlockMask with some of its tensors replaced (lists edited by hand)."""
  args = {f: getattr(bm, f) for f in (
      "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
      "q_indices", "full_q_num_blocks", "full_q_indices")}
  args.update(fields)
  return BlockMask(seq_lengths=bm.seq_lengths, BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=bm.mask_mod,
                   **args)


def test_lists_edited_by_hand():
  bm = maskc.torch.block_mask("causal", L, block_size=32)
  assert maskc.verify("causal", bm).ok
  # a partial block listed as full
  full_num = bm.full_kv_num_blocks.clone()
  full_idx = bm.full_kv_indices.clone()
  full_num[0, 0, 3] += 1  # row 3's full list gains block 3 (the diagonal)
  wrong = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, full_num, full_idx,
                                   BLOCK_SIZE=32, mask_mod=bm.mask_mod, seq_lengths=(L, L))
  r = maskc.verify("causal", wrong)
  assert "listed both as partial and as full" in r.why and r.counterexample == (0, 0, 96, 96)
  kv_num = bm.kv_num_blocks.clone()
  kv_num[0, 0, 3] = 0
  wrong = BlockMask.from_kv_blocks(kv_num, bm.kv_indices, full_num, full_idx, BLOCK_SIZE=32,
                                   mask_mod=bm.mask_mod, seq_lengths=(L, L))
  r = maskc.verify("causal", wrong)
  assert r.counterexample == (0, 0, 96, 97) and "lists block (3, 3) as full" in r.why
  assert_real(r, "causal", lambda *p: block_mask_at(wrong, *p), L, L)
  # a full block left out
  full_num = bm.full_kv_num_blocks.clone()
  full_num[0, 0, 5] -= 1
  wrong = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, full_num,
                                   bm.full_kv_indices, BLOCK_SIZE=32, mask_mod=bm.mask_mod,
                                   seq_lengths=(L, L))
  r = maskc.verify("causal", wrong)
  assert r.counterexample == (0, 0, 160, 128) and "leaves block (5, 4) out" in r.why
  assert_real(r, "causal", lambda *p: block_mask_at(wrong, *p), L, L)
  # a block listed twice
  idx = bm.full_kv_indices.clone()
  idx[0, 0, 5, 1] = idx[0, 0, 5, 0]
  r = maskc.verify("causal", _edited(bm, full_kv_indices=idx))
  assert "listed 2 times in full_kv_indices" in r.why
  # backward lists that disagree with the forward ones
  q_num = bm.full_q_num_blocks.clone()
  q_num[0, 0, 0] -= 1
  r = maskc.verify("causal", _edited(bm, full_q_num_blocks=q_num))
  assert "in the q lists (backward)" in r.why and r.counterexample == (0, 0, 224, 0)
  # out of range
  idx = bm.kv_indices.clone()
  idx[0, 0, 0, 0] = 99
  with pytest.raises(maskc.MaskValueError, match="outside the 8 blocks"):
    maskc.verify("causal", _edited(bm, kv_indices=idx))


def test_block_mask_shapes_heads_and_alignment():
  masks = ["causal", "sliding(20)"]
  bm = maskc.torch.block_mask(masks, 100, 300, block_size=(32, 64))
  assert maskc.verify(masks, bm).ok
  r = maskc.verify(masks[::-1], bm)
  assert r.counterexample[1] == 0
  assert_real(r, masks[::-1], lambda *p: block_mask_at(bm, *p), 100, 300)
  top = create_block_mask(lambda b, h, q, k: k <= q, 1, 1, 100, 300, device="cpu")
  assert not maskc.verify("causal", top).ok
  assert maskc.verify("causal", top, q_offset=0).ok
  with pytest.raises(maskc.MaskValueError, match="q_len=99 was given"):
    maskc.verify("causal", top, 99)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_maskc_block_masks_and_mask_mods_verify_and_a_changed_position_is_found(data):
  mask = data.draw(testing.masks(max_depth=2, operands=("seg", "img", "n")), label="mask")
  shape = data.draw(testing.shapes(max_len=48), label="shape")
  ops = data.draw(testing.operand_values(mask, shape), label="operands")
  q_len, kv_len = shape[:2]
  off = shape[2] if shape[2] is not None else kv_len - q_len
  bm = maskc.torch.block_mask(mask, q_len, kv_len, operands=ops, q_offset=off, block_size=16)
  assert maskc.verify(mask, bm, operands=ops, q_offset=off).ok
  mm = maskc.torch.mask_mod(mask, operands=ops, q_offset=off, q_len=q_len, kv_len=kv_len)
  assert maskc.verify(mask, mm, q_len, kv_len, operands=ops, q_offset=off).ok
  batch = bm.kv_num_blocks.shape[0]
  at = data.draw(st.tuples(st.integers(0, batch - 1), st.integers(0, q_len - 1),
                           st.integers(0, kv_len - 1)), label="changed position")

  def changed(b, h, q, k):
    flip = (b == at[0]) & (q == at[1]) & (k == at[2])
    return mm(b, h, q, k) ^ flip

  r = maskc.verify(mask, changed, q_len, kv_len, operands=ops, q_offset=off)
  assert r.counterexample == (at[0], 0, at[1], at[2])
  assert_real(r, mask, lambda *p: one(changed, *p), q_len, kv_len, off, ops)


def test_cli_verify_a_torch_file(tmp_path, capsys):
  d = torch.from_numpy(np.asarray(maskc.materialize("sliding(8)", 64)))
  torch.save(d, tmp_path / "w.pt")
  assert main(["verify", "sliding(8)", "--against", str(tmp_path / "w.pt")]) == 0
  assert main(["verify", "sliding(7)", "--against", str(tmp_path / "w.pt")]) == 1
  assert "q_index 7, k_index 0" in capsys.readouterr().out
  torch.save({"mask": d, "other": d}, tmp_path / "two.pt")
  assert main(["verify", "sliding(8)", "--against", str(tmp_path / "two.pt"), "--key",
               "mask"]) == 0


def test_import_maskc_and_verify_numpy_never_import_torch():
  code = ("import sys, numpy as np, maskc; "
          "assert maskc.verify('causal', np.tril(np.ones((8, 8), bool))).ok; "
          "assert 'torch' not in sys.modules, 'torch was imported'")
  subprocess.run([sys.executable, "-c", code], check=True)
