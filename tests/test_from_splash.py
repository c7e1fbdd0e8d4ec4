"""`maskc.from_splash`: splash mask objects become maskc masks with the same array.

Every class and combination, random offsets, windows, chunks and shapes (wide, tall and
square): `materialize` of the result equals the object's own `mask[:, :]`. JAX's classes
always; tokamax's where tokamax is installed (Python 3.12 venvs).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import maskc

sm = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask")


def _modules():
  yield sm
  try:
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as tk
  except ImportError:
    return
  yield tk


MODULES = list(_modules())


def dense(obj) -> np.ndarray:
  return np.asarray(obj[(slice(None),) * len(obj.shape)], bool)


def assert_same(obj):
  got = maskc.from_splash(obj)
  np.testing.assert_array_equal(got.materialize(), dense(obj))
  # the masks compile too, and their maps' dense view agrees
  bm = got.compile(block_q=8, block_kv=8)
  np.testing.assert_array_equal(np.asarray(bm.to_dense()), dense(obj))
  return got


shapes = st.tuples(st.integers(1, 40), st.integers(1, 40))
sides = st.one_of(st.none(), st.integers(0, 12))


@st.composite
def leaf(draw, mod, shape):
  kind = draw(st.sampled_from(["full", "causal", "local", "chunked", "numpy"]))
  offset = draw(st.integers(-8, 8))
  if kind == "full":
    return mod.FullMask(shape)
  if kind == "causal":
    return mod.CausalMask(shape, offset=offset)
  if kind == "local":
    return mod.LocalMask(shape, window_size=(draw(sides), draw(sides)), offset=offset)
  if kind == "chunked":
    return mod.ChunkedCausalMask(shape, chunk_size=draw(st.integers(1, 9)))
  seed = draw(st.integers(0, 2**16))
  return mod.NumpyMask(np.random.default_rng(seed).random(shape) < 0.4)


@st.composite
def tree(draw, mod, shape, depth=2):
  if depth == 0 or draw(st.booleans()):
    return draw(leaf(mod, shape))
  a, b = draw(tree(mod, shape, depth - 1)), draw(tree(mod, shape, depth - 1))
  return a & b if draw(st.booleans()) else a | b


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__.split(".")[0])
@given(data=st.data(), shape=shapes)
@settings(max_examples=60, deadline=None)
def test_random_masks_and_combinations(mod, data, shape):
  assert_same(data.draw(tree(mod, shape)))


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__.split(".")[0])
@given(data=st.data(), shape=shapes, heads=st.integers(1, 4))
@settings(max_examples=25, deadline=None)
def test_multi_head_masks(mod, data, shape, heads):
  if not hasattr(mod, "MultiHeadMask"):
    pytest.skip("tokamax's splash has no MultiHeadMask: one mask serves every head")
  obj = mod.MultiHeadMask([data.draw(tree(mod, shape, 1)) for _ in range(heads)])
  got = assert_same(obj)
  assert isinstance(got.mask, tuple) and len(got.mask) == heads


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__.split(".")[0])
def test_offsets_map_to_maskc_alignment(mod):
  # bottom-right: a causal mask with offset kv_len - q_len is maskc's causal
  assert str(maskc.from_splash(mod.CausalMask((4, 10), offset=6)).mask) == "causal"
  assert str(maskc.from_splash(mod.CausalMask((4, 10), offset=0)).mask) == "k <= q - 6"
  assert str(maskc.from_splash(mod.LocalMask((8, 8), (3, 0), offset=0)).mask) == "local(3, 0)"
  assert str(maskc.from_splash(mod.ChunkedCausalMask((8, 8), 4)).mask) == "causal & chunk(4)"
  assert str(maskc.from_splash(mod.FullMask((3, 5))).mask) == "full"


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__.split(".")[0])
def test_numpy_masks_become_pair_operands_shared_by_equal_arrays(mod):
  arr = np.tri(6, 6, dtype=bool)
  got = assert_same((mod.NumpyMask(arr) | mod.NumpyMask(~arr)) & mod.NumpyMask(arr.copy()))
  assert sorted(got.operands) == ["splash_array0", "splash_array1"]
  assert str(got.mask).count("splash_array0") == 2


def test_refuses_unknown_classes():
  class Mine(sm.CausalMask):  # a subclass may compute anything
    pass

  with pytest.raises(maskc.MaskTypeError, match="does not know"):
    maskc.from_splash(Mine((4, 4)))
  with pytest.raises(maskc.MaskTypeError, match="splash mask"):
    maskc.from_splash(np.ones((4, 4), bool))
  with pytest.raises(maskc.MaskTypeError, match="does not know"):
    maskc.from_splash(sm.CausalMask((4, 4)) & Mine((4, 4)))


def test_refuses_permuted_rows():
  m = sm.CausalMask((8, 8))
  m.q_sequence = np.array([0, 1, 6, 7, 2, 3, 4, 5], np.int32)
  with pytest.raises(maskc.MaskValueError, match="q_sequence"):
    maskc.from_splash(m)


def test_import_maskc_loads_no_splash_module_of_its_own():
  import subprocess
  import sys
  code = ("import sys, maskc; print(any(m.startswith('tokamax') for m in sys.modules), "
          "'maskc.formats.splash' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.split() == ["False", "True"]
