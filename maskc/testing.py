"""Testing helpers for users' own test suites: strategies and `assert_masks_equal`.

`assert_masks_equal(a, b, q_len, ...)` checks that two masks (text, `Mask`, or a
dense NumPy bool reference) agree at a shape, and fails with the first differing
position, both masks as text, and a small picture of the differences:

    from maskc.testing import assert_masks_equal

    def test_prefix_lm():
      assert_masks_equal("causal | prefix(16)", "causal | q < 16 & k < 16", 4096)

The hypothesis strategies draw random valid masks, shapes and operand values, for
property tests of code that consumes masks:

    from hypothesis import given, strategies as st
    from maskc import testing

    @given(st.data())
    def test_my_kernel(data):
      mask = data.draw(testing.masks())
      shape = data.draw(testing.shapes(max_len=64))
      operands = data.draw(testing.operand_values(mask, shape))
      ...

Two families of strategies share their building blocks. `masks`, `shapes` and
`operand_values` work with operands you name. `mask_trees`, `terms`,
`comparisons`, `prelude_masks`, `truths` and `prelude_combinations` draw richer
masks over one fixed set of operands, `STANDARD_OPERANDS`, whose values
`seeded_operand_values(kv_len, seed)` gives without hypothesis, with the
`(q_len, kv_len)` pairs of `prefill_shapes`:

    @given(testing.mask_trees(), testing.prefill_shapes(), st.integers(0, 3))
    def test_my_evaluator(mask, shape, seed):
      q_len, kv_len = shape
      operands = testing.seeded_operand_values(kv_len, seed)
      ...

hypothesis is a test dependency only: this module imports without it, and the
strategies raise an `ImportError` that says how to install it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from jax.typing import ArrayLike

from maskc.language import builders as mb, ir
from maskc.language.arguments import MaskLike, as_mask
from maskc.language.errors import MaskValueError, MissingExtraError, short_repr
from maskc.semantics.evaluate import Env, evaluate
from maskc.semantics.shape import Shape
from maskc.tools.equivalence import Counterexample, Equivalence, MaskOrDense, equivalent

if TYPE_CHECKING:
  from hypothesis.strategies import SearchStrategy

__all__ = ["assert_masks_equal", "comparisons", "mask_trees", "masks", "operand_values",
           "prefill_shapes", "prelude_combinations", "prelude_masks", "seeded_operand_values",
           "shapes", "terms", "truths", "MASK_OPERANDS", "OPERAND_KINDS", "STANDARD_OPERANDS"]

OPERAND_KINDS = {
    "segments": "integer ids per token: `document(x)`, `x[q] == x[k]`, `x[q] < x[k]`",
    "image": "booleans per token: `bidirectional(x)`, `x[q]`, `x[k]`, `runs(x)[q] == runs(x)[k]`",
    "scalar": "a non-negative int: `prefix(x)`, `sink(x)`, `global(x)`, `k < x`",
    "pairwise": "a boolean [Lq, Lk] matrix: `x[q, k]`",
}
_DEFAULT_KINDS = {"seg": "segments", "segment_ids": "segments", "doc": "segments",
                  "img": "image", "image": "image", "pfx": "image", "g": "image", "n": "scalar",
                  "plen": "scalar", "prompt_len": "scalar", "allowed": "pairwise"}


def _strategies() -> ModuleType:
  """`hypothesis.strategies`, or an ImportError that says how to install hypothesis."""
  try:
    import hypothesis.strategies as st
  except ImportError as e:  # pragma: no cover - exercised only without hypothesis
    raise MissingExtraError(
        "maskc.testing's strategies need hypothesis, a test dependency", extra="test",
        hint="(Or `pip install hypothesis` alone.) assert_masks_equal works without it.") from e
  return st


# ----------------------------------------------------------------------------- masks


def _operand_kinds(operands: Sequence[str] | Mapping[str, str]) -> dict[str, str]:
  if isinstance(operands, str):
    operands = (operands,)
  if isinstance(operands, Mapping):
    kinds = dict(operands)
  else:
    kinds = {}
    for name in operands:
      if name not in _DEFAULT_KINDS:
        raise MaskValueError(
            f"cannot tell what kind of operand `{name}` is",
            hint=f"Pass a mapping of names to kinds, e.g. operands={{'{name}': 'segments'}}; "
                 f"kinds: {', '.join(OPERAND_KINDS)}.")
      kinds[name] = _DEFAULT_KINDS[name]
  for name, kind in kinds.items():
    if kind not in OPERAND_KINDS:
      raise MaskValueError(f"unknown operand kind {short_repr(kind)} for `{name}`",
                           hint=f"Use one of {', '.join(OPERAND_KINDS)}.")
    ir.operand(name)  # a valid identifier
  return kinds


# The helpers below take `hypothesis.strategies` as `st` and return strategies.


def _terms(st: ModuleType) -> Any:
  """Integer terms of q and k whose values stay small over small shapes."""
  q, k = ir.Pos("q"), ir.Pos("k")
  c = st.integers(-8, 8)
  pos = st.sampled_from([q, k])
  return st.one_of(
      pos,
      st.sampled_from([q - k, k - q, abs(q - k), ir.fn("min", (q, k)), ir.fn("max", (q, k))]),
      st.builds(lambda p, n: p + n, pos, c),
      st.builds(lambda p, n: p // n, pos, st.integers(1, 6)),
      st.builds(lambda p, n: p % n, pos, st.integers(1, 6)),
      st.builds(lambda n, p: n * p, st.integers(-2, 3), pos),
      st.builds(lambda a, b, n: a - b + n, pos, pos, c))


_OPS = ("<", "<=", "==", "!=", ">=", ">")


def _comparisons(st: ModuleType) -> Any:
  t = _terms(st)
  op = st.sampled_from(_OPS)
  return st.one_of(
      st.builds(lambda a, o, b: ir.compare((a, b), (o,)), t, op, t),
      st.builds(lambda a, o1, b, o2, c: ir.compare((a, b, c), (o1, o2)), t, op, t, op, t))


def _prelude_leaves(st: ModuleType, local_max: int) -> list[Any]:
  """The prelude masks without operands, with small valid arguments."""
  small = st.integers(0, 12)
  return [
      st.builds(mb.sliding, st.integers(1, 12)),
      st.builds(mb.local, st.integers(0, local_max), st.integers(0, local_max)),
      st.builds(mb.chunk, st.integers(1, 12)),
      st.builds(mb.prefix, small),
      st.builds(mb.sink, small),
      st.builds(mb.global_, small),
  ]


def _combined(st: ModuleType, children: Any) -> Any:
  """`&`, `|`, `^` of two drawn masks, or `~` of one."""
  return st.one_of(
      st.builds(lambda a, b: a & b, children, children),
      st.builds(lambda a, b: a | b, children, children),
      st.builds(lambda a, b: a ^ b, children, children),
      st.builds(lambda a: ~a, children))


def _named_or_expanded(st: ModuleType, strategy: Any) -> Any:
  """Draws from `strategy`, and a named call drawn is given as written or as its body.

  The two spellings mean the same mask, but the lowering meets them in different
  shapes (a call it expands itself, or the `&` of reads the simplifier may
  rewrite), so a property should hold for both.
  """
  return strategy.flatmap(
      lambda m: st.sampled_from([m, ir.expand(m)]) if isinstance(m, ir.Call) else st.just(m))


def _reads(st: ModuleType, kind: str, name: str) -> list[ir.Mask]:
  """The masks that read operand `name` of `kind`, named and raw."""
  q, k = ir.Pos("q"), ir.Pos("k")
  if kind == "segments":
    return [mb.document(name), ir.read(name, q) < ir.read(name, k),
            ir.compare((ir.read(name, k), ir.read(name, q)), ("<=",)),
            ir.compare((ir.read(name, q), ir.read(name, k)), ("!=",))]
  if kind == "image":
    return [mb.bidirectional(name), ir.truth(ir.read(name, q)), ir.truth(ir.read(name, k)),
            ir.compare((ir.read(name, q, runs=True), ir.read(name, k, runs=True)), ("==",))]
  if kind == "scalar":
    return [mb.prefix(name), mb.sink(name), mb.global_(name), k < ir.Scalar(name),
            ir.compare((q, ir.Scalar(name)), (">=",))]
  return [ir.truth(ir.pair_read(name, q, k))]


def _leaves(st: ModuleType, kinds: dict[str, str], allow_comparisons: bool) -> Any:
  """Leaf masks of three families: operand-free prelude masks (and comparisons), one
  read of an operand, and, as often as those two together, two operands of one kind
  combined."""
  free = [st.sampled_from([mb.full(), mb.empty(), mb.causal()]), *_prelude_leaves(st, 8)]
  if allow_comparisons:
    free.append(_comparisons(st))
  options = [_named_or_expanded(st, st.one_of(free))]
  reads = [r for name, kind in kinds.items() for r in _reads(st, kind, name)]
  if reads:
    options.append(_named_or_expanded(st, st.sampled_from(reads)))
  pairs = _same_kind_pairs(st, kinds)
  if pairs is not None:
    options += [pairs, pairs]  # as often as the other two families together
  return st.one_of(options)


def _same_kind_pairs(st: ModuleType, kinds: dict[str, str]) -> Any:
  """One mask read of two operands of one kind, combined: `bidirectional(img) &
  ~bidirectional(g)`, `document(seg) ^ document(doc)`; None without two of a kind.

  Lowerings that take a mask of one operand apart (its runs, its equal reads) meet
  a second operand of the same shape here, the case a draw of independent leaves
  reaches too rarely to test.
  """
  by_kind: dict[str, list[str]] = {}
  for name, kind in kinds.items():
    by_kind.setdefault(kind, []).append(name)
  groups = [names for names in by_kind.values() if len(names) > 1]
  if not groups:
    return None
  from hypothesis.strategies import DrawFn, composite

  @composite
  def pair(draw: DrawFn) -> ir.Mask:
    names = draw(st.sampled_from(groups))
    a, b = draw(st.permutations(names))[:2]
    # the named prelude mask of the kind (`document`, `bidirectional`, `prefix`) half the time
    n_forms = len(_reads(st, kinds[a], a))
    form = draw(st.one_of(st.just(0), st.integers(0, n_forms - 1)))
    x = draw(_named_or_expanded(st, st.just(_reads(st, kinds[a], a)[form])))
    y = draw(_named_or_expanded(st, st.just(_reads(st, kinds[b], b)[form])))
    op = draw(st.sampled_from(["&", "|", "^", "&~", "~^"]))
    combined: ir.Mask = {"&": lambda: x & y, "|": lambda: x | y, "^": lambda: x ^ y,
                         "&~": lambda: x & ~y, "~^": lambda: ~x ^ y}[op]()
    return combined

  return pair()


MASK_OPERANDS = {"seg": "segments", "doc": "segments", "img": "image", "pfx": "image",
                 "g": "image", "n": "scalar"}
"""The operands `masks()` reads by default: two segment-id, three image-span and one
scalar operand, so that its masks combine operands of one kind."""


def masks(max_depth: int = 3,
          operands: Sequence[str] | Mapping[str, str] = tuple(MASK_OPERANDS),
          allow_comparisons: bool = True,
          as_text: bool = False) -> SearchStrategy[ir.Mask] | SearchStrategy[str]:
  """A hypothesis strategy for random valid masks.

  Leaves are the prelude masks (`full empty causal sliding local chunk prefix
  sink global document bidirectional`) with small arguments, reads of the given
  operands, and (with `allow_comparisons`) comparisons of terms of `q` and `k`
  (`q - k + 3 < k // 2`, chained ones too). A named leaf is drawn as written or as
  its body (`bidirectional(img)` or `runs(img)[q] == runs(img)[k] & img[q]`).
  Leaves combine with `& | ^ ~` up to `max_depth` levels, so `~` and `^` reach
  every leaf, raw reads included. Every mask drawn parses from its text, prints
  and compiles.

  Args:
    max_depth: levels of `& | ^ ~` above the leaves (0 draws leaves only).
    operands: operand names the masks may read: a sequence of known names
      (`seg`, `doc` → segment ids; `img`, `pfx`, `g` → image flags; `n`, `plen`
      → scalars; `allowed` → a pairwise matrix) or a mapping name → kind, kinds
      being the keys of `OPERAND_KINDS`. The default, `MASK_OPERANDS`, holds
      several operands of each kind but pairwise. Pass `()` for masks without
      operands.
    allow_comparisons: include comparisons of integer terms.
    as_text: draw the masks' canonical text instead of `Mask` objects.

  Returns:
    A strategy of `Mask` (or `str`). Draw values for its operands with
    `operand_values(mask, shape)`.

  >>> from maskc import testing
  >>> strategy = testing.masks(max_depth=2, operands=(), as_text=True)
  """
  _strategies()  # hypothesis, or an ImportError that says how to get it
  from hypothesis import strategies as st
  if max_depth < 0:
    raise MaskValueError(f"max_depth must be >= 0, got {max_depth=}")
  leaves = _leaves(st, _operand_kinds(operands), allow_comparisons)
  tree: SearchStrategy[ir.Mask] = leaves
  for _ in range(max_depth):
    tree = st.one_of(leaves, _combined(st, tree))
  return tree.map(str) if as_text else tree


# ----------------------------------------------------------------------------- richer masks

STANDARD_OPERANDS = {"seg": "segments", "img": "image", "allowed": "pairwise", "n": "scalar",
                     "plen": "scalar"}
"""The operands `mask_trees` and its parts read, by name, with their kinds.

Reads index only at `q`, `k`, `q // c` or `k // c` (c >= 1), so with `kv_len >=
q_len` and the default offset every read stays in bounds for operands of length
`kv_len`, as `seeded_operand_values` gives them.
"""


def _pos_index(st: ModuleType) -> Any:
  """An in-bounds index term of one position: q, k, q // c or k // c."""
  pos = st.sampled_from([mb.q, mb.k])
  return st.one_of(pos, st.builds(lambda p, c: p // c, pos, st.integers(1, 4)))


def _as_term(value: int | ir.Term) -> ir.Term:
  """An int or a term as a term, so Python operators build IR rather than fold ints."""
  return ir.Const(value) if isinstance(value, int) else value


def terms(max_leaves: int = 6) -> SearchStrategy[ir.Term]:
  """A hypothesis strategy for random integer terms over `STANDARD_OPERANDS`.

  Leaves are `q`, `k`, constants in [-20, 20], reads `seg[i]` and `runs(img)[i]`
  (i one of `q`, `k`, `q // c`, `k // c`) and the scalar `n`; they combine with
  `+ - * // %` (by small non-zero constants where a side must be one), unary
  `-`, `abs`, `min` and `max`.

  Args:
    max_leaves: the most leaves a term has (hypothesis' `recursive`).
  """
  _strategies()
  from hypothesis import strategies as st
  reads = st.one_of(st.builds(lambda i: mb.operand("seg")[i], _pos_index(st)),
                    st.builds(lambda i: mb.runs("img")[i], _pos_index(st)))
  leaves = st.one_of(st.sampled_from([mb.q, mb.k]), st.integers(-20, 20).map(ir.Const), reads,
                     st.just(mb.scalar("n")))

  def extend(children: SearchStrategy[ir.Term]) -> SearchStrategy[ir.Term]:
    nonzero = st.integers(-5, 5).filter(lambda c: c != 0)
    return st.one_of(
        st.builds(lambda a, b: _as_term(a) + b, children, children),
        st.builds(lambda a, b: _as_term(a) - b, children, children),
        st.builds(lambda a, c: _as_term(a) * c, children, st.integers(-4, 4)),
        st.builds(lambda a, c: c * _as_term(a), children, st.integers(-4, 4)),
        st.builds(lambda a, c: _as_term(a) // c, children, nonzero),
        st.builds(lambda a, c: _as_term(a) % c, children, nonzero),
        st.builds(lambda a: -_as_term(a), children),
        st.builds(lambda a: abs(_as_term(a)), children),
        st.builds(lambda a, b: mb.minimum(a, b), children, children),
        st.builds(lambda a, b: mb.maximum(a, b), children, children),
    )

  return st.recursive(leaves, extend, max_leaves=max_leaves)


def comparisons(max_leaves: int = 6) -> SearchStrategy[ir.Compare]:
  """A hypothesis strategy for comparisons of `terms(max_leaves)`, some chained:
  `t1 < t2`, `t1 <= t2 < t3`."""
  _strategies()
  from hypothesis import strategies as st
  t = terms(max_leaves)
  op = st.sampled_from(_OPS)
  return st.one_of(
      st.builds(lambda a, o, b: mb.compare((a, b), (o,)), t, op, t),
      st.builds(lambda a, o1, b, o2, c: mb.compare((a, b, c), (o1, o2)), t, op, t, op, t))


def prelude_masks() -> SearchStrategy[ir.Mask]:
  """A hypothesis strategy for prelude masks with valid arguments, over `STANDARD_OPERANDS`:
  `full empty causal sliding local chunk prefix sink global`, `document(seg)`,
  `bidirectional(img)`, `prefix(plen)` and `sink(n)`."""
  _strategies()
  from hypothesis import strategies as st
  return st.one_of(
      st.sampled_from([mb.full(), mb.empty(), mb.causal(), mb.document("seg"),
                       mb.bidirectional("img"), mb.prefix("plen"), mb.sink("n")]),
      *_prelude_leaves(st, 12))


def truths() -> SearchStrategy[ir.Truth]:
  """A hypothesis strategy for boolean operand reads used as masks: `img[i]`,
  `runs(img)[i]`, `allowed[q, k]` and `allowed[q // c, k // c]`."""
  _strategies()
  from hypothesis import strategies as st
  return st.one_of(
      st.builds(lambda i: mb.truth(mb.operand("img")[i]), _pos_index(st)),
      st.builds(lambda i: mb.truth(mb.runs("img")[i]), _pos_index(st)),
      st.just(mb.truth(mb.operand("allowed")[mb.q, mb.k])),
      st.builds(lambda c: mb.truth(mb.operand("allowed")[mb.q // c, mb.k // c]),
                st.integers(1, 3)))


def mask_trees(max_leaves: int = 8, term_leaves: int = 4) -> SearchStrategy[ir.Mask]:
  """A hypothesis strategy for random masks over `STANDARD_OPERANDS`, by leaf count.

  Leaves are `prelude_masks()` (drawn twice as often), `comparisons(term_leaves)`
  and `truths()`, combined with `& | ^ ~`. Every mask drawn is valid and reads
  only the operands of `seeded_operand_values`.

  Args:
    max_leaves: the most leaf masks a tree has (hypothesis' `recursive`).
    term_leaves: the most leaves of each compared term.

  >>> from maskc import testing
  >>> strategy = testing.mask_trees(max_leaves=4, term_leaves=3)
  """
  _strategies()
  from hypothesis import strategies as st
  leaves = st.one_of(prelude_masks(), prelude_masks(), comparisons(term_leaves), truths())
  return st.recursive(leaves, lambda children: _combined(st, children), max_leaves=max_leaves)


def prelude_combinations(max_leaves: int = 6) -> SearchStrategy[ir.Mask]:
  """A hypothesis strategy for masks built from `prelude_masks()` alone with `& | ^ ~`."""
  _strategies()
  from hypothesis import strategies as st
  return st.recursive(prelude_masks(), lambda children: _combined(st, children),
                      max_leaves=max_leaves)


def prefill_shapes(max_len: int = 16) -> SearchStrategy[tuple[int, int]]:
  """A hypothesis strategy for `(q_len, kv_len)` with `1 <= q_len <= kv_len <= max_len`
  (the default offset, `kv_len - q_len`, keeps every read of `mask_trees` in bounds)."""
  _strategies()
  from hypothesis import strategies as st

  @st.composite
  def draw_shape(draw: st.DrawFn) -> tuple[int, int]:
    kv_len = draw(st.integers(1, max_len))
    return draw(st.integers(1, kv_len)), kv_len

  return draw_shape()


def seeded_operand_values(kv_len: int, seed: int = 0,
                          batch: int | None = None) -> dict[str, Any]:
  """Values for every operand of `STANDARD_OPERANDS`, for masks of `kv_len` columns.

  Deterministic in `seed` and needs no hypothesis: sorted segment ids in [0, 4),
  random image flags and pairwise booleans, and scalars in [0, kv_len].

  Args:
    kv_len: the key length (and the per-token operands' length).
    seed: the NumPy random seed.
    batch: None for unbatched values, or the size of a leading batch axis.

  >>> sorted(seeded_operand_values(8))
  ['allowed', 'img', 'n', 'plen', 'seg']
  """
  rng = np.random.default_rng(seed)
  lead = () if batch is None else (batch,)
  seg = np.sort(rng.integers(0, 4, size=lead + (kv_len,)), axis=-1)
  return {
      "seg": seg.astype(np.int32),
      "img": rng.random(lead + (kv_len,)) < 0.5,
      "allowed": rng.random(lead + (kv_len, kv_len)) < 0.5,
      "n": rng.integers(0, kv_len + 1, size=lead) if batch else int(rng.integers(0, kv_len + 1)),
      "plen": rng.integers(0, kv_len + 1, size=lead) if batch else int(rng.integers(0, kv_len + 1)),
  }


# ----------------------------------------------------------------------------- shapes


def shapes(max_len: int = 64) -> SearchStrategy[tuple[int, int, int | None]]:
  """A hypothesis strategy for `(q_len, kv_len, q_offset)`.

  Draws square shapes, ragged ones (`q_len < kv_len`: chunked prefill), decode
  (1 to 4 queries against a longer cache), more queries than keys, and explicit
  offsets. `q_offset` is None (the default, `kv_len - q_len`) only where that
  default is non-negative, and explicit offsets are non-negative too, so every
  query position is >= 0 and operand reads at `q` stay in bounds with operands
  from `operand_values`.

  Args:
    max_len: the largest `q_len` and `kv_len` drawn.
  """
  _strategies()
  from hypothesis import strategies as st
  if max_len < 1:
    raise MaskValueError(f"max_len must be >= 1, got {max_len=}")
  n = st.integers(1, max_len)

  @st.composite
  def draw_shape(draw: st.DrawFn) -> tuple[int, int, int | None]:
    kind = draw(st.sampled_from(["square", "ragged", "decode", "offset", "more_queries"]))
    kv_len = draw(n)
    if kind == "square":
      return kv_len, kv_len, None
    if kind == "ragged":
      return draw(st.integers(1, kv_len)), kv_len, None
    if kind == "decode":
      return draw(st.integers(1, min(4, kv_len))), kv_len, None
    q_len = draw(n) if kind == "offset" else draw(st.integers(kv_len, max_len))
    return q_len, kv_len, draw(st.integers(0, max_len))

  return draw_shape()


# ----------------------------------------------------------------------------- operands


def _needed_length(m: ir.Mask, shape: Shape,
                   scalars: dict[str, np.ndarray]) -> tuple[dict[tuple[str, int], int], int]:
  """Per operand axis `(name, axis)`: the largest index the mask reads plus one, and the least."""
  qpos = np.arange(shape.q_len, dtype=np.int64) + shape.q_offset
  kpos = np.arange(shape.kv_len, dtype=np.int64)
  nb = max([v.shape[0] for v in scalars.values()] + [1])
  arrays = {n: np.broadcast_to(v, (nb,)) for n, v in scalars.items()}
  env_b = np.arange(nb)[:, None]
  need: dict[tuple[str, int], int] = {}
  low = 0
  for n in ir.walk(m):
    if isinstance(n, ir.Read):
      checks = [(n.index, (n.operand.name, -1))]
    elif isinstance(n, ir.PairRead):
      checks = [(n.q_index, (n.operand.name, -2)), (n.k_index, (n.operand.name, -1))]
    else:
      continue
    for index, key in checks:
      pos = qpos if "q" in ir.positions_of(index) else kpos
      values = np.asarray(evaluate(index, Env(np, pos[None, :], pos[None, :], arrays, env_b)))
      need[key] = max(need.get(key, 1), int(values.max()) + 1)
      low = min(low, int(values.min()))
  return need, low


def operand_values(mask: MaskLike, shape: tuple[int, int, int | None], *,
                   batch: int | None | bool = False) -> SearchStrategy[dict[str, Any]]:
  """A hypothesis strategy for values of every operand `mask` reads, at `shape`.

  Segment ids are small non-negative ints, sorted (packed documents) or not;
  image flags are bool arrays made of runs or drawn freely; scalars are ints in
  `[0, max(kv_len, q_len + q_offset)]`; pairwise operands are bool matrices.
  Lengths cover every index the mask reads at the shape. Batched variants give
  some operands a leading batch axis of one common size.

  Args:
    mask: the mask (or its text) whose operands to draw.
    shape: `(q_len, kv_len, q_offset)` as drawn by `shapes()`.
    batch: False (the default) draws unbatched or batched values; None draws
      unbatched values only; an int draws values batched with that size.

  Returns:
    A strategy of `{name: value}` for `operands=`. Masks that read an operand
    at negative indices (queries before position 0) are rejected.
  """
  _strategies()
  from hypothesis import reject, strategies as st
  from hypothesis.extra import numpy as hnp
  m = as_mask(mask)
  bound = Shape.of(*shape)
  specs = m.operands
  span = max(bound.kv_len, bound.q_len + max(int(bound.q_offset), 0))

  @st.composite
  def draw_values(draw: st.DrawFn) -> dict[str, Any]:
    nb = draw(st.sampled_from([None, None, 1, 2, 3])) if batch is False else batch
    batched = {s.name: nb is not None and draw(st.booleans()) for s in specs}
    if nb is not None and specs and not any(batched.values()):
      batched[specs[0].name] = True
    values: dict[str, Any] = {}
    for s in specs:
      if s.kind == "scalar":
        ints = st.integers(0, span)
        values[s.name] = (np.asarray(draw(st.lists(ints, min_size=nb, max_size=nb)), np.int32)
                          if nb is not None and batched[s.name] else draw(ints))
    scalars = {n: np.atleast_1d(np.asarray(v)) for n, v in values.items()}
    need, low = _needed_length(m, bound, scalars)
    if low < 0:
      reject()
    for s in specs:
      if s.kind == "scalar":
        continue
      lead = (nb,) if nb is not None and batched[s.name] else ()  # batched: nb is set
      if s.kind == "pair":
        dims = (need.get((s.name, -2), 1), need.get((s.name, -1), 1))
        values[s.name] = draw(hnp.arrays(np.bool_, lead + dims))
        continue
      length = max(need.get((s.name, -1), 1), bound.kv_len)
      rows = [_token_values(draw, st, hnp, s.boolean, length) for _ in range(nb or 1)]
      values[s.name] = np.stack(rows) if batched[s.name] else rows[0]
    return values

  return draw_values()


def _token_values(draw: Callable[[Any], Any], st: ModuleType, hnp: ModuleType, boolean: bool,
                  length: int) -> np.ndarray:
  if boolean:
    if draw(st.booleans()):  # runs of equal flags, as image tokens come
      out: list[bool] = []
      value = draw(st.booleans())
      while len(out) < length:
        out.extend([value] * draw(st.integers(1, max(1, length // 2))))
        value = not value
      return np.asarray(out[:length], bool)
    flags: np.ndarray = draw(hnp.arrays(np.bool_, (length,)))
    return flags
  ids = draw(hnp.arrays(np.int32, (length,), elements=st.integers(0, 4)))
  return np.sort(ids) if draw(st.booleans()) else ids


# ----------------------------------------------------------------------------- assertions


def assert_masks_equal(a: MaskOrDense, b: MaskOrDense, q_len: int | None = None,
                       kv_len: int | None = None, *, q_offset: int | None = None,
                       operands: Mapping[str, ArrayLike] | None = None, block_q: int = 128,
                       block_kv: int = 128) -> Equivalence:
  """Asserts that two masks agree at a shape; fails with a picture of where they do not.

  Cheap at long sequences (see `maskc.equivalent`): only tiles where the masks'
  block maps disagree or are partial are evaluated.

  Args:
    a, b: masks: `Mask`, mask text, or a dense bool array (a reference built
      by hand; it gives the shape when `q_len` is None).
    q_len, kv_len, q_offset, operands: the shape and operand values to check at;
      `q_len` may be left out only when a dense array gives it.
    block_q, block_kv: tile sizes of the check.

  Returns:
    The `Equivalence` (truthy), for further inspection.

  Raises:
    AssertionError: the masks differ. The message gives the first differing
      position (row-major), both masks as text, and a window of at most 16 rows
      by 32 columns around it, with `#` where both are true, `.` where both are
      false, `a` where only a is true and `b` where only b is.

  >>> from maskc.testing import assert_masks_equal
  >>> _ = assert_masks_equal("sliding(4)", "causal & local(3, 0)", 64)
  """
  __tracebackhide__ = True  # pytest shows the caller's line
  result = equivalent(a, b, q_len, kv_len, q_offset=q_offset, operands=operands,
                      block_q=block_q, block_kv=block_kv)
  if result.equal is None:
    raise AssertionError(f"cannot decide whether `{result.a}` and `{result.b}` are equal without "
                         f"a shape: pass q_len (and operands). {result.reason}")
  if result.equal:
    return result
  raise AssertionError(_failure_message(result, a, b, operands))


def _failure_message(result: Equivalence, a: MaskOrDense, b: MaskOrDense,
                     operands: Mapping[str, ArrayLike] | None) -> str:
  # the masks differ at a shape: the verdict has both
  cx = cast(Counterexample, result.counterexample)
  q_len, kv_len, q_offset = cast(tuple[int, int, int], result.shape)
  r0 = max(0, min(cx.row - 3, q_len - 16))
  r1 = min(q_len, r0 + 16)
  c0 = max(0, min(cx.col - 8, kv_len - 32))
  c1 = min(kv_len, c0 + 32)
  va = _window(a, result, cx, operands, r0, r1, c0, c1)
  vb = _window(b, result, cx, operands, r0, r1, c0, c1)
  where = "" if cx.batch is None else f"batch {cx.batch}, "
  lines = [
      f"masks differ at {where}row {cx.row}, col {cx.col} (q={cx.q}, k={cx.k}): "
      f"a is {str(cx.a).lower()}, b is {str(cx.b).lower()}",
      f"  a: {result.a}",
      f"  b: {result.b}",
      f"  at q_len={q_len}, kv_len={kv_len}, q_offset={q_offset}; tile {cx.tile} = rows "
      f"{cx.tile_rows[0]}:{cx.tile_rows[1]}, cols {cx.tile_cols[0]}:{cx.tile_cols[1]} of "
      f"{result.block_q}x{result.block_kv}",
      f"  rows {r0}:{r1}, cols {c0}:{c1}: {int((va != vb).sum())} of {va.size} differ "
      f"('#' both true, '.' neither, 'a' only a, 'b' only b):",
  ]
  width = len(str(q_len + q_offset))
  lines.append((" " * (width * 2 + 13) + _ruler(c0, c1)).rstrip())
  for i, r in enumerate(range(r0, r1)):
    cells = "".join("#" if x and y else "." if not x and not y else "a" if x else "b"
                    for x, y in zip(va[i], vb[i]))
    lines.append(f"    row {r:>{width}} q={r + q_offset:<{width}} |{cells}|")
    if r == cx.row:
      lines.append(" " * (width * 2 + 13 + cx.col - c0) + "^ first difference")
  return "\n".join(lines)


def _ruler(c0: int, c1: int) -> str:
  """Column numbers over the picture: the first column and every multiple of 10 that fits."""
  cells = [" "] * (c1 - c0)
  for c in range(c0, c1):
    label = str(c)
    at = c - c0
    if (c == c0 or c % 10 == 0) and at + len(label) <= len(cells) and \
        all(x == " " for x in cells[max(0, at - 1):at + len(label)]):
      cells[at:at + len(label)] = label
  return "".join(cells)


def _window(x: MaskOrDense, result: Equivalence, cx: Counterexample,
            operands: Mapping[str, ArrayLike] | None, r0: int, r1: int, c0: int,
            c1: int) -> np.ndarray:
  """Values of one side in the window (its batch row of the counterexample)."""
  q_len, kv_len, q_offset = cast(tuple[int, int, int], result.shape)
  if isinstance(x, (ir.Mask, str)):
    cm = as_mask(x).bind(q_len, kv_len, q_offset=q_offset, operands=operands)
    idx: tuple[int | slice, ...] = (slice(r0, r1), slice(c0, c1))
    if len(cm.shape) == 3:
      idx = (cx.batch or 0,) + idx
    return np.asarray(cm[idx], bool)
  arr = np.asarray(x).astype(bool)
  if arr.ndim == 3:
    arr = arr[cx.batch or 0]
  return arr[r0:r1, c0:c1]
