"""The integer types evaluation computes in, and `runs(x)`'s run ids.

The NumPy path computes every integer term in int64; the jax.numpy path in int32, or
int64 with `jax_enable_x64` (`jax_int_bits`). `runs_of` numbers the runs of true values
of an operand in that type.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from maskc.arrays.bit_words import count_through
from maskc.semantics.operand_runs import RunForm

NUMPY_BITS = 64  # the NumPy path's integer width


def is_traced(value: Any) -> bool:
  """Whether `value` is a JAX array (concrete or traced) rather than static data."""
  return isinstance(value, jax.Array)


def jax_int_bits() -> int:
  """The width of the integers the jax.numpy path computes in: 64 with `jax_enable_x64`, else 32."""
  # what jax makes of int64 follows the flag and `with jax.enable_x64(...)` alike
  return 64 if jax.dtypes.canonicalize_dtype(np.int64) == np.int64 else 32


def jax_int() -> Any:
  """The integer dtype of the jax.numpy path (see `jax_int_bits`)."""
  return jnp.int64 if jax_int_bits() == 64 else jnp.int32


def runs_of(xp: ModuleType, x: Any, dtype: DTypeLike | None = None) -> Any:
  """`runs(x)` along the last axis: 1-based index of each run of true values, 0 outside.

  Run ids are at most `(L + 1) // 2`; they are int64 with NumPy (the type the
  NumPy path computes in, so `runs(g)[q] + 2147483648` cannot overflow) and the
  jax.numpy path's integer type otherwise, unless `dtype` says.
  """
  dtype = dtype or (np.int64 if xp is np else jax_int())
  if xp is np:
    return _runs_of_numpy(np.asarray(x), dtype)
  x, starts = nonzero_run_starts(xp, x)
  return xp.where(x, count_through(xp, starts, dtype), 0).astype(dtype)


def nonzero_run_starts(xp: ModuleType, x: Any) -> tuple[Any, Any]:
  """`(x != 0, starts)`: where x is nonzero, and where a run of nonzeros starts, along the
  last axis (array form; a prefix sum of the starts numbers the runs)."""
  x = x != 0
  prev = xp.concatenate([xp.zeros_like(x[..., :1]), x[..., :-1]], axis=-1)
  return x, xp.logical_and(x, xp.logical_not(prev))


def _runs_of_numpy(x: np.ndarray, dtype: DTypeLike) -> np.ndarray:
  """`runs_of` from the runs of `x`: memory and time follow the output, not a cumsum's
  temporaries."""
  shape = x.shape
  if x.size == 0:
    return np.zeros(shape, dtype)
  flat = (x != 0).reshape(-1, shape[-1]) if x.ndim else (x != 0).reshape(1, 1)
  return RunForm.of(flat).run_ids().to_array(dtype).reshape(shape)
