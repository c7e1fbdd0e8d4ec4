"""Hypothesis strategies for random masks, shared by the test files.

`masks()` draws IR trees built with the public Python builders: prelude masks,
comparisons of random integer terms (`q`, `k`, constants, `+ - * // %`,
`abs`, `min`, `max`, operand reads `seg[q]`, `runs(img)[k]`, the scalar `n`)
and boolean operand reads (`img[q]`, `allowed[q, k]`), combined with
`& | ^ ~`. Every mask it draws is valid, and reads only the operands of
`operand_values`, whose names keep one kind each:

| name | kind | value |
|---|---|---|
| `seg` | per-token int | segment ids |
| `img` | per-token bool | image-token flags |
| `allowed` | pairwise bool | a random dense mask |
| `n`, `plen` | scalar | small non-negative ints |

Reads index only at `q`, `k` or `q // c`, `k // c` (c >= 1), so with
`kv_len >= q_len` and the default offset every read stays in bounds for
operands of length `kv_len`.

    from strategies import masks, shapes, operand_values
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np

import maskc

SCALARS = ("n", "plen")


def _pos_index() -> st.SearchStrategy:
  """An in-bounds index term of one position: q, k, q // c or k // c."""
  pos = st.sampled_from([maskc.q, maskc.k])
  return st.one_of(pos, st.builds(lambda p, c: p // c, pos, st.integers(1, 4)))


def _reads() -> st.SearchStrategy:
  return st.one_of(
      st.builds(lambda i: maskc.operand("seg")[i], _pos_index()),
      st.builds(lambda i: maskc.runs("img")[i], _pos_index()))


def terms(max_leaves: int = 6) -> st.SearchStrategy:
  """Random integer terms of q and k (see the module docstring)."""
  leaves = st.one_of(
      st.sampled_from([maskc.q, maskc.k]),
      st.integers(-20, 20).map(maskc.Const),
      _reads(),
      st.just(maskc.scalar("n")))

  def extend(children):
    nonzero = st.integers(-5, 5).filter(lambda c: c != 0)
    return st.one_of(
        st.builds(lambda a, b: _term(a) + b, children, children),
        st.builds(lambda a, b: _term(a) - b, children, children),
        st.builds(lambda a, c: _term(a) * c, children, st.integers(-4, 4)),
        st.builds(lambda a, c: c * _term(a), children, st.integers(-4, 4)),
        st.builds(lambda a, c: _term(a) // c, children, nonzero),
        st.builds(lambda a, c: _term(a) % c, children, nonzero),
        st.builds(lambda a: -_term(a), children),
        st.builds(lambda a: abs(_term(a)), children),
        st.builds(lambda a, b: maskc.minimum(a, b), children, children),
        st.builds(lambda a, b: maskc.maximum(a, b), children, children),
    )

  return st.recursive(leaves, extend, max_leaves=max_leaves)


def _term(value) -> maskc.Term:
  """An int or a term as a term, so Python operators build IR rather than fold ints."""
  return maskc.Const(value) if isinstance(value, int) else value


_OPS = ("<", "<=", "==", "!=", ">=", ">")


def comparisons(max_leaves: int = 6) -> st.SearchStrategy:
  """Random comparisons, some of them chained: `t1 < t2`, `t1 <= t2 < t3`."""
  t = terms(max_leaves)
  return st.one_of(
      st.builds(lambda a, op, b: maskc.compare((a, b), (op,)), t, st.sampled_from(_OPS), t),
      st.builds(lambda a, o1, b, o2, c: maskc.compare((a, b, c), (o1, o2)),
                t, st.sampled_from(_OPS), t, st.sampled_from(_OPS), t))


def prelude_masks() -> st.SearchStrategy:
  """Prelude masks with valid arguments, including operands."""
  small = st.integers(0, 12)
  return st.one_of(
      st.sampled_from([maskc.full(), maskc.empty(), maskc.causal(), maskc.document("seg"),
                       maskc.bidirectional("img"), maskc.prefix("plen"), maskc.sink("n")]),
      st.builds(maskc.sliding, st.integers(1, 12)),
      st.builds(maskc.local, small, small),
      st.builds(maskc.chunk, st.integers(1, 12)),
      st.builds(maskc.prefix, small),
      st.builds(maskc.sink, small),
      st.builds(maskc.global_, small))


def truths() -> st.SearchStrategy:
  """Boolean operand reads used as masks: `img[q]`, `allowed[q, k]`, `runs(img)[k]`."""
  return st.one_of(
      st.builds(lambda i: maskc.truth(maskc.operand("img")[i]), _pos_index()),
      st.builds(lambda i: maskc.truth(maskc.runs("img")[i]), _pos_index()),
      st.just(maskc.truth(maskc.operand("allowed")[maskc.q, maskc.k])),
      st.builds(lambda c: maskc.truth(maskc.operand("allowed")[maskc.q // c, maskc.k // c]),
                st.integers(1, 3)))


def _combined(children: st.SearchStrategy) -> st.SearchStrategy:
  """`&`, `|`, `^` of two drawn masks, or `~` of one."""
  return st.one_of(
      st.builds(lambda a, b: a & b, children, children),
      st.builds(lambda a, b: a | b, children, children),
      st.builds(lambda a, b: a ^ b, children, children),
      st.builds(lambda a: ~a, children))


def masks(max_leaves: int = 8, term_leaves: int = 4) -> st.SearchStrategy:
  """Random masks: prelude masks, comparisons and operand reads under `& | ^ ~`."""
  leaves = st.one_of(prelude_masks(), prelude_masks(), comparisons(term_leaves), truths())

  return st.recursive(leaves, _combined, max_leaves=max_leaves)


def prelude_combinations(max_leaves: int = 6) -> st.SearchStrategy:
  """Masks built from prelude masks alone with `& | ^ ~`."""
  return st.recursive(prelude_masks(), _combined, max_leaves=max_leaves)


@st.composite
def shapes(draw, max_len: int = 16) -> tuple[int, int]:
  """`(q_len, kv_len)` with `1 <= q_len <= kv_len <= max_len`."""
  kv_len = draw(st.integers(1, max_len))
  q_len = draw(st.integers(1, kv_len))
  return q_len, kv_len


def operand_values(kv_len: int, seed: int = 0, batch: int | None = None) -> dict:
  """Values for every operand `masks()` may read, for masks of `kv_len` columns."""
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
