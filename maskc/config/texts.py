"""Mask text in a config: parsed with the config's definitions and parameters in scope, and
its errors moved back to where the text sits in the config.

Each mask is parsed as one program, the shared `definitions:` then the mask. An error
inside it is relocated (`MaskTexts.relocate`) from that synthesized program to the piece
of config it came from: the key path, and the line and column inside that text.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from maskc.config.files import key_path
from maskc.config.params import Params
from maskc.config.where import Where
from maskc.language import ir
from maskc.language.errors import (
  PYTHON,
  Frontend,
  MaskError,
  Span,
  Unbound,
  config_where,
  example,
  names,
  short_repr,
)
from maskc.language.parse import parse, parse_definitions

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Between the definitions and a mask: `;` ends the definitions even if the mask starts
# with an operator.
_GLUE = "\n;\n"


@dataclasses.dataclass(frozen=True)
class Segment:
  """A piece of a synthesized program that came from one place in the config."""
  start: int
  text: str
  path: str


@dataclasses.dataclass(frozen=True)
class Parsed:
  """A mask text of the config, parsed: the program it was parsed as, and where it sits."""
  mask: ir.Mask
  program: str
  segments: list[Segment]
  path: str


class MaskTexts:
  """The config's mask texts, each parsed once, with the definitions in scope.

  Attributes:
    parsed: every mask text read so far, parsed, by text.
    texts: every text read (definitions and masks), to find the parameters in use.
    definitions: the shared definitions, as one program text.
    defined: the names the definitions define.
  """

  def __init__(self, where: Where, params: Params) -> None:
    self.where, self.params = where, params
    self.parsed: dict[str, Parsed] = {}
    self.texts: list[str] = []
    self.definitions = ""
    self.segments: list[Segment] = []  # the definitions' pieces
    self.defined: set[str] = set()

  def read_definitions(self, raw: Any) -> None:
    """Reads `definitions:` (a mapping of `name` or `name(params)` to text, or one text
    block) and checks every definition, used or not."""
    base = self.where.path("definitions")
    if raw is None:
      return
    if isinstance(raw, str):
      text, segments = raw, [Segment(0, raw, base)]
    elif isinstance(raw, Mapping):
      parts, segments, pos = [], [], 0
      for lhs, body in raw.items():
        p = key_path(base, str(lhs))
        if not isinstance(lhs, str) or not _NAME.match(lhs.strip()):
          raise self.where.error(f"definition name {short_repr(lhs)} is not a name or "
                                 f"`name(params)`", p)
        if not isinstance(body, str) or not body.strip():
          raise self.where.error(f"definition `{lhs}` must be mask text, got "
                                 f"{short_repr(body)}", p, hint=f"{lhs}: causal & chunk(C)")
        line = f"{lhs} = {body}"
        segments.append(Segment(pos, lhs, p))
        segments.append(Segment(pos + len(lhs) + 3, body, p))
        parts.append(line)
        pos += len(line) + 1
      text = "\n".join(parts)
    else:
      raise self.where.error(f"definitions must be a mapping or a text block, got "
                             f"{type(raw).__name__}", base,
                             hint="definitions: {local: causal & chunk(C)}")
    self.texts.append(text)
    self.definitions, self.segments = text, segments
    if text.strip():
      try:
        self.defined = set(parse_definitions(text, **self.params.values))
      except RecursionError:
        raise self.where.error("the definitions nest too deeply to process", base) from None
      except MaskError as e:
        raise self.relocate(e, text, segments, base) from None

  def mask(self, text: Any, path: str) -> ir.Mask:
    """The mask of `text`, read at `path`, parsed with the definitions in scope."""
    if not isinstance(text, str):
      raise self.where.error(f"expected mask text, got {type(text).__name__} "
                             f"{short_repr(text)}", path,
                             hint="Write the mask as a string: \"causal & chunk(C)\".")
    if not text.strip():
      raise self.where.error("the mask text is empty", path,
                             hint="Write a mask, e.g. `causal`.")
    if text in self.parsed:
      return self.parsed[text].mask
    self.texts.append(text)
    if self.definitions.strip():
      program = self.definitions + _GLUE + text
      segments = self.segments + [Segment(len(self.definitions) + len(_GLUE), text, path)]
    else:
      program, segments = text, [Segment(0, text, path)]
    try:
      mask = parse(program, **self.params.values)
    except RecursionError:
      raise self.where.error("the mask is too deeply nested to process", path) from None
    except MaskError as e:
      raise self.relocate(e, program, segments, path) from None
    self.parsed[text] = Parsed(mask, program, segments, path)
    return mask

  def relocate(self, err: MaskError, program: str, segments: list[Segment],
               path: str) -> MaskError:
    """`err` with its span moved from the synthesized program into the config text, saying
    how to bind names in config terms."""
    span, where = err.span, path
    if span is not None and span.text == program and segments:
      seg = segments[0]
      for s in segments:
        if s.start <= span.start:
          seg = s
      rel = min(span.start - seg.start, len(seg.text))
      rel_end = max(rel + 1, min(span.end - seg.start, len(seg.text)))
      line = seg.text.count("\n", 0, rel) + 1
      column = rel - (seg.text.rfind("\n", 0, rel) + 1) + 1
      span, where = Span(line, column, rel, rel_end, seg.text), seg.path
    if where != path:  # the error sits in a definition: say which mask reached it
      extra = f"The mask at {path} uses this definition."
      err.hint = f"{err.hint}\n{extra}" if err.hint else extra
    err.span = span
    err.path, err.file = where or None, self.where.file
    if span is None:
      err.message = f"{err.message} ({config_where(self.where.file, where)})"
    err.with_source(config_where(self.where.file, where))
    return err.speaking_for(CONFIG)


class _Config:
  """A model config's terms for binding a name: `params:`, or `load_config(..., C=8192)`."""

  def bind_params(self, params: Sequence[Unbound]) -> str:
    args = ", ".join(f"{p.name}={example(p)}" for p in params)
    return f"Set {names(params)} under `params:` or pass `load_config(..., {args})`."

  def pass_operands(self, operands: Sequence[Unbound]) -> str:
    return PYTHON.pass_operands(operands)  # at compile time, a Python call passes them


CONFIG: Frontend = _Config()
