"""Operand arrays by name, the per-token and pairwise ones written out only when first read.

Binding widens every operand to the type integer terms are computed in (int64
on the NumPy path). For a per-token operand at a million tokens that is an
8 MiB copy (16 MiB with its `runs(x)` ids), freshly paged in on every cold
call, while the static lowering reads such operands only through their runs
(`maskc.semantics.operand_runs.RunForm`). So a static per-token operand is kept as a
recipe (`Unwritten`: its shape, dtype and how to write it out) and written out
once, when a consumer that indexes tokens (evaluation, kernels, the dense
reference) first asks for it. To every consumer it is a read-only mapping like
a dict.

A static pairwise operand is kept as given (`raw`: bool or a narrow integer type) and widened
only when a consumer indexes it: widening an 8K x 8K boolean operand to int64 writes 512 MiB,
where the lowering reads it through one blocked pass of its own bytes (`Tables.pair_blocks`)
and gathers the few entries it evaluates (`Tables.reads`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np


class Unwritten(NamedTuple):
  """An array not written out yet: `write()` returns it (called at most once); `raw`, where
  given, holds the same values in their own dtype (a pairwise operand as the caller gave it)."""
  shape: tuple[int, ...]
  dtype: Any
  write: Callable[[], Any]
  raw: Any = None


class OperandArrays(Mapping):
  """A read-only mapping from operand names to arrays, `Unwritten` ones written on first access."""

  def __init__(self, entries: Mapping[str, Any] | None = None):
    self._entries: dict[str, Any] = dict(entries or {})
    # the values in their own dtype, kept once an entry is written out: `raw` (and what is
    # digested from it) must not change with what was read
    self._kept: dict[str, Any] = {}

  def __getitem__(self, name: str) -> Any:
    value = self._entries[name]
    if isinstance(value, Unwritten):
      arr = value.write()
      assert tuple(arr.shape) == tuple(value.shape) and arr.dtype == value.dtype, (
          name, arr.shape, value.shape, arr.dtype, value.dtype)
      if value.raw is not None:
        self._kept[name] = value.raw
      self._entries[name] = value = arr
    return value

  def __iter__(self) -> Iterator[str]:
    return iter(self._entries)

  def __len__(self) -> int:
    return len(self._entries)

  def __contains__(self, name: object) -> bool:
    return name in self._entries

  def shape(self, name: str) -> tuple[int, ...]:
    """The array's shape, without writing it out."""
    return tuple(self._entries[name].shape)

  def dtype(self, name: str) -> np.dtype:
    """The array's dtype, without writing it out."""
    return np.dtype(self._entries[name].dtype)

  def written(self, name: str) -> bool:
    """Whether the array exists (it was given, or an access wrote it out)."""
    return not isinstance(self._entries[name], Unwritten)

  def raw(self, name: str) -> Any:
    """The array's values in their own dtype where they are kept so (a static pairwise
    operand, bool or narrow integers; a per-token one with about as many runs as tokens),
    without widening them, before and after the array is written out; else the array."""
    value = self._entries[name]
    if isinstance(value, Unwritten) and value.raw is not None:
      return value.raw
    return self._kept[name] if name in self._kept else self[name]

  def later(self, name: str, change: Callable[[Any], Any] | None = None,
            shape: tuple[int, ...] | None = None) -> Any:
    """The array (`change`d), or an `Unwritten` one for it that does not write this one out yet.

    `shape`: the changed array's shape (default: this one's).
    """
    change = change or (lambda a: a)
    if self.written(name) and name not in self._kept:
      return change(self[name])
    raw = self._kept[name] if name in self._kept else self._entries[name].raw
    return Unwritten(shape or self.shape(name), self.dtype(name),
                     lambda: change(self[name]), None if raw is None else change(raw))

  def __repr__(self) -> str:
    items = ", ".join(f"{n!r}: {self.shape(n)}{'' if self.written(n) else ' (not written)'}"
                      for n in self)
    return f"OperandArrays({{{items}}})"
