"""The lowering's rules as a mechanism: their entry type (`Rule`), the set the registry hands
down (`RuleSet`), the site a part is lowered at (`Site`), a switch to turn a rule off, and a
record of those taken.

The rules themselves, one module each, are in `maskc/lowering/closed_forms/`; the registry
(`maskc.lowering.registry.REGISTRY`) lists them, and the lowering reaches them through it
alone: the static path hands the registry's `RuleSet` down in every `Site`, and each
mechanism asks it for the rules of the step it is at (`RuleSet.at`).

The static and traced lowerings reach most masks by closed forms, each a faster way to the
same tiles as the generic range analysis (`maskc.lowering.generic.range_analysis`), taken
where its precondition holds. A closed form that is wrong for some mask is wrong silently:
the tiles still look plausible. So each can be turned off, and the tiles compared with the
ones the lowering gives without it:

    from maskc.lowering.rules import disabled, taken

    with taken() as fired:
      fast = maskc.compile(mask, n, operands=ops)
    assert "widened_band" in fired
    with disabled("widened_band"):
      slow = maskc.compile(mask, n, operands=ops)  # a separate cache entry

`disabled()` with no names turns off every rule: the generic analysis alone. Both are
context managers over context variables, so they hold for the thread or task that entered
them, and compiled maps are cached per set of disabled rules. `tests/test_lowering_rules.py`
runs each rule against the lowering without it.

`recording()` listens more closely, for `maskc.explain`: a `Recorder` that the static
lowering writes a `PartRecord` into for each part it lowers (the whole mask, and each `&` /
`|` part it splits off), with the rule that lowered it (or why the generic analysis did), the
rules taken inside it and the time it took; and the time of each step of `maskc.compile`. A
lowering inside a `recording()` block skips `maskc.compile`'s cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

from maskc.language import ir
from maskc.language.errors import MaskValueError
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget
from maskc.semantics.ranges import Tables

_DISABLED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "maskc_disabled_rules", default=frozenset())
_TAKEN: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "maskc_taken_rules", default=None)
_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "maskc_lowering_recorder", default=None)

Stage = Literal["part", "combine", "analysis", "intervals"]

# Where in the lowering a rule acts (`Rule.step`), by stage: the mechanism at each step asks
# the `RuleSet` for its rules and tries them in the registry's order.
STEPS: dict[str, tuple[Stage, str]] = {
    "part": ("part", "lowers a part of a mask on its own (`maskc.lowering.generic.dispatch`)"),
    "join": ("combine", "joins an `|`'s parts into one interval per row, nothing combined"),
    "meet": ("combine", "meets an `&`'s band-shaped part with its band, as bounds per line"),
    "clip": ("combine", "clips an `&`'s other parts at the band of an `|` among them"),
    "decide": ("combine", "decides tiles PARTIAL in two parts of an `&` with no pair "
                          "evaluated"),
    "start": ("analysis", "the rectangles the generic analysis starts from"),
    "tables": ("analysis", "configures the operand tables the analysis reads (both paths)"),
    "intervals": ("intervals", "proves `bm.key_intervals()`, no tiles"),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Site:
  """Where a part is lowered: the grid, the operands' run tables, the batch rows, whether
  ambiguous tiles are refined, the memory budget, the rules (the registry's `RuleSet`), and
  `join`, the `&` / `|` the part belongs to (`ir.and_` or `ir.or_`; None for a whole mask)."""
  geo: TileGeometry
  tables: Tables
  batch: int | None
  refine: bool
  budget: Budget
  rules: RuleSet
  join: Callable[[Sequence[Any]], ir.Mask] | None = None

  def part_of(self, join: Callable[[Sequence[Any]], ir.Mask]) -> Site:
    """The site of a part of an `&` / `|` (`join`) lowered here."""
    return Site(self.geo, self.tables, self.batch, self.refine, self.budget, self.rules, join)


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
  """One closed form of the lowering: a module of `maskc/lowering/closed_forms/`, listed in
  `maskc.lowering.registry.REGISTRY`.

  Attributes:
    name: its name, for `disabled()`, `taken()` and `maskc.explain`.
    doc: one line on what it lowers.
    stage: what it acts on. "part": it lowers a part of a mask on its own. "combine": it
      combines the runs of an `&` / `|`'s parts, matched on the forms they give
      (`maskc.lowering.grid.forms.Form`), not on the rules that lowered them. "analysis": it
      sharpens or shortens the generic range analysis. "intervals": it proves
      `bm.key_intervals()`, no tiles.
    step: where it acts (`STEPS`): the mechanism there asks `RuleSet.at(step)`.
    exact: whether the tiles it gives are always the mask's exact tiles (a closed form that
      decides every tile); else they are as sharp as the analysis it runs, exact where the
      map is refined (prelude-only masks, `exact=True`).
    match: its precondition, pure (it builds no runs and ignores the switch: `found` applies
      it), giving what `lower` needs, or None where it does not apply. Its arguments are
      the step's: `(mask, site)` for a part rule.
    lower: the static closed form, from what `match` found: `lower(mask, found, site)` gives
      a part rule's runs (`maskc.lowering.grid.forms.PartRuns`).
    traced: its variant on the traced path, where it has one (`maskc.lowering.traced`).
    why_not: for `maskc.explain`: why the rule does not lower part `mask` at `site`
      (`why_not(mask, site)`), where its structure is close to the rule's, else None.
    recurses: a part rule that splits or rewrites its part and lowers the pieces through the
      dispatch again (`parts`, `distribute`), rather than in a closed form of its own.
  """
  name: str
  doc: str
  stage: Stage
  step: str
  exact: bool
  match: Callable[..., Any] | None = None
  lower: Callable[..., Any] | None = None
  traced: Callable[..., Any] | None = None
  why_not: Callable[[ir.Mask, Site], str | None] | None = None
  recurses: bool = False

  def __post_init__(self) -> None:
    if STEPS.get(self.step, (None,))[0] != self.stage:
      raise ValueError(f"rule {self.name!r}: step {self.step!r} is no step of stage "
                       f"{self.stage!r} (STEPS)")

  def enabled(self) -> bool:
    """Whether the rule may be taken now (no `disabled()` block names it)."""
    return self.name not in _DISABLED.get()

  def took(self) -> None:
    """Records that the rule was taken (where a `taken()` or `recording()` block listens)."""
    took(self.name)

  def found(self, *args: Any) -> Any:
    """`match(*args)` where the rule is enabled here, else None."""
    if self.match is None or not self.enabled():
      return None
    return self.match(*args)

  def run(self, *args: Any) -> Any:
    """`lower(*args)`: the static closed form, from what `match` found."""
    if self.lower is None:
      raise TypeError(f"rule {self.name!r} has no static lower")
    return self.lower(*args)

  def run_traced(self, *args: Any) -> Any:
    """`traced(*args)`: the variant on the traced path."""
    if self.traced is None:
      raise TypeError(f"rule {self.name!r} has no traced lower")
    return self.traced(*args)


class RuleSet:
  """The rules in the order they are tried, by the step they act at: what the registry hands
  down to the lowering in every `Site`."""

  def __init__(self, rules: Iterable[Rule]):
    self.rules = tuple(rules)
    names = [r.name for r in self.rules]
    if len(set(names)) != len(names):
      raise ValueError(f"rule names must be distinct: {names}")
    self._at: dict[str, tuple[Rule, ...]] = {
        step: tuple(r for r in self.rules if r.step == step) for step in STEPS}

  def at(self, step: str) -> tuple[Rule, ...]:
    """The rules that act at `step` (`STEPS`), in order, enabled or not (`Rule.found`)."""
    return self._at[step]

  def __iter__(self) -> Iterator[Rule]:
    return iter(self.rules)


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
    MaskValueError: for a name that is no rule's, with the nearest rule's name.
  """
  unknown = sorted(set(names) - set(_KNOWN))
  if unknown:
    near = [n for n in (ir.nearest(u, _KNOWN) for u in unknown) if n is not None]
    maybe = f"Did you mean {', '.join(map(repr, near))}? " if near else ""
    raise MaskValueError(f"unknown lowering rule(s) {', '.join(map(repr, unknown))}",
                         hint=f"{maybe}The rules are: {', '.join(_KNOWN)}.")
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


def took(name: str) -> None:
  """Records that rule `name` was taken (where a `taken()` or `recording()` block listens):
  `Rule.took`, and `maskc.compile` replaying the rules of a cached map."""
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
    mask: the part: a whole mask at depth 0.
    depth: 0 for a whole mask, 1 for a part split off it, and so on.
    way: the rule that lowered it (a name of `maskc.lowering.registry.RULES`), or "generic"
      for the range analysis.
    reason: for "generic", why no rule matched; else empty.
    rules: the rules taken while it lowered, its own parts' included.
    seconds: the time it took to lower, its own parts' included (the combining of its
      parts' runs, done when the runs are packed, is the step "combine").
    runs: the object that holds its runs, for counting its tiles afterwards.
  """
  mask: ir.Mask
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
  def part(self, mask: ir.Mask) -> Iterator[PartRecord]:
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
