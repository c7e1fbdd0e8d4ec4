"""A long soundness campaign over `maskc.testing.masks()`, outside CI.

Draws masks with hypothesis (several operands of each kind, named calls and their
bodies, `~` and `^` over every leaf), shapes (offsets, `q_len` of 1, tiles larger
than the shape) and operand values, compiles each, and checks every tile against
the dense mask from `maskc.materialize`: no EMPTY tile over an allowed pair, no
FULL tile over a disallowed one, and no uniform PARTIAL tile for masks of prelude
masks alone. `--traced` cases compile under `jax.jit` with traced operands
(soundness only). Findings are printed as they come, with the counts, the rate
and the time at the end; it exits 1 if there was any.

    python benchmarks/soundness_campaign.py --static 100000 --traced 5000 --seed 0
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from hypothesis import HealthCheck, Phase, given, seed, settings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from test_soundness import check_static, check_traced, setups  # noqa: E402


def campaign(check, n: int, run_seed: int, max_depth: int, max_len: int) -> tuple[int, list]:
  """Runs `check` on `n` drawn setups; returns (cases run, findings)."""
  findings: list = []
  ran = [0]

  @seed(run_seed)
  @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
            suppress_health_check=list(HealthCheck))
  @given(setups(max_depth=max_depth, max_len=max_len))
  def run(s):
    ran[0] += 1
    try:
      check(s)
    except AssertionError as e:
      findings.append((s, str(e)))
      print(f"FINDING {len(findings)}: {s[0]} shape={s[1:4]} tiles={s[4:6]}\n  {e}", flush=True)

  run()
  return ran[0], findings


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--static", type=int, default=100_000)
  p.add_argument("--traced", type=int, default=5_000)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()
  bad = 0
  for name, check, n, depth, length in (("static", check_static, args.static, 3, 64),
                                        ("traced", check_traced, args.traced, 2, 40)):
    if not n:
      continue
    t0 = time.perf_counter()
    ran, findings = campaign(check, n, args.seed, depth, length)
    dt = time.perf_counter() - t0
    bad += len(findings)
    print(f"{name}: {ran} cases, {len(findings)} findings, {dt:.0f} s "
          f"({ran / dt:.1f} cases/s)", flush=True)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
