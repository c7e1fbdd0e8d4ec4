"""A long fuzz campaign, outside CI: random masks lowered and checked, random texts parsed.

Lowering cases: a random mask (prelude masks, random comparisons of integer terms
over `q`, `k`, constants and operand reads, boolean operand reads, combined with
`& | ^ ~`), a random shape, offset, tile sizes and operands (sorted or unsorted
segment ids, image flags, a pairwise mask, scalars, with or without a batch axis,
sometimes with values near the int64 limits). Each is compiled, and every tile's
verdict is checked against the dense mask evaluated by an independent NumPy
reference written here (Python semantics, object arrays: exact integers). A
traced compile under `jax.jit` is compared with the static one for a share of the
cases. Any exception other than a `maskc.MaskError` is a finding.

Texts: mutations of valid mask texts (insertions, deletions, swaps, repeats of
characters and tokens) and random byte strings are parsed; anything but a
`MaskError`, and any parse slower than a second, is a finding.

    python benchmarks/fuzz.py --cases 100000 --texts 1000000 --seed 0
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import maskc

PRELUDE = ["causal", "full", "empty", "sliding({w})", "local({a}, {b})", "chunk({c})",
           "prefix({n})", "sink({n})", "global({n})", "document(seg)", "bidirectional(img)"]


def _term(rng: random.Random, depth: int, big: bool) -> str:
  if depth <= 0 or rng.random() < 0.3:
    choice = rng.random()
    if choice < 0.35:
      return rng.choice(["q", "k"])
    if choice < 0.6:
      c = rng.randint(-40, 40)
      if big and rng.random() < 0.3:
        c = rng.choice([2**31 - 1, 2**31, 2**40, 2**62, -2**62, 2**63 - 1])
      return str(c) if c >= 0 else f"({c})"
    if choice < 0.8:
      return f"seg[{rng.choice(['q', 'k'])}]"
    if choice < 0.9:
      return f"runs(img)[{rng.choice(['q', 'k'])}]"
    return "n"
  op = rng.choice(["+", "-", "*", "//", "%", "abs", "min", "max"])
  a = _term(rng, depth - 1, big)
  if op in ("*", "//", "%"):
    c = rng.choice([1, 2, 3, 4, 7, 16, -3]) if not big else rng.choice([2, 3, 2**20, 2**33])
    return f"({a}) {op} {c}" if c > 0 else f"({a}) {op} ({c})"
  if op == "abs":
    return f"abs({a})"
  if op in ("min", "max"):
    return f"{op}({a}, {_term(rng, depth - 1, big)})"
  return f"({a}) {op} ({_term(rng, depth - 1, big)})"


def random_mask(rng: random.Random, depth: int, big: bool) -> str:
  if depth <= 0 or rng.random() < 0.35:
    r = rng.random()
    if r < 0.45:
      t = rng.choice(PRELUDE)
      return t.format(w=rng.randint(1, 40), a=rng.randint(0, 20), b=rng.randint(0, 20),
                      c=rng.randint(1, 40), n=rng.randint(0, 40))
    if r < 0.85:
      op = rng.choice(["<", "<=", "==", "!=", ">=", ">"])
      return f"{_term(rng, 2, big)} {op} {_term(rng, 2, big)}"
    return rng.choice(["img[q]", "img[k]", "allowed[q, k]", "img[q] & img[k]"])
  op = rng.choice(["&", "|", "^", "~"])
  if op == "~":
    return f"~({random_mask(rng, depth - 1, big)})"
  return f"({random_mask(rng, depth - 1, big)}) {op} ({random_mask(rng, depth - 1, big)})"


def operands(rng: np.random.Generator, kv_len: int, batch: int | None, big: bool) -> dict:
  lead = () if batch is None else (batch,)
  seg = rng.integers(0, 5, size=lead + (kv_len,))
  if rng.random() < 0.7:
    seg = np.sort(seg, axis=-1)
  if big:
    seg = seg * rng.choice([1, 2**40, 2**61]) + rng.choice([0, -2**62, 2**31 - 3])
  img = rng.random(lead + (kv_len,)) < rng.choice([0.2, 0.5, 0.8])
  n = rng.integers(0, kv_len + 1, size=lead) if batch else int(rng.integers(0, kv_len + 1))
  return {"seg": seg.astype(np.int64), "img": img,
          "allowed": rng.random(lead + (kv_len, kv_len)) < 0.5, "n": n}


def reference(mask: maskc.Mask, q_len, kv_len, q_offset, ops, batch):
  """The mask densely, by exact integer arithmetic over object arrays (independent of maskc)."""
  q = np.arange(q_len, dtype=object)[:, None] + q_offset
  k = np.arange(kv_len, dtype=object)[None, :]
  out = []
  for b in range(batch or 1):
    def op(name, b=b):
      a = ops[name]
      return a[b] if batch else a
    out.append(np.broadcast_to(np.asarray(_eval(mask, q, k, op), bool), (q_len, kv_len)))
  return np.stack(out) if batch else out[0]


def _runs(x):
  out, run, prev = [], 0, False
  for v in x:
    if v and not prev:
      run += 1
    out.append(run if v else 0)
    prev = bool(v)
  return np.asarray(out, dtype=object)


def _eval(m, q, k, op):
  ir = maskc
  if isinstance(m, ir.Const):
    return m.value
  if isinstance(m, ir.Pos):
    return q if m.axis == "q" else k
  if isinstance(m, ir.Scalar):
    return int(np.asarray(op(m.name)))
  if isinstance(m, ir.Read):
    arr = np.asarray(op(m.operand.name))
    arr = _runs(arr) if m.runs else np.asarray([int(v) for v in arr], dtype=object)
    idx = _eval(m.index, q, k, op)
    idx = np.clip(np.asarray(idx, dtype=object), 0, len(arr) - 1).astype(np.int64)
    return arr[idx]
  if isinstance(m, ir.PairRead):
    arr = np.asarray(op(m.operand.name)).astype(object)
    qi = np.clip(np.asarray(_eval(m.q_index, q, k, op), object), 0, arr.shape[0] - 1)
    ki = np.clip(np.asarray(_eval(m.k_index, q, k, op), object), 0, arr.shape[1] - 1)
    return arr[qi.astype(np.int64), ki.astype(np.int64)]
  if isinstance(m, ir.Neg):
    return -_eval(m.arg, q, k, op)
  if isinstance(m, ir.Arith):
    a, b = _eval(m.lhs, q, k, op), _eval(m.rhs, q, k, op)
    return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b,
            "//": lambda: a // b, "%": lambda: a % b}[m.op]()
  if isinstance(m, ir.Fn):
    args = [_eval(a, q, k, op) for a in m.args]
    if m.name == "abs":
      return np.abs(np.asarray(args[0], object))
    out = np.asarray(args[0], object)
    for a in args[1:]:
      out = np.where(out <= a, out, a) if m.name == "min" else np.where(out >= a, out, a)
    return out
  if isinstance(m, ir.BoolConst):
    return np.full(np.broadcast_shapes(np.shape(q), np.shape(k)), m.value)
  if isinstance(m, ir.Compare):
    vals = [np.asarray(_eval(t, q, k, op), object) for t in m.terms]
    out = True
    for o, a, b in zip(m.ops, vals, vals[1:]):
      r = {"<": a < b, "<=": a <= b, "==": a == b, "!=": a != b, ">=": a >= b, ">": a > b}[o]
      out = np.logical_and(out, r.astype(bool))
    return out
  if isinstance(m, ir.Truth):
    return np.asarray(_eval(m.read, q, k, op), object) != 0
  if isinstance(m, ir.And):
    return np.logical_and.reduce([np.asarray(_eval(i, q, k, op), bool) for i in m.items])
  if isinstance(m, ir.Or):
    return np.logical_or.reduce([np.asarray(_eval(i, q, k, op), bool) for i in m.items])
  if isinstance(m, ir.Xor):
    return np.logical_xor.reduce([np.asarray(_eval(i, q, k, op), bool) for i in m.items])
  if isinstance(m, ir.Not):
    return ~np.asarray(_eval(m.item, q, k, op), bool)
  if isinstance(m, ir.Call):
    return _eval(maskc.language.ir.expand(m), q, k, op)
  raise TypeError(type(m))


def traced_grid(m, q_len, kv_len, bq, bk, offset, operands):
  """The tile grid compiled with the operands traced (jit it)."""
  return maskc.compile(m, q_len, kv_len, block_q=bq, block_kv=bk, q_offset=offset,
                       operands=operands).grid


def check_tiles(grid, dense, bq, bk):
  """Unsound tiles: FULL with a false position, EMPTY with a true one."""
  bad = 0
  lead = grid.shape[:-2]
  for idx in np.ndindex(*lead) if lead else [()]:
    g, d = grid[idx], dense[idx]
    for i, j in zip(*np.nonzero(g != 1)):
      tile = d[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
      if (g[i, j] == 2 and not tile.all()) or (g[i, j] == 0 and tile.any()):
        bad += 1
  return bad


def lowering_cases(n: int, seed: int, report) -> dict:
  rng = random.Random(seed)
  nrng = np.random.default_rng(seed)
  stats = {"cases": 0, "refused": 0, "unsound_tiles": 0, "tiles": 0, "crashes": 0,
           "wrong_dense": 0, "traced": 0, "traced_differs": 0}
  traced_fn = {}
  for case in range(n):
    if case and case % 5000 == 0:
      print(f"  lowering after {case}: {stats}", flush=True)
    big = rng.random() < 0.1
    text = random_mask(rng, rng.randint(0, 3), big)
    kv_len = rng.randint(1, 40)
    q_len = rng.randint(1, kv_len)
    offset = kv_len - q_len if rng.random() < 0.7 else rng.choice([0, 3, 2**31 - 8, 2**37])
    batch = rng.choice([None, None, 2])
    bq, bk = rng.choice([1, 2, 3, 4, 8, 16]), rng.choice([1, 2, 4, 5, 8, 16])
    ops = operands(nrng, max(kv_len, q_len + offset if offset < 10**6 else kv_len) + 64, batch,
                   big)
    stats["cases"] += 1
    try:
      m = maskc.parse(text)
      used = {s.name for s in m.operands}
      ops_m = {k: v for k, v in ops.items() if k in used}
      bm = maskc.compile(m, q_len, kv_len, block_q=bq, block_kv=bk, q_offset=offset,
                         operands=ops_m)
      grid = np.asarray(bm.grid)
    except maskc.MaskError:
      stats["refused"] += 1
      continue
    except Exception:  # noqa: BLE001 - a finding
      stats["crashes"] += 1
      report(f"crash compiling {text!r} q_len={q_len} kv_len={kv_len} offset={offset}\n"
             + traceback.format_exc(limit=2))
      continue
    try:
      dense = np.asarray(reference(m, q_len, kv_len, offset, ops_m, bm.batch), bool)
    except (OverflowError, ValueError, ZeroDivisionError):
      continue
    if bm.batch and dense.ndim == 2:
      dense = np.broadcast_to(dense, (bm.batch,) + dense.shape)
    bad = check_tiles(grid, dense, bq, bk)
    stats["tiles"] += grid.size
    if bad:
      stats["unsound_tiles"] += bad
      report(f"UNSOUND {bad} tiles: {text!r} q_len={q_len} kv_len={kv_len} offset={offset} "
             f"tiles={bq}x{bk} batch={batch}")
    try:
      mat = np.asarray(maskc.materialize(m, q_len, kv_len, q_offset=offset, operands=ops_m))
      if not np.array_equal(np.broadcast_to(mat, dense.shape), dense):
        stats["wrong_dense"] += 1
        report(f"materialize differs: {text!r} q_len={q_len} kv_len={kv_len} offset={offset}")
    except maskc.MaskError:
      pass
    except Exception:  # noqa: BLE001 - a finding
      stats["crashes"] += 1
      report(f"crash materializing {text!r} offset={offset}\n" + traceback.format_exc(limit=2))
    if case % 250 == 0 and offset < 2**31 and not big:
      key = (str(m), q_len, kv_len, offset, bq, bk, tuple(sorted(ops_m)))
      try:
        fn = traced_fn.get(key) or jax.jit(
            functools.partial(traced_grid, m, q_len, kv_len, bq, bk, offset))
        tgrid = np.asarray(fn({k: jnp.asarray(v) for k, v in ops_m.items()}))
        stats["traced"] += 1
        if check_tiles(tgrid, dense, bq, bk):
          stats["traced_differs"] += 1
          report(f"UNSOUND traced: {text!r} q_len={q_len} kv_len={kv_len} offset={offset}")
      except maskc.MaskError:
        pass
      except Exception:  # noqa: BLE001
        stats["crashes"] += 1
        report(f"crash tracing {text!r}\n" + traceback.format_exc())
  return stats


VALID = ["causal & chunk(8192) | bidirectional(img)", "sliding(w) | sink(4)",
         "local = causal & chunk(C) & document(seg)\nlocal | prefix(n)",
         "abs(q // W - k // W) <= r & abs(q % W - k % W) <= r", "q - k < 128 & k <= q",
         "allowed[q, k] | g[q] | g[k]", "streaming(w, s) = sliding(w) | sink(s)\nstreaming(64, 4)",
         "runs(img)[q] == runs(img)[k] & img[q]", "min(q, 3) < max(k, 2) ^ ~causal"]
ALPHABET = list("qk()[]&|^~<=>!+-*/%,;#\n 0123456789_abcxyz") + ["causal", "chunk", "runs",
                                                                "where", "//", "==", "sliding"]


def text_cases(n: int, seed: int, report) -> dict:
  rng = random.Random(seed + 1)
  stats = {"texts": 0, "accepted": 0, "refused": 0, "crashes": 0, "slow": 0, "max_s": 0.0}
  for i in range(n):
    if i and i % 100000 == 0:
      print(f"  texts after {i}: {stats}", flush=True)
    r = rng.random()
    if r < 0.15:
      text = bytes(rng.randrange(256) for _ in range(rng.randint(0, 60))).decode("latin-1")
    else:
      text = list(rng.choice(VALID))
      for _ in range(rng.randint(1, 6)):
        op = rng.random()
        pos = rng.randint(0, len(text))
        if op < 0.35:
          text.insert(pos, rng.choice(ALPHABET))
        elif op < 0.6 and text:
          del text[min(pos, len(text) - 1)]
        elif op < 0.8 and text:
          i, j = rng.randrange(len(text)), rng.randrange(len(text))
          text[i], text[j] = text[j], text[i]
        else:
          text.insert(pos, rng.choice(ALPHABET) * rng.choice([2, 10, 300, 5000]))
      text = "".join(text)
    stats["texts"] += 1
    t0 = time.perf_counter()
    try:
      maskc.parse(text, w=64, C=8, n=3, W=16, r=1)
      stats["accepted"] += 1
    except maskc.MaskError as e:
      stats["refused"] += 1
      if len(str(e)) > 5000:
        report(f"long error ({len(str(e))} chars) for {text[:80]!r}")
    except Exception:  # noqa: BLE001
      stats["crashes"] += 1
      report(f"crash parsing {text[:200]!r}\n" + traceback.format_exc())
    dt = time.perf_counter() - t0
    stats["max_s"] = max(stats["max_s"], dt)
    if dt > 1.0:
      stats["slow"] += 1
      report(f"slow parse {dt:.2f}s: {text[:80]!r}")
  return stats


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cases", type=int, default=2000)
  p.add_argument("--texts", type=int, default=20000)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  findings = []

  def report(msg):
    findings.append(msg)
    print(msg, file=sys.stderr, flush=True)

  t0 = time.perf_counter()
  if args.cases:
    print("lowering:", lowering_cases(args.cases, args.seed, report), flush=True)
  if args.texts:
    print("texts:", text_cases(args.texts, args.seed, report), flush=True)
  print(f"{len(findings)} findings in {time.perf_counter() - t0:.0f} s")
  return 1 if findings else 0


if __name__ == "__main__":
  sys.exit(main())
