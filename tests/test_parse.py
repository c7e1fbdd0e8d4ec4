"""Parse errors: every bad input raises a located, actionable `maskc.MaskError` (the error rule
of docs/contributing.md).

Checks the error class, the message, and that the caret sits under the
offending token; then fuzzes the parser with junk and mutated masks, which
must raise `MaskError` or parse, never anything else.
"""

import re

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

import maskc


def error_of(text, **params) -> maskc.MaskError:
  with pytest.raises(maskc.MaskError) as info:
    maskc.parse(text, **params)
  return info.value


def caret_columns(err: maskc.MaskError) -> tuple[int, int]:
  """The 1-based columns of the first and last `^` in the rendered error."""
  for line in str(err).splitlines():
    if line.strip() and set(line.strip()) == {"^"}:
      first = line.index("^") - 1  # the quoted line is indented by two spaces
      return first, first + line.count("^") - 1
  raise AssertionError(f"no caret line in:\n{err}")


def quoted_line(err: maskc.MaskError) -> str:
  lines = str(err).splitlines()
  caret = next(i for i, line in enumerate(lines) if line.strip() and set(line.strip()) == {"^"})
  return lines[caret - 1][2:]


def assert_points_at(err: maskc.MaskError, text: str, token: str, occurrence: int = 0):
  """The error's column and caret start at `token` (its `occurrence`-th appearance) in `text`."""
  starts = [m.start() for m in re.finditer(re.escape(token), text)]
  line_start = text.rfind("\n", 0, starts[occurrence]) + 1
  column = starts[occurrence] - line_start + 1
  assert err.column == column, f"column {err.column}, expected {column}:\n{err}"
  assert caret_columns(err)[0] == column, str(err)
  assert quoted_line(err) == text[line_start:].split("\n")[0]


# ----------------------------------------------------------------------------- syntax errors


@pytest.mark.parametrize("text,token", [
    ("causal & | chunk(4)", "|"),
    ("causal && chunk(4)", "&"),
    ("chunk(4))", ")"),
    ("causal chunk(4)", "chunk"),
    ("q < < k", "<"),
    ("sliding(4,)", ")"),
    ("causal & chunk(4) |", "|"),
])
def test_syntax_error_is_located(text, token):
  err = error_of(text)
  assert isinstance(err, maskc.MaskSyntaxError)
  assert isinstance(err, SyntaxError)
  assert "expected" in err.message or "ends too early" in err.message
  assert err.line == 1
  occurrence = 1 if text.count(token) > 1 and token in ("&", ")", "<") else 0
  if text.endswith(token) and token == "|":
    return  # the error is at the end of the text; checked below
  assert_points_at(err, text, token, occurrence)


def test_syntax_error_says_what_was_expected():
  err = error_of("causal & | chunk(4)")
  assert "unexpected `|`" in err.message
  assert "expected" in err.message and "a name" in err.message


def test_unclosed_bracket_points_at_the_end():
  text = "causal & (chunk(4)"
  err = error_of(text)
  assert isinstance(err, maskc.MaskSyntaxError)
  assert "end" in err.message and "`)`" in err.message
  assert err.column >= len(text)  # at the last token or just past it
  assert caret_columns(err)[0] == err.column


def test_syntax_error_on_a_later_line():
  text = "local = causal & chunk(8)\nwide = local | | sink(4)\nwide"
  err = error_of(text)
  assert err.line == 2
  assert err.column == len("wide = local | ") + 1
  assert quoted_line(err) == "wide = local | | sink(4)"


@pytest.mark.parametrize("text,char,hint", [
    ("!causal", "!", "~"),
    ("q / 2 < k", "/", "//"),
    ("document('seg')", "'", "bare names"),
    ("causal $ chunk(4)", "$", None),
])
def test_unexpected_character(text, char, hint):
  err = error_of(text)
  assert isinstance(err, maskc.MaskSyntaxError)
  assert repr(char) in err.message
  assert_points_at(err, text, char)
  if hint:
    assert hint in str(err)


def test_single_equals_hints_at_comparison():
  err = error_of("causal & (q = k)")
  assert "==" in str(err)
  assert_points_at(err, "causal & (q = k)", "=")


def test_single_equals_on_one_line_hints_at_comparison():
  err = error_of("q = k & causal")
  assert "==" in str(err)


@pytest.mark.parametrize("text", ["causal and chunk(4)", "causal or sink(4)"])
def test_python_boolean_words_hint_at_operators(text):
  err = error_of(text)
  assert isinstance(err, maskc.MaskSyntaxError)
  assert "&" in str(err)


def test_mask_must_come_last():
  err = error_of("a = causal")
  assert isinstance(err, maskc.MaskSyntaxError)
  assert "last line must be the mask" in err.message
  err = error_of("causal\nsink(4)")
  assert "only the last line may be a mask" in err.message


def test_leading_operator_continues_the_line():
  m = maskc.parse("causal & chunk(4)\n  | bidirectional(img)")
  assert m == maskc.parse("causal & chunk(4) | bidirectional(img)")


def test_unexpected_newline_message_reads_well():
  """The operator at a line's end continues onto the next line, so the error is the stray
  `)` there, named as the token it is (never "unexpected a new line")."""
  text = "causal &\nchunk(4) )"
  err = error_of(text)
  assert isinstance(err, maskc.MaskSyntaxError)
  assert err.message == "unexpected `)`; expected `=`, a new line or `;` or the end"
  assert (err.line, err.column) == (2, 10)
  assert_points_at(err, text, ")", occurrence=1)
  assert str(err) == (f"{err.message} (line 2, column 10)\n\n"
                      "  chunk(4) )\n"
                      "           ^")  # no hint line
  assert err.hint is None
  assert "unexpected a new line" not in err.message


# ----------------------------------------------------------------------------- names


@pytest.mark.parametrize("text,wrong,guess", [
    ("causl & chunk(4)", "causl", "causal"),
    ("causal & chunck(4)", "chunck", "chunk"),
    ("slidng(4) | sink(4)", "slidng", "sliding"),
    ("causal | bidirectionl(img)", "bidirectionl", "bidirectional"),
    ("local = causal & chunk(4)\nlocl | sink(2)", "locl", "local"),
    ("docment(seg)", "docment", "document"),
])
def test_unknown_name_suggests_the_nearest(text, wrong, guess):
  err = error_of(text)
  assert isinstance(err, maskc.MaskNameError)
  assert isinstance(err, NameError)
  assert f"`{wrong}`" in err.message
  assert f"Did you mean `{guess}`?" in str(err)
  assert_points_at(err, text, wrong)


def test_unknown_name_without_a_near_match():
  """No name is near `zzzzzz`: the hint says how to define one instead of guessing."""
  err = error_of("zzzzzz(3)")
  assert isinstance(err, maskc.MaskNameError)
  assert err.message == "unknown function `zzzzzz`"
  assert err.hint == "Define it first: `name(a, b) = ...`."
  assert_points_at(err, "zzzzzz(3)", "zzzzzz")
  assert caret_columns(err) == (1, 6)
  assert str(err).splitlines()[-1] == err.hint
  assert "Did you mean" not in str(err)


def test_bare_operand_used_as_a_mask_hints_at_indexing():
  err = error_of("causal & img")
  assert isinstance(err, maskc.MaskNameError)
  assert "img[q]" in str(err)
  assert_points_at(err, "causal & img", "img")


@pytest.mark.parametrize("text,message,hint,token,occurrence", [
    ("q = causal; q", "`q` is a reserved name and cannot be defined", "Choose another name.",
     "q", 0),
    ("where = causal; where", "unexpected `where`; expected `(`, `-`, `~`, a name or a number",
     None, "where", 0),
    ("abs = causal; abs", "`abs` is a reserved name and cannot be defined",
     "Choose another name.", "abs", 0),
    ("f(q) = causal; f(1)", "parameter `q` of `f` is reserved or repeated",
     "Choose another parameter name.", "q", 0),
    ("f(a, a) = causal; f(1, 2)", "parameter `a` of `f` is reserved or repeated",
     "Choose another parameter name.", "a", 1),
])
def test_reserved_and_repeated_names(text, message, hint, token, occurrence):
  err = error_of(text)
  assert err.message == message
  assert err.hint == hint
  assert_points_at(err, text, token, occurrence)


def test_duplicate_definition():
  err = error_of("a = causal\na = sink(2)\na")
  assert isinstance(err, maskc.MaskNameError)
  assert "defined twice" in err.message
  assert err.line == 2


# ----------------------------------------------------------------------------- arity and types


@pytest.mark.parametrize("text,needle", [
    ("chunk(1, 2)", "takes 1 argument, got 2"),
    ("local(3)", "takes 2 arguments, got 1"),
    ("chunk", "takes 1 argument"),
    ("causal(3)", "takes 0 arguments, got 1"),
    ("sliding(w=3, w=4)", "given twice"),
    ("sliding(x=3)", "no parameter `x`"),
    ("runs(img)", "index it"),
    ("runs(img, seg)[q]", "runs takes 1 argument"),
    ("abs(q, k) < 3", "abs takes 1 argument"),
    ("min(q) < 3", "min takes 2 or more arguments"),
    ("q * k < 3", "needs a constant on one side"),
    ("q // k < 3", "constant divisor"),
    ("q % n < 3", "constant divisor"),
    ("q < true", "expected an integer term"),
    ("seg[q + k] == 1", "uses both q and k"),
    ("allowed[k, q]", "must be a term of `q` alone"),
    ("allowed[q, k, q]", "one or two indices"),
    ("seg[q] == seg[k] & k < seg", "both as a"),
    ("causal[q]", "only operands can be indexed"),
    ("q(3)", "not a function"),
    ("q - k", "expected a mask, got an integer term"),
])
def test_type_errors(text, needle):
  err = error_of(text)
  assert isinstance(err, (maskc.MaskTypeError, maskc.MaskNameError, maskc.OperandError)), err
  assert needle in str(err), str(err)
  assert err.line == 1 and err.column is not None


def test_index_of_both_positions_message_is_stable():
  """A per-token read indexed by both positions says so (not "must be a term of `q`
  alone", the pairwise operand's message), points at the index, and shows both ways to
  index an operand."""
  err = error_of("seg[q + k] == 1")
  assert isinstance(err, maskc.MaskTypeError)
  assert err.message == "the index of `seg` uses both q and k"
  assert_points_at(err, "seg[q + k] == 1", "q + k")
  assert caret_columns(err) == (5, 9)
  assert err.hint == ("A per-token operand is indexed by one position (`seg[q]`, `doc[k // 2]`); "
                      "a pairwise operand by a term of q and a term of k: `allowed[q, k]`.")
  assert str(err).splitlines()[-1] == err.hint
  assert "`q` alone" not in err.message and "`k` alone" not in err.message


@pytest.mark.parametrize("text,fix", [
    ("document(seg[q])", "`document(seg)`"),
    ("causal | bidirectional(img[k])", "`bidirectional(img)`"),
    ("f(x) = document(x) & causal; f(seg[q])", "`f(seg)`"),   # indexed by a callee
    ("f(a, s) = sliding(a) & s[q] == s[k]; f(4, doc[q // 2])", "`f(4, doc)`"),
])
def test_an_indexed_argument_where_a_name_belongs_hints_at_the_name(text, fix):
  err = error_of(text)
  assert isinstance(err, maskc.MaskTypeError)
  assert "so it takes an operand's name" in err.message
  assert err.hint == f"Pass the operand's name: {fix}."
  assert fix not in text  # not what was typed


def test_a_number_where_an_operand_name_belongs_is_refused():
  err = error_of("document(3)")
  assert isinstance(err, maskc.MaskTypeError)
  assert "`document` indexes its parameter `s`" in err.message


def test_arity_error_shows_the_signature():
  err = error_of("causal & local(3)")
  assert "local(left, right)" in str(err)
  assert_points_at(err, "causal & local(3)", "local")


def test_keyword_arguments():
  assert maskc.parse("local(left=2, right=1)") == maskc.local(2, 1)
  assert maskc.parse("local(2, right=1)") == maskc.local(2, 1)
  err = error_of("local(left=2, 1)")
  assert isinstance(err, maskc.MaskSyntaxError)


def test_mask_argument_where_a_number_belongs_points_at_the_call():
  text = "causal & chunk(causal)"
  err = error_of(text)
  assert isinstance(err, maskc.MaskTypeError)
  assert err.line == 1
  assert quoted_line(err) == text


def test_mask_argument_where_a_number_belongs_is_a_type_error():
  err = error_of("causal & chunk(causal)")
  assert isinstance(err, maskc.MaskTypeError)
  assert "expected an integer term" in err.message


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("text,token,needle", [
    ("causal & chunk(0) | bidirectional(img)", "chunk", "c >= 1, got chunk(0)"),
    ("sliding(-1)", "sliding", "w >= 1, got sliding(-1)"),
    ("sliding(0) | sink(4)", "sliding", "got sliding(0)"),
    ("causal & local(-1, 2)", "local", "left reach"),
    ("causal & local(1, -2)", "local", "right reach"),
    ("prefix(-3)", "prefix", "cannot be negative"),
    ("sink(-1)", "sink", "cannot be negative"),
    ("global(-2) | causal", "global", "cannot be negative"),
    ("q // 0 < k", "0", "division by zero"),
    ("q % 0 == 1", "0", "division by zero"),
    ("q < 99999999999999999", "99999999999999999", "out of range"),
])
def test_bad_values(text, token, needle):
  err = error_of(text)
  assert isinstance(err, maskc.MaskValueError)
  assert isinstance(err, ValueError)
  assert needle in err.message, str(err)
  assert_points_at(err, text, token)


def test_bad_value_through_a_parameter():
  err = error_of("causal & chunk(C)", C=0)
  assert isinstance(err, maskc.MaskValueError)
  assert "chunk(0)" in err.message


def test_user_requirements():
  text = 'band(w) = q - w < k <= q\n  where w >= 2 "a band is at least two wide"\nband(1)'
  err = error_of(text)
  assert isinstance(err, maskc.MaskValueError)
  assert "a band is at least two wide, got band(1)" in err.message
  np.testing.assert_array_equal(maskc.parse(text.replace("band(1)", "band(2)")).to_dense(8, 8),
                                maskc.parse("q - 2 < k <= q").to_dense(8, 8))


def test_bad_parameter_value():
  err = error_of("chunk(C)", C=2.5)
  assert isinstance(err, maskc.MaskTypeError)
  assert err.message == "parameter `C` must be an int, a mask or an operand name, got float 2.5"
  assert_points_at(err, "chunk(C)", "C")


def test_parse_needs_a_string():
  for value, kind in ((42, "int"), (b"causal", "bytes")):
    err = error_of(value)
    assert isinstance(err, maskc.MaskTypeError)
    assert str(err) == err.message == f"parse takes a str, got {kind}"  # no text to point at
    assert err.line is None and err.column is None


# ----------------------------------------------------------------------------- definitions


@pytest.mark.parametrize("text,cycle,token,occurrence", [
    ("a = a & causal; a", "a -> a", "a & causal", 0),
    ("a = b; b = a | causal; a", "a -> b -> a", "a | causal", 0),
    ("f(x) = g(x); g(x) = sliding(x) | f(x); f(2)", "f -> g -> f", "f(x)", 1),
])
def test_recursive_definitions(text, cycle, token, occurrence):
  """The cycle is named and the caret sits under the use that closes it."""
  err = error_of(text)
  assert isinstance(err, maskc.MaskRecursionError)
  assert err.message == f"recursive definition: {cycle}"
  assert err.hint == "A mask cannot be defined in terms of itself."
  assert err.line == 1
  assert_points_at(err, text, token, occurrence)


def test_undefined_function():
  err = error_of("causal & foo(3)")
  assert isinstance(err, maskc.MaskNameError)
  assert "unknown function `foo`" in err.message
  assert_points_at(err, "causal & foo(3)", "foo")


def test_definitions_may_come_in_any_order():
  text = "outer = inner | sink(1); inner = causal & chunk(4); outer"
  assert str(maskc.parse(text)).splitlines()[-1] == "outer"


# ----------------------------------------------------------------------------- limits


def test_huge_text():
  err = error_of("causal | " * 20_000 + "causal")
  assert isinstance(err, maskc.MaskLimitError)
  assert "limit" in err.message


@pytest.mark.parametrize("text", ["~" * 300 + "causal", "-" * 300 + "q < k",
                                  "q" + " + 1" * 600 + " < k",
                                  "(causal & " * 200 + "causal" + ")" * 200])
def test_deep_nesting(text):
  err = error_of(text)
  assert isinstance(err, maskc.MaskLimitError)
  assert err.message == "the mask nests deeper than 128 levels"
  assert err.hint == (
      "A run of `~` or `-` nests one level per operator; drop pairs that cancel."
      if text[0] in "~-" else
      "Long chains of `+` or `-` and deep brackets nest; name parts with definitions.")
  assert err.line == 1 and caret_columns(err)[0] >= 1
  assert len(str(err)) < SHORT_ERROR


def test_deep_brackets_alone_are_harmless():
  assert maskc.parse("(" * 300 + "causal" + ")" * 300) == maskc.causal()


def test_exponential_definitions():
  lines = ["a0 = causal | causal"] + [f"a{i} = a{i - 1} | a{i - 1}" for i in range(1, 40)]
  err = error_of("\n".join(lines + ["a39"]))
  assert isinstance(err, maskc.MaskLimitError)
  assert "expands" in err.message


def test_exponential_parameterized_definitions():
  lines = ["a0(x) = sliding(x) | sliding(x + 1)"] + [
      f"a{i}(x) = a{i - 1}(x) & a{i - 1}(x + 1)" for i in range(1, 40)]
  text = "; ".join(lines + ["a39(3)"])
  err = error_of(text)
  assert isinstance(err, maskc.MaskLimitError)
  assert err.message == "the mask expands to more than 50000 nodes"
  assert err.hint == "Definitions used many times multiply; simplify the mask."
  assert err.column == text.rindex("a39(3)") + 1  # the use that expands too far


# Errors quote the offending text with a window and a caret; whatever the input, they stay short.
SHORT_ERROR = 1500


def forbid_lark(monkeypatch):
  """Makes any use of the lark parser fail: a limit must answer before lark runs."""
  from maskc.language import parse as _parse

  def refuse():
    raise AssertionError("lark ran on a text the pre-scan should have refused")

  _parse._parse_cached.cache_clear()
  monkeypatch.setattr(_parse, "_parser", refuse)


@pytest.mark.parametrize("digits", [41, 4300, 4301, 5000, 90_000])
def test_huge_integer_literals_are_limit_errors(digits):
  text = "causal & q * " + "9" * digits + " < k"
  err = error_of(text)
  assert isinstance(err, maskc.MaskLimitError) and isinstance(err, maskc.MaskValueError)
  assert f"{digits} digits" in err.message and "limit is 40" in err.message
  assert (err.line, err.column) == (1, 14)
  assert len(str(err)) < SHORT_ERROR
  assert quoted_line(err).startswith("causal & q * 999")  # the caret window starts the line
  assert caret_columns(err)[0] == 14


@given(st.integers(41, 3000), st.integers(1, 5), st.sampled_from(["", "_"]))
def test_any_literal_past_40_digits_is_refused_at_its_position(digits, line, sep):
  """Law: an integer literal of more than 40 digits is a MaskLimitError pointing at it."""
  literal = sep.join(["7"] * digits)
  text = "".join(f"a{i} = causal\n" for i in range(line - 1)) + "q < " + literal
  err = error_of(text)
  assert isinstance(err, maskc.MaskLimitError)
  assert (err.line, err.column) == (line, 5)
  assert len(str(err)) < SHORT_ERROR


def test_literals_up_to_40_digits_keep_their_range_error():
  err = error_of("q < " + "9" * 40)
  assert type(err) is maskc.MaskValueError and "out of range" in err.message
  assert err.column == 5
  # Leading zeros are not digits of the value.
  assert maskc.parse("q < " + "0" * 100 + "5") == maskc.parse("q < 5")


def test_huge_integer_parameter_is_a_short_value_error():
  err = error_of("causal & k < C", C=10**5000)
  assert isinstance(err, maskc.MaskValueError) and "parameter `C`" in err.message
  assert len(str(err)) < SHORT_ERROR


def test_where_clause_on_literal_arguments_still_errors():
  text = 'band(w) = q - w < k <= q\n  where w >= 2 "a band is at least two wide"\n'
  err = error_of(text + "band(1) & causal")
  assert isinstance(err, maskc.MaskValueError)
  assert "a band is at least two wide, got band(1)" in err.message
  assert_points_at(err, text + "band(1) & causal", "band(1)")
  assert isinstance(error_of("sliding(0)"), maskc.MaskValueError)
  assert isinstance(error_of("chunk(-3)"), maskc.MaskValueError)
  err = error_of(text + "band(" + "1" * 50 + ")")
  assert isinstance(err, maskc.MaskLimitError) and "50 digits" in err.message


@pytest.mark.parametrize("text", [
    "(" * 60_000, "[" * 60_000, "([" * 30_000, "a" + "[(" * 30_000, "causal & " + "(" * 60_000,
    "(\n" * 30_000, "causal & # (((\n" + "((" * 30_000 + "q",
])
def test_deep_brackets_are_refused_before_lark(text, monkeypatch):
  from maskc.language.parse import MAX_BRACKET_DEPTH
  forbid_lark(monkeypatch)
  err = error_of(text)
  assert isinstance(err, maskc.MaskLimitError)
  assert f"deeper than {MAX_BRACKET_DEPTH}" in err.message
  code = re.sub(r"#[^\n]*", lambda m: " " * len(m.group()), text)  # comments do not count
  offset = [m.start() for m in re.finditer(r"[(\[]", code)][MAX_BRACKET_DEPTH]
  assert err.line == text.count("\n", 0, offset) + 1
  assert err.column == offset - (text.rfind("\n", 0, offset) + 1) + 1
  assert len(str(err)) < SHORT_ERROR


@pytest.mark.parametrize("text", ["~" * 60_000 + "causal", "q - " + "-" * 60_000 + "1 < k",
                                  "q < " + "- " * 40_000 + "k"])
def test_long_prefix_operator_runs_are_refused_before_lark(text, monkeypatch):
  forbid_lark(monkeypatch)
  err = error_of(text)
  assert isinstance(err, maskc.MaskLimitError) and "deeper than 128" in err.message
  assert len(str(err)) < SHORT_ERROR


@given(st.integers(1, 1500), st.sampled_from(["(", "[", "(["]))
def test_bracket_depth_law(depth, opens):
  """Law: brackets nested `depth` deep are refused iff depth > MAX_BRACKET_DEPTH, with the
  caret under the first bracket too deep."""
  from maskc.language.parse import MAX_BRACKET_DEPTH
  left = (opens * depth)[:depth]
  right = "".join(")" if c == "(" else "]" for c in reversed(left))
  text = "x" + left + "q" + right if "[" in opens else left + "causal" + right
  try:
    maskc.parse(text)
  except maskc.MaskError as e:
    too_deep = isinstance(e, maskc.MaskLimitError) and "brackets deeper" in e.message
    assert too_deep == (depth > MAX_BRACKET_DEPTH), str(e)[:300]
    if too_deep:
      assert e.column == text.index(left) + MAX_BRACKET_DEPTH + 1
  else:
    assert depth <= MAX_BRACKET_DEPTH


def test_brackets_in_comments_and_messages_do_not_count():
  text = "# " + "(" * 5000 + "\nw(n) = sliding(n) where n >= 1 \"" + "[" * 3000 + "\"\nw(2)"
  np.testing.assert_array_equal(maskc.parse(text).to_dense(8, 8),
                                maskc.sliding(2).to_dense(8, 8))


def test_error_on_a_long_line_quotes_a_window_with_the_caret():
  text = "causal & " * 9000 + "lokal"
  err = error_of(text)
  assert isinstance(err, maskc.MaskNameError) and err.column == len(text) - 4
  assert len(str(err)) < SHORT_ERROR
  line, caret = quoted_line(err), caret_columns(err)
  assert line.startswith("...") and line[caret[0] - 1:caret[1]] == "lokal"


def test_limit_errors_are_value_errors():
  assert issubclass(maskc.MaskLimitError, maskc.MaskValueError)
  assert issubclass(maskc.MaskLimitError, ValueError)


# ----------------------------------------------------------------------------- operands


def materialize_error(text, q_len, operands, **kw) -> maskc.MaskError:
  with pytest.raises(maskc.OperandError) as info:
    maskc.materialize(text, q_len, operands=operands, **kw)
  return info.value


def test_missing_operand():
  err = materialize_error("causal & document(seg)", 4, {})
  assert "`seg`" in err.message and "[L] or [B, L]" in err.message
  err = materialize_error("causal & k < kv_len", 4, {})
  assert "`kv_len`" in err.message and "[] or [B]" in err.message
  err = materialize_error("anc[q, k]", 4, {})
  assert "`anc`" in err.message and "[Lq, Lk]" in err.message


@pytest.mark.parametrize("text,name,value,needle", [
    ("document(seg)", "seg", np.zeros((2, 3, 4), int), "[L] or [B, L]"),
    ("document(seg)", "seg", np.zeros(3, int), "length 3"),
    ("document(seg)", "seg", np.zeros(4), "integers or booleans"),
    ("k < n", "n", np.zeros((2, 2), int), "[] or [B]"),
    ("allowed[q, k]", "allowed", np.zeros(4, bool), "[Lq, Lk]"),
    ("allowed[q, k]", "allowed", np.zeros((3, 4), bool), "length 3 on its first axis"),
    ("allowed[q, k]", "allowed", np.zeros((4, 3), bool), "length 3 on its second axis"),
    ("bidirectional(img)", "img", np.zeros(2, bool), "at least 4"),
])
def test_misshapen_operand(text, name, value, needle):
  err = materialize_error(text, 4, {name: value})
  assert f"`{name}`" in err.message
  assert needle in str(err), str(err)


def test_operands_disagree_on_batch():
  err = materialize_error("document(seg) & k < n", 4,
                          {"seg": np.zeros((2, 4), int), "n": np.array([1, 2, 3])})
  assert "batch" in err.message and "`seg`" in err.message and "`n`" in err.message


def test_negative_positions_cannot_read_operands():
  err = materialize_error("document(seg)", 4, {"seg": np.zeros(4, int)}, kv_len=2)
  assert "below 0" in str(err)


# ----------------------------------------------------------------------------- fuzzing

VALID = [
    "causal & chunk(8192) | bidirectional(img)",
    "local = causal & chunk(8192)\nstreaming(w, s) = sliding(w) | sink(s)\n"
    "local | bidirectional(img)",
    "abs(q // 8 - k // 8) <= 1 & abs(q % 8 - k % 8) <= 1",
    "k < P | anc[q, k]",
    "causal & (topk[q // 64, k // 64] | q // 64 == k // 64)",
    "runs(img)[q] == runs(img)[k] & img[q]",
    "local(left=2, right=1) ^ ~global(3)",
    'band(w) = q - w < k <= q\n  where w >= 1 "at least one"\nband(4) & document(seg)',
    "causal & q - k < 128 & k < kv_len",
    "min(q, k) >= max(0, q - 4) # a comment",
]
ALPHABET = "qk()[],;=<>!&|^~+-*/%#\n \t0123456789_abcdefghijklmnopqrstuvwxyz\"'.@$é"


def parse_or_mask_error(text: str) -> None:
  """Parses `text`; a short MaskError is fine, and a parsed mask must print and simplify."""
  try:
    m = maskc.parse(text)
  except maskc.MaskError as e:
    assert str(e) and len(str(e)) < SHORT_ERROR, str(e)[:300]
    return
  assert isinstance(m, maskc.Mask)
  assert maskc.parse(str(m)) == m
  m.simplify()
  _ = m.operands


@given(st.text(alphabet=ALPHABET, max_size=80))
def test_junk_text_raises_only_mask_errors(text):
  parse_or_mask_error(text)


@given(st.text(max_size=40))
def test_unicode_junk_raises_only_mask_errors(text):
  parse_or_mask_error(text)


@st.composite
def mutated_masks(draw):
  """A valid mask text with a few characters inserted, deleted or replaced."""
  text = draw(st.sampled_from(VALID))
  for _ in range(draw(st.integers(1, 4))):
    i = draw(st.integers(0, len(text)))
    c = draw(st.sampled_from(ALPHABET))
    edit = draw(st.sampled_from(["insert", "delete", "replace"]))
    if edit == "insert":
      text = text[:i] + c + text[i:]
    elif edit == "delete":
      text = text[:i] + text[i + 1:]
    else:
      text = text[:i] + c + text[i + 1:]
  return text


@given(mutated_masks())
def test_mutated_masks_raise_only_mask_errors(text):
  parse_or_mask_error(text)


@given(st.binary(max_size=300), st.sampled_from(["utf-8", "latin-1"]))
def test_random_bytes_raise_only_mask_errors(data, encoding):
  parse_or_mask_error(data.decode(encoding, errors="replace"))


@st.composite
def stretched_masks(draw):
  """A valid mask text with one character repeated thousands of times somewhere: runs of
  digits, brackets and operators, the fuzz classes of deep nesting and huge literals."""
  text = draw(st.sampled_from(VALID))
  i = draw(st.integers(0, len(text)))
  c = draw(st.sampled_from("9([~-+_ \n#" + ALPHABET[:20]))
  n = draw(st.integers(1, 20_000))
  return text[:i] + c * n + text[i:]


@given(stretched_masks())
def test_stretched_masks_raise_only_mask_errors(text):
  parse_or_mask_error(text)


@given(st.lists(st.sampled_from(VALID[:4] + ["(", ")", "&", "|", "~", "q", "<", "k", "\n"]),
                max_size=12))
def test_spliced_masks_raise_only_mask_errors(parts):
  parse_or_mask_error(" ".join(parts))


@pytest.mark.parametrize("text", VALID)
def test_valid_examples_parse(text):
  m = maskc.parse(text)
  assert maskc.parse(str(m)) == m
