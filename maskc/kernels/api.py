"""`attention(q, k, v, blockmap, ...)`: one entry point for compiled masks, several backends.

Backends live in one immutable registry (as in tokamax). Each is a module with
`run(q, k, v, blockmap, *, scale, logits_soft_cap, sinks, interpret)` and
`default_blocks(q_len, kv_len)`, imported only when first used, so an optional
backend's dependencies cost nothing until then. The XLA path is always there.

| name | where | |
|---|---|---|
| `dense` | anywhere | materialized mask; the reference |
| `xla` | anywhere | block-sparse jax.numpy; time tracks density |
| `flash` | GPU (Triton); CPU with `interpret=True` | Pallas block-sparse flash attention |
| `splash` | TPU; CPU in interpret mode | JAX's splash kernel fed our MaskInfo |

What `backend="auto"` picks, and why:

- TPU: `splash` (Mosaic; any length, padded in the adapter). Falls back to xla
  when a mask reads batched operands other than segment ids `s[q] == s[k]`
  (splash's MaskInfo has no batch axis) or `block_kv` is not a multiple of 128.
- GPU: `flash` (Triton; every operand kind: per-token, scalar, pairwise and
  per-tile; any length). Falls back to xla when the tiles are not powers of two
  >= 16.
- CPU: `dense` when `q_len * kv_len <= TINY` or the compiled map's density is
  above `NEARLY_FULL`, else `xla`. On CPU the Pallas kernels only interpret, and
  for tiny or nearly full masks the block bookkeeping costs more than the
  skipped tiles save.

On TPU and GPU the choice does not depend on the mask's size or density: the
kernels skip EMPTY tiles and do no mask work on FULL ones, so a dense mask costs
them what dense attention costs. `choose_backend` makes the choice from the
platform and lengths before compiling (it decides the tile sizes); `attention`
refines an xla choice to dense once it sees the compiled map.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from collections.abc import Mapping
from typing import Any, Protocol, cast

import jax
from jax.typing import ArrayLike

from maskc.compiled.blockmap import BlockMap
from maskc.kernels import common
from maskc.kernels.platform import platform as platform
from maskc.language.errors import BackendError, MaskValueError

# Tiny masks and nearly full ones gain nothing from block sparsity on CPU.
TINY = 256 * 256
NEARLY_FULL = 0.9


class BackendModule(Protocol):
  """What a backend's module provides (this module's docstring; `dense` has no tiles)."""

  def run(self, q: jax.Array, k: jax.Array, v: jax.Array, bm: BlockMap, *,
          scale: float | None = None, logits_soft_cap: float | None = None,
          sinks: ArrayLike | None = None, interpret: bool | None = None) -> jax.Array: ...

  def default_blocks(self, q_len: int, kv_len: int) -> tuple[int, int]: ...


@dataclasses.dataclass(frozen=True)
class Backend:
  """A registered attention backend: its module, imported on first use."""
  name: str
  module: str
  description: str = ""

  def load(self) -> BackendModule:
    return cast(BackendModule, importlib.import_module(self.module))


BACKENDS: Mapping[str, Backend] = types.MappingProxyType({
    "dense": Backend("dense", "maskc.kernels.dense", "materialized mask (reference)"),
    "xla": Backend("xla", "maskc.kernels.xla", "block-sparse jax.numpy, any platform"),
    "flash": Backend("flash", "maskc.kernels.flash", "Pallas flash attention (GPU)"),
    "splash": Backend("splash", "maskc.kernels.splash", "JAX splash attention (TPU)"),
    "cudnn": Backend("cudnn", "maskc.kernels.cudnn", "cuDNN flash attention for bands (GPU)"),
})


def check_backend(backend: str) -> None:
  """Raises BackendError unless `backend` is "auto" or registered."""
  if backend != "auto" and backend not in BACKENDS:
    raise BackendError(f"unknown attention backend {backend!r}",
                       hint=f"Choose one of: auto, {', '.join(BACKENDS)}.")


def choose_backend(backend: str, q_len: int, kv_len: int) -> str:
  """The backend `attention` starts from, before a mask is compiled.

  `"auto"` picks splash on TPU and flash on GPU, whatever the mask or length (they
  fall back to xla for a mask they cannot run; see the module's table); on CPU it
  picks dense for tiny masks (`q_len * kv_len <= TINY`, where the block bookkeeping
  costs more than it saves) and xla otherwise. `attention` may still move an xla
  choice to dense once it sees the compiled map's density.
  """
  check_backend(backend)
  if backend != "auto":
    return backend
  name = _platform_backend()
  if name == "xla" and q_len * kv_len <= TINY:
    return "dense"
  return name


def _platform_backend() -> str:
  """The block-sparse backend native to the platform jax runs on (xla on CPU)."""
  return {"tpu": "splash", "gpu": "flash"}.get(platform(), "xla")


def default_blocks(backend: str, q_len: int, kv_len: int) -> tuple[int, int]:
  """The tile sizes `backend` runs best with at these lengths."""
  if backend == "dense":
    return q_len, kv_len
  return BACKENDS[backend].load().default_blocks(q_len, kv_len)


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, bm: BlockMap, *, backend: str = "auto",
              scale: float | None = None, logits_soft_cap: float | None = None,
              sinks: ArrayLike | None = None, interpret: bool | None = None) -> jax.Array:
  """Masked multi-head attention under a compiled mask (`maskc.compile`).

  The kernels' entry point: it takes the compiled object only. To start from mask
  text, call `maskc.attention`, which compiles with the chosen backend's tiles.
  Works under `jit`, `grad` and `vmap`.

  Args:
    q: `[B, Lq, H, D]`. k, v: `[B, Lkv, Hkv, D]` / `[B, Lkv, Hkv, Dv]` with
      `H % Hkv == 0` (GQA; `Hkv = 1` is MQA).
    bm: the compiled `BlockMap` (its tiles, offset and operands are used).
    backend: `"auto"` or one of `BACKENDS`. `auto`: splash on TPU, flash on GPU,
      xla on CPU, and dense instead of xla when the mask is tiny
      (`q_len * kv_len <= TINY`) or nearly full (density > `NEARLY_FULL`); when
      splash or flash cannot run a mask, `auto` falls back to xla.
    scale: logit scale (default `1 / sqrt(D)`).
    logits_soft_cap: if set, logits become `cap * tanh(logits / cap)`.
    sinks: optional float `[H]` learned sink logits joining each softmax denominator.
    interpret: run Pallas kernels in interpret mode (default: when not on their
      native platform).

  Returns:
    `[B, Lq, H, Dv]` in q's dtype. Rows with no allowed key are zero, with zero
    gradients.

  Raises:
    BackendError: the backend cannot run this mask; the message names one that can.
    MaskValueError: shapes, lengths or block sizes do not fit.

  >>> import jax.numpy as jnp, maskc
  >>> from maskc.kernels import attention
  >>> x = jnp.ones((1, 256, 2, 16))
  >>> attention(x, x, x, maskc.compile("sliding(64)", 256), backend="xla").shape
  (1, 256, 2, 16)
  """
  q, k, v = common.qkv_arrays(q, k, v)
  check_backend(backend)
  if not isinstance(bm, BlockMap):
    raise MaskValueError(
        f"maskc.kernels.attention takes a compiled BlockMap, got {type(bm).__name__}",
        hint="Compile the mask first (`maskc.compile(mask, q_len, ...)`), or call "
             "`maskc.attention`, which accepts mask text and compiles it.")
  auto = backend == "auto"
  name = _platform_backend() if auto else backend
  if auto and name == "xla" and dense_is_better(bm):
    name = "dense"
  kw: dict[str, Any] = dict(scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
                            interpret=interpret)
  try:
    return BACKENDS[name].load().run(q, k, v, bm, **kw)
  except (BackendError, MaskValueError):
    if not auto or name in ("xla", "dense"):
      raise
    # `auto` promises an answer: the xla path runs every mask.
    return BACKENDS["xla"].load().run(q, k, v, bm, **kw)


def dense_is_better(bm: BlockMap) -> bool:
  """Whether dense attention beats block sparsity on CPU: tiny or nearly full masks."""
  if bm.q_len * bm.kv_len <= TINY:
    return True
  return bm.is_static and bm.density > NEARLY_FULL
