"""Worker for tests/test_sharding.py: `sharded_attention` with NumPy, jax and traced inputs on
`Auto` and `Explicit` meshes (`jax.make_mesh` gives `Explicit` axes), 4 fake CPU devices.

Writes `{case id: max abs error against unsharded dense attention}` as JSON to argv[1].
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

import maskc

MASK = "causal & document(seg)"


def main(out: str) -> None:
  rng = np.random.default_rng(0)
  q = rng.standard_normal((2, 128, 2, 8)).astype(np.float32)
  seg = np.repeat(np.arange(4), 32).astype(np.int32)
  ops = {"seg": seg}
  ref = np.asarray(maskc.attention(q, q, q, MASK, operands=ops, backend="dense"))
  devices = np.array(jax.devices()[:4])
  meshes = {
      "auto": Mesh(devices.reshape(2, 2), ("data", "context")),
      "explicit": jax.make_mesh((2, 2), ("data", "context"),
                                axis_types=(AxisType.Explicit, AxisType.Explicit),
                                devices=list(devices)),
  }
  results = {}
  for mesh_name, mesh in meshes.items():
    for strategy in ("all_gather", "ring"):
      kw = dict(mesh=mesh, batch_axis="data", seq_axis="context", strategy=strategy,
                backend="xla")
      for inputs, x in (("numpy", q), ("jax", jnp.asarray(q))):
        got = maskc.sharded_attention(x, x, x, MASK, operands=ops, **kw)
        results[f"{mesh_name}-{strategy}-{inputs}"] = float(np.abs(np.asarray(got) - ref).max())
      traced = jax.jit(lambda x, s, kw=kw: maskc.sharded_attention(
          x, x, x, MASK, operands={"seg": s}, layout="zigzag", **kw))(q, seg)
      results[f"{mesh_name}-{strategy}-traced"] = float(np.abs(np.asarray(traced) - ref).max())
  with open(out, "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main(sys.argv[1])
