"""Where in a config an error points, and the checks every section of a config shares.

A config's errors name the file and the key path (`layers[3].mask`); `Where` is
that pair for the config being loaded, and builds its errors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from maskc.config.files import key_path
from maskc.language.errors import ConfigError, short_repr
from maskc.language.parse import BUILTINS, RESERVED, nearest, prelude


@dataclasses.dataclass(frozen=True)
class Where:
  """The config being loaded: its file (None for a dict) and the key path of its root."""
  file: str | None
  root: str

  def path(self, key: Any) -> str:
    """The key path of a top-level key."""
    return key_path(self.root, key)

  def error(self, message: str, path: str, hint: str | None = None) -> ConfigError:
    """A `ConfigError` at `path` in this config."""
    return ConfigError(message, path=path or None, file=self.file, hint=hint)


def shown(key: Any) -> str:
  """A config key as an error quotes it: short keys as they are, long ones cut."""
  text = str(key) if isinstance(key, str) else short_repr(key, 60)
  return text if len(text) <= 60 else text[:57] + "..."


def did_you_mean(word: Any, choices: Iterable[str]) -> str:
  """"Did you mean `x`? " for the choice nearest `word`, or "" when none is near (or `word`
  is not text)."""
  guess = nearest(word, choices) if isinstance(word, str) else None
  return f"Did you mean `{guess}`? " if guess else ""


def check_name(where: Where, name: Any, path: str, what: str) -> None:
  """Refuses a parameter or operand name that is not a name, is reserved, or hides a
  prelude mask."""
  if not isinstance(name, str) or not name.isidentifier():
    raise where.error(f"{what} name {short_repr(name)} is not a name", path,
                      hint="Names are letters, digits and `_`, not starting with a digit.")
  if name in RESERVED or name in BUILTINS:
    raise where.error(f"{what} name `{name}` is reserved in the mask language", path,
                      hint="Choose another name.")
  if name in prelude():
    raise where.error(f"{what} name `{name}` would hide the prelude mask `{name}`", path,
                      hint="Choose another name.")
