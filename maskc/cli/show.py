"""`maskc show`: a mask's header and picture on the command line, or as PNG/SVG files.

    maskc show "causal & chunk(8192) | bidirectional(img)" --q-len 32768 \\
        --operand img=32768:0,1:1000-3000

Small shapes (up to 256 x 512) are drawn element by element with the tile grid
over them; larger ones, or any with `--tiles`, as the compiled tile map.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import TextIO

import maskc
from maskc.cli.args import (
  OPERAND_VALUES_HELP,
  add_shape_arguments,
  can_encode,
  check_operands,
  operands_from_items,
  parse_mask,
)
from maskc.language.errors import MissingExtraError
from maskc.tools.show import MAX_ELEMENT_COLS, MAX_ELEMENT_ROWS, MaskView


def add_show(subparsers) -> None:
  """Declares the `show` subcommand on `subparsers` (an argparse subparsers action)."""
  p = subparsers.add_parser(
      "show", help="draw a mask's tile map (or its elements, for small shapes) with its statistics",
      description="Compile a mask at a shape and print a header (shape, tiles, density, FLOPs "
                  "saved) and text art: element by element with tile boundaries up to "
                  f"{MAX_ELEMENT_ROWS} x {MAX_ELEMENT_COLS}, else the tile map, downsampled to "
                  "--width. --png and --svg write pictures too.",
      epilog=OPERAND_VALUES_HELP)
  add_shape_arguments(p)
  p.add_argument("--block-q", type=int, metavar="B",
                 help="query tile size (default: 128, or a few tiles per axis for small shapes)")
  p.add_argument("--block-kv", type=int, metavar="B", help="key tile size (default: --block-q)")
  p.add_argument("--tiles", action="store_true",
                 help="draw the tile map even when the shape is small enough for elements")
  p.add_argument("--width", type=int, metavar="W",
                 help="the widest line of the tile map (default: the terminal's, at most 120)")
  p.add_argument("--ascii", action="store_true", help="draw with ASCII characters only")
  p.add_argument("--png", metavar="PATH", help="also write a PNG (needs matplotlib)")
  p.add_argument("--svg", metavar="PATH", help="also write an SVG")
  p.set_defaults(run=run_show)


def run_show(args: argparse.Namespace, out: TextIO) -> int:
  """Runs `maskc show` with parsed `args`, writing text to `out`; returns the exit status."""
  for name, value in (("--q-len", args.q_len), ("--kv-len", args.kv_len),
                      ("--block-q", args.block_q), ("--block-kv", args.block_kv)):
    if value is not None and value < 1:
      raise maskc.MaskValueError(f"{name} must be at least 1, got {value}")
  width = args.width if args.width is not None else min(120, shutil.get_terminal_size().columns)
  if width < 10:
    raise maskc.MaskValueError(f"--width must be at least 10, got {width}")
  m = parse_mask(args)
  operands = operands_from_items(args.operand)
  check_operands(m, operands)
  view = maskc.show(m, args.q_len, args.kv_len, q_offset=args.offset, operands=operands,
                    block_q=args.block_q, block_kv=args.block_kv)
  if args.tiles and view.elements:
    view = MaskView(view.blockmap)
  ascii = args.ascii or not can_encode(out, "█▓░·─│┌")
  out.write(view.to_text(width=width, ascii=ascii))
  if args.svg:
    _write(args.svg, lambda path: _save_svg(view, path))
    out.write(f"wrote {args.svg}\n")
  if args.png:
    _write(args.png, lambda path: _save_png(view, path))
    out.write(f"wrote {args.png}\n")
  return 0


def _write(path: str, write) -> None:
  """Writes a picture, turning file-system errors into a MaskError the CLI reports."""
  try:
    write(path)
  except OSError as e:
    raise maskc.MaskValueError(f"cannot write {path}: {e.strerror or e}",
                               hint=f"Check that {os.path.dirname(path) or '.'} exists and is "
                                    "writable.") from None


def _save_svg(view: MaskView, path: str) -> None:
  with open(path, "w", encoding="utf-8") as f:
    f.write(view.to_svg())


def _save_png(view: MaskView, path: str) -> None:
  try:
    import matplotlib
  except ImportError:
    raise MissingExtraError("--png needs matplotlib, which is not installed", extra="plot",
                            hint="Or write --svg, which needs nothing.") from None
  if "matplotlib.pyplot" not in sys.modules:
    matplotlib.use("Agg")  # no window from a command line tool
  import matplotlib.pyplot as plt
  ax = view.plot()
  fig = (ax.flat[0] if hasattr(ax, "flat") else ax).figure
  try:
    fig.savefig(path, dpi=120)
  finally:
    plt.close(fig)
