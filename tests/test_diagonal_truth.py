"""`maskc.analysis.diagonal_truth`: a mask proved true at every pair `q == k` is true there for any
operands (checked on the dense mask), the prelude's reflexive masks are proved, and the
static lowering then takes no sampled pair for the tiles the diagonal crosses."""

import numpy as np
from hypothesis import given, settings, strategies as st

import maskc
from helpers import tile_states
from maskc import testing
from maskc.analysis.diagonal_truth import true_on_diagonal
from maskc.lowering import compile as _lower
from maskc.lowering.generic import combination as _combined
from maskc.lowering.rules import taken

PROVED = ["causal", "sliding(5)", "local(3, 2)", "chunk(8)", "causal & document(seg)",
          "document(seg) & (causal | bidirectional(img))", "causal | bidirectional(img)",
          "seg[q] <= seg[k] + 1 & seg[k] <= seg[q]", "~(k > q)", "q * 2 >= k * 2",
          "full"]
NOT_PROVED = ["bidirectional(img)", "document(seg) & ~img[k]", "k < q", "prefix(4)",
              "sink(3)", "global(3)", "q - k < 0", "seg[q] < seg[k]", "g[q] | g[k]",
              "causal ^ document(seg)", "empty"]


def test_reflexive_masks_are_proved_and_others_are_not():
  for text in PROVED:
    assert true_on_diagonal(maskc.parse(text)), text
  for text in NOT_PROVED:
    assert not true_on_diagonal(maskc.parse(text)), text


@settings(max_examples=150, deadline=None)
@given(testing.mask_trees(max_leaves=6), st.integers(1, 40), st.integers(0, 2**31))
def test_a_mask_proved_true_on_the_diagonal_is_true_there(m, n, seed):
  """Soundness on random masks of positions, terms and operand reads: where the proof holds,
  every diagonal pair of the dense mask is true, for random operand values."""
  if not true_on_diagonal(m):
    return
  ops = testing.seeded_operand_values(n, seed)
  ops = {o.name: ops[o.name] for o in m.operands}
  dense = np.asarray(maskc.materialize(m, n, n, q_offset=0, operands=ops))
  assert dense.reshape(-1, n, n).diagonal(axis1=-2, axis2=-1).all(), str(m)


def test_diagonal_tiles_of_a_reflexive_and_take_no_sampled_pair(monkeypatch):
  """`causal & document(seg)` with documents of 30 tokens on 16-tiles: the tiles where a
  document's edge crosses the diagonal are PARTIAL in both parts, and proved mixed
  without evaluating a pair; the map is the dense mask's. (The diagonal_truth rule says
  the proof was used; that no tile was left to sampling, no rule says: the spy does.)"""
  seg = np.repeat(np.arange(100), 30)
  sampled = []
  sample = _combined.sampled_mixed
  monkeypatch.setattr(_combined, "sampled_mixed",
                      lambda *a, **k: sampled.append(np.size(a[4])) or sample(*a, **k))
  _lower._CACHE.clear()
  text = "causal & document(seg)"
  with taken() as fired:
    bm = maskc.compile(text, 3000, block_q=16, block_kv=16, operands={"seg": seg})
  assert "diagonal_truth" in fired and "met_bounds" in fired, fired
  assert sampled == []
  expected = tile_states(np.asarray(maskc.materialize(text, 3000, operands={"seg": seg})),
                            16, 16)
  np.testing.assert_array_equal(np.asarray(bm.grid).reshape(expected.shape), expected)
