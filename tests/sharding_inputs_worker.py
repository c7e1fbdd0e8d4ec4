"""Worker for tests/test_sharding.py: `sharded_attention` with inputs in every sharding a caller
hands over, on `Auto` and `Explicit` meshes (`jax.make_mesh` gives `Explicit` axes), 4 fake CPU
devices as a (data 2, context 2) mesh.

- Eager calls: NumPy and jax q/k/v with static operands, per mesh and strategy.
- Traced calls (`TRACED`): q, k, v and the operands as `jit` arguments, placed as host arrays,
  replicated, sharded over the sequence, or over batch and sequence, on both meshes, with both
  strategies and every layout (contiguous, zigzag, a balanced `maskc.Layout`).
- One gradient of q, k and v through the traced call on the `Explicit` mesh.

Writes `{case id: max abs error against unsharded dense attention}` as JSON to argv[1].
Importing this module does nothing.
"""

import json
import sys

MASK = "causal & document(seg) | prefix(n) | img[q] & img[k]"
MESHES = ("auto", "explicit")
STRATEGIES = ("all_gather", "ring")
LAYOUTS = ("contiguous", "zigzag", "balanced")
PLACEMENTS = ("host", "replicated", "sequence", "batch_sequence")


# (mesh, strategy, layout, placement) of the traced calls: every mesh meets every placement,
# every placement both strategies, and every mesh and every strategy each layout (8 cases, not the
# 48 of the full product; `test_sharding.py` checks the cover).
TRACED = [
    ("auto", "all_gather", "contiguous", "host"),
    ("auto", "ring", "zigzag", "replicated"),
    ("auto", "all_gather", "balanced", "sequence"),
    ("auto", "ring", "contiguous", "batch_sequence"),
    ("explicit", "ring", "balanced", "host"),
    ("explicit", "all_gather", "contiguous", "replicated"),
    ("explicit", "ring", "zigzag", "sequence"),
    ("explicit", "all_gather", "zigzag", "batch_sequence"),
]
GRAD = ("explicit", "all_gather", "balanced", "batch_sequence")


def case_ids() -> list[str]:
  """Every case the worker writes."""
  eager = [f"{m}-{s}-{x}" for m in MESHES for s in STRATEGIES for x in ("numpy", "jax")]
  return eager + ["traced-" + "-".join(c) for c in TRACED] + ["grad-" + "-".join(GRAD)]


def main(out: str) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

  import maskc

  rng = np.random.default_rng(0)
  b, n, h, hkv, d = 2, 64, 2, 1, 8
  q = rng.standard_normal((b, n, h, d)).astype(np.float32)
  kv = rng.standard_normal((2, b, n, hkv, d)).astype(np.float32)
  w = rng.standard_normal((b, n, h, d)).astype(np.float32)
  ops = {"seg": np.stack([np.repeat(np.arange(4), n // 4),
                          np.repeat(np.arange(3), [9, 40, n - 49])]).astype(np.int32),
         "n": np.array([5, 12], np.int32),
         "img": np.isin(np.arange(n), np.r_[20:30, 50:58])}

  def dense(q, k, v):
    return maskc.attention(q, k, v, MASK, operands=ops, backend="dense")

  ref = np.asarray(dense(q, kv[0], kv[1]))
  ref_grads = jax.grad(lambda *a: jnp.sum(dense(*a) * w), argnums=(0, 1, 2))(q, kv[0], kv[1])
  devices = np.array(jax.devices()[:4])
  meshes = {
      "auto": Mesh(devices.reshape(2, 2), ("data", "context")),
      "explicit": jax.make_mesh((2, 2), ("data", "context"),
                                axis_types=(AxisType.Explicit, AxisType.Explicit),
                                devices=list(devices)),
  }
  balanced = maskc.balance(MASK, n, 2, block=4, operands=ops)

  def err(got):
    return float(np.abs(np.asarray(got) - ref).max())

  def place(x, mesh, placement):
    """`x` ([B, L, ...], [L] or [B]) as a caller might hand it over."""
    if placement == "host":
      return x
    spec = [None] * x.ndim
    if placement != "replicated":
      if x.ndim >= 2 or x.shape[0] == n:
        spec[x.ndim >= 2] = "context"
      if placement == "batch_sequence" and x.shape[0] == b:
        spec[0] = "data"
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))

  def traced_call(mesh, strategy, layout, placement):
    lay = balanced if layout == "balanced" else layout

    def attend(q, k, v, o):
      return maskc.sharded_attention(q, k, v, MASK, operands=o, mesh=mesh, batch_axis="data",
                                     seq_axis="context", strategy=strategy, layout=lay,
                                     backend="xla")
    args = [place(x, mesh, placement) for x in (q, kv[0], kv[1])]
    return attend, args, {k_: place(x, mesh, placement) for k_, x in ops.items()}

  results = {}
  for mesh_name, mesh in meshes.items():
    for strategy in STRATEGIES:
      for inputs, x in (("numpy", q), ("jax", jnp.asarray(q))):
        got = maskc.sharded_attention(x, kv[0], kv[1], MASK, operands=ops, mesh=mesh,
                                      batch_axis="data", seq_axis="context", strategy=strategy,
                                      backend="xla")
        results[f"{mesh_name}-{strategy}-{inputs}"] = err(got)
  for case in TRACED:
    mesh_name, strategy, layout, placement = case
    attend, args, o = traced_call(meshes[mesh_name], strategy, layout, placement)
    results["traced-" + "-".join(case)] = err(jax.jit(attend)(*args, o))
  attend, args, o = traced_call(meshes[GRAD[0]], *GRAD[1:])
  grads = jax.jit(jax.grad(lambda q, k, v, o: jnp.sum(attend(q, k, v, o) * w),
                           argnums=(0, 1, 2)))(*args, o)
  results["grad-" + "-".join(GRAD)] = max(
      float(np.abs(np.asarray(g) - np.asarray(r)).max()) for g, r in zip(grads, ref_grads))
  with open(out, "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main(sys.argv[1])
