"""Bands of `q - k`: their tiles in closed form, and other runs clipped to them.

`causal` (`0 <= q - k`), `sliding(w)` and `local(l, r)` are exactly a band `lo <=
q - k <= hi` (`maskc._compile_predicate.exact_band`). On a tile line with
consecutive positions, `q - k` over a tile takes every value between its
extremes, so the line's tiles are EMPTY, then PARTIAL, FULL, PARTIAL, EMPTY, in
that order, at bounds that follow from the line's positions by integer
division: no analysis, no period to repeat.

In an `&` (`causal & document(seg)`), the other items' runs are then clipped to
each line's bounds instead of being combined with the band's runs: a pass over
the other runs alone. Only tiles PARTIAL in both stay to be decided, as in any
`&` of parts.
"""

from __future__ import annotations

import numpy as np

from maskc._run_lists import keyed, merge_keyed, merge_runs
from maskc._tile_geometry import TileGeometry
from maskc._tiles import FULL, PARTIAL

# Positions, lengths and offsets beyond this stay off the closed form (sums of three
# of them must stay in int64).
_LIMIT = 1 << 60
_BAND_STATES = np.array([PARTIAL, FULL, PARTIAL], np.int8)  # of [s, f), [f, g), [g, e)
_X_STATES, _Y_STATES = np.repeat(_BAND_STATES, 3), np.tile(_BAND_STATES, 3)  # of 9 pieces


class _Tiles:
  """The tiles of one axis: tile `t` covers positions `[o + t b, o + min((t + 1) b, n) - 1]`."""

  def __init__(self, offset: int, block: int, length: int):
    self.o, self.b, self.n = offset, block, length
    self.count = -(-length // block)

  def starting_by(self, x):
    """How many tiles start at or before position `x`."""
    return np.clip((x - self.o) // self.b + 1, 0, self.count)

  def first_starting_from(self, x):
    """The first tile that starts at or after position `x` (`count`: none)."""
    return np.clip(-((self.o - x) // self.b), 0, self.count)

  def ending_by(self, x):
    """How many tiles end at or before position `x` (they come first: ends increase)."""
    whole = np.clip((x - self.o + 1) // self.b, 0, self.count - 1)
    return np.where(x >= self.o + self.n - 1, self.count, whole)


def band_bounds(geo: TileGeometry, lo: int | None, hi: int | None, along_rows: bool):
  """Per line (a q tile row, or a key tile column), `[4, n_lines]` int64 bounds `s <= f
  <= g <= e` on the other axis' tiles: `[s, f)` and `[g, e)` PARTIAL, `[f, g)` FULL, the
  rest EMPTY, for the band `lo <= q - k <= hi` (None: unbounded)."""
  shape = geo.shape
  other = (_Tiles(0, geo.bk, shape.kv_len) if along_rows else
           _Tiles(shape.q_offset, geo.bq, shape.q_len))  # the tiles each line spans
  t = np.arange(geo.nq if along_rows else geo.nk, dtype=np.int64)
  first, last = geo.q_bounds(t, t + 1) if along_rows else geo.k_bounds(t, t + 1)
  n = other.count
  none, every = np.zeros_like(first), np.full_like(first, n)
  if lo is not None and hi is not None and lo > hi:  # no `q - k` at all: every line EMPTY
    return np.stack([none] * 4)
  if along_rows:  # k tiles [ka, kb] of row [first, last]: q - k spans [first - kb, last - ka]
    s = none if hi is None else other.ending_by(first - hi - 1)  # some <= hi: kb >= first - hi
    e = every if lo is None else other.starting_by(last - lo)  # some >= lo: ka <= last - lo
    f = none if hi is None else other.first_starting_from(last - hi)  # all <= hi: ka >= last - hi
    g = every if lo is None else other.ending_by(first - lo)  # all >= lo: kb <= first - lo
  else:  # q tiles [qa, qb] of column [first, last]: q - k spans [qa - last, qb - first]
    s = none if lo is None else other.ending_by(first + lo - 1)  # qb >= first + lo
    e = every if hi is None else other.starting_by(last + hi)  # qa <= last + hi
    f = none if lo is None else other.first_starting_from(last + lo)  # qa >= last + lo
    g = every if hi is None else other.ending_by(first + hi)  # qb <= first + hi
  e = np.maximum(e, s)
  f = np.clip(f, s, e)
  g = np.clip(g, f, e)
  return np.stack([s, f, g, e])


def band_fits(geo: TileGeometry, band) -> bool:
  """Whether the closed form holds for `geo`: consecutive positions (no explicit ones), a
  static offset, and every sum of positions and bounds inside int64."""
  shape = geo.shape
  if geo.positions or not shape.static:
    return False
  return all(abs(int(x)) < _LIMIT for x in (shape.q_offset, shape.q_len, shape.kv_len,
                                            *(b for b in band if b is not None)))


class BandRuns:
  """The runs of a band `lo <= q - k <= hi` on `geo` (`band_fits`), for `nb` batch rows:
  one of the static lowering's ways (`maskc._lower_static`)."""

  def __init__(self, geo: TileGeometry, band: tuple[int | None, int | None], nb: int):
    self.geo, self.band, self.nb = geo, band, nb
    self._bounds = {}

  def bounds(self, along_rows: bool) -> np.ndarray:
    """`band_bounds` along rows or columns, computed once."""
    if along_rows not in self._bounds:
      self._bounds[along_rows] = band_bounds(self.geo, *self.band, along_rows)
    return self._bounds[along_rows]

  def merged(self, along_rows: bool):
    """The runs as sorted, merged `(b, line, a, z, state)` arrays (where the band is all an
    `&` has: no other runs to clip)."""
    line, a, z, state = line_runs(self.bounds(along_rows))
    b = np.repeat(np.arange(self.nb, dtype=np.int64), line.size)
    # an empty FULL run leaves two PARTIAL ones side by side: merged into one
    return merge_runs(b, *(np.tile(x, self.nb) for x in (line, a, z, state)), in_order=True)


def line_runs(bounds: np.ndarray):
  """The runs of lines with band bounds `bounds` (`[4, n]`: s, f, g, e), empty ones
  dropped: `(the line's index in bounds, a, z, state)`, in order."""
  s, f, g, e = bounds
  a = np.stack([s, f, g], axis=1).reshape(-1)
  z = np.stack([f, g, e], axis=1).reshape(-1)
  keep = np.flatnonzero(z > a)
  return keep // 3, a[keep], z[keep], _BAND_STATES[keep % 3]


def keyed_band_runs(bounds: np.ndarray, lines: np.ndarray, n_lines: int, n_span: int):
  """The band's runs on sorted distinct flat lines `lines` (`b * n_lines + line`), given
  its bounds `bounds` (`band_bounds`), as flat runs (`maskc._run_lists.keyed`)."""
  at, a, z, state = line_runs(bounds[:, lines % n_lines])
  # flat lines as lines of batch row 0: the same keys
  return merge_keyed(*keyed((0, lines[at], a, z, state), n_lines, n_span))


def clipped_pieces(x, bounds: np.ndarray, n_lines: int, n_span: int):
  """Flat sorted runs `x = (start key, stop key, state)` (`maskc._run_lists.keyed`) cut at
  their lines' band bounds (`[4, n_lines]`, the same for every batch row, or `[4, batch *
  n_lines]` by flat line: s, f, g, e), the parts outside the band dropped: `(lo, hi, x's
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
  return lo[keep], hi[keep], state[keep // 3], _BAND_STATES[keep % 3]



def met_bounds_pieces(x_bounds: np.ndarray, first: int, bounds: np.ndarray, n_lines: int,
                      n_span: int):
  """The pieces of flat lines `first, first + 1, ...` whose tiles are both band-shaped
  bounds, `x_bounds` (`[4, n]`, of those lines: equal reads of runs,
  `maskc._equal_reads.equal_read_bounds`) and `bounds` (`[4, n_lines]` for every batch
  row, or by flat line): each of x's three runs cut at the other's, as `clipped_pieces`
  gives them, with no runs written first: `(lo, hi, x's state, the other's state)`, flat
  keys in order, the parts outside either dropped."""
  n = x_bounds.shape[1]
  flat = np.arange(first, first + n, dtype=np.int64)
  line = flat % n_lines if bounds.shape[1] == n_lines else flat
  base = flat * (n_span + 1)
  x, y = x_bounds + base, np.take(bounds, line, axis=1) + base
  # [x's run, the other's run, line], then each line's nine pieces in order: broadcasts
  # over the long axis, not over the short ones (four times as fast)
  lo = np.maximum(x[:3, None, :], y[None, :3, :]).reshape(9, n).T.reshape(-1)
  hi = np.minimum(x[1:, None, :], y[None, 1:, :]).reshape(9, n).T.reshape(-1)
  keep = np.flatnonzero(hi > lo)
  # states by tiling, not by `keep % 9` (int64 division is slow)
  return (lo[keep], hi[keep], np.tile(_X_STATES, n)[keep], np.tile(_Y_STATES, n)[keep])
