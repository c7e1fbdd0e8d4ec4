"""Old import paths, kept for one release with a `DeprecationWarning` naming the new one.

The package was laid out by stage in 0.2.0: the IR node classes and the position
atoms moved from `maskc` to `maskc.ir`, and the flat private modules (`maskc._lower`,
`maskc._ir`, ...) into subpackages. Code that still imports an old name gets the
new object and a warning; the aliases go in the release after.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

IR_NAMES = frozenset({"And", "Arith", "BoolConst", "Call", "Compare", "Const", "Definition",
                      "Fn", "Neg", "Node", "Not", "Operand", "OperandSpec", "Or", "PairRead",
                      "Pos", "Read", "Scalar", "Term", "Truth", "Xor", "q", "k"})

MODULES = {
    "maskc._errors": "maskc.language.errors", "maskc._ir": "maskc.language.ir",
    "maskc._parse": "maskc.language.parse", "maskc._printer": "maskc.language.printer",
    "maskc._simplify": "maskc.language.simplify", "maskc._builders": "maskc.language.builders",
    "maskc._bind": "maskc.semantics.bind", "maskc._evaluate": "maskc.semantics.evaluate",
    "maskc._overflow": "maskc.semantics.overflow", "maskc._analysis": "maskc.semantics.ranges",
    "maskc._operand_arrays": "maskc.semantics.operand_arrays",
    "maskc._operand_runs": "maskc.semantics.operand_runs",
    "maskc._diagonal_period": "maskc.analysis.diagonal_period",
    "maskc._diagonal_truth": "maskc.analysis.diagonal_truth",
    "maskc._ragged": "maskc.arrays.ragged", "maskc._bit_words": "maskc.arrays.bit_words",
    "maskc._blockmap": "maskc.compiled.blockmap", "maskc._tiles": "maskc.compiled.tiles",
    "maskc._predicate": "maskc.compiled.predicate",
    "maskc._compile_predicate": "maskc.compiled.predicate_compiler",
    "maskc._splash_info": "maskc.kernels.splash.jax_info", "maskc._render": "maskc.compiled.render",
    "maskc._lower": "maskc.lowering.compile", "maskc._lower_static": "maskc.lowering.static",
    "maskc._lower_dynamic": "maskc.lowering.traced",
    "maskc._lowering_rules": "maskc.lowering.rules",
    "maskc._tile_geometry": "maskc.lowering.grid.geometry",
    "maskc._tile_refine": "maskc.lowering.grid.refine",
    "maskc._run_lists": "maskc.lowering.grid.run_lists",
    "maskc._band_runs": "maskc.lowering.grid.bands",
    "maskc._equal_reads": "maskc.lowering.closed_forms.equal_reads",
    "maskc._axis_reads": "maskc.lowering.closed_forms.one_axis",
    "maskc._pattern_lines": "maskc.lowering.grid.pattern_lines",
    "maskc._widened_band": "maskc.lowering.closed_forms.widened_band",
    "maskc._widened_traced": "maskc.lowering.closed_forms.widened_band",
    "maskc._same_run": "maskc.lowering.closed_forms.same_run_ids",
    "maskc._tile_cover": "maskc.lowering.closed_forms.tile_cover",
    "maskc._equivalence": "maskc.tools.equivalence", "maskc._show": "maskc.tools.show",
    "maskc._config": "maskc.config.model", "maskc._config_files": "maskc.config.files",
    "maskc._mask_spec": "maskc.config.mask_spec", "maskc._layout": "maskc.parallel.layout",
    "maskc._sharding": "maskc.parallel.sharding", "maskc._cli_args": "maskc.cli.args",
    "maskc._cli_operands": "maskc.cli.operands", "maskc._cli_show": "maskc.cli.show",
    "maskc.kernels._common": "maskc.kernels.common",
    "maskc.kernels._platform": "maskc.kernels.platform",
}


def warn(old: str, new: str) -> None:
  warnings.warn(f"`{old}` moved to `{new}`; the old name goes in the next release",
                DeprecationWarning, stacklevel=3)


def ir_name(name: str):
  """`maskc.<name>` for an IR name that moved to `maskc.ir`, with a warning."""
  warn(f"maskc.{name}", f"maskc.ir.{name}")
  return getattr(importlib.import_module("maskc.ir"), name)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Imports an old module path as the module at its new path, with a warning."""

  def find_spec(self, fullname, path=None, target=None):
    if fullname in MODULES:
      return importlib.util.spec_from_loader(fullname, self)
    return None

  def create_module(self, spec):
    warn(spec.name, MODULES[spec.name])
    return importlib.import_module(MODULES[spec.name])

  def exec_module(self, module) -> None:
    pass


def install() -> None:
  """Lets the old module paths import (once per interpreter)."""
  if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.append(_Alias())
