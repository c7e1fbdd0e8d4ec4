"""The error hierarchy: every bad input raises a `MaskError` subclass.

Each subclass also inherits the matching built-in exception, so callers that
catch `ValueError` or `SyntaxError` keep working. Errors about text carry the
source and a position and render the offending line with a caret under it.

An error about a name the input leaves unbound (a parameter to bind, an operand to
pass) lists it as `Unbound` data, and the front end the user called (`Frontend`: the
Python API, the command line, a model config) says how to bind it in its own terms.
"""

from __future__ import annotations

import dataclasses
import difflib
import reprlib
from collections.abc import Iterable, Sequence
from typing import Any, Literal, Protocol

# What an error quotes is bounded, whatever the input: a value is shown by `short_repr`,
# a long source line by a window around the caret, and a whole message by `_clip`.
MAX_QUOTE_CHARS = 200
MAX_LINE_CHARS = 160
MAX_MESSAGE_CHARS = 500


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
  """A region of source text: 1-based line and column, 0-based offsets."""

  line: int
  column: int
  start: int
  end: int
  text: str = dataclasses.field(repr=False, compare=False, default="")

  def caret(self) -> str:
    """The line holding the span, with carets under the span.

    A line longer than `MAX_LINE_CHARS` is shown as a window around the span,
    with `...` where it was cut, so an error about a huge text stays short.
    """
    lines = self.text.splitlines() or [""]
    line = lines[min(self.line, len(lines)) - 1]
    column = self.column
    width = max(1, min(self.end - self.start, len(line) - column + 1))
    if len(line) > MAX_LINE_CHARS:
      width = min(width, MAX_LINE_CHARS // 2)
      lo = max(0, min(column - 1 - MAX_LINE_CHARS // 4, len(line) - MAX_LINE_CHARS))
      hi = lo + MAX_LINE_CHARS
      head, tail = ("..." if lo > 0 else ""), ("..." if hi < len(line) else "")
      line = head + line[lo:hi] + tail
      column = column - lo + len(head)
    return f"  {line}\n  {' ' * (column - 1)}{'^' * width}"


@dataclasses.dataclass(frozen=True, slots=True)
class Unbound:
  """A name the input leaves unbound, as data, so each front end says how to bind it.

  Attributes:
    name: the name in the mask text.
    role: "param", an integer bound when the text is parsed (`C` in `chunk(C)`), or
      "operand", a runtime array the call passes.
    kind: an operand's kind ("token", "scalar" or "pair"); None for a parameter.
    example: a value to show for a parameter, such as 8192 for a chunk size.
  """
  name: str
  role: Literal["param", "operand"]
  kind: str | None = None
  example: int | None = None


class Frontend(Protocol):
  """How one front end of maskc tells its user to bind the names an error lists as
  `Unbound`: `PYTHON` (the default), the command line (`maskc.cli`), a model config
  (`maskc.config`)."""

  def bind_params(self, params: Sequence[Unbound]) -> str:
    """A sentence saying how to bind the parameters `params`."""
    ...

  def pass_operands(self, operands: Sequence[Unbound]) -> str:
    """A sentence saying how to pass the runtime operands `operands`."""
    ...


class _Python:
  """The Python API: `maskc.parse(text, C=8192)` and `operands={'seg': ...}`."""

  def bind_params(self, params: Sequence[Unbound]) -> str:
    args = ", ".join(f"{p.name}={example(p)}" for p in params)
    return f"Bind {names(params)} when parsing: `maskc.parse(text, {args})`."

  def pass_operands(self, operands: Sequence[Unbound]) -> str:
    items = ", ".join(f"'{o.name}': ..." for o in operands)
    return f"Pass {names(operands)}: `operands={{{items}}}`."


def example(param: Unbound) -> str:
  """The value a hint shows for a parameter: its example, or `...`."""
  return "..." if param.example is None else str(param.example)


def names(unbound: Sequence[Unbound]) -> str:
  """The names quoted for a sentence: "`a`", "`a` and `b`", "`a`, `b` and `c`"."""
  quoted = [f"`{u.name}`" for u in unbound]
  return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


PYTHON: Frontend = _Python()


class MaskError(Exception):
  """Base of every error maskc raises about a mask, its operands or its use.

  Attributes:
    message: what is wrong.
    span: where in the text, when the error is about text.
    hint: what to write instead, when there is a clear fix.
    unbound: the names the fix binds (parameters or operands), as data; the text says how
      to bind them through `frontend`.
    frontend: the front end the text speaks for: `PYTHON` unless the caller (the command
      line, a config loader) set its own. `render` gives the text for any front end.
  """

  # Errors about a config's mask text also carry its key path and file (`maskc.config`).
  path: str | None
  file: str | None

  def __init__(self, message: str, *, span: Span | None = None, hint: str | None = None,
               source: str | None = None, unbound: Sequence[Unbound] = ()):
    self.message = message
    self.span = span
    self.hint = hint
    self.source = source
    self.unbound = tuple(unbound)
    self.frontend = PYTHON
    super().__init__(self._render())

  @property
  def line(self) -> int | None:
    return self.span.line if self.span else None

  @property
  def column(self) -> int | None:
    return self.span.column if self.span else None

  def render(self, frontend: Frontend | None = None) -> str:
    """The error's text, saying how to bind its unbound names through `frontend` (by
    default the error's own)."""
    return self._render(frontend)

  def _render(self, frontend: Frontend | None = None) -> str:
    parts = [_clip(self.message)]
    if self.span is not None:
      where = f"{self.source}, " if self.source else ""
      parts[0] += f" ({where}line {self.span.line}, column {self.span.column})"
      parts.append("")
      parts.append(self.span.caret())
    # The binding completes the hint's first line; later lines (where the text came from,
    # added by a config loader) stay last.
    first, *rest = (self.hint or "").split("\n")
    hint = "\n".join([" ".join(h for h in (first, self._binding(frontend or self.frontend)) if h),
                      *rest]).strip("\n")
    if hint:
      parts.append(_clip(hint))
    return "\n".join(parts)

  def _binding(self, frontend: Frontend) -> str:
    """How to bind the unbound names, through `frontend`: parameters, then operands."""
    params = [u for u in self.unbound if u.role == "param"]
    operands = [u for u in self.unbound if u.role == "operand"]
    return " ".join(([frontend.bind_params(params)] if params else [])
                    + ([frontend.pass_operands(operands)] if operands else []))

  def __str__(self) -> str:
    return self._render()

  def with_source(self, source: str | None) -> MaskError:
    """The same error, naming where the text came from (a file, a config key)."""
    self.source = source
    self.args = (self._render(),)
    return self

  def speaking_for(self, frontend: Frontend) -> MaskError:
    """The same error, its text saying how to bind names through `frontend`."""
    self.frontend = frontend
    self.args = (self._render(),)
    return self


class MaskSyntaxError(MaskError, SyntaxError):
  """The text is not in the mask language."""

  def __init__(self, message: str, **kw: Any) -> None:
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


class MissingExtraError(MaskError, ImportError):
  """An optional dependency is not installed; the hint names the extra of maskc that
  installs it (`install_command`).

  Attributes:
    extra: the extra's name in pyproject.toml (`plot`, `flax`, `yaml`, ...).
  """

  def __init__(self, message: str, *, extra: str, hint: str | None = None) -> None:
    self.extra = extra
    install = f"Install it with `{install_command(extra)}`."
    super().__init__(message, hint=f"{install} {hint}" if hint else install)


def install_command(extra: str) -> str:
  """The command that installs maskc's optional `extra`, in the form that works where
  maskc is installed from its checkout (`pip install -e .`, run in the checkout).

  Every hint about a missing optional dependency names it so.

  >>> install_command("yaml")
  'pip install -e ".[yaml]"'
  """
  return f'pip install -e ".[{extra}]"'


class ConfigError(MaskError, ValueError):
  """A model config is malformed: a wrong key, type or count, an undeclared operand, or a
  file too large or too deeply nested to read.

  Errors in mask text inside a config keep their own class (`MaskSyntaxError`,
  `MaskNameError`, ...); both kinds carry `path` (the key path, `layers[3].mask`)
  and `file` (the config file, or None for a dict).
  """

  def __init__(self, message: str, *, path: str | None = None, file: str | None = None,
               span: Span | None = None, hint: str | None = None):
    self.path = path
    self.file = file
    super().__init__(message, span=span, hint=hint, source=config_where(file, path))

  def _render(self, frontend: Frontend | None = None) -> str:
    if self.span is None and self.source:
      head, *rest = super()._render(frontend).split("\n", 1)
      return "\n".join([f"{head} ({self.source})", *rest])
    return super()._render(frontend)


def nearest(name: str, candidates: Iterable[str]) -> str | None:
  """The candidate closest to `name`, if any is close: the "did you mean" of every hint
  (mask names, operands, backends, config keys).

  >>> nearest("casual", ["causal", "chunk"])
  'causal'
  """
  found = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
  return found[0] if found else None


def config_where(file: str | None, path: str | None) -> str | None:
  """`file: key.path`, or whichever of the two is known."""
  if file and path:
    return f"{file}: {path}"
  return file or path


# ----------------------------------------------------------------------------- quoting


class _ShortRepr(reprlib.Repr):
  """`reprlib.Repr` that also survives integers too long for `repr`."""

  def __init__(self) -> None:
    super().__init__()
    self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, 80, 80, 60
    self.maxdict = self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = 6

  def repr_int(self, x: int, level: int) -> str:
    if x.bit_length() > 256:  # repr of a huge int is slow, or refused past 4300 digits
      return f"<int of {x.bit_length()} bits>"
    return super().repr_int(x, level)


_SHORT_REPR = _ShortRepr()


def short_repr(value: Any, limit: int = MAX_QUOTE_CHARS) -> str:
  """`repr(value)` cut to at most `limit` characters, for quoting user values in errors.

  Bounded in time and length on huge, deeply nested, shared or cyclic values (a
  YAML "billion laughs" document, a 10,000-digit integer), where `repr` would
  take seconds and gigabytes.

  >>> short_repr(list(range(100)))
  '[0, 1, 2, 3, 4, 5, ...]'
  """
  try:
    text = _SHORT_REPR.repr(value)
  except Exception:  # a user object whose __repr__ fails: name its type instead
    text = f"<{type(value).__name__} object>"
  return _clip(text, limit)


def _clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
  """`text`, or its head and tail around ` ... ` when longer than `limit`."""
  if len(text) <= limit:
    return text
  keep = max(limit - 5, 2)
  return text[:keep - keep // 4] + " ... " + text[len(text) - keep // 4:]
