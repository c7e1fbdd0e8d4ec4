"""maskc.kernels: attention backends that consume compiled masks.

`attention(q, k, v, mask, ...)` dispatches to a backend of `BACKENDS`: `dense`
(the reference), `xla` (block-sparse jax.numpy, any platform), `flash` (Pallas,
GPU), `cudnn` and `tokamax` (GPU engines for bands and key intervals), `mosaic_gpu`
(Pallas Mosaic GPU forward, sm90, not yet run on a GPU) and the splash kernels for
TPU: `splash_jax` (JAX's), `splash_tokamax` (tokamax's, MaxText's) and `splash`
(tokamax's where it imports, else JAX's).
Backends are imported on first use.
"""

from maskc.kernels.api import BACKENDS as BACKENDS, Backend as Backend, attention as attention
