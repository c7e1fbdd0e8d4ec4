"""Runs splash kernels built by `maskc.kernels.splash.jax_kernel.make_kernel` under `jax.shard_map`.

On 8 fake CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`, set
before JAX starts, so this runs as its own process:
`python tests/splash_shards_worker.py OUT.json`; `tests/test_splash_shards.py`
drives it). Each case shards heads and the q sequence over a mesh the way MaxText
runs splash (`kernel.manual_sharding_spec`, `jax.vmap` over the batch inside
`shard_map`), in Pallas interpret mode, and writes the relative errors of the
output and of the gradients of `sum(out * w)` w.r.t. q, k and v against dense
attention written here in jax.numpy over `maskc.materialize`'s mask. Importing
this module does nothing.
"""

from __future__ import annotations

import json
import sys

L = 512
BLOCK = 128

CASES = [
    # (head_shards, q_seq_shards, mask, heads, kv heads, grads)
    (2, 4, "causal", 4, 2, True),                      # mask function, q_sequence sharded
    (1, 4, "m[q, k]", 2, 2, True),                     # stored partial blocks (random)
    (2, 2, "causal & chunk(200)", 2, 1, False),
    (2, 4, ("causal", "causal", "sliding(100) | sink(5)", "sliding(100) | sink(5)"), 4, 4,
     False),                                           # a mask per head shard
]


def case_id(case) -> str:
  hs, qs, mask, h, hkv, _ = case
  text = mask if isinstance(mask, str) else " ; ".join(mask)
  return f"{hs}x{qs} {text} h{h}/{hkv}"


def pattern(seed: int = 0):
  """A random mask `[L, L]` with a band of empty rows and a block of empty columns."""
  import numpy as np
  rng = np.random.default_rng(seed)
  m = rng.random((L, L)) < 0.1
  m[200:260] = False
  m[:, 300:400] = False
  return m


def main(path: str) -> None:
  import jax
  jax.config.update("jax_platforms", "cpu")
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import maskc
  from maskc.kernels.splash import jax_kernel as splash

  assert len(jax.devices()) == 8

  def run_case(case, seed: int) -> dict:
    """Relative errors of one `CASES` case, on inputs drawn from `seed`."""
    hs, qs, mask, h, hkv, grads = case
    ops = {"m": pattern()} if mask == "m[q, k]" else {}
    bm = maskc.compile(mask, L, block_q=BLOCK, block_kv=BLOCK, operands=ops)
    kernel = splash.make_kernel(bm, head_shards=hs, q_seq_shards=qs, interpret=True)
    devices = np.array(jax.devices()[:hs * qs]).reshape(hs, qs)
    mesh = Mesh(devices, ("heads", "seq"))
    spec = kernel.manual_sharding_spec(NamedSharding(mesh, P("heads", "seq")))
    kv_spec = P(None, "heads", None, None) if hkv % hs == 0 else P()
    attend = jax.jit(jax.shard_map(
        lambda kern, q, k, v: jax.vmap(kern)(q, k, v), mesh=mesh,
        in_specs=(spec, P(None, "heads", "seq", None), kv_spec, kv_spec),
        out_specs=P(None, "heads", "seq", None), check_vma=False))

    keys = jax.random.split(jax.random.key(seed), 4)
    d = 32
    q = jax.random.normal(keys[0], (2, h, L, d), jnp.float32) / np.sqrt(d)   # scaled
    k = jax.random.normal(keys[1], (2, hkv, L, d), jnp.float32)
    v = jax.random.normal(keys[2], (2, hkv, L, d), jnp.float32)
    w = jax.random.normal(keys[3], (2, h, L, d), jnp.float32)
    allowed = np.asarray(maskc.materialize(mask, L, operands=ops))
    allowed = np.broadcast_to(allowed, (h, L, L))
    # splash leaves rows with no allowed key undefined: compare the others
    rows = jnp.asarray(allowed.any(-1))[None, :, :, None]

    def dense(q, k, v):
      g = h // hkv
      kk, vv = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
      s = jnp.einsum("bhqd,bhkd->bhqk", q, kk, precision="highest")
      s = jnp.where(allowed[None], s, -1e30)
      p = jax.nn.softmax(s, axis=-1)
      return jnp.einsum("bhqk,bhkd->bhqd", p, vv, precision="highest")

    def rel(a, b):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      return float(np.abs(a - b).max() / max(np.abs(b).max(), 1.0))

    out = attend(kernel, q, k, v)
    res = {"forward": rel(jnp.where(rows, out, 0.0), jnp.where(rows, dense(q, k, v), 0.0)),
           "shape": list(out.shape)}
    if grads:
      def loss(f):
        return lambda q, k, v: jnp.sum(jnp.where(rows, f(q, k, v), 0.0) * w)
      gs = jax.jit(jax.grad(loss(lambda q, k, v: attend(kernel, q, k, v)),
                            argnums=(0, 1, 2)))(q, k, v)
      gd = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v)
      for name, a, b in zip("qkv", gs, gd):
        res[f"grad_{name}"] = rel(a, b)
    return res

  results = {}
  for case in CASES:
    res = run_case(case, len(results))
    results[case_id(case)] = res
    print(case_id(case), res, flush=True)
  with open(path, "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main(sys.argv[1])
