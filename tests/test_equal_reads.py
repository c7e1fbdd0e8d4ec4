"""Searches over the runs lines read (`maskc._equal_reads`), against NumPy's binary search."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from maskc._equal_reads import _Sorted

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
