"""Runs sharded attention cases on 8 fake CPU devices; `tests/test_sharding.py` drives it.

`XLA_FLAGS=--xla_force_host_platform_device_count=8` must be set before JAX
starts, so this runs as its own process: `python tests/sharding_worker.py OUT.json`.
For each case it writes the relative errors of the sharded forward output and of
the gradients of `sum(out * w)` with respect to q, k and v against unsharded
`maskc.attention`, and of the unsharded output against a NumPy reference.
Importing this module does nothing.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

CASES = [
    # (mesh shape, axis names, strategy, layout, mask, operands kind, grads)
    ((2, 2, 2), ("data", "model", "context"), "all_gather", "contiguous", "causal & document(seg)",
     "seg", True),
    ((2, 2, 2), ("data", "model", "context"), "all_gather", "zigzag", "causal & document(seg)",
     "seg", False),
    ((2, 2, 2), ("data", "model", "context"), "all_gather", "balanced", "causal & document(seg)",
     "seg", False),
    ((2, 2, 2), ("data", "model", "context"), "ring", "contiguous", "causal & document(seg)",
     "seg", False),
    ((2, 2, 2), ("data", "model", "context"), "ring", "zigzag", "causal & document(seg)",
     "seg", True),
    ((2, 2, 2), ("data", "model", "context"), "ring", "balanced", "sliding(5) | global(2)",
     None, False),
    ((8,), ("context",), "all_gather", "zigzag", "causal | bidirectional(img)", "img", True),
    ((8,), ("context",), "ring", "balanced", "causal | bidirectional(img)", "img", True),
    ((8,), ("context",), "ring", "contiguous", "causal", None, False),
    ((2, 4), ("data", "context"), "all_gather", "balanced", "causal", None, False),
    ((2, 4), ("data", "context"), "ring", "zigzag", "sliding(6)", None, True),
]


def case_id(case) -> str:
  shape, _, strategy, layout, mask, _, grads = case
  return f"{'x'.join(map(str, shape))}-{strategy}-{layout}-{mask}{'-grad' if grads else ''}"


M3 = ((2, 2, 2), ("data", "model", "context"))
M1 = ((8,), ("context",))
HEADS = ("causal & document(seg)", "sliding(9)", "causal", "causal | bidirectional(img)")

# The Pallas backends (interpret mode on CPU) and the other inputs: (mesh, strategy, layout,
# backend, mask, operands kind, what, sequence length). `what` is "plain" (sharded against
# unsharded, forward and gradients, for both strategies: `strategy` is None), "traced"
# (operands as jit arguments against the same call with static operands, forward and
# gradients) or "heads" (a per-head mask list with heads sharded over the model axis; its
# forward under both strategies, gradients under `strategy`). Splash needs key tiles of 128,
# hence its longer sequences.
BACKEND_CASES = [
    (*M3, None, "zigzag", "flash", "causal & document(seg)", "seg", "plain", 128),
    (*M1, None, "balanced", "flash", "causal | bidirectional(img)", "img", "plain", 128),
    (*M3, None, "contiguous", "splash", "causal & document(seg)", "seg", "plain", 512),
    (*M1, None, "contiguous", "splash", "sliding(100) & document(seg)", "seg", "plain", 1024),
    (*M3, "all_gather", "zigzag", "xla", "causal & document(seg)", "seg", "traced", 64),
    (*M3, "ring", "zigzag", "flash", "causal & document(seg)", "seg", "traced", 128),
    (*M3, "all_gather", "zigzag", "splash", "causal & document(seg)", "seg", "traced", 512),
    (*M3, "ring", "balanced", "flash", HEADS, "both", "heads", 128),
    (*M3, "all_gather", "contiguous", "splash", HEADS, "both", "heads", 512),
]


def backend_case_id(case) -> str:
  shape, _, strategy, layout, backend, mask, _, what, n = case
  name = "heads" if isinstance(mask, tuple) else mask
  return f"{backend}-{what}-{'x'.join(map(str, shape))}-{strategy or 'both'}-{layout}-{name}-{n}"


def main(path: str, only: str = "") -> None:
  """Runs every case whose id starts with one of the comma-separated prefixes in `only`
  (every case by default) and writes their errors to `path`."""
  prefixes = tuple(only.split(","))
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  import jax
  jax.config.update("jax_platforms", "cpu")
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh

  import maskc

  assert len(jax.devices()) == 8
  rng = np.random.default_rng(0)
  b, n, h, hkv, d = 2, 32, 4, 2, 4          # GQA: 2 query heads per kv head
  q = jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, n, hkv, d)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, n, hkv, d)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.float32)
  operands = {
      "seg": {"seg": np.stack([np.repeat(np.arange(4), 8),
                               np.repeat(np.arange(3), [5, 20, 7])]).astype(np.int32)},
      "img": {"img": np.isin(np.arange(n), list(range(3, 9)) + list(range(17, 27)))},
      None: {},
  }

  def reference(mask, ops):
    """NumPy softmax attention with the dense mask; GQA by repeating kv heads."""
    allowed = np.asarray(maskc.materialize(mask, n, operands=ops))
    allowed = np.broadcast_to(allowed, (b, n, n)) if allowed.ndim == 3 else allowed[None]
    kk = np.repeat(np.asarray(k), h // hkv, axis=2)
    vv = np.repeat(np.asarray(v), h // hkv, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", np.asarray(q, np.float64), kk) / np.sqrt(d)
    s = np.where(allowed[:, None], s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, vv)

  def rel(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-30))

  def run_case(case) -> dict:
    """Relative errors of one `CASES` case (see there)."""
    shape, names, strategy, layout, mask, kind, grads = case
    ops = operands[kind]
    mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
    axes = dict(batch_axis="data" if "data" in names else None,
                head_axis="model" if "model" in names else None, seq_axis="context")

    def sharded(q, k, v, strategy=strategy):
      return maskc.sharded_attention(q, k, v, mask, mesh=mesh, strategy=strategy,
                                     layout=layout, operands=ops, backend="xla", **axes)

    def plain(q, k, v):
      return maskc.attention(q, k, v, mask, operands=ops, backend="xla")

    out, want = sharded(q, k, v), plain(q, k, v)
    res = {"forward": rel(out, want), "reference": rel(want, reference(mask, ops))}
    other = "ring" if strategy == "all_gather" else "all_gather"
    res["ring_vs_all_gather"] = rel(out, sharded(q, k, v, strategy=other))
    if grads:
      gs = jax.grad(lambda *a: jnp.sum(sharded(*a) * w), argnums=(0, 1, 2))(q, k, v)
      gp = jax.grad(lambda *a: jnp.sum(plain(*a) * w), argnums=(0, 1, 2))(q, k, v)
      for name, x, y in zip("qkv", gs, gp):
        res[f"grad_{name}"] = rel(x, y)
    # inputs already in the layout's order give the output in that order
    lay = layout if not isinstance(layout, str) else maskc.balance(
        mask, n, mesh.shape["context"], block=2, operands=ops, method=layout)
    permuted = maskc.sharded_attention(*(lay.permute(x) for x in (q, k, v)), mask, mesh=mesh,
                                       strategy=strategy, layout=lay, operands=ops,
                                       backend="xla", inputs_permuted=True, **axes)
    res["inputs_permuted"] = rel(permuted, lay.permute(want))
    return res

  results = {}
  for case in [c for c in CASES if case_id(c).startswith(prefixes)]:
    res = run_case(case)
    results[case_id(case)] = res
    print(case_id(case), res, flush=True)
  for case in [c for c in BACKEND_CASES if backend_case_id(c).startswith(prefixes)]:
    start = time.perf_counter()
    try:
      res = backend_case(case)
    except Exception as e:  # recorded, so the test names the failing case and its error
      res = {"error": f"{type(e).__name__}: {e}"[:2000]}
    res["seconds"] = round(time.perf_counter() - start, 1)   # reported, never asserted
    results[backend_case_id(case)] = res
    print(backend_case_id(case), res, flush=True)
  with open(path, "w") as f:
    json.dump(results, f)


def backend_case(case) -> dict:
  """Relative errors of one `BACKEND_CASES` case (see there)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh

  import maskc

  shape, names, strategy, layout, backend, mask, kind, what, n = case
  mask = list(mask) if isinstance(mask, tuple) else mask
  rng = np.random.default_rng(1)
  b, h, hkv, d = 2, 4, 2, 8
  q, k, v, w = (jnp.asarray(rng.standard_normal((b, n, hh, d)), jnp.float32)
                for hh in (h, hkv, hkv, h))
  seg = np.stack([np.repeat(np.arange(4), n // 4),
                  np.repeat(np.arange(3), [n // 8, n // 2, n - n // 8 - n // 2])])
  img = np.zeros(n, bool)
  img[n // 8:n // 4] = img[n // 2:n // 2 + n // 8] = True
  ops = {"seg": {"seg": seg.astype(np.int32)}, "img": {"img": img},
         "both": {"seg": seg.astype(np.int32), "img": img}}[kind]
  mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
  axes = dict(batch_axis="data" if "data" in names else None,
              head_axis="model" if "model" in names else None, seq_axis="context")

  def rel(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-30))

  def sharded(q, k, v, ops=ops, strategy=strategy):
    return maskc.sharded_attention(q, k, v, mask, mesh=mesh, strategy=strategy, layout=layout,
                                   operands=ops, backend=backend, **axes)

  def plain(q, k, v):
    return maskc.attention(q, k, v, mask, operands=ops, backend="xla")

  def grads(f):
    return jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v)

  def reference():
    """NumPy softmax attention with each head's dense mask; GQA by repeating kv heads."""
    per_head = mask if isinstance(mask, list) else [mask] * h
    allowed = np.stack([np.broadcast_to(np.asarray(maskc.materialize(m, n, operands={
        o.name: ops[o.name] for o in maskc.parse(m).operands})), (b, n, n)) for m in per_head],
        axis=1)                                                 # [B, H, L, L]
    kk = np.repeat(np.asarray(k, np.float64), h // hkv, axis=2)
    vv = np.repeat(np.asarray(v, np.float64), h // hkv, axis=2)
    sc = np.einsum("bqhd,bkhd->bhqk", np.asarray(q, np.float64), kk) / np.sqrt(d)
    sc = np.where(allowed, sc, -np.inf)
    e = np.exp(sc - sc.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", e / e.sum(-1, keepdims=True), vv)

  res = {}
  if what == "traced":
    traced = jax.jit(lambda q, k, v, ops: sharded(q, k, v, ops))
    res["forward"] = rel(traced(q, k, v, ops), sharded(q, k, v))
    gt = jax.jit(jax.grad(lambda q, k, v, ops: jnp.sum(sharded(q, k, v, ops) * w),
                          argnums=(0, 1, 2)))(q, k, v, ops)
    for name, x, y in zip("qkv", gt, grads(sharded)):
      res[f"grad_{name}"] = rel(x, y)
    res["unsharded"] = rel(sharded(q, k, v), plain(q, k, v))
    return res
  want, want_grads = plain(q, k, v), grads(plain)
  res["reference"] = rel(want, reference())
  outs = {}
  for st in ("all_gather", "ring"):
    outs[st] = sharded(q, k, v, strategy=st)
    res[f"forward_{st}"] = rel(outs[st], want)
    if st == strategy or what == "plain":
      for name, x, y in zip("qkv", grads(functools.partial(sharded, strategy=st)), want_grads):
        res[f"grad_{name}_{st}"] = rel(x, y)
  res["ring_vs_all_gather"] = rel(outs["ring"], outs["all_gather"])
  return res


if __name__ == "__main__":
  main(*sys.argv[1:])
