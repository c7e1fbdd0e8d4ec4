"""maskc.testing: the strategies draw valid masks, shapes and operands; assert_masks_equal."""

import os
import subprocess
import sys
import textwrap

import hypothesis
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import maskc
from maskc import testing
from maskc.testing import assert_masks_equal

OPERANDS = {"seg": "segments", "img": "image", "n": "scalar", "allowed": "pairwise"}


def find(strategy, condition):
  """An example satisfying `condition`, without shrinking it (coverage checks only)."""
  return hypothesis.find(strategy, condition, settings=settings(
      phases=[hypothesis.Phase.generate], max_examples=2000, database=None, deadline=None))


PRELUDE = {"full", "empty", "causal", "sliding", "local", "chunk", "prefix", "sink", "global",
           "document", "bidirectional"}


# ----------------------------------------------------------------------------- strategies


@settings(deadline=None)
@given(st.data())
def test_masks_parse_print_and_compile_with_drawn_operands(data):
  m = data.draw(testing.masks(max_depth=3, operands=OPERANDS))
  assert isinstance(m, maskc.Mask)
  text = str(m)
  assert maskc.parse(text) == m
  assert {s.name for s in m.operands} <= set(OPERANDS)
  shape = data.draw(testing.shapes(max_len=48))
  ops = data.draw(testing.operand_values(m, shape))
  assert set(ops) == {s.name for s in m.operands}
  q_len, kv_len, q_offset = shape
  bm = maskc.compile(m, q_len, kv_len, q_offset=q_offset, operands=ops, block_q=8, block_kv=16)
  dense = maskc.materialize(m, q_len, kv_len, q_offset=q_offset, operands=ops)
  assert dense.shape[-2:] == (q_len, kv_len)
  assert bm.grid.shape[-2:] == (bm.n_q_tiles, bm.n_kv_tiles)


@settings(deadline=None)
@given(testing.masks(max_depth=2, as_text=True))
def test_text_masks_are_canonical_text(text):
  assert isinstance(text, str)
  assert str(maskc.parse(text)) == text


@given(testing.masks(max_depth=0, operands=(), allow_comparisons=False))
def test_depth_zero_without_comparisons_draws_prelude_masks_or_their_bodies(m):
  assert not m.operands
  if isinstance(m, maskc.ir.Call):
    assert m.name in PRELUDE
  else:  # a body: comparisons of q and k (`k <= q`), `&` / `|` of them, or true / false
    assert isinstance(m, (maskc.ir.Compare, maskc.ir.BoolConst, maskc.ir.And, maskc.ir.Or)), m


def test_named_masks_are_drawn_as_written_and_as_their_bodies():
  strategy = testing.masks(max_depth=0, operands=OPERANDS)
  body = maskc.parse("runs(img)[q] == runs(img)[k] & img[q]")
  find(strategy, lambda m: m == maskc.bidirectional("img"))
  find(strategy, lambda m: m == body)
  find(strategy, lambda m: m == maskc.parse("k <= q"))  # causal's body


def test_two_operands_of_one_kind_are_combined_under_not_and_xor():
  strategy = testing.masks(max_depth=0)
  images = {"img", "pfx", "g"}

  def two_images(m, cls):
    names = {s.name for s in m.operands}
    return isinstance(m, cls) and len(names & images) == 2 and "bidirectional" in str(m)

  find(strategy, lambda m: two_images(m, maskc.ir.Xor))
  find(strategy, lambda m: two_images(m, maskc.ir.And) and "~" in str(m))
  find(strategy, lambda m: {s.name for s in m.operands} == {"seg", "doc"})


@given(testing.masks(max_depth=2, operands=()))
def test_masks_without_operands_read_none(m):
  assert m.operands == ()


def test_every_prelude_mask_and_operator_is_drawn():
  strategy = testing.masks(max_depth=1, operands=OPERANDS)
  for name in PRELUDE:
    find(strategy, lambda m, name=name: isinstance(m, maskc.ir.Call) and m.name == name)
  for cls in (maskc.ir.And, maskc.ir.Or, maskc.ir.Xor, maskc.ir.Not, maskc.ir.Compare,
              maskc.ir.Truth):
    find(strategy, lambda m, cls=cls: isinstance(m, cls))


def test_operand_kinds():
  with pytest.raises(maskc.MaskValueError, match="kind of operand `ids`"):
    testing.masks(operands=("ids",))
  with pytest.raises(maskc.MaskValueError, match="unknown operand kind"):
    testing.masks(operands={"ids": "tokens"})
  strategy = testing.masks(max_depth=0, operands={"ids": "segments"}, allow_comparisons=False)
  m = find(strategy, lambda m: bool(m.operands))
  assert [s.name for s in m.operands] == ["ids"]


@given(testing.shapes(max_len=32))
def test_shapes_keep_query_positions_non_negative(shape):
  q_len, kv_len, q_offset = shape
  assert 1 <= q_len <= 32 and 1 <= kv_len <= 32
  if q_offset is None:
    assert kv_len >= q_len
  else:
    assert q_offset >= 0


def test_shapes_cover_decode_ragged_and_offsets():
  s = testing.shapes(max_len=64)
  find(s, lambda x: x[0] == 1 and x[1] > 16 and x[2] is None)  # decode
  find(s, lambda x: 1 < x[0] < x[1] and x[2] is None)  # chunked prefill
  find(s, lambda x: x[0] > x[1])  # more queries than keys
  find(s, lambda x: x[2] is not None and x[2] > 0)  # explicit offset


def test_operand_values_cover_sorted_unsorted_and_batched():
  m = maskc.parse("document(seg) | bidirectional(img) | prefix(n) | allowed[q, k]")
  vals = testing.operand_values(m, (16, 16, None))
  find(vals, lambda v: np.all(np.diff(v["seg"], axis=-1) >= 0) and len(np.unique(v["seg"])) > 2)
  find(vals, lambda v: np.any(np.diff(v["seg"], axis=-1) < 0))
  find(vals, lambda v: np.ndim(v["seg"]) == 2 and np.ndim(v["n"]) == 1)
  find(vals, lambda v: np.asarray(v["img"]).sum() > 4)
  v = find(testing.operand_values(m, (16, 16, None), batch=None), lambda v: True)
  assert np.ndim(v["seg"]) == 1 and np.ndim(v["n"]) == 0 and v["allowed"].shape == (16, 16)
  v = find(testing.operand_values(m, (16, 16, None), batch=3), lambda v: True)
  assert 3 in {np.shape(x)[0] for x in v.values() if np.ndim(x)}


@given(st.data())
def test_operand_values_cover_offset_and_strided_reads(data):
  m = maskc.parse("seg[q // 2] == seg[k] & allowed[q, k // 3] | k < n")
  shape = data.draw(testing.shapes(max_len=24))
  ops = data.draw(testing.operand_values(m, shape))
  q_len, kv_len, q_offset = shape
  maskc.materialize(m, q_len, kv_len, q_offset=q_offset, operands=ops)  # in bounds


# ----------------------------------------------------------------------------- standard operands


def test_seeded_operand_values_are_deterministic_and_well_formed():
  a, b = testing.seeded_operand_values(12, seed=3), testing.seeded_operand_values(12, seed=3)
  assert set(a) == set(testing.STANDARD_OPERANDS)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name])
  assert a["seg"].dtype == np.int32 and a["seg"].shape == (12,)
  assert np.all(np.diff(a["seg"]) >= 0) and a["seg"].min() >= 0 and a["seg"].max() < 4
  assert a["img"].dtype == np.bool_ and a["allowed"].shape == (12, 12)
  assert 0 <= a["n"] <= 12 and 0 <= a["plen"] <= 12
  batched = testing.seeded_operand_values(12, seed=3, batch=2)
  assert batched["seg"].shape == (2, 12) and batched["allowed"].shape == (2, 12, 12)
  assert batched["n"].shape == (2,)


@given(testing.prefill_shapes(max_len=20))
def test_prefill_shapes_are_ordered(shape):
  q_len, kv_len = shape
  assert 1 <= q_len <= kv_len <= 20


@settings(deadline=None)
@given(testing.mask_trees(max_leaves=6, term_leaves=3), testing.prefill_shapes(max_len=12),
       st.integers(0, 3))
def test_mask_trees_read_only_standard_operands_in_bounds(m, shape, seed):
  assert {s.name for s in m.operands} <= set(testing.STANDARD_OPERANDS)
  assert maskc.parse(str(m)) == m
  q_len, kv_len = shape
  dense = np.asarray(maskc.materialize(
      m, q_len, kv_len, operands=testing.seeded_operand_values(kv_len, seed)))
  assert dense.shape == (q_len, kv_len)


@settings(deadline=None)
@given(testing.comparisons(max_leaves=4), testing.prefill_shapes(max_len=10), st.integers(0, 3))
def test_comparisons_match_a_numpy_reference(c, shape, seed):
  """Every comparison drawn evaluates as the NumPy formula of its terms (floor division and
  modulo rounding towards negative infinity, as in Python)."""
  q_len, kv_len = shape
  ops = testing.seeded_operand_values(kv_len, seed)
  qpos = np.arange(q_len)[:, None] + (kv_len - q_len)
  kpos = np.arange(kv_len)[None, :]
  seg = ops["seg"].astype(np.int64)
  img = np.asarray(ops["img"], bool)
  rises = img & ~np.concatenate([[False], img[:-1]])
  run_ids = np.cumsum(rises) * img  # 1, 2, ... per run of flagged tokens, 0 elsewhere

  def term(t):
    if isinstance(t, maskc.ir.Pos):
      return qpos if t.axis == "q" else kpos
    if isinstance(t, maskc.ir.Const):
      return np.int64(t.value)
    if isinstance(t, maskc.ir.Scalar):
      return np.int64(ops[t.name])
    if isinstance(t, maskc.ir.Neg):
      return -term(t.arg)
    if isinstance(t, maskc.ir.Arith):
      a, b = term(t.lhs), term(t.rhs)
      if t.op == "+":
        return a + b
      if t.op == "-":
        return a - b
      if t.op == "*":
        return a * b
      return np.floor_divide(a, b) if t.op == "//" else np.mod(a, b)
    if isinstance(t, maskc.ir.Fn):
      args = np.broadcast_arrays(*[term(x) for x in t.args])
      if t.name == "abs":
        return np.abs(args[0])
      return np.minimum.reduce(args) if t.name == "min" else np.maximum.reduce(args)
    if isinstance(t, maskc.ir.Read):
      values = run_ids if t.runs else seg
      return values[term(t.index)]
    raise AssertionError(f"no reference for {type(t).__name__}")

  values = [term(t) for t in c.terms]
  expect = np.ones((q_len, kv_len), bool)
  ops_ = {"<": np.less, "<=": np.less_equal, "==": np.equal, "!=": np.not_equal,
          ">=": np.greater_equal, ">": np.greater}
  for a, op, b in zip(values, c.ops, values[1:]):
    expect &= np.broadcast_to(ops_[op](a, b), (q_len, kv_len))
  got = np.asarray(maskc.materialize(c, q_len, kv_len, operands=ops))
  np.testing.assert_array_equal(got, expect, err_msg=str(c))


def test_standard_strategies_cover_their_parts():
  strategy = testing.mask_trees(max_leaves=4, term_leaves=3)
  for cls in (maskc.ir.And, maskc.ir.Or, maskc.ir.Xor, maskc.ir.Not, maskc.ir.Compare,
              maskc.ir.Truth):
    find(strategy, lambda m, cls=cls: isinstance(m, cls))
  for name in ("document", "bidirectional", "prefix", "sink"):
    find(testing.prelude_masks(), lambda m, name=name: isinstance(m, maskc.ir.Call)
         and m.name == name and bool(m.operands))
  find(testing.truths(), lambda m: [s.name for s in m.operands] == ["allowed"])
  find(testing.terms(), lambda t: "runs(img)" in str(t))
  find(testing.prelude_combinations(), lambda m: isinstance(m, maskc.ir.Not))


def test_strategies_need_hypothesis(monkeypatch):
  monkeypatch.setitem(sys.modules, "hypothesis.strategies", None)
  with pytest.raises(ImportError, match="pip install hypothesis"):
    testing.masks()


def test_module_imports_without_hypothesis():
  code = textwrap.dedent("""
      import sys
      sys.modules["hypothesis"] = None
      from maskc.testing import assert_masks_equal
      assert_masks_equal("sliding(4)", "causal & local(3, 0)", 64)
      assert "hypothesis" not in [m for m in sys.modules if sys.modules[m] is not None]
  """)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# ----------------------------------------------------------------------------- assert_masks_equal


def test_assert_masks_equal_passes_and_returns_the_result():
  r = assert_masks_equal("sliding(1024)", "causal & local(1023, 0)", 1 << 16)
  assert r.equal is True


def test_assert_masks_equal_failure_message():
  with pytest.raises(AssertionError) as info:
    assert_masks_equal("sliding(4)", "causal & local(4, 0)", 12, block_q=8, block_kv=8)
  assert str(info.value) == textwrap.dedent("""\
      masks differ at row 4, col 0 (q=4, k=0): a is false, b is true
        a: sliding(4)
        b: causal & local(4, 0)
        at q_len=12, kv_len=12, q_offset=0; tile (0, 0) = rows 0:8, cols 0:8 of 8x8
        rows 0:12, cols 0:12: 8 of 144 differ ('#' both true, '.' neither, 'a' only a, 'b' only b):
                       0         10
          row  0 q=0  |#...........|
          row  1 q=1  |##..........|
          row  2 q=2  |###.........|
          row  3 q=3  |####........|
          row  4 q=4  |b####.......|
                       ^ first difference
          row  5 q=5  |.b####......|
          row  6 q=6  |..b####.....|
          row  7 q=7  |...b####....|
          row  8 q=8  |....b####...|
          row  9 q=9  |.....b####..|
          row 10 q=10 |......b####.|
          row 11 q=11 |.......b####|""")


def test_assert_masks_equal_window_is_small_at_long_lengths():
  n = 1 << 15
  with pytest.raises(AssertionError) as info:
    assert_masks_equal("causal & chunk(8192)", "causal & chunk(8191)", n)
  message = str(info.value)
  # q = 8191 opens chunk 1 of chunk(8191) but is still in chunk 0 of chunk(8192).
  assert "masks differ at row 8191, col 0 (q=8191, k=0): a is true, b is false" in message
  rows = [line for line in message.splitlines() if "|" in line]
  assert 1 <= len(rows) <= 16
  assert all(len(line.split("|")[1]) <= 32 for line in rows)
  assert "^ first difference" in message


def test_assert_masks_equal_with_batched_operands_and_dense_reference():
  seg = np.array([[0, 0, 1, 1], [0, 1, 1, 1]])
  reference = seg[:, :, None] == seg[:, None, :]
  assert_masks_equal("document(seg)", reference, operands={"seg": seg})
  reference[1, 3, 0] = True
  with pytest.raises(AssertionError, match=r"batch 1, row 3, col 0 \(q=3, k=0\): a is false"):
    assert_masks_equal("document(seg)", reference, operands={"seg": seg})


def test_assert_masks_equal_needs_a_shape_to_fail():
  assert_masks_equal("global(4)", "sink(4) | q < 4")  # a symbolic proof needs none
  with pytest.raises(AssertionError, match="without a shape"):
    assert_masks_equal("sliding(4)", "causal & local(3, 0)")


# ----------------------------------------------------------------------------- README example


def test_readme_example_config_mask_against_numpy_reference():
  # A model config's mask, checked against a hand-written NumPy reference.
  config_mask = "causal & chunk(8) | bidirectional(img)"
  img = np.array([0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0], bool)
  q = np.arange(16)[:, None]
  k = np.arange(16)[None, :]
  run = np.cumsum(np.diff(img, prepend=False) & img) * img  # 1-based image run ids, 0 outside
  reference = (k <= q) & (q // 8 == k // 8) | (run[q] == run[k]) & img[q]
  assert_masks_equal(config_mask, reference, operands={"img": img})


def test_readme_example_two_spellings_of_one_mask():
  assert_masks_equal("sliding(4096) | sink(4)", "causal & q - k < 4096 | k < 4", 128 * 1024)
