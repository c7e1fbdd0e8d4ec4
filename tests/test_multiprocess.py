"""`maskc.sharded_attention` across two JAX processes on this host.

Two processes, each with two CPU devices, join with `jax.distributed.initialize` (the
coordinator on a free localhost port) and run `tests/multiprocess_worker.py`: both strategies
with static operands, traced operands sharded over the mesh, and global operand arrays outside
jit; each process checks the output shards it holds against a NumPy reference. Both processes
always end here: on a timeout or a failure of either, both are killed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

import multiprocess_worker

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 900   # seconds for both processes (about 45 s of CPU each)
TOL = 1e-5


def free_port() -> int:
  """A localhost port nothing listens on now (the OS picks it)."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_processes(out_dir, script: str = "multiprocess_worker.py",
                  timeout: int = TIMEOUT) -> list[dict]:
  """Runs `tests/<script> PORT ID OUT` as processes 0 and 1 until both end; returns each one's
  JSON results. When one fails, or the timeout passes, the other is killed."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  port = free_port()
  outs = [out_dir / f"process{i}.json" for i in range(2)]
  logs = [open(out_dir / f"process{i}.log", "w+") for i in range(2)]
  procs: list[subprocess.Popen] = []
  try:
    for i in range(2):
      procs.append(subprocess.Popen(
          [sys.executable, os.path.join(HERE, script), str(port), str(i), str(outs[i])],
          env=env, stdout=logs[i], stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
      if any(p.returncode for p in procs):   # one failed: the other would wait for it
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  texts = []
  for log in logs:
    log.seek(0)
    texts.append(log.read())
    log.close()
  for i, p in enumerate(procs):
    assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{texts[i][-4000:]}"
  return [json.loads(o.read_text()) for o in outs]


@pytest.mark.slow
def test_two_processes_attend_like_one(tmp_path):
  results = run_processes(tmp_path)
  want = {multiprocess_worker.case_id(c) for c in multiprocess_worker.CASES}
  for i, res in enumerate(results):
    assert set(res) == want, (i, res)
    assert all(err < TOL for err in res.values()), (i, res)


def test_cases_cover_both_strategies_with_static_and_sharded_operands():
  cases = multiprocess_worker.CASES
  for kind in ("static", "traced"):
    assert {c[0] for c in cases if c[1] == kind} == {"all_gather", "ring"}


def test_a_failing_process_is_reported_and_the_other_killed(tmp_path):
  # process 0 fails at once; process 1 would wait for it forever
  script = tmp_path / "worker.py"
  script.write_text("import os, sys, time\n"
                    "open(sys.argv[3] + '.pid', 'w').write(str(os.getpid()))\n"
                    "sys.exit(3) if sys.argv[2] == '0' else time.sleep(600)\n")
  with pytest.raises(AssertionError, match="process 0 exited with 3"):
    run_processes(tmp_path, script=str(script))
  for i in range(2):
    pid = int((tmp_path / f"process{i}.json.pid").read_text())
    with pytest.raises(ProcessLookupError):   # ended and reaped
      os.kill(pid, 0)
