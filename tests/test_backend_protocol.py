"""The backend protocol: what every backend declares, and `auto` reading it, never a name.

`maskc.kernels.api.BackendModule` is what each backend's module declares; a registry entry
(`Backend`) says where `auto` considers it. `choose`, `choose_backend`, the cost model and
`attention`'s fallback read those declarations, so a backend registered with the right
declarations takes part in `auto` with no change to the dispatch (checked here with a
backend made up for the test).
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

import maskc
from maskc.kernels import api, common

API_SOURCE = pathlib.Path(api.__file__)
# The functions through which `auto` picks and runs a backend.
DISPATCH = ("choose", "choose_backend", "gpu_cost", "gpu_costs", "attention", "default_blocks",
            "_refusal", "_candidates", "_where")


def loaded_modules():
  """Each registered backend's module, where its packages import here."""
  out = {}
  for name, b in api.BACKENDS.items():
    try:
      out[name] = b.load()
    except maskc.BackendError:  # an optional package missing (splash_tokamax without tokamax)
      continue
  return out


def test_every_backend_declares_the_protocol():
  for name, mod in loaded_modules().items():
    for fn in ("run", "default_blocks", "refusal", "length_refusal", "installed",
               "forward_work"):
      assert callable(getattr(mod, fn, None)), (name, fn)
    assert mod.run_with_lse is None or callable(mod.run_with_lse), name
    assert mod.GPU_COST is None or (len(mod.GPU_COST) == 3
                                    and all(x > 0 for x in mod.GPU_COST)), name
    assert mod.BACKWARD_ENGINE is None or mod.BACKWARD_ENGINE in api.BACKENDS, name
    # `choose` calls every refusal with these keywords
    inspect.signature(mod.refusal).bind(None, head_dim=128, dtype=jnp.bfloat16, soft_cap=False,
                                        sinks=False)
    assert isinstance(mod.installed(), bool), name


def test_the_registry_is_consistent():
  platforms = {p for b in api.BACKENDS.values() for p in b.auto_on}
  assert platforms == {"cpu", "gpu", "tpu"}
  for p in platforms:  # one backend whose tiles `auto` compiles at, and `auto` may run it
    tiled = [b for b in api.BACKENDS.values() if p in b.compiles_for]
    assert len(tiled) == 1 and p in tiled[0].auto_on, p
  for b in api.BACKENDS.values():
    assert set(b.falls_back_to) <= set(api.BACKENDS) - {b.name}, b.name
    assert b.fallback is None or b.fallback in api.BACKENDS, b.name


def test_dispatch_names_no_backend():
  """The functions that pick and run a backend hold no backend's name: they read the
  declarations. (Before the protocol, `choose` and `attention` named flash, cudnn, xla.)"""
  tree = ast.parse(API_SOURCE.read_text(encoding="utf-8"))
  found = []
  for node in tree.body:
    if isinstance(node, ast.FunctionDef) and node.name in DISPATCH:
      body = node.body[1:] if ast.get_docstring(node) else node.body
      for sub in body:
        for c in ast.walk(sub):
          if isinstance(c, ast.Constant) and c.value in api.BACKENDS:
            found.append((node.name, c.value, c.lineno))
  assert not found, f"backend names in the dispatch: {found}"


# ----------------------------------------------------------------------------- a new backend


def _fake_module(gpu_cost, refuse=None, calls=None):
  """A backend module declaring the protocol: it records its runs and returns zeros."""
  mod = types.ModuleType("fake_engine")

  def run(q, k, v, bm, *, scale=None, logits_soft_cap=None, sinks=None, interpret=None):
    if calls is not None:
      calls.append("fake")
    return jnp.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)

  mod.run = run
  mod.run_with_lse = None
  mod.default_blocks = lambda q_len, kv_len: (64, 64)
  mod.refusal = lambda bm, *, head_dim, dtype, soft_cap=False, sinks=False: refuse
  mod.length_refusal = common.any_length
  mod.installed = common.installed
  mod.forward_work = common.tile_work
  mod.GPU_COST = gpu_cost
  mod.BACKWARD_ENGINE = "flash"
  return mod


def _register(monkeypatch, mod, **entry):
  monkeypatch.setitem(sys.modules, "fake_engine", mod)
  table = dict(api.BACKENDS)
  table["fake"] = api.Backend("fake", "fake_engine", "made up for the test", **entry)
  monkeypatch.setattr(api, "BACKENDS", types.MappingProxyType(table))


def test_a_registered_backend_takes_part_in_auto(monkeypatch):
  bm = maskc.compile("causal & chunk(256)", 1024, block_q=64, block_kv=64)
  before = api.choose(bm, platform="gpu")
  # ten times flash's rates: cheapest of all; its backward is flash's
  _register(monkeypatch, _fake_module((2780.0, 3110.0, 0.05)), auto_on=("gpu",),
            falls_back_to=("xla",))
  got = api.choose(bm, platform="gpu")
  assert got.backend == "fake" and f"{before.backend} " in got.reason, got.reason
  fwd, bwd = api.gpu_cost("fake", bm, 128)
  assert bwd == api.gpu_cost("flash", bm, 128)[1] and fwd < api.gpu_cost("flash", bm, 128)[0]
  # a refusal is reported, and the others compete as before
  _register(monkeypatch, _fake_module((2780.0, 3110.0, 0.05), refuse="not today"),
            auto_on=("gpu",))
  got = api.choose(bm, platform="gpu")
  assert got.backend == before.backend and "not fake: not today" in got.reason


def test_auto_falls_back_along_the_declared_chain(monkeypatch):
  """A pick that refuses at run time hands the call to its `falls_back_to`, in order."""
  calls: list[str] = []

  def refusing(*a, **kw):
    calls.append("refusing")
    raise maskc.BackendError("cannot here")

  first, second = _fake_module(None), _fake_module(None, calls=calls)
  first.run = refusing
  monkeypatch.setitem(sys.modules, "fake_first", first)
  monkeypatch.setitem(sys.modules, "fake_second", second)
  # first in the registry: uncosted candidates are taken in its order (before dense, xla)
  table = {"fake": api.Backend("fake", "fake_first", auto_on=("cpu",),
                               falls_back_to=("fake2",)),
           **api.BACKENDS, "fake2": api.Backend("fake2", "fake_second")}
  monkeypatch.setattr(api, "BACKENDS", types.MappingProxyType(table))
  monkeypatch.setattr(api, "platform", lambda: "cpu")
  bm = maskc.compile("causal", 512, block_q=64, block_kv=64)
  assert api.choose(bm).backend == "fake"
  x = jnp.ones((1, 512, 1, 8))
  out = api.attention(x, x, x, bm)
  assert calls == ["refusing", "fake"] and out.shape == x.shape
  with pytest.raises(maskc.BackendError, match="cannot here"):  # named: no fallback
    api.attention(x, x, x, bm, backend="fake")


# ----------------------------------------------------------------------------- defaults, names


def test_choose_defaults_to_head_dim_128_in_bfloat16():
  bm = maskc.compile("causal", 4096, block_q=64, block_kv=64)
  for platform in ("gpu", "cpu", "tpu"):
    assert api.choose(bm, platform=platform) == api.choose(
        bm, platform=platform, head_dim=128, dtype=jnp.bfloat16)
  assert (api.DEFAULT_HEAD_DIM, api.DEFAULT_DTYPE) == (128, jnp.bfloat16)
  # float32 rules cuDNN out: the default is not float32
  assert api.choose(bm, platform="gpu").backend == "cudnn"


def test_rings_on_cpu_never_run_dense():
  """`need_lse` keeps to backends with a log-sum-exp on every platform."""
  tiny = maskc.compile("causal", 64, block_q=16, block_kv=16)
  assert api.choose(tiny, platform="cpu").backend == "dense"
  got = api.choose(tiny, platform="cpu", need_lse=True)
  assert got.backend == "xla" and "not dense: no differentiable log-sum-exp" in got.reason


def test_a_misspelled_backend_gets_the_nearest_name():
  x = np.ones((1, 16, 1, 8), np.float32)
  with pytest.raises(maskc.BackendError, match="unknown attention backend 'cudn'") as e:
    maskc.attention(x, x, x, "causal", backend="cudn")
  assert "Did you mean 'cudnn'?" in e.value.hint
  with pytest.raises(maskc.BackendError) as e:
    api.check_backend("splash-jax")
  assert "Did you mean 'splash_jax'?" in e.value.hint
  with pytest.raises(maskc.BackendError) as e:
    api.check_backend("zzz")
  assert "Did you mean" not in e.value.hint and "Choose one of: auto, dense" in e.value.hint


def test_cudnn_off_a_gpu_says_so_before_anything_else():
  x = np.ones((1, 64, 1, 8), np.float32)  # float32 too: cuDNN would need a cast as well
  with pytest.raises(maskc.BackendError, match="runs on an NVIDIA GPU, and jax runs on cpu"):
    maskc.attention(x, x, x, "causal", backend="cudnn")


def test_rings_start_from_a_backend_with_a_log_sum_exp(monkeypatch):
  monkeypatch.setattr(api, "platform", lambda: "cpu")
  assert api.choose_backend("auto", 16, 16) == "dense"           # tiny: dense attention
  assert api.choose_backend("auto", 16, 16, need_lse=True) == "xla"
  assert api.choose_backend("auto", 4096, 4096, need_lse=True) == "xla"
