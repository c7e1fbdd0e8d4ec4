"""The Mosaic GPU kernel (`backend="mosaic_gpu"`) lowers for cuda, checked on a CPU-only machine.

`jit(f).trace(...).lower(lowering_platforms=("cuda",))` under the abstract H100 of
`cuda_lowering.CUDA_TARGET` runs Pallas Mosaic GPU's whole lowering of the kernel
body into the `mosaic_gpu_v2` custom call: a primitive without a Mosaic GPU lowering rule
(say, an integer op a predicate needs), a layout the kernel cannot take, or shared memory
over the H100's 227 KiB fails here as it would on the device. What this cannot show:
ptxas, numerics and speed (tests/test_gpu.py on a GPU; interpret mode does not run Mosaic
GPU's wgmma pipelines).

The kernel's own code needs no stub: unlike `attention_mgpu.py` it does not ask the CUDA
runtime for its version at trace time, so nothing is patched here.

Marker `lowering` (`make test-lowering`, in .venv-lowering with JAX's CUDA plugin). With
jax 0.10, Pallas Mosaic GPU imports absl, which jax does not declare: the lowering venv
installs it (maskc's `mosaic_gpu` extra).

The default run covers the matrix pairwise: every mask once, with dtypes, head dims and
heads rotating, then every dtype × head dim once with causal; forward alone, forward
with flash's backward (Triton `dq` and `dkv` calls beside the Mosaic GPU forward), and
forward with the opt-in Mosaic GPU backward (`mosaic_gpu.BACKWARD = "mosaic_gpu"`: three
`mosaic_gpu_v2` calls, forward, dq and dk/dv, no Triton; sinks included). The full
product (masks × dtypes × head dims × heads) is marked `slow` (`make test-slow`), for
both backward passes.
"""

from __future__ import annotations

import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maskc
from cuda_lowering import count_mosaic_gpu, count_triton, cuda_plugin, lower_for, operands  # noqa: F401  (cuda_plugin: a fixture)
from maskc.kernels import attention, compat
from maskc.kernels.mosaic_gpu import forward as mosaic_gpu

pytestmark = [pytest.mark.lowering,
              pytest.mark.usefixtures("cuda_plugin", "mosaic_gpu_imports")]

DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128, 256)
HEADS = ((4, 4), (4, 2), (4, 1))                 # MHA, GQA, MQA
LENGTH = 320                                     # not a multiple of the tiles

# (mask, the kind of read its PARTIAL tiles make)
MASKS = (
    ("causal", "positions only"),
    ("sliding(100) | sink(4)", "holes inside a row"),
    ("document(seg)", "per-token q and k reads"),
    ("causal | bidirectional(img)", "run ids of an operand"),
    ("causal & anc[q, k]", "pairwise"),
    ("causal & sel[q // 128, k // 128]", "tile-constant pairwise"),
    ("causal & k < n", "scalar"),
    ("causal & (q - k) % 4 == 0", "integer remainder"),
)


@pytest.fixture(scope="module")
def mosaic_gpu_imports():
  why = compat.mosaic_gpu_unavailable()
  if why is not None:
    pytest.fail(f"Pallas Mosaic GPU is not usable here: {why}. `make test-lowering` "
                "installs maskc's mosaic_gpu extra (absl-py) in .venv-lowering")


def mask_operands(length: int) -> dict:
  ops = operands(length)
  ops["n"] = np.int32(length - 37)
  return ops


def tiles_for(d: int, n: int) -> tuple[int, int]:
  """128 × 128 tiles, or 128 × 64 (every other case, and always at head dim 256, where two
  slots of 128 keys exceed shared memory)."""
  return (128, 64) if d == 256 or n % 2 else (128, 128)


def pairwise():
  """`(mask, dtype, head_dim, heads, cap, sinks)`: every mask once, then dtype × head dim."""
  cases = []
  for n, (mask, _) in enumerate(MASKS):
    cases.append((mask, DTYPES[n % 2], HEAD_DIMS[n % 3], HEADS[n % 3], n % 2 == 0, n % 4 == 3))
  for n, (dtype, d) in enumerate(itertools.product(DTYPES, HEAD_DIMS)):
    cases.append(("causal", dtype, d, HEADS[n % 3], n % 2 == 1, False))
  return cases


def product():
  return [(mask, dtype, d, heads, False, False)
          for (mask, _), dtype, d, heads in itertools.product(MASKS, DTYPES, HEAD_DIMS, HEADS)]


def case_id(case) -> str:
  mask, dtype, d, (h, hkv), cap, sinks = case
  return (f"{mask}|{jnp.dtype(dtype).name}|D{d}|H{h}/{hkv}{'|cap' if cap else ''}"
          f"{'|sinks' if sinks else ''}")


def compiled(mask: str, length: int, d: int, n: int = 0):
  m = maskc.parse(mask)
  ops = mask_operands(length)
  bq, bk = tiles_for(d, n)
  return maskc.compile(m, length, block_q=bq, block_kv=bk,
                       operands={s.name: ops[s.name] for s in m.operands})


@contextlib.contextmanager
def mosaic_backward():
  """Gradients of `backend="mosaic_gpu"` by its own (opt-in) Mosaic GPU backward."""
  saved = mosaic_gpu.BACKWARD
  mosaic_gpu.BACKWARD = "mosaic_gpu"
  try:
    yield
  finally:
    mosaic_gpu.BACKWARD = saved


def lowered(case, n: int = 0, backward: bool = True):
  """`(forward text, forward+backward text or None)` for one case."""
  mask, dtype, d, (h, hkv), cap, sinks = case
  bm = compiled(mask, LENGTH, d, n)
  sink = jnp.linspace(-1.0, 1.0, h) if sinks else None
  kw = dict(backend="mosaic_gpu", interpret=False, logits_soft_cap=2.0 if cap else None,
            sinks=sink)
  qs = jax.ShapeDtypeStruct((1, LENGTH, h, d), dtype)
  ks = jax.ShapeDtypeStruct((1, LENGTH, hkv, d), dtype)

  def fwd(q, k, v):
    return attention(q, k, v, bm, **kw)

  def bwd(q, k, v):
    return jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)

  return (lower_for("cuda", fwd, qs, ks, ks),
          lower_for("cuda", bwd, qs, ks, ks) if backward else None)


def check(case, n: int = 0):
  fwd, bwd = lowered(case, n, backward=not case[5])
  assert count_mosaic_gpu(fwd) == 1 and count_triton(fwd) == 0, case_id(case)
  if bwd is not None:               # flash's backward: dq and dkv
    assert count_mosaic_gpu(bwd) == 1 and count_triton(bwd) == 2, case_id(case)


def check_backward(case, n: int = 0):
  """The opt-in Mosaic GPU backward: forward, dq and dk/dv kernels, no Triton call (sinks
  included: their gradient is a reduction outside the kernels)."""
  with mosaic_backward():
    _, bwd = lowered(case, n)
  assert count_mosaic_gpu(bwd) == 3 and count_triton(bwd) == 0, case_id(case)


@pytest.mark.parametrize("n_case", list(enumerate(pairwise())),
                         ids=lambda nc: case_id(nc[1]))
def test_lowers_to_mosaic_gpu(n_case):
  n, case = n_case
  check(case, n)


@pytest.mark.slow
@pytest.mark.parametrize("case", product(), ids=case_id)
def test_full_matrix_lowers(case):
  check(case)


@pytest.mark.parametrize("n_case", list(enumerate(pairwise())),
                         ids=lambda nc: case_id(nc[1]))
def test_mosaic_backward_lowers(n_case):
  n, case = n_case
  check_backward(case, n)


@pytest.mark.slow
@pytest.mark.parametrize("case", product(), ids=case_id)
def test_mosaic_backward_full_matrix_lowers(case):
  check_backward(case)


def test_every_read_kind_is_in_the_matrix():
  """The matrix's masks make every kind of read a PARTIAL tile can make."""
  kinds = set()
  for mask, _ in MASKS:
    p = compiled(mask, LENGTH, 128).predicates[0]
    for kind, reads in (("q", p.q_reads), ("k", p.k_reads), ("scalar", p.scalars),
                        ("pair", p.pairs), ("tile", p.tile_pairs)):
      if reads:
        kinds.add(kind)
  assert kinds == {"q", "k", "scalar", "pair", "tile"}


@pytest.mark.parametrize("backward", ["forward", "mosaic backward"])
def test_batched_and_traced_operands_lower(backward):
  """Batched pairwise, tile-constant and per-token operands, traced under jit; with the
  Mosaic GPU backward, its gradients too (the dk/dv kernel reads the pairwise array
  transposed and walks the traced map's columns)."""
  rng = np.random.default_rng(1)
  anc = rng.random((2, 256, 256)) < 0.5
  sel = rng.random((2, 4, 4)) < 0.5
  seg = np.sort(rng.integers(0, 3, (2, 256)), -1).astype(np.int32)
  mask = "causal & (anc[q, k] | sel[q // 64, k // 64]) & document(seg)"
  qs = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
  ks = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)

  def f(q, k, v, anc, sel, seg):
    return maskc.attention(q, k, v, mask, operands={"anc": anc, "sel": sel, "seg": seg},
                           backend="mosaic_gpu", interpret=False, block_q=128, block_kv=128)

  if backward == "forward":
    assert count_mosaic_gpu(lower_for("cuda", f, qs, ks, ks, anc, sel, seg)) == 1
    return

  def g(q, k, v, anc, sel, seg):
    return jax.grad(lambda q, k, v: f(q, k, v, anc, sel, seg).astype(jnp.float32).sum(),
                    (0, 1, 2))(q, k, v)

  with mosaic_backward():
    text = lower_for("cuda", g, qs, ks, ks, anc, sel, seg)
  assert count_mosaic_gpu(text) == 3 and count_triton(text) == 0


def test_run_with_lse_lowers():
  bm = compiled("sliding(100) | sink(4)", LENGTH, 128)
  qs = jax.ShapeDtypeStruct((1, LENGTH, 4, 128), jnp.bfloat16)
  ks = jax.ShapeDtypeStruct((1, LENGTH, 2, 128), jnp.bfloat16)
  text = lower_for("cuda", lambda q, k, v: mosaic_gpu.run_with_lse(q, k, v, bm), qs, ks, ks)
  assert count_mosaic_gpu(text) == 1


def test_run_with_lse_gradient_lowers_with_the_mosaic_backward():
  """Both cotangents (out and lse) through the Mosaic GPU backward, with a soft cap."""
  bm = compiled("causal & document(seg)", LENGTH, 128)
  qs = jax.ShapeDtypeStruct((1, LENGTH, 4, 128), jnp.float16)
  ks = jax.ShapeDtypeStruct((1, LENGTH, 2, 128), jnp.float16)

  def loss(q, k, v):
    out, lse = mosaic_gpu.run_with_lse(q, k, v, bm, logits_soft_cap=3.0)
    return out.sum() + lse.sum()

  with mosaic_backward():
    text = lower_for("cuda", jax.grad(loss, (0, 1, 2)), qs, ks, ks)
  assert count_mosaic_gpu(text) == 3 and count_triton(text) == 0


def test_unknown_backward_refuses():
  bm = compiled("causal", LENGTH, 128)
  qs = jax.ShapeDtypeStruct((1, LENGTH, 2, 128), jnp.bfloat16)
  saved, mosaic_gpu.BACKWARD = mosaic_gpu.BACKWARD, "triton"
  try:
    with pytest.raises(maskc.MaskValueError, match="BACKWARD"):
      lower_for("cuda", lambda q, k, v: attention(q, k, v, bm, backend="mosaic_gpu",
                                                  interpret=False), qs, qs, qs)
  finally:
    mosaic_gpu.BACKWARD = saved


@pytest.mark.parametrize("what, kw, match", [
    ("float32", dict(dtype=jnp.float32), "bfloat16 and float16"),
    ("head dim 256 at 128-key tiles", dict(d=256, bk=128), "block_kv=64"),
    ("64 x 64 tiles", dict(bq=64, bk=64), "block_q=128"),
    ("interpret mode", dict(interpret=True), "interpret"),
])
def test_refusals_name_flash(what, kw, match):
  d = kw.get("d", 128)
  bm = maskc.compile("causal", LENGTH, block_q=kw.get("bq", 128), block_kv=kw.get("bk", 128))
  qs = jax.ShapeDtypeStruct((1, LENGTH, 2, d), kw.get("dtype", jnp.bfloat16))

  def f(q, k, v):
    return attention(q, k, v, bm, backend="mosaic_gpu", interpret=kw.get("interpret", False))

  with pytest.raises(maskc.BackendError, match=match) as err:
    lower_for("cuda", f, qs, qs, qs)
  assert "flash" in str(err.value), what


def test_gradients_with_sinks_refuse():
  bm = compiled("causal", LENGTH, 128)
  qs = jax.ShapeDtypeStruct((1, LENGTH, 2, 128), jnp.bfloat16)

  def g(q, k, v):
    out = attention(q, k, v, bm, backend="mosaic_gpu", interpret=False, sinks=jnp.zeros(2))
    return out.astype(jnp.float32).sum()

  with pytest.raises(maskc.BackendError, match="sinks"):
    lower_for("cuda", jax.grad(g), qs, qs, qs)


def test_lowers_without_the_ping_pong(monkeypatch):
  """The switch a first GPU session may flip if the kernel hangs lowers too."""
  monkeypatch.setattr(mosaic_gpu, "SCHEDULE_BARRIER", False)
  fwd, _ = lowered(("causal & document(seg)", jnp.bfloat16, 128, (4, 2), False, False),
                   backward=False)
  assert count_mosaic_gpu(fwd) == 1
