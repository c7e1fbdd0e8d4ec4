"""maskc masks in PyTorch FlexAttention: `mask_mod`, `block_mask` and `flex_attention`.

Needs PyTorch (`pip install -e ".[torch]"`; without it, `import maskc.torch` raises a
`maskc.MissingExtraError`). This package reads maskc's public API and its
compiled contract (`BlockMap` and its compiled predicates) only; `import maskc` never
imports it, nor torch.

Alignment: FlexAttention's `mask_mod` counts query rows from 0 (top-left); maskc's query
position of row `i` is `q_offset + i`, where maskc's default `q_offset` is
`kv_len - q_len` (bottom-right, as in decoding with a KV cache). The two agree when
`q_len == kv_len`. `mask_mod` defaults to FlexAttention's alignment (`q_offset=0`);
`block_mask` and `flex_attention` to maskc's (`q_offset=None`).

>>> import torch
>>> import maskc.torch
>>> q = k = v = torch.randn(1, 2, 256, 16)
>>> maskc.torch.flex_attention(q, k, v, "causal & sliding(64)").shape
torch.Size([1, 2, 256, 16])
"""

import maskc

try:
  import torch  # noqa: F401  (only to say which extra is missing)
except ModuleNotFoundError as e:
  if e.name != "torch":
    raise
  raise maskc.MissingExtraError(
      "maskc.torch needs PyTorch, which is not installed", extra="torch",
      hint="A CPU-only build is enough: `pip install torch --index-url "
           "https://download.pytorch.org/whl/cpu`.") from None

from maskc.torch._attention import flex_attention as flex_attention  # noqa: E402
from maskc.torch._block_mask import block_mask as block_mask  # noqa: E402
from maskc.torch._mask_mod import mask_mod as mask_mod  # noqa: E402

__all__ = ["mask_mod", "block_mask", "flex_attention"]
