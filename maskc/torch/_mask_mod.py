"""`mask_mod`: a maskc mask as a FlexAttention `mask_mod(b, h, q_idx, kv_idx)`.

The function evaluates the map's compiled predicates (`maskc.compiled.predicate`) with torch
ops: the program is the one every maskc kernel runs, `run` is its one evaluator, and this
module supplies a torch namespace for it and a `fetch` that reads the operands, so nothing
here knows the mask language. Reads index torch tensors made once from the map's operand
arrays (run ids included), clamped to their length as `gather` clamps them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

import maskc
from maskc.compiled.blockmap import BlockMap
from maskc.compiled.predicate import Predicate, Program, run
from maskc.torch._common import MaskArg, masks_of, numpy_operands

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_INT32 = (-(1 << 31), (1 << 31) - 1)


def mask_mod(mask: MaskArg, *, operands: Mapping[str, Any] | None = None, q_offset: int = 0,
             q_len: int | None = None, kv_len: int | None = None,
             device: torch.device | str | None = None, **params: Any) -> MaskMod:
  """A FlexAttention `mask_mod(b, h, q_idx, kv_idx)` that evaluates a maskc mask with torch ops.

  FlexAttention counts query rows from 0 (top-left alignment); maskc's query position is
  `q = q_idx + q_offset`, and `q_offset` defaults to 0 here, which is FlexAttention's
  alignment. (maskc's own default elsewhere, in `maskc.compile` and `block_mask`, is
  bottom-right: `q_offset = kv_len - q_len`. Pass that here to get maskc's alignment when
  `q_len != kv_len`.) Key `kv_idx` is key position `k`.

  The function works where FlexAttention calls it: under `torch.vmap` (as `create_mask`
  and `create_block_mask` call it), in eager `flex_attention`, and under `torch.compile`.
  It computes in int32 where every term of the mask fits it at the bound shape, else in
  int64.

  Args:
    mask: a Mask, mask text, or a list of them (one per head, indexed by `h`).
    operands: operand values by name: NumPy, jax or torch arrays, or ints. Per-token
      operands `[L]` or `[B, L]` (a `[B, L]` operand is indexed by `b`), scalars `[]` or
      `[B]`, pairwise `[Lq, Lk]` or `[B, Lq, Lk]`.
    q_offset: the query position of row 0.
    q_len, kv_len: the shape the operands are checked against (default: `kv_len` the
      longest per-token operand, or 1; `q_len` that minus `q_offset`, at least 1). Reads
      beyond an operand are clamped to it, as in maskc's kernels.
    device: where the operand tensors live (default: the device of the first torch
      operand, else the CPU).
    **params: values of parameters named in mask text (`chunk(C)` with `C=8192`).

  Returns:
    `mask_mod(b, h, q_idx, kv_idx) -> bool tensor`.

  Raises:
    MaskError: bad mask text, missing or misshapen operands.

  >>> import torch
  >>> import maskc.torch
  >>> from torch.nn.attention.flex_attention import create_mask
  >>> mm = maskc.torch.mask_mod("sliding(2)")
  >>> create_mask(mm, 1, 1, 3, 3, device="cpu")[0, 0].int().tolist()
  [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
  """
  masks, multi = masks_of(mask, params)
  if device is None:
    device = next((v.device for v in (operands or {}).values() if isinstance(v, torch.Tensor)),
                  torch.device("cpu"))
  ops = numpy_operands(operands)
  if kv_len is None:
    lengths = [np.shape(ops[s.name])[-1] for m in masks for s in m.operands
               if s.kind == "token" and s.name in ops and np.ndim(ops[s.name]) > 0]
    kv_len = max([1] + lengths)
  if q_len is None:
    q_len = max(1, kv_len - q_offset)
  bm = maskc.compile(masks if multi else masks[0], q_len, kv_len, q_offset=q_offset,
                     operands=ops)
  return from_block_map(bm, device=device)


def from_block_map(bm: BlockMap, *, device: torch.device | str) -> MaskMod:
  """The `mask_mod` of a static map's predicates and operands, at its `q_offset`."""
  lo, hi = bm.int_range if bm.int_range is not None else (_INT32[0] - 1, 0)
  dtype = torch.int32 if _INT32[0] <= lo and hi <= _INT32[1] else torch.int64
  device = torch.device(device)
  names = sorted(bm.operands)
  tensors = {n: torch.as_tensor(np.asarray(bm.operands[n]), device=device).to(dtype)
             for n in names}
  # a batch axis of size 1 is read at 0: keep the row alone, so no read indexes with `b`
  arrays = {n: (t[0], False) if t.shape[0] == 1 else (t, True) for n, t in tensors.items()}
  preds = bm.predicates
  heads = None if bm.head_index is None or len(preds) == 1 else \
      torch.as_tensor(bm.head_index, dtype=torch.int64, device=device)
  offset = int(bm.q_offset)
  ops = _TorchOps(dtype, device)
  texts = [p.text for p in preds]

  def maskc_mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                     kv_idx: torch.Tensor) -> torch.Tensor:
    q = q_idx.to(dtype) + offset
    k = kv_idx.to(dtype)
    bb = b.to(dtype)
    values = [ops.as_bool(run(p.program, ops, q, k, _fetch(p, arrays, ops, bb, q, k)))
              for p in preds]
    out = values[0]
    if heads is not None:  # each head picks its distinct mask
      u = heads[h]
      for i in range(1, len(values)):
        out = torch.where(u == i, values[i], out)
    return out

  maskc_mask_mod.__doc__ = f"maskc mask_mod: {' ; '.join(texts)} (q = q_idx + {offset})"
  maskc_mask_mod.__qualname__ = maskc_mask_mod.__name__ = "maskc_mask_mod"
  return maskc_mask_mod


def _fetch(pred: Predicate, arrays: Mapping[str, tuple[torch.Tensor, bool]], ops: _TorchOps,
           b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Callable[[str, int], Any]:
  """`fetch(kind, slot)` for `run`: the value of a read at `b`, `q`, `k`."""
  def scalar(slot: int) -> Any:
    t, batched = arrays[pred.scalars[slot]]
    return t[b] if batched else t.reshape(())

  def index(program: Program, pos: Any) -> Any:
    return run(program, ops, pos, None, lambda kind, slot: scalar(slot))

  def fetch(kind: str, slot: int) -> Any:
    if kind == "scalar":
      return scalar(slot)
    if kind in ("q_read", "k_read"):
      r = (pred.q_reads if kind == "q_read" else pred.k_reads)[slot]
      pos = q if kind == "q_read" else k
      if not r.array:  # the position itself
        return index(r.index, pos)
      t, batched = arrays[r.array]
      i = ops.clamp(index(r.index, pos), t.shape[-1])
      return t[b, i] if batched else t[i]
    # a pairwise read; one read per tile (`tile_pair`) is the same read at any of its positions
    pr = (pred.pairs if kind == "pair" else pred.tile_pairs)[slot]
    t, batched = arrays[pr.array]
    qi = ops.clamp(index(pr.q_index, q), t.shape[-2])
    ki = ops.clamp(index(pr.k_index, k), t.shape[-1])
    return t[b, qi, ki] if batched else t[qi, ki]

  return fetch


class _TorchOps:
  """The array functions `maskc.compiled.predicate.run` calls, for torch tensors and ints."""

  def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
    self.dtype, self.device = dtype, device

  def t(self, x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
      return x
    dtype = torch.bool if isinstance(x, (bool, np.bool_)) else self.dtype
    return torch.tensor(x, dtype=dtype, device=self.device)

  def as_bool(self, x: Any) -> torch.Tensor:
    """The program's result as a bool tensor (a constant mask gives a 0-d one, which
    `torch.vmap` and broadcasting expand)."""
    return self.t(x).to(torch.bool)

  def clamp(self, i: Any, n: int) -> Any:
    return min(max(i, 0), n - 1) if isinstance(i, int) else torch.clamp(i, 0, n - 1)

  def asarray(self, x: Any, dtype: Any = None) -> torch.Tensor:
    return self.t(x)

  def floor_divide(self, a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int):
      return a // b
    return torch.div(self.t(a), b if isinstance(b, int) else self.t(b), rounding_mode="floor")

  def remainder(self, a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int):
      return a % b
    return torch.remainder(self.t(a), b if isinstance(b, int) else self.t(b))

  def abs(self, a: Any) -> Any:
    return abs(a) if isinstance(a, int) else torch.abs(a)

  def minimum(self, a: Any, b: Any) -> Any:
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else \
        torch.minimum(self.t(a), self.t(b))

  def maximum(self, a: Any, b: Any) -> Any:
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else \
        torch.maximum(self.t(a), self.t(b))

  def less(self, a: Any, b: Any) -> torch.Tensor:
    return torch.lt(self.t(a), self.t(b))

  def less_equal(self, a: Any, b: Any) -> torch.Tensor:
    return torch.le(self.t(a), self.t(b))

  def equal(self, a: Any, b: Any) -> torch.Tensor:
    return torch.eq(self.t(a), self.t(b))

  def not_equal(self, a: Any, b: Any) -> torch.Tensor:
    return torch.ne(self.t(a), self.t(b))

  def greater_equal(self, a: Any, b: Any) -> torch.Tensor:
    return torch.ge(self.t(a), self.t(b))

  def greater(self, a: Any, b: Any) -> torch.Tensor:
    return torch.gt(self.t(a), self.t(b))

  def logical_and(self, a: Any, b: Any) -> torch.Tensor:
    return torch.logical_and(self.t(a), self.t(b))

  def logical_or(self, a: Any, b: Any) -> torch.Tensor:
    return torch.logical_or(self.t(a), self.t(b))

  def logical_xor(self, a: Any, b: Any) -> torch.Tensor:
    return torch.logical_xor(self.t(a), self.t(b))

  def logical_not(self, a: Any) -> torch.Tensor:
    return torch.logical_not(self.t(a))
