"""maskc in Flax NNX models: `maskc.flax.Attention`, an attention module with a maskc mask.

Needs Flax (`pip install "maskc[flax]"`). This package imports Flax and maskc's public
API only; `import maskc` never imports it.

>>> from flax import nnx
>>> from maskc.flax import Attention
>>> Attention(2, 16, mask="causal & chunk(8)", rngs=nnx.Rngs(0)).window
8
"""

from maskc.flax._attention import Attention as Attention

__all__ = ["Attention"]
