"""Cross-lowering helpers shared by tests/test_cross_lowering.py and
tests/test_mosaic_gpu_lowering.py: a named H100 target, `lower_for`, call counters, operands.
"""

from __future__ import annotations

import contextlib
import re

import jax
import numpy as np
import pytest


def operands(length: int, seed: int = 0) -> dict:
  """Operand values for every mask of the matrix at `length` keys."""
  rng = np.random.default_rng(seed)
  seg = np.sort(rng.integers(0, 4, length)).astype(np.int32)
  img = np.zeros(length, bool)
  img[length // 5: length // 2] = True
  parent = [-1] + [int(rng.integers(0, i)) for i in range(1, length)]
  anc = np.eye(length, dtype=bool)
  for i in range(1, length):
    anc[i] |= anc[parent[i]]
  sel = rng.random((-(-length // 64), -(-length // 64))) < 0.5
  return {"seg": seg, "img": img, "anc": anc, "sel": sel}


# jax 0.12's Triton lowering asks the device for its GPU generation; with no GPU present
# the target is named by an abstract device (jax 0.10.2 accepts it too, and needs none).
CUDA_TARGET = jax.sharding.AbstractMesh(
    (1,), ("x",), (jax.sharding.AxisType.Auto,),
    abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3",
                                                num_cores=None, platform="gpu"))


def lower_for(platform: str, fn, *args) -> str:
  """The module text of `jit(fn)` lowered for `platform` ("cuda": for an H100) on this CPU."""
  target = (jax.sharding.use_abstract_mesh(CUDA_TARGET) if platform == "cuda"
            else contextlib.nullcontext())
  with target:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def count_triton(text: str) -> int:
  return text.count('"__gpu$xla.gpu.triton"') or text.count("xla.gpu.triton")


def count_mosaic_gpu(text: str) -> int:
  """Pallas Mosaic GPU kernels in a lowered module (`mosaic_gpu_v2` custom calls)."""
  return len(re.findall(r"custom_call @mosaic_gpu", text))


@pytest.fixture(scope="module")
def cuda_plugin():
  """Fails with the command to run unless JAX's CUDA plugin is installed (never in .venv)."""
  try:
    import jax_plugins.xla_cuda12  # noqa: F401
  except ImportError:
    pytest.fail("the cuda lowering tests need jax-cuda12-plugin and jax-cuda12-pjrt; run them "
                "with `make test-lowering`, which installs both in .venv-lowering")
