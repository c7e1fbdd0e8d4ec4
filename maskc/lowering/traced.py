"""The dynamic lowering path: traced operands or offset, under `jit`.

The same range analysis as the static path, over the whole tile grid in
jax.numpy, with shapes from the lengths and tile sizes only. A per-token read
along an axis (`x[q + c]`, `x[k + c]`) is read once per tile line (its min, max
and changes over the line's tokens); other reads go through blocked range tables
(`maskc.semantics.ranges.BlockedRange`). No table has log2(L) levels of the operand.

In an `&` / `|` with operand-free items (`causal & document(seg)`,
`causal & chunk(8192) | bidirectional(img)`) and a static shape, those items are
lowered at trace time by the static path to a constant tile grid, and only the
others are analysed under `jit` (rule `parts`, its traced lower): the analysis over every tile,
the costliest kernel of a traced lowering, has less to do. The static grid's
PARTIAL tiles are exact, so they need no refinement where the other items leave
them so (as causal's diagonal tiles inside a document).

`intervals | bidirectional(x)` (`causal & chunk(8192) | bidirectional(img)`) takes none
of this: its runs follow from a few reductions per tile line, exactly
(`maskc.lowering.closed_forms.widened_band`), in 23 kernels where the analysis took 58.

`bidirectional(x)`'s body, `runs(x)[q] == runs(x)[k] & x[q]`, is decided exactly
from the run labels the tile lines read (`maskc.lowering.closed_forms.same_run_ids`), seeded
into the analysis: its tiles across a span's edge are never ambiguous.

Ambiguous PARTIAL tiles (the analysis cannot prove them mixed) are listed once,
in order, by one sort (top_k where one round holds them), and decided `chunk` at
a time in a `while_loop`, so the cost follows their number, never the grid's, per
round:

1. by *pieces*, as the static path does: each tile line is cut where a read along
   it changes (up to `MAX_CUTS` cuts, none if it changes more often) and into
   `SUB_PARTS` equal parts (the static path's 4 x 4 sub-rectangles); on a cut line
   every read is one value per piece, which makes the analysis exact on prelude
   masks. A round of `PIECE_ROUND` tiles cuts its tiles' lines only, so a few
   ambiguous tiles never pay for cutting every line of the grid. Masks without
   such reads use 4 x 4 and 16 x 16 sub-rectangles instead;
2. what is left by evaluating the mask on the tile, in an inner loop of
   `EVAL_CHUNK` elements a round, at most `refine_budget` tiles in all; any beyond
   stay PARTIAL (sound).

Both steps are `maskc.lowering.grid.refine`'s, shared with the static path (`xp=jnp`).

XLA compiles every fused kernel separately, and on a CPU that is most of a traced
lowering's cost (each kernel goes through its own MLIR and LLVM pipelines), so the
code keeps the kernel count down:
- sorts instead of prefix sums (associative scans of log2(N) levels), unstable
  ones where keys are distinct but for a fill value (`_sort`: half the time);
  where few keys of a line are not the fill, `lax.top_k` of those few, with the
  sort kept for inputs that have more (`_sort_few`: faster per call, for a little
  more compile); a grid's few ambiguous tiles by
  top_k over groups of tiles, then over the first groups' tiles (`_listed`);
- counts and places of flags from flags packed into 32-bit words
  (`maskc.arrays.bit_words`): the run labels' prefix count, and a tile line's runs
  where it has few (`_bit_runs`: faster than top_k per call, for a little more
  compile);
- a reduction over more than 32 elements is one variadic reduce with its siblings
  (`maskc.semantics.ranges.reduce_many`) or an argmin/argmax, never a plain one, which
  XLA's CPU compiler splits into three kernels (a tree reduction);
- when q and key tiles coincide, one set of lines serves both axes;
- arrays built in one expression rather than concatenated after the fact;
- one gather per round of a tile's packed pieces, and none of an operand's tokens
  along the lines where the offset is static (a slice, `_line_tokens`);
- constants of a loop's body (slot numbers, their parts) made in NumPy at trace time:
  built by jnp, XLA hoists them out of the loop as kernels of their own (3 of image
  spans' 61).
`benchmarks/traced_lowering.py` prints the kernel count with the compile time.
"""

from __future__ import annotations

import copy
from collections import ChainMap
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from maskc.arrays.bit_words import WORD, bit_words, prefix_sums
from maskc.compiled.tiles import Runs
from maskc.language import ir
from maskc.lowering.closed_forms.same_run_ids import (
  SameRun,
  label_key,
  labels,
  run_ids,
  same_run_truth,
)
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget, decide_parts, evaluate_tiles, subdivide
from maskc.lowering.registry import RULESET
from maskc.lowering.rules import Rule
from maskc.lowering.static import compile_static
from maskc.lowering.tuning import (
  BIT_LINES,
  EVAL_CHUNK,
  FEW_RUNS,
  ITEM_BYTES,
  LIST_GROUP,
  MANY_RUNS,
  MAX_CUTS,
  MEMORY_BUDGET,
  PIECE_CHUNK,
  PIECE_ROUND,
  SUB_PARTS,
  TILE_BYTES,
  WIDENED_TILE_BYTES,
)
from maskc.semantics.operand_runs import reads_at, unit_read
from maskc.semantics.ranges import EMPTY, FULL, PARTIAL, Analyzer, Tables, Truth3, reduce_many
from maskc.semantics.shape import Shape

PIECES = MAX_CUTS + SUB_PARTS  # pieces a line is cut into (some may be empty)


def _sort(keys: Any) -> Any:
  """`keys` sorted along the last axis, where keys are distinct but for a fill value.

  Equal keys are then interchangeable, so the sort need not be stable: XLA's CPU
  sort takes about half the time of a stable one (`jnp.sort`'s).
  """
  return jax.lax.sort(keys, dimension=keys.ndim - 1, is_stable=False)


def _sort_few(keys: Any, fill: int, few: int) -> Any:
  """`_sort(keys)`, from the `few` smallest keys of each line where no line has more.

  Where every line holds at most `few` keys below `fill` (the common case: a tile
  line has a few runs, a grid a few dozen ambiguous tiles), `lax.top_k` finds them
  in about a quarter of a sort's time on a CPU; otherwise the whole sort runs
  (`lax.cond`: one branch executes). top_k is fast for float32 only (other types
  become a stable sort), exact while keys stay below 2**24.
  """
  width = keys.shape[-1]
  if width <= few + 1 or fill >= 1 << 24:
    return _sort(keys)
  neg, _ = jax.lax.top_k(-keys.astype(jnp.float32), few + 1)
  # Integers again at once: an argmax over the floats takes far longer (NaN rules).
  smallest = (-neg).astype(jnp.int32)  # ascending; slot `few` is `fill` on lines that fit
  last = smallest[..., few].reshape(-1)
  # every line fits: no slot `few` below the fill (argmin: one kernel, not a tree reduction)
  fits = last[jnp.argmin(last)] >= fill

  def padded() -> Any:
    rest = jnp.full(keys.shape[:-1] + (width - few,), fill, keys.dtype)
    return jnp.concatenate([smallest[..., :few].astype(keys.dtype), rest], axis=-1)

  return jax.lax.cond(fits, padded, lambda: _sort(keys))


def _listed(flags: Any, size: int, few: int) -> Any:
  """The places of `flags` (`[N]`) that are set, ascending, then `N` up to `size` entries:
  `_sort_few` of the keys `where(flags, place, N)`.

  Where at most `few` are set (a grid's ambiguous tiles: a few dozen of hundreds of
  thousands), in two small steps instead of top_k over them all: top_k over the
  groups of `LIST_GROUP` flags that hold any, then over the flags of the first `few`
  such groups: faster, for one kernel more (`docs/lowering.md`, "Measurements behind the design").
  Otherwise all of them sorted (`lax.cond`: one branch executes).
  """
  n = flags.shape[0]
  rows = -(-n // LIST_GROUP)

  def keys() -> Any:
    return jnp.where(jnp.pad(flags, (0, size - n)), jnp.arange(size, dtype=jnp.int32), n)

  if rows <= few + 1 or size >= 1 << 24:  # few groups, or past float32's exact integers
    return _sort_few(keys(), n, few)
  grouped = jnp.pad(flags, (0, rows * LIST_GROUP - n)).reshape(rows, LIST_GROUP)
  group_keys = jnp.where(grouped.any(axis=1), jnp.arange(rows, dtype=jnp.float32), rows)
  neg, _ = jax.lax.top_k(-group_keys, few + 1)
  first = (-neg).astype(jnp.int32)  # ascending; slot `few` is `rows` where they all fit
  held = grouped[jnp.minimum(first[:few], rows - 1)] & (first[:few] < rows)[:, None]
  at = first[:few, None] * LIST_GROUP + jnp.arange(LIST_GROUP, dtype=jnp.int32)
  neg, _ = jax.lax.top_k(-jnp.where(held, at, n).reshape(-1).astype(jnp.float32), few + 1)
  smallest = (-neg).astype(jnp.int32)
  fits = (first[few] >= rows) & (smallest[few] >= n)

  def padded() -> Any:
    return jnp.concatenate([smallest[:few], jnp.full((size - few,), n, jnp.int32)])

  return jax.lax.cond(fits, padded, lambda: _sort(keys()))


def _refine(flat: Any, ambiguous: Any, decide: Any, evaluate: Any, chunk: int, eval_chunk: int,
            budget: Any) -> Any:
  """Decides the ambiguous tiles: `decide` on `chunk` at a time, then `evaluate` what it leaves.

  The ambiguous tiles are listed once, in order, by one sort, or by top_k where
  one chunk holds them all (`_sort_few`; XLA compiles a sort far faster than a
  prefix sum, an associative scan of log2(N) levels, and compile time is much of
  a traced lowering's cost). A `while_loop` takes them
  `chunk` at a time; within each chunk, the tiles `decide` leaves ambiguous are
  listed by a small sort and evaluated `eval_chunk` at a time in an inner loop,
  as long as fewer than `budget` tiles were evaluated. No round looks at the
  whole grid.

  Args:
    flat: the flat tile states, `[N]`.
    ambiguous: `[N]` bool.
    decide: flat tile indices `[chunk]` (clipped to real tiles) -> (states, still
      ambiguous), or None to evaluate every ambiguous tile.
    evaluate: flat tile indices `[eval_chunk]` -> exact states.
    budget: at most how many tiles to evaluate (None: all).
  """
  n = flat.shape[0]
  padded = -(-n // chunk) * chunk
  # listed at the padded size, with no concatenation after: one kernel fewer to compile
  todo = _listed(ambiguous, padded + 1, chunk)
  local_size = -(-chunk // eval_chunk) * eval_chunk + 1
  positions = np.arange(local_size, dtype=np.int32)  # a constant: jnp's is a loop operand

  def body(carry: Any) -> Any:
    r, flat, used = carry
    idx = jax.lax.dynamic_slice(todo, (r * chunk,), (chunk,))
    if decide is None:
      unresolved = idx < n
    else:
      new, unresolved = decide(jnp.minimum(idx, n - 1))
      # Entries past the list carry the out-of-bounds index N and are dropped: writing
      # them to a real tile would put its old value back over the real update.
      flat = flat.at[idx].set(new.astype(flat.dtype), mode="drop")
      unresolved = unresolved & (idx < n)
    local = _sort(jnp.where(jnp.pad(unresolved, (0, local_size - chunk)), positions, chunk))

    def more(c: Any) -> Any:
      going = local[c[0] * eval_chunk] < chunk
      return going if budget is None else going & (c[2] < budget)

    def step(c: Any) -> Any:
      s, flat, used = c
      at = jax.lax.dynamic_slice(local, (s * eval_chunk,), (eval_chunk,))
      valid = at < chunk
      if budget is not None:
        valid = valid & (used + jnp.arange(eval_chunk) < budget)
      tiles = jnp.where(valid, idx[jnp.minimum(at, chunk - 1)], n)
      flat = flat.at[tiles].set(evaluate(jnp.minimum(tiles, n - 1)).astype(flat.dtype),
                                mode="drop")
      if budget is not None:  # no count (one kernel fewer) when nothing limits it
        used = used + valid.sum(dtype=jnp.int32)
      return s + 1, flat, used

    _, flat, used = jax.lax.while_loop(more, step, (jnp.int32(0), flat, used))
    return r + 1, flat, used

  def going(carry: Any) -> Any:
    return todo[carry[0] * chunk] < n

  _, flat, _ = jax.lax.while_loop(going, body, (jnp.int32(0), flat, jnp.int32(0)))
  return flat


class _Lines:
  """The tile lines of one axis, their pieces, and the values read along them.

  Attributes:
    tile: `{(table, axis, c): (min, max)}`, `[nb, n_lines]`: each read over each line.
    piece: per read, where its min and max per piece are among the fields `pieces`
      gives: on a cut line each read is one value per piece; an uncut line's pieces
      are its equal parts, with the read's range over each.

  A line is cut where an operand read along the axis (`x[q + c]`) changes, unless it
  changes more than `MAX_CUTS` times: then only into its `SUB_PARTS` equal parts.
  """

  def __init__(self, m: ir.Mask, geo: TileGeometry, tables: Tables, axis: str, nb: int,
               reads: list[tuple[str, int]] | None = None) -> None:
    n_lines, block, length = (geo.nq, geo.bq, geo.shape.q_len) if axis == "q" else (
        geo.nk, geo.bk, geo.shape.kv_len)
    t = jnp.arange(n_lines)
    lo = t * block
    hi = jnp.minimum((t + 1) * block, length) - 1
    if axis == "q":
      lo, hi = lo + geo.shape.q_offset, hi + geo.shape.q_offset
    lo = jnp.broadcast_to(lo, (nb, n_lines))
    hi = jnp.broadcast_to(hi, (nb, n_lines))
    # Shifts beyond any length read clipped ends only; they would leave int32 here.
    reads = [(n, c) for n, c in (reads_at(m, axis) if reads is None else reads)
             if abs(c) < 1 << 30]
    self.tile = {}
    self.axis, self.n_lines = axis, n_lines
    self._count = jnp.zeros((nb, n_lines), jnp.int32)  # changes per line: none without reads
    self._block, self._length = block, length
    self._offset = geo.shape.q_offset if axis == "q" else 0
    # Each read over each line's positions p = lo + t (t < block), its index clipped to
    # the operand as range queries clip it; a change at p: the value differs from p - 1's.
    p = lo[..., None] + jnp.arange(block, dtype=jnp.int32)
    inside = p <= hi[..., None]
    change = jnp.zeros(p.shape[:-1] + (block - 1,), bool)
    self._reads = []
    terms = []
    for name, shift in reads:
      a = tables.arrays[name]
      v = _line_tokens(a, p, shift, self._offset)
      info = np.iinfo(a.dtype)
      terms += [(jnp.where(inside, v, info.max), "min"), (jnp.where(inside, v, info.min), "max")]
      change = change | (inside[..., 1:] & (v[..., 1:] != v[..., :-1]))
      self._reads.append((name, shift, v, info))
    # where each read's min and max per piece are in `pieces`' fields (after starts, ends)
    self.piece = {(name, axis, shift): 2 + 2 * r for r, (name, shift, _, _)
                  in enumerate(self._reads)}
    if reads:  # every read's min and max and the changes per line: one reduction
      first = jnp.zeros(p.shape[:-1] + (1,), jnp.int32)
      changes = jnp.concatenate([first, change.astype(jnp.int32)], axis=-1)
      out = reduce_many(jnp, terms + [(changes, "sum")], -1)
      for r, (name, shift, _, _) in enumerate(self._reads):
        self.tile[(name, axis, shift)] = (out[2 * r], out[2 * r + 1])
      self._count = out[-1]

  def pieces(self, sel: Any) -> Any:
    """The pieces of lines `sel` (flat `b * n_lines + line`), `[len(sel), F, PIECES]`: the
    fields `piece` names, the pieces' `starts` and `ends` first (inclusive positions;
    `ends < starts`: no piece). For refinement only, a round's lines at a time: no pass
    over every line when few tiles are ambiguous.

    Cuts are the first `MAX_CUTS` positions where a read changes (none if it changes
    more often) and the `SUB_PARTS` equal parts of the line, as the static path's
    4 x 4 sub-rectangles: one analysis then does the work of both.
    """
    # the lines' positions from their index, their reads' values by one gather each
    line = jax.lax.rem(sel, jnp.int32(self.n_lines))
    lo = line * self._block + self._offset
    hi = jnp.minimum((line + 1) * self._block, self._length) - 1 + self._offset
    p = lo[:, None] + jnp.arange(self._block, dtype=jnp.int32)
    inside = p <= hi[:, None]
    values = [v.reshape(-1, self._block)[sel] for _, _, v, _ in self._reads]
    change = jnp.zeros(p.shape[:-1] + (self._block - 1,), bool)
    for v in values:
      change = change | (inside[..., 1:] & (v[..., 1:] != v[..., :-1]))
    cut = self._count.reshape(-1)[sel] <= MAX_CUTS
    # Candidates, in one array (one kernel, no concatenation): slot t < w (w = block - 1)
    # the change at lo + 1 + t, then the SUB_PARTS - 1 inner part bounds, then MAX_CUTS
    # unused slots (past the line's end; short lines have fewer changes to fill them).
    # The slots' constants in NumPy: under jnp, XLA hoists them out of the refinement's
    # loop as kernels of their own.
    w = change.shape[-1]
    t = np.arange(w + SUB_PARTS - 1 + MAX_CUTS, dtype=np.int32)
    change = jnp.pad(change & cut[..., None], [(0, 0), (0, t.size - w)])
    length = (hi - lo + 1)[..., None]
    part = lo[..., None] + (np.clip(t - w + 1, 0, SUB_PARTS) * length) // SUB_PARTS
    is_part = (t >= w) & (t < w + SUB_PARTS - 1)
    c = jnp.where(change, lo[..., None] + 1 + t, jnp.where(is_part, part, hi[..., None] + 1))
    # one sort: the cuts and parts, then the unused slots (values alone: unstable is the same)
    c = _sort(c)[..., :MAX_CUTS + SUB_PARTS - 1]
    # Pieces start at the line's lo, then at each cut, and end before the next start
    # (a repeated cut or an unused slot makes an empty piece).
    starts = jnp.concatenate([lo[..., None], c], axis=-1)
    ends = jnp.concatenate([c - 1, hi[..., None]], axis=-1)
    fields = [starts, ends]
    # Each read's exact min and max per piece. On a cut line a read is constant between
    # cuts: its value at the piece's start. An uncut line's pieces are its parts (the
    # operand cuts are all past its end): the read's min and max over each part.
    first = jnp.clip(starts - lo[..., None], 0, p.shape[-1] - 1)
    in_part = ((p[..., None, :] >= starts[..., :SUB_PARTS, None]) &
               (p[..., None, :] <= ends[..., :SUB_PARTS, None]) & inside[..., None, :])
    rest = starts.shape[-1] - SUB_PARTS
    part_range = reduce_many(jnp, [  # one reduction
        (jnp.where(in_part, v[..., None, :], extreme), op)
        for v, (_, _, _, info) in zip(values, self._reads)
        for extreme, op in ((info.max, "min"), (info.min, "max"))], -1) if values else []
    for r, v in enumerate(values):
      point = jnp.take_along_axis(v, first, axis=-1)
      lo_v, hi_v = part_range[2 * r], part_range[2 * r + 1]
      lo_v = jnp.concatenate([lo_v, point[..., SUB_PARTS:]], axis=-1) if rest else lo_v
      hi_v = jnp.concatenate([hi_v, point[..., SUB_PARTS:]], axis=-1) if rest else hi_v
      fields += [jnp.where(cut[..., None], point, lo_v), jnp.where(cut[..., None], point, hi_v)]
    return jnp.stack(fields, axis=1)

  @property
  def any_reads(self) -> bool:
    return bool(self.tile)

  def as_axis(self, axis: str) -> _Lines:
    """These lines as the other axis' lines (same tiles, same reads): keys relabelled only."""
    other = copy.copy(self)
    other.axis = axis
    other.tile = {(n, axis, c): v for (n, _, c), v in self.tile.items()}
    other.piece = {(n, axis, c): f for (n, _, c), f in self.piece.items()}
    return other


def _line_tokens(a: Any, p: Any, shift: int, offset: Any) -> Any:
  """Operand `a` (`[B', size]`) read at every line's positions `p + shift` (`[nb, lines,
  block]`), clipped to the operand as range queries clip it.

  Where the offset is static, the positions are one contiguous range: a slice of the
  operand (padded with its end values where it reaches past them), reshaped to the
  lines, which XLA folds into what reads it, where a gather is a kernel of its own
  (three of a traced `bidirectional(img)`'s 63, for its three reads).
  """
  size = a.shape[-1]
  total = p.shape[-2] * p.shape[-1]
  if isinstance(offset, (int, np.integer)):
    start = int(offset) + shift
    lo, hi = max(start, 0), min(start + total, size)
    if lo < hi:
      v = jnp.pad(a[:, lo:hi], [(0, 0), (lo - start, start + total - hi)], mode="edge")
      return jnp.broadcast_to(v.reshape(a.shape[0], *p.shape[-2:]), p.shape)
  rows = jnp.arange(a.shape[0])[:, None, None] if a.shape[0] > 1 else 0
  return a[rows, jnp.clip(p + shift, 0, size - 1)]


def _shared_reads(geo: TileGeometry, q_reads: Any, k_reads: Any) -> list[tuple[str, int]] | None:
  """The reads of one set of lines serving both axes, or None where each axis needs its own.

  When q and key tiles cover the same positions (same tiles and lengths, offset 0)
  and both axes read operands, one set of lines with the union of their reads
  serves both: half the kernels to compile. A line is then also cut where the
  other axis' reads change (in the masks of interest, `x[q] == x[k]`, the same
  places), which keeps every piece sound; lines with more than `MAX_CUTS` changes
  are not cut and their tiles go on to evaluation, as on either axis alone.
  """
  off = geo.shape.q_offset
  if not (isinstance(off, (int, np.integer)) and off == 0 and geo.bq == geo.bk and
          geo.shape.q_len == geo.shape.kv_len):
    return None
  if not (q_reads and k_reads):
    return None
  return sorted(set(q_reads) | set(k_reads))


def _decide_by_pieces(m: ir.Mask, geo: TileGeometry, tables: Tables, lines: Any, batch: Any, b: Any,
                      i: Any, j: Any) -> Any:
  """States of tiles `(b, i, j)` from their pieces, and whether each stays ambiguous.

  Each tile's q and k pieces are gathered from the lines' packed arrays (one gather
  per axis) and decided by `maskc.lowering.grid.refine.decide_parts`, with every read along
  an axis known per piece. Pieces are exact on prelude masks, where every read is
  constant over them.
  """
  q, k = lines
  if q._reads is k._reads:  # lines shared by both axes: their pieces in one pass
    n = i.shape[0]
    both = q.pieces(jnp.concatenate([b * q.n_lines + i, b * k.n_lines + j]))
    qp, kp = both[:n][:, :, :, None], both[n:][:, :, None, :]
  else:
    qp = q.pieces(b * q.n_lines + i)[:, :, :, None]  # [n, F, pieces, 1]
    kp = k.pieces(b * k.n_lines + j)[:, :, None, :]  # [n, F, 1, pieces]
  known = {key: (qp[:, f], qp[:, f + 1]) for key, f in q.piece.items()}
  known.update({key: (kp[:, f], kp[:, f + 1]) for key, f in k.piece.items()})
  return decide_parts(m, geo, tables, jnp, b[:, None, None] if batch else 0, qp[:, 0], qp[:, 1],
                      kp[:, 0], kp[:, 1], spans={"q": geo.bq, "k": geo.bk}, known=known)


def _prepare_tables(m: ir.Mask, tables: Tables, spans: bool, pos_ok: Any) -> None:
  """Builds the tables the analysis of `m` reads, before any loop (whose traces stay inside).

  With `spans`, reads at `q + c` and `k + c` need no range table; any other
  per-token read a `BlockedRange`, and pairwise reads their prefix sums. Only
  what the analysis asks for: every table is a kernel to compile.
  """
  for n in ir.walk(m):
    if isinstance(n, ir.Read):
      name = ir.array_key(n)
      bare = isinstance(n.index, ir.Pos) and (pos_ok is True or n.index.axis == "k")
      if not bare:  # an index that may leave the type reads the whole operand's range
        tables.whole(name)
      if not (spans and unit_read(n.index) is not None):
        tables.blocked(name)
    elif isinstance(n, ir.PairRead) and tables.pair_blocks(n) is None:  # not aligned
      tables.prefix(n.operand.name)
    elif isinstance(n, ir.Compare):  # `x[i] == x[j]` may use x's monotonicity
      for op, a, b in zip(n.ops, n.terms, n.terms[1:]):
        if (op in ("==", "!=") and isinstance(a, ir.Read) and isinstance(b, ir.Read) and
            not a.runs and ir.array_key(a) == ir.array_key(b)):
          tables.monotone(ir.array_key(a))


def _combine(fixed: Any, state: Any, certain: Any, union: bool) -> Any:
  """A tile's state and certainty from its operand-free part's and its other part's.

  `fixed` is exact (refined: PARTIAL tiles are mixed); `state`, `certain` are the
  other part's analysis (FULL and EMPTY exact, PARTIAL mixed where `certain`).
  With EMPTY < PARTIAL < FULL, `|` takes the larger state and `&` the smaller,
  exactly, except where both are PARTIAL: the tile may then be FULL under `|`
  (EMPTY under `&`), and stays ambiguous for the whole mask's refinement. A tile
  is certainly PARTIAL where one part is and the other is EMPTY under `|` (FULL
  under `&`).
  """
  neutral = EMPTY if union else FULL
  certain = ((certain & (state == PARTIAL) & (fixed == neutral)) |
             ((fixed == PARTIAL) & (state == neutral)))
  return jnp.maximum(fixed, state) if union else jnp.minimum(fixed, state), certain


def _dynamic_grid(m: ir.Mask, geo: TileGeometry, tables: Tables, batch: int | None, refine: bool,
                  budget: int | None, memory: Budget, same: Sequence[SameRun] = ()) -> Any:
  """The tile grid `[nb, nq, nk]` of one mask; `same`: its places decided from run labels."""
  nb = batch or 1
  memory.charge(nb * geo.nq * geo.nk * TILE_BYTES, "the traced analysis of the tile grid")
  i = jnp.arange(geo.nq)[None, :, None]
  j = jnp.arange(geo.nk)[None, None, :]
  q_lo = i * geo.bq + geo.shape.q_offset
  q_hi = jnp.minimum((i + 1) * geo.bq, geo.shape.q_len) - 1 + geo.shape.q_offset
  k_lo = j * geo.bk
  k_hi = jnp.minimum((j + 1) * geo.bk, geo.shape.kv_len) - 1
  dense = True
  if geo.qa is not None:  # explicit positions: per-tile hulls, `[B', nq, 1]`
    q_lo, q_hi = geo.qa.tmin[:, :, None], geo.qa.tmax[:, :, None]
    dense = geo.qa.dense_tiles[:, :, None]
  if geo.ka is not None:
    k_lo, k_hi = geo.ka.tmin[:, None, :], geo.ka.tmax[:, None, :]
    dense = dense & geo.ka.dense_tiles[:, None, :]
  spans = not geo.positions  # tile extents bound reads along an axis (not position hulls)
  _prepare_tables(m, tables, spans, geo.pos_ok)
  lines, known, shared = None, {}, None
  if spans:  # every read along an axis read once per line, for the grid and the pieces
    # the run labels of `same` are read along each axis besides the mask's own reads
    q_reads = reads_at(m, "q") + [(p.key, p.s) for p in same]
    k_reads = reads_at(m, "k") + [(p.key, p.t) for p in same]
    shared = _shared_reads(geo, q_reads, k_reads)
    if shared is None:
      lines = (_Lines(m, geo, tables, "q", nb, q_reads), _Lines(m, geo, tables, "k", nb, k_reads))
    else:
      one = _Lines(m, geo, tables, "q", nb, shared)
      lines = (one, one.as_axis("k"))
    known = {key: (lo[:, :, None], hi[:, :, None]) for key, (lo, hi) in lines[0].tile.items()}
    known.update({key: (lo[:, None, :], hi[:, None, :])
                  for key, (lo, hi) in lines[1].tile.items()})
  b = jnp.arange(nb)[:, None, None] if batch else 0
  splitting = _traced_rule("part")
  split = None if splitting is None else splitting.run_traced(m, geo, refine, memory,
                                                          compile_static)
  analyzer = Analyzer(jnp, tables, q_lo, q_hi, k_lo, k_hi, b, geo.pos_ok,
                      spans={"q": geo.bq, "k": geo.bk} if spans else None, known=known)
  # exact verdicts from the labels the lines read (`maskc.lowering.closed_forms.same_run_ids`)
  for p in same:
    on_q, on_k = (p.key, "q", p.s), (p.key, "k", p.t)
    if geo.pos_ok is True and on_q in known and on_k in known:
      analyzer.memo[p.node] = same_run_truth(jnp, *known[on_q], *known[on_k])
  # aligned pairwise reads as masks: each tile reads one block, its verdict exact from the
  # block's counts (no gathers from prefix tables, nothing left ambiguous)
  for n in ir.walk(m):
    if isinstance(n, ir.Truth) and isinstance(n.read, ir.PairRead):
      blocks = tables.pair_blocks(n.read)
      if blocks is not None and not geo.positions and blocks.per_tile(geo.nq, geo.nk):
        analyzer.memo[n] = Truth3(blocks.tile_states(), True)
  t = analyzer.truth(m if split is None else split[0])
  full_shape = (nb, geo.nq, geo.nk)
  state = jnp.broadcast_to(jnp.asarray(t.state, jnp.int8), full_shape)
  certain = jnp.broadcast_to(jnp.asarray(t.certain, bool) & dense, full_shape)
  if split is not None:  # the operand-free items' exact grid, combined with the others'
    state, certain = _combine(split[1], state, certain, split[2])
  if not refine:
    return state
  ambiguous = ((state == PARTIAL) & ~certain).reshape(-1)
  tiles = geo.nq * geo.nk

  def coords(idx: Any) -> Any:
    rest = jax.lax.rem(idx, jnp.int32(tiles))
    tb = jax.lax.div(idx, jnp.int32(tiles))
    return (tb if batch else 0), jax.lax.div(rest, jnp.int32(geo.nk)), jax.lax.rem(
        rest, jnp.int32(geo.nk))

  items = max(1, min(PIECE_CHUNK, memory.items(ITEM_BYTES)))
  if lines is not None and (lines[0].any_reads or lines[1].any_reads):
    # pieces: exact on prelude masks, one analysis per pair of pieces (the parts of the
    # static path's 4 x 4 sub-rectangles included)
    per_tile = PIECES * PIECES
    round_tiles = PIECE_ROUND  # each round cuts its tiles' lines: few tiles, few lines

    def decide(idx: Any) -> Any:
      tb, ti, tj = coords(idx)
      return _decide_by_pieces(m, geo, tables, lines, batch,
                               tb if batch else jnp.zeros_like(ti), ti, tj)
  else:
    # sub-rectangles, 4 x 4 then 16 x 16
    per_tile = 256
    round_tiles = None

    def decide(idx: Any) -> Any:
      tb, ti, tj = coords(idx)
      out, amb = subdivide(m, geo, tables, jnp, tb, ti, tj, 4, spans=spans)
      if max(geo.bq, geo.bk) >= 16:
        out16, amb16 = subdivide(m, geo, tables, jnp, tb, ti, tj, 16, spans=spans)
        out = jnp.where(amb, out16, out)
        amb = amb & amb16
      return out, amb

  def evaluate(idx: Any) -> Any:
    tb, ti, tj = coords(idx)
    return evaluate_tiles(m, geo, tables, jnp, tb, ti, tj)

  chunk = max(1, min(items // per_tile, round_tiles or items))
  flat = _refine(state.reshape(-1), ambiguous, decide, evaluate, chunk,
                 max(1, EVAL_CHUNK // (geo.bq * geo.bk)),
                 None if budget is None else max(0, int(budget)))
  return flat.reshape(full_shape)


def _traced_rule(step: str) -> Rule | None:
  """The first enabled rule at `step` (`maskc.lowering.rules.STEPS`) with a traced lower."""
  return next((r for r in RULESET.at(step) if r.traced is not None and r.enabled()), None)


def compile_dynamic(masks: Sequence[ir.Mask], shape: Shape, operands: Mapping[str, Any],
                    batch: int | None, block_q: int, block_kv: int, refine: list[bool],
                    budget: int | None, memory: Budget | None = None) -> tuple[Runs, Runs]:
  """Per-q-tile and per-key-tile runs `[B, U, n, R]` of the masks, traced."""
  geo = TileGeometry(shape, block_q, block_kv, xp=jnp)
  memory = memory or Budget(MEMORY_BUDGET)
  # bidirectional's body, decided from run labels (an analysis rule at step "tables")
  labelling = _traced_rule("tables")
  expanded: list[tuple[ir.Mask, list[SameRun]]] = [
      (m, []) if labelling is None else labelling.run_traced(m) for m in masks]
  # whole masks in closed form (a combine rule at step "join": the widened band)
  joining = _traced_rule("join")
  found = [None if joining is None else joining.run_traced(m, geo, same) for m, same in expanded]
  widened = [w for w in found if w is not None]
  if joining is not None and len(widened) == len(found):  # `causal | bidirectional(img)`
    joining.took()
    nb = batch or 1
    memory.charge(nb * len(masks) * geo.nq * geo.nk * WIDENED_TILE_BYTES + sum(
        operands[w.operand].size * 32 for w in widened), "the widened band's runs")
    rows, cols = (_stacked([w.runs(operands[w.operand], geo, nb, along_rows) for w in widened])
                  for along_rows in (True, False))
    return rows, cols
  labelled = {p.operand for _, found in expanded for p in found}
  if labelling is not None and labelled:
    labelling.took()
  arrays: Mapping[str, Any] = operands
  if labelled:  # the labels, and run ids from them: one prefix sum (kernels) for both
    derived = {}
    for n in labelled:
      ids = ir.run_ids_key(n)
      derived[label_key(n)] = lab = labels(jnp, operands[n], operands[ids].dtype)
      derived[ids] = run_ids(jnp, lab)
    # ChainMap writes to its first map only: the operands are read, never written
    arrays = ChainMap(derived, cast(MutableMapping[str, Any], operands))
  tables = Tables(jnp, arrays)
  # configured by the analysis rules at step "tables" (aligned pairwise reads)
  used = [(r, r.run(tables, [m for m, _ in expanded], geo)) for r in RULESET.at("tables")
          if r.enabled()]
  for name, a in arrays.items():
    if a.ndim == 2:  # per-token: its lines' tokens, parts and pieces, or blocked range tables
      memory.charge(a.size * a.dtype.itemsize * 12, f"the tables of `{name}`")
  grid = jnp.stack([_dynamic_grid(m, geo, tables, batch, ref, budget, memory, same)
                    for (m, same), ref in zip(expanded, refine)], axis=1)
  for rule, was_used in used:
    if was_used():
      rule.took()
  return _runs(grid), _runs(jnp.swapaxes(grid, -1, -2))


def _stacked(runs: list[Runs]) -> Runs:
  """Runs of each mask (`[B', n_lines, R]`) as one `Runs` `[B', U, n_lines, R]`."""
  return Runs(*(jnp.stack(x, axis=1) for x in zip(*runs)))


def _runs(grid: Any) -> Runs:
  """Maximal runs of equal non-empty states along the last axis of `grid` (`[..., n]`).

  The runs of `maskc.compiled.tiles.runs_from_grid` (`R = n` slots). Where every line has
  at most `FEW_RUNS` runs (the usual case: a diagonal tile, a document's block, an
  image's span a line), they are read from bit words (`_bit_runs`), faster than
  top_k over the tiles; where some line has more but none more than `MANY_RUNS` (block
  selection: a query block's top-k, a key block many query blocks chose), from the same
  words with room for that many; otherwise from a sort (`lax.cond`: one branch executes).
  The words cost a fixed compile time whatever the width, so lines shorter than
  `BIT_LINES` (where top_k is cheap) or longer keep `_sorted_runs` (top_k where the
  runs are few). (The figures: `docs/lowering.md`, "Measurements behind the design".)
  """
  n = grid.shape[-1]
  if not BIT_LINES[0] <= n <= BIT_LINES[1]:
    return _sorted_runs(grid)
  most, runs = _bit_runs(grid.astype(jnp.int8))

  def more() -> Runs:
    if MANY_RUNS >= n:
      return _sorted_runs(grid, listed=_sort)
    found: Runs = jax.lax.cond(most <= MANY_RUNS, lambda: runs(MANY_RUNS),
                               lambda: _sorted_runs(grid, listed=_sort))
    return found

  found: Runs = jax.lax.cond(most <= FEW_RUNS, lambda: runs(FEW_RUNS), more)
  return found


def _bit_runs(g: Any) -> Any:
  """The most runs a line of `g` (`[..., n]`, `n` at most 1024) has, and a function giving
  its runs where no line has more than `few` of them (`few < n`), from the flags of the
  tiles where runs start and end packed into 32-bit words.

  A line's `i`-th run starts at its `i`-th start flag and ends after its `i`-th end
  flag. Flag `i` lies in the word whose set bits before it number at most `i` and
  with it more, at the place a binary search by population counts finds; the run
  is FULL where the FULL tiles' word has that bit. Elementwise work on a few values
  per line: no sort and no prefix sum over the line (costly kernels on a CPU).
  """
  n = g.shape[-1]
  assert n <= 32 * WORD, n
  lead = g.shape[:-1]
  words = bit_words(jnp.stack(_run_edges(g) + (g == FULL,), -2))  # [..., 3, words]
  count = jax.lax.population_count(words[..., :2, :]).astype(jnp.int32)
  before = prefix_sums(count) - count  # the set bits in the words before each word
  # runs a line (from `before`: the inclusive sums' own last slot costs a kernel more)
  total = before[..., 0, -1] + count[..., 0, -1]
  flat = total.reshape(-1)
  most = flat[jnp.argmax(flat)]  # argmax: one kernel

  def runs(few: int) -> Any:
    assert few < n, (few, n)
    # flag i in word w: its rank r there, with 0 <= r < count in exactly one word
    r = jnp.arange(few, dtype=jnp.int32)[:, None] - before[..., None, :]
    here = (r >= 0) & (r < count[..., None, :])  # [..., 2, few, words]
    x = jnp.broadcast_to(words[..., :2, None, :], r.shape)
    place = jnp.zeros_like(r)
    for width in (16, 8, 4, 2, 1):
      low = jax.lax.population_count(x & jnp.uint32((1 << width) - 1)).astype(jnp.int32)
      up = r >= low
      r, x, place = (jnp.where(up, r - low, r), jnp.where(up, x >> width, x),
                     place + jnp.where(up, width, 0))
    full = ((words[..., 2:, None, :] >> place.astype(jnp.uint32)) & 1).astype(jnp.int32)
    # one sum: 2 (place + 1) + (whether FULL) where the flag is, else 0
    w = jnp.arange(words.shape[-1], dtype=jnp.int32)
    found = jnp.sum(jnp.where(here, 2 * (w * WORD + place + 1) + full, 0), axis=-1,
                    dtype=jnp.int32)
    valid = found[..., 0, :] > 0
    rest = jnp.zeros(lead + (n - few,), jnp.int32)
    return Runs(
        jnp.concatenate([jnp.where(valid, found[..., 0, :] // 2 - 1, 0), rest], axis=-1),
        jnp.concatenate([jnp.where(valid, found[..., 1, :] // 2, 0), rest], axis=-1),
        jnp.concatenate([jnp.where(valid, PARTIAL + found[..., 0, :] % 2, EMPTY),
                         rest], axis=-1).astype(jnp.int8),
        total)

  return most, runs


def _run_edges(g: Any) -> Any:
  """Where a run of `g`'s non-empty states starts, and where one ends (its last tile),
  along the last axis: a tile whose state differs from its neighbour's, or the line's end."""
  pad = jnp.zeros(g.shape[:-1] + (1,), g.dtype)
  on = g != EMPTY
  return (on & (g != jnp.concatenate([pad, g[..., :-1]], axis=-1)),
          on & (g != jnp.concatenate([g[..., 1:], pad], axis=-1)))


def _sorted_runs(grid: Any, listed: Any = None) -> Runs:
  """`_runs` from one sort per line (`listed`: by default, top_k where no line has more
  than `FEW_RUNS` runs, `_sort_few`): each tile gives a start key
  `4 j + state` where a run starts and an end key `4 j + 3` where one ends, so the
  sorted keys alternate start, end, start, ... and carry the run's state. Keys are
  16-bit where they fit (lines of up to 16K tiles): XLA's CPU sort takes about a
  third less time on them.
  """
  n = grid.shape[-1]
  g = grid.astype(jnp.int32)
  starts, ends = _run_edges(g)
  j = jnp.arange(n, dtype=jnp.int32)
  never = 4 * n + 4
  key_type = jnp.uint16 if never <= np.iinfo(np.uint16).max else jnp.int32
  start = jnp.where(starts, 4 * j + g, never)
  end = jnp.where(ends, 4 * j + 3, never)
  keys = jnp.stack([start, end], axis=-1).reshape(g.shape[:-1] + (2 * n,)).astype(key_type)
  keys = listed(keys) if listed else _sort_few(keys, never, 2 * FEW_RUNS)
  first, last = keys[..., 0::2].astype(jnp.int32), keys[..., 1::2].astype(jnp.int32)
  valid = first < never
  # Valid runs come first: their count is the first invalid slot (argmax: one kernel,
  # where a sum over more than 32 elements compiles to three).
  count = jnp.argmax(jnp.concatenate([~valid, jnp.ones(valid.shape[:-1] + (1,), bool)], -1),
                     axis=-1).astype(jnp.int32)
  return Runs(jnp.where(valid, first // 4, 0), jnp.where(valid, last // 4 + 1, 0),
              jnp.where(valid, first % 4, 0).astype(jnp.int8), count)
