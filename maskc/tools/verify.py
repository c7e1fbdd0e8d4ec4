"""`maskc.verify`: is a mask built elsewhere the mask you meant?

A mask written by hand as a dense array, a FlexAttention `BlockMask` or `mask_mod`, or a
splash mask object is checked against a maskc expression, position by position, by
maskc's own prover (`maskc.tools.equivalence`): tiles both sides decide alike are skipped,
and only the rest is evaluated. The foreign side is read by `maskc.tools.foreign`, a band
of rows or a tile at a time, so a check at 128K tokens never holds a `q_len × kv_len`
array. The answer says where the two differ, in the foreign mask's own indices, and why.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.typing import ArrayLike

from maskc.language import ir
from maskc.language.arguments import as_mask
from maskc.language.errors import MaskTypeError, MaskValueError
from maskc.language.parse import parse
from maskc.semantics.shape import Shape
from maskc.tools import foreign as _foreign
from maskc.tools.equivalence import Equivalence, MaskSide, Side, compare_sides

_BLOCK = 128  # tile size of checks against foreign masks that have none of their own


@dataclasses.dataclass(frozen=True)
class Verification:
  """The verdict of `maskc.verify(mask, foreign, ...)`.

  Attributes:
    ok: True when the foreign mask agrees with the maskc mask at every position.
    counterexample: None when `ok`; else `(batch, head, q_index, k_index)`, a position
      where they disagree, as indices into the foreign mask (rows and columns counted
      from 0; batch and head 0 where there are none). For a BlockMask whose lists
      contradict themselves, the first position of the block concerned.
    why: one sentence saying what differs and where, or why they agree.
    expected: the maskc mask's value at the counterexample (None when `ok`).
    found: the foreign mask's value there (None when `ok`, or for a BlockMask's lists
      that contradict themselves).
    mask: the maskc mask(s) as text.
    foreign: what the foreign mask is, in words.
    shape: `(q_len, kv_len, q_offset)` of the check.
    stats: tiles decided by block maps, positions evaluated, seconds taken.

  `bool(result)` is `ok`.
  """
  ok: bool
  counterexample: tuple[int, int, int, int] | None
  why: str
  expected: bool | None = None
  found: bool | None = None
  mask: str = ""
  foreign: str = ""
  shape: tuple[int, int, int] | None = None
  stats: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

  def __bool__(self) -> bool:
    return self.ok

  def __str__(self) -> str:
    return self.why


def verify(mask: ir.Mask | str | Sequence[ir.Mask | str], foreign: Any,
           q_len: int | None = None, kv_len: int | None = None, *,
           operands: Mapping[str, ArrayLike] | None = None, q_offset: int | None = None,
           **params: Any) -> Verification:
  """Checks a mask built elsewhere against a maskc mask, at every position.

  `foreign` may be

  - a dense boolean array `[Lq, Lk]` or `[B, H, Lq, Lk]`: NumPy (a memory-mapped `.npy`
    too), jax or torch;
  - a FlexAttention `BlockMask`: its block lists and its `mask_mod` are both checked, as
    FlexAttention's kernels use them. A block listed as full that holds a disallowed
    pair is a failure, and so is a block left out that holds an allowed pair; on partial
    blocks the `mask_mod` must agree with the mask. Lists that contradict themselves (a
    block listed twice, as both partial and full, or differently in the backward pass's
    `q_*` lists) are a failure too;
  - a bare FlexAttention `mask_mod(b, h, q_idx, kv_idx)`, evaluated with `torch.vmap` at
    every position, for `b` in the operands' batch and `h` in the list of masks (0
    otherwise);
  - a JAX splash or tokamax mask object (`CausalMask`, `LocalMask`, `NumpyMask`,
    `MultiHeadMask`, ...), read through its own slices.

  Row `i` of the foreign mask is compared with maskc's query position `q_offset + i`, and
  column `j` with key position `j`. maskc's default `q_offset` is `kv_len - q_len`
  (bottom-right); FlexAttention's `mask_mod`s and splash masks count rows from 0
  (top-left), so pass `q_offset=0` for them when `q_len != kv_len`.

  The check never holds an `Lq × Lk` array: dense arrays, mask_mods and splash masks are
  read one band of rows at a time to find their blocks' states, and a BlockMask block by
  block; then maskc's prover skips the blocks both sides decide alike and evaluates the
  rest (`maskc.equivalent`'s machinery). A bare `mask_mod` is evaluated at every position,
  which is slow at long lengths; a BlockMask's only on the partial blocks that need it.

  Args:
    mask: a Mask, mask text, or a list of them (one per head).
    foreign: the mask to check (see above).
    q_len, kv_len: the shape (default: the foreign mask's; a bare mask_mod needs `q_len`).
      `kv_len` defaults to `q_len`.
    operands: static operand values of the maskc mask (NumPy, jax or torch arrays, ints).
    q_offset: maskc's query position of row 0 (default `kv_len - q_len`).
    **params: values of parameters named in mask text (`chunk(C)` with `C=8192`).

  Returns:
    A `Verification`: truthy when they agree; else its `counterexample`
    `(batch, head, q_index, k_index)` and `why` say where and how they differ.

  Raises:
    MaskTypeError: `foreign` is none of the kinds above, or not boolean.
    MaskValueError: shapes, batch or head counts that do not match, malformed lists.

  >>> import numpy as np
  >>> import maskc
  >>> window = np.tril(np.ones((64, 64), bool)) & ~np.tril(np.ones((64, 64), bool), -9)
  >>> maskc.verify("sliding(8)", window).counterexample
  (0, 0, 8, 0)
  >>> bool(maskc.verify("sliding(9)", window))
  True
  """
  start = time.perf_counter()
  masks, multi = _masks(mask, params)
  ops = _host_operands(operands)
  if _foreign.is_block_mask(foreign):
    lists = _foreign.block_mask_lists(foreign)
    seq = foreign.seq_lengths
    q_len, kv_len = _shape_of((int(seq[0]), int(seq[1])), q_len, kv_len, "the BlockMask")
    bq, bk = (int(s) for s in foreign.BLOCK_SIZE)
    shape = Shape.of(q_len, kv_len, q_offset)
    checker = _Checker(masks, multi, shape, bq, bk, ops, "the BlockMask", start)
    if lists.problems:
      return checker.inconsistent(lists)
    b_f, h_f = lists.grid.shape[:2]
    heads = checker.heads(h_f)
    checker.batch_agrees(b_f)
    mask_mod = foreign.mask_mod

    def lists_side(h: int, batch: int | None) -> Side:
      return _foreign.ListsSide(lists.grid, mask_mod, h, h if h_f > 1 else 0, batch, bq, bk)

    return checker.run(heads, lists_side, per_head=True, lists=lists.grid)
  if _is_mask_mod(foreign):
    if q_len is None:
      raise MaskValueError("a bare mask_mod has no shape: pass q_len (and kv_len)",
                           hint="e.g. `maskc.verify(mask, mask_mod, 4096)`.")
    shape = Shape.of(q_len, kv_len, q_offset)
    checker = _Checker(masks, multi, shape, _BLOCK, _BLOCK, ops, "the mask_mod", start)
    source = _foreign.mask_mod_rows(foreign, checker.batch or 1, len(masks) if multi else 1,
                                    shape.kv_len)
  else:
    source = _rows_source(foreign)
    assert source.shape is not None
    q_len, kv_len = _shape_of(source.shape, q_len, kv_len, source.kind)
    shape = Shape.of(q_len, kv_len, q_offset)
    checker = _Checker(masks, multi, shape, _BLOCK, _BLOCK, ops, source.kind, start)
  heads = checker.heads(source.heads)
  checker.batch_agrees(source.batch)

  def rows_side(h: int, batch: int | None) -> Side:
    return _foreign.RowsSide(source, h if source.heads > 1 else 0, shape, _BLOCK, _BLOCK, batch)

  return checker.run(heads, rows_side, per_head=source.heads > 1)


def _masks(mask: Any, params: Mapping[str, Any]) -> tuple[list[ir.Mask], bool]:
  def one(m: Any) -> ir.Mask:
    if isinstance(m, str):
      return parse(m, **params)
    if params:
      raise MaskTypeError(f"parameters {sorted(params)} were given with a Mask object; they "
                          f"bind names in mask text only", hint="Pass the mask as text.")
    return as_mask(m)

  if isinstance(mask, (str, ir.Mask)):
    return [one(mask)], False
  if isinstance(mask, Sequence) and len(mask) > 0:
    return [one(m) for m in mask], True
  raise MaskTypeError(f"expected a mask, mask text or a non-empty list of them, got {mask!r}")


def _host_operands(operands: Mapping[str, Any] | None) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for name, value in (operands or {}).items():
    if _foreign.is_torch_tensor(value):
      value = value.detach().cpu().numpy()
    elif isinstance(value, jax.Array):
      value = np.asarray(value)
    out[name] = value
  return out


def _is_mask_mod(foreign: Any) -> bool:
  return callable(foreign) and not isinstance(foreign, (np.ndarray, jax.Array)) and not (
      _foreign.is_torch_tensor(foreign) or _foreign.is_splash_mask(foreign))


def _rows_source(foreign: Any) -> _foreign.Rows:
  """The reader of a dense array or a splash mask object."""
  if isinstance(foreign, (str, ir.Mask)):
    raise MaskTypeError("the foreign mask is a maskc mask",
                        hint="Compare two maskc masks with `maskc.equivalent(a, b, q_len)`.")
  if isinstance(foreign, (np.ndarray, jax.Array)) or _foreign.is_torch_tensor(foreign):
    return _foreign.dense_rows(foreign)
  if _foreign.is_splash_mask(foreign):
    return _foreign.splash_rows(foreign)
  raise MaskTypeError(
      f"cannot verify a {type(foreign).__module__}.{type(foreign).__name__}",
      hint="Pass a dense bool array ([Lq, Lk] or [B, H, Lq, Lk]; NumPy, jax or torch), a "
           "FlexAttention BlockMask or mask_mod, or a splash / tokamax mask object.")


def _shape_of(found: tuple[int, int], q_len: int | None, kv_len: int | None,
              kind: str) -> tuple[int, int]:
  """The check's shape: the foreign mask's, which a given `q_len`/`kv_len` must match."""
  for name, given, have in (("q_len", q_len, found[0]), ("kv_len", kv_len, found[1])):
    if given is not None and given != have:
      raise MaskValueError(f"{kind} is {found[0]} x {found[1]}, but {name}={given} was given",
                           hint="Leave q_len and kv_len out to check at the foreign shape.")
  return found


class _Checker:
  """The check of one foreign mask against the masks, head by head."""

  def __init__(self, masks: list[ir.Mask], multi: bool, shape: Shape, bq: int, bk: int,
               ops: Mapping[str, Any], kind: str, start: float) -> None:
    if not shape.static:
      raise MaskTypeError("verify needs a static q_offset", hint="Call it outside jax.jit.")
    self.masks, self.multi, self.shape, self.bq, self.bk = masks, multi, shape, bq, bk
    self.kind, self.start = kind, start
    self.sides: dict[ir.Mask, MaskSide] = {}
    for m in masks:
      if m not in self.sides:
        self.sides[m] = MaskSide(m, shape, bq, bk, ops)
    batches = {s.batch for s in self.sides.values() if s.batch is not None}
    if len(batches) > 1:
      raise MaskValueError(f"the heads' operands disagree on the batch size: {sorted(batches)}")
    self.batch = batches.pop() if batches else None
    self.text = " ; ".join(str(m) for m in masks)

  def heads(self, foreign_heads: int) -> int:
    n = len(self.masks)
    if self.multi and foreign_heads not in (1, n):
      raise MaskValueError(f"{self.kind} has {foreign_heads} heads, the list of masks {n}",
                           hint="Pass one mask per head, or a single mask for every head.")
    return max(foreign_heads, n if self.multi else 1)

  def batch_agrees(self, foreign_batch: int) -> None:
    if foreign_batch > 1 and self.batch is not None and foreign_batch != self.batch:
      raise MaskValueError(f"{self.kind} has a batch of {foreign_batch}, the operands "
                           f"{self.batch}", hint="Give the operands the foreign mask's batch.")

  def run(self, heads: int, side_of: Callable[[int, int | None], Side], *, per_head: bool,
          lists: np.ndarray | None = None) -> Verification:
    """Compares every head (the foreign side read once when it is the same for all)."""
    stats: dict[str, Any] = {"heads": heads, "tiles": 0, "tiles_by_map": 0,
                             "positions_evaluated": 0}
    shared: Side | None = None
    for h in range(heads):
      m = self.masks[h if self.multi else 0]
      if per_head or shared is None:
        shared = side_of(h, self.batch)
      eq = compare_sides(self.sides[m], shared, self.shape, self.bq, self.bk, text_a=str(m),
                         text_b=self.kind)
      for key in ("tiles", "tiles_by_map", "positions_evaluated"):
        stats[key] += int(eq.stats.get(key, 0))
      if not eq.equal:
        return self._differ(eq, h, m, stats, lists)
    stats["seconds"] = time.perf_counter() - self.start
    s = self.shape
    size = f"{self.batch or 1} x {heads} x {s.q_len} x {s.kv_len}"
    return Verification(
        True, None, f"{self.kind[0].upper()}{self.kind[1:]} equals `{self.text}` at every "
        f"position ({size}, q_offset={s.q_offset}): {stats['tiles_by_map']} of "
        f"{stats['tiles']} blocks decided by the block maps, {stats['positions_evaluated']} "
        f"positions evaluated.", mask=self.text, foreign=self.kind, shape=self._shape(),
        stats=stats)

  def _shape(self) -> tuple[int, int, int]:
    return (self.shape.q_len, self.shape.kv_len, int(self.shape.q_offset))

  def _differ(self, eq: Equivalence, h: int, m: ir.Mask, stats: dict[str, Any],
              lists: np.ndarray | None) -> Verification:
    cx = eq.counterexample
    assert cx is not None
    b = cx.batch or 0
    where = (f"query row {cx.row}, key {cx.col} (batch {b}, head {h}; maskc's positions "
             f"q={cx.q}, k={cx.k})")
    verb = {True: "allows", False: "disallows"}
    if lists is not None:
      lb = b if lists.shape[0] > 1 else 0
      state = int(lists[lb, h if lists.shape[1] > 1 else 0, cx.tile[0], cx.tile[1]])
      block = f"block {cx.tile}"
      why = {
          _foreign.FULL: f"The BlockMask lists {block} as full, but `{m}` disallows {where}: a "
                         f"block listed as full must hold only allowed pairs (the kernels skip "
                         f"the mask_mod there).",
          _foreign.EMPTY: f"The BlockMask leaves {block} out, but `{m}` allows {where}: a "
                          f"block left out must hold no allowed pair.",
          _foreign.PARTIAL: f"The BlockMask's mask_mod {verb[cx.b]} {where} (in partial "
                            f"{block}), but `{m}` {verb[cx.a]} it.",
      }[state]
    else:
      why = (f"{self.kind[0].upper()}{self.kind[1:]} {verb[cx.b]} {where}, but `{m}` "
             f"{verb[cx.a]} it.")
    s = self.shape
    if s.q_len != s.kv_len and int(s.q_offset) != 0:
      why = why[:-1] + (f"; rows are compared at q_offset={s.q_offset} (maskc's bottom-right "
                        f"default), while FlexAttention and splash count rows from 0: pass "
                        f"q_offset=0 if the foreign mask is top-left aligned.")
    stats["seconds"] = time.perf_counter() - self.start
    return Verification(False, (b, h, cx.row, cx.col), why, expected=cx.a, found=cx.b,
                        mask=self.text, foreign=self.kind, shape=self._shape(), stats=stats)

  def inconsistent(self, lists: _foreign.Lists) -> Verification:
    b, h, i, j, text = lists.problems[0]
    more = len(lists.problems) - 1
    why = (f"The BlockMask's lists contradict themselves: {text} (batch {b}, head {h})"
           + (f", and {more} more such block{'s' * (more > 1)}" if more else "") + ".")
    return Verification(False, (b, h, i * self.bq, j * self.bk), why, mask=self.text,
                        foreign=self.kind, shape=self._shape(),
                        stats={"seconds": time.perf_counter() - self.start})
