"""`context_parallel:`: how a config's model splits its sequence over a mesh axis."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from maskc.config.files import key_path
from maskc.config.where import Where, did_you_mean, shown
from maskc.language.errors import short_repr

# `context_parallel:` keys and their values (those of `maskc.sharded_attention`).
CHOICES = {"layout": ("contiguous", "zigzag", "balanced"), "strategy": ("all_gather", "ring")}


@dataclasses.dataclass(frozen=True)
class ContextParallel:
  """How a config's model splits its sequence over a mesh axis, as `context_parallel:` says.

  Attributes:
    layout: `"contiguous"`, `"zigzag"` or `"balanced"` (see `maskc.balance`).
    strategy: `"all_gather"` or `"ring"` (see `maskc.sharded_attention`).

  >>> import maskc
  >>> cfg = maskc.load_config({"num_layers": 1, "layers": ["causal"],
  ...                          "context_parallel": {"layout": "zigzag", "strategy": "ring"}})
  >>> cfg.context_parallel.kwargs()
  {'layout': 'zigzag', 'strategy': 'ring'}
  """
  layout: str = "contiguous"
  strategy: str = "all_gather"

  def kwargs(self) -> dict[str, str]:
    """The keywords to pass to `maskc.sharded_attention` (`**cfg.context_parallel.kwargs()`)."""
    return {"layout": self.layout, "strategy": self.strategy}


def read_context_parallel(data: Mapping[str, Any], where: Where) -> ContextParallel | None:
  """The `context_parallel:` entry: a mapping of `layout` and `strategy`, each optional."""
  if "context_parallel" not in data:
    return None
  raw = data["context_parallel"]
  base = where.path("context_parallel")
  example = "context_parallel: {layout: zigzag, strategy: ring}"
  if not isinstance(raw, Mapping):
    raise where.error(f"context_parallel must be a mapping of layout and strategy, got "
                      f"{short_repr(raw)}", base, hint=example)
  values = {}
  for key, value in raw.items():
    p = key_path(base, str(key))
    if key not in CHOICES:
      raise where.error(f"unknown key `{shown(key)}` in context_parallel", p,
                        hint=did_you_mean(str(key), CHOICES)
                        + "context_parallel has `layout` and `strategy`.")
    choices = CHOICES[key]
    if not isinstance(value, str) or value not in choices:
      raise where.error(f"context_parallel {key} {short_repr(value)} is not one of "
                        f"{', '.join(choices)}", p,
                        hint=did_you_mean(value, choices) + f"{key}: {' | '.join(choices)}.")
    values[key] = value
  return ContextParallel(**values)
