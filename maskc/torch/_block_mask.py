"""`block_mask`: a FlexAttention `BlockMask` written from maskc's compiled map.

The map's runs of tiles become FlexAttention's four pairs of lists (`kv_*` and `full_kv_*`
per q tile for the forward pass, `q_*` and `full_q_*` per key tile for the backward), in
the layout `create_block_mask` writes (`maskc.torch._lists`), without evaluating the mask
at any position. The `mask_mod` attached evaluates the same compiled predicates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

import maskc
from maskc.compiled.blockmap import BlockMap
from maskc.compiled.tiles import FULL, PARTIAL, Runs
from maskc.torch import _lists
from maskc.torch._common import MaskArg, masks_of, numpy_operands
from maskc.torch._mask_mod import MaskMod, from_block_map as _mask_mod_of


def block_mask(mask: MaskArg, q_len: int, kv_len: int | None = None, *,
               operands: Mapping[str, Any] | None = None,
               block_size: int | tuple[int, int] = 128, device: torch.device | str = "cpu",
               q_offset: int | None = None, exact: bool = False, **params: Any) -> BlockMask:
  """A FlexAttention `BlockMask` built from maskc's compiled map, with its `mask_mod` attached.

  The block lists come from `maskc.compile`'s tiles, never from evaluating the dense mask:
  milliseconds at 128K tokens where `create_block_mask` evaluates `q_len × kv_len` pairs.
  They are always sound (a block left out holds no allowed pair; a block listed as full
  holds only allowed pairs), and equal to `create_block_mask`'s wherever maskc's tiles are
  exact: masks of prelude masks combined with `& | ^ ~` and static operands, and every
  mask with `exact=True`. Lengths need not be whole blocks: as in `create_block_mask`, a
  block that reaches past `q_len` or `kv_len` is never listed as full.

  Alignment: row `i` is maskc's query position `q_offset + i`. `q_offset=None` is maskc's
  default, `kv_len - q_len` (bottom-right); FlexAttention's own `mask_mod`s count rows
  from 0 (top-left), which is `q_offset=0`. They agree when `q_len == kv_len`.

  Args:
    mask: a Mask, mask text, or a list of them (one per head).
    q_len: query rows. kv_len: key columns (default `q_len`).
    operands: operand values by name (NumPy, jax or torch arrays, or ints). A batch axis
      on an operand gives the BlockMask a batch dimension of that size; a list of masks
      gives it one head per mask. Both are 1 otherwise (FlexAttention broadcasts them).
    block_size: FlexAttention's block size, an int or `(q_block, kv_block)`.
    device: where the BlockMask's tensors (and the mask_mod's operands) live.
    q_offset: the query position of row 0 (see Alignment).
    exact: refine the tiles of any mask by evaluation (see `maskc.compile`).
    **params: values of parameters named in mask text (`chunk(C)` with `C=8192`).

  Returns:
    A `torch.nn.attention.flex_attention.BlockMask` of shape `[B, H, q_len, kv_len]`.

  Raises:
    MaskError: bad mask text, shapes, block sizes or operands.

  >>> import maskc.torch
  >>> bm = maskc.torch.block_mask("causal", 512, block_size=128)
  >>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()
  ([[[1, 1, 1, 1]]], [[[0, 1, 2, 3]]])
  """
  masks, multi = masks_of(mask, params)
  bq, bk = _block_sizes(block_size)
  bm = maskc.compile(masks if multi else masks[0], q_len, kv_len, block_q=bq, block_kv=bk,
                     q_offset=q_offset, operands=numpy_operands(operands), exact=exact)
  return from_block_map(bm, device=device)


def from_block_map(bm: BlockMap, *, device: torch.device | str,
                   mask_mod: MaskMod | None = None) -> BlockMask:
  """The `BlockMask` of a static map (tile sizes as FlexAttention's block size)."""
  if not bm.is_static:
    raise maskc.MaskTypeError("a BlockMask is built from a static map, got a traced one",
                              hint="Compile with NumPy operands, outside jax.jit.")
  if bm.q_positions is not None or bm.kv_positions is not None:
    raise maskc.MaskValueError("a BlockMask has no explicit positions; this map has them",
                               hint="Compile without q_positions / kv_positions.")
  device = torch.device(device)
  nq, nk = bm.n_q_tiles, bm.n_kv_tiles
  q_ragged, kv_ragged = bm.q_len % bm.block_q != 0, bm.kv_len % bm.block_kv != 0
  fields = {}
  for axis, runs, n_lines, n_other, line_ragged, other_ragged in (
      ("kv", bm.rows, nq, nk, q_ragged, kv_ragged), ("q", bm.cols, nk, nq, kv_ragged, q_ragged)):
    lists = _lists_of(runs, n_lines, n_other, line_ragged, other_ragged)
    for prefix, (num, idx) in zip(("", "full_"), lists):
      fields[f"{prefix}{axis}_num_blocks"] = _tensor(bm, num, device)
      fields[f"{prefix}{axis}_indices"] = _tensor(bm, idx, device)
  return BlockMask(seq_lengths=(bm.q_len, bm.kv_len), BLOCK_SIZE=(bm.block_q, bm.block_kv),
                   mask_mod=mask_mod or _mask_mod_of(bm, device=device), **fields)


def _lists_of(runs: Runs, n_lines: int, n_other: int, line_ragged: bool,
              other_ragged: bool) -> list[tuple[np.ndarray, np.ndarray]]:
  """`[(num, indices) of PARTIAL tiles, (num, indices) of FULL tiles]`, `[B', U, n_lines, ...]`."""
  lead = np.shape(runs.count)[:-1]
  line, a, z, st = _lists.flat_runs(runs, n_other, last_line_ragged=line_ragged,
                                    last_other_ragged=other_ragged)
  out = []
  for state in (PARTIAL, FULL):
    sel = st == state
    num, idx = _lists.ordered_lists(line[sel], a[sel], z[sel], int(np.prod(lead)) * n_lines,
                                    n_other)
    out.append((num.reshape(lead + (n_lines,)), idx.reshape(lead + (n_lines, n_other))))
  return out


def _tensor(bm: BlockMap, arr: np.ndarray, device: torch.device) -> torch.Tensor:
  """`[B', U, ...]` lists as FlexAttention's `[B, H, ...]` tensor."""
  heads = list(bm.head_index) if bm.head_index is not None else [0]
  arr = arr[:, heads] if heads != list(range(arr.shape[1])) else arr
  t = torch.from_numpy(np.ascontiguousarray(arr)).to(device)
  batch = bm.batch or 1
  return t if t.shape[0] == batch else t.expand((batch,) + tuple(t.shape[1:])).contiguous()


def _block_sizes(block_size: int | tuple[int, int]) -> tuple[int, int]:
  if isinstance(block_size, (int, np.integer)) and not isinstance(block_size, bool):
    return int(block_size), int(block_size)
  if isinstance(block_size, tuple) and len(block_size) == 2:
    return int(block_size[0]), int(block_size[1])
  raise maskc.MaskTypeError(f"block_size must be an int or a (q_block, kv_block) pair, got "
                            f"{block_size!r}", hint="e.g. block_size=128 or (128, 64).")
