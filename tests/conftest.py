"""Test configuration: hypothesis profiles and CPU-only JAX.

Random masks for property tests come from the public `maskc.testing`.
Profiles: "ci" is derandomized and bounded (the same examples every run);
"dev" explores more. Pick one with `HYPOTHESIS_PROFILE=ci`; the default is "dev".
"""

import os

import hypothesis
import jax

# Tests compare against NumPy and run kernels in interpret mode: CPU is enough,
# and pinning it keeps results the same on machines with an accelerator. The GPU
# tests (`make test-gpu`, marker `gpu`) set MASKC_TEST_GPU=1 to keep the GPU.
if os.environ.get("MASKC_TEST_GPU") != "1":
  jax.config.update("jax_platforms", "cpu")

hypothesis.settings.register_profile(
    "ci", derandomize=True, max_examples=60, deadline=None, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.register_profile("dev", max_examples=100, deadline=None)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
