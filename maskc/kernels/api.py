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
| `splash` | TPU; CPU interpreted | `splash_tokamax` where tokamax imports, else `splash_jax` |
| `splash_tokamax` | TPU; CPU interpreted | tokamax's splash kernel (MaxText's), our MaskInfo |
| `splash_jax` | TPU; CPU interpreted | JAX's splash kernel fed our MaskInfo |
| `cudnn` | GPU | cuDNN through `jax.nn.dot_product_attention`, for bands |
| `tokamax` | GPU, with tokamax | key intervals: tokamax's Mosaic GPU forward, flash's backward |
| `mosaic_gpu` | GPU sm90 | Mosaic GPU forward; flash's backward or its own (opt-in); never run |

Which splash runs is explicit: name `splash_tokamax` or `splash_jax`, or `splash`
for MaxText's choice, tokamax's kernel when `tokamax` imports (`pip install
maskc[tokamax]`, Python >= 3.12 with jax >= 0.11.1) and JAX's otherwise
(`Backend.resolved()` says which). Both take the same masks; tokamax's also
needs `block_q` to be a multiple of 128.

What `backend="auto"` picks, and why (`choose`):

- TPU: `splash` (Mosaic; any length, padded in the adapter). Falls back to xla
  when a mask reads batched operands other than segment ids `s[q] == s[k]`
  (splash's MaskInfo has no batch axis) or `block_kv` is not a multiple of 128.
- GPU: the mask is compiled at flash's tiles (`choose_backend`), then `choose`
  picks on the compiled map, by the cost model `GPU_COSTS`, among the engines that
  can run it: `cudnn` (a band), `tokamax` (installed, bf16/f16, and one exact interval
  of keys per row; priced as its forward plus flash's backward, which it runs),
  `flash` (every mask). Where the chosen engine refuses at run time, `auto`
  falls back to flash, then to xla (tiles that are not powers of two >= 16).
  `mosaic_gpu` is never picked: it has been lowered for cuda but never run on a GPU,
  so it has no measured cost and no checked numerics yet (name it to use it).
- CPU: `dense` for tiny masks (`tiny`: at most `TINY` pairs and `TINY_KEYS` keys) or
  when the compiled map's density is above `NEARLY_FULL`, else `xla`. On CPU the Pallas
  kernels only interpret, and for tiny or nearly full masks the block bookkeeping
  costs more than the skipped tiles save.

`choose_backend` makes the first choice from the platform and lengths before
compiling (it decides the tile sizes: on a GPU, flash's, so that the map serves every
GPU engine and the fallback); `attention` then refines it on the compiled map
(`choose`): xla to dense on CPU, flash to cudnn or tokamax on GPU.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from maskc.compiled.blockmap import BlockMap
from maskc.kernels import common
from maskc.kernels.platform import platform as platform
from maskc.language.errors import BackendError, MaskValueError

# Tiny masks and nearly full ones gain nothing from block sparsity on CPU.
TINY = 256 * 256
# Keys above which even a few query rows gain from skipping tiles: a decode row over a
# cache of 1K keys runs in about half dense's time on xla (CPU, 2026-11-26; below 512
# keys dense wins), though its pair count is far under TINY.
TINY_KEYS = 512
NEARLY_FULL = 0.9


def tiny(q_len: int, kv_len: int) -> bool:
  """Whether a mask is small enough that dense attention beats xla's tile bookkeeping on
  CPU: at most `TINY` pairs and `TINY_KEYS` keys."""
  return q_len * kv_len <= TINY and kv_len <= TINY_KEYS


class BackendModule(Protocol):
  """What a backend's module provides (this module's docstring; `dense` has no tiles)."""

  def run(self, q: jax.Array, k: jax.Array, v: jax.Array, bm: BlockMap, *,
          scale: float | None = None, logits_soft_cap: float | None = None,
          sinks: ArrayLike | None = None, interpret: bool | None = None) -> jax.Array: ...

  def default_blocks(self, q_len: int, kv_len: int) -> tuple[int, int]: ...


@dataclasses.dataclass(frozen=True)
class Backend:
  """A registered attention backend: its module, imported on first use.

  `requires` names the optional package the module imports (None: jax is
  enough). When it is missing, a backend with a `fallback` loads that backend
  instead; one without raises `BackendError` saying what to install.
  """
  name: str
  module: str
  description: str = ""
  requires: str | None = None
  fallback: str | None = None

  def load(self) -> BackendModule:
    try:
      return cast(BackendModule, importlib.import_module(self.module))
    except ImportError as e:
      if self.requires is None or (e.name or "").split(".")[0] != self.requires:
        raise
      if self.fallback is not None:
        return BACKENDS[self.fallback].load()
      raise BackendError(
          f"the {self.name} backend needs {self.requires}, which does not import here: {e}",
          hint=f"Install it (`pip install maskc[{self.requires}]`; {self.requires} needs "
               "Python >= 3.12 and jax >= 0.11.1), or use backend='splash_jax'.") from e

  def resolved(self) -> str:
    """The registered backend that runs for this name: itself, or its fallback."""
    if self.fallback is None:
      return self.name
    try:
      importlib.import_module(self.module)
    except ImportError as e:
      if self.requires is None or (e.name or "").split(".")[0] != self.requires:
        raise
      return BACKENDS[self.fallback].resolved()
    return next(b.name for b in BACKENDS.values()
                if b.module == self.module and b.fallback is None)


BACKENDS: Mapping[str, Backend] = types.MappingProxyType({
    "dense": Backend("dense", "maskc.kernels.dense", "materialized mask (reference)"),
    "xla": Backend("xla", "maskc.kernels.xla", "block-sparse jax.numpy, any platform"),
    "flash": Backend("flash", "maskc.kernels.flash.kernel", "Pallas flash attention (GPU)"),
    "splash": Backend("splash", "maskc.kernels.splash.tokamax_kernel",
                      "tokamax's splash (MaxText's) when installed, else JAX's (TPU)",
                      requires="tokamax", fallback="splash_jax"),
    "splash_tokamax": Backend("splash_tokamax", "maskc.kernels.splash.tokamax_kernel",
                              "tokamax's splash attention (TPU)", requires="tokamax"),
    "splash_jax": Backend("splash_jax", "maskc.kernels.splash.jax_kernel",
                          "JAX splash attention (TPU)"),
    "cudnn": Backend("cudnn", "maskc.kernels.cudnn", "cuDNN flash attention for bands (GPU)"),
    "tokamax": Backend("tokamax", "maskc.kernels.tokamax",
                       "tokamax's Mosaic GPU forward and flash's backward, for key "
                       "intervals (GPU)"),
    # Lowered for cuda but never run on a GPU: `auto` does not consider it (`choose`).
    "mosaic_gpu": Backend("mosaic_gpu", "maskc.kernels.mosaic_gpu.forward",
                          "Pallas Mosaic GPU block-sparse forward, flash's backward (sm90; "
                          "not yet validated on a GPU)"),
})
# The splash backends: static MaskInfo, key tiles of 128 (`maskc.attention`, sharding).
SPLASH = frozenset({"splash", "splash_tokamax", "splash_jax"})

# The GPU cost model: per engine, (forward TFLOP/s, backward TFLOP/s, fixed ms a call),
# TFLOP/s counted on the tile work an engine does (`_work`). Measured on one NVIDIA H100
# 80GB HBM3 (jax 0.11.2, tokamax 0.0.17), bf16, B=1, 16 heads of 128, at 32K, all three
# engines in one run, medians over the five masks of the GPU table: 2026-11-26,
# `GPU_TESTS=tokamax LENGTHS=32768 bash benchmarks/gpu_check.sh` (docs/benchmarks.md,
# "with tokamax's forward and flash's backward"). At 8K every engine runs 10-30% below
# these rates (launches weigh more); the same run's ranking holds there. tokamax's own
# backward (185 TFLOP/s, an earlier run that day) does not skip key blocks, so
# `backend="tokamax"` runs flash's backward instead (`BACKWARD_ENGINE`) and the model
# never uses that rate.
GPU_COSTS: Mapping[str, tuple[float, float, float]] = types.MappingProxyType({
    "cudnn": (597.0, 540.0, 0.05),
    "tokamax": (549.0, 185.0, 0.05),
    "flash": (278.0, 311.0, 0.05),
})
GPU_COSTS_MEASURED = ("2026-11-26, H100, `GPU_TESTS=tokamax LENGTHS=32768 bash "
                      "benchmarks/gpu_check.sh`")
# The engine whose backward pass each engine's gradients run (tokamax: flash's, on the
# same map; `maskc.kernels.tokamax`).
BACKWARD_ENGINE: Mapping[str, str] = types.MappingProxyType({"tokamax": "flash"})
# A backward pass does 2.5 times a forward pass's matmul work (5 matmuls against 2).
BACKWARD_WORK = 2.5
# Engines whose `run_with_lse` returns a differentiable log-sum-exp (rings need one).
WITH_LSE = ("xla", "flash", "splash", "splash_tokamax", "splash_jax")


def check_backend(backend: str) -> None:
  """Raises BackendError unless `backend` is "auto" or registered."""
  if backend != "auto" and backend not in BACKENDS:
    raise BackendError(f"unknown attention backend {backend!r}",
                       hint=f"Choose one of: auto, {', '.join(BACKENDS)}.")


def choose_backend(backend: str, q_len: int, kv_len: int) -> str:
  """The backend `attention` starts from, before a mask is compiled.

  `"auto"` picks splash on TPU and flash on GPU, whatever the mask or length (they
  fall back to xla for a mask they cannot run; see the module's table); on CPU it
  picks dense for tiny masks (`tiny`, where the block bookkeeping costs more than it
  saves) and xla otherwise. `attention` may still move an xla
  choice to dense once it sees the compiled map's density.
  """
  check_backend(backend)
  if backend != "auto":
    return backend
  name = _platform_backend()
  if name == "xla" and tiny(q_len, kv_len):
    return "dense"
  return name


class Choice(NamedTuple):
  """What `choose` picked, and why in one line."""
  backend: str
  reason: str


def choose(bm: BlockMap, *, platform: str | None = None, head_dim: int,
           dtype: DTypeLike, soft_cap: bool = False, sinks: bool = False,
           need_lse: bool = False) -> Choice:
  """The backend `auto` runs a compiled map on, and a one-line reason.

  On a GPU: every engine that can run the map (`cudnn` for a band, `tokamax` when
  installed for one exact interval of keys per row in bf16/f16, `flash` always) is costed
  by `GPU_COSTS` on the map's work, forward plus backward (`gpu_cost`; tokamax's backward
  is flash's), and the cheapest wins. On a
  TPU: splash. On a CPU: dense for tiny or nearly full maps, else xla.

  Args:
    bm: the compiled map (at flash's tiles on a GPU: `choose_backend`).
    platform: `"gpu"`, `"tpu"` or `"cpu"` (default: where jax runs).
    head_dim: the query/key head dimension. dtype: q's dtype.
    soft_cap, sinks: whether the call has a logit soft cap / sink logits.
    need_lse: only engines with a differentiable log-sum-exp (`run_with_lse`; rings).

  Returns:
    `Choice(backend, reason)`.

  >>> import jax.numpy as jnp, maskc
  >>> from maskc.kernels.api import choose
  >>> choose(maskc.compile("causal", 4096, block_q=64, block_kv=64), platform="gpu",
  ...        head_dim=128, dtype=jnp.bfloat16).backend
  'cudnn'
  """
  where = platform_name() if platform is None else platform
  if where == "tpu":
    return Choice("splash", "TPU: splash attention (Mosaic), whatever the mask")
  if where != "gpu":
    if dense_is_better(bm):
      return Choice("dense", "CPU: a tiny or nearly full mask, where dense attention is "
                             "cheaper than block bookkeeping")
    return Choice("xla", "CPU: block-sparse jax.numpy, whose work tracks the density")
  refused: dict[str, str] = {}
  costs: dict[str, float] = {}
  for name in ("cudnn", "tokamax", "flash"):
    why = _refusal(name, bm, head_dim=head_dim, dtype=dtype, soft_cap=soft_cap, sinks=sinks,
                   need_lse=need_lse)
    if why is not None:
      refused[name] = why
      continue
    costs[name] = sum(gpu_cost(name, bm, head_dim))
  best = min(costs, key=costs.__getitem__)
  others = ", ".join(f"{n} {c:.3g}" for n, c in sorted(costs.items(), key=lambda x: x[1])
                     if n != best)
  skipped = "; ".join(f"not {n}: {w}" for n, w in refused.items())
  return Choice(best, f"GPU: {best}, estimated {costs[best]:.3g} ms fwd+bwd per batch row "
                      f"and head" + (f" (vs {others})" if others else "") +
                (f"; {skipped}" if skipped else ""))


def gpu_cost(name: str, bm: BlockMap, head_dim: int) -> tuple[float, float]:
  """`(forward, backward)` ms per batch row and head that engine `name` is estimated to take
  on `bm` by `GPU_COSTS`: its forward work at its forward rate, and the backward engine's
  (`BACKWARD_ENGINE`) work, 2.5 times a forward's, at that engine's backward rate, each
  with the fixed cost of a call."""
  back = BACKWARD_ENGINE.get(name, name)
  fwd, _, fixed = GPU_COSTS[name]
  _, bwd, fixed_b = GPU_COSTS[back]
  return (_work(name, bm, head_dim) / (fwd * 1e9) + fixed,
          BACKWARD_WORK * _work(back, bm, head_dim) / (bwd * 1e9) + fixed_b)


def _refusal(name: str, bm: BlockMap, *, head_dim: int, dtype: DTypeLike, soft_cap: bool,
             sinks: bool, need_lse: bool) -> str | None:
  """Why engine `name` cannot run `bm` on a GPU, or None."""
  if need_lse and name not in WITH_LSE:
    return "no differentiable log-sum-exp"
  if name == "flash":
    return None
  if name == "cudnn":
    if soft_cap or sinks:
      return "no soft cap or sinks"
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
      return f"runs bfloat16 and float16, not {jnp.dtype(dtype)}"
    if head_dim % 8 or head_dim > 256:
      return f"head dim {head_dim}"
    try:
      BACKENDS["cudnn"].load().arguments(bm)  # type: ignore[attr-defined]
    except BackendError:
      return "no band cuDNN expresses"
    return None
  mod = BACKENDS["tokamax"].load()
  if not mod.installed():  # type: ignore[attr-defined]
    return "tokamax is not installed"
  why = mod.refusal(bm, head_dim=head_dim, dtype=dtype, sinks=sinks)  # type: ignore[attr-defined]
  return None if why is None else why.split(" (")[0]


def _work(name: str, bm: BlockMap, head_dim: int) -> float:
  """The forward FLOPs engine `name` spends on `bm`, per batch row and head: the non-EMPTY
  tiles for flash and cuDNN (which skips masked tiles of its band itself), each 128-row
  tile's hull of key intervals for tokamax (it skips the key blocks outside it)."""
  lead = int(np.prod(bm.lead_shape or (1,)))
  sparse = bm.attention_flops(head_dim)[0] / lead if bm.is_static else \
      4.0 * bm.q_len * bm.kv_len * head_dim
  if name != "tokamax" or not bm.is_static:
    return float(sparse)
  start, stop, _ = bm.key_intervals()
  rows = 128
  n = -(-bm.q_len // rows)
  pad = n * rows - bm.q_len
  lo = np.pad(np.asarray(start), [(0, 0)] * (start.ndim - 1) + [(0, pad)], mode="edge")
  hi = np.pad(np.asarray(stop), [(0, 0)] * (stop.ndim - 1) + [(0, pad)], mode="edge")
  lo = lo.reshape(lo.shape[:-1] + (n, rows)).min(-1)
  hi = hi.reshape(hi.shape[:-1] + (n, rows)).max(-1)
  return float(4.0 * rows * np.maximum(hi - lo, 0).sum() * head_dim / lead)


def platform_name() -> str:
  """Where jax runs: "gpu", "tpu" or "cpu" (`maskc.kernels.platform`)."""
  return platform()


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
    backend: `"auto"` or one of `BACKENDS`. `auto` runs what `choose` picks on the
      map: splash on TPU; cudnn, tokamax or flash on GPU by the cost model; xla on
      CPU, or dense when the mask is tiny (`q_len * kv_len <= TINY`) or nearly full
      (density > `NEARLY_FULL`). Where the pick cannot run the call, `auto` falls back
      to flash (GPU), then to xla.
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
  name = backend
  if auto:
    name = choose(bm, head_dim=q.shape[-1], dtype=q.dtype, soft_cap=logits_soft_cap is not None,
                  sinks=sinks is not None).backend
  kw: dict[str, Any] = dict(scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
                            interpret=interpret)
  try:
    return BACKENDS[name].load().run(q, k, v, bm, **kw)
  except (BackendError, MaskValueError):
    if not auto or name in ("xla", "dense"):
      raise
  # `auto` promises an answer: flash runs every mask on a GPU, the xla path everywhere.
  if name not in ("flash", *SPLASH):
    try:
      return BACKENDS["flash"].load().run(q, k, v, bm, **kw)
    except (BackendError, MaskValueError):
      pass
  return BACKENDS["xla"].load().run(q, k, v, bm, **kw)


def dense_is_better(bm: BlockMap) -> bool:
  """Whether dense attention beats block sparsity on CPU: tiny or nearly full masks."""
  if tiny(bm.q_len, bm.kv_len):
    return True
  return bm.is_static and bm.density > NEARLY_FULL
