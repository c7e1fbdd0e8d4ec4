"""One interval of keys per query row: the form kernels without mask evaluation read.

Many masks hold on one interval of keys in every row (`causal`, `sliding(w)`,
`causal & chunk(c)`, `causal & document(seg)` with contiguous documents,
`causal | bidirectional(img)`, prefix-LM). The compiler proves it from the mask's
structure (`maskc.lowering.closed_forms.row_intervals`) and hands each distinct mask
over as a `KeyIntervals` form: a small tree of the parts below, with no arrays inside.
`BlockMap.key_intervals()` evaluates it on the map's operands, with NumPy for a static
map and jax.numpy under `jit`.

Every part gives, per row at position `p`, an interval of keys `[lo, hi]` (inclusive,
clipped to the keys `[0, kv_len)`; `lo > hi` when the row has none) that holds every
allowed key of the row (sound), and says whether it holds only allowed keys (exact):

| part | keys of row `p` | exact |
|---|---|---|
| `Band(lo, hi)` | `p - hi <= k <= p - lo` | always |
| `Chunk(c)` | the chunk of `p`: `c (p // c) <= k < c (p // c + 1)` | always |
| `Block(x, s, t, g)` | `x[k + t]` in the run of `x[p + s]`, if `g[p + s]` | one run a value |
| `Rows(pred)` | every key, or none, as the mask of `q` alone says | always |
| `Keys(pred)` | the hull of the keys the mask of `k` alone allows | when declared an interval |
| `Meet(items)` | the intersection | when every item is |
| `Join(items)` | the hull of the union | when every item is and all share an anchor |
| `Anything()` | every key | never |

An *anchor* is a key every non-empty interval of a part holds: `"diag"` (the row's
own position, clipped to the keys), `"first"` (key 0) or `"last"` (key `kv_len - 1`).
Intervals that share a key are one interval together, so a union of exact parts with a
common anchor is exact: `causal | bidirectional(img)` (both hold the diagonal),
`causal | prefix(n)` (both start at key 0).

This module imports only the compiled predicate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from maskc.compiled import predicate as _predicate
from maskc.compiled.predicate import Predicate

ANCHORS = frozenset({"diag", "first", "last"})
# beyond any key a row can reach (int32 under jit)
_FAR = 1 << 30


@dataclasses.dataclass(frozen=True)
class Band:
  """`lo <= q - k <= hi` (either end None: unbounded)."""
  lo: int | None
  hi: int | None


@dataclasses.dataclass(frozen=True)
class Chunk:
  """`q // c == k // c`."""
  c: int


@dataclasses.dataclass(frozen=True)
class Block:
  """`x[q + s] == x[k + t]`, and `gate[q + s]` nonzero when `gate` is set.

  Attributes:
    array: the operand array compared (a key of the map's operands).
    s, t: the shifts of the row's and the key's read.
    gate: the array whose nonzero value at `q + s` the row needs, or None.
    one_run: whether each value of `array` is known to be one run of its batch row
      where the gate holds (run ids `runs(x)` beside `x[q]`; ids declared contiguous and
      checked when bound). Otherwise it is checked on static values, and the block is
      every key (not exact) under `jit`.
  """
  array: str
  s: int
  t: int
  gate: str | None = None
  one_run: bool = False


@dataclasses.dataclass(frozen=True)
class Rows:
  """A mask of `q` (and scalars) alone: each row allows every key or none."""
  pred: Predicate


@dataclasses.dataclass(frozen=True)
class Keys:
  """A mask of `k` (and scalars) alone: the same keys in every row, taken as their hull.

  Attributes:
    pred: the compiled mask.
    interval: whether its keys are one interval for every operand value (comparisons of
      `k + c` with terms free of `k`, in an `&`), which makes the hull exact.
    anchors: the anchors of that interval (`"first"` when it only bounds `k` above).
  """
  pred: Predicate
  interval: bool = False
  anchors: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class Meet:
  """The intersection of the items' intervals."""
  items: tuple[Form, ...]


@dataclasses.dataclass(frozen=True)
class Join:
  """The hull of the union of the items' intervals."""
  items: tuple[Form, ...]


@dataclasses.dataclass(frozen=True)
class Anything:
  """A part no analysis covers: every key of the row."""


Form = Band | Chunk | Block | Rows | Keys | Meet | Join | Anything


@dataclasses.dataclass(frozen=True)
class KeyIntervals:
  """The interval form of one distinct mask, as the compiler found it.

  Attributes:
    form: the tree of parts (this module's table).
    text: the mask's canonical text, for messages.
  """
  form: Form
  text: str = ""


def anchors(form: Form) -> frozenset[str]:
  """The keys every non-empty interval of `form` holds, in every row (its anchors)."""
  if isinstance(form, Band):
    out = set()
    if (form.lo is None or form.lo <= 0) and (form.hi is None or form.hi >= 0):
      out.add("diag")
    if form.hi is None:
      out.add("first")
    if form.lo is None:
      out.add("last")
    return frozenset(out)
  if isinstance(form, Chunk):
    return frozenset({"diag"})
  if isinstance(form, Block):
    return frozenset({"diag"}) if form.s == form.t else frozenset()
  if isinstance(form, (Rows, Anything)):
    return ANCHORS
  if isinstance(form, Keys):
    return form.anchors
  found = ANCHORS
  for item in form.items:
    found = found & anchors(item)
  return found


class Env:
  """What evaluating a form needs: the array module, the rows' positions, the keys,
  the operands (batch axis first) and the batch size."""

  def __init__(self, xp: Any, positions: Any, kv_len: int, operands: Mapping[str, Any],
               nb: int, static: bool):
    self.xp, self.p, self.kv_len, self.operands, self.nb = xp, positions, kv_len, operands, nb
    self.static = static
    self.int_t = np.int64 if xp is np else np.int32


def evaluate(form: Form, env: Env) -> tuple[Any, Any, bool]:
  """`(lo, hi, exact)`: each row's interval of keys `[lo, hi]`, `[B' or 1, q_len]`,
  clipped to the keys (`lo > hi`: no key), and whether it holds only allowed keys."""
  xp, last = env.xp, env.kv_len - 1
  p = env.p[None, :]
  if isinstance(form, Band):
    lo = p - _clamp(form.hi) if form.hi is not None else xp.full_like(p, -_FAR)
    hi = p - _clamp(form.lo) if form.lo is not None else xp.full_like(p, _FAR)
    return _clip(xp, lo, hi, last) + (True,)
  if isinstance(form, Chunk):
    start = xp.floor_divide(p, form.c) * form.c
    return _clip(xp, start, start + form.c - 1, last) + (True,)
  if isinstance(form, Block):
    return _block(form, env)
  if isinstance(form, Rows):
    rows = _rows(form.pred, env)
    return (xp.where(rows, 0, env.kv_len), xp.where(rows, last, -1), True)
  if isinstance(form, Keys):
    allowed = _keys(form.pred, env)  # [B', kv_len]
    k = xp.arange(env.kv_len, dtype=env.int_t)
    lo = xp.min(xp.where(allowed, k, env.kv_len), axis=-1, keepdims=True)
    hi = xp.max(xp.where(allowed, k, -1), axis=-1, keepdims=True)
    return (xp.broadcast_to(lo, (lo.shape[0], p.shape[1])),
            xp.broadcast_to(hi, (hi.shape[0], p.shape[1])), form.interval)
  if isinstance(form, Anything):
    return xp.zeros_like(p), xp.full_like(p, last), False
  parts = [evaluate(item, env) for item in form.items]
  exact = all(e for _, _, e in parts)
  if isinstance(form, Meet):
    lo, hi = parts[0][0], parts[0][1]
    for a, b, _ in parts[1:]:
      lo, hi = xp.maximum(lo, a), xp.minimum(hi, b)
    return lo, hi, exact
  # a union: the hull of the non-empty intervals, one interval where they share a key
  lo = hi = None
  for a, b, _ in parts:
    empty = a > b
    a, b = xp.where(empty, _FAR, a), xp.where(empty, -_FAR, b)
    lo = a if lo is None else xp.minimum(lo, a)
    hi = b if hi is None else xp.maximum(hi, b)
  return lo, hi, exact and (len(parts) == 1 or bool(anchors(form)))


def _clamp(x: int) -> int:
  return max(-_FAR, min(_FAR, x))


def _clip(xp: Any, lo: Any, hi: Any, last: int) -> tuple[Any, Any]:
  return xp.maximum(lo, 0), xp.minimum(hi, last)


def _block(form: Block, env: Env) -> tuple[Any, Any, bool]:
  """The run of `x` each row reads, as keys; every key where it may not be the only one."""
  xp, last = env.xp, env.kv_len - 1
  x = xp.asarray(env.operands[form.array])
  one_run = form.one_run or (env.static and _one_run_each(np.asarray(x)))
  if not one_run:
    p = env.p[None, :]
    return xp.zeros_like(p), xp.full_like(p, last), False
  n = x.shape[-1]
  i = xp.arange(n, dtype=env.int_t)[None, :]
  new = xp.concatenate([xp.ones_like(x[:, :1], dtype=bool), x[:, 1:] != x[:, :-1]], axis=1)
  ends = xp.concatenate([x[:, 1:] != x[:, :-1], xp.ones_like(x[:, :1], dtype=bool)], axis=1)
  start = _cum(xp, xp.where(new, i, 0), "max")
  stop = _cum(xp, xp.where(ends, i, n - 1), "min")
  at = xp.clip(env.p + form.s, 0, n - 1).astype(env.int_t)
  at = xp.broadcast_to(at[None, :], (x.shape[0], at.shape[0]))
  a = xp.take_along_axis(start, at, axis=1)
  b = xp.take_along_axis(stop, at, axis=1)
  # reads are clipped to the operand: its first and last runs reach past its ends
  lo = xp.where(a == 0, -_FAR, a - form.t)
  hi = xp.where(b == n - 1, _FAR, b - form.t)
  lo, hi = _clip(xp, lo, hi, last)
  if form.gate is not None:
    g = xp.asarray(env.operands[form.gate])
    on = xp.take_along_axis(xp.broadcast_to(g != 0, (x.shape[0], g.shape[-1])),
                            xp.clip(at, 0, g.shape[-1] - 1), axis=1)
    lo, hi = xp.where(on, lo, env.kv_len), xp.where(on, hi, -1)
  return lo, hi, True


def _cum(xp: Any, a: Any, how: str) -> Any:
  """Running max from the left, or running min from the right, along the last axis."""
  if xp is np:
    if how == "max":
      return np.maximum.accumulate(a, axis=-1)
    return np.minimum.accumulate(a[:, ::-1], axis=-1)[:, ::-1]
  if how == "max":
    return jax.lax.cummax(a, axis=1)
  return jax.lax.cummin(a, axis=1, reverse=True)


def _one_run_each(x: np.ndarray) -> bool:
  """Whether each value of `x` (`[B', L]`) occurs in one run of its row."""
  return all(one_run_each(row) for row in x.reshape(-1, x.shape[-1]))


def one_run_each(row: np.ndarray) -> bool:
  """Whether each value of the 1-D `row` occurs in one run (contiguous ids)."""
  if row.size < 2:
    return True
  starts = np.concatenate([[True], row[1:] != row[:-1]])
  values = row[starts]
  return np.unique(values).size == values.size


def _rows(pred: Predicate, env: Env) -> Any:
  """The mask of `q` alone at each row: bool `[B', q_len]`."""
  xp = env.xp
  k = xp.zeros((1,), env.int_t)
  values = _predicate.gather(pred, env.operands, env.p, k, xp, batch=env.nb, block_q=1,
                             block_kv=1, dtype=env.int_t)
  fetch = _predicate.dense_fetch(values, xp, block_q=1, block_kv=1, q_len=env.p.shape[0],
                                 kv_len=1)
  out = _predicate.evaluate(pred, xp, env.p[None, :, None], k[None, None, :], fetch)
  return xp.broadcast_to(out, (env.nb, env.p.shape[0], 1))[..., 0]


def _keys(pred: Predicate, env: Env) -> Any:
  """The mask of `k` alone at each key: bool `[B', kv_len]`."""
  xp = env.xp
  q = env.p[:1]
  k = xp.arange(env.kv_len, dtype=env.int_t)
  values = _predicate.gather(pred, env.operands, q, k, xp, batch=env.nb, block_q=1,
                             block_kv=1, dtype=env.int_t)
  fetch = _predicate.dense_fetch(values, xp, block_q=1, block_kv=1, q_len=1,
                                 kv_len=env.kv_len)
  out = _predicate.evaluate(pred, xp, q[None, :, None], k[None, None, :], fetch)
  return xp.broadcast_to(out, (env.nb, 1, env.kv_len))[:, 0]


def band_of(form: Form) -> tuple[Band, Keys | None] | None:
  """`(band, keys)` where `form` is exactly a band of `q - k`, alone or met with an
  interval of keys from key 0 (`causal & k < kv_len`: per-batch key lengths); else None."""
  if isinstance(form, Band):
    return form, None
  if isinstance(form, Keys) and form.interval and "first" in form.anchors:
    return Band(None, None), form
  if isinstance(form, Meet) and len(form.items) == 2:
    for a, b in (form.items, form.items[::-1]):
      if isinstance(a, Band) and isinstance(b, Keys) and b.interval and "first" in b.anchors:
        return a, b
  return None


def key_lengths(keys: Keys, env: Env) -> Any:
  """How many keys from key 0 an interval of keys `keys` (`band_of`) keeps, `[B']`."""
  allowed = _keys(keys.pred, env)
  return env.xp.sum(allowed, axis=-1)
