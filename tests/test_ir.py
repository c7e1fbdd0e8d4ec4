"""The mask IR: printing, parsing, builders, equality, repr and simplification.

Property tests over random masks from `maskc.testing.mask_trees`: the canonical text
parses back to an equal mask, `repr` evaluates back, and `simplify` keeps the
meaning (dense evaluation at several shapes) and is canonical under
commutativity, De Morgan, double complement and absorption.
"""

import subprocess
import sys

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import assume, given

import maskc
from maskc.ir import k, q
from maskc.testing import (
  mask_trees,
  prefill_shapes,
  prelude_combinations,
  seeded_operand_values,
  terms,
)

EVAL_SHAPES = [(1, 1), (5, 5), (3, 11), (8, 13)]


def dense(m, q_len, kv_len, seed=0):
  return np.asarray(maskc.materialize(m, q_len, kv_len,
                                      operands=seeded_operand_values(kv_len, seed)))


def assert_same_meaning(a, b, shapes_=EVAL_SHAPES):
  for q_len, kv_len in shapes_:
    for seed in (0, 1):
      np.testing.assert_array_equal(dense(a, q_len, kv_len, seed), dense(b, q_len, kv_len, seed),
                                    err_msg=f"`{a}` vs `{b}` at {q_len}x{kv_len}, seed {seed}")


# ----------------------------------------------------------------------------- print / parse


@given(mask_trees())
def test_print_parse_round_trip(m):
  text = str(m)
  assert maskc.parse(text) == m, text
  assert str(maskc.parse(text)) == text


@given(terms())
def test_term_round_trip(t):
  m = maskc.compare((t, 3), ("<",))
  assert maskc.parse(str(m)) == m, str(m)


@given(mask_trees())
def test_repr_evaluates_back(m):
  assert eval(repr(m), {"maskc": maskc}) == m, repr(m)


@pytest.mark.parametrize("text", [
    "causal & chunk(8192)",
    "sliding(4096) | sink(4)",
    "causal & chunk(8192) | bidirectional(img)",
    "~~causal",
    "~(causal & chunk(4))",
    "q - -3 < k",
    "-q * 2 < k",
    "-(q * 2) < k",
    "q // -3 == k // -3",
    "abs(q - k) <= 2 & min(q, k) > max(q, 1)",
    "img[q] ^ img[k]",
    "allowed[q // 2, k // 2]",
    "runs(img)[q] == runs(img)[k] & img[q]",
    "q < k <= q + 3",
    "(q - k) % 3 == 0",
    "q - (k - 1) < 2",
    "true",
    "false | full",
    "a = causal\nb(w) = a & sliding(w)\nb(3) | a",
])
def test_canonical_text_is_a_fixed_point(text):
  m = maskc.parse(text)
  assert str(m) == text
  assert maskc.parse(str(m)) == m


def test_canonical_text_normalizes_spacing_and_brackets():
  assert str(maskc.parse("causal&chunk( 8_192 )")) == "causal & chunk(8192)"
  assert str(maskc.parse("(causal) | ((sink(4)))")) == "causal | sink(4)"
  assert str(maskc.parse("causal & (q - k < 128)")) == "causal & q - k < 128"
  assert str(maskc.parse("(causal | sink(4)) & chunk(8)")) == "(causal | sink(4)) & chunk(8)"


def test_parameters_are_substituted():
  assert maskc.parse("causal & chunk(C)", C=8192) == maskc.parse("causal & chunk(8192)")
  assert maskc.parse("document(s)", s="seg") == maskc.document("seg")
  assert maskc.parse("m & causal", m=maskc.sink(4)) == maskc.sink(4) & maskc.causal()


# ----------------------------------------------------------------------------- builders

BUILDERS = [
    ("causal & chunk(8192)", lambda: maskc.causal() & maskc.chunk(8192)),
    ("sliding(128) | sink(4)", lambda: maskc.sliding(128) | maskc.sink(4)),
    ("local(3, 2)", lambda: maskc.local(3, 2)),
    ("causal | prefix(16)", lambda: maskc.causal() | maskc.prefix(16)),
    ("global(2) & ~causal", lambda: maskc.global_(2) & ~maskc.causal()),
    ("document(seg) & causal", lambda: maskc.document("seg") & maskc.causal()),
    ("bidirectional(img)", lambda: maskc.bidirectional("img")),
    ("causal & chunk(4) | bidirectional(img)",
     lambda: maskc.causal() & maskc.chunk(4) | maskc.bidirectional("img")),
    ("full", maskc.full),
    ("empty ^ causal", lambda: maskc.empty() ^ maskc.causal()),
    ("prefix(plen)", lambda: maskc.prefix("plen")),
    ("q - k < 128", lambda: q - k < 128),
    ("k <= q", lambda: k <= q),
    ("k < kv_len", lambda: k < maskc.scalar("kv_len")),
    ("seg[q] == seg[k]", lambda: maskc.operand("seg")[q].eq(maskc.operand("seg")[k])),
    ("seg[q] != seg[k]", lambda: maskc.operand("seg")[q].ne(maskc.operand("seg")[k])),
    ("img[q] & img[k]", lambda: maskc.operand("img")[q] & maskc.operand("img")[k]),
    ("img[q]", lambda: maskc.truth(maskc.operand("img")[q])),
    ("allowed[q, k]", lambda: maskc.truth(maskc.operand("allowed")[q, k])),
    ("topk[q // 64, k // 64]", lambda: maskc.truth(maskc.operand("topk")[q // 64, k // 64])),
    ("runs(img)[q] == runs(img)[k]", lambda: maskc.runs("img")[q].eq(maskc.runs("img")[k])),
    ("abs(q // 8 - k // 8) <= 1", lambda: abs(q // 8 - k // 8) <= 1),
    ("min(q, k) < max(q, 3)", lambda: maskc.minimum(q, k) < maskc.maximum(q, 3)),
    ("q < k <= q + 3", lambda: maskc.compare((q, k, q + 3), ("<", "<="))),
    ("q * 2 >= k - 1", lambda: q * 2 >= k - 1),
    ("2 * q % 5 > -k", lambda: 2 * q % 5 > -k),
    ("~causal", lambda: ~maskc.causal()),
    ("causal & chunk(4)", lambda: maskc.causal() & "chunk(4)"),
    ("sink(4) | causal", lambda: "sink(4)" | maskc.causal()),
]


@pytest.mark.parametrize("text,build", BUILDERS, ids=[b[0] for b in BUILDERS])
def test_builders_equal_parsed_text(text, build):
  built = build()
  assert built == maskc.parse(text)
  assert hash(built) == hash(maskc.parse(text))
  assert str(built) == text


def test_builder_constructs_check_values():
  with pytest.raises(maskc.MaskValueError):
    maskc.chunk(0)
  with pytest.raises(maskc.MaskValueError):
    maskc.sliding(-1)
  with pytest.raises(maskc.MaskTypeError):
    maskc.local(1)
  with pytest.raises(maskc.MaskTypeError):
    q * k


def test_mask_and_operand_read():
  img = maskc.operand("img")
  assert maskc.causal() & img[q] == maskc.parse("causal & img[q]")


def test_xor_of_operand_reads():
  img = maskc.operand("img")
  assert (img[q] ^ img[k]) == maskc.parse("img[q] ^ img[k]")


def test_operand_reads_combine_on_the_left():
  img = maskc.operand("img")
  assert img[q] & maskc.causal() == maskc.parse("img[q] & causal")
  assert img[q] | img[k] == maskc.parse("img[q] | img[k]")
  assert ~img[q] == maskc.parse("~img[q]")


# ----------------------------------------------------------------------------- operands


@pytest.mark.parametrize("text,expected", [
    ("causal & chunk(8192)", ()),
    ("causal & chunk(8192) | bidirectional(img)", (("img", "token", True),)),
    ("document(seg) & k < kv_len", (("kv_len", "scalar", False), ("seg", "token", False))),
    ("anc[q, k] | topk[q // 4, k // 4]", (("anc", "pair", True), ("topk", "pair", True))),
    ("seg[q] + 1 == seg[k]", (("seg", "token", False),)),
    ("img[q] & runs(img)[k] > 2", (("img", "token", True),)),
    ("prefix(plen)", (("plen", "scalar", False),)),
    ("z[q] & a[k] & m", None),
])
def test_operands(text, expected):
  if expected is None:
    with pytest.raises(maskc.MaskNameError):
      maskc.parse(text)
    return
  specs = maskc.parse(text).operands
  assert tuple((s.name, s.kind, s.boolean) for s in specs) == expected
  assert all(isinstance(s, maskc.ir.OperandSpec) for s in specs)


def test_operands_are_sorted_by_name():
  names = [s.name for s in maskc.parse("z[q] & a[k] & k < m").operands]
  assert names == ["a", "m", "z"]


# ----------------------------------------------------------------------------- equality, hashing


def test_equality_ignores_source_positions():
  a = maskc.parse("causal & chunk(8)")
  b = maskc.parse("causal   &   chunk( 8 )")
  assert a == b and hash(a) == hash(b)
  assert len({a, b, maskc.causal() & maskc.chunk(8)}) == 1


def test_different_masks_are_unequal():
  distinct = ["causal", "sliding(1)", "chunk(8)", "chunk(9)", "causal & chunk(8)",
              "chunk(8) & causal", "k <= q", "q >= k", "document(seg)", "document(ids)",
              "img[q]", "img[k]", "true", "full"]
  ms = [maskc.parse(t) for t in distinct]
  for i, a in enumerate(ms):
    for j, b in enumerate(ms):
      assert (a == b) == (i == j), (distinct[i], distinct[j])
  assert len(set(ms)) == len(ms)


def test_masks_compare_unequal_to_other_types():
  m = maskc.causal()
  assert m != "causal" and m != 3 and m is not None
  assert (m == object()) is False


def test_terms_compare_structurally_with_eq():
  assert q == q and (q + 1) == (q + 1) and (q + 1) != (q + 2)
  assert isinstance(q.eq(k), maskc.ir.Compare)


@given(mask_trees())
def test_equal_masks_hash_equal(m):
  again = maskc.parse(str(m))
  assert hash(again) == hash(m)
  assert {m: 1}[again] == 1


def test_ir_nodes_are_immutable():
  m = maskc.parse("causal & chunk(8)")
  with pytest.raises(AttributeError):
    m.items = ()


@pytest.mark.parametrize("value", [maskc.causal(), q < k, maskc.causal() & maskc.sink(2)])
def test_mask_has_no_truth_value(value):
  with pytest.raises(maskc.MaskTypeError) as info:
    bool(value)
  assert "`&`" in str(info.value) and "`and`" in str(info.value)
  with pytest.raises(maskc.MaskTypeError):
    if value and maskc.sink(1):
      pass


def test_chained_python_comparison_hints():
  with pytest.raises(maskc.MaskTypeError) as info:
    _ = q - 4 < k <= q  # Python evaluates `(q - 4 < k) and (k <= q)`
  assert "a < b <= c" in str(info.value)


def test_term_has_no_truth_value():
  with pytest.raises(maskc.MaskTypeError):
    bool(q + 1)


# ----------------------------------------------------------------------------- simplify


@given(mask_trees(), st.sampled_from(EVAL_SHAPES), st.integers(0, 3))
def test_simplify_preserves_meaning(m, shape, seed):
  s = m.simplify()
  np.testing.assert_array_equal(dense(s, *shape, seed), dense(m, *shape, seed),
                                err_msg=f"`{m}` simplified to `{s}`")


@given(mask_trees(), prefill_shapes(), st.integers(0, 3))
def test_simplify_preserves_meaning_at_random_shapes(m, shape, seed):
  np.testing.assert_array_equal(dense(m.simplify(), *shape, seed), dense(m, *shape, seed))


@given(mask_trees())
def test_simplify_is_idempotent(m):
  s = m.simplify()
  assert s.simplify() == s, (str(m), str(s), str(s.simplify()))
  assert maskc.parse(str(s)) == s


def test_simplify_is_idempotent_on_negated_xor():
  m = ~(maskc.causal() ^ maskc.sliding(1))
  s = m.simplify()
  assert s.simplify() == s, (str(s), str(s.simplify()))


def test_negated_chain_folds_constant_links():
  assert str(maskc.parse("~(q < 0 < 1)").simplify()) == "q >= 0"
  assert maskc.parse("~(q < 0 < 0)").simplify() == maskc.full()


def test_negated_chain_simplifies_again_to_a_fixed_point():
  s = maskc.parse("~(q < 0 < 1)").simplify()
  assert str(s.simplify()) == "q >= 0"  # a second pass folds what the first left


def test_xor_with_own_complement():
  assert (maskc.causal() ^ ~maskc.causal()).simplify() == maskc.full()


@given(mask_trees(5), mask_trees(5))
def test_simplify_is_canonical_under_commutativity(a, b):
  for x, y in [(a & b, b & a), (a | b, b | a), (a ^ b, b ^ a)]:
    sx, sy = x.simplify(), y.simplify()
    assert sx == sy and str(sx) == str(sy), (str(x), str(y), str(sx), str(sy))


@given(mask_trees(4), mask_trees(4), mask_trees(4))
def test_simplify_is_canonical_under_associativity(a, b, c):
  assert ((a & b) & c).simplify() == (a & (b & c)).simplify()
  assert ((a | b) | c).simplify() == (a | (b | c)).simplify()


def test_simplify_sorts_and_prints_canonically():
  x = maskc.parse("sink(4) | causal & chunk(8)").simplify()
  y = maskc.parse("chunk(8) & causal | sink(4)").simplify()
  assert x == y and str(x) == str(y)


@given(mask_trees(5), mask_trees(5))
def test_de_morgan(a, b):
  assert (~(a & b)).simplify() == (~a | ~b).simplify()
  assert (~(a | b)).simplify() == (~a & ~b).simplify()


@given(mask_trees())
def test_double_complement(m):
  assert (~~m).simplify() == m.simplify()


@given(mask_trees(5), mask_trees(5))
def test_absorption(a, b):
  assume(not isinstance(a.simplify(), (maskc.ir.And, maskc.ir.Or)))
  assert (a | (a & b)).simplify() == a.simplify()
  assert (a & (a | b)).simplify() == a.simplify()


def test_absorption_of_compound_masks():
  a = maskc.sliding(1) & maskc.chunk(1)
  assert (a | (a & maskc.causal())).simplify() == a.simplify()


@given(mask_trees())
def test_complement_laws(m):
  assert (m ^ m).simplify() == maskc.empty()
  assert (m ^ maskc.empty()).simplify() == m.simplify()
  assert (m & m).simplify() == m.simplify()
  assert (m | maskc.full()).simplify() == maskc.full()
  assert (m & maskc.empty()).simplify() == maskc.empty()
  assert (m & maskc.full()).simplify() == m.simplify()


@given(mask_trees())
def test_excluded_middle(m):
  # See the compound case below: a chained comparison's complement is a union, and one
  # such as `q < q >= q` is empty without the simplifier knowing it.
  for s in (m.simplify(), (~m).simplify()):
    assume(not isinstance(s, (maskc.ir.And, maskc.ir.Or)))
    assume(not (isinstance(s, maskc.ir.Compare) and len(s.ops) > 1))
  assert (m & ~m).simplify() == maskc.empty()
  assert (m | ~m).simplify() == maskc.full()


def test_excluded_middle_of_compound_masks():
  m = maskc.causal() & maskc.sliding(1)
  assert (m & ~m).simplify() == maskc.empty()
  chained = maskc.parse("q < n < q")
  assert (chained | ~chained).simplify() == maskc.full()


@pytest.mark.parametrize("text,expected", [
    ("~~causal", "causal"),
    ("~(k <= q)", "k > q"),
    ("~(q - 4 < k <= q)", "k > q | q - 4 >= k"),
    ("causal & full", "causal"),
    ("causal | empty", "causal"),
    ("causal & ~causal", "empty"),
    ("causal | causal & chunk(8)", "causal"),
    ("chunk(8) & causal", "causal & chunk(8)"),
    ("3 < 4", "full"),
    ("q < q + 0 | false", "q < q + 0"),
    ("causal ^ causal ^ sink(2)", "sink(2)"),
])
def test_simplify_examples(text, expected):
  s = maskc.parse(text).simplify()
  assert str(s) == expected
  assert_same_meaning(maskc.parse(text), s)


@given(prelude_combinations())
def test_prelude_combinations_simplify(m):
  s = m.simplify()
  assert_same_meaning(m, s, [(6, 6), (4, 9)])


# ----------------------------------------------------------------------------- the ground floor


def test_methods_from_above_the_ir_work_from_a_bare_import_of_the_ir():
  # `maskc.language.ir` imports nothing above it; importing it alone still loads the public face,
  # which attaches text, simplification, binding and the parser before anything runs.
  code = ("import maskc.language.ir as ir\n"
          "m = ir.compare((ir.Pos('q'), ir.Pos('k')), ('>=',))\n"
          "print(m & 'causal', repr(~m), (m & ~m).simplify(), m.to_dense(2, 3).sum(),\n"
          "      m.bind(3)[:, :].sum(), ir.nearest('casual', ['causal', 'chunk']), sep='|')\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  # q >= k at q_len 2, kv_len 3 (q_offset 1): rows q = 1, 2 allow 2 and 3 keys.
  assert out.stdout.strip().split("|") == [
      "q >= k & causal", "~(maskc.ir.q >= maskc.ir.k)", "empty", "5", "6", "causal"]


def test_unknown_mask_passed_as_a_mask_argument_names_the_nearest_prelude_mask():
  with pytest.raises(maskc.MaskNameError) as err:
    maskc.parse("f(x) = x & causal\nf(casual)")
  assert "Did you mean `causal`?" in err.value.hint
  assert "`casual[q]`" in err.value.hint


# ----------------------------------------------------------------------------- bounded expansion
# Each use of a definition copies its body, so definitions that use others twice double with
# each line. Every such text is refused with a MaskLimitError after building a bounded number
# of nodes (counted here through `_rebuild`, which builds each node `instantiate` makes).


def doubling(n: int) -> str:
  return ("d0 = q\n" + "\n".join(f"d{i} = d{i - 1} + d{i - 1}" for i in range(1, n))
          + f"\nd{n - 1} < k")


def min_chain(n: int) -> str:
  return ("d0 = q\n" + "\n".join(f"d{i} = min(d{i - 1}, d{i - 1} + 1)" for i in range(1, n))
          + f"\nd{n - 1} < k")


def parametric(n: int) -> str:
  return ("f0(x) = x\n" + "\n".join(f"f{i}(x) = f{i - 1}(x) + f{i - 1}(x + 1)"
                                    for i in range(1, n)) + f"\nf{n - 1}(q) < k")


def parametric_same_argument(n: int) -> str:
  return ("f0(x) = x\n" + "\n".join(f"f{i}(x) = f{i - 1}(x) + f{i - 1}(x)" for i in range(1, n))
          + f"\nf{n - 1}(q) < k")


def discarded_copies(n: int) -> str:
  # Each `z(d14)` copies d14 (2**15 nodes) and throws the copy away: no single step is
  # large, but together they are.
  return ("d0 = q\n" + "\n".join(f"d{i} = d{i - 1} + d{i - 1}" for i in range(1, 15))
          + "\nz(x) = 1\n" + " & ".join(["z(d14) < k"] * n))


@pytest.fixture
def built(monkeypatch):
  """Counts the nodes `instantiate` builds."""
  count = [0]
  rebuild = maskc.language.ir._rebuild

  def counting(*args):
    count[0] += 1
    return rebuild(*args)

  monkeypatch.setattr(maskc.language.ir, "_rebuild", counting)
  return count


BUILD_BOUND = maskc.language.parse.MAX_BUILT_NODES + 1


@pytest.mark.parametrize("family", [doubling, min_chain, parametric, parametric_same_argument])
@pytest.mark.parametrize("n", [20, 60, 200])
def test_exponential_definitions_are_refused_after_bounded_work(family, n, built):
  with pytest.raises(maskc.MaskLimitError):
    maskc.parse(family(n))
  assert built[0] <= BUILD_BOUND


def test_many_discarded_copies_are_refused_after_bounded_work(built):
  with pytest.raises(maskc.MaskLimitError) as err:
    maskc.parse(discarded_copies(1000))
  assert "expanding the definitions builds more than" in err.value.message
  assert built[0] <= BUILD_BOUND
  assert maskc.parse(discarded_copies(2)) == maskc.parse("1 < k & 1 < k")


def test_exponential_definitions_in_a_config_library_are_refused(built):
  with pytest.raises(maskc.MaskLimitError):
    maskc.load_config({"definitions": doubling(60).rsplit("\n", 1)[0], "layers": ["d59 < k"]})
  assert built[0] <= BUILD_BOUND


def test_the_largest_doubling_within_the_limit_is_accepted_and_exact(built):
  # d14 is q added to itself 2**14 times: 16384 * q < k, checked against NumPy.
  m = maskc.parse(doubling(15))
  assert built[0] <= BUILD_BOUND
  assert maskc.language.ir.expanded_size(m, 10**6) == 2**15 + 1
  qs, ks = np.meshgrid(np.arange(3), np.arange(40000, 40004), indexing="ij")
  np.testing.assert_array_equal(m.to_dense(3, 40004, q_offset=0)[:, 40000:], 16384 * qs < ks)


def test_the_budget_counts_every_expansion_in_a_block():
  twice = maskc.parse("twice(x) = x + x\ntwice(q) < k").terms[0]
  assert str(twice) == "q + q"
  x = maskc.language.ir.Param("x")
  definition = maskc.language.ir.Definition("twice", ("x",), x + x)
  with maskc.language.ir.build_budget(5):
    maskc.language.ir.call(definition, [q])  # 2 nodes: the sum and its shared parameter
    maskc.language.ir.call(definition, [k])  # 4
    with pytest.raises(maskc.MaskLimitError):
      maskc.language.ir.call(definition, [q + 1])
  maskc.language.ir.call(definition, [q + 1])  # no budget outside the block


def nested(n: int) -> str:
  return "f(" * n + "q" + ")" * n


def test_errors_quote_huge_terms_by_their_size():
  # f applied 60 times is 2**60 nodes as a tree, though 60 in memory.
  cases = {f"f(x) = x + x\n{nested(60)} * k < 1": (maskc.MaskTypeError, "`*` needs a constant"),
           f"f(x) = x + x\n{nested(60)}[q] < 1": (maskc.MaskTypeError, "only operands can"),
           f"f(x) = x + x\ng(y) = y < k where y > 0 & {nested(60).replace('q', 'k')} > 0\ng(-1)":
               (maskc.MaskValueError, "requires a mask of more than 200 nodes"),
           f"f(x) = x + x\n{nested(60)} // 0 < 1": (maskc.MaskValueError, "division by zero")}
  for text, (kind, message) in cases.items():
    with pytest.raises(kind) as err:
      maskc.parse(text)
    assert message in err.value.message
    assert len(str(err.value)) < 1000


def test_printing_a_huge_term_raises_instead_of_hanging():
  t = q
  for _ in range(60):
    t = t + t
  m = t < k
  assert maskc.language.ir.printed_size(m, 1000) == 1001
  for show in (str, repr):
    with pytest.raises(maskc.MaskLimitError, match="too large to print"):
      show(m)
  small = q + q < k
  assert maskc.language.ir.printed_size(small, 1000) == 5
  assert str(small) == "q + q < k" and maskc.language.ir.quote(small) == "`q + q < k`"
  assert maskc.language.ir.quote(m) == "a mask of more than 200 nodes"
  assert maskc.language.ir.quote(list(range(10**5))).endswith("99998, 99999]")
  assert len(maskc.language.ir.quote(list(range(10**5)))) < 200
