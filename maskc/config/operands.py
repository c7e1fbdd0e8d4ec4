"""A config's runtime operands: `operands:` declarations, and the check that the masks read
exactly what is declared, each operand as the kind it is declared."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from maskc.config.files import key_path
from maskc.config.params import Params
from maskc.config.texts import MaskTexts, Parsed
from maskc.config.where import Where, check_name, did_you_mean, shown
from maskc.language import ir
from maskc.language.errors import ConfigError, MaskError, Span, config_where, short_repr

# The kinds `kind:` accepts, by their spellings.
KINDS = {"token": "token", "per_token": "token", "per-token": "token", "scalar": "scalar",
         "pair": "pair", "pairwise": "pair"}
SHAPES = {"token": "[L] or [B, L]", "scalar": "[] or [B]", "pair": "[Lq, Lk] or [B, Lq, Lk]"}


@dataclasses.dataclass(frozen=True)
class OperandDecl:
  """A runtime operand a config's masks read, as declared under `operands:`.

  Attributes:
    name: the operand's name in the mask text.
    kind: "token" (shape `[L]` or `[B, L]`), "scalar" (`[]` or `[B]`) or "pair"
      (`[Lq, Lk]` or `[B, Lq, Lk]`).
    dtype: a NumPy dtype name, `int32` or `bool` when not declared.
  """
  name: str
  kind: str
  dtype: str

  @property
  def shape(self) -> str:
    """The accepted shapes, as text."""
    return SHAPES[self.kind]


@dataclasses.dataclass(frozen=True)
class Declared:
  """An operand as `operands:` declares it: its kind, its dtype if given, and where."""
  kind: str
  dtype: str | None
  path: str


def read_operands(data: Mapping[str, Any], params: Params,
                  where: Where) -> dict[str, Declared]:
  """The `operands:` mapping: each name to a kind, or to `{kind, dtype, doc}`."""
  raw = data.get("operands")
  if raw is None:
    return {}
  base = where.path("operands")
  if not isinstance(raw, Mapping):
    raise where.error(f"operands must be a mapping of names to kinds, got "
                      f"{type(raw).__name__}", base,
                      hint="operands: {seg: {kind: token, dtype: int32}, prompt_len: scalar}")
  out = {}
  for name, spec in raw.items():
    p = key_path(base, name)
    check_name(where, name, p, "operand")
    if name in params.values:
      raise where.error(f"`{name}` is both a parameter and an operand", p,
                        hint="A parameter is fixed when the config loads; an operand is an "
                             "array the model passes. Keep one.")
    dtype = None
    kind_path = p
    if isinstance(spec, str):
      kind = spec
    elif isinstance(spec, Mapping):
      for key in spec:
        if key not in ("kind", "dtype", "doc"):
          raise where.error(f"unknown key `{shown(key)}` in operand `{name}`",
                            key_path(p, str(key)),
                            hint=did_you_mean(key, ("kind", "dtype", "doc"))
                            + "An operand has `kind`, `dtype` and `doc`.")
      if "kind" not in spec:
        raise where.error(f"operand `{name}` needs a kind", p,
                          hint="kind: token (per token), scalar or pair (pairwise).")
      kind, dtype, kind_path = spec["kind"], spec.get("dtype"), key_path(p, "kind")
    else:
      raise where.error(f"operand `{name}` must be a kind or a mapping, got "
                        f"{short_repr(spec)}", p, hint=f"{name}: {{kind: token, dtype: int32}}")
    if not isinstance(kind, str) or kind not in KINDS:
      raise where.error(f"operand `{name}` has unknown kind {short_repr(kind)}", kind_path,
                        hint=did_you_mean(kind, KINDS)
                        + "Kinds are token (per token, [L] or [B, L]), scalar ([] or [B]) "
                          "and pair (pairwise, [Lq, Lk] or [B, Lq, Lk]).")
    if dtype is not None:
      try:
        dt = np.dtype(dtype) if isinstance(dtype, str) else None
      except (TypeError, ValueError, SyntaxError):
        dt = None
      if dt is None or not (np.issubdtype(dt, np.integer) or dt == np.bool_):
        raise where.error(f"operand `{name}` has dtype {short_repr(dtype)}; operands hold "
                          f"integers or booleans", key_path(p, "dtype"),
                          hint="dtype: int32 or dtype: bool.")
      dtype = dt.name
    out[name] = Declared(KINDS[kind], dtype, p)
  return out


def check_operands(texts: MaskTexts, declared: dict[str, Declared],
                   where: Where) -> tuple[tuple[OperandDecl, ...], list[str]]:
  """Every operand the masks read is declared, as the kind they read it; returns the
  declarations (dtypes filled in: `bool` where a mask reads it as a mask) and warnings
  for those no mask reads."""
  used: dict[str, bool] = {}
  used_names = {s.name for parsed in texts.parsed.values() for s in parsed.mask.operands}
  for parsed in texts.parsed.values():
    for spec in parsed.mask.operands:
      decl = declared.get(spec.name)
      if decl is None:
        raise _operand_error(
            texts, parsed, spec.name, f"the mask reads operand `{spec.name}` as a {spec.kind} "
            f"operand, but the config does not declare it",
            hint=(did_you_mean(spec.name, [d for d in declared if d not in used_names])
                  + f"Declare it: `operands: {{{spec.name}: {{kind: {spec.kind}, dtype: "
                  f"{'bool' if spec.boolean else 'int32'}}}}}`. If `{spec.name}` is a "
                  f"parameter, set it under `params:` or pass "
                  f"`load_config(..., {spec.name}=...)`."))
      if decl.kind != spec.kind:
        raise _operand_error(
            texts, parsed, spec.name, f"operand `{spec.name}` is declared as a {decl.kind} "
            f"operand ({decl.path}) but the mask reads it as a {spec.kind} operand",
            hint=f"Declare `{spec.name}` with kind: {spec.kind}, or index it as a {decl.kind} "
                 f"operand.")
      used[spec.name] = used.get(spec.name, False) or spec.boolean
  out, warnings = [], []
  for name, decl in sorted(declared.items()):
    if name not in used:
      warnings.append(f"operand `{name}` is declared ({config_where(where.file, decl.path)}) "
                      f"but no layer's mask reads it")
    out.append(OperandDecl(name, decl.kind, decl.dtype or ("bool" if used.get(name) else "int32")))
  return tuple(out), warnings


def _operand_error(texts: MaskTexts, parsed: Parsed, name: str, message: str,
                   hint: str) -> MaskError:
  """A `ConfigError` with a caret under the first read of operand `name` in the mask."""
  span = None
  for into_calls in (False, True):
    for n in ir.walk(parsed.mask, into_calls=into_calls):
      nm = getattr(n, "name", None) if isinstance(n, (ir.Operand, ir.Scalar)) else (
          n.operand.name if isinstance(n, (ir.Read, ir.PairRead)) else None)
      s = getattr(n, "span", None)
      if nm == name and s is not None and s.text == parsed.program:
        span = s if span is None or s.start < span.start else span
    if span is not None:
      break
  if span is None:
    # Expansions of calls are cached across texts (spans aside, equal calls are one), so a
    # read inside a named mask may carry the span of another text that used it first.
    span = _first_use(parsed.program, name)
  err = ConfigError(message, path=parsed.path, file=texts.where.file, span=span, hint=hint)
  if span is None:
    return err
  return texts.relocate(err, parsed.program, parsed.segments, parsed.path)


def _first_use(program: str, name: str) -> Span | None:
  """The first place `name` stands as a word in `program`, comments aside."""
  text = re.sub(r"#[^\n]*", lambda m: " " * len(m.group()), program)
  m = re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text)
  if m is None:
    return None
  line = program.count("\n", 0, m.start()) + 1
  column = m.start() - (program.rfind("\n", 0, m.start()) + 1) + 1
  return Span(line, column, m.start(), m.end(), program)
