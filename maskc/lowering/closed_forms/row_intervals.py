"""Rule `row_intervals`: one interval of keys per row, proved from a mask's IR:
`BlockMap.key_intervals()`'s form.

The same facts the closed forms rest on: bands of `q - k` (`exact_band`,
`maskc.analysis.linear`), chunks, equal reads of runs (`equal_reads`, the body of
`bidirectional(x)` found by `same_run_read`), and masks of one position. Each part of
the mask becomes a part of a `maskc.compiled.intervals` form, which states per row an
interval that holds every allowed key, and whether it holds only those; `&` meets
intervals and `|` joins them, exactly where the joined intervals share a key (see that
module). A mask, or a part, that none of these describes is every key: sound, never
exact. Nothing here reads an operand value; `contiguous` names the operands whose
ids are declared to be one run per value (checked on static values by the caller).
An interval rule (step "intervals"): `maskc.lowering.compile` asks it for every map built
on consecutive positions.
"""

from __future__ import annotations

import functools
from typing import cast

from maskc.analysis.linear import conjuncts, exact_band, implied_chunk, linear_form
from maskc.compiled import intervals as iv
from maskc.compiled.predicate_compiler import compile_predicate
from maskc.language import ir
from maskc.lowering.closed_forms.equal_reads import equal_reads
from maskc.lowering.rules import Rule
from maskc.semantics.ranges import same_run_read


@functools.lru_cache(maxsize=256)
def key_intervals(m: ir.Mask, contiguous: frozenset[str] = frozenset()) -> iv.KeyIntervals:
  """The interval form of `m` (`maskc.compiled.intervals.KeyIntervals`); `contiguous`:
  operand names whose every value is one run of each batch row."""
  return iv.KeyIntervals(_form(m, contiguous), str(m))


def _form(m: ir.Mask, contiguous: frozenset[str]) -> iv.Form:
  if isinstance(m, ir.Call):
    return _form(ir.expand(m), contiguous)
  if isinstance(m, ir.BoolConst) and m.value:
    return iv.Band(None, None)
  at = ir.positions_of(m)
  if "k" not in at:
    return iv.Rows(compile_predicate(m, facts=False))
  if at == {"k"}:
    return _keys(m)
  if isinstance(m, ir.And):
    return _meet(m.items, contiguous)
  if isinstance(m, ir.Or):
    return iv.Join(tuple(_form(x, contiguous) for x in m.items))
  if isinstance(m, ir.Compare):
    return _compare(m, contiguous)
  return iv.Anything()


def _meet(items: tuple[ir.Mask, ...], contiguous: frozenset[str]) -> iv.Form:
  """An `&`: `runs(x)[a] == runs(x)[b]` beside `x[a]` or `x[b]` as one gated block, each
  other item on its own."""
  flat = [x for item in items for x in conjuncts(item)]
  used: set[int] = set()
  parts: list[iv.Form] = []
  for i, eq in enumerate(flat):
    for j, w in enumerate(flat):
      if i in used or j in used or i == j or same_run_read(eq, w) is None:
        continue
      found = equal_reads(eq)
      if found is None:
        continue
      array, s, t = found
      read = cast(ir.Read, cast(ir.Truth, w).read)
      parts.append(iv.Block(array, s, t, gate=ir.array_key(read), one_run=True))
      used |= {i, j}
  parts += [_form(x, contiguous) for n, x in enumerate(flat) if n not in used]
  bands = [p for p in parts if isinstance(p, iv.Band)]
  if len(bands) > 1:  # bands meet in one band (`k <= q & q - k < 3`)
    lo = max((b.lo for b in bands if b.lo is not None), default=None)
    hi = min((b.hi for b in bands if b.hi is not None), default=None)
    parts = [iv.Band(lo, hi)] + [p for p in parts if not isinstance(p, iv.Band)]
  return parts[0] if len(parts) == 1 else iv.Meet(tuple(parts))


def _compare(m: ir.Compare, contiguous: frozenset[str]) -> iv.Form:
  """A chain of comparisons, link by link: bands, chunks, equal reads, masks of one
  position."""
  band = exact_band(m)
  if band is not None:
    return iv.Band(*band)
  links: list[iv.Form] = []
  for op, a, b in zip(m.ops, m.terms, m.terms[1:]):
    link = ir.Compare((a, b), (op,))
    found = equal_reads(link)
    band = exact_band(link)
    chunk = implied_chunk([link])
    at = ir.positions_of(link)
    if band is not None:
      links.append(iv.Band(*band))
    elif chunk is not None:
      links.append(iv.Chunk(chunk))
    elif found is not None:
      array, s, t = found
      links.append(iv.Block(array, s, t, one_run=_name(array) in contiguous))
    elif "k" not in at:
      links.append(iv.Rows(compile_predicate(link, facts=False)))
    elif at == {"k"}:
      links.append(_keys(link))
    else:
      links.append(iv.Anything())
  return links[0] if len(links) == 1 else iv.Meet(tuple(links))


def _name(array: str) -> str:
  """The operand an array key belongs to (`runs(x)` → x)."""
  return array[5:-1] if ir.is_run_ids_key(array) else array


def _keys(m: ir.Mask) -> iv.Keys:
  """A mask of `k` alone; an interval where it is an `&` of comparisons of `k + c` with
  terms free of `k` (`k < n`, `2 <= k < kv_len`)."""
  pred = compile_predicate(m, facts=False)
  found = iv.ANCHORS
  for item in conjuncts(m):
    if not isinstance(item, ir.Compare):
      return iv.Keys(pred)
    for op, a, b in zip(item.ops, item.terms, item.terms[1:]):
      side = _key_side(op, a, b)
      if side is None:
        return iv.Keys(pred)
      found = found & side
  return iv.Keys(pred, True, found & {"first", "last"})


def _key_side(op: str, a: ir.Term, b: ir.Term) -> frozenset[str] | None:
  """The anchors of the keys where `a op b` holds, when they are one interval: one side
  `k + c` (or `c - k`), the other free of `k`, `op` no `!=`; else None."""
  if op == "!=":
    return None
  for x, y, flip in ((a, b, False), (b, a, True)):
    if "k" in ir.positions_of(y):
      continue
    form = linear_form(x)
    if form is None or form[0] != 0 or abs(form[1]) != 1:
      continue
    if op == "==":
      return frozenset()
    below = op in ("<", "<=")  # x below y
    if flip:
      below = not below
    if form[1] < 0:
      below = not below
    return frozenset({"first"}) if below else frozenset({"last"})
  return None


ROW_INTERVALS = Rule(
    "row_intervals", "one interval of keys per row for `bm.key_intervals()`, proved from "
    "bands, chunks, runs of equal reads and masks of one position "
    "(maskc.lowering.closed_forms.row_intervals)", "intervals", "intervals", exact=True,
    lower=key_intervals)
