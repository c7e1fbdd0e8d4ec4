"""The interface between the rules that lower a part of a mask and the combiner: what a part's
runs object gives, as typed protocols.

Every part, whatever lowered it, gives its packed `runs()` and says which further forms it
can give (`forms`, a set of `maskc.lowering.grid.forms.Form`); the combiner
(`maskc.lowering.generic.combination`) and the combine rules choose a closed form by those
forms, never by the class that lowered a part. `given(part, form)` is the typed view of a
part in one of its forms, checked.

| form | protocol | what it gives |
|---|---|---|
| (every part) | `PartRuns` | `runs()`, `exact`, `forms`, `m` |
| not `FLAT` | `LinePart` | `merged()`: `LineRuns` |
| `FLAT` | `FlatPart` | `flat()`: `FlatRuns` |
| `BAND` | `BandPart` | `band`, `bounds()` per line, `intervals()` |
| `INTERVALS` | `IntervalsPart` | `intervals()`: one interval of keys per row |
| `LINE_BOUNDS` | `BoundsPart` | `bounds()` per flat line |
| `WIDENS` | `WideningPart` | the equal reads of runs that widen a band |
| `PATTERN` | `PatternPart` | `pattern`, `pattern_along()` |
| `PIECES` | `PiecesPart` | `pieces`: the operand pieces of its lines |
| `JOIN` | `JoinPart` | `parts`, `union` |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, cast, overload

from maskc.compiled.tiles import Runs
from maskc.language import ir
from maskc.lowering.grid.bands import Intervals
from maskc.lowering.grid.forms import Array, FlatRuns, Form, LineBounds, LineRuns, Pattern
from maskc.lowering.grid.geometry import TileGeometry
from maskc.lowering.grid.refine import Budget
from maskc.semantics.operand_runs import Pieces, RunTable


class PartRuns(Protocol):
  """The runs of one part of a mask, as a rule (or the generic analysis) lowered it.

  Attributes:
    forms: the forms beyond `runs()` it gives (see the module's table).
    exact: whether its tiles are the part's exact tiles as they stand (a closed form that
      decides every tile), not only where the map is refined.
    m: the part's mask (expanded where a rule looked through a named call).
  """

  @property
  def forms(self) -> frozenset[Form]: ...

  @property
  def exact(self) -> bool: ...

  @property
  def m(self) -> ir.Mask: ...

  def runs(self, along_rows: bool) -> Runs:
    """Its runs packed, per q tile row (`along_rows`) or per key tile column."""
    ...


class LinePart(PartRuns, Protocol):
  """A part that gives its runs line by line (every part without `Form.FLAT`)."""

  def merged(self, along_rows: bool) -> LineRuns: ...


class FlatPart(PartRuns, Protocol):
  """`Form.FLAT`: sorted, merged flat runs, as it found or combined them."""

  def flat(self, along_rows: bool) -> FlatRuns: ...


class IntervalsPart(PartRuns, Protocol):
  """`Form.INTERVALS`: one interval of keys per row, a band's or a band's inside chunks."""

  def intervals(self) -> Intervals | None: ...


class BandPart(IntervalsPart, LinePart, Protocol):
  """`Form.BAND`: an exact band `lo <= q - k <= hi`, the same for every batch row."""

  @property
  def band(self) -> tuple[int | None, int | None]: ...

  def bounds(self, along_rows: bool) -> LineBounds: ...

  def intervals(self) -> Intervals: ...


class BoundsPart(PartRuns, Protocol):
  """`Form.LINE_BOUNDS`: band-shaped lines, `bounds()` per flat line (batch row and line)."""

  def bounds(self, along_rows: bool) -> LineBounds | None: ...


class WideningPart(PartRuns, Protocol):
  """`Form.WIDENS`: equal reads of runs `x[q + s] == x[k + t]` (beside `& w[q + s]`), each
  value of x one run, which widen a band to one interval per row (rule `widened_band`).

  Attributes:
    table: x's runs. shifts: `(s, t)`. on: per run of x, whether w holds there (None: no w).
    geo, budget: the grid and the memory budget it was lowered with.
    line_memo: the runs each line reads (`maskc.lowering.closed_forms.equal_reads.lines_read`).
    widened_memo: the bounds of bands it widened, by band and direction.
  """

  @property
  def table(self) -> RunTable: ...

  @property
  def shifts(self) -> tuple[int, int]: ...

  @property
  def on(self) -> Array | None: ...

  @property
  def geo(self) -> TileGeometry: ...

  @property
  def budget(self) -> Budget: ...

  @property
  def line_memo(self) -> dict[tuple[Any, ...], tuple[Array, Array]]: ...

  @property
  def widened_memo(self) -> dict[tuple[Any, ...], LineBounds | None]: ...


class PatternPart(LinePart, Protocol):
  """`Form.PATTERN`: a part that reads one position only, whose runs along the lines of the
  other axis repeat one `pattern` per batch row."""

  @property
  def pattern(self) -> Pattern: ...

  def pattern_along(self, along_rows: bool) -> bool: ...


class PiecesPart(LinePart, Protocol):
  """`Form.PIECES`: the generic analysis's operand pieces of its lines, lent to an `&` / `|`
  that reads the same operands."""

  @property
  def pieces(self) -> tuple[Pieces, Pieces] | None: ...


class JoinPart(FlatPart, Protocol):
  """`Form.JOIN`: an `&` / `|` of parts lowered apart."""

  @property
  def parts(self) -> Sequence[PartRuns]: ...

  @property
  def union(self) -> bool: ...


@overload
def given(part: PartRuns, form: Literal[Form.FLAT]) -> FlatPart: ...
@overload
def given(part: PartRuns, form: Literal[Form.BAND]) -> BandPart: ...
@overload
def given(part: PartRuns, form: Literal[Form.INTERVALS]) -> IntervalsPart: ...
@overload
def given(part: PartRuns, form: Literal[Form.LINE_BOUNDS]) -> BoundsPart: ...
@overload
def given(part: PartRuns, form: Literal[Form.WIDENS]) -> WideningPart: ...
@overload
def given(part: PartRuns, form: Literal[Form.PATTERN]) -> PatternPart: ...
@overload
def given(part: PartRuns, form: Literal[Form.PIECES]) -> PiecesPart: ...
@overload
def given(part: PartRuns, form: Literal[Form.JOIN]) -> JoinPart: ...
def given(part: PartRuns, form: Form) -> PartRuns:
  """`part` seen in `form`, which it must list in its `forms`."""
  if form not in part.forms:
    raise TypeError(f"{type(part).__name__} gives no {form.name} form (it gives "
                    f"{sorted(f.name for f in part.forms)})")
  return part


def line_part(part: PartRuns) -> LinePart:
  """`part` as a part that gives its runs line by line: any part without `Form.FLAT`."""
  if Form.FLAT in part.forms:
    raise TypeError(f"{type(part).__name__} gives flat runs, not runs line by line")
  return cast(LinePart, part)
