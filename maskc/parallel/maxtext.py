"""MaxText's load-balanced context-parallel layout as a `maskc.Layout`: `maxtext_layout`."""

from __future__ import annotations

import math
from typing import Any

from maskc.config.maxtext import maxtext_config_data
from maskc.config.model import load_config
from maskc.language.errors import ConfigError
from maskc.language.parse import parse
from maskc.parallel.layout import Layout, balance


def maxtext_layout(config: Any, seq_len: int | None = None, *,
                   block: int | None = None) -> Layout | None:
  """The token layout MaxText's input pipeline gives a context-parallel run, or None.

  With `context_parallel_load_balance` and a context axis of `cp > 1` devices
  (`ici_context_parallelism * dcn_context_parallelism`), MaxText reorders every batch
  DUAL_CHUNK_SWAP (`max_utils.reorder_sequence`): `2 cp` chunks, device `r` holding chunks
  `r` and `2 cp - 1 - r`. That is maskc's `zigzag` layout; its `work` is counted on the
  config's first layer's mask (on `causal` when that mask reads operands).

  Args:
    config: a MaxText config, as `maskc.config.from_maxtext` reads it.
    seq_len: the sequence length (default: `max_target_length`).
    block: the tile size work is counted in (default: the largest power of two up to
      MaxText's `sa_block_q` that divides a chunk).

  Returns:
    The `maskc.Layout` (`positions` is the stored order of the natural positions; pass it
    as `q_positions` / `kv_positions`), or None when MaxText keeps tokens in order
    (no context axis, no load balancing).

  Raises:
    ConfigError: as `from_maxtext`; a length that does not split into `2 cp` chunks.
  """
  data = maxtext_config_data(config, segments=False)
  cp = data.get("context_parallel")
  if cp is None or cp["layout"] != "zigzag":
    return None
  cfg = load_config(data)
  get = (config.get if hasattr(config, "get") else lambda key, default=None: default)
  shards = int(get("ici_context_parallelism", 1) or 1) * int(get("dcn_context_parallelism", 1)
                                                             or 1)
  n = int(seq_len if seq_len is not None else (get("max_target_length") or 2048))
  if n % (2 * shards):
    raise ConfigError(f"a sequence of {n} tokens does not split into {2 * shards} equal chunks",
                      path="max_target_length",
                      hint=f"MaxText's reorder needs a multiple of 2 * cp = {2 * shards}.")
  chunk = n // (2 * shards)
  if block is None:
    block = math.gcd(chunk, 1 << (int(get("sa_block_q", 512) or 512).bit_length() - 1))
  mask = cfg.mask(0)
  if isinstance(mask, tuple) or mask.operands:
    mask = parse("causal")  # work needs operand values; the order itself does not
  return balance(mask, n, shards, block=block, method="zigzag", chunk=chunk)
