"""Helpers over flat run lists (`maskc.lowering.grid.run_lists`) against plain NumPy: which keys lie
on given lines, which runs of one list overlap the other's, two sorted lists of disjoint runs
interleaved, and leaves (disjoint rectangles) expanded into runs in line order."""

import numpy as np
from hypothesis import given, settings, strategies as st

from maskc.arrays.ragged import group_ends, ranges
from maskc.compiled.tiles import EMPTY, FULL, PARTIAL
from maskc.lowering.grid.bands import band_bounds
from maskc.lowering.grid.forms import keyed_band_runs
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.run_lists import interleaved, meeting_mask, on_lines_mask
from maskc.semantics.shape import Shape


@st.composite
def flat_runs(draw, n_lines: int, n_span: int):
  """Sorted flat runs `(start key, stop key, state)` on some of `n_lines` lines."""
  rng = np.random.default_rng(draw(st.integers(0, 2**31)))
  lines = np.flatnonzero(rng.random(n_lines) < draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])))
  key, end = [], []
  for line in lines:
    cuts = np.unique(rng.integers(0, n_span + 1, 2 * rng.integers(1, 4)))
    cuts = cuts[:cuts.size // 2 * 2].reshape(-1, 2)
    key += list(line * (n_span + 1) + cuts[:, 0])
    end += list(line * (n_span + 1) + cuts[:, 1])
  key, end = np.asarray(key, np.int64), np.asarray(end, np.int64)
  return key, end, rng.integers(1, 3, key.size).astype(np.int8)


@given(st.data(), st.integers(1, 40), st.integers(1, 30))
def test_keys_on_lines_are_those_whose_line_is_listed(data, n_lines, n_span):
  key = data.draw(flat_runs(n_lines, n_span))[0]
  lines = np.flatnonzero(np.asarray(data.draw(st.lists(st.booleans(), min_size=n_lines,
                                                         max_size=n_lines)), bool))
  np.testing.assert_array_equal(on_lines_mask(key, lines, n_span),
                                np.isin(key // (n_span + 1), lines))


@given(st.data(), st.integers(1, 40), st.integers(1, 30))
def test_lists_on_disjoint_lines_interleave_as_a_sort(data, n_lines, n_span):
  x = data.draw(flat_runs(n_lines, n_span))
  mine = on_lines_mask(x[0], np.flatnonzero(np.arange(n_lines) % 3 == 0), n_span)
  a, b = (tuple(v[keep] for v in x) for keep in (mine, ~mine))
  order = np.argsort(np.concatenate([a[0], b[0]]), kind="stable")
  for got, u, v in zip(interleaved(a, b), a, b):
    np.testing.assert_array_equal(got, np.concatenate([u, v])[order])


@given(st.data(), st.integers(1, 40), st.integers(1, 30))
def test_runs_meeting_another_list_are_those_that_share_a_key(data, n_lines, n_span):
  """`meeting_mask` against a key-by-key overlap, touching runs excluded."""
  x, y = data.draw(flat_runs(n_lines, n_span)), data.draw(flat_runs(n_lines, n_span))
  covered = np.zeros(n_lines * (n_span + 1), bool)
  for a, z in zip(y[0], y[1]):
    covered[a:z] = True
  want = [bool(covered[a:z].any()) for a, z in zip(x[0], x[1])]
  np.testing.assert_array_equal(meeting_mask(x, y), np.asarray(want, bool))


@given(st.data(), st.integers(1, 40), st.integers(1, 30))
def test_disjoint_runs_on_shared_lines_interleave_as_a_sort(data, n_lines, n_span):
  """Two lists whose runs share lines but not keys (a list split at random) interleave."""
  x = data.draw(flat_runs(n_lines, n_span))
  mine = np.asarray(data.draw(st.lists(st.booleans(), min_size=x[0].size,
                                       max_size=x[0].size)), bool)
  a, b = (tuple(v[keep] for v in x) for keep in (mine, ~mine))
  for got, want in zip(interleaved(a, b), x):
    np.testing.assert_array_equal(got, want)


@given(st.one_of(st.none(), st.integers(-30, 30)), st.one_of(st.none(), st.integers(-30, 30)),
       st.integers(1, 60), st.integers(1, 60), st.sampled_from([1, 3, 8]), st.data())
def test_a_bands_runs_on_some_lines_are_its_tiles_there(lo, hi, q_len, kv_len, block, data):
  """`keyed_band_runs` on chosen lines of two batch rows give the band's tile states there."""
  geo = TileGeometry(Shape.of(q_len, kv_len, 0), block, block)
  for along_rows, n_lines, n_span in ((True, geo.nq, geo.nk), (False, geo.nk, geo.nq)):
    bounds = band_bounds(geo, lo, hi, along_rows)
    lines = np.flatnonzero(np.asarray(data.draw(st.lists(
        st.booleans(), min_size=2 * n_lines, max_size=2 * n_lines)), bool))
    key, end, state = keyed_band_runs(bounds, lines, n_lines, n_span)
    got = np.zeros((2 * n_lines, n_span), np.int8)
    for a, z, s in zip(key, end, state):
      line, pos = divmod(int(a), n_span + 1)
      got[line, pos:pos + int(z - a)] = s
    s, f, g, e = bounds
    t = np.arange(n_span)
    one = np.where((t >= f[:, None]) & (t < g[:, None]), FULL,
                   np.where((t >= s[:, None]) & (t < e[:, None]), PARTIAL, EMPTY))
    want = np.zeros_like(got)
    want[lines] = np.tile(one, (2, 1))[lines]
    np.testing.assert_array_equal(got, want)


@given(st.lists(st.tuples(st.integers(-5, 1000), st.integers(-3, 12)), max_size=30))
def test_ranges_are_aranges_laid_end_to_end(pairs):
  starts = np.asarray([s for s, _ in pairs], np.int64)
  lengths = np.asarray([n for _, n in pairs], np.int64)
  want = [i for s, n in pairs for i in range(s, s + n)]  # a negative length: none
  got = ranges(starts, lengths)
  assert got.dtype == np.int64
  assert got.tolist() == want


@given(st.lists(st.booleans(), min_size=1, max_size=40))
def test_group_ends_select_each_groups_first_and_last(flags):
  new = np.asarray([True] + flags[1:], bool)
  first, last = group_ends(new)  # masks or indices: either selects
  starts = [i for i, f in enumerate(new) if f]
  ends = [s - 1 for s in starts[1:]] + [len(new) - 1]
  items = np.arange(new.size)
  assert items[first].tolist() == starts
  assert items[last].tolist() == ends


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 40), st.integers(0, 2**31))
def test_leaves_expand_in_line_order(nb, n_lines, n_span, seed):
  """Leaves (disjoint rectangles) expanded in `(b, line, a)` order by the radix sorts (and by
  one key when the lines are too many for 16 bits): the order of a plain sort of the runs."""
  from maskc.lowering.grid import run_lists as _run_lists
  rng = np.random.default_rng(seed)
  rects = []  # random disjoint rectangles: a grid cut into random row bands and column cuts
  for b in range(nb):
    rows = np.unique(np.concatenate([[0, n_lines], rng.integers(0, n_lines, 4)]))
    for i0, i1 in zip(rows[:-1], rows[1:]):
      cols = np.unique(np.concatenate([[0, n_span], rng.integers(0, n_span, 4)]))
      rects += [(b, i0, i1, j0, j1, rng.integers(1, 3)) for j0, j1 in zip(cols[:-1], cols[1:])
                if rng.random() < 0.7]
  rng.shuffle(rects)
  leaves = tuple(np.array([r[f] for r in rects], np.int8 if f == 5 else np.int64).reshape(-1)
                 for f in range(6))
  for along_rows in (True, False):
    lines = n_lines if along_rows else n_span
    want = _run_lists.expand_leaves(leaves, along_rows)
    order = np.lexsort((want[2], want[1], want[0]))
    want = [x[order] for x in want]
    got = _run_lists.expand_in_order(leaves, along_rows, lines)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)
    wide = _run_lists.expand_in_order(leaves, along_rows, (1 << 16) + 1)  # one-key path
    merged = _run_lists.merge_runs(*want)
    for g, w in zip(wide, merged):
      np.testing.assert_array_equal(g, w)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 40), st.integers(0, 2**31))
def test_columns_transposed_through_the_grid_are_the_rows_runs(nb, n_rows, n_cols, seed):
  """Columns' runs (disjoint in each column, adjacent ones of one state included) turned into
  rows' runs through the dense grid: the rows' runs that expanding their tiles gives."""
  from maskc.lowering.grid import run_lists as _run_lists
  rng = np.random.default_rng(seed)
  leaves = []
  for b in range(nb):
    for j in range(n_cols):
      cuts = np.unique(np.concatenate([[0, n_rows], rng.integers(0, n_rows, 5)]))
      leaves += [(b, i0, i1, j, j + 1, rng.integers(1, 3)) for i0, i1 in zip(cuts[:-1], cuts[1:])
                 if rng.random() < 0.7]
  fields = tuple(np.array([r[f] for r in leaves], np.int8 if f == 5 else np.int64).reshape(-1)
                 for f in range(6))
  b, i0, i1, j, _, state = fields
  columns = _run_lists.merge_runs(b, j, i0, i1, state, in_order=True)
  want = _run_lists.merge_runs(*_run_lists.expand_in_order(fields, True, n_rows), in_order=True)
  got = _run_lists.transposed_through_grid(columns, nb, n_rows, n_cols)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
