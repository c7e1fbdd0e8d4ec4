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
from maskc.lowering.grid.run_lists import expand_in_order, merge_runs
from maskc.lowering.rules import Rule, Site
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
    keys = np.arange(shape.kv_len, dtype=np.int64)
    q_off = int(shape.q_offset)
    budget.charge(nb * shape.kv_len * 8 * 12, "the keys' intervals of a tree")
    exits = _rows(tables, form.y, nb)[:, :shape.kv_len]
    if form.x is None:  # entry times are the positions: q < y[k] (or <=)
      end = exits + (0 if form.strict_hi else 1)
    else:  # the first position whose entry time reaches y[k]: q < e[k]
      entries = _rows(tables, form.x, nb)
      end = np.stack([np.searchsorted(entries[b], exits[b],
                                      "left" if form.strict_hi else "right")
                      for b in range(nb)])
    start = keys[None, :] + (1 if form.strict_lo else 0)
    # in rows: [start - q_off, end - q_off) clipped to the rows there are
    lo = np.clip(start - q_off, 0, shape.q_len)
    hi = np.clip(end - q_off, 0, shape.q_len)
    lo, hi = np.broadcast_arrays(lo, np.maximum(hi, lo))
    self.leaves = hold_leaves(_leaves(lo, hi, geo), budget)

  def merged(self, along_rows: bool) -> LineRuns:
    """The runs as sorted, merged `(b, line, a, z, state)` arrays."""
    n_lines = self.geo.nq if along_rows else self.geo.nk
    self.budget.charge(int(sum(x.nbytes for x in self.leaves)) * (2 if along_rows else 1) +
                       int(((self.leaves[2] - self.leaves[1]) if along_rows else
                            (self.leaves[4] - self.leaves[3])).sum()) * 64, "the packed runs")
    return merge_runs(*expand_in_order(self.leaves, along_rows, n_lines), in_order=True)

  def runs(self, along_rows: bool) -> Runs:
    return pack_runs(*self.merged(along_rows), self.batch or 1,
                     self.geo.nq if along_rows else self.geo.nk)


def _rows(tables: Tables, name: str, nb: int) -> Array:
  """Per-token operand `name`, `[nb, L]` int64."""
  a = np.asarray(tables.arrays[name], np.int64)
  return np.broadcast_to(a, (nb,) + a.shape[1:])


def _leaves(lo: Array, hi: Array, geo: TileGeometry) -> Leaves:
  """Rectangles `(b, i0, i1, j, j + 1, state)` of each key tile column `j` from its keys'
  intervals of rows `[lo, hi)` (`[nb, kv_len]`): the tiles some interval reaches, merged
  into runs, and among them the FULL ones, where every key's interval covers the tile."""
  nb, n = lo.shape
  bq, bk, q_len = geo.bq, geo.bk, geo.shape.q_len
  nq, nk = geo.nq, geo.nk
  j = np.arange(n, dtype=np.int64) // bk
  # the tiles each key's interval reaches: [t0, t1)
  some = hi > lo
  t0 = lo // bq
  t1 = np.where(some, -(-hi // bq), t0)
  # each column's reached tiles merged into runs: keys come by column, and in each column
  # the intervals start in order (`lo` grows with k), so a running max of their ends finds
  # where a new run starts; columns of batch rows are kept apart by an offset
  stride = nq + 2
  col = (np.arange(nb, dtype=np.int64)[:, None] * nk + j[None, :])
  b_, col_, a_, z_ = (x.reshape(-1) for x in np.broadcast_arrays(
      np.arange(nb)[:, None], col, t0 + col * stride, t1 + col * stride))
  keep = some.reshape(-1)
  col_, a_, z_, b_ = col_[keep], a_[keep], z_[keep], b_[keep]
  if a_.size:
    reach = np.maximum.accumulate(z_)
    new = np.ones(a_.size, bool)
    new[1:] = a_[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:], a_.size) - 1
    ra, rz, rc, rb = a_[first], reach[last], col_[first], b_[first]
  else:
    ra = rz = rc = rb = np.zeros(0, np.int64)
  base = rc * stride
  ra, rz = ra - base, rz - base
  # the FULL tiles of each column: inside [max lo, min hi) of all its keys (every key
  # reaches them), in whole tiles
  first_key = np.arange(0, n, bk)  # each column's first key: keys come by column
  full_lo = np.maximum.reduceat(lo, first_key, axis=-1).reshape(-1)
  full_hi = np.minimum.reduceat(hi, first_key, axis=-1).reshape(-1)
  f0 = -(-full_lo // bq)                              # the first tile starting at or after
  tile_end = np.minimum((np.arange(nq + 1) + 1) * bq, q_len)  # rows end of each tile (excl.)
  f1 = np.searchsorted(tile_end, full_hi, "right")   # tiles ending at or before full_hi
  f0, f1 = f0[rc], np.maximum(f1[rc], f0[rc])
  # each run split at its FULL tiles (the intersection lies inside one run: the one that
  # holds it)
  f0, f1 = np.clip(f0, ra, rz), np.clip(f1, ra, rz)
  f1 = np.maximum(f1, f0)
  parts = [(ra, f0, PARTIAL), (f0, f1, FULL), (f1, rz, PARTIAL)]
  jj = rc % nk
  b, i0, i1, j0, j1, st = (np.concatenate(x) for x in zip(*(
      (rb, a, z, jj, jj + 1, np.full(a.size, s, np.int8)) for a, z, s in parts)))
  keep = i1 > i0
  out = tuple(x[keep].astype(np.int64) if x.dtype != np.int8 else x[keep]
              for x in (b, i0, i1, j0, j1, st))
  return out[0], out[1], out[2], out[3], out[4], out[5]


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

