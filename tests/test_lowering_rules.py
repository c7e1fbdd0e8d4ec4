"""Each rule of the lowering's registry (`maskc.lowering.registry`) against the lowering
without it.

For every drawn mask, the rules its lowering took are turned off one at a time, and all of
them at once (the generic range analysis alone). Where the map is refined (a mask built
from prelude masks with `& | ^ ~`, or `exact=True`), each map must be the mask's exact
tiles, taken from the dense mask; otherwise each must be sound (never FULL or EMPTY where
the dense mask's tile is not). A part lowered by a rule the registry
calls exact (`Rule.exact`) has the exact tiles of its part even unrefined. Masks come from
`maskc.testing.masks()` (several operands of each kind, named calls and their bodies, `~`
and `^`) and from shapes that reach each rule, wrapped in `~` or `^` with another drawn
mask.
"""

from __future__ import annotations

import importlib

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

import maskc
from helpers import assert_exact, assert_sound
from maskc import testing
from maskc.compiled.tiles import grid_from_runs
from maskc.language import ir
from maskc.lowering.explain import _row_runs
from maskc.lowering.registry import BY_NAME, REGISTRY, RULES
from maskc.lowering.rules import STEPS, disabled, recording, taken
from sampling import PARTS, count

# Masks whose lowering takes each rule (at the shapes of `_shaped`), named or spelled out.
REACHES = {
    "periodic": ["causal & chunk(6)", "k <= q & q // 6 == k // 6", "sliding(5) ^ local(2, 3)"],
    "one_axis": ["img[k]", "~pfx[q] & k < n", "sink(n)"],
    "equal_reads": ["document(seg)", "bidirectional(img)", "runs(g)[q] == runs(g)[k] & g[q]"],
    "parts": ["causal & chunk(6) | bidirectional(img)", "local(4, 4) | g[q] | g[k]"],
    "band": ["causal & document(seg)", "sliding(5) | bidirectional(pfx)"],
    "widened_band": ["causal | bidirectional(img)", "causal & chunk(8) | bidirectional(g)",
                     "k <= q | runs(img)[q] == runs(img)[k] & img[q]"],
    "met_bounds": ["causal & document(seg)", "document(doc) & (causal | bidirectional(img))"],
    "distribute": ["document(seg) & (causal | img[k])",
                   "document(doc) & (sliding(4) | bidirectional(pfx) | g[k])"],
    "spread": ["document(seg) & (causal | bidirectional(img))",
               "document(seg) & (causal | document(doc))"],
    "tile_cover": ["bidirectional(img) & ~bidirectional(g)",
                   "document(seg) & seg[q] < seg[k] + 1 & (q - k) % 3 == 0"],
    "same_run_ids": ["bidirectional(img) & ~bidirectional(g)",
                     "bidirectional(pfx) ^ bidirectional(g)"],
    "row_intervals": ["causal & document(seg)", "causal | bidirectional(img)"],
    "diagonal_truth": ["causal & (document(seg) | bidirectional(img))",
                       "k <= q & (doc[q] == doc[k] | bidirectional(g))"],
    "aligned_pairs": ["a[q, k]", "causal & a[q, k]", "sel[q // 8, k // 8] & causal",
                      "~a[q, k] | sliding(5)"],
    "tree": ["tree(tin, tout)", "tin[k] <= tin[q] & tin[q] < tout[k]",
             "causal & tree(tin, tout)", "k < q & q <= end[k]"],
}
OPERANDS = testing.MASK_OPERANDS


def _values(rng: np.random.Generator, n: int) -> dict:
  """Sorted segment ids (documents) and image flags in runs, as models pass them; a pairwise
  matrix and a block selection of 8 x 8 blocks; and a tree of rollouts in DFS order (a
  prompt, then completions), its entry and exit times, and its exits' last position."""
  def spans():
    out = np.zeros(n, bool)
    for _ in range(rng.integers(1, 4)):
      a = int(rng.integers(0, n))
      out[a:a + int(rng.integers(1, max(2, n // 3)))] = True
    return out
  prompt = int(rng.integers(0, n))
  cuts = np.sort(rng.integers(prompt, n + 1, int(rng.integers(0, 4))))
  tree = maskc.trees.rollout(prompt, np.diff(np.concatenate([[prompt], cuts, [n]])).tolist())
  return {"seg": np.sort(rng.integers(0, 5, n)).astype(np.int32),
          "doc": np.sort(rng.integers(0, 3, n)).astype(np.int32),
          "img": spans(), "pfx": spans(), "g": spans(), "n": int(rng.integers(0, n)),
          "a": rng.random((n, n)) < rng.random(), "sel": rng.random((-(-n // 8),) * 2) < 0.3,
          "tin": tree["tin"], "tout": tree["tout"], "end": tree["tout"] - 1}


def test_every_rule_is_reached_by_its_masks():
  rng = np.random.default_rng(0)
  for rule, texts in REACHES.items():
    for text in texts:
      m = maskc.parse(text)
      ops = {s.name: v for s_name, v in _values(rng, 96).items() for s in m.operands
             if s.name == s_name}
      with taken() as fired:
        maskc.compile(m, 96, block_q=8, block_kv=8, operands=ops)
      assert rule in fired, f"{text} did not take {rule}: {sorted(fired)}"
  assert set(REACHES) == set(RULES)


def test_each_entry_states_its_contract():
  """Each rule is a module of `maskc/lowering/closed_forms/` that owns it (its name is the
  module's), acts at a step of its stage, and has what that step calls: part rules a
  match and a lower; combine rules a match on forms, and a lower but at step "decide" (a
  proof inside the combiner); analysis and interval rules a lower. Traced variants are
  functions."""
  assert len(BY_NAME) == len(REGISTRY)
  for rule in REGISTRY:
    assert rule.doc and rule.stage in ("part", "combine", "analysis", "intervals"), rule.name
    assert STEPS[rule.step][0] == rule.stage, rule.name
    module = importlib.import_module(f"maskc.lowering.closed_forms.{rule.name}")
    assert any(v is rule for v in vars(module).values()), rule.name
    if rule.stage in ("part", "combine"):
      assert rule.match is not None, rule.name
    if rule.step != "decide":
      assert rule.lower is not None, rule.name
    assert rule.traced is None or callable(rule.traced), rule.name
  assert {r.name for r in REGISTRY if r.traced} == {"parts", "widened_band", "same_run_ids"}


def test_no_rule_name_is_a_string_outside_its_module():
  """The lowering names a rule by its object, never by a string: outside docstrings, a rule's
  name is a string constant only in its own module (`Rule(name, ...)`)."""
  import ast
  import pathlib
  names = {rule.name for rule in REGISTRY}
  root = pathlib.Path(maskc.__file__).parent / "lowering"
  for path in root.rglob("*.py"):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body and
            isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and
             isinstance(n.value, str) and id(n) not in docs} & names
    assert found <= {path.stem}, (path, found - {path.stem})


def test_a_part_rule_matches_without_building():
  """`match` is pure: a part rule's match on a mask whose operands are not bound builds
  nothing and leaves the switch alone (the registry's `found` applies it)."""
  from maskc.lowering.closed_forms.equal_reads import EQUAL_READS
  from maskc.lowering.closed_forms.periodic import PERIODIC
  from maskc.lowering.grid.geometry import TileGeometry
  from maskc.lowering.registry import RULESET
  from maskc.lowering.rules import Site
  from maskc.semantics.shape import Shape
  site = Site(TileGeometry(Shape.of(4096, 4096, 0), 128, 128), None, None, False, None, RULESET)
  assert PERIODIC.match(maskc.parse("causal & chunk(512)"), site) == 512
  with disabled("periodic"):
    assert PERIODIC.found(maskc.parse("causal & chunk(512)"), site) is None
    assert PERIODIC.match(maskc.parse("causal & chunk(512)"), site) == 512
  assert EQUAL_READS.match(maskc.parse("causal"), site) is None


def test_unknown_rules_are_refused_with_the_known_ones():
  with pytest.raises(maskc.MaskValueError, match="unknown lowering rule") as e:
    with disabled("widened"):
      pass
  assert "widened_band" in e.value.hint
  with pytest.raises(maskc.MaskValueError, match="unknown lowering rule") as e:
    with disabled("widened_bnd", "band"):
      pass
  assert e.value.hint.startswith("Did you mean 'widened_band'?"), e.value.hint


def test_disabling_a_rule_keeps_a_separate_cache_entry():
  img = np.zeros(64, bool)
  img[10:30] = True
  with taken() as fired:
    a = maskc.compile("causal | bidirectional(img)", 64, block_q=8, block_kv=8,
                      operands={"img": img})
  with disabled("widened_band"), taken() as without:
    b = maskc.compile("causal | bidirectional(img)", 64, block_q=8, block_kv=8,
                      operands={"img": img})
  assert "widened_band" in fired and "widened_band" not in without
  np.testing.assert_array_equal(a.grid, b.grid)


@st.composite
def setups(draw):
  """(mask, q_len, kv_len, q_offset, block_q, block_kv, operands)."""
  reach = st.sampled_from(sorted(REACHES)).flatmap(
      lambda rule: st.sampled_from(REACHES[rule])).map(maskc.parse)
  other = testing.masks(max_depth=1)
  wrapped = st.one_of(
      reach, st.builds(lambda m: ~m, reach), st.builds(lambda a, b: a ^ b, reach, other),
      st.builds(lambda a, b: a & ~b, reach, other), st.builds(lambda a, b: a | b, reach, other))
  mask = draw(st.one_of(reach, reach, wrapped, testing.masks()), label="mask")
  q_len, kv_len, q_offset = draw(testing.shapes(max_len=72), label="shape")
  if draw(st.sampled_from([True, True, True, False]), label="run-structured operands"):
    span = max(kv_len, q_len + (q_offset if q_offset is not None else max(kv_len - q_len, 0)))
    rng = np.random.default_rng(draw(st.integers(0, 2**16), label="seed"))
    values = _values(rng, span + 1)
    ops = {s.name: values[s.name] for s in mask.operands if s.name in values}
    if set(ops) != {s.name for s in mask.operands}:
      ops = draw(testing.operand_values(mask, (q_len, kv_len, q_offset)))
  else:
    ops = draw(testing.operand_values(mask, (q_len, kv_len, q_offset)), label="operands")
  bq = draw(st.sampled_from([1, 2, 4, 8, 16]), label="block_q")
  bk = draw(st.sampled_from([1, 3, 4, 8, 16]), label="block_kv")
  return mask, q_len, kv_len, q_offset, bq, bk, ops


def check_rules(s, traced: bool = False, exact: bool = False) -> set[str]:
  """The maps with each rule taken turned off, and with all off, against the dense mask and
  each other; returns the rules taken."""
  mask, q_len, kv_len, q_offset, bq, bk, ops = s

  def grid(refined: bool):
    if traced:
      f = jax.jit(lambda ops: maskc.compile(mask, q_len, kv_len, block_q=bq, block_kv=bk,
                                            q_offset=q_offset, operands=ops).grid)
      return np.asarray(f(ops))
    return np.asarray(maskc.compile(mask, q_len, kv_len, block_q=bq, block_kv=bk,
                                    q_offset=q_offset, operands=ops, exact=refined).grid)

  dense = np.asarray(maskc.materialize(mask, q_len, kv_len, q_offset=q_offset, operands=ops))
  refined = (exact or ir.is_prelude_only(mask)) and not traced
  with taken() as fired:
    full = grid(exact)
  # `row_intervals` lowers no tiles: its form is checked against the tiles' hull by
  # tests/test_key_intervals.py
  ways = [(None, f"{mask}, every rule")] + [
      ((off,), f"{mask}, without {off}") for off in sorted(fired - {"row_intervals"})] + [
      ((), f"{mask}, without any rule")]
  for off, what in ways:
    if off is None:
      g = full
    else:
      with disabled(*off):
        g = grid(exact)
    # sound: never FULL or EMPTY where the dense mask's tile is not
    (assert_exact if refined else assert_sound)(g, dense, bq, bk, what)
  return fired


def check_exact_parts(s) -> set[str]:
  """Each part the static lowering lowered by a rule the registry calls exact has its part's
  exact tiles, unrefined; returns the rules checked."""
  mask, q_len, kv_len, q_offset, bq, bk, ops = s
  with recording() as rec:
    bm = maskc.compile(mask, q_len, kv_len, block_q=bq, block_kv=bk, q_offset=q_offset,
                       operands=ops)
  nb, nq, nk = bm.batch or 1, -(-q_len // bq), -(-kv_len // bk)
  checked = set()
  for part in rec.parts:
    if part.way not in BY_NAME or not BY_NAME[part.way].exact:
      continue
    runs = _row_runs(part.runs, nb, nq)
    got = grid_from_runs(np, runs, nk).reshape(nb, nq, nk)
    names = {o.name for o in part.mask.operands}
    dense = np.asarray(maskc.materialize(part.mask, q_len, kv_len, q_offset=q_offset,
                                         operands={k: v for k, v in ops.items()
                                                   if k in names}))
    assert_exact(got, dense.reshape((-1,) + dense.shape[-2:]), bq, bk,
                 f"part {part.mask} of {mask}, by {part.way}")
    checked.add(part.way)
  return checked


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                       HealthCheck.filter_too_much])


@pytest.mark.parametrize("part", PARTS)
def test_each_rule_agrees_with_the_lowering_without_it(part):
  @settings(max_examples=count(600, part), **_SETTINGS)
  @given(setups(), st.booleans())
  def check(s, exact):
    for rule in check_rules(s, exact=exact):
      event(f"took {rule}")
    for rule in check_exact_parts(s):
      event(f"exact part by {rule}")
  check()


@pytest.mark.parametrize("part", PARTS)
def test_each_traced_rule_agrees_with_the_lowering_without_it(part):
  @settings(max_examples=count(30, part), **_SETTINGS)
  @given(setups())
  def check(s):
    for rule in check_rules(s, traced=True):
      event(f"took {rule}")
  check()


# A jit compile per mask and rule: the default run takes the traced closed form, `-m slow` the
# other two (the drawn traced examples above reach them too).
@pytest.mark.parametrize("rule", ["widened_band", "aligned_pairs",
                                  pytest.param("same_run_ids", marks=pytest.mark.slow),
                                  pytest.param("parts", marks=pytest.mark.slow)])
def test_traced_rules_agree_with_the_traced_lowering_without_them(rule):
  rng = np.random.default_rng(1)
  texts = REACHES[rule] if rule != "parts" else ["causal & ~bidirectional(img)",
                                                 "sliding(9) & document(seg)"]
  for text in texts:
    m = maskc.parse(text)
    values = _values(rng, 80)
    ops = {s.name: values[s.name] for s in m.operands}
    fired = check_rules((m, 80, 80, None, 8, 8, ops), traced=True)
    assert rule in fired, f"{text} under jit did not take {rule}: {sorted(fired)}"
