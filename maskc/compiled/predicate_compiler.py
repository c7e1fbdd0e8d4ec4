"""Compiling a mask into a `Predicate`: the program and read table kernels evaluate.

Every definition is expanded, equal subterms are computed once (IR nodes are
hashable data), and each operand read lands in the table of its kind (see
`maskc.compiled.predicate`). The structural facts are read off the mask's conjunction
after expansion, so `causal & s[q] == s[k]`, `document(s) & causal` and a
user's definition wrapping `document(s)` all give the same segment fact.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from maskc.analysis.linear import conjuncts, implied_band, implied_chunk, segment_conjunct
from maskc.compiled.predicate import Instr, PairwiseRead, Predicate, Program, TokenRead, run
from maskc.language import ir


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
  band, chunk = (((None, None), None) if positions_read else
                 (implied_band(items), implied_chunk(items)))
  rest_pred = None
  if segments:
    rest_mask = ir.and_(rest) if rest else ir.BoolConst(True)
    rest_pred = compile_predicate(rest_mask, q_positions=q_positions, kv_len=kv_len,
                                  block_q=block_q, block_kv=block_kv, facts=False,
                                  kv_positions=kv_positions, positions_read=positions_read)
  return Predicate(program, tuple(c.q_reads), tuple(c.k_reads), tuple(c.scalars),
                   tuple(c.pairs), tuple(c.tile_pairs), tuple(segments), rest_pred, band, chunk,
                   str(m))


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

  def term(self, t: ir.Node, index: bool = False) -> int:
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
