"""maskc.kernels.compat: the kernels on a JAX whose Pallas Triton backend is gone or an error.

The flash kernel is written for Pallas Triton, which JAX 0.11 deprecates. These tests
take the backend away (or accelerate its deprecation, on a JAX that has one) and check
that flash still interprets, refuses to compile for a GPU with a `BackendError`, and
that `auto` falls back to xla. Whether the deprecation warning is silenced is checked
where Triton lowers: tests/test_cross_lowering.py (`make test-lowering`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maskc
from maskc.kernels import api, compat
from maskc.kernels.flash import kernel as flash
from maskc.language.errors import BackendError


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float64])
def test_dot_without_triton_equals_tritons(monkeypatch, trans_a, trans_b, dtype):
  rng = np.random.default_rng(0)
  with jax.enable_x64(dtype == jnp.float64):
    a = jnp.asarray(rng.normal(size=(16, 32) if not trans_a else (32, 16)), dtype)
    b = jnp.asarray(rng.normal(size=(32, 8) if not trans_b else (8, 32)), dtype)
    want = compat.dot(a, b, trans_a=trans_a, trans_b=trans_b)
    monkeypatch.setattr(compat, "_triton", None)
    got = compat.dot(a, b, trans_a=trans_a, trans_b=trans_b)
  assert got.dtype == want.dtype
  ref = (np.asarray(a, np.float64).T if trans_a else np.asarray(a, np.float64)) @ (
      np.asarray(b, np.float64).T if trans_b else np.asarray(b, np.float64))
  np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-2, atol=1e-2)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.fixture(params=["removed", "accelerated"])
def no_triton(request, monkeypatch):
  """A JAX without a usable Triton backend: removed, or its deprecation made an error."""
  if request.param == "removed":
    monkeypatch.setattr(compat, "_triton", None)
  else:
    from jax._src import deprecations
    state = getattr(deprecations, "_registered_deprecations", {}).get(compat.TRITON_ID)
    if state is None:
      pytest.skip(f"jax {jax.__version__} has no {compat.TRITON_ID} deprecation")
    monkeypatch.setattr(state, "accelerated", True)
  return request.param


def _inputs(n=128, h=2, d=16):
  rng = np.random.default_rng(1)
  return [jnp.asarray(rng.normal(size=(1, n, h, d)), jnp.float32) for _ in range(3)]


def test_triton_available_here():
  assert compat.triton_unavailable() is None


def test_flash_interprets_without_triton(no_triton):
  why = {"removed": "has no Pallas Triton backend", "accelerated": "into an error"}[no_triton]
  assert why in compat.triton_unavailable()
  q, k, v = _inputs()
  bm = maskc.compile("sliding(40) | sink(2)", 128, block_q=32, block_kv=32)
  got = flash.run(q, k, v, bm, interpret=True)
  want = api.attention(q, k, v, bm, backend="dense")
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_flash_refuses_a_gpu_compile_without_triton(no_triton):
  q, k, v = _inputs()
  bm = maskc.compile("causal", 128, block_q=32, block_kv=32)
  with pytest.raises(BackendError, match="(?s)Pallas Triton.*backend=.xla."):
    flash.run(q, k, v, bm, interpret=False)


def test_auto_on_a_gpu_falls_back_to_xla_without_triton(no_triton, monkeypatch):
  monkeypatch.setattr(api, "platform", lambda: "gpu")
  monkeypatch.setattr(flash, "platform", lambda: "gpu")
  q, k, v = _inputs()
  bm = maskc.compile("causal & chunk(48)", 128, block_q=32, block_kv=32)
  got = api.attention(q, k, v, bm, backend="auto")
  want = api.attention(q, k, v, bm, backend="dense")
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
