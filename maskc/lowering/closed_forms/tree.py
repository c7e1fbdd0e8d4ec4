"""Rule `tree`: a tree mask in DFS order, `tin[k] <= tin[q] & tin[q] < tout[k]`
(`tree(tin, tout)`), each key's queries one interval, in closed form.

Key `k` is an ancestor of query `q` (or `q` itself) exactly when `q`'s entry time lies in
`k`'s subtree: `tin[k] <= tin[q] < tout[k]`. Where the tokens are laid out in DFS preorder
(`tin` strictly increasing along the positions: the packed prompt-and-completions layout of
RL rollouts, a speculative-decoding tree numbered depth first), the first comparison is `k
<= q` and the second `q < e[k]`, with `e[k]` the first position whose entry time reaches
`tout[k]` (a binary search): every key sees one interval of queries, `[k, e[k])`. A key
tile's column of tiles then follows from those intervals alone: non-EMPTY where one of
them reaches, FULL where all of them cover the tile (their intersection is one interval),
exactly, with no analysis, in time that follows the keys. The rows' runs are those
columns transposed. `k < q`, `tin[q] <= tout[k]` and `q < tout[k]` (entry times that are
the positions) are the same form.

Trees whose tokens are not in DFS order go through the generic analysis: sound, exact
where refined, slower (`docs/lowering.md`, "Trees").
"""

from __future__ import annotations

import dataclasses

import numpy as np

from maskc.analysis.linear import conjuncts
from maskc.compiled.tiles import FULL, PARTIAL, Runs
from maskc.language import ir
from maskc.lowering.generic.dispatch import body_of
from maskc.lowering.generic.range_analysis import Leaves, hold_leaves
from maskc.lowering.grid.forms import Array, Form, LineRuns, pack_runs
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget
from maskc.lowering.grid.run_lists import expand_in_order, merge_runs, transposed_through_grid
from maskc.lowering.rules import Rule, Site
from maskc.lowering.tuning import GRID_CELL_BYTES, GRID_TRANSPOSE_COVER
from maskc.semantics.ranges import Tables

_FLIP = {">": "<", ">=": "<="}


@dataclasses.dataclass(frozen=True)
class TreeForm:
  """`x[k] op_lo x[q] & x[q] op_hi y[k]`: `x` the entry times (None: the positions
  themselves), `y` the exit times, `strict_lo` for `<` below (the query itself left out),
  `strict_hi` for `<` above (`<=`: an inclusive exit time)."""
  x: str | None
  y: str
  strict_lo: bool
  strict_hi: bool


def _links(m: ir.Mask) -> list[tuple[ir.Term, str, ir.Term]] | None:
  """The conjunction `m` as comparisons `a op b` with op `<` or `<=`; None where an item is no
  order comparison."""
  out: list[tuple[ir.Term, str, ir.Term]] = []
  for item in conjuncts(m):
    if not isinstance(item, ir.Compare):
      return None
    for op, a, b in zip(item.ops, item.terms, item.terms[1:]):
      link = (b, _FLIP[op], a) if op in _FLIP else (a, str(op), b)
      if link[1] not in ("<", "<="):
        return None
      out.append(link)
  return out


def _at(t: ir.Term, axis: str) -> tuple[bool, str | None]:
  """`(True, x)` where `t` reads operand `x` at the bare position `axis` (`x[axis]`), `(True,
  None)` where `t` is that position itself; `(False, None)` otherwise."""
  if isinstance(t, ir.Pos):
    return t.axis == axis, None
  if (isinstance(t, ir.Read) and not t.runs and isinstance(t.index, ir.Pos) and
      t.index.axis == axis and isinstance(t.operand, ir.Operand)):
    return True, t.operand.name
  return False, None


def tree_form(m: ir.Mask) -> TreeForm | None:
  """`m` (a body) as a tree in entry and exit times (`TreeForm`), or None."""
  links = _links(m)
  if links is None or len(links) != 2:
    return None
  for (a, op_a, b), (c, op_c, d) in (links, links[::-1]):
    (ok_k, x_k), (ok_q, x_q), (ok_q2, x_q2), (ok_y, y_k) = (
        _at(a, "k"), _at(b, "q"), _at(c, "q"), _at(d, "k"))
    if (ok_k and ok_q and ok_q2 and ok_y and x_k == x_q == x_q2 and y_k is not None and
        y_k != x_k):
      return TreeForm(x_k, y_k, op_a == "<", op_c == "<")
  return None


class TreeRuns:
  """The runs of a tree mask in DFS order (`TreeForm`), from each key's interval of queries:
  rectangles of one key tile column each, as the generic analysis's leaves are."""

  exact = True
  forms: frozenset[Form] = frozenset()  # no form beyond the runs

  def __init__(self, m: ir.Mask, form: TreeForm, geo: TileGeometry, tables: Tables,
               batch: int | None, budget: Budget):
    self.m, self.geo, self.batch, self.budget = m, geo, batch, budget
    shape = geo.shape
    nb = batch or 1
    q_off, q_len, kv_len = int(shape.q_offset), shape.q_len, shape.kv_len
    budget.charge(nb * kv_len * 8 * 6, "the keys' intervals of a tree")
    # key k's queries in rows: [k + s - q_off, e[k] - q_off) within the rows there are, an
    # empty interval kept at its start: lo grows with k
    s = 1 if form.strict_lo else 0
    lo = np.arange(s - q_off, s - q_off + kv_len, dtype=np.int64)[None]
    np.clip(lo, 0, q_len, out=lo)
    exits = _rows(tables, form.y, nb)[:, :kv_len]
    if form.x is None:  # entry times are the positions: q < y[k] (or <=)
      ends = exits + ((0 if form.strict_hi else 1) - q_off)
    else:  # the first position whose entry time reaches y[k]: q < e[k]
      entries = _rows(tables, form.x, nb)
      ends = np.stack([_first_reaching(entries[b], exits[b], form.strict_hi, q_off)
                       for b in range(nb)])
    hi = np.clip(ends, lo, q_len, out=ends)
    lo = np.broadcast_to(lo, hi.shape)
    self.leaves = hold_leaves(_leaves(lo, hi, geo), budget)

  def merged(self, along_rows: bool) -> LineRuns:
    """The runs as sorted, merged `(b, line, a, z, state)` arrays."""
    n_lines = self.geo.nq if along_rows else self.geo.nk
    self.budget.charge(int(sum(x.nbytes for x in self.leaves)) * (2 if along_rows else 1) +
                       int(((self.leaves[2] - self.leaves[1]) if along_rows else
                            (self.leaves[4] - self.leaves[3])).sum()) * 64, "the packed runs")
    b, i0, i1, j, _, state = self.leaves
    columns = merge_runs(b.astype(np.int32), j.astype(np.int32), i0.astype(np.int32),
                         i1.astype(np.int32), state, in_order=True)  # the leaves, in order
    if not along_rows:
      return columns
    nb, nq, nk = self.batch or 1, self.geo.nq, self.geo.nk
    if nb * nq * nk <= GRID_TRANSPOSE_COVER * int((i1 - i0).sum()):
      self.budget.charge(nb * (nq + 1) * nk * GRID_CELL_BYTES, "the tile grid of a tree")
      return transposed_through_grid(columns, nb, nq, nk)
    return merge_runs(*expand_in_order(self.leaves, along_rows, n_lines), in_order=True)

  def runs(self, along_rows: bool) -> Runs:
    return pack_runs(*self.merged(along_rows), self.batch or 1,
                     self.geo.nq if along_rows else self.geo.nk)


def _first_reaching(entries: Array, exits: Array, strict: bool, minus: int) -> Array:
  """For each exit time, the first position whose entry time reaches it (`>=` it where
  `strict`, `>` otherwise), less `minus`, in entry times that grow strictly: a binary
  search, or, where they are consecutive (entry times that count the positions from some
  start, as a DFS numbering that counts entries only gives), a subtraction whose result may
  leave `[-minus, len(entries) - minus]`: the caller clips it to its rows."""
  n = entries.size
  if n and int(entries[-1]) - int(entries[0]) == n - 1:  # strictly growing: consecutive
    return exits + ((0 if strict else 1) - int(entries[0]) - minus)
  return np.searchsorted(entries, exits, "left" if strict else "right") - minus


def _rows(tables: Tables, name: str, nb: int) -> Array:
  """Per-token operand `name`, `[nb, L]` int64."""
  a = np.asarray(tables.arrays[name], np.int64)
  return np.broadcast_to(a, (nb,) + a.shape[1:])


def _leaves(lo: Array, hi: Array, geo: TileGeometry) -> Leaves:
  """Rectangles `(b, i0, i1, j, j + 1, state)` of each key tile column `j` from its keys'
  intervals of rows `[lo, hi)` (`[nb, kv_len]`), sorted by batch row, column and rows:
  the tiles some interval reaches, merged into runs, and among them the FULL ones, where
  every key's interval covers the tile.

  Where query tiles are at least as tall as key tiles are wide (`bq >= bk`), a column's
  reached tiles are one run, `[min t0, max t1)` over its keys whose interval is not empty:
  the keys' first rows `lo` lie within `bk` consecutive rows, so their first tiles `t0` are
  one tile or two adjacent ones, and each interval covers its first tile. Reductions over
  each column's keys then give the runs (`_leaves_by_column`). Otherwise a column's
  intervals may leave tiles between them unreached, and the runs are found key by key
  (`_leaves_by_key`). Both give the same leaves where both apply (tests/test_trees.py).
  """
  if geo.bq >= geo.bk:
    return _leaves_by_column(lo, hi, geo)
  return _leaves_by_key(lo, hi, geo)


def _full_tiles(lo: Array, hi: Array, geo: TileGeometry) -> tuple[Array, Array]:
  """Each column's FULL tiles `[f0, f1)` (`[nb * nk]`): inside `[max lo, min hi)` over all of
  its keys (every key's interval covers them), in whole tiles; `f1 <= f0` where none."""
  bq, q_len, nq = geo.bq, geo.shape.q_len, geo.nq
  n = lo.shape[-1]
  first_key = np.arange(0, n, geo.bk)  # each column's first key
  full_lo = lo[:, np.minimum(first_key + geo.bk, n) - 1].reshape(-1)  # lo grows: its last key's
  full_hi = np.minimum.reduceat(hi, first_key, axis=-1).reshape(-1)
  tile_end = np.minimum((np.arange(nq + 1) + 1) * bq, q_len)  # rows end of each tile (excl.)
  return -(-full_lo // bq), np.searchsorted(tile_end, full_hi, "right")


def _leaves_by_column(lo: Array, hi: Array, geo: TileGeometry) -> Leaves:
  """`_leaves` where `bq >= bk`: each column's reached tiles are one run (see `_leaves`)."""
  nb, n = lo.shape
  bq, nk = geo.bq, geo.nk
  first_key = np.arange(0, n, geo.bk)
  some = hi > lo
  # lo grows along the keys: the first key with rows has the column's smallest lo
  if some.all():  # every key sees a row (as its own query does where it is one)
    a_lo = lo[:, first_key].reshape(-1)
    z_hi = np.maximum.reduceat(hi, first_key, axis=-1).reshape(-1)
  else:
    big = np.iinfo(np.int64).max
    a_lo = np.minimum.reduceat(np.where(some, lo, big), first_key, axis=-1).reshape(-1)
    z_hi = np.maximum.reduceat(np.where(some, hi, -1), first_key, axis=-1).reshape(-1)
  reached = z_hi >= 0
  ra = np.where(reached, a_lo // bq, 0)
  rz = np.where(reached, -(-z_hi // bq), 0)
  f0, f1 = _full_tiles(lo, hi, geo)
  f0 = np.clip(f0, ra, rz)
  f1 = np.clip(np.maximum(f1, f0), f0, rz)
  # each column's three pieces side by side, so the leaves come sorted by column and rows
  i0 = np.stack([ra, f0, f1], axis=-1).reshape(-1)
  i1 = np.stack([f0, f1, rz], axis=-1).reshape(-1)
  st = np.tile(np.array([PARTIAL, FULL, PARTIAL], np.int8), nb * nk)
  col = np.repeat(np.arange(nb * nk, dtype=np.int64), 3)
  keep = i1 > i0
  col = col[keep]
  j = col % nk
  return col // nk, i0[keep], i1[keep], j, j + 1, st[keep]


def _leaves_by_key(lo: Array, hi: Array, geo: TileGeometry) -> Leaves:
  """`_leaves` for any tiles, key by key: the tiles each key's interval reaches, `[t0, t1)`,
  merged into each column's runs."""
  nb, n = lo.shape
  bq, nq, nk = geo.bq, geo.nq, geo.nk
  j = np.arange(n, dtype=np.int64) // geo.bk
  some = hi > lo
  t0 = lo // bq
  t1 = np.where(some, -(-hi // bq), t0)
  # keys come by column, and in each column the intervals start in order (`lo` grows with
  # k), so a running max of their ends finds where a new run starts; columns (of every batch
  # row) are kept apart by an offset
  stride = nq + 2
  col = np.arange(nb, dtype=np.int64)[:, None] * nk + j[None, :]
  col_, a_, z_ = (x.reshape(-1) for x in np.broadcast_arrays(col, t0 + col * stride,
                                                              t1 + col * stride))
  keep = some.reshape(-1)
  col_, a_, z_ = col_[keep], a_[keep], z_[keep]
  if a_.size:
    reach = np.maximum.accumulate(z_)
    new = np.ones(a_.size, bool)
    new[1:] = a_[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:], a_.size) - 1
    ra, rz, rc = a_[first], reach[last], col_[first]
  else:
    ra = rz = rc = np.zeros(0, np.int64)
  ra, rz = ra - rc * stride, rz - rc * stride
  f0, f1 = _full_tiles(lo, hi, geo)
  # each run split at its column's FULL tiles (they lie inside one run: the one that holds
  # them)
  f0 = np.clip(f0[rc], ra, rz)
  f1 = np.clip(np.maximum(f1[rc], f0), f0, rz)
  i0 = np.stack([ra, f0, f1], axis=-1).reshape(-1)
  i1 = np.stack([f0, f1, rz], axis=-1).reshape(-1)
  st = np.tile(np.array([PARTIAL, FULL, PARTIAL], np.int8), rc.size)
  col = np.repeat(rc, 3)
  keep = i1 > i0
  col = col[keep]
  jj = col % nk
  return col // nk, i0[keep], i1[keep], jj, jj + 1, st[keep]


def _dfs_order(tables: Tables, form: TreeForm) -> bool:
  """Whether the entry times grow strictly along the positions in every batch row."""
  if form.x is None:
    return True
  x = np.asarray(tables.arrays[form.x])
  return bool(np.all(x[..., 1:] > x[..., :-1]))


def match(m: ir.Mask, site: Site) -> TreeForm | None:
  """The tree form of `m`'s body (`tree_form`) on consecutive positions with a static offset,
  its entry times in DFS order along the positions."""
  if site.geo.positions or not site.geo.shape.static:
    return None
  form = tree_form(body_of(m))
  if form is None or not _dfs_order(site.tables, form):
    return None
  return form


def lower(m: ir.Mask, form: TreeForm, site: Site) -> TreeRuns:
  return TreeRuns(body_of(m), form, site.geo, site.tables, site.batch, site.budget)


def why_not(m: ir.Mask, site: Site) -> str | None:
  """A tree whose tokens are not in DFS order."""
  form = tree_form(body_of(m))
  if form is not None and TREE.enabled() and not _dfs_order(site.tables, form):
    return (f"a tree whose entry times `{form.x}` do not grow along the positions: lay the "
            f"tokens out in DFS preorder for its closed form")
  return None


TREE = Rule(
    "tree", "a tree in DFS order, `tin[k] <= tin[q] & tin[q] < tout[k]` (`tree(tin, tout)`): "
    "each key's queries one interval (maskc.lowering.closed_forms.tree)", "part", "part",
    exact=True, match=match, lower=lower, why_not=why_not)

