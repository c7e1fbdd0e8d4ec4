"""Tree masks: `maskc.trees` (entry and exit times from parents, the rollout layout) against
ancestor sets computed by walking parents, and the `tree` rule's tiles against the dense
mask and the lowering without it."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import maskc
from helpers import assert_exact, tile_states
from maskc import trees
from maskc.compiled.tiles import grid_from_runs
from maskc.lowering.rules import disabled, taken


def _ancestors(parent: np.ndarray) -> np.ndarray:
  """`out[q, k]`: k is q or an ancestor of q, by walking each token's parents."""
  n = parent.size
  out = np.zeros((n, n), bool)
  for q in range(n):
    v = q
    while v >= 0:
      out[q, v] = True
      v = parent[v]
  return out


@st.composite
def forests(draw, max_n: int = 60, n: int | None = None):
  """Parent arrays of forests of `n` tokens (drawn up to `max_n`): in DFS preorder (each
  parent before its children, subtrees contiguous) or any layout."""
  n = draw(st.integers(1, max_n)) if n is None else n
  seed = draw(st.integers(0, 2**16))
  rng = np.random.default_rng(seed)
  parent = np.full(n, -1)
  for i in range(1, n):  # preorder: a child of some token on the path to i - 1, or a root
    path = [i - 1]
    while parent[path[-1]] >= 0:
      path.append(int(parent[path[-1]]))
    parent[i] = path[int(rng.integers(0, len(path)))] if rng.random() < 0.9 else -1
  if draw(st.booleans()):  # any layout: the same forest with its tokens permuted
    perm = rng.permutation(n)
    inverse = np.argsort(perm)
    parent = np.where(parent[perm] >= 0, inverse[np.maximum(parent[perm], 0)], -1)
  return parent


@given(forests())
def test_entry_and_exit_times_give_the_ancestors(parent):
  ops = trees.from_parents(parent)
  tin, tout = ops["tin"], ops["tout"]
  expected = (tin[None, :] <= tin[:, None]) & (tin[:, None] < tout[None, :])
  np.testing.assert_array_equal(expected, _ancestors(parent))
  np.testing.assert_array_equal(
      np.asarray(maskc.materialize("tree(tin, tout)", parent.size, operands=ops)),
      _ancestors(parent))


def test_preorder_entry_times_are_the_positions():
  assert trees.from_parents([-1, 0, 1, 1, 0, -1, 5])["tin"].tolist() == list(range(7))


@given(st.integers(0, 20), st.lists(st.integers(0, 12), max_size=4))
def test_rollouts_see_the_prompt_and_their_own_completion(prompt, completions):
  ops = trees.rollout(prompt, completions)
  n = prompt + sum(completions)
  parent = np.arange(n) - 1
  start = prompt
  for c in completions:  # each completion's first token continues the prompt
    if c:
      parent[start] = prompt - 1
    start += c
  np.testing.assert_array_equal(
      np.asarray(maskc.materialize("tree(tin, tout)", n, operands=ops)) if n else
      np.zeros((0, 0), bool), _ancestors(parent))
  np.testing.assert_array_equal(ops["tin"], np.arange(n))


def test_bad_parents_are_refused():
  with pytest.raises(maskc.MaskValueError, match="cycle"):
    trees.from_parents([1, 0])
  with pytest.raises(maskc.MaskValueError, match="no position"):
    trees.from_parents([-1, 5])
  with pytest.raises(maskc.MaskValueError, match="integers"):
    trees.from_parents([0.5])


TEXTS = ["tree(tin, tout)", "tin[k] <= tin[q] & tin[q] < tout[k]",
         "tin[k] < tin[q] & tin[q] <= tout[k]", "causal & tree(tin, tout)",
         "~tree(tin, tout)", "tree(tin, tout) | sink(2)", "tree(tin, tout) ^ sliding(3)",
         "~(tin[k] <= tin[q] & tin[q] < tout[k]) ^ causal"]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(TEXTS), st.data())
def test_tree_tiles_are_exact_and_agree_with_the_generic_lowering(text, data):
  """In DFS order the rule lowers every tree exactly (its FULL tiles wherever a whole tile is
  ancestor-or-self); in any order the generic analysis lowers it; both are the dense mask's
  tiles where refined, and agree with the lowering without the rule. Batches of trees and
  query windows that end at the last key (decoding) included."""
  n = data.draw(st.integers(1, 40))
  parents = data.draw(st.lists(forests(n=n), min_size=1, max_size=2))
  rows = [trees.from_parents(p) for p in parents]
  ops = {k: (np.stack([r[k] for r in rows]) if len(rows) > 1 else rows[0][k])
         for k in ("tin", "tout")}
  q_len = data.draw(st.integers(1, n))
  bq, bk = data.draw(st.sampled_from([1, 2, 4, 8])), data.draw(st.sampled_from([1, 3, 4, 8]))
  dense = np.asarray(maskc.materialize(text, q_len, n, operands=ops))
  with taken() as fired:
    bm = maskc.compile(text, q_len, n, block_q=bq, block_kv=bk, operands=ops, exact=True)
  assert_exact(np.asarray(bm.grid), dense, bq, bk, text)
  preorder = all(np.all(np.diff(r["tin"]) > 0) for r in rows)
  if text in TEXTS[:3]:
    assert ("tree" in fired) == preorder, (text, fired)
  with disabled("tree"):
    without = maskc.compile(text, q_len, n, block_q=bq, block_kv=bk, operands=ops, exact=True)
  np.testing.assert_array_equal(np.asarray(bm.grid), np.asarray(without.grid))
  cols = np.asarray(bm.cols.count)  # the backward runs exist and are consistent
  assert cols.shape[-1] == -(-n // bk)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_column_leaves_are_the_key_by_key_leaves(data):
  """Where query tiles are at least as tall as key tiles are wide, each column's reached
  tiles are one run: the leaves from reductions over each column's keys are those found key
  by key, for trees in DFS order at any query offset."""
  from maskc.lowering.closed_forms import tree as _tree
  from maskc.lowering.grid.geometry import TileGeometry
  from maskc.semantics.shape import Shape
  n = data.draw(st.integers(1, 60))
  parents = data.draw(st.lists(forests(n=n), min_size=1, max_size=2))
  q_len = data.draw(st.integers(1, n))
  bk = data.draw(st.sampled_from([1, 2, 3, 4, 8]))
  bq = bk * data.draw(st.integers(1, 3)) + data.draw(st.integers(0, 2))
  keys = np.arange(n)
  lo, hi = [], []
  for p in parents:
    ops = trees.from_parents(p)
    order = np.argsort(ops["tin"])  # the same forest laid out in DFS preorder
    end = np.searchsorted(ops["tin"][order], ops["tout"][order])
    lo.append(np.clip(keys - (n - q_len), 0, q_len))
    hi.append(np.maximum(np.clip(end - (n - q_len), 0, q_len), lo[-1]))
  lo, hi = np.stack(lo), np.stack(hi)
  geo = TileGeometry(Shape.of(q_len, n, n - q_len), bq, bk)
  by_column = _tree._leaves_by_column(lo, hi, geo)
  by_key = _tree._leaves_by_key(lo, hi, geo)
  for a, b in zip(by_column, by_key):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cover", [0, 1 << 30])
def test_rows_of_a_tree_through_the_grid_or_its_tiles(monkeypatch, cover):
  """The rows' runs of a tree, by expanding its columns' tiles (a cover of 0 cells a tile)
  or through the dense grid (any cover): the dense mask's."""
  from maskc.lowering.closed_forms import tree as _tree
  monkeypatch.setattr(_tree, "GRID_TRANSPOSE_COVER", cover)
  ops = trees.rollout(300, [100, 250, 50, 140])
  n = 840
  bm = maskc.compile("tree(tin, tout)", n, block_q=32, block_kv=32, operands=ops)
  dense = np.asarray(maskc.materialize("tree(tin, tout)", n, operands=ops))
  want = tile_states(dense, 32, 32)
  np.testing.assert_array_equal(np.asarray(bm.grid).reshape(want.shape), want)
  from_rows = grid_from_runs(np, bm.rows, want.shape[-1])
  np.testing.assert_array_equal(np.asarray(from_rows).reshape(want.shape), want)


def test_rollout_prompt_tiles_are_full_for_every_completion():
  """A prompt of 4 tiles shared by three completions: every tile of a completion's rows over
  the prompt's keys is FULL, none of a completion's rows over another completion's keys is
  visited."""
  ops = trees.rollout(256, [128, 192, 64])
  bm = maskc.compile("tree(tin, tout)", 640, block_q=64, block_kv=64, operands=ops)
  grid = np.asarray(bm.grid)
  np.testing.assert_array_equal(grid, tile_states(
      np.asarray(maskc.materialize("tree(tin, tout)", 640, operands=ops)), 64, 64))
  assert (grid[4:, :4] == 2).all()  # completions over the prompt
  assert (grid[4:6, 6:] == 0).all() and (grid[6:9, 4:6] == 0).all()


def test_explain_says_why_an_unordered_tree_is_generic():
  ops = trees.from_parents(np.array([-1, 0, 0, 2, 1]))  # 3 is 2's child, 4 is 1's
  assert not np.all(np.diff(ops["tin"]) > 0)
  explained = maskc.explain("tree(tin, tout)", 5, block_q=1, block_kv=1, operands=ops)
  assert explained.parts[0].rule == "generic"
  assert "DFS preorder" in explained.parts[0].reason


_TRACED_TREE = {}


@settings(max_examples=15, deadline=None)
@given(forests(n=48), st.sampled_from(["tree(tin, tout)", "causal & ~tree(tin, tout)"]))
def test_trees_under_jit_have_the_static_tiles(parent, text):
  """Under `jit` (fresh traced entry and exit times each call, one compilation) a tree's
  tiles, in DFS order or not, are the static lowering's: the dense mask's, refined."""
  import jax
  if text not in _TRACED_TREE:
    _TRACED_TREE[text] = jax.jit(lambda tin, tout: maskc.compile(
        text, 48, block_q=8, block_kv=8, operands={"tin": tin, "tout": tout}).rows)
  ops = trees.from_parents(parent)
  rows = _TRACED_TREE[text](ops["tin"], ops["tout"])
  traced = grid_from_runs(np, jax.tree.map(np.asarray, rows), 6)
  dense = np.asarray(maskc.materialize(text, 48, operands=ops))
  np.testing.assert_array_equal(np.asarray(traced).reshape(6, 6), tile_states(dense, 8, 8))
