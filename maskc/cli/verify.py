"""`maskc verify`: check a dense mask saved elsewhere against a maskc expression.

    maskc verify "causal & document(seg)" --against mask.npy --operand seg=@seg.npy

The file holds a boolean array `[Lq, Lk]` or `[B, H, Lq, Lk]`: a `.npy` file (memory-mapped,
so a long mask is read a band of rows at a time), a `.npz` archive (its one array, or the one
`--key` names) or a `.pt` file saved with `torch.save` (a tensor, or a dict of them with
`--key`; needs torch). Exits 0 when the two agree at every position, 1 when they differ (the
first difference is printed) or on a bad input.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any, TextIO

import numpy as np

import maskc
from maskc.cli.args import OPERAND_VALUES_HELP, operands_from_items


def add_verify(subparsers) -> None:
  """Declares the `verify` subcommand on `subparsers` (an argparse subparsers action)."""
  p = subparsers.add_parser(
      "verify", help="check a dense mask saved in a file against a maskc expression",
      description="Compare a dense boolean mask ([Lq, Lk] or [B, H, Lq, Lk]) from a .npy, .npz "
                  "or .pt file with a maskc mask at every position, a band of rows at a time. "
                  "Prints the first position where they differ and exits 1, or exits 0.",
      epilog=OPERAND_VALUES_HELP)
  p.add_argument("expr", metavar="EXPR", help="mask text")
  p.add_argument("--against", required=True, metavar="FILE",
                 help="the dense mask: FILE.npy, FILE.npz or FILE.pt")
  p.add_argument("--key", metavar="NAME", help="the array's name in a .npz or .pt holding several")
  p.add_argument("--offset", type=int, metavar="O",
                 help="maskc's query position of row 0 (default: Lk - Lq, bottom-right aligned; "
                      "0 for FlexAttention's and splash's top-left alignment)")
  p.add_argument("--operand", action="append", default=[], metavar="NAME=VALUES",
                 help="a runtime operand; repeat for several")
  p.set_defaults(run=run_verify)


def run_verify(args: argparse.Namespace, out: TextIO) -> int:
  """Runs `maskc verify` with parsed `args`; returns 0 when the masks agree, else 1."""
  mask = maskc.parse(args.expr)
  foreign = load_dense(args.against, args.key)
  result = maskc.verify(mask, foreign, operands=operands_from_items(args.operand),
                        q_offset=args.offset)
  out.write(("ok: " if result.ok else "differs: ") + result.why + "\n")
  if not result.ok and result.counterexample is not None:
    b, h, i, j = result.counterexample
    out.write(f"counterexample: batch {b}, head {h}, q_index {i}, k_index {j}: the file has "
              f"{_word(result.found)}, `{mask}` {_word(result.expected)}\n")
  return 0 if result.ok else 1


def _word(value: bool | None) -> str:
  return {True: "true", False: "false", None: "no value"}[value]


def load_dense(path: str, key: str | None = None) -> Any:
  """The dense mask in `path` (`.npy` memory-mapped, `.npz`, or `.pt` with torch)."""
  p = pathlib.Path(path)
  if not p.exists():
    raise maskc.MaskValueError(f"no such file: {path}")
  suffix = p.suffix.lower()
  try:
    if suffix == ".npy":
      return np.load(p, mmap_mode="r", allow_pickle=False)
    if suffix == ".npz":
      with np.load(p, allow_pickle=False) as archive:
        return _pick(dict(archive.items()), key, path)
  except (OSError, ValueError, EOFError) as e:
    raise maskc.MaskValueError(f"cannot load {path}: {e}",
                               hint="Save the mask with `numpy.save` or `numpy.savez`.") from None
  if suffix == ".pt":
    try:
      import torch
    except ImportError:
      raise maskc.MissingExtraError(f"{path} is a torch file, and torch is not installed",
                                    extra="torch", hint="Or save the mask as a .npy file."
                                    ) from None
    try:
      value = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for a bad file
      raise maskc.MaskValueError(f"cannot load {path}: {e}",
                                 hint="Save the mask tensor with `torch.save`.") from None
    if isinstance(value, dict):
      return _pick(value, key, path)
    if not isinstance(value, torch.Tensor):
      raise maskc.MaskValueError(f"{path} holds a {type(value).__name__}, not a tensor")
    return value
  raise maskc.MaskValueError(f"cannot read {path}: expected a .npy, .npz or .pt file")


def _pick(arrays: dict[str, Any], key: str | None, path: str) -> Any:
  if key is not None:
    if key not in arrays:
      raise maskc.MaskValueError(f"{path} has no array `{key}`; it has {sorted(arrays)}")
    return arrays[key]
  if len(arrays) != 1:
    raise maskc.MaskValueError(f"{path} holds {len(arrays)} arrays: {sorted(arrays)}",
                               hint="Name the mask with --key.")
  return next(iter(arrays.values()))
