"""Per-token operands in run-length form, and the pieces they cut lines of tiles into.

Segment ids, image flags, global-token flags and run ids are a few runs of equal
values over a long sequence. `RunTable` keeps one operand (all batch rows) as
the start of each run and its value, plus sparse min/max tables over the runs,
so a range query costs a binary search and two lookups, and the memory follows
the number of runs, not the number of tokens.

`line_pieces` cuts each line of tiles (a q tile row, or a k tile column) at the
positions where an operand read at that axis changes value. Within a piece
every such read is constant, which makes the range analysis exact for it: a
constant read is a single, attained value. The lowering analyses pieces instead
of whole tiles where it wants exact answers (see `maskc.lowering.compile`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Iterable

import numpy as np

from maskc.language import ir

PIECES_PER_LINE = 16  # a line with more operand changes than this is not cut


def floor_log2(xp, n):
  """`floor(log2(n))` for counts `n >= 1`, exactly: `frexp` returns a float's binary
  exponent without rounding, and counts are exact floats (below 2**53 in NumPy's float64,
  2**24 in the float32 of the jax.numpy path's range tables, whose counts are far smaller).

  int64 in NumPy, `n`'s dtype in jax.numpy.
  """
  if xp is np:
    return np.frexp(np.asarray(n, np.float64))[1].astype(np.int64) - 1
  return xp.frexp(n.astype(xp.float32))[1].astype(n.dtype) - 1


def run_starts(a: np.ndarray) -> np.ndarray:
  """Sorted flat indices (`row * L + i`) where a run of equal values of `a` (`[B, L]`) starts."""
  rows, length = a.shape
  if not a.size:  # no tokens: no runs (a read of it is refused when bound)
    return np.zeros(0, np.int64)
  flat = a.reshape(-1)
  flags = flat[1:] != flat[:-1]
  if flags.size and flags[0] and flags[-1] and np.count_nonzero(flags) == flags.size:
    # every token its own run (entry times, positions)
    return np.arange(flat.size, dtype=np.int64)
  changed = _set_flags(flags) + 1  # across row ends too: a superset
  row_starts = np.arange(rows, dtype=np.int64) * length
  return np.union1d(changed, row_starts) if rows > 1 else np.concatenate([[0], changed])


def _set_flags(flags: np.ndarray) -> np.ndarray:
  """`np.flatnonzero(flags)` (1-D bool), faster where few are set: the 8-byte words that
  hold any are found first, then the flags within them (an operand's changes among a
  million tokens: 40 against 100 microseconds for a few hundred)."""
  n = flags.size
  whole = n - n % 8
  words = np.flatnonzero(flags[:whole].view(np.uint64) != 0)
  if words.size * 256 > n:  # many: one pass is as fast
    return np.flatnonzero(flags)
  row, col = np.nonzero(flags[:whole].reshape(-1, 8)[words])
  return np.concatenate([words[row] * 8 + col, whole + np.flatnonzero(flags[whole:])])


@dataclasses.dataclass(frozen=True)
class RunForm:
  """A per-token operand `[B, L]` as runs: where each starts and its value.

  `starts` are sorted flat indices `b * L + i` and include every row's first
  token; `values` (int64) hold each run's value. Runs need not be maximal (two
  neighbours may hold the same value): every user only relies on the value being
  constant within a run. The form determines the operand, so its digest can
  stand for the operand's bytes in cache keys, and min, max and run ids come
  from it without another pass over the tokens.
  """
  starts: np.ndarray
  values: np.ndarray
  batch: int
  length: int

  @classmethod
  def of(cls, a: np.ndarray) -> RunForm:
    """The maximal runs of `a` (`[B, L]`, any integer or bool dtype)."""
    a = np.asarray(a)
    starts = run_starts(a).astype(np.int64)
    flat = a.reshape(-1)
    values = flat.astype(np.int64) if starts.size == flat.size else flat[starts].astype(np.int64)
    return cls(starts, values, *a.shape)

  @property
  def lengths(self) -> np.ndarray:
    return np.diff(np.append(self.starts, self.batch * self.length))

  def digest(self) -> bytes:
    """SHA-256 of the form (equal starts and values: equal operands of this shape)."""
    h = hashlib.sha256(usedforsecurity=False)
    h.update(np.ascontiguousarray(self.starts).data)
    h.update(np.ascontiguousarray(self.values).data)
    return h.digest()

  def broadcast(self, batch: int) -> RunForm:
    """A one-row form repeated over `batch` rows."""
    if batch == self.batch:
      return self
    assert self.batch == 1, (self.batch, batch)
    offsets = np.arange(batch, dtype=np.int64)[:, None] * self.length
    return RunForm((self.starts[None, :] + offsets).reshape(-1), np.tile(self.values, batch),
                   batch, self.length)

  def _first_of_row(self) -> np.ndarray:
    """Whether each run is its row's first."""
    row = self.starts // max(self.length, 1)
    first = np.ones(row.size, bool)
    first[1:] = row[1:] != row[:-1]
    return first

  def run_ids(self) -> RunForm:
    """`runs(x)` on the same runs: 1-based index of each run of nonzero values in its row."""
    on = self.values != 0
    first_of_row = self._first_of_row()
    prev_on = np.zeros(on.size, bool)
    prev_on[1:] = on[:-1]
    opens = on & (first_of_row | ~prev_on)           # a run of nonzero values starts here
    count = np.cumsum(opens)
    base = np.maximum.accumulate(np.where(first_of_row, count - opens, 0))
    return RunForm(self.starts, np.where(on, count - base, 0), self.batch, self.length)

  def truth_run_ids(self) -> RunForm:
    """On the same runs: an id for each maximal run of zero or of nonzero values, increasing
    along the rows (counted over all of them, so distinct between rows too)."""
    on = self.values != 0
    new = self._first_of_row()
    new[1:] |= on[1:] != on[:-1]
    return RunForm(self.starts, np.cumsum(new) - 1, self.batch, self.length)

  def values_in(self, rows: np.ndarray | None, lo: int, hi: int) -> np.ndarray:
    """The values of the runs holding tokens `[lo, hi)` of batch rows `rows` (None: all)."""
    if rows is None and lo <= 0 and hi >= self.length:  # every run
      return self.values
    rows = np.arange(self.batch) if rows is None else np.asarray(rows, np.int64)
    if hi <= lo or not rows.size:
      return self.values[:0]
    first = np.searchsorted(self.starts, rows * self.length + lo, "right") - 1
    stop = np.searchsorted(self.starts, rows * self.length + hi - 1, "right")
    held = np.zeros(self.values.size + 1, np.int64)
    np.add.at(held, first, 1)
    np.add.at(held, stop, -1)
    return self.values[np.cumsum(held[:-1]) > 0]

  def to_array(self, dtype) -> np.ndarray:
    """The operand `[B, L]` written out."""
    return np.repeat(self.values.astype(dtype), self.lengths).reshape(self.batch, self.length)


INDEX_AFTER = 2  # a token index is built after searches cost `tokens / INDEX_AFTER` probes
SEARCH_IN_CACHE = 1 << 12  # run starts a binary search finds fast (32 KiB: a core's L1 cache)


def may_index(runs: int) -> bool:
  """Whether a search among `runs` run starts may build an index of each token's run."""
  return SEARCH_IN_CACHE < runs < 1 << 31


class _RunSearch:
  """Which run holds a token, for tables whose runs start at the same tokens.

  Once the run starts outgrow the L1 cache (many short documents), a binary
  search over them costs 10-20 times a gather from a per-token index of runs (4
  bytes a token), and analysing a long sequence looks up hundreds of thousands
  of tokens. So for more than `SEARCH_IN_CACHE` runs, once searches have made
  `tokens / INDEX_AFTER` probes (lookups times log2 of the runs: writing the
  index costs about that much), the index is built where it fits `index_bytes`
  (the lowering's memory budget; else searches go on). Fewer runs are searched:
  there the index would save little and add 4 bytes a token to the peak.
  Also memoizes run spans (`RunTable._runs_spanned`).
  """

  def __init__(self, starts: np.ndarray, tokens: int, index_bytes: int):
    self.starts, self.tokens = starts, tokens
    self.may_index = may_index(starts.size) and tokens * 4 <= index_bytes
    self.probes = 0
    self.index: np.ndarray | None = None
    self.spans: dict = {}  # memo of run spans by the identity of the queried index arrays

  def run_index(self, flat: np.ndarray, count: bool = True) -> np.ndarray:
    """Index of the run holding each flat token `b * L + i` (in range).

    `count=False`: a few lookups that do not count toward building the index.
    """
    if self.index is None and self.may_index and count:
      self.probes += flat.size * self.starts.size.bit_length()
      if self.probes * INDEX_AFTER > self.tokens:
        lengths = np.diff(np.append(self.starts, self.tokens))
        self.index = np.repeat(np.arange(self.starts.size, dtype=np.int32), lengths)
    if self.index is not None:
      return self.index[flat]
    return np.searchsorted(self.starts, flat, side="right") - 1


class RunTable:
  """One per-token operand `[B, L]` as runs: `starts` (global `b * L + i`, sorted) and values.

  Args:
    form: the operand's runs (`RunForm.of(a)` for an array `a`).
    others: tables built before, to share the run search with one that has the same starts.
    index_bytes: at most how many bytes an index of each token's run may take.
  """

  def __init__(self, form: RunForm, others: Iterable[RunTable] = (), index_bytes: int = 0):
    length = form.length
    self.length, self.batch = length, form.batch
    starts = form.starts
    self._search = _RunSearch(starts, form.batch * length, index_bytes)
    for other in others:  # `x` and `runs(x)` change at the same tokens: share the run search
      if other.starts is starts or (other.starts.shape == starts.shape and
                                    other.length == length and
                                    np.array_equal(other.starts, starts)):
        starts, self._search = other.starts, other._search
        break
    self.starts: np.ndarray = starts
    values = form.values
    self.values = values
    self.row = starts // max(length, 1)
    levels = max(1, int(values.size).bit_length())
    info = np.iinfo(np.int32)
    narrow = values.size and info.min <= values.min() and values.max() <= info.max
    dtype = np.int32 if narrow else np.int64  # half the memory when the values fit
    mins = np.empty((levels, values.size), dtype)
    maxs = np.empty_like(mins)
    mins[0] = maxs[0] = values
    big, small = np.iinfo(dtype).max, np.iinfo(dtype).min
    for j in range(1, levels):
      span = 1 << (j - 1)
      n = values.size - span
      mins[j, :n] = np.minimum(mins[j - 1, :n], mins[j - 1, span:])
      maxs[j, :n] = np.maximum(maxs[j - 1, :n], maxs[j - 1, span:])
      mins[j, n:] = big
      maxs[j, n:] = small
    self.mins, self.maxs = mins, maxs

  @staticmethod
  def bytes_for(form: RunForm) -> int:
    """At most how many bytes the table of `form` takes: its min and max tables with 8-byte
    values, and starts, values and rows."""
    runs = form.values.size
    return runs * 8 * (2 * max(1, runs.bit_length()) + 3)

  def clip(self, i):
    return np.minimum(np.maximum(np.asarray(i, np.int64), 0), self.length - 1)

  def run_index(self, b, i) -> np.ndarray:
    """Index of the run holding token `i` (clipped to the length) of batch row `b`."""
    return self._run_of(b, self.clip(i))

  def values_at(self, b, i) -> np.ndarray:
    """The operand at tokens `i` (clipped to the length) of batch rows `b`, for a few
    reads (sampled pairs): they use the index where one exists, else binary searches,
    and never make one be built."""
    flat = np.asarray(b, np.int64) * self.length + self.clip(i)
    return self.values[self._search.run_index(flat, count=False)]

  def _run_of(self, b, i) -> np.ndarray:
    """`run_index` for tokens `i` already inside the length."""
    if np.isscalar(b) and b == 0:
      return self._search.run_index(i)
    return self._search.run_index(np.asarray(b, np.int64) * self.length + i)

  def _runs_spanned(self, b, lo, hi):
    """(first run, last run, sparse-table level, second start) of tokens `[lo, hi]` of row `b`.

    Remembered for the last few queries by the identity of their arrays (kept alive
    with the entry, so an identity is never reused): the analysis reads `x[q]` and
    `runs(x)[q]` over the same position arrays, and tables with the same runs share it.
    """
    spans = self._search.spans
    key = (id(b), id(lo), id(hi))
    hit = spans.get(key)
    if hit is not None and hit[0][0] is b and hit[0][1] is lo and hit[0][2] is hi:
      return hit[1]
    l, h = self.clip(lo), self.clip(hi)
    h = np.maximum(h, l)
    rl, rh = self._run_of(b, l), self._run_of(b, h)
    j = floor_log2(np, rh - rl + 1)
    out = rl, j, rh - (np.int64(1) << j) + 1
    if len(spans) >= 2:  # the q and k ranges of a round (each holds a chunk of arrays)
      spans.clear()
    spans[key] = ((b, lo, hi), out)
    return out

  def range_min_max(self, b, lo, hi) -> tuple[np.ndarray, np.ndarray]:
    """Min and max over tokens `[lo, hi]` of row `b` (clipped to the length), as int64."""
    rl, j, second = self._runs_spanned(b, lo, hi)
    at = j * self.values.size  # one flat gather is faster than a 2-D one
    first, second = at + rl, at + second
    mins, maxs = self.mins.reshape(-1), self.maxs.reshape(-1)
    vmin = np.minimum(mins[first], mins[second]).astype(np.int64)
    vmax = np.maximum(maxs[first], maxs[second]).astype(np.int64)
    return vmin, vmax

  def monotone(self) -> np.ndarray:
    """Per batch row: whether the operand is nondecreasing (`[B]` bool)."""
    down = np.zeros(self.batch, bool)
    same_row = self.row[1:] == self.row[:-1]
    falls = same_row & (self.values[1:] < self.values[:-1])
    down[self.row[1:][falls]] = True
    return ~down


@dataclasses.dataclass
class Pieces:
  """Lines of tiles cut at operand changes: piece `p` of line `f` spans `[lo[p], hi[p]]`.

  Pieces are sorted by line; line `f` (flat `b * n_lines + line`) owns pieces
  `first[f] .. first[f] + count[f] - 1`. Bounds are positions on the line's axis.
  """
  lo: np.ndarray
  hi: np.ndarray
  first: np.ndarray
  count: np.ndarray

  @property
  def cut(self) -> bool:
    """Whether any line is cut into more than one piece."""
    return bool((self.count > 1).any())

  def expand(self, flat_line: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For items on lines `flat_line`: (item of each piece, piece lo, piece hi)."""
    counts = self.count[flat_line]
    item = np.repeat(np.arange(flat_line.size), counts)
    offset = np.arange(item.size) - np.repeat(np.cumsum(counts) - counts, counts)
    p = self.first[flat_line][item] + offset
    return item, self.lo[p], self.hi[p]


def reads_at(m: ir.Mask, axis: str) -> list[tuple[str, int]]:
  """Per-token reads of `m` indexed by `axis` plus a constant: `(table name, shift)` pairs."""
  return list(_reads_at(m, axis))


@functools.lru_cache(maxsize=256)
def _reads_at(m: ir.Mask, axis: str) -> tuple[tuple[str, int], ...]:
  """`reads_at`, once per mask (masks are immutable and hash by structure): a lowering
  asks for each part's and each axis's reads several times."""
  out = set()
  for n in ir.walk(m):
    if not isinstance(n, ir.Read):
      continue
    name = ir.array_key(n)
    shift = unit_shift(n.index, axis)
    if shift is not None:
      out.add((name, shift))
  return tuple(sorted(out))


def unit_shift(t: ir.Term, axis: str) -> int | None:
  """`s` where `t` is `axis + s` (or `axis`, `axis - s`, `s + axis`); else None."""
  read = unit_read(t)
  return read[1] if read is not None and read[0] == axis else None


def unit_read(t: ir.Term) -> tuple[str, int] | None:
  """`(axis, c)` for an index `q`, `q + c`, `q - c` or `c + q` (`k` alike), else None."""
  if isinstance(t, ir.Pos):
    return t.axis, 0
  if isinstance(t, ir.Arith) and t.op in "+-":
    if isinstance(t.lhs, ir.Pos) and isinstance(t.rhs, ir.Const):
      return t.lhs.axis, (t.rhs.value if t.op == "+" else -t.rhs.value)
    if t.op == "+" and isinstance(t.lhs, ir.Const) and isinstance(t.rhs, ir.Pos):
      return t.rhs.axis, t.lhs.value
  return None


def line_pieces(tables: dict[str, RunTable], reads: list[tuple[str, int]], nb: int,
                lo: np.ndarray, hi: np.ndarray, limit: int = PIECES_PER_LINE,
                rows: np.ndarray | None = None) -> Pieces:
  """Cuts lines (positions `[lo, hi]` per line, the same for every batch row) at operand changes.

  Args:
    tables: run tables by operand table name.
    reads: `(table name, shift)`: a read at position `p` reads index `p + shift`.
    nb: batch rows; lines are flat `b * len(lo) + line`.
    lo, hi: each line's inclusive position bounds.
    limit: lines that would have more pieces than this stay whole.
    rows: the batch row of each line when `lo` and `hi` list lines of any batch rows
      (then lines are numbered as listed, not repeated for each batch row).
  """
  if rows is None:
    n_lines = lo.size
    b = np.repeat(np.arange(nb, dtype=np.int64), n_lines)
    lo_all, hi_all = np.tile(lo, nb), np.tile(hi, nb)
  else:
    b, lo_all, hi_all = np.asarray(rows, np.int64), lo, hi
  line_of, cut_at, total = [], [], np.zeros(b.size, np.int64)
  spans, seen = [], set()
  for name, shift in reads:
    t = tables[name]
    if (id(t._search), shift) in seen:  # `x` and `runs(x)` change at the same tokens
      continue
    seen.add((id(t._search), shift))
    tb = b if t.batch > 1 else np.zeros_like(b)
    # changes at token c (a[c] != a[c - 1]) with lo + shift < c <= hi + shift
    i_lo = np.clip(lo_all + shift, 0, t.length - 1)
    i_hi = np.clip(hi_all + shift, 0, t.length - 1)
    rl, rh = t.run_index(tb, i_lo), t.run_index(tb, i_hi)
    total += np.maximum(rh - rl, 0)
    spans.append((t, tb, shift, rl, rh))
  keep = total <= limit - 1
  for t, tb, shift, rl, rh in spans:
    n = np.where(keep, np.maximum(rh - rl, 0), 0)
    f = np.repeat(np.arange(n.size), n)
    r = np.repeat(rl + 1 - (np.cumsum(n) - n), n) + np.arange(f.size)
    line_of.append(f)
    cut_at.append(t.starts[r] - tb[f] * t.length - shift)
  f = np.concatenate(line_of) if line_of else np.zeros(0, np.int64)
  c = np.concatenate(cut_at) if cut_at else np.zeros(0, np.int64)
  if f.size:
    order = np.lexsort((c, f))
    f, c = f[order], c[order]
    fresh = np.ones(f.size, bool)
    fresh[1:] = (f[1:] != f[:-1]) | (c[1:] != c[:-1])
    fresh &= (c > lo_all[f]) & (c <= hi_all[f])
    f, c = f[fresh], c[fresh]
  count = np.bincount(f, minlength=b.size).astype(np.int64) + 1
  first = np.cumsum(count) - count
  # piece starts: the line's lo, then its cuts; piece ends: the next start - 1, or the line's hi
  starts = np.empty(int(count.sum()), np.int64)
  starts[first] = lo_all
  slot = np.arange(f.size) - np.repeat(np.cumsum(count - 1) - (count - 1), count - 1)
  starts[first[f] + 1 + slot] = c
  ends = np.empty_like(starts)
  ends[:-1] = starts[1:] - 1
  ends[first + count - 1] = hi_all
  return Pieces(starts, ends, first, count)
