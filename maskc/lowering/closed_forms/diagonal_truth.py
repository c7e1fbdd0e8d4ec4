"""Rule `diagonal_truth`: tiles PARTIAL in two parts of an `&` that the diagonal crosses, in
a mask true at every pair `q == k`, are mixed with no pair evaluated.

Where both parts of an `&` are PARTIAL in a tile and exactly mixed there, the whole `&` is
not FULL, and one true pair proves it PARTIAL. A mask true at every `q == k` (`causal &
document(seg)`: `maskc.analysis.diagonal_truth` proves it from the IR) has that pair in
every tile the diagonal crosses: thousands of tiles for short documents, decided with no
evaluation. A combine rule at step "decide": the combiner asks it once per `&`.
"""

from __future__ import annotations

from maskc.analysis.diagonal_truth import true_on_diagonal
from maskc.language import ir
from maskc.lowering.rules import Rule


def match(m: ir.Mask) -> bool | None:
  """True where `m` is true at every pair `q == k`; else None."""
  return True if true_on_diagonal(m) else None


DIAGONAL_TRUTH = Rule(
    "diagonal_truth", "tiles PARTIAL in two parts of an `&` that the diagonal crosses, in a "
    "mask true at every q == k, mixed with no pair evaluated "
    "(maskc.lowering.closed_forms.diagonal_truth)", "combine", "decide", exact=True,
    match=match)
