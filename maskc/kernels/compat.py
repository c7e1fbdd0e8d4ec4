"""What differs between the JAX versions maskc supports (0.10.2 through 0.12.x), in one place.

The kernels import version-dependent pieces from here, never test `jax.__version__`
themselves. Two backends of Pallas matter: Triton, which the flash kernel is written
for, and Mosaic GPU, which the `mosaic_gpu` kernel is written for (end of this module).

The Pallas Triton backend:

- jax 0.10 has it, silently.
- jax 0.11 and 0.12 deprecate it (deprecation id `jax-pallas-triton`): lowering a
  Triton kernel warns with a `DeprecationWarning`, and JAX can *accelerate* the
  deprecation, turning that warning into an error, before removing the backend.
- A later JAX may remove `jax.experimental.pallas.triton` altogether.

maskc handles each case on purpose (docs/kernels.md, "The Triton deprecation"):

- The warning is silenced once the flash backend is loaded (`quiet_triton_deprecation`):
  maskc knows about it and its replacement (the Mosaic GPU kernel) is planned. The
  warning names no kernel, so the filter silences it for every Triton kernel in the
  process; `warnings.filterwarnings("default", message=TRITON_DEPRECATION)` after
  loading brings it back.
- When the deprecation is accelerated or the backend is gone, `triton_unavailable()`
  says why, flash refuses to compile for a GPU with a `BackendError` naming `xla`,
  and `backend="auto"` falls back to xla. Interpret mode (any platform) keeps
  working: `dot` falls back to `lax.dot_general`.
"""

from __future__ import annotations

import inspect
import types
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

_triton: types.ModuleType | None
try:  # Removed by a future JAX: flash then runs in interpret mode only.
  from jax.experimental.pallas import triton as _triton
except ImportError:  # pragma: no cover - no JAX release in our range lacks it
  _triton = None

TRITON_ID = "jax-pallas-triton"
# The start of JAX's message (jax/_src/pallas/triton/pallas_call_registration.py); a
# regular expression for `warnings.filterwarnings`.
TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


def triton_unavailable() -> str | None:
  """Why the Pallas Triton backend cannot compile kernels on this JAX, or None if it can."""
  if _triton is None:
    return f"this JAX ({jax.__version__}) has no Pallas Triton backend"
  if _accelerated(TRITON_ID):
    return (f"this JAX ({jax.__version__}) turned the Pallas Triton deprecation "
            f"({TRITON_ID}) into an error")
  return None


def _accelerated(deprecation_id: str) -> bool:
  """Whether JAX made the deprecation an error (jax < 0.11 has no such registry entry)."""
  try:
    from jax._src import deprecations
  except ImportError:  # pragma: no cover
    return False
  registered = getattr(deprecations, "_registered_deprecations", {})
  return deprecation_id in registered and bool(deprecations.is_accelerated(deprecation_id))


_quiet = False


def quiet_triton_deprecation() -> None:
  """Silence JAX's Triton deprecation warning for this process (idempotent).

  A filter, not a scoped `catch_warnings`: the warning comes when a jitted function
  holding the kernel is lowered, which may be long after maskc returned.
  """
  global _quiet
  if not _quiet:
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
    _quiet = True


def triton_compiler_params(num_warps: int, num_stages: int) -> Any:
  """Triton's `CompilerParams` (only asked for when compiling for a GPU)."""
  assert _triton is not None, "callers check triton_unavailable() first"
  return _triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False,
        precision: Any = None) -> jax.Array:
  """A 2-D matrix product inside a Pallas kernel: Triton's `dot`, or `lax.dot_general`.

  Triton's `dot` lowers to `tl.dot` (tensor cores); without the Triton backend the
  kernel can only be interpreted, where `lax.dot_general` computes the same product.
  """
  if _triton is not None:
    return _triton.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)
  dims = ((0 if trans_a else 1,), (1 if trans_b else 0,))
  wide = jnp.float64 if jnp.float64 in (a.dtype, b.dtype) else jnp.float32
  return lax.dot_general(a, b, (dims, ((), ())), precision=precision,
                         preferred_element_type=wide)


# ----------------------------------------------------------------------------- Mosaic GPU
#
# The `mosaic_gpu` kernel (maskc.kernels.mosaic_gpu.forward) uses Pallas Mosaic GPU's warpgroup
# API (`plgpu.kernel`, TMA copies, `wgmma`, barriers, register layouts). What differs:
# - jax 0.10 imports `absl` in Mosaic GPU without declaring it as a dependency, so where
#   absl-py is missing `jax.experimental.pallas.mosaic_gpu` does not import at all;
# - jax 0.10 transposes a ref with `plgpu.transpose_ref(ref, perm)`, jax 0.12 with
#   `ref.transpose(perm)`; jax 0.10's `plgpu.load` takes an index argument, 0.12's not.
# Mosaic GPU is imported here only when asked for, so flash and the CPU paths never pay
# for it.


def mosaic_gpu() -> Any:
  """`jax.experimental.pallas.mosaic_gpu`, or raises ImportError saying why it does not import."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  return plgpu


def mosaic_gpu_unavailable() -> str | None:
  """Why Pallas Mosaic GPU cannot build kernels with this JAX, or None if it can."""
  try:
    plgpu = mosaic_gpu()
  except ImportError as e:
    fix = " (pip install absl-py)" if (e.name or "").split(".")[0] == "absl" else ""
    return (f"jax.experimental.pallas.mosaic_gpu does not import with this JAX "
            f"({jax.__version__}): {e}{fix}")
  missing = [n for n in ("kernel", "wgmma", "ACC", "Barrier", "SMEM", "Layout", "layout_cast",
                         "broadcasted_iota", "load", "copy_gmem_to_smem", "copy_smem_to_gmem",
                         "barrier_wait", "barrier_arrive", "set_max_registers")
             if not hasattr(plgpu, n)]
  if missing:
    return (f"this JAX's ({jax.__version__}) Pallas Mosaic GPU lacks "
            f"{', '.join('plgpu.' + n for n in missing)}")
  return None


def mosaic_transpose(ref: Any, perm: tuple[int, ...]) -> Any:
  """A transposed view of a shared-memory ref (the B operand of a `wgmma`)."""
  if hasattr(ref, "transpose"):
    return ref.transpose(perm)
  return mosaic_gpu().transpose_ref(ref, perm)


def mosaic_load(ref: Any, layout: Any) -> jax.Array:
  """`ref`'s whole value (a view already sliced) in registers with `layout`, from any memory."""
  plgpu = mosaic_gpu()
  if "idx" in inspect.signature(plgpu.load).parameters:
    return plgpu.load(ref, (), layout=layout, optimized=False)
  return plgpu.load(ref, layout=layout, optimized=False)
