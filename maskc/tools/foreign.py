"""Masks built elsewhere, read as sides of maskc's prover (`maskc.tools.equivalence.Side`).

`maskc.verify` compares a maskc mask with a mask some other code built. Each kind of
foreign mask is read here into the prover's terms: tile runs (what the foreign mask says
of whole tiles) and values at positions.

- Dense arrays (NumPy, jax, torch) `[Lq, Lk]` or `[B, H, Lq, Lk]`, FlexAttention
  `mask_mod` functions, and splash / tokamax mask objects are *sources of rows*: their
  tiles' states are found by reading (or evaluating) one band of rows at a time, so no
  `Lq × Lk` array is ever held, and their values are read again only where the prover asks.
- A FlexAttention `BlockMask` is *block metadata*: its lists say which tiles are full,
  partial or left out, and its `mask_mod` decides the partial ones, as in FlexAttention's
  kernels. It is read tile by tile: the mask_mod is evaluated only on the partial tiles
  where the prover needs it.

Nothing here imports torch, jax's Pallas or tokamax at module import: a foreign object is
recognised by its class's module and name, and torch is imported only to evaluate a
torch object, which means torch is already loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from maskc.compiled.tiles import EMPTY, FULL, PARTIAL, runs_from_grid
from maskc.language.errors import MaskTypeError, MaskValueError
from maskc.semantics.bind import ComputableMask
from maskc.semantics.shape import Shape

ROW_CHUNK = 1 << 22  # positions read or evaluated at once
_STATE = {EMPTY: "left out", PARTIAL: "partial", FULL: "full"}


def _classes(x: Any) -> list[tuple[str, str]]:
  return [(c.__module__, c.__name__) for c in type(x).__mro__]


def is_torch_tensor(x: Any) -> bool:
  return ("torch", "Tensor") in _classes(x)


def is_block_mask(x: Any) -> bool:
  return any(name == "BlockMask" and module.startswith("torch.") for module, name in _classes(x))


def is_splash_mask(x: Any) -> bool:
  """A splash or tokamax mask object, or a maskc `ComputableMask` (which reads the same)."""
  return isinstance(x, ComputableMask) or any(
      name == "Mask" and module.endswith("splash_attention_mask") for module, name in _classes(x))


# ----------------------------------------------------------------------------- sources of rows


@dataclasses.dataclass
class Rows:
  """A foreign mask read by rows: its sizes, and how to read a band of rows or positions.

  Attributes:
    kind: what it is, in words ("a dense NumPy array", "the mask_mod", ...).
    batch, heads: its batch and head sizes (1 when it has none: it broadcasts).
    shape: `(q_len, kv_len)`, or None when the foreign mask does not say (a mask_mod).
    rows: `rows(b, h, r0, r1) -> bool [r1 - r0, kv_len]`.
    points: `points(b, h, rows, cols) -> bool` at broadcastable index arrays (`b` too).
    batch_dependent: whether its values depend on the batch row beyond `batch` (a
      mask_mod reads `b` however many rows it is evaluated for).
  """
  kind: str
  batch: int
  heads: int
  shape: tuple[int, int] | None
  rows: Callable[[int, int, int, int], np.ndarray]
  points: Callable[[Any, int, np.ndarray, np.ndarray], np.ndarray]
  batch_dependent: bool = False


def dense_rows(x: Any, kv_len: int | None = None) -> Rows:
  """A dense bool (or 0/1) array, `[Lq, Lk]` or `[B, H, Lq, Lk]`: NumPy, jax or torch."""
  torch_like = is_torch_tensor(x)
  kind = ("a dense torch tensor" if torch_like else "a dense jax array"
          if isinstance(x, jax.Array) else "a dense NumPy array")
  shape = tuple(int(s) for s in x.shape)
  if len(shape) == 3:
    raise MaskValueError(
        f"{kind} of shape {shape} is ambiguous: is its first axis the batch or the heads?",
        hint="Pass [Lq, Lk] or [B, H, Lq, Lk]: `x[:, None]` for a batch, `x[None]` for heads.")
  if len(shape) not in (2, 4):
    raise MaskValueError(f"{kind} must have shape [Lq, Lk] or [B, H, Lq, Lk], got {shape}")
  dtype = str(x.dtype).removeprefix("torch.")
  if dtype not in ("bool",) and not any(dtype.startswith(p) for p in ("int", "uint")):
    raise MaskTypeError(f"{kind} must hold booleans (or 0/1), got {dtype}",
                        hint="Pass the mask as bool: `x.astype(bool)` or `x.bool()`.")
  lead = (shape[0], shape[1]) if len(shape) == 4 else (1, 1)

  def host(a: Any) -> np.ndarray:
    a = a.detach().cpu().numpy() if torch_like else np.asarray(a)
    if a.dtype != np.bool_:
      if a.size and not np.isin(a, (0, 1)).all():
        raise MaskTypeError(f"{kind} holds values other than 0 and 1",
                            hint="Pass the mask as bool.")
      a = a != 0
    return a

  def plane(b: int, h: int) -> Any:
    return x if len(shape) == 2 else x[b, h]

  def rows(b: int, h: int, r0: int, r1: int) -> np.ndarray:
    return host(plane(b, h)[r0:r1])

  def points(b: Any, h: int, r: np.ndarray, c: np.ndarray) -> np.ndarray:
    b, r, c = np.broadcast_arrays(np.asarray(b), r, c)
    if torch_like:
      import torch
      idx: tuple[Any, ...] = tuple(torch.as_tensor(np.ascontiguousarray(i)) for i in (b, r, c))
    else:
      idx = (b, r, c)
    if len(shape) == 2:
      return host(x[idx[1], idx[2]])
    return host(x[idx[0], h, idx[1], idx[2]])

  return Rows(kind, lead[0], lead[1], (shape[-2], shape[-1]), rows, points)


def mask_mod_rows(fn: Callable[..., Any], batch: int, heads: int, kv_len: int,
                  kind: str = "the mask_mod") -> Rows:
  """A FlexAttention `mask_mod(b, h, q_idx, kv_idx)`, evaluated with `torch.vmap` as
  `create_mask` evaluates it (int64 indices, rows counted from 0)."""
  def points(b: Any, h: int, r: np.ndarray, c: np.ndarray) -> np.ndarray:
    b, r, c = np.broadcast_arrays(np.asarray(b), r, c)
    out = np.empty(b.shape, bool)
    flat = out.reshape(-1)
    bf, rf, cf = (np.ascontiguousarray(a).reshape(-1) for a in (b, r, c))
    for s in range(0, flat.size, ROW_CHUNK):
      flat[s:s + ROW_CHUNK] = evaluate_mask_mod(fn, bf[s:s + ROW_CHUNK], h, rf[s:s + ROW_CHUNK],
                                                cf[s:s + ROW_CHUNK])
    return out

  def rows(b: int, h: int, r0: int, r1: int) -> np.ndarray:
    r = np.arange(r0, r1)[:, None]
    return points(np.int64(b), h, r, np.arange(kv_len)[None, :])

  return Rows(kind, batch, heads, None, rows, points, batch_dependent=True)


def evaluate_mask_mod(fn: Callable[..., Any], b: np.ndarray, h: int, rows: np.ndarray,
                      cols: np.ndarray) -> np.ndarray:
  """`fn` at flat index arrays, through `torch.vmap` (as FlexAttention's `create_mask`)."""
  import torch
  n = rows.size
  args = (torch.as_tensor(np.asarray(b, np.int64)), torch.full((n,), h, dtype=torch.int64),
          torch.as_tensor(np.asarray(rows, np.int64)),
          torch.as_tensor(np.asarray(cols, np.int64)))
  try:  # FlexAttention evaluates mask_mods with `tensor[index]` turned into an index op
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    context: Any = TransformGetItemToIndex()
  except ImportError:  # pragma: no cover (older torch)
    import contextlib
    context = contextlib.nullcontext()
  with context:
    out = torch.vmap(fn, in_dims=(0, 0, 0, 0))(*args)
  out = torch.as_tensor(out)
  if out.dtype != torch.bool:
    raise MaskTypeError(f"the mask_mod returned {out.dtype}, not a bool tensor",
                        hint="A mask_mod returns a bool tensor: `q_idx >= kv_idx`.")
  result: np.ndarray = np.broadcast_to(out.cpu().numpy(), (n,))
  return result


def splash_rows(x: Any) -> Rows:
  """A splash or tokamax mask object (`shape`, and `__getitem__` of slices), or a maskc
  `ComputableMask`: read through its own slices, as splash's `process_mask` reads it."""
  shape = tuple(int(s) for s in x.shape)
  name = type(x).__name__
  ours = isinstance(x, ComputableMask)
  batched = ours and len(shape) == 3  # a maskc ComputableMask with a batch
  if len(shape) not in (2, 3):
    raise MaskValueError(f"the splash mask {name} has shape {shape}; expected (Lq, Lk) or "
                         f"(heads, Lq, Lk)")
  lead = 1 if len(shape) == 2 else shape[0]

  def rect(b: int, h: int, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
    idx: tuple[int | slice, ...] = (slice(r0, r1), slice(c0, c1))
    if len(shape) == 3:
      idx = (b if batched else h,) + idx
    return np.asarray(x[idx], dtype=bool)

  def rows(b: int, h: int, r0: int, r1: int) -> np.ndarray:
    return rect(b, h, r0, r1, 0, shape[-1])

  def points(b: Any, h: int, r: np.ndarray, c: np.ndarray) -> np.ndarray:
    b, r, c = np.broadcast_arrays(np.asarray(b), r, c)
    out = np.empty(r.shape, bool)
    # one slice per leading index: the prover asks for rectangles, one per leading index
    lead_n = r.shape[0] if r.ndim > 1 else 1
    for t, (bt, rt, ct) in enumerate(zip(*(a.reshape(lead_n, -1) for a in (b, r, c)))):
      r0, c0 = int(rt.min()), int(ct.min())
      box = rect(int(bt[0]), h, r0, int(rt.max()) + 1, c0, int(ct.max()) + 1)
      out.reshape(lead_n, -1)[t] = box[rt - r0, ct - c0]
    return out

  origin = ("maskc" if ours else
            "tokamax" if type(x).__module__.startswith("tokamax") else "splash")
  return Rows(f"the {origin} mask {name}", shape[0] if batched else 1, 1 if batched else lead,
              (shape[-2], shape[-1]), rows, points)


class RowsSide:
  """A source of rows at one head, as a prover side: exact tile runs from one pass over its
  rows, a band of rows at a time; values read again where the prover asks."""

  def __init__(self, source: Rows, head: int, shape: Shape, bq: int, bk: int,
               batch: int | None) -> None:
    self.source, self.head = source, head
    depends = source.batch > 1 or (source.batch_dependent and batch is not None)
    self.batch = (batch or source.batch) if depends else None
    q_len, kv_len = shape.q_len, shape.kv_len
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    full = kv_len // bk  # key tiles of a whole block
    grid = np.zeros((self.batch or 1, nq, nk), np.int8)
    tiles_at_once = max(1, ROW_CHUNK // (bq * kv_len))
    for b in range(self.batch or 1):
      sb = self._b(b)
      for i0 in range(0, nq, tiles_at_once):
        r0, r1 = i0 * bq, min((i0 + tiles_at_once) * bq, q_len)
        band = source.rows(sb, head, r0, r1)
        for i in range(i0, min(i0 + tiles_at_once, nq)):
          t = band[i * bq - r0:min((i + 1) * bq, q_len) - r0]
          whole = t[:, :full * bk].reshape(t.shape[0], full, bk)
          any_ = np.concatenate([whole.any(axis=(0, 2)), [t[:, full * bk:].any()]])[:nk]
          all_ = np.concatenate([whole.all(axis=(0, 2)), [t[:, full * bk:].all()]])[:nk]
          grid[b, i] = np.where(all_, FULL, np.where(any_, PARTIAL, EMPTY))
    self.runs = tuple(runs_from_grid(np, grid)[:3])

  def _b(self, b: Any) -> Any:
    return b if self.source.batch > 1 or self.source.batch_dependent else 0 * b

  def states(self, b: np.ndarray | int, r0: np.ndarray, r1: np.ndarray, c0: np.ndarray,
             c1: np.ndarray) -> np.ndarray:
    return np.full(np.shape(r0), PARTIAL, np.int8)

  def values(self, b: np.ndarray | int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    return self.source.points(self._b(np.asarray(b)), self.head, rows, cols)


# ----------------------------------------------------------------------------- BlockMask


@dataclasses.dataclass(frozen=True)
class Lists:
  """A FlexAttention BlockMask's lists as tile grids, and what is wrong with them.

  Attributes:
    grid: `int8[B, H, n_q_tiles, n_kv_tiles]`: FULL where `full_kv_*` lists the tile,
      PARTIAL where `kv_*` does, EMPTY where neither does.
    problems: `(b, h, i, j, sentence)` of tiles the lists get wrong in themselves: listed
      twice, listed as both partial and full, or listed differently by the backward
      pass's `q_*` lists (earliest first).
  """
  grid: np.ndarray
  problems: tuple[tuple[int, int, int, int, str], ...]


def block_mask_lists(bm: Any) -> Lists:
  """The tile grids of a BlockMask's `kv_*` lists, checked against its `q_*` lists."""
  def host(t: Any) -> np.ndarray | None:
    return None if t is None else t.detach().cpu().numpy()

  kv_num, kv_idx = host(bm.kv_num_blocks), host(bm.kv_indices)
  full_num, full_idx = host(bm.full_kv_num_blocks), host(bm.full_kv_indices)
  if kv_num is None or kv_idx is None or kv_num.ndim != 3:
    raise MaskValueError("the BlockMask's kv_num_blocks must have shape [B, H, n_q_blocks], got "
                         f"{None if kv_num is None else kv_num.shape}")
  b, h, nq = kv_num.shape
  q_len, kv_len = (int(s) for s in bm.seq_lengths)
  bq, bk = (int(s) for s in bm.BLOCK_SIZE)
  nk = -(-kv_len // bk)
  if nq != -(-q_len // bq):
    raise MaskValueError(f"the BlockMask has {nq} rows of blocks, but seq_lengths {q_len, kv_len}"
                         f" and BLOCK_SIZE {bq, bk} make {-(-q_len // bq)}")
  problems: list[tuple[int, int, int, int, str]] = []
  partial = _grid(kv_num, kv_idx.reshape(b, h, nq, -1), nk, "kv_indices", problems)
  full = (np.zeros_like(partial) if full_num is None or full_idx is None else
          _grid(full_num.reshape(b, h, nq), full_idx.reshape(b, h, nq, -1), nk,
                "full_kv_indices", problems))
  both = partial & full
  for bi, hi, i, j in zip(*np.nonzero(both)):
    problems.append((bi, hi, i, j, f"block ({i}, {j}) is listed both as partial and as full"))
  grid = np.where(full, FULL, np.where(partial, PARTIAL, EMPTY)).astype(np.int8)
  q_num, q_idx = host(bm.q_num_blocks), host(bm.q_indices)
  if q_num is not None and q_idx is not None:
    q_partial = _grid(q_num.reshape(b, h, nk), q_idx.reshape(b, h, nk, -1), nq, "q_indices",
                      problems, transposed=True)
    fq_num, fq_idx = host(bm.full_q_num_blocks), host(bm.full_q_indices)
    q_full = (np.zeros_like(q_partial) if fq_num is None or fq_idx is None else
              _grid(fq_num.reshape(b, h, nk), fq_idx.reshape(b, h, nk, -1), nq,
                    "full_q_indices", problems, transposed=True))
    q_grid = np.where(q_full, FULL, np.where(q_partial, PARTIAL, EMPTY))
    for bi, hi, i, j in zip(*np.nonzero(q_grid != grid)):
      problems.append((bi, hi, i, j, f"block ({i}, {j}) is {_STATE[int(grid[bi, hi, i, j])]} "
                       f"in the kv lists (forward) but {_STATE[int(q_grid[bi, hi, i, j])]} in "
                       f"the q lists (backward)"))
  problems.sort(key=lambda p: p[:4])
  return Lists(grid, tuple((int(p[0]), int(p[1]), int(p[2]), int(p[3]), p[4])
                           for p in problems))


def _grid(num: np.ndarray, idx: np.ndarray, n_other: int, name: str,
          problems: list[tuple[int, int, int, int, str]], *,
          transposed: bool = False) -> np.ndarray:
  """bool `[B, H, n_q_tiles, n_kv_tiles]`: the tiles the first `num` entries of each line
  list (per key tile when `transposed`); duplicates are recorded in `problems`."""
  b, h, n_lines, m = idx.shape
  if (num < 0).any() or (num > m).any():
    raise MaskValueError(f"the BlockMask's {name.replace('indices', 'num_blocks')} has counts "
                         f"outside [0, {m}]")
  valid = np.arange(m) < num[..., None]
  bad = valid & ((idx < 0) | (idx >= n_other))
  if bad.any():
    bi, hi, i, s = (int(v[0]) for v in np.nonzero(bad))
    raise MaskValueError(f"the BlockMask's {name}[{bi}, {hi}, {i}, {s}] is "
                         f"{int(idx[bi, hi, i, s])}, outside the {n_other} blocks of a line")
  lines = np.broadcast_to(np.arange(b * h * n_lines).reshape(b, h, n_lines, 1), idx.shape)
  flat = (lines[valid].astype(np.int64) * n_other + idx[valid])
  count = np.bincount(flat, minlength=b * h * n_lines * n_other).reshape(b, h, n_lines, n_other)
  if transposed:
    count = count.transpose(0, 1, 3, 2)
  for bi, hi, i, j in zip(*np.nonzero(count > 1)):
    problems.append((bi, hi, i, j, f"block ({i}, {j}) is listed {int(count[bi, hi, i, j])} times "
                     f"in {name}"))
  grid: np.ndarray = count > 0
  return grid


class ListsSide:
  """One head of a BlockMask as a prover side: its lists decide full and left-out tiles,
  its `mask_mod` the partial ones (evaluated only where the prover asks)."""

  def __init__(self, grid: np.ndarray, mask_mod: Callable[..., Any], head: int, list_head: int,
               batch: int | None, bq: int, bk: int) -> None:
    self.grid = grid[:, list_head]  # [B_lists, nq, nk]
    self.mask_mod, self.head, self.bq, self.bk = mask_mod, head, bq, bk
    self.batch = batch if batch is not None else (
        self.grid.shape[0] if self.grid.shape[0] > 1 else None)
    self.runs = tuple(runs_from_grid(np, self.grid)[:3])

  def _tiles(self, b: Any, rows: Any, cols: Any) -> np.ndarray:
    lb = b if self.grid.shape[0] > 1 else 0 * np.asarray(b)
    return self.grid[lb, np.asarray(rows) // self.bq, np.asarray(cols) // self.bk]

  def states(self, b: np.ndarray | int, r0: np.ndarray, r1: np.ndarray, c0: np.ndarray,
             c1: np.ndarray) -> np.ndarray:
    return self._tiles(b, r0, c0).astype(np.int8)

  def values(self, b: np.ndarray | int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    b, rows, cols = np.broadcast_arrays(np.asarray(b), rows, cols)
    state = self._tiles(b, rows, cols)
    out = state == FULL
    ask = state == PARTIAL
    if ask.any():
      out[ask] = evaluate_mask_mod(self.mask_mod, b[ask], self.head, rows[ask], cols[ask])
    return out
