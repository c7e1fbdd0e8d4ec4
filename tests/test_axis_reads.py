"""Masks of one axis that read operands at the bare position
(`maskc.lowering.closed_forms.one_axis`): their tiles from the operands' runs are the dense
mask's, exactly, even where the mask is not refined; checked against a NumPy reference written
here."""

import numpy as np
from hypothesis import given, strategies as st

import maskc
from helpers import assert_maximal_runs, tile_states
from maskc.compiled.tiles import grid_from_runs
from maskc.language import ir
from maskc.lowering import compile as _lower
from maskc.lowering.closed_forms.one_axis import bare_reads_only

READ_MASKS = {  # mask: reference over operands read at positions p (q or k), batch row axis first
    "g[k]": lambda g, h, w, s, p: g(p),
    "~g[q]": lambda g, h, w, s, p: ~g(p),
    "g[k] & ~h[k]": lambda g, h, w, s, p: g(p) & ~h(p),
    "w[k] == 2 | g[k]": lambda g, h, w, s, p: (w(p) == 2) | g(p),
    "w[q] >= s | h[q]": lambda g, h, w, s, p: (w(p) >= s) | h(p),
    "w[k] != w[k] | h[k]": lambda g, h, w, s, p: h(p),  # reads of one operand twice
}


@given(st.sampled_from(sorted(READ_MASKS)), st.integers(1, 90), st.integers(1, 90),
       st.integers(0, 40), st.sampled_from([None, 2]), st.sampled_from([1, 3, 4, 16]),
       st.sampled_from([1, 4, 8]), st.sampled_from(["short", "long", "edges"]),
       st.booleans(), st.integers(0, 2**31))
def test_tiles_of_bare_reads_are_the_dense_masks(text, q_len, kv_len, offset, batch, bq, bk,
                                                 kind, shared, seed):
  """Unrefined (every operand is raw), the tiles, forward and backward, equal those of the
  dense mask, and each line's runs are maximal: short runs, one long run, runs on tile
  edges; ragged lengths and offsets (reads past an operand's end take its last token);
  operands with a batch axis, or one row for every batch row (`shared`)."""
  rng = np.random.default_rng(seed)
  length = max(q_len + offset, kv_len)
  lead = () if batch is None or shared else (batch,)

  def run_flags(p):
    if kind == "short":
      return rng.random(lead + (length,)) < p
    if kind == "long":
      out = np.zeros(lead + (length,), bool)
      a = int(rng.integers(0, length))
      out[..., a:a + int(rng.integers(1, length + 1))] = True
      return out
    edges = np.repeat(rng.random(lead + (-(-length // 4),)) < p, 4, axis=-1)  # runs of 4
    return edges[..., :length]

  ops = {"g": run_flags(0.3), "h": run_flags(0.5),
         "w": np.cumsum(run_flags(0.2), axis=-1) % 4,
         "s": rng.integers(0, 4, batch or ()).astype(np.int32)}
  m = maskc.parse(text)
  ops = {o.name: ops[o.name] for o in m.operands}
  nb = batch if batch and (not shared or "s" in ops) else 1  # a batch axis somewhere

  def at(name):
    def read(p):
      a = np.broadcast_to(ops[name], (nb, length))
      return a[:, np.minimum(p, length - 1)]
    return read

  (axis,) = ir.positions_of(m)
  p = np.arange(q_len) + offset if axis == "q" else np.arange(kv_len)
  s = np.broadcast_to(ops.get("s", np.int32(0)), (nb,))[:, None]
  line = READ_MASKS[text](at("g"), at("h"), at("w"), s, p)  # [nb, len of the axis]
  dense = line[:, :, None] if axis == "q" else line[:, None, :]
  dense = np.broadcast_to(dense, (nb, q_len, kv_len))
  expected = tile_states(dense, bq, bk)
  _lower._CACHE.clear()
  bm = maskc.compile(m, q_len, kv_len, q_offset=offset, block_q=bq, block_kv=bk, operands=ops)
  got = np.asarray(bm.grid).reshape(expected.shape)
  np.testing.assert_array_equal(got, expected)
  assert_maximal_runs(bm.rows, expected)
  cols = np.asarray(grid_from_runs(np, bm.cols, expected.shape[-2]))[:, 0]
  np.testing.assert_array_equal(np.swapaxes(cols, -1, -2).reshape(expected.shape), got)


def test_bare_reads_are_reads_indexed_by_a_position_alone():
  for text in ["g[k]", "~pad[q] & img[q]", "seg[k] == 0", "w[k] >= s", "bidirectional(img)"]:
    assert bare_reads_only(maskc.parse(text)) == (text != "bidirectional(img)"), text
  for text in ["g[k] & k < n", "g[k + 1]", "g[k // 2]", "runs(g)[k] > 0", "g[k] | sink(2)"]:
    assert not bare_reads_only(maskc.parse(text)), text
