"""A config's parameters: `params:` and the caller's `load_config(..., C=...)`, and which
of them no mask uses."""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Iterable, Mapping
from typing import Any

from maskc.config.files import key_path
from maskc.config.where import Where, check_name
from maskc.language import ir
from maskc.language.errors import config_where, short_repr

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class Params:
  """The parameter values a config's masks are parsed with.

  Attributes:
    values: by name, the config's `params:` overridden by the caller's.
    paths: the key path of each parameter the config sets.
    caller: the values passed to `load_config`.
  """
  values: dict[str, Any]
  paths: dict[str, str]
  caller: dict[str, Any]

  def where(self, name: str) -> str:
    """Where `name` is set: its key path, or the `load_config` call."""
    return self.paths.get(name, f"load_config({name}=...)")


def read_params(data: Mapping[str, Any], caller: dict[str, Any], where: Where) -> Params:
  """The `params:` mapping (integers by name), overridden by the caller's values."""
  raw = data.get("params")
  if raw is None:
    raw = {}
  base = where.path("params")
  if not isinstance(raw, Mapping):
    raise where.error(f"params must be a mapping of names to integers, got "
                      f"{type(raw).__name__}", base, hint="params: {C: 8192}")
  values: dict[str, Any] = {}
  paths: dict[str, str] = {}
  for name, value in raw.items():
    p = key_path(base, name)
    check_name(where, name, p, "parameter")
    if isinstance(value, bool) or not isinstance(value, int):
      raise where.error(f"parameter `{name}` must be an integer, got {short_repr(value)}", p,
                        hint="Masks belong under `definitions:`; operands under `operands:`.")
    values[name] = value
    paths[name] = p
  for name, value in caller.items():
    at = f"load_config({name}=...)"
    check_name(where, name, at, "parameter")
    if not isinstance(value, (int, str, ir.Node)):
      try:
        value = operator.index(value)  # NumPy integers
      except TypeError:
        raise where.error(f"parameter `{name}` must be an int, a mask or an operand name, got "
                          f"{type(value).__name__} {short_repr(value)}", at) from None
    values[name] = value
  return Params(values, paths, caller)


def unused_params(params: Params, texts: Iterable[str], where: Where) -> list[str]:
  """Warnings for the parameters that no text (comments aside) names."""
  words: set[str] = set()
  for t in texts:
    words.update(_NAME.findall(re.sub(r"#[^\n]*", "", t)))
  out = []
  for name in params.values:
    if name in words:
      continue
    path = params.paths.get(name)
    if path is not None and name not in params.caller:
      out.append(f"parameter `{name}` ({config_where(where.file, path)}) is not used by any "
                 f"mask")
    else:
      out.append(f"parameter `{name}` passed to load_config is not used by any mask of "
                 f"{where.file or 'the config'}")
  return out
