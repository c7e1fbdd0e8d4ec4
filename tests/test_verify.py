"""maskc.verify on foreign masks that need no torch: dense NumPy and jax arrays (memory-mapped
files too), JAX splash mask objects, and the `maskc verify` command. Every counterexample is
checked to be a real disagreement, against `maskc.materialize` and the foreign mask read
directly. Torch objects (dense tensors, BlockMasks, mask_mods): tests/test_verify_torch.py.
"""

from __future__ import annotations

import tracemalloc

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash

import maskc
from maskc import testing
from maskc.cli import main
from maskc.semantics.shape import Shape

OPERANDS = {"seg": "segments", "img": "image", "n": "scalar", "allowed": "pairwise"}


def tril(q_len: int, kv_len: int, k: int = 0) -> np.ndarray:
  return np.tril(np.ones((q_len, kv_len), bool), k)


def assert_real(result: maskc.Verification, mask, foreign_at, q_len, kv_len, q_offset=None,
                operands=None) -> None:
  """The counterexample is a position where maskc's mask and the foreign mask differ, with the
  values the result reports; `foreign_at(b, h, i, j)` reads the foreign mask."""
  assert not result.ok and result.counterexample is not None
  b, h, i, j = result.counterexample
  m = mask[h] if isinstance(mask, list) else mask
  d = np.asarray(maskc.materialize(m, q_len, kv_len, q_offset=q_offset, operands=operands))
  want = bool(d[b, i, j] if d.ndim == 3 else d[i, j])
  got = bool(foreign_at(b, h, i, j))
  assert want != got
  assert (result.expected, result.found) == (want, got)


# ----------------------------------------------------------------------------- dense arrays


def test_dense_numpy_equal_and_unequal():
  window = tril(64, 64) & ~tril(64, 64, -9)
  r = maskc.verify("sliding(8)", window)
  assert r.counterexample == (0, 0, 8, 0) and "allows query row 8, key 0" in r.why
  assert_real(r, "sliding(8)", lambda b, h, i, j: window[i, j], 64, 64)
  ok = maskc.verify("sliding(9)", window)
  assert ok.ok and bool(ok) and ok.counterexample is None and "equals" in str(ok)
  assert ok.shape == (64, 64, 0) and ok.foreign == "a dense NumPy array"


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_a_materialized_mask_verifies_and_each_flip_is_found_first(data):
  mask = data.draw(testing.masks(max_depth=2, operands=OPERANDS), label="mask")
  shape = data.draw(testing.shapes(max_len=40), label="shape")
  ops = data.draw(testing.operand_values(mask, shape), label="operands")
  q_len, kv_len, off = shape[0], shape[1], int(Shape.of(*shape).q_offset)
  d = np.asarray(maskc.materialize(mask, q_len, kv_len, q_offset=off, operands=ops))
  d4 = d[:, None] if d.ndim == 3 else d
  assert maskc.verify(mask, d4, operands=ops, q_offset=off).ok
  flips = data.draw(st.lists(st.tuples(st.integers(0, d4.size - 1)), min_size=1, max_size=3),
                    label="flips")
  bad = d4.copy()
  for (f,) in flips:
    bad.reshape(-1)[f] ^= True
  diff = np.argwhere(bad != d4)
  if not diff.size:
    return
  r = maskc.verify(mask, bad, operands=ops, q_offset=off)
  first = tuple(int(x) for x in diff[0])  # row-major over (batch, head, row, col)
  want = (first[0], first[1], first[2], first[3]) if bad.ndim == 4 else (0, 0) + first
  assert r.counterexample == want
  assert_real(r, mask, lambda b, h, i, j: bad[b, h, i, j] if bad.ndim == 4 else bad[i, j],
              q_len, kv_len, off, ops)


def test_batch_and_heads_of_a_dense_array():
  seg = np.stack([np.repeat(np.arange(4), 50), np.repeat(np.arange(5), 40)])
  masks = ["causal & document(seg)", "sliding(16)"]
  d = np.asarray(maskc.materialize(masks, 200, operands={"seg": seg}))  # [2, 2, 200, 200]
  assert maskc.verify(masks, d, operands={"seg": seg}).ok
  # one mask for every head
  same = np.repeat(d[:, :1], 3, axis=1)
  assert maskc.verify(masks[0], same, operands={"seg": seg}).ok
  # batch 0's mask broadcast to every batch row (`B=None`): found at batch 1
  r = maskc.verify(masks[0], d[:1, :1], operands={"seg": seg})
  assert r.counterexample[:2] == (1, 0)
  assert_real(r, masks[0], lambda b, h, i, j: d[0, 0, i, j], 200, 200, operands={"seg": seg})
  # a head that differs
  wrong = d.copy()
  wrong[1, 1, 150, 140] = False
  r = maskc.verify(masks, wrong, operands={"seg": seg})
  assert r.counterexample == (1, 1, 150, 140) and "head 1" in r.why
  assert_real(r, masks, lambda b, h, i, j: wrong[b, h, i, j], 200, 200, operands={"seg": seg})


def test_padding_ids_attending_each_other_are_found():
  seg = np.array([1] * 70 + [2] * 40 + [0] * 18)  # 0: padding, which attends nothing
  mask = "causal & document(seg) & seg[q] > 0"
  i, j = np.arange(128)[:, None], np.arange(128)[None]
  buggy = (j <= i) & (seg[:, None] == seg[None])  # forgot the padding
  r = maskc.verify(mask, buggy, operands={"seg": seg})
  assert r.counterexample == (0, 0, 110, 110)
  assert_real(r, mask, lambda b, h, i, j: buggy[i, j], 128, 128, operands={"seg": seg})


def test_jax_arrays_and_integer_arrays():
  d = jnp.asarray(maskc.materialize("causal & chunk(16)", 100))
  assert maskc.verify("causal & chunk(16)", d).ok
  assert maskc.verify("causal & chunk(16)", np.asarray(d).astype(np.int8)).ok
  r = maskc.verify("causal & chunk(8)", d)
  assert r.counterexample == (0, 0, 8, 0)
  assert_real(r, "causal & chunk(8)", lambda b, h, i, j: d[i, j], 100, 100)


def test_alignment_is_maskc_bottom_right_unless_told():
  top_left = tril(3, 5)
  r = maskc.verify("causal", top_left)
  assert not r.ok and "pass q_offset=0" in r.why
  assert maskc.verify("causal", top_left, q_offset=0).ok
  assert maskc.verify("causal", tril(3, 5, 2)).ok


def test_memory_mapped_file_is_read_a_band_of_rows_at_a_time(tmp_path):
  n = 4096
  seg = np.repeat(np.arange(n // 512), 512)
  path = tmp_path / "mask.npy"
  big = np.lib.format.open_memmap(path, mode="w+", dtype=bool, shape=(n, n))
  cm = maskc.ComputableMask("causal & document(seg)", n, operands={"seg": seg})
  for r0 in range(0, n, 512):
    big[r0:r0 + 512] = cm[r0:r0 + 512, :]
  big[3000, 2600] = False
  big.flush()
  del big
  mapped = np.load(path, mmap_mode="r")
  tracemalloc.start()
  r = maskc.verify("causal & document(seg)", mapped, operands={"seg": seg})
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  assert r.counterexample == (0, 0, 3000, 2600)
  assert peak < n * n // 2, peak  # never the n x n mask (16 MiB), nor its int64 prefix sums


def test_dense_errors():
  with pytest.raises(maskc.MaskValueError, match="ambiguous"):
    maskc.verify("causal", np.ones((2, 8, 8), bool))
  with pytest.raises(maskc.MaskValueError, match=r"\[Lq, Lk\] or \[B, H, Lq, Lk\]"):
    maskc.verify("causal", np.ones(8, bool))
  with pytest.raises(maskc.MaskTypeError, match="booleans"):
    maskc.verify("causal", np.ones((8, 8)))
  with pytest.raises(maskc.MaskTypeError, match="other than 0 and 1"):
    maskc.verify("causal", np.full((8, 8), 2))
  with pytest.raises(maskc.MaskValueError, match="q_len=9 was given"):
    maskc.verify("causal", tril(8, 8), 9)
  with pytest.raises(maskc.MaskValueError, match="3 heads, the list of masks 2"):
    maskc.verify(["causal", "full"], np.ones((1, 3, 8, 8), bool))
  with pytest.raises(maskc.MaskValueError, match="batch of 3, the operands 2"):
    maskc.verify("document(seg)", np.ones((3, 1, 8, 8), bool),
                 operands={"seg": np.zeros((2, 8), int)})
  with pytest.raises(maskc.MaskTypeError, match="maskc.equivalent"):
    maskc.verify("causal", "causal")
  with pytest.raises(maskc.MaskTypeError, match="cannot verify a builtins.dict"):
    maskc.verify("causal", {})
  with pytest.raises(maskc.MaskValueError, match="pass q_len"):
    maskc.verify("causal", lambda b, h, q, k: q >= k)


# ----------------------------------------------------------------------------- splash masks


def test_splash_masks():
  assert maskc.verify("causal", splash.CausalMask((256, 256))).ok
  assert maskc.verify("causal & local(10, 0)", splash.LocalMask((300, 300), (10, 0), 0)).ok
  assert maskc.verify("causal & chunk(64)", splash.ChunkedCausalMask((256, 256), 64)).ok
  assert maskc.verify("full", splash.FullMask((100, 200))).ok
  window = tril(200, 200) & ~tril(200, 200, -32)
  assert maskc.verify("sliding(32)", splash.NumpyMask(window)).ok
  either = splash.LogicalOr(splash.LocalMask((256, 256), (16, 0), 0),
                            splash.NumpyMask(np.pad(np.ones((256, 4), bool), ((0, 0), (0, 252)))))
  assert maskc.verify("sliding(17) | sink(4)", either).ok
  # splash counts rows from 0: top-left alignment
  assert maskc.verify("causal", splash.CausalMask((100, 300)), q_offset=0).ok
  r = maskc.verify("causal", splash.CausalMask((100, 300)))
  assert r.counterexample == (0, 0, 0, 1)
  r = maskc.verify("causal & local(9, 0)", splash.LocalMask((300, 300), (10, 0), 0))
  assert r.counterexample == (0, 0, 10, 0)
  m = splash.LocalMask((300, 300), (10, 0), 0)
  assert_real(r, "causal & local(9, 0)", lambda b, h, i, j: m[i:i + 1, j:j + 1][0, 0], 300, 300)


def test_splash_multi_head_mask():
  mh = splash.MultiHeadMask([splash.CausalMask((256, 256)),
                             splash.LocalMask((256, 256), (10, 0), 0)])
  assert maskc.verify(["causal", "causal & local(10, 0)"], mh).ok
  r = maskc.verify(["causal", "causal & local(9, 0)"], mh)
  assert r.counterexample == (0, 1, 10, 0)
  assert_real(r, ["causal", "causal & local(9, 0)"],
              lambda b, h, i, j: mh[h, i:i + 1, j:j + 1][0, 0], 256, 256)


def test_tokamax_masks():
  tm = pytest.importorskip(
      "tokamax._src.ops.experimental.tpu.splash_attention.splash_attention_mask")
  assert maskc.verify("causal", tm.CausalMask((256, 256))).ok
  assert maskc.verify("causal & chunk(64)", tm.ChunkedCausalMask((256, 256), 64)).ok
  local = tm.LocalMask((300, 300), (10, 0), 0)
  r = maskc.verify("causal & local(9, 0)", local)
  assert r.counterexample == (0, 0, 10, 0) and r.foreign == "the tokamax mask LocalMask"
  assert_real(r, "causal & local(9, 0)", lambda b, h, i, j: local[i:i + 1, j:j + 1][0, 0],
              300, 300)


def test_a_computable_mask_with_a_batch():
  seg = np.stack([np.repeat(np.arange(2), 64), np.repeat(np.arange(4), 32)])
  cm = maskc.ComputableMask("causal & document(seg)", 128, operands={"seg": seg})
  assert maskc.verify("causal & document(seg)", cm, operands={"seg": seg}).ok
  r = maskc.verify("causal & document(seg)", cm, operands={"seg": seg[::-1].copy()})
  assert r.counterexample[0] == 0
  assert_real(r, "causal & document(seg)", lambda b, h, i, j: cm[b, i, j], 128, 128,
              operands={"seg": seg[::-1].copy()})


# ----------------------------------------------------------------------------- the command


def test_cli_verify(tmp_path, capsys):
  window = tril(64, 64) & ~tril(64, 64, -9)
  np.save(tmp_path / "w.npy", window)
  assert main(["verify", "sliding(9)", "--against", str(tmp_path / "w.npy")]) == 0
  assert capsys.readouterr().out.startswith("ok: ")
  assert main(["verify", "sliding(8)", "--against", str(tmp_path / "w.npy")]) == 1
  out = capsys.readouterr().out
  assert out.startswith("differs: ") and "q_index 8, k_index 0: the file has true" in out
  np.savez(tmp_path / "one.npz", w=window)
  assert main(["verify", "sliding(9)", "--against", str(tmp_path / "one.npz")]) == 0
  np.savez(tmp_path / "two.npz", w=window, x=window)
  assert main(["verify", "sliding(9)", "--against", str(tmp_path / "two.npz")]) == 1
  assert "Name the mask with --key" in capsys.readouterr().err
  assert main(["verify", "sliding(9)", "--against", str(tmp_path / "two.npz"), "--key", "x"]) == 0
  seg = np.repeat(np.arange(2), 32)
  np.save(tmp_path / "seg.npy", seg)
  d = maskc.materialize("causal & document(seg)", 32, 64, operands={"seg": seg})
  np.save(tmp_path / "d.npy", d)
  assert main(["verify", "causal & document(seg)", "--against", str(tmp_path / "d.npy"),
               "--operand", f"seg=@{tmp_path / 'seg.npy'}"]) == 0
  assert main(["verify", "causal & document(seg)", "--against", str(tmp_path / "d.npy"),
               "--operand", f"seg=@{tmp_path / 'seg.npy'}", "--offset", "0"]) == 1
  capsys.readouterr()
  assert main(["verify", "causal", "--against", str(tmp_path / "nope.npy")]) == 1
  assert "no such file" in capsys.readouterr().err
  (tmp_path / "m.txt").write_text("1")
  assert main(["verify", "causal", "--against", str(tmp_path / "m.txt")]) == 1
  assert ".npy, .npz or .pt" in capsys.readouterr().err
