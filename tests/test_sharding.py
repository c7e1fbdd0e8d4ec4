"""`maskc.sharded_attention` on 8 fake CPU devices equals unsharded attention.

The device count must be fixed before JAX starts, so the cases run in one
subprocess (`tests/sharding_worker.py`) and each test here checks one case's
relative errors: sharded forward and gradients against unsharded
`maskc.attention`, that against a NumPy reference, ring against all_gather, and
inputs already in the layout's order. Checks that need no devices (per-shard
compilation, empty ring steps, argument errors) run in this process.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import maskc
import sharding_worker
from maskc import _sharding

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  out = tmp_path_factory.mktemp("sharding") / "results.json"
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.join(HERE, "sharding_worker.py"), str(out)],
                        env=env, capture_output=True, text=True, timeout=3000)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(out.read_text())


# One subprocess on 8 fake devices runs every case (minutes on 2 cores): `make test-slow`,
# which CI runs too.
@pytest.mark.slow
@pytest.mark.parametrize("case", sharding_worker.CASES, ids=sharding_worker.case_id)
def test_sharded_equals_unsharded(results, case):
  res = results[sharding_worker.case_id(case)]
  assert res["reference"] < TOL, res
  assert res["forward"] < TOL, res
  assert res["ring_vs_all_gather"] < TOL, res
  assert res["inputs_permuted"] < TOL, res
  if case[-1]:
    for name in "qkv":
      assert res[f"grad_{name}"] < TOL, res


def test_every_required_mesh_strategy_layout_and_mask_kind_is_covered():
  cases = sharding_worker.CASES
  assert {c[0] for c in cases} == {(2, 2, 2), (8,), (2, 4)}
  for s in ("all_gather", "ring"):
    assert {c[3] for c in cases if c[2] == s} == {"contiguous", "zigzag", "balanced"}
  assert {c[5] for c in cases} == {"seg", "img", None}
  assert {c[2] for c in cases if c[6]} == {"all_gather", "ring"}


def dense_tiles(dense, bq, bk):
  g = np.zeros((dense.shape[-2] // bq, dense.shape[-1] // bk), np.int8)
  for i in range(g.shape[0]):
    for j in range(g.shape[1]):
      t = dense[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
      g[i, j] = 2 if t.all() else (1 if t.any() else 0)
  return g


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_per_shard_maps_are_the_shards_tiles(strategy):
  n, shards, block = 64, 4, 4
  seg = np.repeat(np.arange(4), 16)
  lay = maskc.balance("causal & document(seg)", n, shards, block=block, method="zigzag",
                      operands={"seg": seg})
  plan = _sharding.plan("causal & document(seg)", lay, strategy=strategy, block_q=block,
                        block_kv=block, operands={"seg": seg})
  dense = maskc.materialize("causal & document(seg)", n, operands={"seg": seg})
  for r in range(shards):
    rows = lay.shard_positions(r)
    if strategy == "all_gather":
      want = dense_tiles(dense[rows][:, lay.positions], block, block)
      assert np.array_equal(plan.maps[0][r].grid, want)
      continue
    for c in range(shards):
      want = dense_tiles(dense[rows][:, lay.shard_positions(c)], block, block)
      assert np.array_equal(plan.maps[0][r][c].grid, want)
      assert plan.nonempty[0][r][c] == bool(want.any())


def test_ring_skips_steps_with_no_tiles():
  # Contiguous causal: shard r never sees keys of shards after it, so at step t the
  # shards r < t have nothing; with a chunked mask whole steps are empty.
  lay = maskc.balance("causal & chunk(16)", 64, 4, block=4, method="contiguous")
  plan = _sharding.plan("causal & chunk(16)", lay, strategy="ring", block_q=4, block_kv=4)
  assert plan.empty_steps() == [1, 2, 3]
  lay = maskc.balance("causal", 64, 4, block=4, method="contiguous")
  plan = _sharding.plan("causal", lay, strategy="ring", block_q=4, block_kv=4)
  assert plan.empty_steps() == []
  assert plan.step_map(0, 0, 1) is None and plan.step_map(0, 1, 1) is not None


def test_batched_operands_split_over_data_shards():
  seg = np.stack([np.repeat(np.arange(2), 8), np.zeros(16, int), np.arange(16) // 4,
                  np.ones(16, int)])
  lay = maskc.balance("document(seg)", 16, 2, block=4, method="contiguous",
                      operands={"seg": seg})
  plan = _sharding.plan("document(seg)", lay, block_q=4, block_kv=4, operands={"seg": seg},
                        batch=4, data_shards=2)
  for d in range(2):
    for r in range(2):
      got = plan.maps[d][r].to_dense()
      for i, row in enumerate(seg[2 * d:2 * d + 2]):
        rows = lay.shard_positions(r)
        assert np.array_equal(got[i], row[rows][:, None] == row[lay.positions][None, :])


def test_bad_arguments_raise():
  import jax
  from jax.sharding import Mesh
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1), ("context",))
  x = np.zeros((1, 16, 2, 4), np.float32)
  with pytest.raises(maskc.MaskValueError):
    maskc.sharded_attention(x, x, x, "causal", mesh=mesh, seq_axis="nope")
  with pytest.raises(maskc.BackendError):
    maskc.sharded_attention(x, x, x, "causal", mesh=mesh, seq_axis="context", strategy="ring",
                            backend="dense")
  with pytest.raises(maskc.MaskValueError):
    maskc.sharded_attention(x, x[:, :8], x[:, :8], "causal", mesh=mesh, seq_axis="context")
  lay = maskc.balance("causal", 32, 1, block=4)
  with pytest.raises(maskc.MaskValueError):
    maskc.sharded_attention(x, x, x, "causal", mesh=mesh, seq_axis="context", layout=lay)
  with pytest.raises(maskc.MaskValueError):
    _sharding.plan("causal", lay, strategy="tree", block_q=4, block_kv=4)


def test_xla_run_with_lse_matches_numpy():
  import jax.numpy as jnp
  from maskc.kernels import xla
  rng = np.random.default_rng(0)
  q = rng.standard_normal((2, 24, 4, 8)).astype(np.float32)
  k = rng.standard_normal((2, 24, 2, 8)).astype(np.float32)
  v = rng.standard_normal((2, 24, 2, 8)).astype(np.float32)
  p = np.random.default_rng(1).permutation(24)
  mask = "sliding(4) & (q >= 3)"   # rows 0..2 of position < 3 have no key: lse = NEG_LSE
  bm = maskc.compile(mask, 24, block_q=8, block_kv=8, q_positions=p)
  out, lse = xla.run_with_lse(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), bm)
  allowed = maskc.materialize(mask, 24, q_positions=p)
  kk, vv = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
  s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), kk) / np.sqrt(8)
  s = np.where(allowed, s, -np.inf)
  seen = allowed.any(-1)
  mx = np.where(seen[None, None, :, None], s.max(-1, keepdims=True), 0)
  e = np.exp(s - mx)
  total = e.sum(-1)
  want_lse = np.where(seen, np.log(np.where(seen, total, 1.0)) + mx[..., 0], xla.NEG_LSE)
  want = np.einsum("bhqk,bkhd->bqhd", e / np.maximum(e.sum(-1, keepdims=True), 1e-300), vv)
  np.testing.assert_allclose(np.asarray(lse), np.moveaxis(want_lse, 1, 2), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
