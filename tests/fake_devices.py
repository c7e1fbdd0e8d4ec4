"""Runs a test worker script on 8 fake CPU devices in a subprocess and reads its JSON results.

`XLA_FLAGS=--xla_force_host_platform_device_count=8` must be set before JAX starts, so
multi-device tests run their cases in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_worker(script: str, out, timeout: int) -> dict:
  """Runs `tests/<script> <out>` on 8 fake devices; returns the JSON it wrote to `out`."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.join(HERE, script), str(out)], env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(out.read_text())
