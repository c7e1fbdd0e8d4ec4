"""Ragged index ranges in NumPy: many `arange`s in one array, without a Python loop.

The static lowering expands rectangles of tiles into lines, lines into pieces
and patterns of runs into every line: each is a list of ranges of indices laid
end to end. A cumulative sum of steps (1 inside a range, a jump at each start)
builds them in two passes over the output, where `repeat` plus an offset
`arange` takes five.
"""

from __future__ import annotations

import numpy as np


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """`concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])` as int64.

  >>> ranges(np.array([5, 0, 9, 2]), np.array([3, 0, 1, 2])).tolist()
  [5, 6, 7, 9, 2, 3]
  """
  starts = np.asarray(starts, np.int64)
  lengths = np.asarray(lengths, np.int64)
  keep = lengths > 0
  if not keep.all():
    starts, lengths = starts[keep], lengths[keep]
  if not starts.size:
    return np.zeros(0, np.int64)
  at = np.cumsum(lengths) - lengths  # where each range begins in the output
  step = np.ones(int(at[-1] + lengths[-1]), np.int64)
  step[0] = starts[0]
  # the jump from the last index of one range to the first of the next
  step[at[1:]] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
  return np.cumsum(step)
