"""Splash attention: JAX's kernel and tokamax's (MaxText's), fed maskc's own `MaskInfo`.

The one place a compiled `BlockMap` becomes a splash format, and a bound mask a splash
mask. The compiler knows none of them (`import maskc` loads no Pallas):

- `mask_info(bm, ...)`: `(fwd, dq, dkv, mask_function)`, JAX splash `MaskInfo`s for JAX's
  `SplashAttentionKernel` (`jax_info`).
- `tokamax_mask_info(bm, ...)`: `(fwd, dkv, mask_function)` in tokamax's compacted layout
  (`CompactMaskInfo`), for tokamax's `SplashAttentionKernel` (`tokamax_info`).
- `as_splash_mask(cm)`: a bound mask (`maskc.ComputableMask`) as JAX splash's own `Mask`,
  for splash's `process_mask` and `make_splash_mha` (`masks`).
- `as_tokamax_mask(cm)`: the same as a tokamax splash `Mask` (needs tokamax).

The backends: `jax_kernel` (`backend="splash_jax"`) and `tokamax_kernel`
(`backend="splash_tokamax"`, and `"splash"` where tokamax imports), each with `run`,
`run_with_lse` and `make_kernel` (splash's kernel object, for a mesh).

>>> import maskc
>>> from maskc.kernels import splash
>>> fwd, dq, dkv, fn = splash.mask_info(maskc.compile("causal", 256, block_q=128, block_kv=128))
>>> fwd.block_mask[0].tolist()
[[1, 0], [2, 1]]
"""

from __future__ import annotations

from typing import Any

from maskc.kernels.splash.jax_info import MaskFunction as MaskFunction, mask_info as mask_info
from maskc.kernels.splash.masks import as_splash_mask as as_splash_mask
from maskc.kernels.splash.tokamax_info import (
  CompactMaskInfo as CompactMaskInfo,
  tokamax_mask_info as tokamax_mask_info,
)
from maskc.language.errors import BackendError, install_command


def as_tokamax_mask(cm: Any) -> Any:
  """A bound mask as a tokamax splash `Mask` (`maskc.kernels.splash.tokamax_kernel.as_tokamax`).

  tokamax is optional (Python >= 3.12): it is imported here, on the first call.

  Raises:
    BackendError: tokamax does not import here.
    MaskValueError: `cm` is no bound mask, or has a batch axis (tokamax's masks are 2-D).
  """
  try:
    from maskc.kernels.splash import tokamax_kernel
  except ImportError as e:
    if (e.name or "").split(".")[0] != "tokamax":
      raise
    raise BackendError(f"as_tokamax_mask needs tokamax, which does not import here: {e}",
                       hint=f"Install it (`{install_command('tokamax')}`: Python >= 3.12, "
                            "jax >= 0.11.1), or hand splash the mask: `as_splash_mask(cm)`."
                       ) from e
  return tokamax_kernel.as_tokamax(cm)


__all__ = ["mask_info", "tokamax_mask_info", "as_splash_mask", "as_tokamax_mask",
           "MaskFunction", "CompactMaskInfo"]
