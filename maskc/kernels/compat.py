"""What differs between the JAX versions maskc supports (0.10.2 through 0.12.x), in one place.

The kernels import version-dependent pieces from here, never test `jax.__version__`
themselves. Today that is the Pallas Triton backend, which the flash kernel is written
for:

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

import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

try:  # Removed by a future JAX: flash then runs in interpret mode only.
  from jax.experimental.pallas import triton as _triton
except ImportError:  # pragma: no cover - no JAX release in our range lacks it
  _triton = None  # type: ignore[assignment]

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
