"""The simplifier: an equivalent mask in a canonical form.

Folds constants, applies the identities of `full`/`empty`, idempotence,
absorption and complementation, removes double complements, pushes `~` to the
leaves (negating comparisons, De Morgan through `&`/`|`), and flattens and
sorts the operands of `&`, `|` and `^` by their canonical text, so masks equal
up to commutativity print and hash the same. Named masks stay as leaves.
"""

from __future__ import annotations

import functools
from typing import cast

from maskc.language import (
  ir,
  printer,  # noqa: F401  (`_key` sorts by `str`, which the printer gives)
)
from maskc.language.parse import prelude


def _full() -> ir.Mask:
  return cast(ir.Mask, ir.call(prelude()["full"], ()))  # a mask's definition makes a Call


def _empty() -> ir.Mask:
  return cast(ir.Mask, ir.call(prelude()["empty"], ()))


def _const(m: ir.Mask) -> bool | None:
  if isinstance(m, ir.BoolConst):
    return m.value
  if isinstance(m, ir.Call) and m.definition.prelude and m.name in ("full", "empty"):
    return m.name == "full"
  return None


def _key(m: ir.Mask) -> str:
  return str(m)


@functools.lru_cache(maxsize=4096)
def simplify(m: ir.Mask) -> ir.Mask:
  """An equivalent, canonical mask (see the module docstring)."""
  out = _simplify(m, negate=False)
  c = _const(out)
  if c is not None:
    return _full() if c else _empty()
  return out


def _simplify(m: ir.Mask, negate: bool) -> ir.Mask:
  if isinstance(m, ir.Not):
    return _simplify(m.item, not negate)
  c = _const(m) if not isinstance(m, ir.Compare) else ir.const_truth(m)
  if c is not None:
    return ir.BoolConst(c != negate)
  if isinstance(m, ir.Compare):
    if not negate:
      return m
    if len(m.ops) == 1:
      return ir.compare(m.terms, (ir.NEGATED_OP[m.ops[0]],))
    links = [_simplify(ir.compare(m.terms[i:i + 2], (ir.NEGATED_OP[op],)), False)
             for i, op in enumerate(m.ops)]
    return _combine(ir.Or, links)
  if isinstance(m, (ir.And, ir.Or)):
    cls = type(m)
    if negate:
      cls = ir.Or if cls is ir.And else ir.And
    return _combine(cls, [_simplify(i, negate) for i in m.items])
  if isinstance(m, ir.Xor):
    items = [_simplify(i, False) for i in m.items]
    return _xor(items, negate)
  # Leaves: named masks, operand truths.
  return ir.Not(m) if negate else m


def _complement(m: ir.Mask) -> ir.Mask:
  return _simplify(m, True)


def _parts(item: ir.Mask, dual) -> tuple[ir.Mask, ...]:
  """The operands of `item` under the dual operation (a chain's links under `&`)."""
  if type(item) is dual:
    return tuple(p for child in cast(ir.And | ir.Or, item).items for p in _parts(child, dual))
  if dual is ir.And and isinstance(item, ir.Compare) and len(item.ops) > 1:
    return tuple(_simplify(ir.compare(item.terms[i:i + 2], (op,)), False)
                 for i, op in enumerate(item.ops))
  return (item,)


def _combine(cls, items: list[ir.Mask]) -> ir.Mask:
  absorbing = cls is ir.Or  # true absorbs a union, false an intersection
  dual = ir.And if cls is ir.Or else ir.Or
  flat: list[ir.Mask] = []
  for it in items:
    if type(it) is cls:
      flat.extend(cast(ir.And | ir.Or, it).items)
    else:
      flat.append(it)
  unique: dict[ir.Mask, None] = {}
  for it in flat:
    c = _const(it)
    if c is not None:
      if c == absorbing:
        return ir.BoolConst(absorbing)
      continue  # identity element
    unique[it] = None
  members = set(unique)
  parts = {it: frozenset(_parts(it, dual)) for it in unique}
  for it in unique:
    # x | ~x = true and x & ~x = false, also for compound x: (a & b) | ~a | ~b.
    if all(_complement(p) in members for p in parts[it]):
      return ir.BoolConst(absorbing)
  # Absorption: a | (a & b) = a, also (a & b) | (a & b & c) = a & b.
  kept = [it for it in unique if not any(other != it and parts[other] < parts[it]
                                         for other in unique)]
  if not kept:
    return ir.BoolConst(not absorbing)
  if len(kept) == 1:
    return kept[0]
  return cls(tuple(sorted(kept, key=_key)))


def _positive(m: ir.Mask) -> tuple[ir.Mask, bool]:
  """`m` as (a canonical polarity, whether it was complemented to get there)."""
  if isinstance(m, ir.Not):
    return m.item, True
  if isinstance(m, ir.Compare) and len(m.ops) == 1 and m.ops[0] in (">=", ">", "!="):
    return ir.compare(m.terms, (ir.NEGATED_OP[m.ops[0]],)), True
  return m, False


def _is_leaf(m: ir.Mask) -> bool:
  return isinstance(m, (ir.Call, ir.Truth)) or (isinstance(m, ir.Compare) and len(m.ops) == 1)


def _xor(items: list[ir.Mask], negate: bool) -> ir.Mask:
  flat: list[ir.Mask] = []
  for it in items:
    if isinstance(it, ir.Xor):
      flat.extend(it.items)
    else:
      flat.append(it)
  parity = negate
  counts: dict[ir.Mask, int] = {}
  for it in flat:
    c = _const(it)
    if c is not None:
      parity ^= c
      continue
    it, flipped = _positive(it)
    parity ^= flipped
    counts[it] = counts.get(it, 0) + 1
  kept = sorted((it for it, n in counts.items() if n % 2), key=_key)
  if not kept:
    return ir.BoolConst(parity)
  if parity:
    # Complement the first leaf (its positive form sorts the same on the next pass,
    # so simplify stays idempotent); with no leaf, keep the parity as a `full` term.
    leaf = next((n for n, it in enumerate(kept) if _is_leaf(it)), None)
    if leaf is None:
      kept.append(_full())
    else:
      kept[leaf] = _complement(kept[leaf])
  return kept[0] if len(kept) == 1 else ir.Xor(tuple(kept))


ir.install(simplify=simplify)
