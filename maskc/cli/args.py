"""Arguments and helpers shared by the `maskc` subcommands (`maskc.cli`, `maskc.cli.show`).

A subcommand that draws a mask takes the mask text, its shape and its operands
(`add_shape_arguments`), reads the `--operand NAME=VALUES` items into arrays
(`operands_from_items`, values in the syntax of `maskc.cli.operands`) and picks
Unicode or ASCII art by what the output can encode (`can_encode`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TextIO

import numpy as np

from maskc.cli.operands import parse_operand_value
from maskc.language.errors import MaskError, MaskValueError

OPERAND_VALUES_HELP = (
    "Operand values: a bare integer is a scalar (kv_len=10); comma-separated items make a "
    "per-token array, each an integer or v*n for v repeated n times (img=0*3,1*5,0*4); "
    "LEN:DEFAULT,VALUE:START-STOP,... sets half-open ranges in an array of LEN "
    "(img=32768:0,1:1000-3000); @file.npy loads any array.")


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
  """The mask, its shape and its operands: the arguments every drawing subcommand takes."""
  p.add_argument("expr", metavar="EXPR", help="mask text")
  p.add_argument("--q-len", type=int, required=True, metavar="N", help="query rows")
  p.add_argument("--kv-len", type=int, metavar="M", help="key columns (default: N)")
  p.add_argument("--offset", type=int, metavar="O",
                 help="position of query row 0 (default: M - N, bottom-right aligned)")
  p.add_argument("--operand", action="append", default=[], metavar="NAME=VALUES",
                 help="a runtime operand; repeat for several")


def operands_from_items(items: Sequence[str]) -> dict[str, np.ndarray | int]:
  """`NAME=VALUES` strings (the `--operand` items) to operand values by name.

  >>> operands_from_items(["img=0*2,1*2", "kv_len=10"])
  {'img': array([0, 0, 1, 1]), 'kv_len': 10}
  """
  result: dict[str, np.ndarray | int] = {}
  for item in items:
    name, eq, text = item.partition("=")
    name = name.strip()
    if not eq or not name.isidentifier():
      raise MaskValueError(f"--operand takes NAME=VALUES, got {item!r}",
                           hint="e.g. `--operand img=0,0,1,1` or `--operand kv_len=10`.")
    if name in result:
      raise MaskValueError(f"operand `{name}` is given twice")
    try:
      result[name] = parse_operand_value(text)
    except MaskError as e:
      raise MaskValueError(f"operand `{name}`: {e.message}", hint=e.hint) from None
  return result


def can_encode(out: TextIO, chars: str) -> bool:
  """Whether `out` can write `chars` (else the drawings fall back to ASCII)."""
  try:
    chars.encode(getattr(out, "encoding", None) or "ascii")
  except (UnicodeEncodeError, LookupError):
    return False
  return True
