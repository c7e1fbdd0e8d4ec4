"""Operands of tree masks: DFS entry and exit times from parent arrays, and the packed layout
of RL rollouts that share a prompt.

A tree mask lets a query attend to its ancestors and itself. In the language it is
`tree(tin, tout)` (`tin[k] <= tin[q] & tin[q] < tout[k]`), where `tin[p]` is token `p`'s
entry time in a depth-first walk and `tout[p]` the entry time after its last descendant:
`k` is an ancestor of `q` (or `q` itself) exactly when `tin[k] <= tin[q] < tout[k]`.

Laid out in DFS preorder (each token's subtree right after it), `tin` is the positions
themselves and every key sees one interval of queries: the lowering then takes its closed
form (rule `tree`), as fast as packed documents. The packed layout of rollouts (the prompt,
then each completion) is such an order; `from_parents` numbers any tree, in any layout.

>>> import maskc
>>> from maskc import trees
>>> ops = trees.from_parents([-1, 0, 1, 1, 0])    # 0 -> 1 -> {2, 3}; 0 -> 4
>>> ops["tin"].tolist(), ops["tout"].tolist()
([0, 1, 2, 3, 4], [5, 4, 3, 4, 5])
>>> maskc.materialize("tree(tin, tout)", 5, operands=ops).astype(int)[3].tolist()
[1, 1, 0, 1, 0]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from maskc.language.errors import MaskValueError


def from_parents(parent: ArrayLike) -> dict[str, np.ndarray]:
  """`{"tin": ..., "tout": ...}`: DFS entry and exit times of a forest given as parent indices.

  Args:
    parent: `[L]` or `[B, L]` integers: the position of each token's parent, -1 for a root
      (and for padding: a token of its own). Children are visited in the order of their
      positions.

  Returns:
    int32 arrays of `parent`'s shape, the operands of `tree(tin, tout)`. Where the tokens
    are laid out in DFS preorder, `tin` equals the positions.

  Raises:
    MaskValueError: for a parent index outside `[-1, L)`, or a cycle.
  """
  p = np.asarray(parent)
  if p.ndim not in (1, 2) or not np.issubdtype(p.dtype, np.integer):
    raise MaskValueError(f"parent must be integers of shape [L] or [B, L], got {p.dtype} "
                         f"{tuple(p.shape)}", hint="Give each token's parent position, -1 "
                                                   "for a root.")
  rows = p.reshape(-1, p.shape[-1])
  tin, tout = np.zeros(rows.shape, np.int32), np.zeros(rows.shape, np.int32)
  for b, row in enumerate(rows):
    tin[b], tout[b] = _euler(row, b if p.ndim == 2 else None)
  return {"tin": tin.reshape(p.shape), "tout": tout.reshape(p.shape)}


def _euler(parent: np.ndarray, row: int | None) -> tuple[np.ndarray, np.ndarray]:
  """Entry and exit times of one row's forest, by an iterative depth-first walk."""
  n = parent.size
  where = "" if row is None else f" in batch row {row}"
  bad = np.flatnonzero((parent < -1) | (parent >= n))
  if bad.size:
    raise MaskValueError(f"parent[{bad[0]}] = {parent[bad[0]]}{where} is no position of the "
                         f"{n} tokens", hint="Parents are positions in [0, L), or -1.")
  # children of each token in position order: a stable sort by parent
  order = np.argsort(parent, kind="stable")
  first = np.searchsorted(parent[order], np.arange(-1, n), "left")
  last = np.searchsorted(parent[order], np.arange(-1, n), "right")
  tin = np.full(n, -1, np.int64)
  tout = np.zeros(n, np.int64)
  t = 0
  stack: list[tuple[int, bool]] = [(int(r), False) for r in order[first[0]:last[0]][::-1]]
  while stack:
    v, done = stack.pop()
    if done:
      tout[v] = t
      continue
    tin[v] = t
    t += 1
    stack.append((v, True))
    stack.extend((int(c), False) for c in order[first[v + 1]:last[v + 1]][::-1])
  if t != n:
    lost = int(np.flatnonzero(tin < 0)[0])
    raise MaskValueError(f"token {lost}{where} lies on a cycle of parents: no root above it",
                         hint="Every token's chain of parents must end at a -1.")
  return tin, tout


def rollout(prompt_len: int, completion_lens: Sequence[int]) -> dict[str, np.ndarray]:
  """The operands of `tree(tin, tout)` for RL rollouts packed as one sequence: a prompt of
  `prompt_len` tokens, then each completion, every completion continuing the prompt.

  Prompt tokens see the prompt before them; completion tokens see the whole prompt and
  their own completion up to themselves, never another completion. The layout is DFS
  preorder, so `tin` is the positions (the lowering's closed form applies).

  >>> from maskc import trees
  >>> ops = trees.rollout(2, [2, 1])
  >>> ops["tin"].tolist(), ops["tout"].tolist()
  ([0, 1, 2, 3, 4], [5, 5, 4, 4, 5])
  """
  if prompt_len < 0 or any(c < 0 for c in completion_lens):
    raise MaskValueError(f"lengths cannot be negative: prompt {prompt_len}, completions "
                         f"{list(completion_lens)}")
  n = prompt_len + int(sum(completion_lens))
  tout = np.full(n, n, np.int32)
  start = prompt_len
  for c in completion_lens:
    tout[start:start + c] = start + c
    start += c
  return {"tin": np.arange(n, dtype=np.int32), "tout": tout}
