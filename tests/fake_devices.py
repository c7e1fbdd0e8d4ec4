"""Runs a test worker script on 8 fake CPU devices in a subprocess and reads its JSON results.

`XLA_FLAGS=--xla_force_host_platform_device_count=8` must be set before JAX starts, so
multi-device tests run their cases in a fresh interpreter.

Each script runs once per pytest run, however its tests are spread: under pytest-xdist
(`make test-slow`) every worker that reaches a module's fixture would otherwise start the
same subprocess (minutes each). The first one runs it under a lock, in a folder all
workers of the run share, and the others read its results. (xdist's `--dist loadgroup`
cannot keep a module on one worker with pytest 9.2: the group it appends to a test's
`_nodeid` is no longer read.)
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _run_folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
  """A folder for this pytest run: shared by its xdist workers, new for every run."""
  base = tmp_path_factory.getbasetemp()
  return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def run_worker(script: str, tmp_path_factory: pytest.TempPathFactory, timeout: int) -> dict:
  """Runs `tests/<script>` on 8 fake devices once per pytest run; returns its JSON results."""
  folder = _run_folder(tmp_path_factory)
  out = folder / f"{pathlib.Path(script).stem}.json"
  with open(folder / f"{pathlib.Path(script).stem}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)          # released when the file closes
    if not out.exists():
      env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
                 JAX_PLATFORMS="cpu")
      proc = subprocess.run([sys.executable, os.path.join(HERE, script), str(out)], env=env,
                            capture_output=True, text=True, timeout=timeout, check=False)
      assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())
