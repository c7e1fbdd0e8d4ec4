"""maskc in Flax NNX models: `maskc.flax.Attention`, an attention module with a maskc mask.

Needs Flax (`pip install -e ".[flax]"`); without it, `import maskc.flax` raises a
`maskc.MissingExtraError` (an `ImportError`) that says so. This package imports Flax and maskc's
public API only; `import maskc` never imports it.

>>> from flax import nnx
>>> from maskc.flax import Attention
>>> Attention(2, 16, mask="causal & chunk(8)", rngs=nnx.Rngs(0)).window
8
"""

import maskc

try:
  import flax  # noqa: F401  (only to say which extra is missing)
except ModuleNotFoundError as e:
  if e.name != "flax":
    raise
  raise maskc.MissingExtraError("maskc.flax needs Flax, which is not installed",
                                extra="flax") from None

from maskc.flax._attention import Attention as Attention  # noqa: E402  (after the check)

__all__ = ["Attention"]
