"""Which platform JAX runs on: what `auto` dispatch and the Pallas backends' defaults follow."""

from __future__ import annotations

import jax


def platform() -> str:
  """`"tpu"`, `"gpu"` or `"cpu"`: where jax runs by default."""
  p = jax.default_backend()
  return "gpu" if p in ("gpu", "cuda", "rocm") else p
