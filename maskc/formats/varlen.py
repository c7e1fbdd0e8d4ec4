"""Varlen kernels' packed-sequence format: `cu_seqlens(mask, q_len, operands=...)`.

Varlen attention (`flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, causal=...)`, FlashInfer's ragged prefill, cuDNN's THD layout) packs sequences
one after another and attends within each: sequence `s` is tokens
`[cu_seqlens[s], cu_seqlens[s + 1])` of the packed axis, all of them (or, with `causal`, each
token and those before it). A mask fits when it is exactly that: packed documents, each one
contiguous run, optionally causal inside.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from maskc.formats._tiles import line_intervals, require_static
from maskc.language.arguments import MasksLike
from maskc.language.errors import MaskValueError
from maskc.lowering.compile import compile as compile_mask


@dataclasses.dataclass(frozen=True)
class Varlen:
  """Packed sequences as varlen kernels take them.

  Attributes:
    cu_seqlens_q, cu_seqlens_k: int32 `[S + 1]`: sequence `s` is tokens
      `[cu_seqlens[s], cu_seqlens[s + 1])` of the packed axis; a batch's rows follow one
      another (row `b`'s tokens are `b * L .. (b + 1) * L - 1`). Equal here (self-attention).
    max_seqlen_q, max_seqlen_k: the longest sequence.
    causal: the kernel's `causal` flag: each token sees itself and the tokens before it in
      its sequence (else every token of it).

  The dense mask over the packed axis, back from the fields:

      dense = zeros((T, T), bool)          # T = cu_seqlens_q[-1]
      for s in range(len(cu_seqlens_q) - 1):
        a, b = cu_seqlens_q[s], cu_seqlens_q[s + 1]
        dense[a:b, a:b] = tril(ones((b - a, b - a))) if causal else True
  """
  cu_seqlens_q: np.ndarray
  cu_seqlens_k: np.ndarray
  max_seqlen_q: int
  max_seqlen_k: int
  causal: bool


def _documents(lo: np.ndarray, hi: np.ndarray, causal: bool) -> tuple[np.ndarray | None, int]:
  """`(starts, -1)`: the first row of each document, when the rows' key intervals `[lo, hi)`
  are exactly contiguous documents (causal inside or not); else `(None, first bad row)`."""
  n = lo.size
  rows = np.arange(n)
  starts = rows[lo == rows] if causal else rows[np.append(True, (lo[1:] != lo[:-1])
                                                          | (hi[1:] != hi[:-1]))]
  if not starts.size or starts[0] != 0:
    return None, 0
  doc = np.cumsum(np.isin(rows, starts)) - 1
  ends = np.append(starts[1:], n)
  ok = (lo == starts[doc]) & (hi == (rows + 1 if causal else ends[doc]))
  return (starts, -1) if ok.all() else (None, int(np.argmin(ok)))


def cu_seqlens(mask: MasksLike, q_len: int, *, operands: Mapping[str, Any] | None = None,
               causal: bool | None = None) -> Varlen:
  """The `cu_seqlens` of varlen kernels for a mask of packed documents.

  Args:
    mask: mask text, a Mask, or per-head masks that are all equal; self-attention
      (`kv_len = q_len`).
    q_len: tokens per batch row.
    operands: static operand values (document ids, `[L]` or `[B, L]`).
    causal: ask for the causal (True) or the full (False) form; None: whichever is exact
      (the full one when both are: documents of one token).

  Returns:
    A `Varlen`, exact: its sequences are the mask's documents, position by position.

  Raises:
    MaskValueError: the mask is not packed documents (a row with no key, a row whose keys
      are not one run, documents that overlap or leave gaps, masks that differ per head),
      naming the first row that does not fit; traced operands.

  >>> import numpy as np, maskc
  >>> v = maskc.formats.cu_seqlens("causal & document(seg)", 6,
  ...                              operands={"seg": np.array([0, 0, 0, 1, 2, 2])})
  >>> v.cu_seqlens_q.tolist(), v.max_seqlen_q, v.causal
  ([0, 3, 4, 6], 3, True)
  """
  bm = compile_mask(mask, q_len, operands=operands)
  require_static(bm, "cu_seqlens")
  if bm.head_index is not None and len(set(bm.head_index)) > 1:
    raise MaskValueError("the heads have different masks; varlen kernels give every head the "
                         "same sequences", hint="Call cu_seqlens once per distinct head mask.")
  forms = (False, True) if causal is None else (bool(causal),)
  lengths: list[np.ndarray] = []
  chosen: bool | None = None
  for b in range(bm.batch or 1):
    line, lo, hi = line_intervals(bm, 0, b)
    where = f" of batch row {b}" if bm.batch else ""
    counts = np.bincount(line, minlength=q_len)
    if (counts != 1).any():
      i = int(np.argmax(counts != 1))
      what = "no allowed key" if counts[i] == 0 else f"{counts[i]} separate runs of keys"
      raise MaskValueError(f"row {i}{where} has {what}; a varlen sequence attends to one run "
                           f"of its own tokens",
                           hint="Unpad first (drop padding tokens), or give padding its own "
                                "document id.")
    found, bad = None, 0
    for form in ([chosen] if chosen is not None else forms):
      found, bad = _documents(lo, hi, form)
      if found is not None:
        chosen = form
        break
    if found is None:
      kind = {None: "", True: "causal ", False: "full "}[chosen if chosen is not None else causal]
      raise MaskValueError(
          f"the mask is not packed {kind}documents{where}: row {bad} attends to keys "
          f"[{lo[bad]}, {hi[bad]}), not its document{' up to itself' if kind == 'causal ' else ''}",
          hint="Varlen kernels take contiguous documents, each all-to-all or causal inside "
               "(document(seg), causal & document(seg)).")
    lengths.append(np.diff(np.append(found, q_len)))
  seq = np.concatenate(lengths)
  cu = np.concatenate([[0], np.cumsum(seq)]).astype(np.int32)
  longest = int(seq.max()) if seq.size else 0
  return Varlen(cu_seqlens_q=cu, cu_seqlens_k=cu.copy(), max_seqlen_q=longest,
                max_seqlen_k=longest, causal=bool(chosen))
