"""Soundness and exactness of compiled tile maps over masks of several operands of each kind.

The property: no EMPTY tile holds an allowed pair and no FULL tile a disallowed one,
for any mask `maskc.testing.masks()` draws (named calls and their expansions, `~`
and `^` over every leaf, two segment-id and three image-span operands), at any
shape (offsets, `q_len` of 1, tiles larger than the shape), on the static path and
under `jit`. Masks built from prelude masks alone with `& | ^ ~` over static operands
are exact too: no PARTIAL tile is uniform.

`tests/cases/lowering_regression.json` holds masks an outside campaign found unsound
or inexact; each must now be both sound and exact.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import maskc
from helpers import assert_exact, assert_sound
from maskc import testing
from maskc.language import ir
from sampling import PARTS, count

CASES = json.loads((pathlib.Path(__file__).parent / "cases" / "lowering_regression.json")
                   .read_text())

BLOCKS = [1, 2, 3, 4, 8, 16, 64]  # 64 is larger than every shape drawn


def _operands(record: dict) -> dict[str, np.ndarray]:
  return {name: np.asarray(v["values"], dtype=v["dtype"]).reshape(v["shape"])
          for name, v in record["operands"].items()}


@pytest.mark.parametrize("record", CASES, ids=[f"{i}-{c['finding'].split()[0]}"
                                               for i, c in enumerate(CASES)])
def test_regression_cases_are_sound_and_exact(record):
  mask = maskc.parse(record["mask"], **record["params"])
  assert ir.is_prelude_only(mask)  # so the exactness promise covers it
  kw = dict(q_offset=record["q_offset"], operands=_operands(record))
  q_len, kv_len, bq, bk = (record[n] for n in ("q_len", "kv_len", "block_q", "block_kv"))
  bm = maskc.compile(mask, q_len, kv_len, block_q=bq, block_kv=bk, **kw)
  dense = np.asarray(maskc.materialize(mask, q_len, kv_len, **kw))
  assert_exact(np.asarray(bm.grid), dense, bq, bk, record["mask"])


def test_two_image_operands_under_not_attend_every_allowed_key():
  # A tile map with tiles (4, 0)-(4, 3) EMPTY made every block-sparse backend skip keys
  # 3..29 of rows 32..39, which lie in one image run and one run of `g`.
  img = np.zeros(64, bool)
  img[3:40] = True
  g = np.zeros(64, bool)
  g[10:20] = True
  g[30:50] = True
  text, ops = "bidirectional(img) & ~bidirectional(g)", {"img": img, "g": g}
  bm = maskc.compile(text, 64, block_q=8, block_kv=8, operands=ops)
  dense = np.asarray(maskc.materialize(text, 64, operands=ops))
  assert_exact(np.asarray(bm.grid), dense, 8, 8)
  assert dense[32:40, 3:30].all() and np.asarray(bm.grid)[4, :4].tolist() == [1, 2, 2, 1]


@st.composite
def setups(draw, max_depth: int = 3, max_len: int = 40):
  """(mask, q_len, kv_len, q_offset, block_q, block_kv, operands)."""
  mask = draw(testing.masks(max_depth=max_depth), label="mask")
  q_len, kv_len, q_offset = draw(testing.shapes(max_len=max_len), label="shape")
  ops = draw(testing.operand_values(mask, (q_len, kv_len, q_offset)), label="operands")
  bq, bk = draw(st.sampled_from(BLOCKS), label="block_q"), draw(st.sampled_from(BLOCKS),
                                                                label="block_kv")
  return mask, q_len, kv_len, q_offset, bq, bk, ops


def check_static(s) -> None:
  mask, q_len, kv_len, q_offset, bq, bk, ops = s
  bm = maskc.compile(mask, q_len, kv_len, block_q=bq, block_kv=bk, q_offset=q_offset,
                     operands=ops)
  dense = np.asarray(maskc.materialize(mask, q_len, kv_len, q_offset=q_offset, operands=ops))
  grid = np.asarray(bm.grid)
  if ir.is_prelude_only(mask):
    assert_exact(grid, dense, bq, bk, str(mask))
  else:
    assert_sound(grid, dense, bq, bk, str(mask))


def check_traced(s) -> None:
  mask, q_len, kv_len, q_offset, bq, bk, ops = s

  @jax.jit
  def grid(ops):
    return maskc.compile(mask, q_len, kv_len, block_q=bq, block_kv=bk, q_offset=q_offset,
                         operands=ops).grid

  dense = np.asarray(maskc.materialize(mask, q_len, kv_len, q_offset=q_offset, operands=ops))
  assert_sound(np.asarray(grid(ops)), dense, bq, bk, str(mask))


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                       HealthCheck.filter_too_much])


# About 10 ms an example: the default run draws 600, `make test-slow` 5,000 more.
@settings(max_examples=600, **_SETTINGS)
@given(setups())
def test_static_maps_are_sound_and_prelude_maps_exact(s):
  check_static(s)


@pytest.mark.slow
@settings(max_examples=5000, **_SETTINGS)
@given(setups(max_len=64))
def test_static_maps_are_sound_and_prelude_maps_exact_long(s):
  check_static(s)


@pytest.mark.parametrize("part", PARTS)
def test_traced_maps_are_sound(part):
  # a jit compile per example: the default run draws a share (sampling.py)
  @settings(max_examples=count(30, part), **_SETTINGS)
  @given(setups(max_depth=2))
  def check(s):
    check_traced(s)
  check()


@pytest.mark.parametrize("backend, block, scale", [("xla", 8, 1), ("flash", 16, 2),
                                                   ("splash", 128, 16)])
def test_two_image_operands_under_not_give_dense_attention_on_every_backend(backend, block,
                                                                              scale):
  # The repro at tiles each backend takes (scaled so the same spans cross the same tiles):
  # block-sparse backends skipped allowed keys wherever the map said EMPTY.
  n = 64 * scale
  img = np.zeros(n, bool)
  img[3 * scale:40 * scale] = True
  g = np.zeros(n, bool)
  g[10 * scale:20 * scale] = True
  g[30 * scale:50 * scale] = True
  text, ops = "bidirectional(img) & ~bidirectional(g)", {"img": img, "g": g}
  bm = maskc.compile(text, n, block_q=block, block_kv=block, operands=ops)
  dense = np.asarray(maskc.materialize(text, n, operands=ops))
  assert_exact(np.asarray(bm.grid), dense, block, block)
  x = np.random.default_rng(0).standard_normal((1, n, 1, 16)).astype(np.float32)
  got = maskc.attention(x, x, x, bm, backend=backend)
  want = maskc.attention(x, x, x, text, operands=ops, backend="dense")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
