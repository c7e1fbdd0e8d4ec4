"""The Pallas kernels lower for their hardware, checked on a CPU-only machine.

`jax.jit(f).trace(...).lower(lowering_platforms=(...,))` runs each kernel's real
lowering without the device: flash through Pallas' Triton lowering to an
`xla.gpu.triton` custom call (cuda), splash through Mosaic to a
`tpu_custom_call` (tpu). A mask, operand kind, dtype, head dimension or tile
size the lowering rejects (Triton's power-of-two blocks, Mosaic's layouts) fails
here, as it would on the device. What this cannot show: numerics and speed on
the device (the interpret-mode tests in test_kernels.py check numerics).

- TPU (`TestSplashLowersForTpu`): needs nothing beyond jax, so it runs in the
  default suite.
- CUDA (`TestFlashLowersForCuda`, marker `lowering`): needs `jax-cuda12-plugin` and
  `jax-cuda12-pjrt` of the installed jax version, installed without their CUDA
  libraries. Importing the plugin on a machine without CUDA prints errors, so it
  lives in its own environment: `make test-lowering` builds `.venv-lowering` and
  runs these with `JAX_PLATFORMS=cpu`; the default run deselects the marker.

The matrix is pairwise, not the full product: every mask once with rotating
dtypes, head dims, heads, soft cap, sinks and tiles, then every dtype × head
dimension once, forward and backward each.

Known limit: a mask whose in-kernel predicate divides integers (`chunk(c)`, and
splash's own `ChunkedCausalMask`) does not lower for tpu on a CPU host: Mosaic's
integer division asks for the TPU generation, which a CPU host has none of. Such
masks are left out of the TPU matrix (`test_chunked_needs_a_tpu_generation`
records the limit, so a JAX that lifts it shows up here).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maskc
from cuda_lowering import count_triton, cuda_plugin, lower_for, operands  # noqa: F401
from maskc.kernels import attention

DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
HEAD_DIMS = (64, 96, 128, 256)
HEADS = ((4, 1), (2, 2), (4, 2))              # (query heads, key heads): MQA, MHA, GQA


# (mask, what it exercises): prelude masks, token operands, documents, image spans,
# dilated, pairwise and block-pairwise operands.
MASKS = (
    ("causal", "prelude"),
    ("sliding(100) | sink(4)", "prelude"),
    ("local(40, 8) | global(3)", "prelude"),
    ("causal & document(seg)", "documents"),
    ("causal | bidirectional(img)", "image spans"),
    ("causal & (q - k) % 4 == 0", "dilated"),
    ("causal & seg[q] >= seg[k] - 1", "token operands"),
    ("causal & anc[q, k]", "pairwise"),
    ("causal & sel[q // 64, k // 64]", "block-pairwise"),
)


def matrix(tiles: tuple[tuple[int, int], ...], masks=MASKS):
  """Pairwise cases: `(mask, dtype, head_dim, heads, cap, sinks, tiles)`."""
  cases = []
  for n, (mask, _) in enumerate(masks):
    cases.append((mask, DTYPES[n % 3], HEAD_DIMS[n % 4], HEADS[n % 3], n % 2 == 0,
                  (n // 2) % 2 == 1, tiles[n % len(tiles)]))
  for n, (dtype, d) in enumerate(itertools.product(DTYPES, HEAD_DIMS)):
    cases.append(("causal", dtype, d, HEADS[n % 3], n % 2 == 1, n % 3 == 0,
                  tiles[n % len(tiles)]))
  return cases


def case_id(case) -> str:
  mask, dtype, d, (h, hkv), cap, sinks, (bq, bk) = case
  return (f"{mask}|{jnp.dtype(dtype).name}|D{d}|H{h}/{hkv}|{'cap|' if cap else ''}"
          f"{'sinks|' if sinks else ''}{bq}x{bk}")


def lowered(backend: str, platform: str, case, length: int, interpret: bool = False) -> str:
  """The lowered module text of forward and of forward+backward for one case."""
  mask, dtype, d, (h, hkv), cap, sinks, (bq, bk) = case
  ops = operands(length)
  m = maskc.parse(mask)
  bm = maskc.compile(m, length, block_q=bq, block_kv=bk,
                     operands={s.name: ops[s.name] for s in m.operands})
  kw = dict(backend=backend, interpret=interpret, logits_soft_cap=2.0 if cap else None)
  sink = jnp.linspace(-1.0, 1.0, h) if sinks else None
  qs = jax.ShapeDtypeStruct((1, length, h, d), dtype)
  ks = jax.ShapeDtypeStruct((1, length, hkv, d), dtype)

  def fwd(q, k, v):
    return attention(q, k, v, bm, sinks=sink, **kw)

  def bwd(q, k, v):
    return jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)

  return tuple(lower_for(platform, f, qs, ks, ks) for f in (fwd, bwd))


# ----------------------------------------------------------------------------- tpu


class TestSplashLowersForTpu:
  """JAX's splash (`splash_jax`, our MaskInfo) → Mosaic `tpu_custom_call`, fwd and bwd.

  tokamax's kernel (fused backward: two calls) is lowered in tests/test_tokamax_splash.py.
  """

  length = 512

  @pytest.mark.parametrize("case", matrix(((128, 128), (256, 128), (128, 256))), ids=case_id)
  def test_lowers_to_mosaic(self, case):
    fwd, bwd = lowered("splash_jax", "tpu", case, self.length)
    assert fwd.count("tpu_custom_call") == 1, case_id(case)
    assert bwd.count("tpu_custom_call") == 3, case_id(case)       # fwd, dq, dkv

  @pytest.mark.parametrize("mask", ["sliding(100) | sink(4)", "causal & anc[q, k]",
                                    "causal & document(seg)"])
  def test_ragged_lengths_lower(self, mask):
    """Lengths off the tiles: the adapter pads them, and the padded kernel lowers."""
    case = (mask, jnp.bfloat16, 128, (4, 2), False, True, (128, 128))
    fwd, bwd = lowered("splash_jax", "tpu", case, 400)
    assert fwd.count("tpu_custom_call") == 1
    assert bwd.count("tpu_custom_call") == 3

  def test_batched_document_ids_lower(self):
    seg = np.stack([np.repeat(np.arange(4), 128), np.repeat(np.arange(2), 256)]).astype(np.int32)
    bm = maskc.compile("causal & document(seg)", 512, block_q=128, block_kv=128,
                       operands={"seg": seg})
    qs = jax.ShapeDtypeStruct((2, 512, 2, 128), jnp.bfloat16)
    def f(q, k, v):
      return attention(q, k, v, bm, backend="splash_jax", interpret=False)
    text = lower_for("tpu", f, qs, qs, qs)
    assert text.count("tpu_custom_call") == 1

  def test_interpret_mode_lowers_no_kernel(self):
    """The check can fail: interpret mode lowers to plain HLO, with no custom call."""
    case = ("causal", jnp.float32, 128, (2, 2), False, False, (128, 128))
    fwd, _ = lowered("splash_jax", "tpu", case, self.length, interpret=True)
    assert "tpu_custom_call" not in fwd

  def test_chunked_needs_a_tpu_generation(self):
    case = ("causal & chunk(128)", jnp.bfloat16, 128, (2, 2), False, False, (128, 128))
    with pytest.raises(ValueError, match="TPU device kind"):
      lowered("splash_jax", "tpu", case, self.length)


def traced_lowering_text(platform: str, mask: str = "(q - k) % 2 == 0 | bidirectional(img)"
                         ) -> str:
  """StableHLO of a traced lowering (`jit` over the operands) for `platform`: by default
  image spans read through run labels counted from bit words, lines of 128 tiles whose
  runs are read from bit words, the ambiguous tiles' top_k and the sorts behind them."""

  def rows(img):
    return maskc.compile(mask, 2048, block_q=16, block_kv=16, operands={"img": img}).rows

  spec = jax.ShapeDtypeStruct((2, 2048), jnp.int32)
  return lower_for(platform, rows, spec)


def test_traced_lowering_lowers_for_tpu():
  assert "popcnt" in traced_lowering_text("tpu")


def test_traced_widened_band_lowers_for_tpu():
  """`causal & chunk(1024) | bidirectional(img)` under `jit` takes the widened band
  (`maskc.lowering.closed_forms.widened_band`, traced): its reductions and scans over the lines
  lower too."""
  text = traced_lowering_text("tpu", "causal & chunk(1024) | bidirectional(img)")
  assert "stablehlo.reduce" in text and "popcnt" not in text


# ----------------------------------------------------------------------------- cuda


@pytest.mark.lowering
@pytest.mark.usefixtures("cuda_plugin")
class TestFlashLowersForCuda:
  """Flash (Pallas) → Triton `xla.gpu.triton` custom calls, fwd and bwd."""

  length = 320          # not a multiple of the tiles: the padded path lowers too

  @pytest.mark.parametrize("case", matrix(((64, 64), (128, 64), (32, 128), (16, 16))),
                           ids=case_id)
  def test_lowers_to_triton(self, case):
    fwd, bwd = lowered("flash", "cuda", case, self.length)
    assert count_triton(fwd) == 1, case_id(case)
    assert count_triton(bwd) == 3, case_id(case)                  # fwd, dq, dkv

  def test_traced_lowering_lowers(self):
    assert "popcnt" in traced_lowering_text("cuda")

  def test_batched_pairwise_and_traced_operands_lower(self):
    rng = np.random.default_rng(1)
    anc = rng.random((2, 256, 256)) < 0.5
    sel = rng.random((2, 4, 4)) < 0.5
    mask = "causal & (anc[q, k] | sel[q // 64, k // 64]) & document(seg)"
    qs = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
    ks = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
    seg = np.sort(rng.integers(0, 3, (2, 256)), -1).astype(np.int32)

    def f(q, k, v, anc, sel, seg):
      return maskc.attention(q, k, v, mask, operands={"anc": anc, "sel": sel, "seg": seg},
                             backend="flash", interpret=False, block_q=64, block_kv=64)

    def g(*a):
      return jax.grad(lambda q, k, v, *r: f(q, k, v, *r).astype(jnp.float32).sum(),
                                (0, 1, 2))(*a)
    for fn, calls in ((f, 1), (g, 3)):
      text = lower_for("cuda", fn, qs, ks, ks, anc, sel, seg)
      assert count_triton(text) == calls

  def test_interpret_mode_lowers_no_kernel(self):
    """The check can fail: interpret mode lowers to plain HLO, with no Triton call."""
    case = ("causal", jnp.float32, 64, (2, 2), False, False, (64, 64))
    fwd, _ = lowered("flash", "cuda", case, self.length, interpret=True)
    assert count_triton(fwd) == 0

  # Flash-decoding (maskc.kernels.flash.decode): a decode step's one q tile of a few rows
  # (block_q = q_len, the kernel's tile 16 rows) over a cache of many 64-key tiles, split
  # (`splits`; None: the heuristic's pick). (mask, dtype, head dim, heads, cap, sinks, q_len,
  # splits, traced: the map compiled under jit from a traced offset and operands, as
  # maskc.flax's step does.)
  DECODE = (
      ("causal & (q - k) % 4 != 1", jnp.bfloat16, 128, (8, 2), True, True, 1, None, False),
      ("causal & (document(seg) | anc[q, k])", jnp.float16, 64, (4, 1), False, False, 4, 3,
       False),
      ("causal & sel[q // 64, k // 64]", jnp.float32, 96, (2, 2), True, False, 2, 5, False),
      ("causal & document(seg) & k < n", jnp.bfloat16, 128, (8, 1), False, True, 1, None, True),
  )

  @pytest.mark.parametrize("case", DECODE, ids=lambda c: f"{c[0]}|L{c[6]}|S{c[7]}")
  def test_split_decode_lowers_to_triton(self, case):
    from maskc.kernels.flash import kernel as flash
    mask, dtype, d, (h, hkv), cap, sinks, lq, splits, traced = case
    lkv = 1000                                   # 16 key tiles of 64, the last one ragged
    ops = {n: a for n, a in operands(lkv).items() if f"{n}[" in mask or f"({n})" in mask}
    if " n" in mask:
      ops["n"] = np.int32(lkv - 10)
    sink = jnp.linspace(-1.0, 1.0, h) if sinks else None
    qs = jax.ShapeDtypeStruct((1, lq, h, d), dtype)
    ks = jax.ShapeDtypeStruct((1, lkv, hkv, d), dtype)

    def fwd(q, k, v, ops, offset):
      bm = maskc.compile(mask, lq, lkv, block_q=lq, block_kv=64, operands=ops, q_offset=offset)
      assert bm.is_static != traced
      return flash.run(q, k, v, bm, logits_soft_cap=2.0 if cap else None, sinks=sink,
                       interpret=False, splits=splits)

    def bwd(q, k, v, ops, offset):
      def loss(q, k, v):
        return fwd(q, k, v, ops, offset).astype(jnp.float32).sum()
      return jax.grad(loss, (0, 1, 2))(q, k, v)

    for fn, calls in ((fwd, 1), (bwd, 3)):                # split forward (+ dq, dkv)
      if traced:
        args = ({n: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype)
                 for n, a in ops.items()}, jax.ShapeDtypeStruct((), jnp.int32))
        text = lower_for("cuda", fn, qs, ks, ks, *args)
      else:
        text = lower_for("cuda", lambda q, k, v, fn=fn: fn(q, k, v, ops, lkv - lq), qs, ks, ks)
      assert count_triton(text) == calls, case
      assert "maskc_flash_fwd_split" in text, case


# The Triton deprecation (jax >= 0.11): maskc silences it once flash is loaded, and only it.
QUIET_THEN_LOUD = """
import warnings, jax, jax.numpy as jnp, maskc
from maskc.kernels import attention, compat
from cuda_lowering import lower_for
def lower(n):
  bm = maskc.compile("causal", n, block_q=64, block_kv=64)
  x = jax.ShapeDtypeStruct((1, n, 2, 64), jnp.bfloat16)
  f = lambda q, k, v: attention(q, k, v, bm, backend="flash", interpret=False)
  return lower_for("cuda", f, x, x, x)
assert "xla.gpu.triton" in lower(128)            # -W error::DeprecationWarning: no warning
warnings.filterwarnings("error", message=compat.TRITON_DEPRECATION)
try:
  lower(192)
except DeprecationWarning as e:
  print("LOUD:", e)
"""


@pytest.mark.lowering
@pytest.mark.usefixtures("cuda_plugin")
def test_triton_deprecation_is_silenced_only_by_maskc():
  """Under `-W error::DeprecationWarning` flash lowers; the warning is JAX's, and it is there."""
  import subprocess
  import sys
  run = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", QUIET_THEN_LOUD],
                       capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).parent)
  assert run.returncode == 0, run.stderr[-3000:]
  from jax._src import deprecations
  if "jax-pallas-triton" in getattr(deprecations, "_registered_deprecations", {}):
    assert "LOUD: The Pallas Triton backend is deprecated" in run.stdout, run.stdout
  else:                                       # jax 0.10: the backend is not deprecated yet
    assert "LOUD" not in run.stdout, run.stdout
