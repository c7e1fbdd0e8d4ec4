"""FlashInfer's block-sparse row (BSR) format: `bsr(bm)`.

FlashInfer's `BlockSparseAttentionWrapper.plan(indptr, indices, M, N, R, C, ..., mask=...)`
takes the block-sparse matrix of SciPy's `bsr_matrix`: the non-empty `R × C` blocks of
block row `i` are `indices[indptr[i]:indptr[i + 1]]`, and, when not every block is full,
`mask[n]` is block `n`'s own `R × C` boolean mask. A compiled map is that matrix: its
non-EMPTY tiles are the blocks, its PARTIAL tiles the ones that need a mask.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from maskc.compiled.blockmap import BlockMap
from maskc.compiled.tiles import FULL, PARTIAL
from maskc.formats._tiles import require_static, tile_evaluator
from maskc.language.errors import MaskLimitError, MaskValueError

# The most elements the blocks' masks may hold (1 GiB of bool): FlashInfer's `mask` has one
# R x C array per non-empty block, full ones included, so it grows with the blocks' count.
MAX_MASK_ELEMENTS = 1 << 30


@dataclasses.dataclass(frozen=True)
class BSR:
  """One mask in FlashInfer's block-sparse row format.

  Attributes:
    indptr: int32 `[MB + 1]`: block row `i`'s blocks are `indices[indptr[i]:indptr[i + 1]]`
      (`MB = ceil(M / R)`).
    indices: int32 `[nnz]`: the block column of each non-empty block, ascending per row.
    shape: `(M, N)`: query rows and key columns.
    block: `(R, C)`: rows and columns of a block.
    mask: bool `[nnz, R, C]`, block `n`'s own mask (rows past `M` False), or None when
      every listed block is full. FlashInfer's `plan(..., mask=mask)` takes it as is.

  The dense mask back from the fields:

      dense = zeros((MB * R, N), bool)
      for i in range(MB):
        for n in range(indptr[i], indptr[i + 1]):
          j = indices[n]
          dense[i * R:(i + 1) * R, j * C:(j + 1) * C] = True if mask is None else mask[n]
      dense = dense[:M]
  """
  indptr: np.ndarray
  indices: np.ndarray
  shape: tuple[int, int]
  block: tuple[int, int]
  mask: np.ndarray | None

  @property
  def nnz(self) -> int:
    """The number of non-empty blocks."""
    return int(self.indices.size)

  def plan_args(self) -> tuple[np.ndarray, np.ndarray, int, int, int, int]:
    """`(indptr, indices, M, N, R, C)`, FlashInfer `plan`'s first six arguments."""
    return (self.indptr, self.indices, *self.shape, *self.block)


def _pick(bm: BlockMap, batch: int | None, head: int | None) -> tuple[int, int]:
  """The batch row and distinct mask a single-mask format reads."""
  if bm.batch is not None and batch is None:
    raise MaskValueError(f"this map has a batch of {bm.batch}; FlashInfer's BSR holds one mask",
                         hint="Pass batch=i for batch row i.")
  if bm.heads is not None and head is None:
    if len(set(bm.head_index or ())) > 1:
      raise MaskValueError(f"this map has {bm.heads} heads with different masks; FlashInfer's "
                           f"BSR gives every head the same blocks",
                           hint="Pass head=h for head h, and plan one wrapper per head.")
    head = 0
  b = 0 if batch is None else int(batch)
  if not 0 <= b < (bm.batch or 1):
    raise MaskValueError(f"batch={batch} is out of range for a batch of {bm.batch or 1}")
  u = 0
  if head is not None:
    if bm.head_index is None or not 0 <= head < len(bm.head_index):
      raise MaskValueError(f"head={head} is out of range for a map with {bm.heads or 0} heads")
    u = bm.head_index[head]
  return b, u


def bsr(bm: BlockMap, *, batch: int | None = None, head: int | None = None,
        with_mask: bool | None = None) -> BSR:
  """The map's non-empty tiles as FlashInfer's block-sparse row (BSR) matrix.

  Args:
    bm: a compiled map (`maskc.compile`), static operands. Its tiles are the blocks:
      `R, C = bm.block_q, bm.block_kv`.
    batch, head: which batch row / head, for a map that has them.
    with_mask: give the blocks' own masks (`mask`, FlashInfer's `plan(mask=...)`). None:
      when some tile is PARTIAL. False refuses a map with PARTIAL tiles.

  Returns:
    A `BSR`; exact: its blocks and their masks are the mask, position by position.

  Raises:
    MaskValueError: `kv_len` not a multiple of `block_kv` (FlashInfer needs `N % C == 0`),
      PARTIAL tiles with `with_mask=False`, a batch or heads not picked, traced operands.
    MaskLimitError: the blocks' masks would hold more than `MAX_MASK_ELEMENTS`.

  >>> import maskc
  >>> m = maskc.formats.bsr(maskc.compile("causal", 6, block_q=2, block_kv=2))
  >>> m.indptr.tolist(), m.indices.tolist(), m.mask.shape
  ([0, 1, 3, 6], [0, 0, 1, 0, 1, 2], (6, 2, 2))
  """
  require_static(bm, "bsr")
  r, c = bm.block_q, bm.block_kv
  if bm.kv_len % c:
    raise MaskValueError(f"kv_len={bm.kv_len} is not a multiple of block_kv={c}; FlashInfer's "
                         f"block-sparse attention needs N % C == 0",
                         hint=f"Compile with a block_kv that divides {bm.kv_len}, or pad the keys "
                              f"to a multiple of {c} (the padding masked out by the mask).")
  b, u = _pick(bm, batch, head)
  runs = bm.rows
  bb = min(b, runs.count.shape[0] - 1)
  start, stop = np.asarray(runs.start[bb, u]), np.asarray(runs.stop[bb, u])
  state, count = np.asarray(runs.state[bb, u]), np.asarray(runs.count[bb, u])
  cols, states, counts = [], [], []
  for i in range(bm.n_q_tiles):
    n = 0
    for k in range(int(count[i])):
      s, e = int(start[i, k]), int(stop[i, k])
      cols.append(np.arange(s, e))
      states.append(np.full(e - s, state[i, k]))
      n += e - s
    counts.append(n)
  indices = (np.concatenate(cols) if cols else np.zeros(0)).astype(np.int32)
  st = np.concatenate(states) if states else np.zeros(0, np.int8)
  indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
  partial = bool((st == PARTIAL).any())
  if with_mask is False and partial:
    raise MaskValueError(f"{int((st == PARTIAL).sum())} blocks are PARTIAL; a BSR without a "
                         f"mask would allow all of their positions",
                         hint="Pass with_mask=True (FlashInfer's plan(mask=...)), or compile with "
                              "tiles the mask fills or leaves empty.")
  mask = None
  if with_mask or (with_mask is None and partial):
    if indices.size * r * c > MAX_MASK_ELEMENTS:
      raise MaskLimitError(
          f"the blocks' masks would hold {indices.size} x {r} x {c} elements, over "
          f"{MAX_MASK_ELEMENTS}", hint="FlashInfer's mask holds every non-empty block densely: "
          "for causal masks pass its causal=True flag instead (with_mask=False on a map of "
          "FULL tiles), or use larger tiles on a sparser mask.")
    mask = np.zeros((indices.size, r, c), bool)
    rows = np.repeat(np.arange(bm.n_q_tiles), counts)
    tile = tile_evaluator(bm, u, b)
    for n in range(indices.size):
      i, j = int(rows[n]), int(indices[n])
      h = min(r, bm.q_len - i * r)
      mask[n, :h] = True if st[n] == FULL else tile(i, j)
  return BSR(indptr=indptr, indices=indices, shape=(bm.q_len, bm.kv_len), block=(r, c),
             mask=mask)
