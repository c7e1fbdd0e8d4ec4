"""The run form of operands (`maskc.semantics.operand_runs`) against plain loops: a lossless
summary of an operand (its runs, digest and run ids), the set flags found word by word, which
run holds a token (by binary search and by the per-token index), and the sparse tables'
level `floor(log2(n))`, in NumPy and under jit."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

from helpers import runs_reference


@st.composite
def run_arrays(draw):
  """`[B, L]` arrays of a few runs (ids, flags or extreme values), B in 1..3."""
  b, n = draw(st.integers(1, 3)), draw(st.integers(1, 40))
  values = st.sampled_from([0, 1, 2, 7, -3, 2**62, -2**63])
  rows = []
  for _ in range(b):
    row, pos = [], 0
    while pos < n:
      run = draw(st.integers(1, n - pos))
      row += [draw(values)] * run
      pos += run
    rows.append(row)
  return np.array(rows, np.int64)


@given(run_arrays())
def test_run_form_is_a_lossless_summary(a):
  """The run form rebuilds the operand, its digest tells operands apart, and run ids agree
  with a plain loop, on one row and broadcast over rows."""
  from maskc.semantics.operand_runs import RunForm
  form = RunForm.of(a)
  np.testing.assert_array_equal(form.to_array(np.int64), a)
  assert form.starts[0] == 0 and (np.diff(form.starts) > 0).all()
  assert all(b * a.shape[1] in form.starts for b in range(a.shape[0]))  # rows start runs
  np.testing.assert_array_equal(form.run_ids().to_array(np.int64), runs_reference(a != 0))
  changed = a.copy()
  changed.flat[len(a.flat) // 2] ^= 1
  assert RunForm.of(changed).digest() != form.digest()
  assert RunForm.of(a.copy()).digest() == form.digest()
  one = RunForm.of(a[:1]).broadcast(3)
  np.testing.assert_array_equal(one.to_array(np.int64), np.repeat(a[:1], 3, axis=0))
  np.testing.assert_array_equal(one.run_ids().to_array(np.int64),
                                runs_reference(np.repeat(a[:1], 3, axis=0) != 0))


@given(st.integers(0, 5000), st.lists(st.integers(0, 4999), max_size=40))
def test_few_set_flags_are_found_word_by_word(n, places):
  """`np.flatnonzero` of a long, sparse bool array (an operand's changes), by the 8-byte
  words that hold any, any length and places (tail past the last whole word included)."""
  from maskc.semantics.operand_runs import _set_flags
  flags = np.zeros(n, bool)
  flags[[p for p in places if p < n]] = True
  np.testing.assert_array_equal(_set_flags(flags), np.flatnonzero(flags))
  np.testing.assert_array_equal(_set_flags(flags[1:]), np.flatnonzero(flags[1:]))


@given(run_arrays(), st.lists(st.integers(-5, 400), min_size=1, max_size=30))
def test_run_lookup_by_search_and_by_token_index_agree(a, tokens):
  """Which run holds a token: by binary search over the run starts and by the per-token
  index built once searches have cost enough, both equal to a plain scan; and no index
  where it would not fit the budget, or for runs few enough to search in cache."""
  from maskc.semantics import operand_runs as _operand_runs
  from maskc.semantics.operand_runs import RunForm, RunTable
  form = RunForm.of(a)
  assert RunTable(form, index_bytes=1 << 20)._search.may_index is (
      form.starts.size > _operand_runs.SEARCH_IN_CACHE)
  in_cache, _operand_runs.SEARCH_IN_CACHE = _operand_runs.SEARCH_IN_CACHE, 0  # index any runs
  try:
    _check_run_lookups(form, a, tokens)
  finally:
    _operand_runs.SEARCH_IN_CACHE = in_cache


def _check_run_lookups(form, a, tokens):
  """Lookups of `tokens` (one batch row each, in turn) by search and by index, to a scan."""
  from maskc.semantics.operand_runs import RunTable
  rows, length = a.shape
  b = np.arange(len(tokens)) % rows
  i = np.asarray(tokens)
  clipped = np.clip(i, 0, length - 1)
  # the run of token t is the last run starting at or before it
  expected = np.array([max(r for r, s in enumerate(form.starts) if s <= bb * length + t)
                       for bb, t in zip(b, clipped)])
  searching = RunTable(form)  # index_bytes 0: never an index
  indexed = RunTable(form, index_bytes=1 << 20)
  for _ in range(2 * rows * length):  # enough lookups to build the index
    if indexed._search.index is not None:
      break
    np.testing.assert_array_equal(indexed.run_index(b, i), expected)
  assert indexed._search.index is not None and searching._search.index is None
  np.testing.assert_array_equal(indexed.run_index(b, i), expected)
  np.testing.assert_array_equal(searching.run_index(b, i), expected)
  small = RunTable(form, index_bytes=4 * rows * length - 1)  # one byte short
  for _ in range(2 * rows * length):
    small.run_index(b, i)
  assert small._search.index is None


@given(st.lists(st.one_of(st.integers(1, 2**53 - 1),
                          st.integers(0, 52).map(lambda e: 2**e),
                          st.integers(1, 53).map(lambda e: 2**e - 1)), min_size=1,
                max_size=64))
def test_floor_log2_is_exact_for_counts(ns):
  """The sparse tables' level, `floor(log2(n))`, equals Python's exact integer answer,
  at and around every power of two a count can reach, in NumPy and under jit."""
  from maskc.semantics.operand_runs import floor_log2
  got = floor_log2(np, np.array(ns, np.int64))
  assert got.dtype == np.int64
  assert got.tolist() == [n.bit_length() - 1 for n in ns]
  small = np.array([n for n in ns if n < 2**24] + [1, 2, 3, 2**23, 2**24 - 1], np.int32)
  padded = np.pad(small, (0, 69 - small.size), constant_values=1)  # one shape: one compile
  traced = _floor_log2_jit(padded)  # float32 under jit: counts < 2**24
  assert traced.dtype == jnp.int32
  assert np.asarray(traced)[:small.size].tolist() == [int(n).bit_length() - 1 for n in small]


@jax.jit
def _floor_log2_jit(x):
  from maskc.semantics.operand_runs import floor_log2
  return floor_log2(jnp, x)
