"""Searches over the runs lines read (`maskc.lowering.closed_forms.equal_reads`), against NumPy's
binary search."""

import numpy as np
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

from maskc.lowering.closed_forms.equal_reads import _Sorted, equal_read_bounds, equal_read_runs
from maskc.lowering.grid.geometry import TileGeometry
from maskc.semantics.operand_runs import RunForm, RunTable
from maskc.semantics.shape import Shape

ints = hnp.arrays(np.int64, st.integers(0, 40), elements=st.integers(-50, 50))


@given(ints, ints, st.sampled_from(["left", "right"]), st.integers(-2**40, 2**40))
def test_counted_search_is_a_binary_search(a, v, side, shift):
  """By counting where values are close (any offset), by binary search where they are far
  apart: the same indices either way."""
  a = np.sort(a) + shift
  v = v + shift
  np.testing.assert_array_equal(_Sorted(a).search(v, side), np.searchsorted(a, v, side))
  spread = np.sort(np.concatenate([a, (a - shift) * 1000 + shift]))  # too wide to count
  np.testing.assert_array_equal(_Sorted(spread).search(v, side),
                                np.searchsorted(spread, v, side))


@given(st.integers(2, 60), st.integers(1, 3), st.sampled_from([1, 4, 8]), st.integers(0, 2**31))
def test_one_operand_row_read_by_every_batch_row(n, nb, block, seed):
  """An operand of one row read by `nb` batch rows gives the runs and bounds of that row
  repeated `nb` times: the same as the operand stacked `nb` times, along rows and columns,
  with and without a truth read beside the equal reads."""
  rng = np.random.default_rng(seed)
  seg = np.sort(rng.integers(0, 6, n))
  geo = TileGeometry(Shape.of(n, n, 0), block, block)
  one, many = (RunTable(RunForm.of(a)) for a in (seg[None], np.stack([seg] * nb)))
  on_one, on_many = one.values % 2 == 0, many.values % 2 == 0
  for along_rows in (True, False):
    np.testing.assert_array_equal(equal_read_bounds(one, geo, nb, 0, 0, along_rows),
                                  equal_read_bounds(many, geo, nb, 0, 0, along_rows))
    for a, b in zip(equal_read_runs(one, geo, nb, 0, 0, along_rows, on_one),
                    equal_read_runs(many, geo, nb, 0, 0, along_rows, on_many)):
      np.testing.assert_array_equal(a, b)
