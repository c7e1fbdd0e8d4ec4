"""`maskc.explain`: the rule it reports for each part is the one the lowering took
(`maskc.lowering.rules.taken`), its tile counts are the compiled map's, and bad input raises
`MaskError`. No wall-clock assertions: timings are only checked to be there."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import maskc
from maskc import testing
from maskc.lowering import compile as _lower
from maskc.lowering.registry import RULES
from maskc.lowering.rules import disabled, taken

N = 96


def _values(n: int, seed: int = 0) -> dict:
  """Sorted segment ids, image flags in spans, a scalar: as models pass them."""
  rng = np.random.default_rng(seed)
  img = np.zeros(n, bool)
  for a in rng.integers(0, n, 3):
    img[a:a + int(rng.integers(1, n // 4))] = True
  return {"seg": np.sort(rng.integers(0, 5, n)).astype(np.int32),
          "doc": np.sort(rng.integers(0, 3, n)).astype(np.int32),
          "img": img, "pfx": np.roll(img, n // 2), "g": np.roll(img, n // 3),
          "n": int(rng.integers(0, n))}


def _ops(m: maskc.Mask, values: dict) -> dict:
  names = {s.name for s in m.operands}
  return {k: v for k, v in values.items() if k in names}


# (mask, the rule of the whole mask, the rules of its parts at depth 1)
WAYS = [
    ("causal & chunk(24)", "periodic", []),
    ("img[k]", "one_axis", []),
    ("document(seg)", "equal_reads", []),
    ("causal & document(seg)", "parts", ["band", "equal_reads"]),
    ("local(4, 4) | g[q] | g[k]", "parts", ["band", "one_axis", "one_axis"]),
    ("causal & chunk(24) | bidirectional(img)", "parts", ["periodic", "equal_reads"]),
    ("q * 3 % 7 < k % 5 + seg[k]", "generic", []),
]


@pytest.mark.parametrize("text, rule, parts", WAYS)
def test_the_rule_reported_is_the_rule_taken(text, rule, parts):
  m = maskc.parse(text)
  ops = _ops(m, _values(N))
  _lower._CACHE.clear()
  with taken() as fired:
    bm = maskc.compile(m, N, block_q=8, block_kv=8, operands=ops)
  e = maskc.explain(text, N, block_q=8, block_kv=8, operands=ops)
  assert set(e.rules) == fired
  assert e.parts[0].depth == 0 and e.parts[0].rule == rule
  assert sorted(p.rule for p in e.parts if p.depth == 1) == sorted(parts)
  for p in e.parts:
    assert p.rule == "generic" or p.rule in fired, p
    assert set(p.rules) <= fired
    assert p.reason  # a rule's description, or why the analysis ran
  assert bm.counts == e.block_map.counts


def test_generic_parts_say_why():
  seg = np.repeat(np.arange(N // 2), 2)  # a change at every other token: lowered whole
  text = "causal & seg[q] <= seg[k] + 1 & seg[k] <= seg[q]"
  e = maskc.explain(text, N, block_q=8, block_kv=8, operands={"seg": seg})
  (whole,) = e.parts
  assert whole.rule == "generic" and "faster whole" in whole.reason
  assert e.generic == (whole,)
  with disabled():
    e = maskc.explain("causal & document(seg)", N, block_q=8, block_kv=8,
                      operands={"seg": seg})
  assert [p.rule for p in e.parts] == ["generic"]
  assert "rules turned off" in e.parts[0].reason


@settings(max_examples=30, deadline=None)
@given(testing.masks(max_depth=2, operands=("seg", "img", "g", "n")), st.sampled_from([8, 16]),
       st.integers(0, 3))
def test_the_whole_mask_counts_are_the_compiled_maps(m, block, seed):
  ops = _ops(m, _values(N, seed))
  e = maskc.explain(m, N, block_q=block, block_kv=8, operands=ops)
  bm = maskc.compile(m, N, block_q=block, block_kv=8, operands=ops)
  whole = e.parts[0]
  assert whole.depth == 0 and whole.mask == str(m)
  assert {"full": whole.full, "partial": whole.partial, "empty": whole.empty} == bm.counts
  assert all(p.full + p.partial + p.empty == e.grid[0] * e.grid[1] for p in e.parts)
  # each part's depth follows the part it belongs to
  assert all(b.depth <= a.depth + 1 for a, b in zip(e.parts, e.parts[1:]))


def test_batched_and_per_head_masks_count_every_row():
  seg = np.stack([np.repeat(np.arange(4), N // 4), np.repeat(np.arange(8), N // 8)])
  e = maskc.explain("causal & document(seg)", N, block_q=8, block_kv=8, operands={"seg": seg})
  bm = maskc.compile("causal & document(seg)", N, block_q=8, block_kv=8, operands={"seg": seg})
  whole = e.parts[0]
  assert {"full": whole.full, "partial": whole.partial, "empty": whole.empty} == bm.counts
  e = maskc.explain(["causal", "sliding(8)", "causal"], N, block_q=8, block_kv=8)
  assert [p.mask for p in e.parts if p.depth == 0] == ["causal", "sliding(8)"]


def test_steps_and_the_table():
  e = maskc.explain("causal & chunk(24) | bidirectional(img)", N, block_q=8, block_kv=8,
                    operands={"img": _values(N)["img"]})
  assert [name for name, _ in e.steps] == ["parse", "bind", "lower", "combine", "assemble"]
  assert all(s >= 0 for _, s in e.steps) and all(p.seconds >= 0 for p in e.parts)
  text = str(e)
  for p in e.parts:
    assert p.mask in text and p.rule in text
  assert "PARTIAL" in text and "rules taken: " in text
  # a Mask, not text: no parse step; the cache is skipped, and explaining twice agrees
  again = maskc.explain(maskc.parse("causal & chunk(24) | bidirectional(img)"), N, block_q=8,
                        block_kv=8, operands={"img": _values(N)["img"]})
  assert [name for name, _ in again.steps] == ["bind", "lower", "combine", "assemble"]
  assert [(p.mask, p.rule, p.partial) for p in again.parts] == [
      (p.mask, p.rule, p.partial) for p in e.parts]
  assert set(e.rules) <= set(RULES)


@pytest.mark.parametrize("call, error", [
    (lambda: maskc.explain("causal &", N), maskc.MaskSyntaxError),
    (lambda: maskc.explain("causal", 0), maskc.MaskValueError),
    (lambda: maskc.explain("causal", N, block_q=0), maskc.MaskValueError),
    (lambda: maskc.explain("document(seg)", N), maskc.MaskError),  # its operand is missing
    (lambda: maskc.explain(42, N), maskc.MaskTypeError),
])
def test_bad_input_raises_a_mask_error(call, error):
  with pytest.raises(error):
    call()


def test_traced_operands_are_refused():
  seg = np.repeat(np.arange(4), N // 4)
  with pytest.raises(maskc.MaskValueError, match="static operands"):
    jax.jit(lambda s: maskc.explain("document(seg)", N, operands={"seg": s}).parts)(seg)
