"""The lowering's rules as a mechanism: their entry type (`Rule`), the site a part is lowered
at (`Site`), a switch to turn a rule off, and a record of those taken.

The entries themselves, one per closed form, are `maskc.lowering.registry.REGISTRY`.

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
from collections.abc import Callable, Iterator
from typing import Any, Literal

from maskc.language.errors import MaskValueError

_DISABLED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "maskc_disabled_rules", default=frozenset())
_TAKEN: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "maskc_taken_rules", default=None)
_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "maskc_lowering_recorder", default=None)


@dataclasses.dataclass(frozen=True, slots=True)
class Site:
  """Where a part is lowered: the grid, the operands' run tables, the batch rows, whether
  ambiguous tiles are refined, the memory budget, and `join`, the `&` / `|` the part
  belongs to (`ir.and_` or `ir.or_`; None for a whole mask)."""
  geo: Any
  tables: Any
  batch: int | None
  refine: bool
  budget: Any
  join: Callable[..., Any] | None = None

  def part_of(self, join: Callable[..., Any]) -> Site:
    """The site of a part of an `&` / `|` (`join`) lowered here."""
    return Site(self.geo, self.tables, self.batch, self.refine, self.budget, join)


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
  """One closed form of the lowering: an entry of `maskc.lowering.registry.REGISTRY`.

  Attributes:
    name: its name, for `disabled()`, `taken()` and `maskc.explain`.
    doc: one line on what it lowers and where it lives.
    stage: where it acts. "part": it lowers a part of a mask on its own, through `match`
      and `lower` (`maskc.lowering.part_rules`). "combine": it combines the runs of an `&` /
      `|`'s parts, matched on the pair of their forms (`maskc.lowering.combined`).
      "analysis": it sharpens or shortens the generic range analysis. "intervals": it
      proves `bm.key_intervals()`, no tiles.
    exact: whether the tiles it gives are always the mask's exact tiles (a closed form that
      decides every tile); else they are as sharp as the analysis it runs, exact where the
      map is refined (prelude-only masks, `exact=True`).
    match: for a "part" rule, its precondition: `match(mask, site)` gives what `lower`
      needs, or None where it does not apply. Pure: it builds no runs and ignores the
      switch (`found` applies it). For a "combine" rule, `match(parts, union)` on the parts'
      forms (`maskc.lowering.grid.forms.Form`).
    lower: for a "part" rule, `lower(mask, found, site)`: the part's runs.
    traced: the function of its traced variant (a dotted name), where it has one.
  """
  name: str
  doc: str
  stage: Literal["part", "combine", "analysis", "intervals"]
  exact: bool
  match: Callable[..., Any] | None = None
  lower: Callable[..., Any] | None = None
  traced: str | None = None

  def found(self, *args: Any) -> Any:
    """`match(*args)` where the rule is enabled here, else None."""
    if self.match is None or not enabled(self.name):
      return None
    return self.match(*args)


_KNOWN: dict[str, Rule] = {}


def register(*entries: Rule) -> None:
  """Makes rules known to `disabled`: `maskc.lowering.registry` registers every entry of
  its registry when it is imported, which importing `maskc` does."""
  for rule in entries:
    _KNOWN[rule.name] = rule


@contextlib.contextmanager
def disabled(*names: str) -> Iterator[frozenset[str]]:
  """Turns off the named rules (every rule when none is named) inside the block: the
  lowering takes the next rule that matches, or the generic analysis.

  Raises:
    MaskValueError: for a name that is no rule's, with the known names.
  """
  unknown = sorted(set(names) - set(_KNOWN))
  if unknown:
    raise MaskValueError(f"unknown lowering rule(s) {', '.join(map(repr, unknown))}",
                         hint=f"The rules are: {', '.join(_KNOWN)}.")
  token = _DISABLED.set(_DISABLED.get() | frozenset(names or _KNOWN))
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
    way: the rule that lowered it (a name of `maskc.lowering.registry.RULES`), or "generic"
      for the range analysis.
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
