"""The kernel contract: compiled predicates, their facts, and the frozen BlockMap.

The compiled predicate must equal the mask wherever it is evaluated: NumPy and
jax.numpy directly, and inside the flash kernel (interpret mode) and splash's
kernel through the attention they compute. The dense reference here is
`maskc.materialize`, which evaluates the IR itself, not the predicate.
"""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import maskc
from maskc.compiled import predicate as _predicate
from maskc.compiled.predicate_compiler import compile_predicate
from maskc.testing import mask_trees as masks, seeded_operand_values as operand_values
from sampling import PARTS, count


def _dense_from_predicate(bm, xp, dtype):
  """Mask 0 of `bm` evaluated by its predicate with `xp` on every position: `[B', Lq, Lkv]`."""
  values = bm.read_values(0, dtype=dtype)
  values = _predicate.ReadValues(*(xp.asarray(a) for a in values))
  q = (xp.arange(bm.q_len, dtype=dtype) + int(bm.q_offset))[None, :, None]
  k = xp.arange(bm.kv_len, dtype=dtype)[None, None, :]
  fetch = _predicate.dense_fetch(values, xp, block_q=bm.block_q, block_kv=bm.block_kv,
                                 q_len=bm.q_len, kv_len=bm.kv_len)
  return np.asarray(_predicate.evaluate(bm.predicates[0], xp, q, k, fetch))


@st.composite
def cases(draw, max_len: int = 24):
  kv_len = draw(st.integers(1, max_len), label="kv_len")
  q_len = draw(st.integers(1, kv_len), label="q_len")
  mask = draw(masks(max_leaves=5, term_leaves=3), label="mask")
  batch = draw(st.sampled_from([None, 2]), label="batch")
  seed = draw(st.integers(0, 2**16), label="seed")
  bq = draw(st.sampled_from([1, 2, 4, 8]), label="block_q")
  bk = draw(st.sampled_from([1, 2, 4, 8]), label="block_kv")
  return mask, q_len, kv_len, operand_values(kv_len, seed, batch), bq, bk


# The jax.numpy evaluation of each example is slow (new shapes each time): the default run
# draws a share of the examples, `-m slow` all of them (sampling.py).
@pytest.mark.parametrize("part", PARTS)
def test_predicate_equals_the_mask_in_numpy_and_jax_numpy(part):
  settings(max_examples=count(60, part))(given(cases())(_check_predicate_equals_the_mask))()


def _check_predicate_equals_the_mask(case):
  mask, q_len, kv_len, ops, bq, bk = case
  bm = maskc.compile(mask, q_len, kv_len, block_q=bq, block_kv=bk, operands=ops)
  ref = np.asarray(maskc.materialize(mask, q_len, kv_len, operands=ops))
  ref = np.broadcast_to(ref, (bm.batch or 1, q_len, kv_len))
  np.testing.assert_array_equal(_dense_from_predicate(bm, np, np.int64), ref, err_msg=str(mask))
  np.testing.assert_array_equal(_dense_from_predicate(bm, jnp, np.int32), ref, err_msg=str(mask))
  np.testing.assert_array_equal(np.broadcast_to(bm.to_dense(), ref.shape if bm.batch else
                                                ref.shape[1:]), ref if bm.batch else ref[0])


def _mask_through_attention(backend: str, mask, q_len: int, kv_len: int, ops, bq: int, bk: int,
                            **kw):
  """The mask a backend applies, read off its attention output.

  With q = k = 0 every allowed logit is equal, and v is the identity over keys, so
  output row i is `allowed[i] / allowed[i].sum()`: nonzero exactly where allowed.
  """
  q = jnp.zeros((1, q_len, 1, 16), jnp.float32)
  k = jnp.zeros((1, kv_len, 1, 16), jnp.float32)
  v = jnp.eye(kv_len, dtype=jnp.float32)[None, :, None, :]
  out = maskc.attention(q, k, v, mask, operands=ops, backend=backend, block_q=bq, block_kv=bk,
                        interpret=True, **kw)
  return np.asarray(out[0, :, 0, :]) > 0


# A flash kernel compile per example: a share by default, all with `-m slow` (sampling.py).
@pytest.mark.parametrize("part", PARTS)
def test_flash_kernel_applies_the_predicate(part):
  settings(max_examples=count(12, part))(given(cases(max_len=32))(_check_flash_predicate))()


def _check_flash_predicate(case):
  mask, q_len, kv_len, _, _, _ = case
  ops = operand_values(kv_len, 7)   # unbatched: one picture per case
  got = _mask_through_attention("flash", mask, q_len, kv_len, ops, 16, 16)
  np.testing.assert_array_equal(got, maskc.materialize(mask, q_len, kv_len, operands=ops),
                                err_msg=str(mask))


@settings(max_examples=6)
@given(masks(max_leaves=4, term_leaves=3), st.integers(0, 2**16))
def test_splash_kernel_applies_the_predicate(mask, seed):
  ops = operand_values(128, seed)
  got = _mask_through_attention("splash", mask, 128, 128, ops, 128, 128)
  np.testing.assert_array_equal(got, maskc.materialize(mask, 128, operands=ops),
                                err_msg=str(mask))


# ----------------------------------------------------------------------------- facts


@pytest.mark.parametrize("text", [
    "causal & document(seg)",
    "causal & seg[q] == seg[k]",
    "seg[k] == seg[q] & causal",
    "local_doc = causal & chunk(8) & document(seg)\nlocal_doc",
    "document(seg) & (causal | bidirectional(img))",
])
def test_segment_equalities_are_found_anywhere_in_the_conjunction(text):
  p = compile_predicate(maskc.parse(text))
  assert len(p.segments) == 1
  qs, ks = p.segments[0]
  assert p.q_reads[qs].text == "seg[q]" and p.k_reads[ks].text == "seg[k]"
  assert p.rest is not None and not any(r.array == "seg" for r in p.rest.q_reads + p.rest.k_reads)


@pytest.mark.parametrize("text", ["causal | document(seg)", "~document(seg)",
                                  "seg[q] == seg[k + 1]", "seg[q] == img[k]"])
def test_no_segment_fact_where_the_equality_is_not_a_conjunct(text):
  assert compile_predicate(maskc.parse(text)).segments == ()


@pytest.mark.parametrize("text, band, chunk", [
    ("causal", (0, None), None),
    ("sliding(100)", (0, 99), None),
    ("local(3, 5)", (-5, 3), None),
    ("causal & chunk(64)", (0, None), 64),
    ("q - k < 7 & k <= q", (0, 6), None),
    ("full", (None, None), None),
    ("causal | sink(4)", (None, None), None),
])
def test_band_and_chunk_facts(text, band, chunk):
  p = compile_predicate(maskc.parse(text))
  assert (p.band, p.chunk) == (band, chunk)


@given(st.integers(-20, 20), st.integers(-20, 20))
def test_band_fact_is_sound(lo, hi):
  text = f"q - k >= {lo} & q - k <= {hi}"
  p = compile_predicate(maskc.parse(text))
  dense = maskc.materialize(text, 48, 48, q_offset=0)
  d = np.arange(48)[:, None] - np.arange(48)[None, :]
  assert p.band == (lo, hi)
  assert not (dense & ((d < lo) | (d > hi))).any()


# ----------------------------------------------------------------------------- splash segments


@pytest.mark.parametrize("text", [
    "causal & s[q] == s[k]",
    "local_doc = causal & document(s)\nlocal_doc",
    "document(s) & (causal | bidirectional(img))",
])
def test_splash_takes_batched_segment_ids_for_every_spelling(text):
  rng = np.random.default_rng(0)
  seg = np.sort(rng.integers(0, 3, size=(2, 256)), axis=-1).astype(np.int32)
  img = np.zeros(256, bool)
  img[40:90] = True
  ops = {"s": seg, "img": img} if "img" in text else {"s": seg}
  bm = maskc.compile(text, 256, block_q=128, block_kv=128, operands=ops)
  assert bm.segment_split is not None
  q, k, v = (jax.random.normal(jax.random.key(i), (2, 256, 2, 32)) for i in range(3))
  out = maskc.attention(q, k, v, bm, backend="splash", interpret=True)
  ref = maskc.attention(q, k, v, text, operands=ops, backend="dense")
  np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------------- the object


def test_blockmap_is_frozen_and_its_hash_reads_no_operand_bytes():
  a = maskc.compile("causal & document(seg)", 64, block_q=16, block_kv=16,
                    operands={"seg": np.repeat([0, 1], 32)})
  b = maskc.compile("causal & document(seg)", 64, block_q=16, block_kv=16,
                    operands={"seg": np.repeat([0, 1, 2, 3], 16)})
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.rows = b.rows  # type: ignore[misc]
  assert hash(a) == hash(b) and a != b            # the static parts agree, the arrays do not
  assert a == maskc.compile("causal & document(seg)", 64, block_q=16, block_kv=16,
                            operands={"seg": np.repeat([0, 1], 32)})


def test_flattening_does_not_compile_the_backward_runs():
  bm = maskc.compile("sliding(40) | sink(3)", 512, block_q=32, block_kv=32)
  calls = []
  hook = bm.backward
  bm = dataclasses.replace(bm, backward=lambda: calls.append(1) or hook())
  leaves, tree = jax.tree_util.tree_flatten(bm)
  assert calls == [] and bm.col_runs is None
  again = jax.tree_util.tree_unflatten(tree, leaves)
  np.testing.assert_array_equal(again.cols.count, bm.cols.count)
  assert len(calls) == 2                          # asked for twice, never stored on the map
  grid = np.asarray(bm.grid)
  cols = maskc.compiled.tiles.grid_from_runs(np, bm.cols, bm.n_q_tiles)[0, 0]
  np.testing.assert_array_equal(cols, grid.T)


@settings(max_examples=30)
@given(cases())
def test_flex_counts_and_density_come_from_the_runs(case):
  mask, q_len, kv_len, ops, bq, bk = case
  bm = maskc.compile(mask, q_len, kv_len, block_q=bq, block_kv=bk, operands=ops)
  g = np.asarray(bm.grid).reshape(((bm.batch or 1), 1, bm.n_q_tiles, bm.n_kv_tiles))
  flex = bm.flex()
  for name, gg in (("kv", g), ("q", np.swapaxes(g, -1, -2))):
    for prefix, state in (("", 1), ("full_", 2)):
      count = flex[f"{prefix}{name}_num_blocks"]
      idx = flex[f"{prefix}{name}_indices"]
      np.testing.assert_array_equal(count, (gg == state).sum(-1))
      for b, h, i in np.ndindex(count.shape):
        np.testing.assert_array_equal(idx[b, h, i, :count[b, h, i]],
                                      np.flatnonzero(gg[b, h, i] == state))
  assert bm.counts == {"empty": int((g == 0).sum()), "partial": int((g == 1).sum()),
                       "full": int((g == 2).sum())}
  assert bm.density == pytest.approx((g != 0).mean())


def torch_ordered(chosen: np.ndarray) -> np.ndarray:
  """torch's `_dense_to_ordered` index lists, written out: per line its chosen tiles in
  order, then the line's other tiles in order."""
  out = np.zeros(chosen.shape, np.int32)
  for line in np.ndindex(chosen.shape[:-1]):
    row = chosen[line]
    out[line] = np.concatenate([np.flatnonzero(row), np.flatnonzero(~row)])
  return out


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("text", ["causal", "sliding(20) | sink(3)", "causal & document(seg)"])
def test_flex_index_lists_are_padded_as_torch_pads_them(text, traced):
  seg = np.repeat(np.arange(6), 16)[None].repeat(2, 0).astype(np.int32)
  seg[1] = np.sort(seg[1][::-1] % 4)
  m = maskc.parse(text)
  ops = {"seg": seg} if m.operands else {}

  def flex(ops):
    return maskc.compile(m, 96, block_q=16, block_kv=8, operands=ops).flex()

  got = jax.jit(flex)({n: jnp.asarray(a) for n, a in ops.items()}) if traced else flex(ops)
  bm = maskc.compile(m, 96, block_q=16, block_kv=8, operands=ops)
  g = np.asarray(bm.grid).reshape(((bm.batch or 1), 1, bm.n_q_tiles, bm.n_kv_tiles))
  for name, gg in (("kv", g), ("q", np.swapaxes(g, -1, -2))):
    for prefix, state in (("", 1), ("full_", 2)):
      np.testing.assert_array_equal(np.asarray(got[f"{prefix}{name}_indices"]),
                                    torch_ordered(gg == state), err_msg=f"{prefix}{name}")


# ----------------------------------------------------------------------------- reliability


def test_kernels_refuse_terms_past_int32():
  x = jnp.ones((1, 4, 1, 8))
  ops = {"seg": np.full(4, 2**31 - 1)}
  assert maskc.materialize("q + seg[k] > 0", 4, operands=ops).all()   # exact in int64
  assert maskc.compile("q + seg[k] > 0", 4, operands=ops).int_range == (0, 2**31 + 2)
  for backend in ("dense", "xla", "flash"):
    with pytest.raises(maskc.MaskValueError, match="int32"):
      maskc.attention(x, x, x, "q + seg[k] > 0", operands=ops, backend=backend, interpret=True)


@pytest.mark.parametrize("mask, ops", [
    ("a[q, k]", {"a": np.tril(np.ones((256, 256), bool))}),
    ("causal & k < n", {"n": np.int32(200)}),
    ("causal & document(seg) & k < n",
     {"seg": np.repeat(np.arange(4), 64).astype(np.int32), "n": np.int32(230)}),
])
def test_splash_under_jit_with_traced_operands(mask, ops):
  x = jax.random.uniform(jax.random.key(0), (1, 256, 1, 32))
  f = jax.jit(lambda x, ops: maskc.attention(x, x, x, mask, operands=ops, backend="splash",
                                             interpret=True, block_q=128, block_kv=128))
  out = f(x, ops)
  ref = maskc.attention(x, x, x, mask, operands=ops, backend="dense")
  np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
