"""`maskc config`: the maskc config of a Hugging Face or MaxText model, printed as YAML.

    maskc config --from-hf config.json
    maskc config --from-maxtext gemma3-4b.yml --path dot_product

The YAML is `maskc.load_config`'s schema: save it and load it, edit it, or read off which
mask each layer gets. It is checked by loading it before it is printed.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

import maskc
from maskc.config.hugging_face import TRANSFORMERS_VERSION, hf_config_data
from maskc.config.maxtext import MAXTEXT_VERSION, PATHS, maxtext_config_data


def add_config(subparsers) -> None:
  """Declares the `config` subcommand on `subparsers` (an argparse subparsers action)."""
  p = subparsers.add_parser(
      "config", help="print the maskc config (YAML) of a Hugging Face or MaxText model config",
      description="Read a transformers config.json (--from-hf) or a MaxText YAML config "
                  "(--from-maxtext) and print the maskc config of its attention masks, one "
                  "mask per layer, as YAML that maskc.load_config reads.")
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--from-hf", metavar="CONFIG_JSON",
                      help="a Hugging Face transformers config.json")
  source.add_argument("--from-maxtext", metavar="CONFIG_YML",
                      help="a MaxText config (YAML; missing keys take configs/base.yml's values)")
  p.add_argument("--no-padding", action="store_true",
                 help="--from-hf: masks for inputs without padding (no attention_mask)")
  p.add_argument("--no-packing", action="store_true",
                 help="--from-hf: masks for one sequence per row (no packed position_ids)")
  p.add_argument("--no-segments", action="store_true",
                 help="--from-maxtext: masks without packed documents (decoder_segment_ids)")
  p.add_argument("--path", choices=PATHS,
                 help="--from-maxtext: MaxText's mask path (default: what `attention` selects)")
  p.set_defaults(run=_run_config)


def _run_config(args: argparse.Namespace, out: TextIO) -> int:
  if args.from_hf is not None:
    data = hf_config_data(args.from_hf, padding=not args.no_padding,
                          packing=not args.no_packing)
    head = (f"# The attention masks of {args.from_hf}, as transformers {TRANSFORMERS_VERSION}'s "
            f"masking_utils builds them.\n# Operands: maskc.config.hf_operands(cfg, "
            f"attention_mask=..., position_ids=..., token_type_ids=...).\n")
  else:
    data = maxtext_config_data(args.from_maxtext, path=args.path,
                               segments=not args.no_segments)
    head = (f"# The attention masks of {args.from_maxtext}, as MaxText {MAXTEXT_VERSION}'s "
            f"attention_op builds them.\n")
  maskc.load_config(data)  # what is printed loads
  out.write(head + to_yaml(data))
  return 0


def to_yaml(data: Any, indent: int = 0) -> str:
  """Plain data (mappings, lists, strings, numbers, bools, None) as block YAML.

  Names are written bare, other strings double-quoted (JSON's escapes are YAML's), so mask
  text never trips YAML's own syntax (`|`, `&`, `*`, `!`, `#`). Lists of scalars go on one
  line.
  """
  pad = "  " * indent
  lines = []
  for key, value in data.items():
    k = key if isinstance(key, str) and key.isidentifier() else json.dumps(str(key))
    if isinstance(value, dict) and value:
      lines.append(f"{pad}{k}:\n{to_yaml(value, indent + 1).rstrip()}")
    elif isinstance(value, list) and value and any(isinstance(v, (dict, list)) for v in value):
      items = "".join(f"{pad}  - {_scalar(v)}\n" for v in value)
      lines.append(f"{pad}{k}:\n{items.rstrip()}")
    elif isinstance(value, list):
      lines.append(f"{pad}{k}: [{', '.join(_scalar(v) for v in value)}]")
    else:
      lines.append(f"{pad}{k}: {_scalar(value)}")
  return "\n".join(lines) + "\n"


_YAML_WORDS = {"true", "false", "null", "yes", "no", "on", "off", "y", "n", "~"}


def _scalar(value: Any) -> str:
  if isinstance(value, str) and value.isidentifier() and value.lower() not in _YAML_WORDS:
    return value  # a plain name needs no quotes
  if value is None:
    return "null"
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (int, float)):
    return str(value)
  if isinstance(value, dict):
    return json.dumps(value)  # a flow mapping: valid YAML
  return json.dumps(str(value))
