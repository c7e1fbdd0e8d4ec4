"""The maskc language: its lark grammar and the prelude, as package data.

Installed as ``maskc.grammar``. The files are read with ``importlib.resources``
so the package works from a checkout, an editable install and a wheel alike.
"""

from importlib import resources


def grammar_text() -> str:
  """The lark grammar of the mask language."""
  return resources.files(__name__).joinpath("maskc.lark").read_text("utf-8")


def prelude_text() -> str:
  """The prelude: the standard named masks, written in the language."""
  return resources.files(__name__).joinpath("prelude.mask").read_text("utf-8")
