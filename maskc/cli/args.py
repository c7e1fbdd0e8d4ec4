"""Arguments and helpers shared by the `maskc` subcommands (`maskc.cli`, `maskc.cli.show`).

Every subcommand takes the mask text and its parameters (`add_mask_arguments`,
`--param NAME=VALUE` read by `params_from_items`); one that draws a mask also takes its
shape and operands (`add_shape_arguments`), reads the `--operand NAME=VALUES` items into
arrays (`operands_from_items`, values in the syntax of `maskc.cli.operands`), checks that
the mask gets every operand it reads (`check_operands`) and picks Unicode or ASCII art by
what the output can encode (`can_encode`). Errors print through `CLI`, which says how to
bind a name in command-line terms (`--param C=8192`, `--operand seg=...`).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Collection, Mapping, Sequence
from typing import Any, TextIO

import numpy as np

from maskc.cli.operands import parse_operand_value
from maskc.language import ir
from maskc.language.errors import (
  Frontend,
  MaskError,
  MaskValueError,
  OperandError,
  Unbound,
  example,
  names,
)
from maskc.language.parse import parse

# The shapes an operand of each kind takes, as text.
SHAPES = {"scalar": "[] or [B]", "token": "[L] or [B, L]", "pair": "[Lq, Lk] or [B, Lq, Lk]"}

OPERAND_VALUES_HELP = (
    "Operand values: a bare integer is a scalar (kv_len=10); comma-separated items make a "
    "per-token array, each an integer or v*n for v repeated n times (img=0*3,1*5,0*4); "
    "LEN:DEFAULT,VALUE:START-STOP,... sets half-open ranges in an array of LEN "
    "(img=32768:0,1:1000-3000); @file.npy loads any array.")


class _Cli:
  """The command line's terms for binding a name: `--param` and `--operand`."""

  def bind_params(self, params: Sequence[Unbound]) -> str:
    flags = " ".join(f"--param {p.name}={example(p)}" for p in params)
    return f"Bind {names(params)}: `{flags}`."

  def pass_operands(self, operands: Sequence[Unbound]) -> str:
    flags = " ".join(f"--operand {o.name}=..." for o in operands)
    scalars = [o for o in operands if o.kind == "scalar"]
    # A scalar operand could be a parameter the user forgot to bind.
    also = (f", or bind {names(scalars)} when parsing: `"
            + " ".join(f"--param {o.name}=..." for o in scalars) + "`") if scalars else ""
    return f"Pass {names(operands)}: `{flags}`{also}."


CLI: Frontend = _Cli()


def add_mask_arguments(p: argparse.ArgumentParser) -> None:
  """The mask text and its parameters: the arguments every subcommand takes."""
  p.add_argument("expr", metavar="EXPR", help="mask text")
  p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                 help="bind a parameter of the text to an integer (chunk(C) with --param "
                      "C=8192); repeat for several")


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
  """The mask, its parameters, its shape and its operands: what a drawing subcommand takes."""
  add_mask_arguments(p)
  p.add_argument("--q-len", type=int, required=True, metavar="N", help="query rows")
  p.add_argument("--kv-len", type=int, metavar="M", help="key columns (default: N)")
  p.add_argument("--offset", type=int, metavar="O",
                 help="position of query row 0 (default: M - N, bottom-right aligned)")
  p.add_argument("--operand", action="append", default=[], metavar="NAME=VALUES",
                 help="a runtime operand; repeat for several")


def params_from_items(items: Sequence[str]) -> dict[str, int]:
  """`NAME=VALUE` strings (the `--param` items) to integer parameter values by name.

  >>> params_from_items(["C=8192", "W=4_096"])
  {'C': 8192, 'W': 4096}
  """
  result: dict[str, int] = {}
  for name, text in _named_items(items, "--param", "NAME=VALUE", "parameter",
                                 "e.g. `--param C=8192`."):
    try:
      result[name] = int(text.strip())
    except ValueError:
      raise MaskValueError(f"parameter `{name}` must be an integer, got {text.strip()!r}",
                           hint="e.g. `--param C=8192`. A mask is written in the text itself: "
                                "`local = causal & chunk(C); local | sink(4)`.") from None
  return result


def _named_items(items: Sequence[str], flag: str, form: str, what: str,
                 example: str) -> list[tuple[str, str]]:
  """`NAME=TEXT` items of a repeated option as `(name, text)` pairs: each a name, none twice."""
  out: list[tuple[str, str]] = []
  for item in items:
    name, eq, text = item.partition("=")
    name = name.strip()
    if not eq or not name.isidentifier():
      raise MaskValueError(f"{flag} takes {form}, got {item!r}", hint=example)
    if name in (n for n, _ in out):
      raise MaskValueError(f"{what} `{name}` is given twice")
    out.append((name, text))
  return out


def unused_params(text: str, params: Mapping[str, Any]) -> list[str]:
  """The parameters whose name the mask text (comments aside) never mentions."""
  words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", re.sub(r"#[^\n]*", "", text)))
  return [name for name in params if name not in words]


def parse_mask(args: argparse.Namespace) -> ir.Mask:
  """The mask of `args.expr` with the `--param` values bound; notes the unused ones."""
  params = params_from_items(args.param)
  for name in unused_params(args.expr, params):
    sys.stderr.write(f"maskc: note: the mask does not use parameter `{name}`\n")
  return parse(args.expr, **params)


def check_operands(mask: ir.Mask, given: Collection[str]) -> None:
  """Refuses a mask whose operands are not all given (`--operand`), naming each missing one
  with its kind and shapes, and a given name close to it."""
  missing = [s for s in mask.operands if s.name not in given]
  if not missing:
    return
  what = ", ".join(f"`{s.name}` ({s.kind}, shape {SHAPES[s.kind]})" for s in missing)
  unused = [g for g in given if g not in {s.name for s in mask.operands}]
  guesses = [(s.name, ir.nearest(s.name, unused)) for s in missing]
  hint = " ".join(f"`{g}` is given but not read: did you mean `{s}`?"
                  for s, g in guesses if g) or None
  raise OperandError(f"missing operand{'s' if len(missing) > 1 else ''} {what}", hint=hint,
                     unbound=[Unbound(s.name, "operand", s.kind) for s in missing])


def operands_from_items(items: Sequence[str]) -> dict[str, np.ndarray | int]:
  """`NAME=VALUES` strings (the `--operand` items) to operand values by name.

  >>> operands_from_items(["img=0*2,1*2", "kv_len=10"])
  {'img': array([0, 0, 1, 1]), 'kv_len': 10}
  """
  result: dict[str, np.ndarray | int] = {}
  for name, text in _named_items(items, "--operand", "NAME=VALUES", "operand",
                                 "e.g. `--operand img=0,0,1,1` or `--operand kv_len=10`."):
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
