"""The lowering's closed forms by name: a switch to turn one off, and a record of those taken.

The static and traced lowerings reach most masks by closed forms, each a faster
way to the same tiles as the generic range analysis (`maskc.lowering.
range_analysis._StaticRuns`), taken where its precondition holds. A closed form that is wrong
for some mask is wrong silently: the tiles still look plausible. So each can be
turned off, and the tiles compared with the ones the lowering gives without it:

    from maskc.lowering.rules import disabled, taken

    with taken() as fired:
      fast = maskc.compile(mask, n, operands=ops)
    assert "widened_band" in fired
    with disabled("widened_band"):
      slow = maskc.compile(mask, n, operands=ops)  # a separate cache entry

`disabled()` with no names turns off every rule: the generic analysis alone.
Both are context managers over context variables, so they hold for the thread
or task that entered them, and compiled maps are cached per set of disabled
rules. `tests/test_lowering_rules.py` runs each rule against the lowering
without it.

`recording()` listens more closely, for `maskc.explain`: a `Recorder` that the static
lowering writes a `PartRecord` into for each part it lowers (the whole mask, and each
`&` / `|` part it splits off), with the rule that lowered it (or why the generic analysis
did), the rules taken inside it and the time it took; and the time of each step of
`maskc.compile`. A lowering inside a `recording()` block skips `maskc.compile`'s cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
import types
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from maskc.language.errors import MaskValueError

RULES: Mapping[str, str] = types.MappingProxyType({
    "periodic": "an operand-free mask with a diagonal period (`causal`, `chunk(c)`): one "
                "period of tiles classified and repeated (maskc.analysis.diagonal_period)",
    "one_axis": "a mask that reads one position only (`g[k]`, `sink(4)`): one line of tiles "
                "decides each axis (maskc.lowering.closed_forms.axis_reads)",
    "equal_reads": "`x[q + s] == x[k + t]` where each value of x is one run (`document(seg)`, "
                   "`bidirectional(img)`): binary searches per line "
                   "(maskc.lowering.closed_forms.equal_reads)",
    "parts": "an `&` / `|` whose parts lower apart, their runs combined (static), or whose "
             "operand-free items lower at trace time (traced)",
    "band": "a band of `q - k` (`causal`, `sliding(w)`, `local(l, r)`) in an `&` / `|`, in "
            "closed form (maskc.lowering.closed_forms.band_runs)",
    "widened_band": "a band joined with equal reads into one interval per row (`causal | "
                    "bidirectional(img)`), static and traced "
                    "(maskc.lowering.closed_forms.widened_band, "
                    "maskc.lowering.closed_forms.widened_traced)",
    "met_bounds": "equal reads `&` a band (or a widened band), met as bounds per line "
                  "(`causal & document(seg)`)",
    "distribute": "`x & (rest | pattern)` lowered as `(x & rest) | (x & pattern)`, the "
                  "pattern of one axis spliced into x's runs",
    "spread": "`x & (band | rest)`: x clipped at the band off the rest's lines",
    "tile_cover": "the analysis starts from the rectangles where the operands' runs allow "
                  "a true pair (maskc.lowering.closed_forms.tile_cover)",
    "same_run_ids": "`runs(x)[a] == runs(x)[b]` beside `x[a]` analysed by ids of x's runs of "
                    "zeros and nonzeros (static) or by run labels (traced, "
                    "maskc.lowering.closed_forms.same_run)",
    "row_intervals": "one interval of keys per row for `bm.key_intervals()`, proved from "
                     "bands, chunks, runs of equal reads and masks of one position "
                     "(maskc.lowering.closed_forms.row_intervals)",
    "diagonal_truth": "tiles PARTIAL in two parts of an `&` that the diagonal crosses, in a "
                      "mask true at every q == k, mixed with no pair evaluated "
                      "(maskc.analysis.diagonal_truth)",
})

_DISABLED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "maskc_disabled_rules", default=frozenset())
_TAKEN: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "maskc_taken_rules", default=None)
_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "maskc_lowering_recorder", default=None)


def _check(names: Iterable[str]) -> frozenset[str]:
  unknown = sorted(set(names) - set(RULES))
  if unknown:
    raise MaskValueError(f"unknown lowering rule(s) {', '.join(map(repr, unknown))}",
                         hint=f"The rules are: {', '.join(RULES)}.")
  return frozenset(names)


@contextlib.contextmanager
def disabled(*names: str) -> Iterator[frozenset[str]]:
  """Turns off the named rules (every rule when none is named) inside the block."""
  off = _check(names) if names else frozenset(RULES)
  token = _DISABLED.set(_DISABLED.get() | off)
  try:
    yield _DISABLED.get()
  finally:
    _DISABLED.reset(token)


@contextlib.contextmanager
def taken() -> Iterator[set[str]]:
  """Collects the names of the rules the lowerings inside the block took (a static map
  from `maskc.compile`'s cache reports the rules that lowered it)."""
  fired: set[str] = set()
  token = _TAKEN.set(fired)
  try:
    yield fired
  finally:
    _TAKEN.reset(token)


def enabled(name: str) -> bool:
  """Whether rule `name` may be taken now."""
  return name not in _DISABLED.get()


def took(name: str) -> None:
  """Records that rule `name` was taken (where a `taken()` or `recording()` block listens)."""
  fired = _TAKEN.get()
  if fired is not None:
    fired.add(name)
  rec = _RECORDER.get()
  if rec is not None:
    rec.took(name)


def disabled_now() -> frozenset[str]:
  """The rules turned off here: part of the compiled-map cache's key."""
  return _DISABLED.get()


@dataclasses.dataclass(eq=False)
class PartRecord:
  """One part the static lowering lowered, written while it lowers (`Recorder.part`).

  Attributes:
    mask: the part (an `ir.Mask`): a whole mask at depth 0.
    depth: 0 for a whole mask, 1 for a part split off it, and so on.
    way: the rule that lowered it (a name of `RULES`), or "generic" for the range analysis.
    reason: for "generic", why no rule matched; else empty.
    rules: the rules taken while it lowered, its own parts' included.
    seconds: the time it took to lower, its own parts' included (the combining of its
      parts' runs, done when the runs are packed, is the step "combine").
    runs: the object that holds its runs, for counting its tiles afterwards.
  """
  mask: Any
  depth: int
  way: str = ""
  reason: str = ""
  rules: set[str] = dataclasses.field(default_factory=set)
  seconds: float = 0.0
  runs: Any = None


class Recorder:
  """What a lowering inside `recording()` did: its parts (`PartRecord`, in the order they
  started) and its steps (`(name, seconds)`, in the order they ended)."""

  def __init__(self) -> None:
    self.parts: list[PartRecord] = []
    self.steps: list[tuple[str, float]] = []
    self._open: list[PartRecord] = []

  @contextlib.contextmanager
  def part(self, mask: Any) -> Iterator[PartRecord]:
    """A record for part `mask`, open (collecting the rules taken) inside the block."""
    record = PartRecord(mask, len(self._open))
    self.parts.append(record)
    self._open.append(record)
    start = time.perf_counter()
    try:
      yield record
    finally:
      record.seconds = time.perf_counter() - start
      self._open.pop()

  def took(self, name: str) -> None:
    for record in self._open:
      record.rules.add(name)


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
  """Records the parts and steps of the lowerings inside the block (`Recorder`)."""
  rec = Recorder()
  token = _RECORDER.set(rec)
  try:
    yield rec
  finally:
    _RECORDER.reset(token)


def recorder() -> Recorder | None:
  """The recorder listening now, if any: the lowering writes its parts there."""
  return _RECORDER.get()


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
  """Times step `name` of a lowering where a `recording()` block listens."""
  rec = _RECORDER.get()
  if rec is None:
    yield
    return
  start = time.perf_counter()
  try:
    yield
  finally:
    rec.steps.append((name, time.perf_counter() - start))


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
  """No recording inside the block: a lowering's own helper compiles (the segment split of
  a batched map) are no parts of the mask explained."""
  token = _RECORDER.set(None)
  try:
    yield
  finally:
    _RECORDER.reset(token)
