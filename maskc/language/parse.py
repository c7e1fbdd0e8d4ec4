"""From text to IR: the lark parser, limits, and the elaborator.

`parse(text, **params)` reads a program (definitions, then one mask), checks
it against the size limits, and elaborates the syntax tree into IR through the
constructors of `maskc.language.ir`, so text and Python builders give equal masks.
Definitions are elaborated lazily, once, into templates with `Param` nodes;
recursion is found by tracking the definitions in progress.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, cast, overload

import lark

from maskc.grammar import grammar_text, prelude_text
from maskc.language import ir
from maskc.language.errors import (
  MaskError,
  MaskLimitError,
  MaskNameError,
  MaskRecursionError,
  MaskSyntaxError,
  MaskTypeError,
  MaskValueError,
  Span,
  short_repr,
)

MAX_TEXT_CHARS = 100_000
MAX_NESTING = 128
MAX_EXPANDED_NODES = 50_000
# Redundant brackets add no syntax-tree depth (`((causal))` is `causal`), so brackets get a
# looser bound than the tree; it is checked by a scan before lark runs, which stops at the first
# bracket too deep: a text of 60,000 `(` is refused after about this many characters.
MAX_BRACKET_DEPTH = 4 * MAX_NESTING
# An integer literal longer than this cannot be a sensible position, and Python refuses to
# convert one past 4,300 digits; the IR's own range check then gives the exact bound.
MAX_LITERAL_DIGITS = 40
MAX_BUILT_NODES = 4 * MAX_EXPANDED_NODES  # nodes built while expanding definitions, in all

RESERVED = {"q", "k", "true", "false", "where"}
BUILTINS = {"abs", "min", "max", "runs"}


_OPEN_ENDED = {"|", "^", "&", "+", "-", "*", "//", "%", "~", "=", ",", "<", "<=", "==", "!=",
               ">=", ">", "where"}
_CONTINUES = {"|", "^", "&", "+", "*", "//", "%", "where", "<", "<=", "==", "!=", ">=", ">"}


class _Separators:
  """Post-lexer: folds newlines and `;` into one `_SEP`.

  Newlines inside brackets are dropped, and so is a newline before a line that
  starts with `where` or a binary operator, which continues the line above.
  """

  always_accept = ("NEWLINE", "SEMICOLON")

  def process(self, stream: Iterator[lark.Token]) -> Iterator[lark.Token]:
    depth = 0
    pending = None
    started = False
    last = None
    for tok in stream:
      if tok.type in ("NEWLINE", "SEMICOLON"):
        if depth > 0 and tok.type == "NEWLINE":
          continue
        if tok.type == "NEWLINE" and last in _OPEN_ENDED:
          continue  # a line ending in an operator continues on the next
        if started and pending is None:
          pending = lark.Token.new_borrow_pos("_SEP", "\n" if tok.type == "NEWLINE" else ";",
                                              tok)
        elif pending is not None and tok.type == "SEMICOLON":
          pending = lark.Token.new_borrow_pos("_SEP", ";", tok)
        continue
      if tok in ("(", "["):
        depth += 1
      elif tok in (")", "]"):
        depth = max(0, depth - 1)
      if pending is not None and not (pending == "\n" and tok in _CONTINUES):
        yield pending
      pending = None
      started = True
      last = str(tok)
      yield tok


@functools.lru_cache(maxsize=1)
def _parser() -> lark.Lark:
  return lark.Lark(grammar_text(), parser="lalr", lexer="basic", propagate_positions=True,
                   maybe_placeholders=False, postlex=_Separators())


_TOKEN_TEXT = {"LPAR": "(", "RPAR": ")", "LSQB": "[", "RSQB": "]", "COMMA": ",", "EQUAL": "=",
               "VBAR": "|", "CIRCUMFLEX": "^", "AMPERSAND": "&", "TILDE": "~", "PLUS": "+",
               "MINUS": "-", "STAR": "*", "SLASH": "/", "PERCENT": "%", "__ANON_0": "//",
               "COMP_OP": "a comparison", "INT": "a number", "NAME": "a name",
               "STRING": "a quoted message", "_SEP": "a new line or `;`", "$END": "the end"}


def _describe_expected(expected: Iterable[str]) -> str:
  names = []
  for e in sorted(expected):
    text = _TOKEN_TEXT.get(e)
    if text is None:
      try:
        pattern = _parser().get_terminal(e).pattern
        text = pattern.value if pattern.type == "str" else e.lower()
      except (KeyError, AttributeError):
        text = e.lower()
    if len(text) <= 2 and text.isascii() and not text.isalnum():
      text = f"`{text}`"
    names.append(text)
  names = sorted(set(names))
  if not names:
    return ""
  return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _span(text: str, line: int, column: int, start: int, end: int) -> Span:
  return Span(line, column, start, max(end, start + 1), text)


def _syntax_error(text: str, err: lark.exceptions.UnexpectedInput) -> MaskSyntaxError:
  # Lark sets these per error class, some not at all, some to -1 or "?" where unknown.
  pos: Any = getattr(err, "pos_in_stream", None)
  line: Any = getattr(err, "line", None)
  column: Any = getattr(err, "column", None)
  if isinstance(err, lark.exceptions.UnexpectedEOF) or line in (None, -1):
    stripped = text.rstrip()
    line = stripped.count("\n") + 1
    column = len(stripped) - (stripped.rfind("\n") + 1) + 1
    pos = len(stripped)
    expected_at_end = getattr(err, "expected", None)
    return MaskSyntaxError(
        "the mask ends too early" + (f"; expected {_describe_expected(expected_at_end)}"
                                     if expected_at_end else ""),
        span=_span(text, line, column, pos, pos + 1),
        hint="Close every bracket and finish the last operator's operand.")
  if isinstance(err, lark.exceptions.UnexpectedCharacters):
    ch = text[pos] if pos is not None and pos < len(text) else "?"
    return MaskSyntaxError(f"unexpected character {ch!r}",
                           span=_span(text, line, column, pos or 0, (pos or 0) + 1),
                           hint=_char_hint(ch))
  tok = cast(lark.exceptions.UnexpectedToken, err).token  # the third kind of UnexpectedInput
  start = tok.start_pos if tok.start_pos is not None else (pos or 0)
  end = tok.end_pos if tok.end_pos is not None else start + 1
  shown = "end of the mask" if tok.type == "$END" else (
      "new line or `;`" if tok.type == "_SEP" else f"`{tok}`")
  expected = _describe_expected(getattr(err, "expected", set()) or set())
  return MaskSyntaxError(f"unexpected {shown}" + (f"; expected {expected}" if expected else ""),
                         span=_span(text, line, column, start, end), hint=_token_hint(tok))


def _char_hint(ch: str) -> str | None:
  return {"!": "Complement a mask with `~`, not `!`.",
          "/": "Integer division is `//`.",
          "'": "Operands are bare names: `document(seg)`, not strings.",
          "&": None}.get(ch, "Masks use `& | ^ ~`, comparisons, `+ - * // %` and calls.")


def _token_hint(tok: lark.Token) -> str | None:
  if tok == "=":
    return "Comparison is `==`; `name = mask` defines a name on its own line."
  if tok in ("and", "or", "not"):
    return "Use `&`, `|` and `~` to combine masks."
  return None


def parse_tree(text: str) -> lark.Tree[lark.Token]:
  """The syntax tree of `text`, after the size and nesting limits."""
  if not isinstance(text, str):
    raise MaskTypeError(f"a mask text must be a str, got {type(text).__name__}")
  if len(text) > MAX_TEXT_CHARS:
    raise MaskLimitError(f"the mask text has {len(text)} characters; the limit is "
                         f"{MAX_TEXT_CHARS}", hint="Name repeated parts with definitions.")
  _check_brackets(text)
  try:
    tree = _parser().parse(text)
  except lark.exceptions.UnexpectedInput as e:
    raise _syntax_error(text, e) from None
  except lark.exceptions.LarkError as e:  # anything else lark may raise on odd input
    raise MaskSyntaxError(f"cannot parse the mask: {e}") from None
  _check_nesting(tree, text)
  return tree


# Comments and quoted messages are skipped whole; every other bracket is counted, and so is
# a run of prefix operators (`~~~~`, `- - -`), each of which nests the tree one level.
_DEPTH_SCAN = re.compile(rf'#[^\n]*|"[^"\n]*"|(?P<unary>(?<![~-])[~-](?:\s*[~-]){{{MAX_NESTING},}})'
                         r'|[()\[\]]')


def _check_brackets(text: str) -> None:
  """Refuses brackets nested deeper than `MAX_BRACKET_DEPTH`, and runs of more than
  `MAX_NESTING` prefix operators, before lark parses the text: the scan stops at the first
  one, so a text of 60,000 `(` is refused in time proportional to the limit."""
  depth = 0
  for m in _DEPTH_SCAN.finditer(text):
    tok = m.group()
    if m.lastgroup == "unary":
      raise MaskLimitError(f"the mask nests deeper than {MAX_NESTING} levels",
                           span=_offset_span(text, m.start(), m.end()),
                           hint="A run of `~` or `-` nests one level per operator; drop pairs "
                                "that cancel.")
    if tok in ("(", "["):
      depth += 1
      if depth > MAX_BRACKET_DEPTH:
        raise MaskLimitError(f"the mask nests brackets deeper than {MAX_BRACKET_DEPTH} levels",
                             span=_offset_span(text, m.start(), m.end()),
                             hint="Close brackets sooner; name parts with definitions.")
    elif tok in (")", "]"):
      depth = max(0, depth - 1)


def _offset_span(text: str, start: int, end: int) -> Span:
  line = text.count("\n", 0, start) + 1
  column = start - (text.rfind("\n", 0, start) + 1) + 1
  return _span(text, line, column, start, end)


def _check_nesting(tree: lark.Tree[lark.Token], text: str) -> None:
  stack = [(tree, 1)]
  while stack:
    node, depth = stack.pop()
    if depth > MAX_NESTING:
      m = node.meta
      raise MaskLimitError(
          f"the mask nests deeper than {MAX_NESTING} levels",
          span=_span(text, m.line, m.column, m.start_pos, m.end_pos) if not m.empty else None,
          hint="Long chains of `+` or `-` and deep brackets nest; name parts with definitions.")
    stack.extend((c, depth + 1) for c in node.children if isinstance(c, lark.Tree))


nearest = ir.nearest  # the candidate closest to a name, for hints

# A node of lark's syntax tree. Lark types a tree's children as trees or tokens; which of
# the two stands where follows from the grammar (maskc/grammar/maskc.lark), not the types.
_Syntax = Any

_ARITH_OPS: dict[str, ir.ArithOp] = {"add": "+", "sub": "-", "mul": "*", "floordiv": "//",
                                     "mod": "%"}
_CONNECTIVES = {"or_": ir.or_, "xor": ir.xor, "and_": ir.and_}


class _Runs:
  """`runs(x)` before it is indexed."""

  def __init__(self, operand: ir.Operand | ir.Param, span: Span | None) -> None:
    self.operand, self.span = operand, span


# What an expression elaborates to: IR, or `runs(x)` waiting for its index.
_Value = ir.Node | _Runs


class _Pending:
  def __init__(self, name: str, params: tuple[str, ...], body: _Syntax,
               requirements: list[_Syntax], span: Span | None) -> None:
    self.name, self.params, self.body = name, params, body
    self.requirements, self.span = requirements, span


class _Program:
  """One program's statements: its definitions, elaborated lazily and once each into
  templates with `Param` nodes, and its final mask."""

  def __init__(self, text: str, library: dict[str, ir.Definition], params: dict[str, Any],
               prelude: bool = False):
    self.text = text
    self.library = library
    self.params = params
    self.prelude = prelude
    self.pending: dict[str, _Pending] = {}
    self.done: dict[str, ir.Definition] = {}
    self.in_progress: list[str] = []
    self.expressions = _Expressions(self)

  def span(self, node: _Syntax) -> Span | None:
    if isinstance(node, lark.Token):  # the lexer sets every position of the tokens it makes
      return _span(self.text, cast(int, node.line), cast(int, node.column),
                   cast(int, node.start_pos), cast(int, node.end_pos))
    m = node.meta
    if m.empty:
      return None
    return _span(self.text, m.line, m.column, m.start_pos, m.end_pos)

  @overload
  def program(self, tree: lark.Tree[lark.Token], *,
              library_only: Literal[False] = False) -> ir.Mask: ...

  @overload
  def program(self, tree: lark.Tree[lark.Token], *, library_only: Literal[True]) -> None: ...

  def program(self, tree: lark.Tree[lark.Token], *, library_only: bool = False) -> ir.Mask | None:
    # Expanding definitions may build at most this many nodes in all: bounded work for any text.
    with ir.build_budget(MAX_BUILT_NODES):
      return self._program(tree, library_only=library_only)

  def _program(self, tree: lark.Tree[lark.Token], *, library_only: bool) -> ir.Mask | None:
    statements = tree.children
    for i, st in enumerate(statements):
      last = i == len(statements) - 1
      if isinstance(st, lark.Tree) and st.data == "definition":
        if last and not library_only:
          name = self._lhs(st.children[0])[0]
          raise MaskSyntaxError(
              "the program ends with a definition; its last line must be the mask",
              span=self.span(st), hint=f"Add the mask on a last line, e.g. `{name}`; to "
                                       "compare, write `==`.")
        self._declare(st)
      elif library_only or not last:
        raise MaskSyntaxError("only the last line may be a mask; the lines before it define names",
                              span=self.span(st), hint="Name this line: `m = ...`.")
    if library_only:
      for name in list(self.pending):
        self.definition(name, None)
      return None
    result = self.expressions.mask(statements[-1])
    if ir.expanded_size(result, MAX_EXPANDED_NODES) > MAX_EXPANDED_NODES:
      raise MaskLimitError(f"the mask expands to more than {MAX_EXPANDED_NODES} nodes",
                           span=self.span(statements[-1]),
                           hint="Definitions used many times multiply; simplify the mask.")
    ir.collect_operands(result)  # raises on an operand used as two kinds
    return result

  def _lhs(self, node: _Syntax) -> tuple[str, tuple[str, ...], tuple[_Syntax, ...]]:
    if isinstance(node, lark.Tree) and node.data == "name":
      return str(node.children[0]), (), ()
    if isinstance(node, lark.Tree) and node.data == "call":
      name, args = node.children[0], node.children[1:]
      params = []
      for a in args:
        if not (isinstance(a, lark.Tree) and a.data == "name"):
          raise MaskSyntaxError("a definition's parameters must be plain names",
                                span=self.span(a), hint=f"Write `{name}(a, b) = ...`.")
        params.append(a.children[0])
      return str(name), tuple(str(p) for p in params), tuple(params)
    raise MaskSyntaxError("the left of `=` must be a name or `name(params)`",
                          span=self.span(node),
                          hint="Comparison is `==`; a definition reads `name = mask`.")

  def _declare(self, st: lark.Tree[lark.Token]) -> None:
    lhs, body, *reqs = st.children
    name, params, param_tokens = self._lhs(lhs)
    where = self.span(lhs)
    if name in RESERVED or name in BUILTINS:
      raise MaskNameError(f"`{name}` is a reserved name and cannot be defined", span=where,
                          hint="Choose another name.")
    if name in self.pending:
      raise MaskNameError(f"`{name}` is defined twice", span=where,
                          hint="Remove or rename one of the definitions.")
    seen = set()
    for p, tok in zip(params, param_tokens):
      if p in RESERVED or p in BUILTINS or p in seen:
        raise MaskNameError(f"parameter `{p}` of `{name}` is reserved or repeated",
                            span=self.span(tok), hint="Choose another parameter name.")
      seen.add(p)
    self.pending[name] = _Pending(name, params, body, reqs, where)

  def definition(self, name: str, span: Span | None) -> ir.Definition:
    if name in self.done:
      return self.done[name]
    if name in self.in_progress:
      cycle = " -> ".join(self.in_progress[self.in_progress.index(name):] + [name])
      raise MaskRecursionError(f"recursive definition: {cycle}", span=span,
                               hint="A mask cannot be defined in terms of itself.")
    p = self.pending[name]
    self.in_progress.append(name)
    exprs = self.expressions
    outer, exprs.env = exprs.env, {x: ir.Param(x, p.span) for x in p.params}
    try:
      body = exprs.visit(p.body)
      if isinstance(body, (ir.Read, ir.PairRead)):
        body = ir.truth(body, self.span(p.body))
      if isinstance(body, (ir.Operand, _Runs)):
        raise MaskTypeError(f"`{name}` must be a mask or an integer term",
                            span=self.span(p.body))
      reqs = []
      for r in p.requirements:
        cond = exprs.mask(r.children[0])
        message = str(r.children[1])[1:-1] if len(r.children) > 1 else f"requires {ir.quote(cond)}"
        reqs.append((cond, message))
    finally:
      self.in_progress.pop()
      exprs.env = outer
    d = ir.Definition(name, p.params, body, tuple(reqs), self.prelude)
    self.done[name] = d
    return d

  def lookup(self, name: str, span: Span | None) -> ir.Definition | None:
    if name in self.pending:
      return self.definition(name, span)
    return self.library.get(name)

  def known_names(self) -> list[str]:
    return list(self.pending) + list(self.library) + list(self.params)


class _Expressions(lark.visitors.Interpreter[lark.Token, _Value]):
  """Elaborates an expression's syntax tree into IR, top down: one method per node of the
  grammar, named by its alias in `maskc/grammar/maskc.lark`.

  `env` holds the parameters of the definition being elaborated (empty for the final mask).
  """

  def __init__(self, program: _Program) -> None:
    self.program = program
    self.span = program.span
    self.env: dict[str, ir.Param] = {}

  def visit(self, tree: lark.Tree[lark.Token]) -> _Value:
    # Lark's `visit` also looks for a `visit_wrapper` on each method; none has one here.
    method: Callable[[lark.Tree[lark.Token]], _Value] = getattr(self, tree.data)
    return method(tree)

  def __default__(self, tree: lark.Tree[lark.Token]) -> _Value:
    raise MaskSyntaxError(f"unexpected `{tree.data}`", span=self.span(tree))

  def mask(self, node: _Syntax) -> ir.Mask:
    """`node` elaborated, as a mask: an indexed boolean operand is one."""
    value = self.visit(node)
    if isinstance(value, ir.Operand):
      guess = nearest(value.name, self.program.known_names())
      tail = f"If `{value.name}` is a boolean operand, index it: `{value.name}[q]`."
      raise MaskNameError(f"unknown mask `{value.name}`", span=value.span or self.span(node),
                          hint=(f"Did you mean `{guess}`? " if guess else "") + tail)
    if isinstance(value, _Runs):
      raise MaskTypeError("`runs(x)` is a per-token value; index it", span=value.span,
                          hint="Compare runs at two positions: `runs(x)[q] == runs(x)[k]`.")
    if isinstance(value, (ir.Read, ir.PairRead)):
      return ir.truth(value, self.span(node))
    return ir.mask(value, self.span(node))

  def term(self, node: _Syntax) -> ir.Term:
    """`node` elaborated, as an integer term."""
    return self._term(self.visit(node), node)

  def _term(self, value: _Value, node: _Syntax) -> ir.Term:
    if isinstance(value, _Runs):
      raise MaskTypeError("`runs(x)` is a per-token value; index it", span=value.span,
                          hint="`runs(x)[q]`.")
    return ir.term(value, self.span(node))

  # ---------------------------------------------------------------- masks

  def _connective(self, tree: lark.Tree[lark.Token]) -> ir.Mask:
    return _CONNECTIVES[tree.data]([self.mask(c) for c in tree.children], self.span(tree))

  or_ = xor = and_ = _connective

  def not_(self, tree: lark.Tree[lark.Token]) -> ir.Mask:
    return ir.not_(self.mask(tree.children[0]), self.span(tree))

  def compare(self, tree: lark.Tree[lark.Token]) -> ir.Mask:
    ch = tree.children
    return ir.compare([self.term(c) for c in ch[0::2]], [str(o) for o in ch[1::2]],
                      self.span(tree))

  # ---------------------------------------------------------------- integer terms

  def _arith(self, tree: lark.Tree[lark.Token]) -> ir.Term:
    lhs, rhs = tree.children
    return ir.arith(_ARITH_OPS[tree.data], self.term(lhs), self.term(rhs), self.span(tree))

  add = sub = mul = floordiv = mod = _arith

  def neg(self, tree: lark.Tree[lark.Token]) -> ir.Term:
    return ir.neg(self.term(tree.children[0]), self.span(tree))

  def int_lit(self, tree: lark.Tree[lark.Token]) -> ir.Term:
    digits = str(tree.children[0]).replace("_", "").lstrip("0") or "0"
    if len(digits) > MAX_LITERAL_DIGITS:
      raise MaskLimitError(f"the integer literal has {len(digits)} digits; the limit is "
                           f"{MAX_LITERAL_DIGITS}", span=self.span(tree),
                           hint="Positions, offsets and sizes fit in far fewer digits.")
    return ir.term(int(digits), self.span(tree))

  # ---------------------------------------------------------------- names, calls, reads

  def name(self, tree: lark.Tree[lark.Token]) -> ir.Node:
    name, span = str(tree.children[0]), self.span(tree)
    if name in self.env:
      return self.env[name]
    if name in ("q", "k"):
      return ir.Pos(cast(Literal["q", "k"], name), span)
    if name in ("true", "false"):
      return ir.BoolConst(name == "true", span)
    if name in self.program.params:
      return _param_value(name, self.program.params[name], span)
    d = self.program.lookup(name, span)
    if d is not None:
      if d.params:
        raise MaskTypeError(f"`{name}` takes {len(d.params)} argument"
                            f"{'s' if len(d.params) > 1 else ''}", span=span,
                            hint=f"Write `{name}({', '.join(d.params)})`.")
      return ir.call(d, (), span)
    if name in BUILTINS:
      raise MaskTypeError(f"`{name}` is a function", span=span, hint=f"Call it: `{name}(...)`.")
    return ir.Operand(name, span)

  def kwarg(self, tree: lark.Tree[lark.Token]) -> _Value:
    raise MaskSyntaxError("a keyword argument outside a call", span=self.span(tree))

  def call(self, tree: lark.Tree[lark.Token]) -> _Value:
    name_tok, *args = cast(list[_Syntax], tree.children)
    name = str(name_tok)
    span = self.span(tree)
    positional: list[tuple[_Value, _Syntax]] = []
    keywords: dict[str, tuple[_Value, _Syntax]] = {}
    for a in args:
      if isinstance(a, lark.Tree) and a.data == "kwarg":
        key = str(a.children[0])
        if key in keywords:
          raise MaskTypeError(f"argument `{key}` given twice", span=self.span(a))
        keywords[key] = (self.visit(a.children[1]), a)
      else:
        if keywords:
          raise MaskSyntaxError("a positional argument after a keyword argument",
                                span=self.span(a), hint="Put positional arguments first.")
        positional.append((self.visit(a), a))
    if name in BUILTINS:
      if keywords:
        raise MaskTypeError(f"`{name}` takes no keyword arguments", span=span)
      if name == "runs":
        if len(positional) != 1:
          raise MaskTypeError(f"runs takes 1 argument, got {len(positional)}", span=span,
                              hint="`runs(img)[q]`.")
        value, a = positional[0]
        if not isinstance(value, (ir.Operand, ir.Param)):
          raise MaskTypeError("runs takes the name of a boolean per-token operand",
                              span=self.span(a), hint="`runs(img)`.")
        return _Runs(value, span)
      return ir.fn(name, [self._term(v, a) for v, a in positional], span)
    if name in self.env or name in self.program.params or name in ("q", "k", "true", "false"):
      raise MaskTypeError(f"`{name}` is not a function", span=self.span(name_tok))
    d = self.program.lookup(name, span)
    if d is None:
      guess = nearest(name, self.program.known_names() + sorted(BUILTINS))
      raise MaskNameError(f"unknown function `{name}`", span=self.span(name_tok),
                          hint=f"Did you mean `{guess}`?" if guess else
                          "Define it first: `name(a, b) = ...`.")
    values = [v for v, _ in positional]
    for key, (_, a) in keywords.items():
      if key not in d.params:
        raise MaskTypeError(f"`{name}` has no parameter `{key}`", span=self.span(a),
                            hint=f"Its parameters are ({', '.join(d.params)}).")
    if keywords:
      if len(values) + len(keywords) != len(d.params):
        raise MaskTypeError(f"`{name}` takes {len(d.params)} arguments, got "
                            f"{len(values) + len(keywords)}", span=span,
                            hint=f"Write `{name}({', '.join(d.params)})`.")
      for p in d.params[len(values):]:
        if p not in keywords:
          raise MaskTypeError(f"`{name}` is missing argument `{p}`", span=span)
        values.append(keywords[p][0])
      for p in d.params[:len(positional)]:
        if p in keywords:
          raise MaskTypeError(f"argument `{p}` given twice", span=span)
    values = [v.operand if isinstance(v, _Runs) else v for v in values]
    return ir.call(d, values, span)

  def index(self, tree: lark.Tree[lark.Token]) -> ir.Term:
    operand, *indices = cast(list[_Syntax], tree.children)
    base = self.visit(operand)
    idx = [self.term(c) for c in indices]
    span = self.span(tree)
    if isinstance(base, _Runs):
      if len(idx) != 1:
        raise MaskTypeError("runs(x) takes one index", span=span, hint="`runs(x)[q]`.")
      return ir.read(base.operand, idx[0], True, span)
    if not isinstance(base, (ir.Operand, ir.Param)):
      raise MaskTypeError(f"only operands can be indexed, not {ir.quote(base)}", span=span,
                          hint="Index an operand by name: `seg[q]`, `allowed[q, k]`.")
    if len(idx) == 1:
      return ir.read(base, idx[0], False, span)
    if len(idx) == 2:
      return ir.pair_read(base, idx[0], idx[1], span)
    raise MaskTypeError(f"operands take one or two indices, got {len(idx)}", span=span)


def _param_value(name: str, value: Any, span: Span | None) -> ir.Node:
  if isinstance(value, bool):
    return ir.BoolConst(value, span)
  if isinstance(value, int) or (hasattr(value, "__index__") and not isinstance(value, str)):
    try:
      number = int(value.__index__()) if not isinstance(value, int) else value
    except TypeError:
      pass
    else:
      if number.bit_length() > 4 * MAX_LITERAL_DIGITS:  # too long for the IR to quote
        raise MaskValueError(f"parameter `{name}` is out of range: an integer of "
                             f"{number.bit_length()} bits", span=span)
      return ir.term(number, span)
  if isinstance(value, ir.Node):
    return value
  if isinstance(value, str) and value.isidentifier():
    return ir.Operand(value, span)
  raise MaskTypeError(f"parameter `{name}` must be an int, a mask or an operand name, got "
                      f"{type(value).__name__} {short_repr(value)}", span=span)


@functools.lru_cache(maxsize=1)
def prelude() -> dict[str, ir.Definition]:
  """The standard named masks, parsed once from `maskc/grammar/prelude.mask`."""
  text = prelude_text()
  program = _Program(text, {}, {}, prelude=True)
  program.program(parse_tree(text), library_only=True)
  return dict(program.done)


def parse_definitions(text: str, **params: Any) -> dict[str, ir.Definition]:
  """Elaborates a program of definitions only, and returns them by name.

  What a model config's `definitions:` hold: every definition is elaborated and checked,
  with the prelude and `params` in scope, whether or not a mask uses it.

  Raises:
    MaskError: a definition that does not parse or check, or a line that is not a
      definition.

  >>> sorted(parse_definitions("local = causal & chunk(C); stream(w) = sliding(w) | sink(4)",
  ...                          C=64))
  ['local', 'stream']
  """
  program = _Program(text, prelude(), dict(params))
  program.program(parse_tree(text), library_only=True)
  return dict(program.done)


def known_mask_names() -> list[str]:
  """Names of the prelude masks."""
  return sorted(prelude())


@functools.lru_cache(maxsize=1024)
def _parse_cached(text: str, params: tuple[tuple[str, Any], ...]) -> ir.Mask:
  program = _Program(text, prelude(), dict(params))
  return program.program(parse_tree(text))


def parse(text: str, **params: Any) -> ir.Mask:
  """Parses mask text into IR.

  Args:
    text: a program: optional definitions (`name = ...`, `name(a, b) = ...`), one per
      line or separated by `;`, then the mask. `#` starts a comment.
    **params: values for free names: ints (`C=8192` for `chunk(C)`), masks, or
      operand names (strings) to rename an operand.

  Returns:
    The mask IR. `str()` of it is its canonical text.

  Raises:
    MaskError: a subclass naming what is wrong, with line, column and a caret.

  >>> import maskc
  >>> maskc.parse("causal & chunk(C)", C=8192) == maskc.causal() & maskc.chunk(8192)
  True
  """
  if not isinstance(text, str):
    raise MaskTypeError(f"parse takes a str, got {type(text).__name__}")
  try:
    key = tuple(sorted(params.items()))
    hash(key)
  except TypeError:
    return _Program(text, prelude(), params).program(parse_tree(text))
  try:
    return _parse_cached(text, key)
  except RecursionError:
    raise MaskLimitError("the mask is too deeply nested to process",
                         hint="Name parts of it with definitions.") from None
  except MaskError:
    raise


ir.install(parse=parse, mask_names=known_mask_names)
