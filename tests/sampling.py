"""Example counts for the costliest property tests: a share by default, all of them when slow.

The default run (`make test`) must stay under 10 minutes on a 2-core machine, and some property
tests compile a kernel or a jitted function for every example, so their cost is the number of
examples. Such a test is parametrized by `PARTS` and draws `count(full, part)` examples: the
default run explores a tenth of them, and the twin marked `slow` (`make test-slow`, which CI
runs) explores all `full`, so CI checks as much as before the split.
"""

from __future__ import annotations

import hypothesis
import pytest

SHARE = 10  # the default run draws 1 / SHARE of a split test's examples


# Parametrize a split test with `@pytest.mark.parametrize("part", PARTS)`.
PARTS = [pytest.param("fast", id="fast"),
         pytest.param("full", id="full", marks=pytest.mark.slow)]


def count(full: int | None, part: str) -> int:
  """The `max_examples` for `part` of a test whose whole count is `full`.

  Args:
    full: the test's whole example count; None means the loaded hypothesis profile's
      `max_examples` (60 under "ci", 100 under "dev").
    part: "fast" (the default run: a 1 / SHARE share, at least 1) or "full" (marked slow).

  Returns:
    The number of examples hypothesis draws for this part.
  """
  full = hypothesis.settings.default.max_examples if full is None else full
  if part == "full":
    return full
  assert part == "fast", part
  return max(1, full // SHARE)
