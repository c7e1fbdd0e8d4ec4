"""Reading a model config: a YAML, JSON or TOML file (or a mapping) into bounded plain data.

A config comes from users and from other tools, so reading it is bounded before
and while parsing: the file's size (`MAX_CONFIG_BYTES`), its nesting depth
(`MAX_CONFIG_DEPTH`, checked by a cheap scan of the text before the JSON and
TOML parsers run, and by the YAML composer as it nests) and its node count
(`MAX_CONFIG_NODES`, counting every YAML alias as the copy it stands for, so a
"billion laughs" document is refused after a bounded number of steps). Data
passed as a mapping is walked under the same depth and node bounds. Every
refusal is a `ConfigError` that names the limit. YAML is read with PyYAML's safe
constructor only: no tag ever runs code.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

from maskc.language.errors import ConfigError, Span, install_command, short_repr

MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 64
MAX_CONFIG_NODES = 50_000

_SUFFIXES = (".yaml", ".yml", ".json", ".toml")


def key_path(path: str, key: Any) -> str:
  """The key path `path.key`, `path[3]` or `path["odd key"]`, as errors print it."""
  if isinstance(key, int):
    return f"{path}[{key}]"
  if isinstance(key, str) and key.isidentifier() and len(key) <= 60:
    return f"{path}.{key}" if path else key
  text = str(key) if isinstance(key, str) else short_repr(key, 60)
  return f"{path}[{json.dumps(text if len(text) <= 60 else text[:57] + '...')}]"


def read_config(config: Any, section: str | None) -> tuple[Any, str | None, str]:
  """The config as plain data, its file name (or None), and the key path of its root.

  Raises:
    ConfigError: an unreadable, malformed, oversized or too deeply nested config,
      or a `section` it does not have.
  """
  file = None
  if isinstance(config, (str, os.PathLike)):
    file = os.fspath(config)
    suffix = os.path.splitext(file)[1].lower()
    if suffix not in _SUFFIXES:
      raise ConfigError(f"cannot tell the format of {short_repr(file)} from its suffix",
                        file=file,
                        hint="Name it .yaml, .yml, .json or .toml, or pass the loaded dict.")
    text = _read_text(file)
    data = {".json": _load_json, ".toml": _load_toml}.get(suffix, _load_yaml)(text, file)
  elif isinstance(config, Mapping):
    data = config
  else:
    raise ConfigError(f"a config is a file path or a mapping, got {type(config).__name__}",
                      hint="Pass a .yaml/.json/.toml path or a dict.")
  check_bounds(data, file)
  root = ""
  for part in (section.split(".") if section else []):
    if not isinstance(data, Mapping) or part not in data:
      raise ConfigError(f"the config has no section `{part}`", file=file, path=root or None,
                        hint=f"section={short_repr(section)} names nested keys separated by "
                             f"dots.")
    data, root = data[part], key_path(root, part)
  return data, file, root


def _read_text(file: str) -> str:
  """The file's text, refused past `MAX_CONFIG_BYTES` without reading the rest."""
  try:
    with open(file, "rb") as f:
      raw = f.read(MAX_CONFIG_BYTES + 1)
  except OSError as e:
    raise ConfigError(f"cannot read the config file: {e.strerror or e}", file=file) from None
  if len(raw) > MAX_CONFIG_BYTES:
    raise ConfigError(f"the config file is larger than {MAX_CONFIG_BYTES} bytes", file=file,
                      hint="A mask config names a few masks and a layer pattern; load a "
                           "larger file yourself and pass its mask section as a dict.")
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ConfigError(f"the config file is not UTF-8 text (byte {e.start})", file=file) from None


# ----------------------------------------------------------------------------- bounds


def _too_deep(file: str | None, span: Span | None = None, path: str | None = None):
  return ConfigError(f"the config nests deeper than {MAX_CONFIG_DEPTH} levels of lists and "
                     f"mappings", file=file,
                     span=span, path=path,
                     hint="A mask config nests a few levels (layers, a pattern, per-head "
                          "lists); flatten it.")


def _too_many(file: str | None, span: Span | None = None):
  return ConfigError(f"the config holds more than {MAX_CONFIG_NODES} values (counting each "
                     f"YAML alias as the copy it stands for)", file=file, span=span,
                     hint="Use `layers: {pattern: [...]}` rather than listing every layer, "
                          "and do not nest YAML aliases inside each other.")


def check_bounds(data: Any, file: str | None) -> None:
  """Refuses data with containers nested more than `MAX_CONFIG_DEPTH` deep (the root counts
  as one) or holding more than `MAX_CONFIG_NODES` values.

  Shared (or cyclic) containers count once per place they appear, and the walk
  stops at the first limit, so its work is bounded whatever the data.
  """
  stack: list[tuple[Any, int, Any]] = [(data, 1, None)]
  count = 0
  while stack:
    value, depth, where = stack.pop()
    count += 1
    if count > MAX_CONFIG_NODES:
      raise _too_many(file)
    if depth > MAX_CONFIG_DEPTH and isinstance(value, (Mapping, list, tuple)):
      keys = []
      while where is not None:  # (parent, key) links, built into a path only here
        where, key = where
        keys.append(key)
      path = ""
      for key in reversed(keys):
        path = key_path(path, key)
      raise _too_deep(file, path=path or None)
    if isinstance(value, Mapping):
      stack.extend((item, depth + 1, (where, key)) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
      stack.extend((item, depth + 1, (where, i)) for i, item in enumerate(value))


# Strings and comments, skipped whole by the scan; any other bracket is counted. In TOML a
# dotted key nests too (`a.b.c = 1`), and tomllib's time grows with the square of its length:
# a chain of more dots than the depth limit is refused as it is found.
_JSON_SCAN = re.compile(r'"(?:[^"\\]++|\\.)*+"|[\[\]{}]', re.DOTALL)
_TOML_KEY = r"""(?:[A-Za-z0-9_-]++|"(?:[^"\\\n]|\\.)*+"|'[^'\n]*+')"""
_TOML_SCAN = re.compile(rf"(?P<key>(?<![A-Za-z0-9_-])(?:{_TOML_KEY}[ \t]*+\.[ \t]*+)"
                        rf"{{{MAX_CONFIG_DEPTH}}}{_TOML_KEY})"
                        r'|"""(?:[^\\]|\\.)*?"""|\'\'\'.*?\'\'\'|"(?:[^"\\\n]|\\.)*"'
                        r"|'[^'\n]*'|#[^\n]*|[\[\]{}]", re.DOTALL)


def _check_brackets(text: str, scan: re.Pattern, file: str) -> None:
  """Refuses text whose brackets nest past `MAX_CONFIG_DEPTH` before a recursive parser
  sees it; the scan stops at the first bracket too deep."""
  depth = 0
  for m in scan.finditer(text):
    tok = m.group()
    if m.lastgroup == "key":  # a dotted key past the depth limit
      raise _too_deep(file, _offset_span(text, m.start()))
    if tok in ("[", "{"):
      depth += 1
      if depth > MAX_CONFIG_DEPTH:
        raise _too_deep(file, _offset_span(text, m.start()))
    elif tok in ("]", "}"):
      depth = max(0, depth - 1)


def _offset_span(text: str, offset: int) -> Span:
  line = text.count("\n", 0, offset) + 1
  column = offset - (text.rfind("\n", 0, offset) + 1) + 1
  return Span(line, column, offset, offset + 1, text)


def _file_span(text: str, line: int, column: int) -> Span:
  lines = text.splitlines(keepends=True)
  start = sum(len(x) for x in lines[:line - 1]) + column - 1
  return Span(line, column, start, start + 1, text)


# ----------------------------------------------------------------------------- formats


def _load_json(text: str, file: str) -> Any:
  _check_brackets(text, _JSON_SCAN, file)
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise ConfigError(f"invalid JSON: {e.msg}", file=file,
                      span=_file_span(text, e.lineno, e.colno)) from None
  except (ValueError, RecursionError) as e:  # an integer too long to convert, say
    raise ConfigError(f"invalid JSON: {e}", file=file) from None


def _load_toml(text: str, file: str) -> Any:
  import tomllib
  _check_brackets(text, _TOML_SCAN, file)
  try:
    return tomllib.loads(text)
  except tomllib.TOMLDecodeError as e:
    message, span = str(e), None
    m = re.search(r"\s*\(at (?:line (\d+), column (\d+)|end of document)\)$", message)
    if m:
      if m.group(1):
        span = _file_span(text, int(m.group(1)), int(m.group(2)))
      else:
        body = text.rstrip()
        line = body.count("\n") + 1
        span = _file_span(text, line, len(body) - (body.rfind("\n") + 1) + 1)
      message = message[:m.start()]
    raise ConfigError(f"invalid TOML: {message}", file=file, span=span) from None
  except (ValueError, RecursionError) as e:  # an integer too long to convert, say
    raise ConfigError(f"invalid TOML: {e}", file=file) from None


def _load_yaml(text: str, file: str) -> Any:
  try:
    import yaml
  except ImportError:
    raise ConfigError("reading a YAML config needs PyYAML, which is not installed", file=file,
                      hint=f"Install it with `{install_command('yaml')}`, or write the config "
                           "as JSON or TOML.") from None
  loader = _yaml_loader(yaml)(text, file)
  try:
    return loader.get_single_data()
  except yaml.MarkedYAMLError as e:
    mark = e.problem_mark
    span = _file_span(text, mark.line + 1, mark.column + 1) if mark is not None else None
    if "maximum nesting depth" in (e.problem or ""):
      # libyaml 0.2.6 (in PyYAML 6.0.4's wheels) limits depth itself (to 1000), and its
      # scanner reads that far ahead before our composer sees the deep collection
      raise _too_deep(file, span) from None
    raise ConfigError(f"invalid YAML: {e.problem}", file=file, span=span,
                      hint=_yaml_hint(e, text)) from None
  except yaml.YAMLError as e:
    raise ConfigError(f"invalid YAML: {e}", file=file) from None
  except ConfigError:
    raise
  except (ValueError, RecursionError) as e:  # an integer too long to convert, say
    raise ConfigError(f"invalid YAML: {e}", file=file) from None
  finally:
    loader.dispose()


def _yaml_hint(error: Any, text: str) -> str | None:
  """A fix for a YAML error (PyYAML's `MarkedYAMLError`), by what the parser met: the
  message differs between libyaml and PyYAML's own parser, so it is read with the text."""
  problem, context = error.problem or "", error.context or ""
  mark = error.problem_mark
  lines = text.split("\n")
  line = lines[mark.line] if mark is not None and mark.line < len(lines) else ""
  at = line[mark.column] if mark is not None and mark.column < len(line) else ""
  if "cannot start any token" in problem:
    if at == "\t" or "\\t" in problem:
      return "YAML indents with spaces only: replace the tabs on this line with spaces."
    return _quote_hint(at) if at else None
  start = {"anchor": "&", "alias": "*", "tag": "!"}
  for word, char in start.items():
    if word in context or f"{word} '" in problem or f"the {word} " in problem:
      return _quote_hint(char)
  if "block scalar" in context:
    head = line[:mark.column].rstrip() if mark is not None else ""
    return _quote_hint(head[-1] if head and head[-1] in "|>" else "|")
  if "mapping values are not allowed" in problem:
    if mark is not None and ": " in line[:mark.column]:
      return ("A value that holds `: ` reads as a mapping: quote it, e.g. "
              "`default: \"causal & q - k < 8\"`.")
    return _INDENT_HINT
  if "expected key" in problem or "<block end>" in problem or "'-' indicator" in problem:
    return _INDENT_HINT
  if "flow sequence" in context or "flow mapping" in context:
    return ("Close the bracket of this inline list or mapping, and quote items that hold `,` "
            "or `: `: `[\"local(1, 2)\", causal]`.")
  if "quoted scalar" in context:
    return "Close the quote this value opens, on the same line or a later one."
  return None


_INDENT_HINT = ("Check the indentation here: the keys of one mapping start in the same column, "
                "and what belongs to a key is indented further, with spaces.")


def _quote_hint(char: str) -> str:
  shown = "a backtick" if char == "`" else f"`{char}`"
  return (f"YAML reads {shown} at the start of a value itself: quote the mask text, e.g. "
          f"`default: \"{char}...\"`.")


_YAML_LOADERS: dict[Any, type] = {}


def _yaml_loader(yaml) -> type:
  """A safe YAML loader (libyaml's parser when PyYAML has it) whose composer bounds depth
  and node count as it builds the document, aliases counted as full copies."""
  if yaml in _YAML_LOADERS:
    return _YAML_LOADERS[yaml]
  from yaml.composer import Composer
  from yaml.constructor import SafeConstructor
  from yaml.events import AliasEvent, CollectionStartEvent
  from yaml.resolver import Resolver
  try:
    from yaml.cyaml import CParser as Parser  # the same events, parsed in C: 10x faster
    parts: tuple = (Parser,)
  except ImportError:  # pragma: no cover - PyYAML built without libyaml
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner
    parts = (Reader, Scanner, Parser)

  class BoundedComposer(Composer):
    """PyYAML's composer, refusing documents too deep or too large once expanded."""

    def compose_node(self, parent, index):
      self.depth += 1
      try:
        event = self.peek_event()
        if self.depth > MAX_CONFIG_DEPTH and isinstance(event, CollectionStartEvent):
          raise _too_deep(self.file, self.span(event))
        before = self.count
        node = super().compose_node(parent, index)
        if isinstance(event, AliasEvent):  # a copy of the anchored node, in full
          self.count += self.sizes.get(id(node), 1)
        else:
          self.count += 1
          if event.anchor is not None:
            self.sizes[id(node)] = self.count - before
        if self.count > MAX_CONFIG_NODES:
          raise _too_many(self.file, self.span(event))
        return node
      finally:
        self.depth -= 1

    def span(self, event) -> Span | None:
      mark = getattr(event, "start_mark", None)
      if mark is None:
        return None
      return _file_span(self.text, mark.line + 1, mark.column + 1)

  # The parser parts are picked at runtime (libyaml's or PyYAML's own): bases mypy cannot see.
  class Loader(BoundedComposer, *parts, SafeConstructor, Resolver):  # type: ignore[misc]
    def __init__(self, text: str, file: str):
      parts[0].__init__(self, text)  # the reader (or libyaml's parser) takes the text
      for part in parts[1:]:
        part.__init__(self)
      SafeConstructor.__init__(self)
      Resolver.__init__(self)
      Composer.__init__(self)
      self.text, self.file = text, file
      self.depth = self.count = 0
      self.sizes: dict[int, int] = {}

  _YAML_LOADERS[yaml] = Loader
  return Loader
