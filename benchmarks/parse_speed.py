"""Parse speed: this checkout's parser against another checkout's, in one run.

Times `maskc.parse` without its cache (lark's parse plus the elaboration into IR) over the
prelude and typical masks, and the elaboration alone (the syntax tree parsed once). Each
side runs in its own subprocess with its `maskc` first on `PYTHONPATH`; the two alternate
for `--rounds` rounds and each keeps its best time, so both meet the machine in the same
state. The table gives both times and their ratio (this checkout / the baseline).

  git worktree add /tmp/maskc-base <commit>        # the baseline: an older commit
  python benchmarks/parse_speed.py --baseline /tmp/maskc-base [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(HERE)

# (label, text, params): the README's masks, a program with definitions, and a long union.
CASES = [
    ("causal & chunk(C) | bidirectional(img)", "causal & chunk(C) | bidirectional(img)",
     {"C": 8192}),
    ("sliding(4096) | sink(4)", "sliding(4096) | sink(4)", {}),
    ("dilated window", "causal & (q - k) % 4 == 0 & q - k < 4096", {}),
    ("prefix-LM per document", "document(seg) & (causal | pfx[k])", {}),
    ("2-D neighbourhood", "abs(q // W - k // W) <= r & abs(q % W - k % W) <= r",
     {"W": 64, "r": 3}),
    ("block selection", "causal & topk[q // 64, k // 64]", {}),
    ("definitions", "local = causal & chunk(8192)\nstreaming(w, s) = sliding(w) | sink(s)\n"
                    "local | streaming(1024, 4) | bidirectional(img)", {}),
    ("union of 64 bands", " | ".join(f"q - k == {i}" for i in range(64)), {}),
]


def _best(fn, repeat: int) -> float:
  """CPU seconds per call of `fn`: the best of a few batches of `repeat` calls.

  CPU time of this process, not wall time: on a shared machine, time spent waiting for a
  core is not the parser's.
  """
  best = float("inf")
  for _ in range(5):
    t0 = time.process_time()
    for _ in range(repeat):
      fn()
    best = min(best, (time.process_time() - t0) / repeat)
  return best


def worker() -> dict[str, float]:
  """Times every case with the `maskc` that imports first; seconds per parse by label."""
  import maskc
  from maskc.language import parse as parse_module

  out = {}
  # The prelude: its text parsed and every definition elaborated, as at first import.
  out["prelude"] = _best(lambda: (parse_module.prelude.cache_clear(), parse_module.prelude()),
                         10)
  cached = parse_module._parse_cached  # the cache `maskc.parse` keeps; cleared to time parses
  for label, text, params in CASES:
    def parse(text=text, params=params):
      cached.cache_clear()
      return maskc.parse(text, **params)
    out[label] = _best(parse, 50)
  # The elaboration alone: trees parsed once, then turned into IR.
  library = parse_module.prelude()

  def elaborate(text, params, tree):
    return parse_module._Program(text, library, dict(params)).program(tree)
  trees = [(text, params, parse_module.parse_tree(text)) for _, text, params in CASES]
  out["elaboration only, all masks"] = _best(
      lambda: [elaborate(text, params, tree) for text, params, tree in trees], 20)
  return out


def run(path: str) -> dict[str, float]:
  env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, __file__, "--worker"], env=env, check=True,
                        capture_output=True, text=True)
  return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--baseline", help="a checkout whose maskc/ is the baseline")
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    print(json.dumps(worker()))
    return
  sides = {"this checkout": CHECKOUT}
  if args.baseline:
    sides["baseline"] = os.path.abspath(args.baseline)
  best: dict[str, dict[str, float]] = {side: {} for side in sides}
  for r in range(args.rounds):
    # Alternate which side runs first, so neither always meets the machine after the other.
    for side, path in (list(sides.items())[::-1] if r % 2 else sides.items()):
      for label, seconds in run(path).items():
        best[side][label] = min(best[side].get(label, float("inf")), seconds)
  labels = list(best["this checkout"])
  if "baseline" not in best:
    print("| case | µs per parse |\n|---|---:|")
    for label in labels:
      print(f"| {_cell(label)} | {1e6 * best['this checkout'][label]:.1f} |")
    return
  print("| case | baseline µs | this checkout µs | ratio |\n|---|---:|---:|---:|")
  for label in labels:
    old, new = best["baseline"][label], best["this checkout"][label]
    print(f"| {_cell(label)} | {1e6 * old:.1f} | {1e6 * new:.1f} | {new / old:.2f} |")
  ratios = [best["this checkout"][label] / best["baseline"][label] for label in labels]
  print(f"| geometric mean | | | {math.prod(ratios) ** (1 / len(ratios)):.2f} |")


def _cell(label: str) -> str:
  return f"`{label}`".replace("|", "\\|") if "|" in label else label


if __name__ == "__main__":
  main()
