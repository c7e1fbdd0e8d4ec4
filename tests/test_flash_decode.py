"""Flash-decoding in the flash kernel (`maskc.kernels.flash.decode`), in interpret mode.

A decode step's map has one q tile of a few rows over many key tiles; the forward pass
splits each q tile's key tiles into `S` shares and merges them by log-sum-exp. Checked
here: the split output equals the unsplit kernel's (`splits=1`, today's single walk) and
the dense reference, for decode shapes (1-4 query rows at the end of a cache of hundreds
of keys, ragged lengths, traced maps as `maskc.flax` compiles them inside its step, every
kind of read, sinks, soft caps, GQA, empty rows); gradients through it; `run_with_lse`
split; that the result does not depend on `S` (a property over `S`, shares of zero tiles
included); the combine alone against one softmax; and the heuristic's choices.

The default run takes one case of most tests (about 15 s on 2 cores); `-m slow` the rest.
"""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import maskc
from attention_reference import NEG_LSE, jnp_reference, numpy_reference
from helpers import assert_close
from maskc.kernels.flash import decode as flash_decode, kernel as flash

TOL = 1e-5
BF16_TOL = 2e-2
BK = 16       # key tiles of 16: a cache of 300 keys is 19 of them


def qkv(seed: int, b: int, lq: int, lkv: int, h: int, hkv: int, d: int = 16,
        dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, lq, h, d), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (b, lkv, hkv, d), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, lkv, hkv, d), jnp.float32).astype(dtype)
  w = jax.random.normal(ks[3], (b, lq, h, d), jnp.float32)
  return q, k, v, w


def operands(kind: str, b: int, lq: int, lkv: int, seed: int) -> dict[str, np.ndarray]:
  """The case's operands: documents `seg` (batched), pairwise `anc` and tile-constant `sel`
  at absolute positions, per-row cache lengths `n` (the second row's cache a third full),
  per-row query positions `qpos` (a ragged batch: the second row halfway)."""
  rng = np.random.default_rng(seed)
  out: dict[str, np.ndarray] = {}
  if "seg" in kind:
    out["seg"] = np.sort(rng.integers(0, 4, (b, lkv)), -1).astype(np.int32)
  if "anc" in kind:
    out["anc"] = rng.random((lkv, lkv)) < 0.4
  if "sel" in kind:
    out["sel"] = rng.random((-(-lkv // BK), -(-lkv // BK))) < 0.5
  if "n" in kind.split("+"):
    out["n"] = np.array([lkv - 7, lkv // 3][:b], np.int32)
  if "qpos" in kind:
    ends = np.array([lkv - lq, lkv // 2][:b])
    out["qpos"] = (ends[:, None] + np.arange(lq)[None]).astype(np.int32)
  return out


# (id, mask, q_len, kv_len, (heads, kv heads), operands, soft cap, sinks, traced). The
# default run takes the first here and in the property over S (its documents batched, so
# the two rows' lists differ in length and one is padded), the second in the gradient test.
CASES = [
    ("pairwise-documents", "causal & (document(seg) | anc[q, k])", 3, 250, (2, 1), "seg+anc",
     None, False, False),
    ("window-sinks-gqa", "sliding(100) | sink(4)", 1, 300, (4, 2), "", 5.0, True, False),
    ("traced-documents-cache-len", "causal & document(seg) & k < n", 2, 250, (4, 1), "seg+n",
     None, False, True),
    ("tile-pairs", "causal & sel[q // 16, k // 16]", 4, 260, (2, 2), "sel", None, False, False),
    ("token-reads-cap", "causal & seg[q] >= seg[k] - 1", 2, 300, (2, 1), "seg", 3.0, False,
     False),
    ("ragged-positions", "causal & k < n", 2, 280, (2, 1), "n+qpos", None, True, True),
    ("traced-pairwise-sinks", "causal & anc[q, k] | sink(2)", 1, 200, (4, 2), "anc", 2.0, True,
     True),
    ("empty-row", "causal & k < n & k >= 150", 1, 300, (2, 1), "n", None, False, False),
]
DEFAULT = 1


def case_sinks(case):
  """The case's sink logits `[H]`, or None."""
  return jnp.linspace(-1.0, 1.0, case[4][0]) if case[7] else None


def attend(case, q, k, v, *, splits, backend: str = "flash", sinks=None):
  """The case's attention through flash with `splits` (or the dense backend); `sinks`
  default to the case's."""
  _, mask, lq, lkv, _, kind, cap, _, traced = case
  ops = operands(kind, q.shape[0], lq, lkv, lq + lkv)
  qpos = ops.pop("qpos", None)
  offset = None if qpos is not None else lkv - lq
  sinks = case_sinks(case) if sinks is None else sinks
  if backend == "dense":
    return maskc.attention(q, k, v, mask, backend="dense", operands=ops, q_offset=offset,
                           q_positions=qpos, logits_soft_cap=cap, sinks=sinks)

  def run(q, k, v, ops, offset, qpos):
    # block_q = q_len, as maskc.flax compiles a decode step; the kernel pads it to 16 rows
    bm = maskc.compile(mask, lq, lkv, block_q=lq, block_kv=BK, operands=ops, q_offset=offset,
                       q_positions=qpos)
    assert bm.n_q_tiles == 1 and bm.is_static != traced
    return flash.run(q, k, v, bm, logits_soft_cap=cap, sinks=sinks, interpret=True,
                     splits=splits)

  if not traced:
    return run(q, k, v, ops, offset, qpos)
  # as maskc.flax's step: operands, offset and positions traced, the map compiled inside
  traced_run = jax.jit(lambda q, k, v, ops, offset, qpos: run(q, k, v, ops, offset, qpos))
  return traced_run(q, k, v, {n: jnp.asarray(a) for n, a in ops.items()},
                    None if offset is None else jnp.int32(offset),
                    None if qpos is None else jnp.asarray(qpos))


def case_inputs(case, dtype=jnp.float32):
  name, _, lq, lkv, (h, hkv), *_ = case
  return qkv(len(name), 2, lq, lkv, h, hkv, dtype=dtype)


@functools.cache
def _unsplit(i: int) -> np.ndarray:
  """Case `i`'s rows through the unsplit kernel (computed once for the tests that share it)."""
  case = CASES[i]
  return np.asarray(attend(case, *case_inputs(case)[:3], splits=1))


@pytest.mark.parametrize("i", [pytest.param(i, id=c[0], marks=() if i < DEFAULT else
                                            pytest.mark.slow) for i, c in enumerate(CASES)])
def test_split_equals_unsplit_and_dense(i):
  case = CASES[i]
  q, k, v, _ = case_inputs(case)
  split = attend(case, q, k, v, splits=5)
  assert_close(split, _unsplit(i), TOL, f"{case[0]}: split vs unsplit")
  assert_close(split, attend(case, q, k, v, splits=None, backend="dense"), TOL,
               f"{case[0]}: split vs dense")


@pytest.mark.slow
def test_split_in_bfloat16_matches_dense():
  case = CASES[1]
  q, k, v, _ = case_inputs(case, jnp.bfloat16)
  out = attend(case, q, k, v, splits=4)
  assert out.dtype == jnp.bfloat16
  ref = attend(case, *(x.astype(jnp.float32) for x in (q, k, v)), splits=None, backend="dense")
  assert_close(out, ref, BF16_TOL, "bf16 split vs dense")


@pytest.mark.parametrize("case", [pytest.param(CASES[1], id=CASES[1][0],
                                               marks=pytest.mark.slow),
                                  pytest.param(CASES[2], id=CASES[2][0],
                                               marks=pytest.mark.slow)])
def test_gradients_through_the_split_forward(case):
  """jax.grad through a split forward (flash's backward on the combined output and lse)
  equals the dense reference's, the sinks' gradient included; so does the output."""
  q, k, v, w = case_inputs(case)
  sinks = case_sinks(case)
  args = (q, k, v) if sinks is None else (q, k, v, sinks)

  def out_and_grads(splits, backend="flash"):
    def loss(q, k, v, sinks=None):
      out = attend(case, q, k, v, splits=splits, backend=backend, sinks=sinks)
      return (out * w).sum(), out
    return jax.grad(loss, tuple(range(len(args))), has_aux=True)(*args)

  grads, out = out_and_grads(4)
  grads_ref, out_ref = out_and_grads(None, "dense")
  assert_close(out, out_ref, TOL, "out: split vs dense")
  for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, grads_ref):
    assert_close(g, r, TOL, f"{name}: split vs dense")


@pytest.mark.parametrize("with_grads", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_run_with_lse_split(with_grads):
  """`run_with_lse` split: values (`NEG_LSE` and zeros on a row with no key) against float64
  NumPy; gradients through both outputs against the dense jax.numpy formula's (slow)."""
  lq, lkv, h, hkv, cap = 2, 230, 2, 1, 4.0
  mask = "causal & k >= 60 & q >= 229"           # row 0 (position 228) sees no key
  q, k, v, w = qkv(3, 1, lq, lkv, h, hkv)
  c = jax.random.normal(jax.random.key(9), (1, lq, h))
  bm = maskc.compile(mask, lq, lkv, block_q=lq, block_kv=BK)
  allowed = np.asarray(maskc.materialize(mask, lq, lkv))

  def parts(fn):
    def loss(q, k, v):
      out, lse = fn(q, k, v)
      return (out * w).sum() + (lse * c).sum(), (out, lse)
    if not with_grads:
      return (*fn(q, k, v), None)
    (_, (out, lse)), g = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return out, lse, g

  out, lse, g = parts(lambda q, k, v: flash.run_with_lse(
      q, k, v, bm, logits_soft_cap=cap, interpret=True, splits=3))
  out64, lse64 = numpy_reference(q, k, v, allowed, 0.25, cap)
  empty = lse64 == NEG_LSE
  assert empty[0, 0].all() and not empty[0, 1].any()
  assert (np.asarray(lse)[empty] == np.float32(NEG_LSE)).all()
  assert not np.asarray(out[0, 0]).any()
  assert_close(out, out64, TOL, "out vs float64")
  assert_close(np.where(empty, 0, lse), np.where(empty, 0, lse64), TOL, "lse vs float64")
  if with_grads:
    _, _, g_ref = parts(lambda q, k, v: jnp_reference(q, k, v, allowed, 0.25, cap))
    for name, a, r in zip("qkv", g, g_ref):
      assert_close(a, r, TOL, f"d{name}: split vs dense")


def check_any_split(i: int, splits: int) -> None:
  """Any `S`, more shares than key tiles included (some then walk none), gives the unsplit
  kernel's rows."""
  case = CASES[i]
  out = attend(case, *case_inputs(case)[:3], splits=splits)
  assert_close(out, _unsplit(i), TOL, f"{case[0]}, S={splits}")


@settings(max_examples=1)
@given(splits=st.integers(2, 24))
def test_result_does_not_depend_on_the_split(splits):
  check_any_split(0, splits)


@pytest.mark.slow
@settings(max_examples=10)
@given(i=st.sampled_from([0, 2]), splits=st.integers(2, 40))
def test_result_does_not_depend_on_the_split_at_more_draws(i, splits):
  """The same on more draws, and on a traced map (lists padded to every key tile, the
  counts read at run time)."""
  check_any_split(i, splits)


def test_combine_is_one_softmax():
  """Shares of one row's keys (some empty: lse +inf) and a sink merge into the softmax over
  all of them; a row with no key and no sink gets out 0 and lse +inf."""
  rng = np.random.default_rng(0)
  s_, b, lq, h, d, n = 3, 1, 2, 2, 4, 12
  scores = rng.standard_normal((b, h, lq, n))
  values = rng.standard_normal((b, n, h, d))
  share = np.array([0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0])       # split 2 holds no key
  allowed = np.ones((b, h, lq, n), bool)
  allowed[:, 1, 1] = False                                      # head 1, row 1: no key
  sinks = np.array([0.3, -0.5])
  outs, lses = [], []
  for s in range(s_):
    m = allowed & (share == s)
    e = np.where(m, np.exp(scores), 0.0)
    tot = e.sum(-1)
    outs.append(np.einsum("bhqk,bkhd->bqhd", e / np.where(tot > 0, tot, 1)[..., None], values))
    lses.append(np.where(tot > 0, np.log(np.where(tot > 0, tot, 1)), np.inf))
  out_s, lse_s = jnp.asarray(np.stack(outs), jnp.float32), jnp.asarray(np.stack(lses),
                                                                      jnp.float32)
  for sink in (None, sinks):
    e = np.where(allowed, np.exp(scores), 0.0)
    tot = e.sum(-1) + (0.0 if sink is None else np.exp(sink)[None, :, None])
    want = np.einsum("bhqk,bkhd->bqhd", e / np.where(tot > 0, tot, 1)[..., None], values)
    out, lse = flash_decode.combine(out_s, lse_s, None if sink is None else
                                    jnp.asarray(sink, jnp.float32))
    assert_close(out, want, TOL, f"out, sinks={sink is not None}")
    finite = tot > 0
    assert_close(np.where(finite, lse, 0), np.where(finite, np.log(np.where(finite, tot, 1)), 0),
                 TOL, "lse")
    assert (np.isinf(np.asarray(lse)) == ~finite).all()
    if sink is None:
      assert not np.asarray(out)[0, 1, 1].any()


def test_splits_heuristic(monkeypatch):
  # a decode step: few programs, many key tiles
  assert flash_decode.splits(4 * 8, 512) == 9
  assert flash_decode.splits(1, 10_000) == flash_decode.MAX_SPLITS
  # few key tiles: at most one split per MIN_TILES_PER_SPLIT
  assert flash_decode.splits(8, 19) == 2
  assert flash_decode.splits(8, 7) == 1
  # a prefill fills the GPU already
  assert flash_decode.splits(16 * 512, 512) == 1
  assert flash_decode.splits(flash_decode.FULL_LAUNCH, 4096) == 1
  monkeypatch.setattr(flash_decode, "MAX_SPLITS", 1)
  assert flash_decode.splits(1, 10_000) == 1


def test_one_q_tile_of_any_rows_runs_in_a_power_of_two_tile():
  """A decode map (`block_q = q_len`, one q tile) runs in a kernel tile of >= 16 rows, which
  Triton can load; maps of several q tiles keep theirs (and Triton refuses bad ones)."""
  for lq, bq, want in ((1, 1, 16), (3, 3, 16), (20, 24, 32), (16, 16, 16), (8, 64, 64)):
    assert flash._tile_rows(maskc.compile("causal", lq, 256, block_q=bq, block_kv=16)) == want
  assert flash._tile_rows(maskc.compile("causal", 48, 256, block_q=24, block_kv=16)) == 24
  bm = maskc.compile("causal", 1, 256, block_q=1, block_kv=16)
  cfg = flash._launch(*qkv(0, 1, 1, 256, 2, 2)[:3], bm, 0, scale=1.0, cap=None,
                      has_sinks=False, interpret=True, splits=None).cfg
  assert cfg.block_q == 16 and cfg.splits == flash_decode.splits(2, 16) == 2
  with pytest.raises(maskc.MaskValueError, match="splits"):
    flash.run(*qkv(0, 1, 1, 256, 2, 2)[:3], bm, interpret=True, splits=0)


@pytest.mark.slow
def test_maskc_flax_decodes_through_the_split_kernel(monkeypatch):
  """A `maskc.flax.Attention` on flash (interpreted): its jitted decode step over a traced
  global cache takes the split path (the heuristic's pick) and decodes as the dense
  module's full forward does, row for row."""
  nnx = pytest.importorskip("flax.nnx")
  from maskc.flax import Attention

  combined = []
  real = flash_decode.combine
  monkeypatch.setattr(flash_decode, "combine",
                      lambda out, *a: combined.append(out.shape) or real(out, *a))
  f, prompt, length = 16, 250, 254
  img = np.zeros(length, bool)
  img[20:60] = True
  def module(backend):             # the same weights: a fresh Rngs(0) each
    return Attention(2, f, num_kv_heads=1, mask="causal | bidirectional(img)", sinks=True,
                     block_kv=BK, backend=backend, rngs=nnx.Rngs(0))

  ours, dense = module("flash"), module("dense")
  x = jax.random.normal(jax.random.key(2), (2, length, f), jnp.float32)
  want = dense(x, operands={"img": img})
  ours.init_cache((2, length, f))
  outs = [ours(x[:, :prompt], operands={"img": img[:prompt]}, decode=True)]
  step = nnx.jit(lambda m, t: m(t, decode=True))
  for t in range(prompt, length):
    outs.append(step(ours, x[:, t:t + 1]))
  # the step's splits: [S = 2, B, 16 rows (its one row padded), H, head dim 8 padded to 16]
  assert (2, 2, 16, 2, 16) in combined, combined
  assert_close(jnp.concatenate(outs, axis=1), want, TOL, "decoded vs the full forward")
