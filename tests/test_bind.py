"""Binding masks to shapes: lazy `ComputableMask` tiles, `materialize` under jit.

A `ComputableMask` must slice like the dense mask and evaluate its `mask_function` with
NumPy and jax.numpy (splash's use of it: tests/test_splash_info.py). `materialize` must
give the NumPy answer under `jax.jit` with traced operands of every supported shape.
"""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import maskc
from maskc.testing import mask_trees, prefill_shapes, seeded_operand_values


def dense(m, q_len, kv_len=None, q_offset=None, operands=None):
  return np.asarray(maskc.materialize(m, q_len, kv_len, q_offset=q_offset, operands=operands))


# ----------------------------------------------------------------------------- lazy tiles

TILE_CASES = [
    ("causal", 16, 16, None, {}),
    ("sliding(3) | sink(1)", 8, 12, None, {}),
    ("causal & chunk(4) | bidirectional(img)", 12, 12, None,
     {"img": np.array([0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0], dtype=bool)}),
    ("local(2, 1) & document(seg)", 6, 10, 3, {"seg": np.repeat(np.arange(5), 2)}),
    ("causal & k < n", 9, 9, None, {"n": 5}),
]


@pytest.mark.parametrize("text,q_len,kv_len,q_offset,operands", TILE_CASES,
                         ids=[c[0] for c in TILE_CASES])
def test_tiles_equal_slices_of_the_dense_mask(text, q_len, kv_len, q_offset, operands):
  cm = maskc.parse(text).bind(q_len, kv_len, q_offset=q_offset, operands=operands)
  full = dense(text, q_len, kv_len, q_offset, operands)
  assert cm.shape == (q_len, kv_len)
  np.testing.assert_array_equal(cm[:, :], full)
  for q0, q1, k0, k1 in [(0, 1, 0, kv_len), (1, 4, 2, 7), (q_len - 2, q_len, 0, 3),
                         (0, q_len, kv_len - 1, kv_len)]:
    tile = cm[q0:q1, k0:k1]
    assert tile.dtype == np.bool_
    np.testing.assert_array_equal(tile, full[q0:q1, k0:k1])
  np.testing.assert_array_equal(cm[2], full[2])
  np.testing.assert_array_equal(cm[::2, 1::3], full[::2, 1::3])
  np.testing.assert_array_equal(cm[-1, -3:], full[-1, -3:])


@given(mask_trees(6), prefill_shapes(), st.integers(0, 3))
def test_random_tiles(m, shape, seed):
  q_len, kv_len = shape
  ops = seeded_operand_values(kv_len, seed)
  cm = m.bind(q_len, kv_len, operands=ops)
  full = dense(m, q_len, kv_len, operands=ops)
  np.testing.assert_array_equal(cm[:, :], full)
  q0, k0 = q_len // 3, kv_len // 2
  np.testing.assert_array_equal(cm[q0:, k0:], full[q0:, k0:])


def test_bound_shape_and_offset():
  cm = maskc.parse("causal").bind(4, 10)
  assert cm.shape == (4, 10)
  assert (cm.q_len, cm.kv_len, cm.q_offset) == (4, 10, 6)
  assert maskc.parse("causal").bind(4, 10, q_offset=1).q_offset == 1
  assert maskc.parse("causal").bind(5).shape == (5, 5)


def test_batched_bind_has_a_leading_batch_axis():
  seg = np.array([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 2, 2]])
  cm = maskc.parse("causal & document(seg)").bind(6, operands={"seg": seg})
  full = dense("causal & document(seg)", 6, operands={"seg": seg})
  assert cm.shape == (2, 6, 6)
  np.testing.assert_array_equal(cm[:, :, :], full)
  np.testing.assert_array_equal(cm[1, 2:4, :], full[1, 2:4, :])
  np.testing.assert_array_equal(cm[:, 1:3, 2:5], full[:, 1:3, 2:5])


def test_tiles_in_row_bands_equal_one_shot_tiles(monkeypatch):
  """Big slices are evaluated a band of rows at a time (int64 temporaries stay small)."""
  from maskc.semantics import dense as _dense
  seg = np.array([[0, 0, 1, 1, 1, 2, 2, 3, 3], [0, 1, 1, 1, 2, 2, 2, 2, 3]])
  text = "causal & document(seg) | q - k == 4"
  cm = maskc.parse(text).bind(7, 9, operands={"seg": seg})
  full = dense(text, 7, 9, operands={"seg": seg})
  # The NumPy reference: positions q = 2 + i, k = j, per batch row.
  q, k = np.arange(7)[:, None] + 2, np.arange(9)[None, :]
  want = np.stack([(k <= q) & (s[np.minimum(q, 8)] == s[k]) | (q - k == 4) for s in seg])
  np.testing.assert_array_equal(full, want)
  monkeypatch.setattr(_dense, "DENSE_CHUNK", 10)  # one row (of 9 x 2 elements) per band
  for idx in [(slice(None), slice(None), slice(None)), (1, slice(None), slice(2, 7)),
              (slice(None), 3, slice(None)), (0, np.array([0, 5, 6]), slice(1, 3)),
              (slice(None), slice(1, 5), 6),
              (slice(None), np.array([True, False] * 3 + [True]), 4),
              (1, np.array([[0, 1], [2, 3]]), slice(None))]:
    np.testing.assert_array_equal(cm[idx], full[idx])
  np.testing.assert_array_equal(maskc.materialize(text, 7, 9, operands={"seg": seg}), want)


def test_to_dense_equals_materialize():
  m = maskc.parse("sliding(4) | sink(2)")
  np.testing.assert_array_equal(m.to_dense(6, 9), dense(m, 6, 9))


def test_bind_checks_operands():
  with pytest.raises(maskc.OperandError):
    maskc.parse("document(seg)").bind(4)
  with pytest.raises(maskc.OperandError):
    maskc.parse("document(seg)").bind(4, operands={"seg": jnp.zeros(4, jnp.int32)})
  with pytest.raises(maskc.MaskValueError):
    maskc.parse("causal").bind(0)
  # Terms that would leave int64, and runtime scalars that break a `where` clause.
  with pytest.raises(maskc.MaskValueError, match="64-bit"):
    maskc.parse("q * 1099511627776 > k").bind(4, q_offset=2**23)
  with pytest.raises(maskc.MaskValueError, match="a sliding window holds at least"):
    maskc.parse("sliding(n)").bind(4, operands={"n": 0})
  with pytest.raises(maskc.OperandError, match="outside int64"):
    maskc.parse("document(seg)").bind(4, operands={"seg": np.full(4, 2**63, np.uint64)})


def test_a_misspelled_operand_gets_the_nearest_given_name():
  seg = np.zeros(8, np.int32)
  for call in (lambda ops: maskc.parse("causal & document(seg)").bind(8, operands=ops),
               lambda ops: maskc.materialize("causal & document(seg)", 8, operands=ops),
               lambda ops: maskc.compile("causal & document(seg)", 8, operands=ops)):
    with pytest.raises(maskc.OperandError, match="missing operand `seg`") as e:
      call({"segs": seg})
    assert "`segs` was given" in str(e.value)
    assert "Did you mean `seg` where you wrote `segs`?" in e.value.hint
  # nothing near: no guess
  with pytest.raises(maskc.OperandError) as e:
    maskc.materialize("document(seg)", 8, operands={"img": seg})
  assert "Did you mean" not in e.value.hint and "was given" not in str(e.value)
  # a name the mask also reads is no guess for another
  with pytest.raises(maskc.OperandError) as e:
    maskc.materialize("document(seg) & document(segs)", 8, operands={"segs": seg})
  assert "Did you mean" not in e.value.hint


def test_bound_masks_compare_by_value():
  a = maskc.parse("document(seg)").bind(4, operands={"seg": np.array([0, 0, 1, 1])})
  b = maskc.parse("document(seg)").bind(4, operands={"seg": np.array([0, 0, 1, 1])})
  c = maskc.parse("document(seg)").bind(4, operands={"seg": np.array([0, 1, 1, 1])})
  assert a == b and hash(a) == hash(b)
  assert a != c
  assert "document(seg)" in repr(a)
  with pytest.raises(maskc.MaskTypeError):
    bool(a)


# ----------------------------------------------------------------------------- mask_function


@pytest.mark.parametrize("text,operands", [("causal", {}), ("sliding(3) | sink(1)", {}),
                                           ("local(2, 3) & chunk(5)", {}),
                                           ("causal & k < n", {"n": 7})])
def test_mask_function_with_numpy_and_jnp(text, operands):
  cm = maskc.parse(text).bind(8, 12, operands=operands)
  full = cm[:, :]
  q_ids, kv_ids = np.arange(8)[:, None], np.arange(12)[None, :]
  f = cm.mask_function
  np.testing.assert_array_equal(np.asarray(f(q_ids, kv_ids)), full)
  got = f(jnp.asarray(q_ids), jnp.asarray(kv_ids))
  assert isinstance(got, jax.Array)
  np.testing.assert_array_equal(np.asarray(got), full)
  got = jax.jit(f)(jnp.asarray(q_ids), jnp.asarray(kv_ids))
  np.testing.assert_array_equal(np.asarray(got), full)
  np.testing.assert_array_equal(cm.q_sequence, np.arange(8))


def test_mask_function_with_scalar_ids():
  f = maskc.parse("causal").bind(4).mask_function
  assert bool(f(np.int32(2), np.int32(1))) and not bool(f(np.int32(1), np.int32(2)))


def test_no_mask_function_for_array_operands():
  cm = maskc.parse("document(seg)").bind(4, operands={"seg": np.array([0, 0, 1, 1])})
  assert not hasattr(cm, "mask_function")
  assert not hasattr(cm, "q_sequence")


# ----------------------------------------------------------------------------- materialize, jit

SEG = np.array([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3]], dtype=np.int32)
IMG = np.array([[0, 1, 1, 0, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0, 1, 1]], dtype=bool)

JIT_CASES = [
    ("causal & document(seg)", {"seg": SEG[0]}),
    ("causal & document(seg)", {"seg": SEG}),
    ("causal | bidirectional(img)", {"img": IMG[0]}),
    ("causal | bidirectional(img)", {"img": IMG}),
    ("causal & k < n", {"n": np.int32(5)}),
    ("causal & k < n", {"n": np.array([3, 8], dtype=np.int32)}),
    ("causal | prefix(n) & document(seg)", {"n": np.array([2, 4], dtype=np.int32),
                                            "seg": SEG}),
    ("document(seg) & k < n", {"seg": SEG[1], "n": np.array([1, 6, 8], dtype=np.int32)}),
    ("allowed[q, k] & causal", {"allowed": np.random.default_rng(0).random((2, 8, 8)) < 0.5}),
    ("topk[q // 4, k // 4]", {"topk": np.array([[1, 0], [1, 1]], dtype=bool)}),
]


@pytest.mark.parametrize("text,operands", JIT_CASES,
                         ids=[f"{c[0]}-{','.join(f'{n}{v.shape}' for n, v in c[1].items())}"
                              for c in JIT_CASES])
def test_materialize_under_jit(text, operands):
  expected = dense(text, 8, operands=operands)
  names = sorted(operands)

  @jax.jit
  def f(*values):
    return maskc.materialize(text, 8, operands=dict(zip(names, values)))

  got = f(*[jnp.asarray(operands[n]) for n in names])
  assert isinstance(got, jax.Array)
  assert got.dtype == jnp.bool_
  assert got.shape == expected.shape
  np.testing.assert_array_equal(np.asarray(got), expected)


def test_materialize_with_concrete_jax_operands():
  seg = jnp.asarray(SEG)
  got = maskc.materialize("causal & document(seg)", 8, operands={"seg": seg})
  np.testing.assert_array_equal(np.asarray(got), dense("causal & document(seg)", 8,
                                                       operands={"seg": SEG}))


def test_materialize_with_traced_offset():
  f = jax.jit(lambda off: maskc.materialize("causal", 4, 8, q_offset=off))
  for off in (0, 2, 4):
    np.testing.assert_array_equal(np.asarray(f(off)), dense("causal", 4, 8, off))


def test_materialize_multi_head():
  got = maskc.materialize(["causal", "sliding(2)", maskc.sink(1)], 5)
  assert got.shape == (3, 5, 5)
  for h, m in enumerate(["causal", "sliding(2)", "sink(1)"]):
    np.testing.assert_array_equal(got[h], dense(m, 5))


def test_materialize_multi_head_batched():
  got = maskc.materialize(["causal", "document(seg)"], 8, operands={"seg": SEG})
  assert got.shape == (2, 2, 8, 8)
  np.testing.assert_array_equal(got[:, 0], np.broadcast_to(dense("causal", 8), (2, 8, 8)))
  np.testing.assert_array_equal(got[:, 1], dense("document(seg)", 8, operands={"seg": SEG}))


# ----------------------------------------------------------------------------- additive bias


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_additive_bias(dtype):
  img = np.array([0, 1, 1, 0, 0, 0], dtype=bool)
  allowed = dense("causal | bidirectional(img)", 6, operands={"img": img})
  bias = maskc.additive_bias("causal | bidirectional(img)", 6, operands={"img": img},
                             dtype=dtype)
  assert bias.dtype == dtype and bias.shape == (6, 6)
  bias = np.asarray(bias, dtype=np.float32)
  np.testing.assert_array_equal(bias[allowed], 0.0)
  neg = bias[~allowed]
  assert np.all(np.isfinite(neg))
  assert np.all(neg == neg[0]) and neg[0] < -1e4
  assert neg[0] <= -0.5 * float(jnp.finfo(dtype).max)


def test_additive_bias_softmax_has_no_nan():
  bias = maskc.additive_bias("k < n", 4, operands={"n": 0})  # every row fully masked
  assert np.all(np.isfinite(np.asarray(jax.nn.softmax(bias, axis=-1))))


def test_additive_bias_under_jit():
  f = jax.jit(lambda n: maskc.additive_bias("causal & k < n", 4, operands={"n": n}))
  bias = np.asarray(f(jnp.array([2, 4], dtype=jnp.int32)))
  allowed = dense("causal & k < n", 4, operands={"n": np.array([2, 4])})
  assert bias.shape == (2, 4, 4)
  np.testing.assert_array_equal(bias == 0, allowed)


# ----------------------------------------------------------------------------- unwritten operands


def _runs_by_loop(x):
  """`runs(x)` by a loop over the tokens: 1-based index of each run of nonzeros, 0 elsewhere."""
  out, count, prev = np.zeros(len(x), np.int64), 0, False
  for i, v in enumerate(x):
    if v and not prev:
      count += 1
    out[i] = count if v else 0
    prev = bool(v)
  return out


def test_static_token_operands_are_written_out_only_when_read():
  """Compiling reads per-token operands through their runs; the int64 arrays are written
  out when a consumer first indexes them, from binding's own copy of the runs."""
  n = 64
  seg = np.repeat(np.arange(8), 8).astype(np.int16)
  img = np.zeros(n, bool)
  img[5:20] = img[40:44] = True
  bm = maskc.compile("causal & document(seg) | bidirectional(img)", n, block_q=16, block_kv=16,
                     operands={"seg": seg, "img": img})
  assert set(bm.operands) == {"seg", "img", "runs(img)"}
  assert not any(bm.operands.written(x) for x in bm.operands)
  assert bm.operands.shape("seg") == (1, n) and bm.operands.dtype("seg") == np.int64
  want = {"seg": seg.astype(np.int64), "img": img.astype(np.int64),
          "runs(img)": _runs_by_loop(img)}
  dense = np.asarray(maskc.materialize("causal & document(seg) | bidirectional(img)", n,
                                       operands={"seg": seg, "img": img}))
  seg[:], img[:] = 3, True  # the caller's arrays change afterwards: the map's operands do not
  for name, values in want.items():
    got = bm.operands[name]
    assert bm.operands.written(name) and got.dtype == np.int64
    np.testing.assert_array_equal(got, values[None])
  np.testing.assert_array_equal(np.asarray(bm.to_dense()).reshape(n, n), dense)


def test_unwritten_operands_broadcast_to_the_batch():
  n = 32
  seg = np.stack([np.repeat(np.arange(4), 8), np.repeat(np.arange(2), 16)])
  img = np.zeros(n, bool)
  img[3:9] = True
  bm = maskc.compile("causal & document(seg) | bidirectional(img)", n, block_q=8, block_kv=8,
                     operands={"seg": seg, "img": img})
  assert bm.operands.shape("img") == (2, n) and not bm.operands.written("img")
  np.testing.assert_array_equal(bm.operands["img"], np.broadcast_to(img.astype(np.int64), (2, n)))
  np.testing.assert_array_equal(bm.operands["runs(img)"],
                                np.broadcast_to(_runs_by_loop(img), (2, n)))
  leaves, _ = jax.tree_util.tree_flatten(bm)  # a pytree of plain arrays, every one written
  assert all(isinstance(x, (np.ndarray, jax.Array, int, np.integer)) for x in leaves)


@given(st.integers(1, 12), st.integers(1, 12), st.integers(-3, 3), st.integers(-2, 2),
       st.integers(0, 14))
def test_a_read_check_remembered_for_a_shape_holds_for_others(q_len, kv_len, shift, offset,
                                                               length):
  """Reads checked once per shape (`_check_reads` remembers shapes that passed): each new
  shape and operand length is checked again, against the positions evaluated in full."""
  text = f"x[q + {shift}] == x[k]"
  q_offset = max(0, kv_len - q_len + offset)
  x = np.arange(length) % 3
  q = q_offset + np.arange(q_len) + shift
  fits = length > 0 and q.min() >= 0 and q.max() < length and kv_len <= length
  for _ in range(2):  # the second time from the remembered shapes
    if fits:
      maskc.compile(text, q_len, kv_len, q_offset=q_offset, operands={"x": x})
    else:
      with pytest.raises(maskc.OperandError):
        maskc.compile(text, q_len, kv_len, q_offset=q_offset, operands={"x": x})


@pytest.mark.parametrize("text, make", [
    ("causal & document(seg)", lambda n: {"seg": np.sort(np.arange(n) % 3).astype(np.int32)}),
    ("causal & document(seg)", lambda n: {"seg": np.arange(n, dtype=np.int32)}),  # a run a token
    ("anc[q, k]", lambda n: {"anc": np.tri(n, dtype=bool)}),
])
@pytest.mark.parametrize("n", [1, 2, 7])
def test_bound_masks_are_equal_whatever_was_read_from_them(text, make, n):
  """Two masks bound to equal operands are equal, with one hash, whether or not one of them
  has written its operands out (its tokens kept in their own dtype, or widened)."""
  m = maskc.parse(text)
  ops = make(n)
  read = m.bind(n, n, operands=ops)
  _ = read[:, :]
  fresh = m.bind(n, n, operands=ops)
  assert read == fresh and hash(read) == hash(fresh)
