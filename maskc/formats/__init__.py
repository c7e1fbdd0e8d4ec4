"""Other kernels' formats and other mask objects, read from maskc's compiled facts.

- `bsr(bm)`: FlashInfer's block-sparse row format (`indptr`, `indices`, block shape, and
  the partial blocks' masks) of a compiled map;
- `cu_seqlens(mask, q_len, operands=...)`: the `cu_seqlens` of varlen kernels, for packed
  documents (optionally causal);
- `flashmask(mask, q_len, operands=...)`: PaddlePaddle FlashMask's column-wise
  `startend_row_indices` and its causal flag;
- `from_splash(mask)`: JAX's and tokamax's splash mask objects as maskc masks.

Each format is exact, or raises a `maskc.MaskError` saying why the mask does not fit.
Nothing here imports torch, Paddle, FlashInfer or Pallas at `import maskc`.
"""

from maskc.formats.block_sparse_rows import BSR as BSR, bsr as bsr
from maskc.formats.flashmask_columns import FlashMask as FlashMask, flashmask as flashmask
from maskc.formats.splash import SplashImport as SplashImport, from_splash as from_splash
from maskc.formats.varlen import Varlen as Varlen, cu_seqlens as cu_seqlens

__all__ = ["BSR", "FlashMask", "SplashImport", "Varlen", "bsr", "cu_seqlens", "flashmask",
           "from_splash"]
