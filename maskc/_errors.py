"""The error hierarchy: every bad input raises a `MaskError` subclass.

Each subclass also inherits the matching built-in exception, so callers that
catch `ValueError` or `SyntaxError` keep working. Errors about text carry the
source and a position and render the offending line with a caret under it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
  """A region of source text: 1-based line and column, 0-based offsets."""

  line: int
  column: int
  start: int
  end: int
  text: str = dataclasses.field(repr=False, compare=False, default="")

  def caret(self) -> str:
    """The line holding the span, with carets under the span."""
    lines = self.text.splitlines() or [""]
    line = lines[min(self.line, len(lines)) - 1]
    width = max(1, min(self.end - self.start, len(line) - self.column + 1))
    return f"  {line}\n  {' ' * (self.column - 1)}{'^' * width}"


class MaskError(Exception):
  """Base of every error maskc raises about a mask, its operands or its use.

  Attributes:
    message: what is wrong.
    span: where in the text, when the error is about text.
    hint: what to write instead, when there is a clear fix.
  """

  def __init__(self, message: str, *, span: Span | None = None, hint: str | None = None,
               source: str | None = None):
    self.message = message
    self.span = span
    self.hint = hint
    self.source = source
    super().__init__(self._render())

  @property
  def line(self) -> int | None:
    return self.span.line if self.span else None

  @property
  def column(self) -> int | None:
    return self.span.column if self.span else None

  def _render(self) -> str:
    parts = [self.message]
    if self.span is not None:
      where = f"{self.source}, " if self.source else ""
      parts[0] += f" ({where}line {self.span.line}, column {self.span.column})"
      parts.append("")
      parts.append(self.span.caret())
    if self.hint:
      parts.append(self.hint)
    return "\n".join(parts)

  def __str__(self) -> str:
    return self._render()

  def with_source(self, source: str) -> "MaskError":
    """The same error, naming where the text came from (a file, a config key)."""
    self.source = source
    self.args = (self._render(),)
    return self


class MaskSyntaxError(MaskError, SyntaxError):
  """The text is not in the mask language."""

  def __init__(self, message: str, **kw):
    MaskError.__init__(self, message, **kw)

  def __str__(self) -> str:
    return self._render()


class MaskNameError(MaskError, NameError):
  """A name is not defined, or is used as something it is not."""


class MaskTypeError(MaskError, TypeError):
  """A value of the wrong kind: a mask where a number belongs, a bad arity."""


class MaskValueError(MaskError, ValueError):
  """A value out of its domain: `chunk(0)`, a negative window, a bad length."""


class MaskRecursionError(MaskNameError):
  """A definition refers to itself, directly or through others."""


class MaskLimitError(MaskValueError):
  """The text or the expression is larger or deeper than maskc accepts."""


class OperandError(MaskValueError):
  """A runtime operand is missing, misshapen or of the wrong kind."""


class BackendError(MaskError, NotImplementedError):
  """The chosen backend cannot run this mask; the message names one that can."""
