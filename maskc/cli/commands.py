"""The `maskc` command line: check a mask's text, draw it densely, verify a saved mask, read
a model's config.

    maskc check "causal & chunk(8192) | bidirectional(img)"
    maskc dense "causal & chunk(4) | bidirectional(img)" --q-len 12 \\
        --operand img=0*3,1*5,0*4

Each subcommand is one `_add_<name>(subparsers)` function that declares its
arguments and sets `run` to the function doing the work; `SUBCOMMANDS` lists
them, so a new subcommand is one function and one entry. A `MaskError` is
printed to stderr (with its line, column and caret) and exits 1; argparse
usage errors exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

import numpy as np

import maskc
from maskc.cli.args import (
  CLI,
  OPERAND_VALUES_HELP,
  SHAPES,
  add_mask_arguments,
  add_shape_arguments,
  can_encode,
  check_operands,
  operands_from_items,
  parse_mask,
)
from maskc.cli.config import add_config
from maskc.cli.show import add_show
from maskc.cli.verify import add_verify

MAX_DENSE_ROWS = 256
MAX_DENSE_COLS = 512

_KINDS = {"scalar": "scalar", "token": "per-token", "pair": "pairwise"}


# ----------------------------------------------------------------------------- check


def _add_check(subparsers) -> None:
  p = subparsers.add_parser(
      "check", help="parse a mask; print its canonical and simplified forms and its operands",
      description="Parse a mask and print its canonical text, its simplified form and the "
                  "runtime operands it needs. Exits 1 with a located error if the text is bad.")
  add_mask_arguments(p)
  p.set_defaults(run=_run_check)


def _run_check(args: argparse.Namespace, out: TextIO) -> int:
  m = parse_mask(args)
  _field(out, "canonical", str(m))
  _field(out, "simplified", str(m.simplify()))
  specs = m.operands
  if not specs:
    out.write("operands:   none\n")
    return 0
  out.write("operands:\n")
  width = max(len(s.name) for s in specs)
  for s in specs:
    kind = _KINDS[s.kind] + (", boolean" if s.boolean else "")
    out.write(f"  {s.name:<{width}}  {kind:<20}  shape {SHAPES[s.kind]}\n")
  return 0


def _field(out: TextIO, label: str, text: str) -> None:
  """`label: text`, or the text indented under the label when it spans lines."""
  if "\n" in text:
    out.write(f"{label}:\n" + "".join(f"  {line}\n" for line in text.splitlines()))
  else:
    out.write(f"{label + ':':<12}{text}\n")


# ----------------------------------------------------------------------------- dense


def _add_dense(subparsers) -> None:
  p = subparsers.add_parser(
      "dense", help="draw a mask densely as text, one row per query",
      description="Materialize a mask at a shape and draw it: one row per query position, one "
                  f"column per key position. At most {MAX_DENSE_ROWS} x {MAX_DENSE_COLS}.",
      epilog=OPERAND_VALUES_HELP)
  add_shape_arguments(p)
  p.add_argument("--ascii", action="store_true", help="draw with '#' and '.'")
  p.set_defaults(run=_run_dense)


def _run_dense(args: argparse.Namespace, out: TextIO) -> int:
  q_len, kv_len = args.q_len, args.q_len if args.kv_len is None else args.kv_len
  for name, value in (("--q-len", q_len), ("--kv-len", kv_len)):
    if value < 1:
      raise maskc.MaskValueError(f"{name} must be at least 1, got {value}")
  if q_len > MAX_DENSE_ROWS or kv_len > MAX_DENSE_COLS:
    raise maskc.MaskValueError(
        f"a {q_len} x {kv_len} mask is too large to draw as text; the limit is "
        f"{MAX_DENSE_ROWS} x {MAX_DENSE_COLS}",
        hint="Draw a smaller shape: the pattern of most masks shows at a few dozen tokens.")
  m = parse_mask(args)
  operands = operands_from_items(args.operand)
  check_operands(m, operands)
  needed = {s.name for s in m.operands}
  for name in operands:
    if name not in needed:
      sys.stderr.write(f"maskc: note: the mask does not read operand `{name}`\n")
  dense = np.asarray(maskc.materialize(m, q_len, kv_len, q_offset=args.offset,
                                       operands=operands))
  q_offset = kv_len - q_len if args.offset is None else args.offset
  on, off = ("#", ".") if args.ascii or not can_encode(out, "█·") else ("█", "·")
  out.write(f"{m}\n")
  out.write(f"q_len={q_len} kv_len={kv_len} q_offset={q_offset}\n")
  if dense.ndim == 2:
    out.write(_draw(dense, q_offset, on, off))
  else:
    for b, plane in enumerate(dense):
      out.write(f"\nbatch {b}:\n")
      out.write(_draw(plane, q_offset, on, off))
  allowed = int(dense.sum())
  out.write(f"allowed: {allowed} of {dense.size} ({100 * allowed / dense.size:.1f}%)\n")
  return 0


def _draw(dense: np.ndarray, q_offset: int, on: str, off: str) -> str:
  """Text art of a `[q_len, kv_len]` bool array, rows labelled with their q positions."""
  q_len, kv_len = dense.shape
  labels = [str(q_offset + i) for i in range(q_len)]
  corner = "q\\k"
  width = max(len(corner), *(len(s) for s in labels))
  tens = [" "] * kv_len
  for j in range(0, kv_len, 10):  # each tenth column's number, where it fits
    digits = str(j)
    if j + len(digits) <= kv_len and all(c == " " for c in tens[j:j + len(digits)]):
      tens[j:j + len(digits)] = digits
  lines = [f"{corner:>{width}}  {''.join(tens).rstrip()}",
           f"{'':>{width}}  {''.join(str(j % 10) for j in range(kv_len))}"]
  for label, row in zip(labels, dense):
    lines.append(f"{label:>{width}}  {''.join(on if v else off for v in row)}")
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main

SUBCOMMANDS: list[Callable] = [_add_check, _add_dense, add_show, add_verify, add_config]


def build_parser() -> argparse.ArgumentParser:
  """The argument parser with every subcommand of `SUBCOMMANDS`."""
  parser = argparse.ArgumentParser(
      prog="maskc", description="maskc: an attention-mask compiler for JAX.")
  parser.add_argument("--version", action="version", version=f"maskc {maskc.__version__}")
  subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
  for add in SUBCOMMANDS:
    add(subparsers)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the `maskc` command line and returns its exit status.

  Args:
    argv: the arguments after the program name (default: `sys.argv[1:]`).

  Returns:
    0 on success, 1 when the mask or its inputs are bad (the error is on stderr).
    Usage errors exit 2 through `SystemExit`, as argparse does.

  >>> main(["check", "causal"])  # doctest: +ELLIPSIS
  canonical:  causal
  ...
  0
  """
  args = build_parser().parse_args(argv)
  try:
    return args.run(args, sys.stdout)
  except maskc.MaskError as e:  # its hint says how to bind a name in command-line terms
    sys.stderr.write(f"maskc {args.command}: error: {e.render(CLI)}\n")
    return 1


if __name__ == "__main__":
  sys.exit(main())
