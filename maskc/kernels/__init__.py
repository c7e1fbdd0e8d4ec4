"""maskc.kernels: attention backends that consume compiled masks.

`attention(q, k, v, mask, ...)` dispatches to a backend of `BACKENDS`: `dense`
(the reference), `xla` (block-sparse jax.numpy, any platform), `flash` (Pallas,
GPU), `cudnn` and `tokamax` (GPU engines for bands and key intervals), `mosaic_gpu`
(Pallas Mosaic GPU forward, sm90, not yet run on a GPU) and the splash kernels for
TPU: `splash_jax` (JAX's), `splash_tokamax` (tokamax's, MaxText's) and `splash`
(tokamax's where it imports, else JAX's).

Backends are imported on first use, and so are the subpackages, on first access:
`maskc.kernels.splash` (splash's formats from a BlockMap: `mask_info`,
`tokamax_mask_info`, `as_splash_mask`), `maskc.kernels.flash`,
`maskc.kernels.mosaic_gpu`.
"""

import importlib as _importlib
from types import ModuleType as _ModuleType

from maskc.kernels.api import BACKENDS as BACKENDS, Backend as Backend, attention as attention

_LAZY = frozenset({"splash", "flash", "mosaic_gpu", "dense", "xla", "cudnn", "tokamax",
                   "sharded", "common", "compat"})


def __getattr__(name: str) -> _ModuleType:
  """A subpackage or module of the kernels, imported on first access."""
  if name in _LAZY:
    return _importlib.import_module(f"maskc.kernels.{name}")
  raise AttributeError(f"module 'maskc.kernels' has no attribute {name!r}")
