"""Bands of `q - k`: their tiles' bounds per line in closed form, and other runs clipped to them.

`causal` (`0 <= q - k`), `sliding(w)` and `local(l, r)` are exactly a band `lo <=
q - k <= hi` (`maskc.compiled.predicate_compiler.exact_band`). On a tile line with
consecutive positions, `q - k` over a tile takes every value between its
extremes, so the line's tiles are EMPTY, then PARTIAL, FULL, PARTIAL, EMPTY, in
that order, at bounds that follow from the line's positions by integer
division: no analysis, no period to repeat.

In an `&` (`causal & document(seg)`), the other items' runs are then clipped to
each line's bounds instead of being combined with the band's runs: a pass over
the other runs alone. Only tiles PARTIAL in both stay to be decided, as in any
`&` of parts.

The bounds follow from the least and greatest ends of the rows' intervals
(`line_bounds`), for any mask that holds on one interval per row whose union over
a line is one interval too (`Intervals`: a band, or a band inside chunks that
holds the diagonal); `maskc.lowering.closed_forms.widened_band` widens them by equal reads.
The rules that use them: `band`, `met_bounds`, `spread` and `widened_band`
(`maskc/lowering/closed_forms/`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from maskc.analysis.linear import conjuncts, exact_band
from maskc.language import ir
from maskc.lowering.grid.forms import BAND_STATES, Array, FlatRuns, LineBounds
from maskc.lowering.grid.geometry import TileGeometry

# Positions, lengths and offsets beyond this stay off the closed form (sums of three
# of them must stay in int64).
_LIMIT = 1 << 60
FAR = 1 << 61  # beyond any position (`band_fits`): an unbounded end


class Tiles:
  """The tiles of one axis: tile `t` covers positions `[o + t b, o + min((t + 1) b, n) - 1]`
  (`xp`: NumPy, or jax.numpy under `jit`)."""

  def __init__(self, offset: int, block: int, length: int, xp: ModuleType = np):
    self.o, self.b, self.n, self.xp = offset, block, length, xp
    self.count = -(-length // block)

  def starting_by(self, x: Any) -> Any:
    """How many tiles start at or before position `x`."""
    return self.xp.clip((x - self.o) // self.b + 1, 0, self.count)

  def first_starting_from(self, x: Any) -> Any:
    """The first tile that starts at or after position `x` (`count`: none)."""
    return self.xp.clip(-((self.o - x) // self.b), 0, self.count)

  def ending_by(self, x: Any) -> Any:
    """How many tiles end at or before position `x` (they come first: ends increase)."""
    whole = self.xp.clip((x - self.o + 1) // self.b, 0, self.count - 1)
    return self.xp.where(x >= self.o + self.n - 1, self.count, whole)


def span_tiles(geo: TileGeometry, along_rows: bool, xp: ModuleType = np) -> Tiles:
  """The tiles each line spans: key tiles along rows, query tiles along columns."""
  shape = geo.shape
  return (Tiles(0, geo.bk, shape.kv_len, xp) if along_rows else
          Tiles(shape.q_offset, geo.bq, shape.q_len, xp))


def line_bounds(tiles: Tiles, least_lo: Any, most_lo: Any, least_hi: Any,
                most_hi: Any) -> tuple[Any, Any, Any, Any]:
  """Bounds `(s, f, g, e)` of lines whose rows hold on one interval `[L, H]` each, the
  union of which is one interval too, given the least and greatest of their `L` and `H`:
  a tile is non-EMPTY where the union reaches it, FULL where every row covers it."""
  xp = tiles.xp
  s = tiles.ending_by(least_lo - 1)
  e = xp.maximum(tiles.starting_by(most_hi), s)
  f = xp.clip(tiles.first_starting_from(most_lo), s, e)
  g = xp.clip(tiles.ending_by(least_hi), f, e)
  return s, f, g, e


def band_bounds(geo: TileGeometry, lo: int | None, hi: int | None,
                along_rows: bool) -> LineBounds:
  """Per line (a q tile row, or a key tile column), `[4, n_lines]` int64 bounds `s <= f
  <= g <= e` on the other axis' tiles: `[s, f)` and `[g, e)` PARTIAL, `[f, g)` FULL, the
  rest EMPTY, for the band `lo <= q - k <= hi` (None: unbounded). The ends of a band's
  rows grow with the row, so a line's extremes are its first and last row's."""
  t = np.arange(geo.nq if along_rows else geo.nk, dtype=np.int64)
  if lo is not None and hi is not None and lo > hi:  # no `q - k` at all: every line EMPTY
    return np.zeros((4, t.size), np.int64)
  first, last = geo.q_bounds(t, t + 1) if along_rows else geo.k_bounds(t, t + 1)
  band = Intervals(lo, hi)
  (least_lo, least_hi), (most_lo, most_hi) = (band.ends(p, along_rows) for p in (first, last))
  return np.stack(line_bounds(span_tiles(geo, along_rows), least_lo, most_lo, least_hi,
                              most_hi))


class Intervals:
  """A mask true on one interval of each row and of each column, whose ends grow with
  the position and whose consecutive intervals touch: a band `lo <= q - k <= hi`
  (`chunk` None), or such a band inside chunks `q // chunk == k // chunk` where the band
  holds the diagonal."""

  def __init__(self, lo: int | None, hi: int | None, chunk: int | None = None):
    self.lo, self.hi, self.chunk = lo, hi, chunk

  @classmethod
  def of(cls, m: ir.Mask) -> Intervals | None:
    """The intervals of `m`: a band (`exact_band`), or one `chunk(c)` beside band
    comparisons that hold the diagonal (`causal & chunk(8192)`); else None."""
    band = exact_band(m)
    if band is not None:
      return cls(*band)
    items = conjuncts(m)
    chunks = [c for c in map(_chunk, items) if c is not None]
    if len(chunks) != 1:
      return None
    rest = [x for x in items if _chunk(x) is None]
    band = exact_band(ir.and_(rest)) if rest else (None, None)
    if band is None:  # beside the chunk stands something that is no band (`k < 30`)
      return None
    found = cls(*band, chunks[0])
    # a row's interval could miss its diagonal, and end before the next one starts
    return found if found.holds_diagonal else None

  @property
  def holds_diagonal(self) -> bool:
    """Whether each row's interval holds the row's own position (`lo <= 0 <= hi`)."""
    return (self.lo is None or self.lo <= 0) and (self.hi is None or self.hi >= 0)

  def ends(self, p: Any, along_rows: bool, xp: ModuleType = np,
           far: int = FAR) -> tuple[Any, Any]:
    """The first and last position `(L, H)` of the interval of each line at positions `p`
    (query positions along rows, key positions along columns), `-far` / `far` where
    unbounded (`xp`: NumPy, or jax.numpy under `jit`, with a `far` that fits int32)."""
    lo, hi = self.lo, self.hi
    if along_rows:  # row p: columns [p - hi, p - lo]
      lo, hi = (None if hi is None else -hi), (None if lo is None else -lo)
    first = xp.full(p.shape, -far, p.dtype) if lo is None else p + lo
    last = xp.full(p.shape, far, p.dtype) if hi is None else p + hi
    if self.chunk is not None:
      c = self.chunk
      start = p // c * c
      first, last = xp.maximum(first, start), xp.minimum(last, start + c - 1)
    return first, last


def _chunk(m: ir.Mask) -> int | None:
  """`c` where `m` is `q // c == k // c` (`chunk(c)`), c >= 1."""
  if not (isinstance(m, ir.Compare) and m.ops == ("==",)):
    return None
  found: dict[str, int] = {}
  for t in m.terms:
    if not (isinstance(t, ir.Arith) and t.op == "//" and isinstance(t.lhs, ir.Pos) and
            isinstance(t.rhs, ir.Const)):
      return None
    found[t.lhs.axis] = t.rhs.value
  c = found.get("q")
  return c if len(found) == 2 and c is not None and c == found.get("k") and c >= 1 else None


def band_fits(geo: TileGeometry, band: tuple[int | None, ...]) -> bool:
  """Whether the closed form holds for `geo`: consecutive positions (no explicit ones), a
  static offset, and every sum of positions and bounds inside int64."""
  shape = geo.shape
  if geo.positions or not shape.static:
    return False
  return all(abs(int(x)) < _LIMIT for x in (shape.q_offset, shape.q_len, shape.kv_len,
                                            *(b for b in band if b is not None)))


def clipped_pieces(x: FlatRuns, bounds: LineBounds, n_lines: int,
                   n_span: int) -> tuple[Array, Array, Array, Array]:
  """Flat sorted runs `x = (start key, stop key, state)` (`maskc.lowering.grid.forms.keyed`)
  cut at their lines' band bounds (`[4, n_lines]`, the same for every batch row, or `[4, batch
  * n_lines]` by flat line: s, f, g, e), the parts outside the band dropped: `(lo, hi, x's
  state, the band's state)`, in order."""
  key, end, state = x
  stride = n_span + 1
  flat_line = key // stride
  line = flat_line
  if bounds.shape[1] == n_lines and flat_line.size and flat_line[-1] >= n_lines:
    line = flat_line % n_lines
  base = flat_line * stride
  # one bound at a time, by 1-D takes: a row gather of [n, 4] or broadcasts over its
  # columns take several times as long
  s, f, g, e = (np.take(b, line) + base for b in bounds)
  lo = np.stack([np.maximum(key, s), np.maximum(key, f), np.maximum(key, g)], 1).reshape(-1)
  hi = np.stack([np.minimum(end, f), np.minimum(end, g), np.minimum(end, e)], 1).reshape(-1)
  keep = np.flatnonzero(hi > lo)
  return lo[keep], hi[keep], state[keep // 3], BAND_STATES[keep % 3]
