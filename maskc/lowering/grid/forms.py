"""The static lowering's named result forms, each with its docstring, and the conversions
between them, in one place.

A way of lowering a part gives its tiles in one of these forms; the combiner
(`maskc.lowering.generic.combination`) and the packing into a `BlockMap`'s `Runs` convert between
them here:

- `LineRuns` (`merged()`): runs `(b, line, a, z, state)`, one entry per run;
- `FlatRuns` (`flat()`): the same runs keyed along one sorted axis for all lines,
  `(key, end, state)`; `keyed` and `split_keys` go there and back;
- `LineBounds` (`bounds()`): a band-shaped line's tiles as four bounds `[4, n]`,
  `s, f, g, e`; `line_runs` and `keyed_band_runs` give their runs;
- `Runs` (`runs()`, `maskc.compiled.tiles`): runs packed into padded `[nb, n_lines, R]`
  arrays; `pack_runs`, `pack_keyed` and `unpacked` convert;
- `Pattern` (`pattern`): the runs every line of a batch row has, for a part that reads
  one position only; `maskc.lowering.grid.pattern_lines` splices it into lines;
- `maskc.compiled.intervals.KeyIntervals` (`bm.key_intervals()`, rule `row_intervals`):
  one interval of keys per row, proved from the IR, no tiles.

Beyond these, a part's runs object says which forms it can give (`Form`, its `forms`), so
that the combiner chooses a closed form by the forms of the parts it combines, not by the
class that lowered them (the typed protocols: `maskc.lowering.grid.parts`).

A tile's flat key is `(b * n_lines + line) * (n_span + 1) + position`: the `+ 1` leaves a
key between lines that no run covers, so runs of different lines never touch.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from maskc.arrays.ragged import group_ends
from maskc.compiled.tiles import EMPTY, FULL, PARTIAL, Runs

# A NumPy array of the static lowering (tile indices, flat keys and states are int64 and int8;
# the lowering checks shapes and dtypes where it builds them, not in annotations).
Array = npt.NDArray[Any]


class Form(enum.Enum):
  """A form a part's runs can be given in, beyond `merged()` (`LineRuns`) and `runs()`
  (`Runs`), which every part gives. A part lists the ones it gives in `forms`."""

  BAND = enum.auto()
  """An exact band `lo <= q - k <= hi`: `band` is `(lo, hi)`, `bounds(along_rows)` its
  `LineBounds` per line, the same for every batch row."""
  INTERVALS = enum.auto()
  """One interval of keys per row, a band's or a band's inside chunks: `intervals()`, a
  `maskc.lowering.grid.bands.Intervals`."""
  LINE_BOUNDS = enum.auto()
  """Band-shaped lines: `bounds(along_rows)` is `LineBounds` per flat line (batch row and
  line), exact."""
  WIDENS = enum.auto()
  """Equal reads of runs that widen a band to one interval per row:
  `widened(intervals, along_rows)`, `LineBounds` per flat line or None."""
  PATTERN = enum.auto()
  """Reads one position only: `pattern` (a `Pattern`), and `pattern_along(along_rows)`,
  whether its runs along these lines repeat it on every line or each line is one run."""
  FLAT = enum.auto()
  """Gives `flat(along_rows)` (`FlatRuns`) directly, as it found or combined them."""
  PIECES = enum.auto()
  """The generic analysis's operand pieces of its lines (`pieces`), lent to an `&` / `|`
  that reads the same operands."""
  JOIN = enum.auto()
  """An `&` / `|` of parts lowered apart: `parts`, and `union` (True for `|`)."""


class LineRuns(NamedTuple):
  """Runs of tiles, one entry per run: tiles `[a, z)` of line `line` (a q tile row, or a
  key tile column for the backward pass) of batch row `b`, in `state` (PARTIAL or FULL).

  What `merged()` gives: sorted by `(b, line, a)`, neighbours of one state merged
  (`maskc.lowering.grid.run_lists.merge_runs`).
  """
  b: Array
  line: Array
  a: Array
  z: Array
  state: Array


class Pattern(NamedTuple):
  """Runs of tiles `[a, z)` in `state` that every line of batch row `b` has (a part that
  reads one position only: `g[k]` along q tile rows), sorted by `b`, each row's runs in
  order and merged; never written out per line unless a line needs them."""
  b: Array
  a: Array
  z: Array
  state: Array


class FlatRuns(NamedTuple):
  """Runs of tiles `[key, end)` in `state`, keyed along one axis for all lines (`keyed`).

  What `flat()` gives: sorted, EMPTY ones dropped, neighbours of one state merged
  (`merge_keyed`), so that lists of many lines combine as one sorted list.
  """
  key: Array
  end: Array
  state: Array


# A line's tiles shaped like a band's (`bounds()`): `[4, n]` int64 bounds `s, f, g, e` per
# line, the tiles `[s, f)` PARTIAL, `[f, g)` FULL, `[g, e)` PARTIAL, and none elsewhere
# (`maskc.lowering.grid.bands.band_bounds`). An array, not a tuple: lines are
# sliced and taken along its second axis.
LineBounds = Array

BAND_STATES = np.array([PARTIAL, FULL, PARTIAL], np.int8)  # of [s, f), [f, g), [g, e)


def keyed(merged: tuple[Array | int, Array, Array, Array, Array],
          n_lines: int, n_span: int) -> FlatRuns:
  """Sorted runs `(b, line, a, z, state)` (`b` may be one row for all) as `(start key, stop
  key, state)`, where a tile's key is `(b * n_lines + line) * (n_span + 1) + position`: one
  sorted axis for all lines."""
  b, line, a, z, state = merged
  base = (np.asarray(b, np.int64) * n_lines + line) * (n_span + 1)
  return FlatRuns(base + a, base + z, np.asarray(state, np.int8))


def split_keys(key: Array, n_lines: int, n_span: int,
               batched: bool) -> tuple[Array, Array, Array]:
  """`(b, line, position)` of flat keys (`keyed`); b is 0 where `batched` is False."""
  line, pos = np.divmod(key, n_span + 1)
  if batched:
    b, line = np.divmod(line, n_lines)
  else:
    b = np.zeros_like(line)
  return b, line, pos


def merge_keyed(key: Array, end: Array, state: Array) -> FlatRuns:
  """Sorted flat runs `(start key, stop key, state)` (`keyed`) with EMPTY ones dropped and
  neighbours of one state merged: keys of different lines never touch."""
  keep = state != EMPTY
  if not keep.all():
    key, end, state = key[keep], end[keep], state[keep]
  if key.size < 2:
    return FlatRuns(key, end, state)
  new = np.empty(key.size, bool)
  new[0] = True
  np.not_equal(key[1:], end[:-1], out=new[1:])
  new[1:] |= state[1:] != state[:-1]
  if new.all():
    return FlatRuns(key, end, state)
  first, last = group_ends(new)  # runs are disjoint and sorted: the last ends last
  return FlatRuns(key[first], end[last], state[first])


def pack_runs(b: Array, line: Array, a: Array, z: Array, state: Array, nb: int,
              n_lines: int) -> Runs:
  """Runs of non-empty tiles, sorted and merged (`merge_runs`), packed into
  `[nb, n_lines, R]` arrays."""
  count = np.bincount(b * n_lines + line if nb > 1 else line,
                      minlength=nb * n_lines).astype(np.int32)
  return packed_lines(a, z, state, count, nb, n_lines)


def pack_keyed(key: Array, end: Array, state: Array, nb: int, n_lines: int,
               n_span: int) -> Runs:
  """Sorted, merged flat runs (`keyed`, `merge_keyed`) packed as `pack_runs` does. Where
  lines hold many runs each, each line's runs are found by binary search for its first
  key, not each key's line by division (twice as fast for hundreds of thousands of runs:
  `docs/lowering.md`, "Measurements behind the design")."""
  stride = n_span + 1
  n_all = nb * n_lines
  if key.size <= 4 * n_all:
    line = key // stride
    count = np.bincount(line, minlength=n_all).astype(np.int32)
    base = line * stride
  else:
    bounds = np.searchsorted(key, np.arange(n_all + 1, dtype=np.int64) * stride)
    count = np.diff(bounds).astype(np.int32)
    base = np.repeat(np.arange(n_all, dtype=np.int64) * stride, count)
  return packed_lines(key - base, end - base, state, count, nb, n_lines)


def unpacked(runs: tuple[Array, ...], nb: int, n_lines: int, n_span: int) -> FlatRuns:
  """Packed runs (`[B', n_lines, R]` arrays, `B'` 1 or `nb`) as sorted flat runs `(start
  key, stop key, state)` (`keyed`): the counterpart of `pack_keyed`."""
  start, stop, state = (np.broadcast_to(x, (nb,) + x.shape[1:]) for x in runs[:3])
  r = start.shape[-1]
  count = (state != EMPTY).sum(-1) if r else np.zeros((nb, n_lines), np.int64)
  valid = np.arange(r) < count[..., None]
  line = (np.arange(nb)[:, None, None] * n_lines + np.arange(n_lines)[None, :, None])
  base = np.broadcast_to(line, start.shape)[valid].astype(np.int64) * (n_span + 1)
  return FlatRuns(base + start[valid], base + stop[valid], state[valid].astype(np.int8))


def packed_lines(a: Array, z: Array, state: Array, count: Array, nb: int,
                 n_lines: int) -> Runs:
  """Runs `[a, z)` in `state`, merged, line after line, each line's in order and `count` a
  line (positions within the line), in `[nb, n_lines, R]` arrays."""
  r = max(1, int(count.max()) if count.size else 1)
  shape = (nb, n_lines, r)
  # the runs come sorted by line: in row-major order, the k-th run of a line fills its
  # slot k, so a mask of the used slots places them all (several times faster than a
  # scatter to computed indices)
  used = (np.arange(r, dtype=np.int32) < count[:, None]).reshape(shape)
  start = np.zeros(shape, np.int32)
  stop = np.zeros(shape, np.int32)
  st = np.zeros(shape, np.int8)
  start[used] = a
  stop[used] = z
  st[used] = state
  return Runs(start, stop, st, count.reshape(nb, n_lines))


def line_runs(bounds: LineBounds) -> tuple[Array, Array, Array, Array]:
  """The runs of lines with band bounds `bounds` (`[4, n]`: s, f, g, e), empty ones
  dropped: `(the line's index in bounds, a, z, state)`, in order."""
  s, f, g, e = bounds
  a = np.stack([s, f, g], axis=1).reshape(-1)
  z = np.stack([f, g, e], axis=1).reshape(-1)
  keep = np.flatnonzero(z > a)
  return keep // 3, a[keep], z[keep], BAND_STATES[keep % 3]


def keyed_band_runs(bounds: LineBounds, lines: Array | None, n_lines: int, n_span: int,
                    nb: int = 1) -> FlatRuns:
  """The band's runs on sorted distinct flat lines `lines` (`b * n_lines + line`; None:
  every line of `nb` batch rows, with no lines picked), given its bounds `bounds`
  (`band_bounds`: per line of every batch row, or per flat line, as a widened band's), as
  flat runs (`maskc.lowering.grid.forms.keyed`)."""
  if lines is None:
    at, a, z, state = line_runs(bounds if bounds.shape[1] == nb * n_lines else
                                np.tile(bounds, nb))
    flat = at
  else:
    at, a, z, state = line_runs(bounds[:, lines % bounds.shape[1]])
    flat = lines[at]
  # flat lines as lines of batch row 0: the same keys; an empty FULL run leaves two
  # PARTIAL ones side by side, merged into one
  return merge_keyed(*keyed((0, flat, a, z, state), n_lines, n_span))
