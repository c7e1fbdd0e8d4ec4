"""maskc.equivalent: symbolic proofs, decisions at a shape, counterexamples, dense references."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import maskc
from helpers import assert_sound
from maskc import testing
from maskc.tools.equivalence import Equivalence, UnsoundBlockMapWarning, equivalent

# Shapes `(q_len, kv_len, q_offset)`: square, ragged (chunked prefill), decode, more
# queries than keys, explicit offsets, and lengths that are not multiples of the tiles.
SHAPES = [(1, 1, None), (7, 7, None), (64, 64, None), (100, 100, None), (33, 97, None),
          (1, 300, None), (3, 260, None), (97, 33, 0), (50, 50, 13), (129, 257, 5),
          (256, 512, None), (300, 300, 1000)]
TILES = [(128, 128), (16, 32), (1, 1), (7, 5)]


def positions(q_len, kv_len, q_offset):
  """Query and key positions as broadcastable NumPy arrays (independent of maskc)."""
  if q_offset is None:
    q_offset = kv_len - q_len
  return np.arange(q_len)[:, None] + q_offset, np.arange(kv_len)[None, :]


def check_counterexample(result: Equivalence, dense_a, dense_b):
  """The counterexample is real, matches the references, and is the first difference."""
  assert result.equal is False
  cx = result.counterexample
  assert cx is not None and cx.a != cx.b
  idx = cx.index
  assert dense_a[idx] == cx.a and dense_b[idx] == cx.b
  assert tuple(np.argwhere(dense_a != dense_b)[0]) == idx
  q_len, kv_len, q_offset = result.shape
  assert cx.q == cx.row + q_offset and cx.k == cx.col
  assert cx.tile == (cx.row // result.block_q, cx.col // result.block_kv)
  assert cx.tile_rows[0] <= cx.row < cx.tile_rows[1] <= q_len
  assert cx.tile_cols[0] <= cx.col < cx.tile_cols[1] <= kv_len


# ----------------------------------------------------------------------------- symbolic


@pytest.mark.parametrize("a, b", [
    ("global(4)", "sink(4) | q < 4"),
    ("causal & chunk(8)", "chunk(8) & causal"),
    ("~(causal | sink(4))", "~causal & ~sink(4)"),
    ("~(document(seg) & causal)", "~document(seg) | ~causal"),
    ("document(seg)", "seg[q] == seg[k]"),
    ("causal | prefix(n)", "causal | q < n & k < n"),
    ("~~sliding(3)", "sliding(3)"),
    ("causal ^ causal", "empty"),
])
def test_symbolic_equivalence_needs_no_shape(a, b):
  r = equivalent(a, b)
  assert r.equal is True and r.verdict is True and bool(r)
  assert r.shape is None and r.reason.startswith("symbolically equal")
  assert r.counterexample is None


def test_symbolic_equivalence_holds_at_any_shape_without_operands():
  # A proof needs no evaluation, so no operand values either.
  assert equivalent("document(seg) & causal", "causal & document(seg)", 1 << 20)


@pytest.mark.parametrize("a, b", [("sliding(4)", "causal & local(3, 0)"),
                                  ("sliding(4)", "causal & local(4, 0)"),
                                  ("causal", "full")])
def test_without_a_shape_the_verdict_is_unknown_never_false(a, b):
  r = equivalent(a, b)
  assert r.equal is None and r.verdict is None and r.counterexample is None
  assert "pass a shape" in r.reason
  assert "unknown" in str(r)
  with pytest.raises(maskc.MaskTypeError, match="unknown"):
    bool(r)


# ----------------------------------------------------------------------------- at a shape

EQUAL_PAIRS = [
    # (a, b, independent NumPy formula of both)
    ("sliding(5)", "causal & local(4, 0)", lambda q, k: (q - 5 < k) & (k <= q)),
    ("sliding(64)", "causal & local(63, 0)", lambda q, k: (q - 64 < k) & (k <= q)),
    ("causal | prefix(20)", "causal | q < 20 & k < 20",
     lambda q, k: (k <= q) | ((q < 20) & (k < 20))),
    ("~(sliding(8) | sink(2))", "~sliding(8) & k >= 2",
     lambda q, k: ~(((q - 8 < k) & (k <= q)) | (k < 2))),
    ("~(causal & chunk(16))", "k > q | q // 16 != k // 16",
     lambda q, k: ~((k <= q) & (q // 16 == k // 16))),
    ("global(3)", "k < 3 | q <= 2", lambda q, k: (q < 3) | (k < 3)),
    ("causal & chunk(32)", "causal & q - q % 32 <= k",
     lambda q, k: (k <= q) & (q // 32 == k // 32)),
    ("local(2, 3)", "abs(q - k) <= 2 | k > q & k - q <= 3",
     lambda q, k: (q - 2 <= k) & (k <= q + 3)),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("a, b, formula", EQUAL_PAIRS)
def test_equal_pairs_at_many_shapes(a, b, formula, shape):
  q_len, kv_len, q_offset = shape
  q, k = positions(*shape)
  ref = np.broadcast_to(formula(q, k), (q_len, kv_len))
  for bq, bk in TILES[:2]:
    r = equivalent(a, b, q_len, kv_len, q_offset=q_offset, block_q=bq, block_kv=bk)
    assert r.equal is True, repr(r)
    assert r.shape == (q_len, kv_len, kv_len - q_len if q_offset is None else q_offset)
    assert r.reason.startswith(("equal at", "symbolically equal"))
  # The pair is not merely equal to each other: both are the formula.
  assert equivalent(a, ref, q_offset=q_offset)
  assert equivalent(ref, b, q_len, kv_len, q_offset=q_offset)


NEAR_MISSES = [
    ("sliding(8)", "causal & local(8, 0)",
     lambda q, k: (q - 8 < k) & (k <= q), lambda q, k: (q - 8 <= k) & (k <= q)),
    ("sliding(8)", "causal & local(6, 0)",
     lambda q, k: (q - 8 < k) & (k <= q), lambda q, k: (q - 6 <= k) & (k <= q)),
    ("causal & chunk(16)", "causal & chunk(17)",
     lambda q, k: (k <= q) & (q // 16 == k // 16), lambda q, k: (k <= q) & (q // 17 == k // 17)),
    ("causal", "k <= q + 1", lambda q, k: k <= q, lambda q, k: k <= q + 1),
    ("causal", "k < q", lambda q, k: k <= q, lambda q, k: k < q),
    ("causal | prefix(20)", "causal | prefix(21)",
     lambda q, k: (k <= q) | ((q < 20) & (k < 20)), lambda q, k: (k <= q) | ((q < 21) & (k < 21))),
    ("global(3)", "sink(3) | q < 2",
     lambda q, k: (q < 3) | (k < 3), lambda q, k: (k < 3) | (q < 2)),
    ("sliding(30) | sink(4)", "sliding(30) | sink(5)",
     lambda q, k: ((q - 30 < k) & (k <= q)) | (k < 4),
     lambda q, k: ((q - 30 < k) & (k <= q)) | (k < 5)),
]


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] * s[1] > 1000])
@pytest.mark.parametrize("a, b, fa, fb", NEAR_MISSES)
@pytest.mark.parametrize("tiles", TILES)
def test_near_misses_give_the_first_real_counterexample(a, b, fa, fb, shape, tiles):
  q_len, kv_len, q_offset = shape
  q, k = positions(*shape)
  ra = np.broadcast_to(fa(q, k), (q_len, kv_len))
  rb = np.broadcast_to(fb(q, k), (q_len, kv_len))
  r = equivalent(a, b, q_len, kv_len, q_offset=q_offset, block_q=tiles[0], block_kv=tiles[1])
  if np.array_equal(ra, rb):  # the miss lies outside this shape
    assert r.equal is True
    return
  check_counterexample(r, ra, rb)
  # maskc's own dense evaluation agrees with the formulas.
  assert np.array_equal(maskc.materialize(a, q_len, kv_len, q_offset=q_offset), ra)


def test_full_against_empty_is_decided_without_evaluation():
  r = equivalent("full", "empty", 1 << 20, block_q=512, block_kv=512)
  assert r.equal is False
  assert (r.counterexample.row, r.counterexample.col) == (0, 0)
  assert r.counterexample.a is True and r.counterexample.b is False
  assert "FULL in a's block map and EMPTY in b's" in r.reason
  assert r.stats["positions_evaluated"] == 0


def test_complements_differ_at_the_first_position():
  r = equivalent("causal", "~causal", 4096)
  assert r.counterexample.index == (0, 0) and r.counterexample.a is True


def test_long_sequences_evaluate_only_the_boundary():
  # 128K tokens: 2**34 positions. The check evaluates only tiles on the window's edges.
  n = 1 << 17
  r = equivalent("sliding(1024)", "causal & local(1023, 0)", n)
  assert r.equal is True
  assert r.stats["positions_evaluated"] < 0.001 * n * n
  assert r.stats["tiles_by_map"] > 0.99 * r.stats["tiles"]
  miss = equivalent("sliding(1024)", "causal & local(1024, 0)", n)
  cx = miss.counterexample
  assert (cx.row, cx.col, cx.a, cx.b) == (1024, 0, False, True)
  assert miss.stats["positions_evaluated"] < 0.001 * n * n


def test_long_decode_and_offsets():
  n = 1 << 16
  assert equivalent("sliding(4096) | sink(4)", "causal & local(4095, 0) | k < 4", 3, n)
  r = equivalent("causal & chunk(8192)", "causal & chunk(8192) & k > 0", 1, n, q_offset=5)
  assert r.counterexample.index == (0, 0)


# ----------------------------------------------------------------------------- operands, batch


def test_operands_are_shared_and_batched():
  seg = np.array([[0, 0, 0, 1, 1, 1, 2, 2], [0, 0, 1, 1, 1, 1, 1, 1]])
  a = "causal & document(seg)"
  b = "k <= q & seg[k] == seg[q]"
  r = equivalent(a, b, 8, operands={"seg": seg}, block_q=2, block_kv=2)
  assert r.equal is True
  # A mask that is right for the first batch row only.
  c = "causal & (q < 3 & k < 3 | q >= 3 & k >= 3 & q < 6 & k < 6 | q >= 6 & k >= 6)"
  r = equivalent(a, c, 8, operands={"seg": seg})
  assert r.counterexample.batch == 1
  assert r.counterexample.index == (1, 2, 0)
  dense_a = maskc.materialize(a, 8, operands={"seg": seg})
  dense_c = maskc.materialize(c, 8, operands={"seg": seg})
  check_counterexample(r, *np.broadcast_arrays(dense_a, dense_c))


def test_unsorted_segments_and_images():
  rng = np.random.default_rng(0)
  seg = rng.integers(0, 3, 200)
  img = rng.random(200) < 0.4
  ops = {"seg": seg, "img": img}
  a = "causal & document(seg) | bidirectional(img)"
  b = "k <= q & seg[q] == seg[k] | runs(img)[q] == runs(img)[k] & img[q]"
  assert equivalent(a, b, 200, operands=ops, block_q=16, block_kv=16)
  dense = maskc.materialize(a, 200, operands=ops)
  assert equivalent(a, dense, operands=ops)
  flipped = dense.copy()
  flipped[150, 3] = ~flipped[150, 3]
  r = equivalent(a, flipped, operands=ops)
  assert r.counterexample.index == (150, 3)


def test_traced_operands_are_refused():
  import jax

  @jax.jit
  def f(seg):
    with pytest.raises(maskc.OperandError, match="static operand values"):
      equivalent("document(seg)", "seg[q] == seg[k] & causal", 8, operands={"seg": seg})
    return seg

  f(np.zeros(8, np.int32))


def test_missing_operands_are_reported():
  with pytest.raises(maskc.OperandError, match="missing operand `seg`"):
    equivalent("document(seg) & causal", "causal", 16)


# ----------------------------------------------------------------------------- dense references


def test_dense_reference_gives_the_shape():
  q, k = positions(40, 100, None)
  ref = (k <= q) & (q // 16 == k // 16)
  r = equivalent("causal & chunk(16)", ref)
  assert r.equal is True and r.shape == (40, 100, 60)
  r = equivalent(ref, "causal & chunk(16)", 40, 100)
  assert r.equal is True


def test_dense_against_dense_and_int_arrays():
  a = np.tril(np.ones((5, 5), bool))
  b = a.astype(np.int8)
  assert equivalent(a, b)
  b[4, 0] = 0
  r = equivalent(a, b)
  assert r.counterexample.index == (4, 0) and r.counterexample.a and not r.counterexample.b


def test_dense_shape_and_dtype_errors():
  ref = np.ones((4, 6), bool)
  with pytest.raises(maskc.MaskValueError, match="shape"):
    equivalent("causal", ref, 4, 7)
  with pytest.raises(maskc.MaskValueError, match="shape"):
    equivalent("causal", np.ones(4, bool))
  with pytest.raises(maskc.MaskTypeError, match="booleans"):
    equivalent("causal", np.ones((4, 4)) * 0.5)
  with pytest.raises(maskc.MaskTypeError, match="mask, mask text or a dense bool array"):
    equivalent("causal", [[True]])


def test_argument_errors():
  with pytest.raises(maskc.MaskValueError, match="without q_len"):
    equivalent("causal", "sliding(3)", kv_len=8)
  with pytest.raises(maskc.MaskValueError, match="block_q must be positive"):
    equivalent("causal", "sliding(3)", 8, block_q=0)
  with pytest.raises(maskc.MaskSyntaxError):
    equivalent("causal &", "causal", 8)
  with pytest.raises(maskc.MaskValueError, match="batch size"):
    equivalent("document(seg)", np.ones((3, 4, 4), bool), operands={"seg": np.zeros((2, 4), int)})


def test_result_text():
  r = equivalent("sliding(8)", "causal & local(8, 0)", 64)
  assert "differ at row 8, col 0 (q=8, k=0): a is false, b is true" in str(r)
  assert repr(r).startswith("Equivalence(equal=False, a='sliding(8)', b='causal & local(8, 0)'")
  assert "counterexample=Counterexample(batch=None, row=8, col=0" in repr(r)
  ok = equivalent("sliding(8)", "causal & local(7, 0)", 64)
  assert str(ok).startswith("`sliding(8)` and `causal & local(7, 0)` are equivalent: equal at")


def test_unsound_block_map_is_caught_and_decided_again(monkeypatch):
  import maskc.lowering.compile as lower
  real = lower.compile

  def lying_compile(mask, *args, **kwargs):  # claims `empty` is FULL everywhere
    return real("full" if str(mask) == "empty" else mask, *args, **kwargs)

  monkeypatch.setattr(lower, "compile", lying_compile)
  with pytest.warns(UnsoundBlockMapWarning, match="maskc bug"):
    r = equivalent("empty", "k < q & k > q", 64, block_q=16, block_kv=16)
  assert r.equal is True


# ----------------------------------------------------------------------------- properties

OPERANDS = {"seg": "segments", "img": "image", "n": "scalar", "allowed": "pairwise"}


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_a_mask_is_equivalent_to_its_simplified_form(data):
  a = data.draw(testing.masks(max_depth=3, operands=OPERANDS))
  assert equivalent(a, a.simplify()).equal is True  # symbolically, at every shape
  shape = data.draw(testing.shapes(max_len=40))
  ops = data.draw(testing.operand_values(a, shape))
  r = equivalent(a, a.simplify(), shape[0], shape[1], q_offset=shape[2], operands=ops)
  assert r.equal is True


@st.composite
def pairs(draw):
  a = draw(testing.masks(max_depth=2, operands=OPERANDS))
  b = draw(st.one_of(
      testing.masks(max_depth=2, operands=OPERANDS),
      st.builds(lambda x: a ^ x, testing.masks(max_depth=1, operands=OPERANDS)),
      st.builds(lambda x: a | x, testing.masks(max_depth=1, operands=OPERANDS)),
      st.builds(lambda x: a & x, testing.masks(max_depth=1, operands=OPERANDS))))
  shape = draw(testing.shapes(max_len=40))
  ops = draw(testing.operand_values(a & b, shape))
  tiles = (draw(st.sampled_from([1, 2, 3, 8, 16, 128])), draw(st.sampled_from([1, 4, 5, 16, 128])))
  return a, b, shape, ops, tiles


@settings(max_examples=80, deadline=None)
@given(pairs())
def test_verdict_matches_dense_comparison(case):
  a, b, (q_len, kv_len, q_offset), ops, (bq, bk) = case
  da = maskc.materialize(a, q_len, kv_len, q_offset=q_offset, operands=ops)
  db = maskc.materialize(b, q_len, kv_len, q_offset=q_offset, operands=ops)
  da, db = np.broadcast_arrays(da, db)
  r = equivalent(a, b, q_len, kv_len, q_offset=q_offset, operands=ops, block_q=bq, block_kv=bk)
  assert r.equal == np.array_equal(da, db), repr(r)
  if not r.equal:
    check_counterexample(r, da, db)
  # The same verdict and position against a dense reference.
  ref = equivalent(a, db, q_offset=q_offset, operands=ops, block_q=bq, block_kv=bk)
  assert ref.equal == r.equal
  if not r.equal:
    assert ref.counterexample.index[-2:] == r.counterexample.index[-2:]


# ----------------------------------------------------------------------------- known bugs


def test_simplify_is_idempotent_under_xor_with_full():
  # Found by these tests: `_xor` complemented the first item after sorting, so this gave
  # `~allowed[q, k] ^ causal`, which simplified again to `causal ^ ~allowed[q, k]`.
  s = maskc.parse("causal ^ full ^ allowed[q, k]").simplify()
  assert s.simplify() == s


def test_equivalent_is_robust_to_non_idempotent_simplify():
  # equivalent() iterates simplify to a fixed point, so such a bug cannot turn a proof to unknown.
  m = maskc.parse("causal ^ full ^ allowed[q, k]")
  assert equivalent(m, m.simplify()).equal is True


BIG_IDS = np.array([0, 0, 0, 0, 2**32, 2**32, 2**32, 2**32], np.int64)


def test_compile_is_sound_for_int64_segment_ids():
  # Regression: the range-analysis tables cast per-token operands to int32, so ids >= 2**31
  # wrapped and `document(seg)` here had grid [[2, 2], [2, 2]] with tiles (0, 1), (1, 0) all false.
  ops = {"seg": BIG_IDS}
  bm = maskc.compile("document(seg)", 8, block_q=4, block_kv=4, operands=ops)
  assert_sound(np.asarray(bm.grid), maskc.materialize("document(seg)", 8, operands=ops), 4, 4)


def test_equivalent_with_int64_segment_ids():
  # Regression: with the int32 cast both maps claimed FULL everywhere and this said equal.
  r = equivalent("document(seg)", "full", 8, block_q=4, block_kv=4, operands={"seg": BIG_IDS})
  assert r.equal is False and r.counterexample.index == (0, 4)


NARROW_DTYPES = [
    # uint8 segment ids: seg[q] - seg[k] must go negative, not wrap around.
    ("seg[q] - seg[k] < 0", {"seg": np.array([0, 0, 0, 0, 1, 1, 1, 1], np.uint8)},
     lambda v, q, k: v["seg"][q] - v["seg"][k] < 0),
    # bool flags: 100 + 100 must not overflow an int8.
    ("img[q] * 100 + img[k] * 100 > 150", {"img": np.ones(8, bool)},
     lambda v, q, k: v["img"][q] * 100 + v["img"][k] * 100 > 150),
    # int16 ids: 300 * 200 must not overflow.
    ("seg[q] * 200 > 1000", {"seg": np.array([0, 0, 0, 0, 300, 300, 300, 300], np.int16)},
     lambda v, q, k: v["seg"][q] * 200 > 1000 + 0 * k),
    # int32 ids: 30000 * 100000 must not overflow.
    ("seg[q] * 100000 < 0", {"seg": np.array([0, 0, 0, 0, 30000, 30000, 30000, 30000], np.int32)},
     lambda v, q, k: v["seg"][q] * 100000 < 0 * k),
]


@pytest.mark.parametrize("mask, values, formula", NARROW_DTYPES)
def test_integer_terms_do_not_wrap_in_narrow_operand_dtypes(mask, values, formula):
  # Regression: evaluation computed integer terms in the operands' own dtypes (uint8, int16,
  # int8 for bool flags), and compile's analysis in int32, so the two disagreed.
  q, k = positions(8, 8, None)
  wide = {n: v.astype(np.int64) for n, v in values.items()}
  expected = np.broadcast_to(formula(wide, q, k), (8, 8))
  assert np.array_equal(maskc.materialize(mask, 8, operands=values), expected)
  for tiles in ((4, 4), (8, 8), (3, 5)):
    bm = maskc.compile(mask, 8, block_q=tiles[0], block_kv=tiles[1], operands=values)
    assert_sound(np.asarray(bm.grid), expected, *tiles)
    assert equivalent(mask, expected, operands=values, block_q=tiles[0], block_kv=tiles[1])
