"""Compiling a mask into a `Predicate`: the program and read table kernels evaluate.

Every definition is expanded, equal subterms are computed once (IR nodes are
hashable data), and each operand read lands in the table of its kind (see
`maskc._predicate`). The structural facts are read off the mask's conjunction
after expansion, so `causal & s[q] == s[k]`, `document(s) & causal` and a
user's definition wrapping `document(s)` all give the same segment fact.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from maskc import _ir as ir
from maskc._predicate import Instr, PairwiseRead, Predicate, Program, TokenRead, run


def compile_predicate(m: ir.Mask, *, q_positions: np.ndarray | None = None,
                      kv_len: int | None = None, block_q: int = 1, block_kv: int = 1,
                      facts: bool = True, kv_positions: np.ndarray | None = None,
                      positions_read: bool = False) -> Predicate:
  """The compiled predicate of `m`.

  Args:
    m: the mask.
    q_positions: static query positions, when known: a pairwise read whose
      indices are constant on every `block_q × block_kv` tile becomes a
      per-tile read (`tile_pairs`).
    kv_len: the number of key columns (with `q_positions`).
    block_q, block_kv: the tile sizes.
    facts: also find segment equalities, the `q - k` band and a chunk size.
    kv_positions: static key positions, when they are not `0..kv_len-1`.
    positions_read: rows and columns are at explicit positions (not `q_offset + row`
      and `col`): every bare `q` and `k` becomes a per-token read of the position
      itself (`TokenRead` with no array), gathered at the given positions like any
      other read, so kernels that feed `q` with `q_offset + row` need no change. No
      band or chunk fact is recorded then (they are facts about rows and columns).
  """
  tiles = None
  if q_positions is not None and kv_len is not None:
    k_pos = (np.arange(kv_len, dtype=np.int64) if kv_positions is None
             else np.asarray(kv_positions, np.int64))
    tiles = (np.asarray(q_positions, np.int64), k_pos, block_q, block_kv)
  c = _Compiler(tiles, positions_read)
  out = c.mask(m)
  program = c.finish(out)
  if not facts:
    return Predicate(program, tuple(c.q_reads), tuple(c.k_reads), tuple(c.scalars),
                     tuple(c.pairs), tuple(c.tile_pairs), text=str(m))
  items = conjuncts(m)
  segments, rest = [], []
  for item in items:
    seg = segment_conjunct(item)
    if seg is None:
      rest.append(item)
      continue
    qs = c.token_slot(seg[0], "q")
    ks = c.token_slot(seg[1], "k")
    segments.append((qs, ks))
  band, chunk = ((None, None), None) if positions_read else (_band(items), _chunk(items))
  rest_pred = None
  if segments:
    rest_mask = ir.and_(rest) if rest else ir.BoolConst(True)
    rest_pred = compile_predicate(rest_mask, q_positions=q_positions, kv_len=kv_len,
                                  block_q=block_q, block_kv=block_kv, facts=False,
                                  kv_positions=kv_positions, positions_read=positions_read)
  return Predicate(program, tuple(c.q_reads), tuple(c.k_reads), tuple(c.scalars),
                   tuple(c.pairs), tuple(c.tile_pairs), tuple(segments), rest_pred, band, chunk,
                   str(m))


def conjuncts(m: ir.Mask) -> list[ir.Mask]:
  """The items of `m` as a conjunction, with definitions expanded (`a & (b & c)` → a, b, c)."""
  if isinstance(m, ir.Call):
    return conjuncts(ir.expand(m))
  if isinstance(m, ir.And):
    return [x for item in m.items for x in conjuncts(item)]
  return [m]


class _Compiler:
  """Emits instructions, one per distinct IR node, and fills the read tables."""

  def __init__(self, tiles, positions_read: bool = False):
    self.tiles = tiles
    self.positions_read = positions_read
    self.program: list[Instr] = []
    self.memo: dict[Any, int] = {}
    self.q_reads: list[TokenRead] = []
    self.k_reads: list[TokenRead] = []
    self.scalars: list[str] = []
    self.pairs: list[PairwiseRead] = []
    self.tile_pairs: list[PairwiseRead] = []

  def finish(self, out: int) -> Program:
    prog = self.program
    if out != len(prog) - 1:
      prog = prog + [Instr("and", (out,))]
    return tuple(prog)

  def emit(self, key, ins: Instr) -> int:
    if key in self.memo:
      return self.memo[key]
    self.program.append(ins)
    self.memo[key] = len(self.program) - 1
    return self.memo[key]

  def scalar_slot(self, name: str) -> int:
    if name not in self.scalars:
      self.scalars.append(name)
    return self.scalars.index(name)

  # ------------------------------------------------------------------ reads

  def index_program(self, t: ir.Term) -> Program:
    """A program computing index term `t` from `pos` (its one position) and scalars."""
    sub = _Compiler(None)
    sub.scalars = self.scalars                     # scalar slots are shared
    out = sub.term(t, index=True)
    return sub.finish(out)

  def token_slot(self, r: ir.Read, side: str) -> int:
    array = ir.array_key(r)
    read = TokenRead(array, self.index_program(r.index), str(r))
    table = self.q_reads if side == "q" else self.k_reads
    if read not in table:
      table.append(read)
    return table.index(read)

  def position_read(self, axis: str) -> Instr:
    """The position of a row (`q`) or column (`k`) as a per-token read of no array."""
    read = TokenRead("", (Instr("pos"),), axis)
    table = self.q_reads if axis == "q" else self.k_reads
    if read not in table:
      table.append(read)
    return Instr(f"{axis}_read", (), table.index(read))

  def read(self, r: ir.Read) -> Instr:
    side = "k" if "k" in ir.positions_of(r.index) else "q"
    return Instr(f"{side}_read", (), self.token_slot(r, side))

  def pair_read(self, r: ir.PairRead) -> Instr:
    read = PairwiseRead(r.operand.name, self.index_program(r.q_index),
                        self.index_program(r.k_index), str(r))
    table, kind = self.pairs, "pair"
    if self._tile_constant(read):
      table, kind = self.tile_pairs, "tile_pair"
    if read not in table:
      table.append(read)
    return Instr(kind, (), table.index(read))

  def _tile_constant(self, read: PairwiseRead) -> bool:
    """Whether both indices of a pairwise read are constant on every tile (static shapes)."""
    if self.tiles is None or read.q_index is None:
      return False
    q_pos, k_pos, bq, bk = self.tiles
    if any(i.op == "scalar" for i in read.q_index + read.k_index):
      return False
    for prog, pos, block in ((read.q_index, q_pos, bq), (read.k_index, k_pos, bk)):
      if block == 1:
        continue
      idx = np.broadcast_to(run(prog, np, pos, None, None), pos.shape).astype(np.int64)
      first = np.repeat(idx[::block], block)[:idx.size]
      if not np.array_equal(idx, first):
        return False
    return True

  # ------------------------------------------------------------------ terms and masks

  def term(self, t: ir.Term, index: bool = False) -> int:
    key = ("t", t)
    if key in self.memo:
      return self.memo[key]
    if isinstance(t, ir.Const):
      return self.emit(key, Instr("const", (), int(t.value)))
    if isinstance(t, ir.Pos):
      if self.positions_read and not index:
        return self.emit(key, self.position_read(t.axis))
      return self.emit(key, Instr("pos" if index else t.axis))
    if isinstance(t, ir.Scalar):
      return self.emit(key, Instr("scalar", (), self.scalar_slot(t.name)))
    if isinstance(t, ir.Read):
      return self.emit(key, self.read(t))
    if isinstance(t, ir.PairRead):
      return self.emit(key, self.pair_read(t))
    if isinstance(t, ir.Neg):
      return self.emit(key, Instr("neg", (self.term(t.arg, index),)))
    if isinstance(t, ir.Arith):
      op = {"+": "add", "-": "sub", "*": "mul", "//": "floordiv", "%": "mod"}[t.op]
      return self.emit(key, Instr(op, (self.term(t.lhs, index), self.term(t.rhs, index))))
    if isinstance(t, ir.Fn):
      return self.emit(key, Instr(t.name, tuple(self.term(a, index) for a in t.args)))
    if isinstance(t, ir.Call):
      return self.term(ir.expand(t), index)
    raise TypeError(f"cannot compile term {type(t).__name__}")

  def mask(self, m: ir.Mask) -> int:
    key = ("m", m)
    if key in self.memo:
      return self.memo[key]
    if isinstance(m, ir.BoolConst):
      return self.emit(key, Instr("true" if m.value else "false"))
    if isinstance(m, ir.Call):
      return self.mask(ir.expand(m))
    if isinstance(m, ir.Compare):
      vals = [self.term(t) for t in m.terms]
      links = [self.emit(("c", op, a, b), Instr(_OPS[op], (a, b)))
               for op, a, b in zip(m.ops, vals, vals[1:])]
      return links[0] if len(links) == 1 else self.emit(key, Instr("and", tuple(links)))
    if isinstance(m, ir.Truth):
      return self.emit(key, Instr("nonzero", (self.term(m.read),)))
    if isinstance(m, ir.Not):
      return self.emit(key, Instr("not", (self.mask(m.item),)))
    for cls, op in ((ir.And, "and"), (ir.Or, "or"), (ir.Xor, "xor")):
      if isinstance(m, cls):
        return self.emit(key, Instr(op, tuple(self.mask(i) for i in m.items)))
    raise TypeError(f"cannot compile mask {type(m).__name__}")


_OPS = {"<": "lt", "<=": "le", "==": "eq", "!=": "ne", ">=": "ge", ">": "gt"}


# ----------------------------------------------------------------------------- facts


def segment_conjunct(m: ir.Mask) -> tuple[ir.Read, ir.Read] | None:
  """`(read at q, read at k)` when `m` is `s[q] == s[k]` (either order), else None."""
  if not (isinstance(m, ir.Compare) and m.ops == ("==",)):
    return None
  a, b = m.terms
  if not (isinstance(a, ir.Read) and isinstance(b, ir.Read)):
    return None
  if a.operand.name != b.operand.name or a.runs != b.runs:
    return None
  if not (isinstance(a.index, ir.Pos) and isinstance(b.index, ir.Pos)):
    return None
  if {a.index.axis, b.index.axis} != {"q", "k"}:
    return None
  return (a, b) if a.index.axis == "q" else (b, a)


def linear_form(t: ir.Term) -> tuple[int, int, int] | None:
  """`(cq, ck, c)` with `t = cq*q + ck*k + c`, or None when `t` is not of that form."""
  if isinstance(t, ir.Const):
    return 0, 0, int(t.value)
  if isinstance(t, ir.Pos):
    return (1, 0, 0) if t.axis == "q" else (0, 1, 0)
  if isinstance(t, ir.Neg):
    a = linear_form(t.arg)
    return None if a is None else (-a[0], -a[1], -a[2])
  if isinstance(t, ir.Arith) and t.op in "+-":
    a, b = linear_form(t.lhs), linear_form(t.rhs)
    if a is None or b is None:
      return None
    s = 1 if t.op == "+" else -1
    return a[0] + s * b[0], a[1] + s * b[1], a[2] + s * b[2]
  if isinstance(t, ir.Arith) and t.op == "*":
    a, b = linear_form(t.lhs), linear_form(t.rhs)
    if a is None or b is None:
      return None
    if a[:2] == (0, 0):
      return b[0] * a[2], b[1] * a[2], b[2] * a[2]
    if b[:2] == (0, 0):
      return a[0] * b[2], a[1] * b[2], a[2] * b[2]
  return None


def _band(items: list[ir.Mask]) -> tuple[int | None, int | None]:
  """The tightest `lo <= q - k <= hi` implied by comparisons among the conjuncts."""
  lo, hi = None, None
  for m in items:
    if not isinstance(m, ir.Compare):
      continue
    for op, a, b in zip(m.ops, m.terms, m.terms[1:]):
      bounds = _pair_bound(op, a, b)
      if bounds is not None:
        lo, hi = _tighter((lo, hi), bounds)
  return lo, hi


@functools.lru_cache(maxsize=1024)
def exact_band(m: ir.Mask) -> tuple[int | None, int | None] | None:
  """`(lo, hi)` where `m` is exactly `lo <= q - k <= hi` (either may be None: unbounded),
  every conjunct a comparison of `q - k` with constants (`causal`, `sliding(w)`,
  `local(l, r)`); else None. Remembered: lowering asks it of each part of a mask.

  >>> import maskc
  >>> [exact_band(maskc.parse(t)) for t in ["causal", "sliding(8)", "causal & k > q - 4",
  ...                                       "causal & chunk(4)", "q - k != 2"]]
  [(0, None), (0, 7), (0, 3), None, None]
  """
  band = (None, None)
  for item in conjuncts(m):
    if not isinstance(item, ir.Compare):
      return None
    for op, a, b in zip(item.ops, item.terms, item.terms[1:]):
      bounds = _pair_bound(op, a, b)
      if bounds is None:
        return None
      band = _tighter(band, bounds)
  return band


def _pair_bound(op: str, a: ir.Term, b: ir.Term) -> tuple[int | None, int | None] | None:
  """The bounds `(lo, hi)` on `q - k` that `a op b` states, or None where it is no such
  bound."""
  la, lb = linear_form(a), linear_form(b)
  if la is None or lb is None:
    return None
  cq, ck, c = la[0] - lb[0], la[1] - lb[1], la[2] - lb[2]   # lhs - rhs = s*d + c
  if cq == 0 or cq != -ck or abs(cq) != 1:
    return None
  # s*d + c (op) 0  →  bounds on d = q - k
  bounds = {"<": (None, -c - 1), "<=": (None, -c), ">": (-c + 1, None), ">=": (-c, None),
            "==": (-c, -c)}.get(op)
  if bounds is None:
    return None
  b_lo, b_hi = bounds
  if cq < 0:
    b_lo, b_hi = (None if b_hi is None else -b_hi), (None if b_lo is None else -b_lo)
  return b_lo, b_hi


def _tighter(band, bounds):
  """The intersection of two `(lo, hi)` bands (None: unbounded)."""
  (lo, hi), (b_lo, b_hi) = band, bounds
  if b_lo is not None:
    lo = b_lo if lo is None else max(lo, b_lo)
  if b_hi is not None:
    hi = b_hi if hi is None else min(hi, b_hi)
  return lo, hi


def _chunk(items: list[ir.Mask]) -> int | None:
  """`c` when a conjunct is `q // c == k // c` (c > 0), else None."""
  for m in items:
    if not (isinstance(m, ir.Compare) and m.ops == ("==",)):
      continue
    a, b = m.terms
    if not all(isinstance(t, ir.Arith) and t.op == "//" and isinstance(t.lhs, ir.Pos)
               and isinstance(t.rhs, ir.Const) for t in (a, b)):
      continue
    if {a.lhs.axis, b.lhs.axis} == {"q", "k"} and a.rhs.value == b.rhs.value > 0:
      return int(a.rhs.value)
  return None
