"""`attention(q, k, v, blockmap, ...)`: one entry point for compiled masks, several backends.

Backends live in one immutable registry (as in tokamax), `BACKENDS`. Each entry (`Backend`)
names its module, imported only when first used (so an optional backend's dependencies
cost nothing until then), and declares where `auto` considers it. Each module declares the
`BackendModule` protocol: `run`, `run_with_lse` (or None), `default_blocks`, `refusal`,
`length_refusal`, `installed`, `forward_work`, its `GPU_COST` and `BACKWARD_ENGINE`.
`auto`, `choose` and the cost model read those, never a backend's name. The XLA path is
always there.

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
for MaxText's choice, tokamax's kernel when `tokamax` imports (the `tokamax` extra,
Python >= 3.12 with jax >= 0.11.1) and JAX's otherwise
(`Backend.resolved()` says which). Both take the same masks; tokamax's also
needs `block_q` to be a multiple of 128.

What `backend="auto"` picks, and why (`choose`):

- TPU: `splash` (Mosaic; any length, padded in the adapter). Falls back to xla
  when a mask reads batched operands other than segment ids `s[q] == s[k]`
  (splash's MaskInfo has no batch axis) or `block_kv` is not a multiple of 128.
- GPU: the mask is compiled at flash's tiles (`choose_backend`), then `choose`
  picks on the compiled map, by the cost model (`gpu_cost`, each engine's `GPU_COST`),
  among the engines that can run it: `cudnn` (a band), `tokamax` (installed, bf16/f16,
  and one exact interval of keys per row; priced as its forward plus flash's backward,
  which it runs), `flash` (every mask). Where the chosen engine refuses at run time,
  `auto` falls back to flash, then to xla (tiles that are not powers of two >= 16).
  `mosaic_gpu` is never picked: it has been lowered for cuda but never run on a GPU,
  so it has no measured cost and no checked numerics yet (name it to use it).
- CPU: `dense` for tiny masks (`maskc.kernels.dense.tiny`: at most `TINY` pairs and
  `TINY_KEYS` keys) or when the compiled map's density is above `NEARLY_FULL`, else
  `xla`. On CPU the Pallas kernels only interpret, and for tiny or nearly full masks the
  block bookkeeping costs more than the skipped tiles save.

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
from jax.typing import ArrayLike, DTypeLike

from maskc.compiled.blockmap import BlockMap
from maskc.kernels import common
from maskc.kernels.platform import platform as platform
from maskc.language.errors import BackendError, MaskValueError, install_command, nearest


class RunWithLse(Protocol):
  """`run_with_lse(q, k, v, bm, ...)`: `(out [B, Lq, H, Dv] f32, lse [B, Lq, H] f32)`,
  differentiable through both (`maskc.kernels.xla.run_with_lse` states the contract)."""

  def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, bm: BlockMap, *,
               scale: float | None = None, logits_soft_cap: float | None = None,
               interpret: bool | None = None) -> tuple[jax.Array, jax.Array]: ...


class BackendModule(Protocol):
  """What every backend's module declares; `auto`, `choose` and the cost model read these,
  never a backend's name (its `Backend` entry declares the rest: where `auto` considers it).

  Attributes:
    run_with_lse: attention and its differentiable log-sum-exp (ring attention needs
      it), or None: the backend has none.
    GPU_COST: the cost model's rates on a GPU, `(forward TFLOP/s, backward TFLOP/s,
      fixed ms a call)` counted on `forward_work`, or None: not costed (where `auto`
      considers it, it takes candidates in the registry's order instead).
    BACKWARD_ENGINE: the backend whose backward pass this one's gradients run, priced at
      that backend's rate (tokamax runs flash's), or None: its own.
  """

  run_with_lse: RunWithLse | None
  GPU_COST: tuple[float, float, float] | None
  BACKWARD_ENGINE: str | None

  def run(self, q: jax.Array, k: jax.Array, v: jax.Array, bm: BlockMap, *,
          scale: float | None = None, logits_soft_cap: float | None = None,
          sinks: ArrayLike | None = None, interpret: bool | None = None) -> jax.Array:
    """Attention `[B, Lq, H, Dv]` under a compiled map."""
    ...

  def default_blocks(self, q_len: int, kv_len: int) -> tuple[int, int]:
    """The tile sizes to compile maps at for this backend."""
    ...

  def refusal(self, bm: BlockMap, *, head_dim: int, dtype: DTypeLike, soft_cap: bool = False,
              sinks: bool = False) -> str | None:
    """Why `auto` should not run `bm` on this backend (it cannot, or another does it
    better), or None."""
    ...

  def length_refusal(self, q_len: int, kv_len: int) -> str | None:
    """`refusal` before a map is compiled, from the lengths alone (or None)."""
    ...

  def installed(self) -> bool:
    """Whether the optional packages it needs import here."""
    ...

  def forward_work(self, bm: BlockMap, head_dim: int) -> float:
    """The forward FLOPs it spends on `bm` per batch row and head (what `GPU_COST` counts)."""
    ...


@dataclasses.dataclass(frozen=True)
class Backend:
  """A registered attention backend: its module, imported on first use, and where `auto`
  considers it (known without importing it).

  Attributes:
    name, module, description: the backend, the module implementing `BackendModule`.
    requires: the optional package the module imports (None: jax is enough). When it is
      missing, a backend with a `fallback` loads that backend instead; one without raises
      `BackendError` saying what to install.
    auto_on: the platforms (`"cpu"`, `"gpu"`, `"tpu"`) on which `auto` considers it. The
      registry's order is `auto`'s preference where costs do not decide.
    compiles_for: the platforms on which `auto` compiles maps at this backend's tiles
      before choosing (one per platform: the map then serves every candidate there, and
      the fallbacks).
    auto_reason: what `choose` says when it picks this backend without a cost.
    falls_back_to: where `auto` goes, in order, when this backend refuses a call at run
      time (the last one's errors are raised).
    reads_tiles: whether it reads the map's tiles; one that does not (dense attention)
      is handed a map bound without lowering (`maskc.lowering.compile.bind_map`).
    block_kv_multiple: what `block_kv` must be a multiple of (splash: 128 lanes).
    static_maps: it builds static metadata per map (splash's MaskInfo), so sharded
      attention switches between maps rather than stacking them.
  """
  name: str
  module: str
  description: str = ""
  requires: str | None = None
  fallback: str | None = None
  auto_on: tuple[str, ...] = ()
  compiles_for: tuple[str, ...] = ()
  auto_reason: str = ""
  falls_back_to: tuple[str, ...] = ()
  reads_tiles: bool = True
  block_kv_multiple: int = 1
  static_maps: bool = False

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
          hint=f"Install it (`{install_command(self.requires)}` in a maskc checkout; "
               f"{self.requires} needs Python >= 3.12 and jax >= 0.11.1), or use "
               "backend='splash_jax'.") from e

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


_SPLASH_FALLBACK = ("xla",)
_GPU_FALLBACK = ("flash", "xla")  # flash runs every mask on a GPU, the xla path everywhere
BACKENDS: Mapping[str, Backend] = types.MappingProxyType({
    "dense": Backend("dense", "maskc.kernels.dense", "materialized mask (reference)",
                     auto_on=("cpu",), reads_tiles=False,
                     auto_reason="a tiny or nearly full mask, where dense attention is cheaper "
                                 "than block bookkeeping"),
    "xla": Backend("xla", "maskc.kernels.xla", "block-sparse jax.numpy, any platform",
                   auto_on=("cpu",), compiles_for=("cpu",),
                   auto_reason="block-sparse jax.numpy, whose work tracks the density"),
    "flash": Backend("flash", "maskc.kernels.flash.kernel", "Pallas flash attention (GPU)",
                     auto_on=("gpu",), compiles_for=("gpu",), falls_back_to=("xla",)),
    "splash": Backend("splash", "maskc.kernels.splash.tokamax_kernel",
                      "tokamax's splash (MaxText's) when installed, else JAX's (TPU)",
                      requires="tokamax", fallback="splash_jax", auto_on=("tpu",),
                      compiles_for=("tpu",), auto_reason="splash attention (Mosaic), whatever "
                                                         "the mask",
                      falls_back_to=_SPLASH_FALLBACK, block_kv_multiple=128, static_maps=True),
    "splash_tokamax": Backend("splash_tokamax", "maskc.kernels.splash.tokamax_kernel",
                              "tokamax's splash attention (TPU)", requires="tokamax",
                              falls_back_to=_SPLASH_FALLBACK, block_kv_multiple=128,
                              static_maps=True),
    "splash_jax": Backend("splash_jax", "maskc.kernels.splash.jax_kernel",
                          "JAX splash attention (TPU)", falls_back_to=_SPLASH_FALLBACK,
                          block_kv_multiple=128, static_maps=True),
    "cudnn": Backend("cudnn", "maskc.kernels.cudnn", "cuDNN flash attention for bands (GPU)",
                     auto_on=("gpu",), falls_back_to=_GPU_FALLBACK),
    "tokamax": Backend("tokamax", "maskc.kernels.tokamax",
                       "tokamax's Mosaic GPU forward and flash's backward, for key "
                       "intervals (GPU)", auto_on=("gpu",), falls_back_to=_GPU_FALLBACK),
    # Lowered for cuda but never run on a GPU: `auto` does not consider it.
    "mosaic_gpu": Backend("mosaic_gpu", "maskc.kernels.mosaic_gpu.forward",
                          "Pallas Mosaic GPU block-sparse forward, flash's backward (sm90; "
                          "not yet validated on a GPU)", falls_back_to=_GPU_FALLBACK),
})
# The GPU cost model's rates are each engine's `GPU_COST` (`maskc.kernels.flash.kernel`,
# `cudnn`, `tokamax`), TFLOP/s counted on the work the engine does (`forward_work`).
# Measured on one NVIDIA H100 80GB HBM3 (jax 0.11.2, tokamax 0.0.17), bf16, B=1, 16 heads of
# 128, at 32K, all three engines in one run, medians over the five masks of the GPU table:
# 2026-11-26, `GPU_TESTS=tokamax LENGTHS=32768 bash benchmarks/gpu_check.sh`
# (docs/benchmarks.md, "with tokamax's forward and flash's backward"). At 8K every engine
# runs 10-30% below these rates (launches weigh more); the same run's ranking holds there.
GPU_COSTS_MEASURED = ("2026-11-26, H100, `GPU_TESTS=tokamax LENGTHS=32768 bash "
                      "benchmarks/gpu_check.sh`")
# A backward pass does 2.5 times a forward pass's matmul work (5 matmuls against 2).
BACKWARD_WORK = 2.5
DEFAULT_HEAD_DIM = 128          # what `choose` assumes when not told
DEFAULT_DTYPE = jnp.bfloat16


def check_backend(backend: str) -> None:
  """Raises BackendError unless `backend` is "auto" or registered (with the nearest name)."""
  if backend != "auto" and backend not in BACKENDS:
    names = ["auto", *BACKENDS]
    guess = nearest(backend, names) if isinstance(backend, str) else None
    raise BackendError(f"unknown attention backend {backend!r}",
                       hint=(f"Did you mean {guess!r}? " if guess else "") +
                            f"Choose one of: {', '.join(names)}.")


def gpu_costs() -> dict[str, tuple[float, float, float]]:
  """The cost model's rates: each GPU candidate's `GPU_COST` (see `GPU_COSTS_MEASURED`)."""
  out = {}
  for b in BACKENDS.values():
    if "gpu" in b.auto_on and (cost := b.load().GPU_COST) is not None:
      out[b.name] = cost
  return out


def choose_backend(backend: str, q_len: int, kv_len: int, *, need_lse: bool = False) -> str:
  """The backend `attention` starts from, before a mask is compiled.

  A named backend is kept. `"auto"` starts from the backend whose tiles the platform's
  maps are compiled at (`Backend.compiles_for`: splash on TPU, flash on GPU, xla
  elsewhere), unless a candidate before it in the registry takes these lengths
  (`length_refusal`: dense for tiny masks on CPU, where the block bookkeeping costs more
  than it saves). `need_lse` keeps to backends with a `run_with_lse` (rings).
  `attention` may still move the choice once it sees the compiled map (`choose`).
  """
  check_backend(backend)
  if backend != "auto":
    return backend
  where = _where(platform())
  tiled = next(b for b in BACKENDS.values() if where in b.compiles_for)
  for b in _candidates(where):
    if b is tiled:
      break
    mod = b.load()
    if (mod.installed() and not (need_lse and mod.run_with_lse is None)
        and mod.length_refusal(q_len, kv_len) is None):
      return b.name
  return tiled.name


class Choice(NamedTuple):
  """What `choose` picked, and why in one line."""
  backend: str
  reason: str


def choose(bm: BlockMap, *, platform: str | None = None, head_dim: int = DEFAULT_HEAD_DIM,
           dtype: DTypeLike = DEFAULT_DTYPE, soft_cap: bool = False, sinks: bool = False,
           need_lse: bool = False) -> Choice:
  """The backend `auto` runs a compiled map on, and a one-line reason.

  The candidates are the backends registered for the platform (`Backend.auto_on`) that
  are installed, have a `run_with_lse` when one is needed, and do not refuse the map
  (each module's `refusal`). Where every candidate left is costed (`GPU_COST`: on a GPU,
  `cudnn` for a band, `tokamax` for one exact interval of keys per row in bf16/f16,
  `flash` for every mask), the cheapest by the cost model wins (`gpu_cost`: forward plus
  backward, tokamax's backward being flash's); else the first in the registry's order
  (TPU: splash; CPU: dense for tiny or nearly full maps, else xla).

  Args:
    bm: the compiled map (at flash's tiles on a GPU: `choose_backend`).
    platform: `"gpu"`, `"tpu"` or `"cpu"` (default: where jax runs).
    head_dim: the query/key head dimension (default 128, `DEFAULT_HEAD_DIM`).
    dtype: q's dtype (default bfloat16, `DEFAULT_DTYPE`).
    soft_cap, sinks: whether the call has a logit soft cap / sink logits.
    need_lse: only engines with a differentiable log-sum-exp (`run_with_lse`; rings).

  Returns:
    `Choice(backend, reason)`.

  Raises:
    BackendError: no backend registered for the platform takes the map.

  >>> import maskc
  >>> from maskc.kernels.api import choose
  >>> choose(maskc.compile("causal", 4096, block_q=64, block_kv=64), platform="gpu").backend
  'cudnn'
  """
  where = _where(platform_name() if platform is None else platform)
  refused: dict[str, str] = {}
  accepted: list[tuple[Backend, BackendModule]] = []
  for b in _candidates(where):
    mod, why = _refusal(b, bm, head_dim=head_dim, dtype=dtype, soft_cap=soft_cap, sinks=sinks,
                        need_lse=need_lse)
    if why is not None:
      refused[b.name] = why
    else:
      accepted.append((b, cast(BackendModule, mod)))
  skipped = "; ".join(f"not {n}: {w}" for n, w in refused.items())
  if not accepted:
    raise BackendError(f"no backend for {where} takes this map: {skipped}",
                       hint="Name a backend (`backend='xla'` runs every mask anywhere).")
  if not all(mod.GPU_COST is not None for _, mod in accepted):
    best = accepted[0][0]
    return Choice(best.name, f"{where.upper()}: {best.auto_reason or best.description}" +
                  (f"; {skipped}" if skipped else ""))
  costs = {b.name: sum(gpu_cost(b.name, bm, head_dim)) for b, _ in accepted}
  name = min(costs, key=costs.__getitem__)
  others = ", ".join(f"{n} {c:.3g}" for n, c in sorted(costs.items(), key=lambda x: x[1])
                     if n != name)
  return Choice(name, f"{where.upper()}: {name}, estimated {costs[name]:.3g} ms fwd+bwd per "
                      f"batch row and head" + (f" (vs {others})" if others else "") +
                (f"; {skipped}" if skipped else ""))


def gpu_cost(name: str, bm: BlockMap, head_dim: int) -> tuple[float, float]:
  """`(forward, backward)` ms per batch row and head that backend `name` is estimated to
  take on `bm`: its forward work (`forward_work`) at its forward rate (`GPU_COST`), and its
  backward engine's (`BACKWARD_ENGINE`, else itself) work, 2.5 times a forward's, at that
  engine's backward rate, each with the fixed cost of a call.

  Raises:
    BackendError: the backend (or its backward engine) has no `GPU_COST`.
  """
  mod = BACKENDS[name].load()
  back = BACKENDS[mod.BACKWARD_ENGINE].load() if mod.BACKWARD_ENGINE else mod
  if mod.GPU_COST is None or back.GPU_COST is None:
    raise BackendError(f"backend {name!r} has no GPU cost (its module's GPU_COST is None)")
  fwd, _, fixed = mod.GPU_COST
  _, bwd, fixed_b = back.GPU_COST
  return (mod.forward_work(bm, head_dim) / (fwd * 1e9) + fixed,
          BACKWARD_WORK * back.forward_work(bm, head_dim) / (bwd * 1e9) + fixed_b)


def _refusal(b: Backend, bm: BlockMap, *, head_dim: int, dtype: DTypeLike, soft_cap: bool,
             sinks: bool, need_lse: bool) -> tuple[BackendModule | None, str | None]:
  """`(module, None)` when `auto` may run `bm` on `b`, else `(module or None, why not)`."""
  try:
    mod = b.load()
  except BackendError:
    return None, f"{b.requires} does not import here"
  if not mod.installed():
    return mod, f"{b.name} is not installed"
  if need_lse and mod.run_with_lse is None:
    return mod, "no differentiable log-sum-exp"
  why = mod.refusal(bm, head_dim=head_dim, dtype=dtype, soft_cap=soft_cap, sinks=sinks)
  return mod, None if why is None else why.split(" (")[0]


def _candidates(where: str) -> list[Backend]:
  """The backends `auto` considers on a platform, in the registry's order."""
  return [b for b in BACKENDS.values() if where in b.auto_on]


def _where(name: str) -> str:
  """A platform as `auto` knows it: one some backend is registered for, else `"cpu"`."""
  return name if any(name in b.auto_on for b in BACKENDS.values()) else "cpu"


def platform_name() -> str:
  """Where jax runs: "gpu", "tpu" or "cpu" (`maskc.kernels.platform`)."""
  return platform()


def default_blocks(backend: str, q_len: int, kv_len: int) -> tuple[int, int]:
  """The tile sizes `backend` runs best with at these lengths."""
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
  chain = BACKENDS[name].falls_back_to
  try:
    return BACKENDS[name].load().run(q, k, v, bm, **kw)
  except (BackendError, MaskValueError):
    if not auto or not chain:
      raise
  # `auto` promises an answer: the backend's fallbacks (`Backend.falls_back_to`), in order.
  for fallback in chain[:-1]:
    try:
      return BACKENDS[fallback].load().run(q, k, v, bm, **kw)
    except (BackendError, MaskValueError):
      pass
  return BACKENDS[chain[-1]].load().run(q, k, v, bm, **kw)
