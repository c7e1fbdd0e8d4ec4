"""`BlockMap.key_intervals()` against the dense mask: always sound, exact only when exact.

Sound: every allowed key of a row lies in `[start, stop)`. Exact: every key there is
allowed, and empty rows have `start == stop`. Drawn masks (`maskc.testing.masks()`)
check both on the static path and under `jit`; the one-interval masks of issue 36
must come out exact, static and traced (documents with `contiguous=` under `jit`).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import maskc
from maskc import testing
from maskc.lowering.rules import disabled

INTERVAL_MASKS = [
    "causal", "sliding(5)", "local(3, 2)", "causal & chunk(8)", "causal | prefix(6)",
    "causal & document(seg)", "causal | bidirectional(img)", "sliding(4) | bidirectional(img)",
    "document(seg) & (causal | bidirectional(img))", "causal & k < n", "global(3)", "full",
    "sliding(6) & chunk(8)", "~img[q] & causal", "k <= q & runs(img)[q] == runs(img)[k] & img[q]"
    " | k <= q",
]
NOT_INTERVALS = ["sink(2) | sliding(3)", "(q - k) % 3 == 0", "img[k]", "q - k > 4 | k - q > 4"]


def _values(n: int) -> dict:
  img = np.zeros(n, bool)
  img[5:11] = img[20:24] = True
  seg = np.repeat(np.arange(4), -(-n // 4))[:n].astype(np.int32)
  return {"img": img, "seg": seg, "n": np.int32(13)}


def _check(start, stop, exact: bool, dense: np.ndarray, what: str) -> None:
  start, stop, dense = np.asarray(start), np.asarray(stop), np.asarray(dense)
  assert start.shape == stop.shape == dense.shape[:-1], what
  assert start.dtype == stop.dtype == np.int32, what
  assert np.all(start <= stop), what
  keys = np.arange(dense.shape[-1])
  inside = (keys >= start[..., None]) & (keys < stop[..., None])
  bad = np.argwhere(dense & ~inside)
  assert bad.size == 0, f"{what}: allowed key outside its row's interval at {bad[0]}"
  if exact:
    bad = np.argwhere(inside & ~dense)
    assert bad.size == 0, f"{what}: exact, but a key inside is not allowed at {bad[0]}"


def _ops(m: maskc.Mask, values: dict) -> dict:
  return {s.name: values[s.name] for s in m.operands}


@pytest.mark.parametrize("text", INTERVAL_MASKS + NOT_INTERVALS)
@pytest.mark.parametrize("q_len", [32, 20, 1])
def test_listed_masks_static(text: str, q_len: int):
  m = maskc.parse(text)
  ops = _ops(m, _values(32))
  bm = maskc.compile(m, q_len, 32, block_q=8, block_kv=8, operands=ops)
  start, stop, exact = bm.key_intervals()
  assert exact == (text in INTERVAL_MASKS), text
  _check(start, stop, exact, maskc.materialize(m, q_len, 32, operands=ops), text)


@pytest.mark.parametrize("text", INTERVAL_MASKS + NOT_INTERVALS)
def test_listed_masks_traced(text: str):
  """Under `jit` the same masks are exact, documents only where declared contiguous."""
  m = maskc.parse(text)
  ops = _ops(m, _values(32))
  for contiguous in ([], ["seg"]) if "seg" in ops else ([],):
    found = []

    def run(o, contiguous=contiguous, found=found):
      bm = maskc.compile(m, 32, block_q=8, block_kv=8, operands=o, contiguous=contiguous)
      start, stop, exact = bm.key_intervals()
      found.append(exact)
      return start, stop

    start, stop = jax.jit(run)(ops)
    expected = text in INTERVAL_MASKS and ("seg" not in ops or bool(contiguous))
    assert found == [expected], (text, contiguous)
    _check(start, stop, found[0], maskc.materialize(m, 32, operands=ops), text)


def test_unsorted_documents_are_exact_only_when_contiguous():
  unsorted = np.repeat([3, 1, 0, 2], 8).astype(np.int32)  # contiguous, not sorted
  repeated = np.array([0, 0, 1, 1, 0, 0, 2, 2] * 4, np.int32)
  for seg, exact in ((unsorted, True), (repeated, False)):
    bm = maskc.compile("causal & document(seg)", 32, block_q=8, block_kv=8,
                       operands={"seg": seg})
    start, stop, found = bm.key_intervals()
    assert found == exact
    _check(start, stop, found, maskc.materialize("causal & document(seg)", 32,
                                                 operands={"seg": seg}), str(seg))


def test_contiguous_is_checked_on_static_values():
  repeated = np.array([0, 0, 1, 1, 0, 0, 2, 2], np.int32)
  with pytest.raises(maskc.MaskValueError, match="more than one run"):
    maskc.compile("document(seg)", 8, operands={"seg": repeated}, contiguous=["seg"])
  with pytest.raises(maskc.MaskValueError, match="per-token operand"):
    maskc.compile("document(seg)", 8, operands={"seg": repeated}, contiguous=["sec"])


def test_batch_and_heads_lead_the_intervals():
  seg = np.stack([np.repeat([0, 1], 8), np.repeat([0, 1, 2, 3], 4)]).astype(np.int32)
  masks = ["causal & document(seg)", "sliding(3)", "causal & document(seg)"]
  bm = maskc.compile(masks, 16, block_q=4, block_kv=4, operands={"seg": seg})
  start, stop, exact = bm.key_intervals()
  assert start.shape == (2, 3, 16) and exact
  _check(start, stop, exact, maskc.materialize(masks, 16, operands={"seg": seg}), "heads")


def test_without_the_rule_the_tiles_give_a_sound_hull():
  ops = _values(32)
  with disabled("row_intervals"):
    bm = maskc.compile("causal & chunk(8) | bidirectional(img)", 32, block_q=8, block_kv=8,
                       operands={"img": ops["img"]})
  start, stop, exact = bm.key_intervals()
  assert not exact
  dense = maskc.materialize("causal & chunk(8) | bidirectional(img)", 32,
                            operands={"img": ops["img"]})
  _check(start, stop, exact, dense, "hull")
  assert (np.asarray(start) % 8 == 0).all()  # tile edges


def test_explicit_positions_give_the_hull():
  pos = np.concatenate([np.arange(8, 16), np.arange(8)])
  bm = maskc.compile("causal", 16, block_q=4, block_kv=4, q_positions=pos, kv_positions=pos)
  start, stop, exact = bm.key_intervals()
  assert not exact
  _check(start, stop, exact, maskc.materialize("causal", 16, q_positions=pos,
                                               kv_positions=pos), "positions")


@st.composite
def _drawn(draw: st.DrawFn):
  mask = draw(testing.masks(max_depth=2))
  shape = draw(testing.shapes(max_len=40))
  ops = draw(testing.operand_values(mask, shape))
  tiles = draw(st.sampled_from([(8, 8), (4, 16), (16, 4), (1, 1)]))
  return mask, shape, ops, tiles


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_drawn())
def test_drawn_masks_static(drawn):
  mask, (q_len, kv_len, q_offset), ops, (bq, bk) = drawn
  bm = maskc.compile(mask, q_len, kv_len, q_offset=q_offset, operands=ops, block_q=bq,
                     block_kv=bk)
  start, stop, exact = bm.key_intervals()
  dense = maskc.materialize(mask, q_len, kv_len, q_offset=q_offset, operands=ops)
  _check(start, stop, exact, dense, str(mask))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_drawn())
def test_drawn_masks_traced(drawn):
  mask, (q_len, kv_len, q_offset), ops, (bq, bk) = drawn
  found = []

  def run(o):
    bm = maskc.compile(mask, q_len, kv_len, q_offset=q_offset, operands=o, block_q=bq,
                       block_kv=bk)
    start, stop, exact = bm.key_intervals()
    found.append(exact)
    return start, stop

  start, stop = jax.jit(run)({n: np.asarray(v) for n, v in ops.items()})
  dense = maskc.materialize(mask, q_len, kv_len, q_offset=q_offset, operands=ops)
  _check(start, stop, found[0], dense, str(mask))


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_drawn())
def test_drawn_masks_traced_more(drawn):
  test_drawn_masks_traced.hypothesis.inner_test(drawn)
