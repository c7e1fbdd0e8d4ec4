"""`maskc.sharded_attention` on 8 fake CPU devices equals unsharded attention.

The device count must be fixed before JAX starts, so the cases run in one
subprocess (`tests/sharding_worker.py`) and each test here checks one case's
relative errors: sharded forward and gradients against unsharded
`maskc.attention`, that against a NumPy reference, ring against all_gather, and
inputs already in the layout's order. Checks that need no devices (per-shard
compilation, empty ring steps, argument errors) run in this process.
"""


import numpy as np
import pytest

import fake_devices
import maskc
import sharding_inputs_worker
import sharding_worker
from maskc.parallel import sharding as _sharding

TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return fake_devices.run_worker("sharding_worker.py", tmp_path_factory, timeout=3000)


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


_KEYS = {
    "plain": {"reference", "forward_all_gather", "forward_ring", "ring_vs_all_gather"}
    | {f"grad_{x}_{s}" for x in "qkv" for s in ("all_gather", "ring")},
    "traced": {"forward", "grad_q", "grad_k", "grad_v", "unsharded"},
    "heads": {"reference", "forward_all_gather", "forward_ring", "ring_vs_all_gather"},
}


# Flash and splash in interpret mode, traced operands under jit, per-head mask lists: the
# same subprocess; each case's errors (and its wall time, reported only) come back.
@pytest.mark.slow
@pytest.mark.parametrize("case", sharding_worker.BACKEND_CASES,
                         ids=sharding_worker.backend_case_id)
def test_backends_traced_operands_and_head_masks(results, case):
  res = dict(results[sharding_worker.backend_case_id(case)])
  assert "error" not in res, res["error"]
  res.pop("seconds")
  what, strategy = case[7], case[2]
  want = set(_KEYS[what])
  if what == "heads":
    want |= {f"grad_{x}_{strategy}" for x in "qkv"}
  assert set(res) == want, res
  assert all(err < TOL for err in res.values()), res


def test_backend_cases_cover_each_backend_strategy_and_mesh():
  cases = sharding_worker.BACKEND_CASES
  for backend in ("flash", "splash"):
    plain = {c[0] for c in cases if c[4] == backend and c[7] == "plain"}
    assert plain == {(2, 2, 2), (8,)}                     # each runs both strategies
    assert any(c[4] == backend and c[7] == "traced" for c in cases)
    assert any(c[4] == backend and c[7] == "heads" for c in cases)
  assert {c[2] for c in cases if c[7] == "traced"} == {"all_gather", "ring"}
  assert {c[2] for c in cases if c[7] == "heads"} == {"all_gather", "ring"}
  # per-head masks with heads sharded: the mesh has a model axis and the head shards differ
  for c in cases:
    if c[7] == "heads":
      assert "model" in c[1]
      half = len(c[5]) // 2
      assert set(c[5][:half]) != set(c[5][half:])


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


def test_per_head_masks_are_cut_over_head_shards_into_groups():
  heads = ["causal", "sliding(3)", "causal", "causal"]
  groups = _sharding.head_groups(heads, 4, 2)
  c, s3 = maskc.parse("causal"), maskc.parse("sliding(3)")
  assert len(groups) == 2
  assert [(g[0], g[1]) for g in groups[0]] == [(c, (0,)), (s3, (1,))]
  assert [(g[0], g[1]) for g in groups[1]] == [(c, None)]    # one mask: every local head
  # equal head shards share one program; equal masks everywhere are one mask
  assert len(_sharding.head_groups(["causal", "sliding(3)"] * 2, 4, 2)) == 1
  assert _sharding.head_groups(["causal"] * 4, 4, 2) == [[(c, None)]]
  with pytest.raises(maskc.MaskValueError, match="3 masks but q has 4 heads"):
    _sharding.head_groups(heads[:3], 4, 1)


def test_per_head_plan_maps_are_each_groups_tiles():
  n, shards, block = 32, 2, 4
  heads = ["causal", "sliding(3)", "causal & document(seg)", "causal & document(seg)"]
  seg = np.repeat(np.arange(4), 8)
  lay = maskc.balance(heads, n, shards, block=block, method="zigzag", operands={"seg": seg})
  plan = _sharding.plan(heads, lay, block_q=block, block_kv=block, operands={"seg": seg},
                        heads=4, head_shards=2)
  for m, groups in enumerate(plan.groups):
    covered = []
    for g in groups:
      local = range(2) if g.heads is None else g.heads
      for i in local:
        assert maskc.parse(heads[2 * m + i]) == g.mask
      covered += list(local)
      dense = maskc.materialize(g.mask, n, operands={"seg": seg})
      for r in range(shards):
        want = dense_tiles(dense[lay.shard_positions(r)][:, lay.positions], block, block)
        assert np.array_equal(plan.groups[m][groups.index(g)].maps[0][r].grid, want)
    assert sorted(covered) == [0, 1]


def test_traced_operands_leave_the_maps_to_the_devices():
  seg = np.repeat(np.arange(4), 16)
  lay = maskc.balance("causal", 64, 4, block=4, method="zigzag")

  @jax_jit
  def planned(seg):
    plan = _sharding.plan("causal & document(seg)", lay, strategy="ring", block_q=4,
                          block_kv=4, operands={"seg": seg})
    assert plan.traced and plan.groups[0][0].maps is None and plan.empty_steps() == []
    bm = plan.traced_map(plan.groups[0][0], lay.shard_positions(1), lay.shard_positions(3),
                         16, {"seg": seg})
    return bm.grid
  dense = maskc.materialize("causal & document(seg)", 64, operands={"seg": seg})
  want = dense_tiles(dense[lay.shard_positions(1)][:, lay.shard_positions(3)], 4, 4)
  assert np.array_equal(np.asarray(planned(seg)), want)


def jax_jit(f):
  import jax
  return jax.jit(f)


def test_layouts_without_operands_match_balance_and_balanced_needs_them():
  from maskc.parallel import layout as _layout
  for method in ("contiguous", "zigzag"):
    fixed = _layout.fixed_layout(64, 4, block=4, method=method)
    lay = maskc.balance("causal", 64, 4, block=4, method=method)
    assert np.array_equal(fixed.positions, lay.positions) and fixed.chunk == lay.chunk
    assert np.isnan(fixed.work).all()
  with pytest.raises(maskc.MaskValueError, match="reads the mask's operands"):
    _layout.fixed_layout(64, 4, block=4, method="balanced")


def test_traced_operands_with_the_balanced_layout_raise_with_a_hint():
  import jax
  from jax.sharding import Mesh
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1), ("context",))
  x = np.zeros((1, 16, 2, 4), np.float32)
  f = jax.jit(lambda seg: maskc.sharded_attention(x, x, x, "document(seg)", mesh=mesh,
                                                  seq_axis="context", layout="balanced",
                                                  operands={"seg": seg}, backend="xla"))
  with pytest.raises(maskc.MaskValueError, match="Balance once outside jit"):
    f(np.zeros(16, np.int32))


@pytest.fixture(scope="module")
def input_results(tmp_path_factory):
  return fake_devices.run_worker("sharding_inputs_worker.py", tmp_path_factory, timeout=600)


# A subprocess on fake devices: about 24 s of CPU for the eager calls, 77 s for the traced ones
# and 19 s for the gradient, 135 s in all (jax 0.10.2).
@pytest.mark.slow
def test_inputs_in_every_placement_on_auto_and_explicit_meshes(input_results):
  assert set(input_results) == set(sharding_inputs_worker.case_ids())
  for case, err in input_results.items():
    assert err < TOL, (case, err)


def test_input_cases_cover_meshes_placements_strategies_and_layouts():
  w = sharding_inputs_worker
  cases = w.TRACED
  assert len(cases) == len(set(cases))
  assert {(c[0], c[3]) for c in cases} == {(m, p) for m in w.MESHES for p in w.PLACEMENTS}
  assert {(c[3], c[1]) for c in cases} == {(p, s) for p in w.PLACEMENTS for s in w.STRATEGIES}
  assert {(c[0], c[2]) for c in cases} == {(m, lay) for m in w.MESHES for lay in w.LAYOUTS}
  assert {(c[1], c[2]) for c in cases} == {(s, lay) for s in w.STRATEGIES for lay in w.LAYOUTS}
  # the case: a per-token operand sharded over the sequence on an Explicit mesh
  assert ("explicit", "ring", "zigzag", "sequence") in cases
  assert w.GRAD[0] == "explicit" and w.GRAD[3] != "host"
