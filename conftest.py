"""Collection of the package's doctests (`--doctest-modules` over `maskc/`).

tokamax is optional (`maskc[tokamax]`, Python >= 3.12): where it does not import, the one
module that imports it is left out of doctest collection (tests/test_tokamax_splash.py skips
itself there too). Flax is optional too (`maskc[flax]`): without it, `maskc/flax/` is left out
(tests/test_flax.py skips itself).
"""

import importlib.util

collect_ignore = ([] if importlib.util.find_spec("tokamax")
                  else ["maskc/kernels/splash/tokamax_kernel.py"])
if not importlib.util.find_spec("flax"):
  collect_ignore.append("maskc/flax")
