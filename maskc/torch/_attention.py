"""`flex_attention`: torch's FlexAttention with a maskc mask, its BlockMask built and cached."""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.nn.attention import flex_attention as _flex
from torch.nn.attention.flex_attention import BlockMask

import maskc
from maskc.torch._block_mask import block_mask
from maskc.torch._common import MaskArg

# BlockMasks by (mask, params, shape, block size, device, offset, exactness, operands); each
# entry keeps its operands alive, so an operand's id() is not reused while it is cached
_CACHE: collections.OrderedDict[Any, tuple[BlockMask, tuple[Any, ...]]] = \
    collections.OrderedDict()
CACHE_SIZE = 16


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: MaskArg,
                   *, operands: Mapping[str, Any] | None = None,
                   block_size: int | tuple[int, int] = 128, scale: float | None = None,
                   enable_gqa: bool = False, q_offset: int | None = None, exact: bool = False,
                   **params: Any) -> torch.Tensor:
  """Torch's `flex_attention` with a maskc mask: `[B, H, L, D]` in, `[B, H, Lq, D]` out.

  Builds the mask's `BlockMask` with `block_mask` (at `q_len = query.shape[-2]`,
  `kv_len = key.shape[-2]`, on the query's device) and calls
  `torch.nn.attention.flex_attention.flex_attention`. BlockMasks are cached by mask,
  parameters, shapes, block size, device, offset and operands: torch operands by identity
  and in-place version, jax operands by identity (they are immutable), NumPy operands and
  ints by value. Wrap this function in `torch.compile` for fused kernels, as for torch's.

  Args:
    query: `[B, H, Lq, D]`. key, value: `[B, Hkv, Lkv, D]` (`Hkv` divides `H` with
      `enable_gqa=True`).
    mask: a Mask, mask text, or a list of them (one per query head).
    operands: operand values by name; a batch axis must be `B`.
    block_size: FlexAttention's block size, an int or `(q_block, kv_block)`.
    scale: the softmax scale (default `1 / sqrt(D)`).
    enable_gqa: grouped-query attention, as in torch's `flex_attention`.
    q_offset: the query position of row 0 (default `kv_len - q_len`, maskc's bottom-right
      alignment; 0 is FlexAttention's top-left).
    exact: refine the tiles of any mask by evaluation (see `maskc.compile`).
    **params: values of parameters named in mask text.

  Returns:
    The attention output, `[B, H, Lq, D]`.

  Raises:
    MaskError: bad mask, operands or shapes (a per-head list whose length is not `H`, an
      operand batch that is not `B`).

  >>> import torch
  >>> import maskc.torch
  >>> q = k = v = torch.randn(2, 4, 128, 16)
  >>> seg = torch.tensor([0] * 100 + [1] * 28).repeat(2, 1)
  >>> out = maskc.torch.flex_attention(q, k, v, "causal & document(seg)",
  ...                                  operands={"seg": seg}, block_size=64)
  >>> out.shape
  torch.Size([2, 4, 128, 16])
  """
  if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
    raise maskc.MaskValueError(
        f"flex_attention takes [B, H, L, D] tensors, got query {tuple(query.shape)}, key "
        f"{tuple(key.shape)}, value {tuple(value.shape)}",
        hint="torch's layout is [B, H, L, D]; maskc.attention takes [B, L, H, D].")
  batch, heads, q_len = query.shape[0], query.shape[1], query.shape[2]
  kv_len = key.shape[2]
  bm = _cached(mask, q_len, kv_len, operands or {}, block_size, query.device, q_offset, exact,
               params)
  b_mask, h_mask = bm.kv_num_blocks.shape[:2]
  if h_mask not in (1, heads):
    raise maskc.MaskValueError(f"the mask has {h_mask} heads, the query {heads}",
                               hint="Pass one mask per query head, or a single mask.")
  if b_mask not in (1, batch):
    raise maskc.MaskValueError(f"the operands have a batch of {b_mask}, the query {batch}",
                               hint="Give batched operands the query's batch size.")
  out: torch.Tensor = _flex.flex_attention(query, key, value, block_mask=bm, scale=scale,
                                           enable_gqa=enable_gqa)
  return out


def _cached(mask: MaskArg, q_len: int, kv_len: int, operands: Mapping[str, Any],
            block_size: int | tuple[int, int], device: torch.device, q_offset: int | None,
            exact: bool, params: Mapping[str, Any]) -> BlockMask:
  mask_key = mask if isinstance(mask, (str, maskc.Mask)) else tuple(mask)
  key = (mask_key, tuple(sorted(params.items())), q_len, kv_len, block_size, str(device),
         q_offset, exact, tuple((n, _operand_key(v)) for n, v in sorted(operands.items())))
  hit = _CACHE.get(key)
  if hit is not None:
    _CACHE.move_to_end(key)
    return hit[0]
  bm = block_mask(mask, q_len, kv_len, operands=operands, block_size=block_size, device=device,
                  q_offset=q_offset, exact=exact, **params)
  _CACHE[key] = bm, tuple(operands.values())
  if len(_CACHE) > CACHE_SIZE:
    _CACHE.popitem(last=False)
  return bm


def _operand_key(v: Any) -> Any:
  """What identifies an operand's value: see `flex_attention`."""
  if isinstance(v, torch.Tensor):
    return ("torch", id(v), v._version)
  if isinstance(v, (int, np.integer)):
    return ("int", int(v))
  if isinstance(v, np.ndarray):
    a = np.ascontiguousarray(v)
    return ("numpy", a.shape, a.dtype.str, hashlib.blake2b(a.tobytes(), digest_size=16).digest())
  return ("object", id(v))
