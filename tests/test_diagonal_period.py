"""Diagonal periods and the lowering that repeats one period of tiles.

Laws: a mask with diagonal period `P` is unchanged when both positions move by
`P` (checked by dense evaluation at moved positions); a map lowered by
repeating one period equals the tile states of the dense mask, forward and
backward, for ragged lengths, offsets and unequal tiles.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import maskc
from helpers import tile_states
from maskc import testing as mt
from maskc.analysis.diagonal_period import diagonal_period
from maskc.compiled.tiles import grid_from_runs
from maskc.lowering import compile as _lower
from maskc.lowering.rules import taken


@pytest.mark.parametrize("text, period", [
    ("causal", 1), ("sliding(100)", 1), ("local(3, 7)", 1), ("causal & chunk(48)", 48),
    ("(q - k) % 4 == 0", 1), ("q % 4 == 0", 4), ("q % 6 == k % 4", 12),
    ("q // 2 - k // 2 < 3", 2), ("abs(q - k) < 9", 1), ("min(q, k) == q", 1), ("full", 1),
    ("q < 5", None), ("2 * q - k > 3", None), ("abs(q) < 5", None),
    ("causal & document(seg)", None), ("causal | prefix(16)", None),
    ("sliding(64) | sink(4)", None), ("q // 6 == k // 4", None),
])
def test_known_periods(text, period):
  assert diagonal_period(maskc.parse(text)) == period


@settings(max_examples=60, deadline=None)
@given(m=mt.mask_trees(max_leaves=5, term_leaves=3), move=st.integers(1, 3),
       offset=st.integers(-20, 20))
def test_moving_both_positions_by_the_period_changes_nothing(m, move, offset):
  period = diagonal_period(m)
  if period is None or m.operands or period > 1000:
    return
  rows = np.arange(48) + offset
  cols = np.arange(40)
  here = maskc.materialize(m, 48, 40, q_positions=rows, kv_positions=cols)
  shift = move * period
  there = maskc.materialize(m, 48, 40, q_positions=rows + shift, kv_positions=cols + shift)
  np.testing.assert_array_equal(np.asarray(here), np.asarray(there))


PERIODIC = ["causal", "sliding(37)", "local(5, 9)", "causal & chunk(64)",
            "causal & (q - k) % 4 == 0 & q - k < 100", "q % 6 == k % 4",
            "(q - k) % 3 == 1 | chunk(48)", "~causal", "q // 2 - k // 2 < 3 & causal"]


@settings(max_examples=40, deadline=None)
@given(text=st.sampled_from(PERIODIC), q_len=st.integers(64, 700), kv_len=st.integers(64, 700),
       offset=st.one_of(st.none(), st.integers(-64, 64)),
       tiles=st.sampled_from([(8, 8), (16, 8), (8, 32), (16, 16), (4, 12)]))
def test_repeated_period_equals_the_dense_tile_states(text, q_len, kv_len, offset, tiles):
  bq, bk = tiles
  _lower._CACHE.clear()
  bm = maskc.compile(text, q_len, kv_len, block_q=bq, block_kv=bk, q_offset=offset, exact=True)
  expected = tile_states(np.asarray(maskc.materialize(text, q_len, kv_len, q_offset=offset)),
                          bq, bk)
  np.testing.assert_array_equal(bm.grid, expected)
  cols = np.asarray(grid_from_runs(np, bm.cols, expected.shape[0]))[0, 0]
  np.testing.assert_array_equal(cols.T, expected)


def test_periodic_masks_take_the_repeating_path():
  """One period of tiles classified and repeated, rows and columns: the periodic rule and
  no other (the generic analysis would classify the whole grid of a million tiles)."""
  _lower._CACHE.clear()
  n = 1024  # tiles per side
  # causal: row i holds a FULL run [0, i) (none in row 0) and the PARTIAL diagonal tile;
  # chunked causal the same within each chunk of 64 tiles; the banded `%` mask one
  # PARTIAL run of up to 32 tiles per row.
  for text, runs in [("causal", 2 * n - 1), ("causal & chunk(8192)", (n // 64) * 127),
                     ("causal & (q - k) % 4 == 0 & q - k < 4096", n)]:
    with taken() as fired:
      bm = maskc.compile(text, n * 128, block_q=128, block_kv=128)
      assert int(bm.rows.count.sum()) == runs
      assert int(bm.cols.count.sum()) == runs
    # `row_intervals` (the key intervals every compile proves) lowers no tiles.
    assert fired - {"row_intervals"} == {"periodic"}, (text, fired)


def test_periodic_map_with_a_batch_matches_each_row():
  seg = np.stack([np.repeat(np.arange(4), 64), np.repeat(np.arange(8), 32)])
  _lower._CACHE.clear()
  bm = maskc.compile(["causal & chunk(64)", "causal & document(seg)"], 256, block_q=16,
                     block_kv=16, operands={"seg": seg})
  dense = np.asarray(maskc.materialize("causal & chunk(64)", 256))
  expected = tile_states(dense, 16, 16)
  grid = np.asarray(grid_from_runs(np, bm.rows, 16))
  for b in range(2):
    np.testing.assert_array_equal(grid[b, 0], expected)
