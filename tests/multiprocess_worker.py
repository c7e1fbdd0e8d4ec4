"""One of two JAX processes running `maskc.sharded_attention` together; `tests/test_multiprocess.py`
starts both.

`python tests/multiprocess_worker.py PORT PROCESS_ID OUT.json`: each process has two CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=2`, set by the caller), joins the other with
`jax.distributed.initialize` (process 0 is the coordinator on `localhost:PORT`) and CPU
collectives over gloo, and builds global arrays with `jax.make_array_from_callback`, each
process filling only its own devices' shards. The 2 x 2 mesh puts the sequence axis across the
processes, so K/V gathers and ring steps cross them. For every case each process compares the
output shards it holds with a NumPy reference and writes `{case: max abs error}` to OUT.json.
Importing this module does nothing.
"""

from __future__ import annotations

import json
import sys

MASK = "causal & document(seg) | prefix(n)"
B, L, H, HKV, D = 2, 32, 2, 1, 8

# (strategy, operands, layout): "static" operands are NumPy arrays every process holds whole;
# "traced" ones are global arrays sharded over (data, context), jit arguments like q, k and v;
# "global" ones are those global arrays passed outside jit.
CASES = [
    ("all_gather", "static", "balanced"),
    ("ring", "static", "zigzag"),
    ("all_gather", "traced", "zigzag"),
    ("ring", "traced", "contiguous"),
    ("ring", "global", "zigzag"),
]


def case_id(case) -> str:
  return "-".join(case)


def inputs():
  """q, k, v and the operands, the same in every process."""
  import numpy as np
  rng = np.random.default_rng(0)
  q = rng.standard_normal((B, L, H, D)).astype(np.float32)
  k, v = (rng.standard_normal((B, L, HKV, D)).astype(np.float32) for _ in range(2))
  seg = np.stack([np.repeat(np.arange(4), L // 4),
                  np.repeat(np.arange(3), [5, 20, L - 25])]).astype(np.int32)
  return q, k, v, {"seg": seg, "n": np.array([3, 9], np.int32)}


def reference(q, k, v, operands):
  """NumPy softmax attention over `maskc.materialize`'s dense mask; GQA by repeating KV heads."""
  import numpy as np

  import maskc
  allowed = np.broadcast_to(np.asarray(maskc.materialize(MASK, L, operands=operands)), (B, L, L))
  kk, vv = (np.repeat(x.astype(np.float64), H // HKV, axis=2) for x in (k, v))
  s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), kk) / np.sqrt(D)
  s = np.where(allowed[:, None], s, -np.inf)
  e = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bhqk,bkhd->bqhd", e / e.sum(-1, keepdims=True), vv)


def main(port: str, process_id: str, out: str) -> None:
  import jax
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                             process_id=int(process_id), initialization_timeout=120)
  import numpy as np
  from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

  import maskc

  assert jax.process_count() == 2 and len(jax.local_devices()) == 2, jax.devices()
  # devices[i] belongs to process i // 2: columns (the sequence axis) cross the processes.
  devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
  mesh = Mesh(devices.reshape(2, 2).T, ("data", "context"), axis_types=(AxisType.Explicit,) * 2)
  q, k, v, ops = inputs()
  want = reference(q, k, v, ops)

  def global_array(x, spec):
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

  gq, gk, gv = (global_array(x, P("data", "context")) for x in (q, k, v))
  gops = {"seg": global_array(ops["seg"], P("data", "context")),
          "n": global_array(ops["n"], P("data"))}

  def attend(q, k, v, operands, strategy, layout):
    return maskc.sharded_attention(q, k, v, MASK, mesh=mesh, batch_axis="data",
                                   seq_axis="context", strategy=strategy, layout=layout,
                                   operands=operands, backend="xla")

  results = {}
  for case in CASES:
    strategy, kind, layout = case
    if layout == "balanced":   # balance reads the operands: once, on the host
      layout = maskc.balance(MASK, L, 2, block=4, operands=ops)
    if kind == "traced":
      got = jax.jit(lambda q, k, v, o, s=strategy, lay=layout: attend(q, k, v, o, s, lay))(
          gq, gk, gv, gops)
    else:
      got = attend(gq, gk, gv, ops if kind == "static" else gops, strategy, layout)
    assert got.shape == want.shape and not got.is_fully_addressable
    results[case_id(case)] = max(
        float(np.abs(np.asarray(s.data, np.float64) - want[s.index]).max())
        for s in got.addressable_shards)
    print(process_id, case_id(case), results[case_id(case)], flush=True)
  with open(out, "w") as f:
    json.dump(results, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(*sys.argv[1:])
