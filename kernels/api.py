"""`attention(q, k, v, mask, ...)`: one entry point, several backends.

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
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from typing import Any, Mapping

import jax

from maskc._blockmap import BlockMap
from maskc._errors import BackendError, MaskValueError
from maskc.kernels import _common as common

# Tiny masks and nearly full ones gain nothing from block sparsity on CPU.
_TINY = 256 * 256
_NEARLY_FULL = 0.9


@dataclasses.dataclass(frozen=True)
class Backend:
  """A registered attention backend: its module, imported on first use."""
  name: str
  module: str
  needs_blockmap: bool = True
  description: str = ""

  def load(self) -> types.ModuleType:
    return importlib.import_module(self.module)


BACKENDS: Mapping[str, Backend] = types.MappingProxyType({
    "dense": Backend("dense", "maskc.kernels.dense", False, "materialized mask (reference)"),
    "xla": Backend("xla", "maskc.kernels.xla", True, "block-sparse jax.numpy, any platform"),
    "flash": Backend("flash", "maskc.kernels.flash", True, "Pallas flash attention (GPU)"),
    "splash": Backend("splash", "maskc.kernels.splash", True, "JAX splash attention (TPU)"),
})


def platform() -> str:
  """`"tpu"`, `"gpu"` or `"cpu"`: where jax runs by default."""
  p = jax.default_backend()
  return "gpu" if p in ("gpu", "cuda", "rocm") else p


def _auto_backend() -> str:
  return {"tpu": "splash", "gpu": "flash"}.get(platform(), "xla")


def attention(q, k, v, mask: Any, *, operands: dict[str, Any] | None = None,
              backend: str = "auto", block_q: int | None = None, block_kv: int | None = None,
              scale: float | None = None, logits_soft_cap: float | None = None, sinks=None,
              q_offset: int | None = None, interpret: bool | None = None) -> jax.Array:
  """Masked multi-head attention with a compiled mask.

  Works under `jit`, `grad` and `vmap`. Static masks compile once (`maskc.compile`
  caches them); masks with traced operands compile inside the trace.

  Args:
    q: `[B, Lq, H, D]`. k, v: `[B, Lkv, Hkv, D]` / `[B, Lkv, Hkv, Dv]` with
      `H % Hkv == 0` (GQA; `Hkv = 1` is MQA).
    mask: mask text, a `Mask`, a sequence of them (one per query head), or a
      compiled `BlockMap` (whose block sizes, offset and operands are then used).
    operands: values of the runtime operands the mask reads (NumPy or jax arrays).
    backend: `"auto"` (splash on TPU, flash on GPU, xla on CPU or dense when the
      mask is tiny or nearly full), or one of `BACKENDS`.
    block_q, block_kv: tile sizes (default: the backend's).
    scale: logit scale (default `1 / sqrt(D)`).
    logits_soft_cap: if set, logits become `cap * tanh(logits / cap)`.
    sinks: optional float `[H]` learned sink logits joining each softmax denominator.
    q_offset: position of query row 0 (default `Lkv - Lq`, bottom-right aligned).
    interpret: run Pallas kernels in interpret mode (default: when not on their
      native platform).

  Returns:
    `[B, Lq, H, Dv]` in q's dtype. Rows with no allowed key are zero, with zero
    gradients.

  Raises:
    BackendError: the backend cannot run this mask; the message names one that can.
    MaskValueError: shapes, lengths or block sizes do not fit.

  >>> import jax.numpy as jnp
  >>> from maskc.kernels import attention
  >>> x = jnp.ones((1, 256, 2, 16))
  >>> attention(x, x, x, "sliding(64)", backend="xla").shape
  (1, 256, 2, 16)
  """
  b, lq, h, lkv, _, _ = common.check_qkv(q, k, v)
  if backend != "auto" and backend not in BACKENDS:
    raise BackendError(f"unknown attention backend {backend!r}",
                       hint=f"Choose one of: auto, {', '.join(BACKENDS)}.")
  auto = backend == "auto"
  name = _auto_backend() if auto else backend
  kw = dict(scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks, interpret=interpret)

  if isinstance(mask, BlockMap):
    if operands:
      raise MaskValueError("operands were given with a compiled BlockMap, which holds its own",
                           hint="Pass the operands to maskc.compile instead.")
    if q_offset is not None and mask.is_static and int(q_offset) != int(mask.q_offset):
      raise MaskValueError(f"q_offset={q_offset} differs from the BlockMap's "
                           f"q_offset={mask.q_offset}")
    for arg, value, have in (("block_q", block_q, mask.block_q),
                             ("block_kv", block_kv, mask.block_kv)):
      if value is not None and value != have:
        raise MaskValueError(f"{arg}={value} differs from the BlockMap's {arg}={have}",
                             hint="Compile the mask with the tile sizes you want.")
    bm = mask
    if auto and name == "xla" and _dense_is_better(bm):
      name = "dense"
    return _run(name, auto, q, k, v, bm, kw)

  if auto and name == "xla" and lq * lkv <= _TINY:
    name = "dense"
  if name == "dense":
    binding = common.bind(mask, lq, lkv, q_offset=q_offset, operands=operands)
    return BACKENDS["dense"].load().run(q, k, v, binding, **kw)
  module = BACKENDS[name].load()
  dq, dk = module.default_blocks(lq, lkv)
  from maskc._lower import compile as compile_mask
  bm = compile_mask(mask, lq, lkv, block_q=block_q or dq, block_kv=block_kv or dk,
                    q_offset=q_offset, operands=operands)
  if auto and name == "xla" and _dense_is_better(bm):
    name = "dense"
  return _run(name, auto, q, k, v, bm, kw)


def _dense_is_better(bm: BlockMap) -> bool:
  if bm.q_len * bm.kv_len <= _TINY:
    return True
  return bm.is_static and bm.density > _NEARLY_FULL


def _run(name: str, auto: bool, q, k, v, bm, kw):
  try:
    return BACKENDS[name].load().run(q, k, v, bm, **kw)
  except (BackendError, MaskValueError):
    if not auto or name == "xla":
      raise
    # `auto` promises an answer: the xla path runs every mask.
    return BACKENDS["xla"].load().run(q, k, v, bm, **kw)
