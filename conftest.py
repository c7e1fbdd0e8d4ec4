"""Collection of the package's doctests (`--doctest-modules` over `maskc/`).

tokamax is optional (`maskc[tokamax]`, Python >= 3.12): where it does not import, the one
module that imports it is left out of doctest collection (tests/test_tokamax_splash.py skips
itself there too). Flax is optional too (`maskc[flax]`): without it, `maskc/flax/` is left out
(tests/test_flax.py skips itself). So is PyTorch (`maskc[torch]`): without it `maskc/torch/` is
left out, and with it its doctests carry the `torch` marker, so they run in `make test-torch`
(which selects `-m torch`) and not in the default run.
"""

import importlib.util
import pathlib

import pytest

collect_ignore = ([] if importlib.util.find_spec("tokamax")
                  else ["maskc/kernels/splash/tokamax_kernel.py"])
if not importlib.util.find_spec("flax"):
  collect_ignore.append("maskc/flax")
if not importlib.util.find_spec("torch"):
  collect_ignore.append("maskc/torch")

_TORCH_PACKAGE = pathlib.Path(__file__).resolve().parent / "maskc" / "torch"


def pytest_collection_modifyitems(items):
  for item in items:
    if _TORCH_PACKAGE in pathlib.Path(item.path).resolve().parents:
      item.add_marker(pytest.mark.torch)
