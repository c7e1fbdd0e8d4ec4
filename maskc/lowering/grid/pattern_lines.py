"""Lines that repeat a pattern of runs, each with a window of it replaced, packed.

An `|` with a part of one axis (`local(64, 64) | g[q] | g[k]`) has, on every
line, the runs of `g[k]` (a *pattern*, the same for every line of a batch row)
except near the other parts' runs, where the two are combined: on long grids,
hundreds of thousands of runs, nearly all the pattern's. Written out run by run
(an index per run, a gather, then packing), the pattern costs several passes over
them; here each line's packed row is read from a padded copy of the pattern as
one window (a row of a strided view), the runs before the replaced window laid
over it from the row's start, and only the combined runs placed one by one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from maskc.compiled.tiles import Runs
from maskc.lowering.grid.refine import Budget
from maskc.lowering.tuning import SLOT_BYTES


def spliced_pattern(pattern: Any, nb: int, n_lines: int, lines: Any, lo: Any, hi: Any, mid: Any,
                    budget: Budget) -> Runs:
  """The packed runs `[nb, n_lines, R]` of lines that are a pattern of runs with a window
  replaced: on flat lines `lines` (`b * n_lines + line`, sorted), the pattern's runs
  `[lo, hi)` (indices into it) give way to the runs `mid`; every other line is the
  pattern of its batch row.

  `pattern`: a `maskc.lowering.grid.forms.Pattern`, `(b, a, z, state)` sorted by batch
  row, each row's runs in order, merged.
  `mid`: per line of `lines` at most, sorted, merged runs `(flat line, a, z, state)`,
  positions within the line, none touching a kept pattern run in its state (so the
  lines come out merged). Lines may lose their window and gain no runs. The rows are
  charged to `budget` before they are made.
  """
  pb, pa, pz, ps = pattern
  n_all = nb * n_lines
  count = np.bincount(pb, minlength=nb)
  first = np.cumsum(count) - count
  row = np.arange(n_all) // n_lines
  kept_before = count[row]  # a line without a window: the pattern, all of it kept
  after = count[row].copy()  # where the runs kept after the window start, in its row
  kept_before[lines] = lo - first[lines // n_lines]
  after[lines] = hi - first[lines // n_lines]
  mid_line, ma, mz, ms = mid
  n_mid = np.bincount(mid_line, minlength=n_all)
  total = kept_before + n_mid + count[row] - after
  r = max(1, int(total.max()) if total.size else 1)
  budget.charge(n_all * (r * SLOT_BYTES + 64), "splicing a pattern of runs")
  # each row's pattern padded with r empty runs on both sides: a window of r runs
  # starting anywhere from r before its first run to its last one stays inside the row
  width = count.max(initial=0) + 2 * r
  at = np.arange(pb.size) - first[pb] + r  # each pattern run's place in its padded row
  padded = []
  for values, dtype in ((pa, np.int32), (pz, np.int32), (ps, np.int8)):
    table = np.zeros((nb, width), dtype)
    table[pb, at] = values
    padded.append(table.reshape(-1))
  # the runs after the window: slot s of a line holds the run `after + s - (kept before
  # + combined)` of its row's pattern, empty past the row's last
  start = r + after - kept_before - n_mid + row * width
  out = [np.take(sliding_window_view(table, r), start, axis=0) for table in padded]
  # the runs kept before the window: slot s holds the row's run s
  before = np.arange(r, dtype=np.int32)[None, :] < kept_before.astype(np.int32)[:, None]
  head = row * width + r
  for o, table in zip(out, padded):
    rows = np.take(sliding_window_view(table, r), head if nb > 1 else head[:1], axis=0)
    np.copyto(o, rows, where=before)
  # the combined runs, each in the slot after its line's kept runs and those before it
  slot = kept_before[mid_line] + np.arange(mid_line.size) - (np.cumsum(n_mid) - n_mid)[mid_line]
  for o, values in zip(out, (ma, mz, ms)):
    o[mid_line, slot] = values
  shape = (nb, n_lines, r)
  return Runs(out[0].reshape(shape), out[1].reshape(shape), out[2].reshape(shape),
              total.astype(np.int32).reshape(nb, n_lines))
