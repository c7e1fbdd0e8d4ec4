"""maskc: an attention-mask compiler for JAX.

Write a mask as text, `causal & chunk(8192) | bidirectional(img)`, or with the
Python builders; maskc parses it into an IR, simplifies it, evaluates it densely,
and lowers it to block-sparsity metadata for attention kernels.

>>> import maskc
>>> m = maskc.parse("causal & chunk(8192)")
>>> m == maskc.causal() & maskc.chunk(8192)
True

This module only re-exports. The verbs, the prelude builders, the errors and the
types public functions return live here; the IR node classes and the position
atoms `q`, `k` in `maskc.ir`; test helpers in `maskc.testing`; the kernels in
`maskc.kernels`, imported on first use (by `maskc.attention`, or on access to
`maskc.kernels`), so `import maskc` loads no Pallas.
"""

from typing import Any as _Any

from maskc import _deprecated, formats as formats, ir as ir
from maskc.attention import (
  MaskLike as MaskLike,
  attention as attention,
  sharded_attention as sharded_attention,
)
from maskc.compiled.blockmap import BlockMap as BlockMap
from maskc.config.mask_spec import MaskSpec as MaskSpec, mask_field as mask_field
from maskc.config.model import (
  ConfigWarning as ConfigWarning,
  MaskConfig as MaskConfig,
  OperandDecl as OperandDecl,
  load_config as load_config,
)
from maskc.formats.splash import from_splash as from_splash
from maskc.language import printer as _printer, simplify as _simplify  # noqa: F401  (install)
from maskc.language.builders import (
  bidirectional as bidirectional,
  causal as causal,
  chunk as chunk,
  compare as compare,
  document as document,
  empty as empty,
  full as full,
  global_ as global_,
  local as local,
  maximum as maximum,
  minimum as minimum,
  operand as operand,
  prefix as prefix,
  runs as runs,
  scalar as scalar,
  sink as sink,
  sliding as sliding,
  tree as tree,
  truth as truth,
)
from maskc.language.errors import (
  BackendError as BackendError,
  ConfigError as ConfigError,
  MaskError as MaskError,
  MaskLimitError as MaskLimitError,
  MaskNameError as MaskNameError,
  MaskRecursionError as MaskRecursionError,
  MaskSyntaxError as MaskSyntaxError,
  MaskTypeError as MaskTypeError,
  MaskValueError as MaskValueError,
  MissingExtraError as MissingExtraError,
  OperandError as OperandError,
  Span as Span,
)
from maskc.language.ir import Mask as Mask
from maskc.language.parse import parse as parse
from maskc.lowering.compile import compile as compile
from maskc.lowering.explain import (
  Explanation as Explanation,
  PartReport as PartReport,
  explain as explain,
)
from maskc.parallel.layout import Layout as Layout, balance as balance
from maskc.semantics.bind import ComputableMask as ComputableMask
from maskc.semantics.dense import additive_bias as additive_bias, materialize as materialize
from maskc.tools import trees as trees
from maskc.tools.equivalence import Equivalence as Equivalence, equivalent as equivalent
from maskc.tools.show import MaskView as MaskView, show as show
from maskc.tools.verify import Verification as Verification, verify as verify

__version__ = "0.2.0"

__all__ = [
    # verbs
    "parse", "compile", "explain", "materialize", "additive_bias", "attention", "sharded_attention",
    "balance", "equivalent", "verify", "load_config", "show", "mask_field", "from_splash",
    # the prelude and term builders
    "bidirectional", "causal", "chunk", "compare", "document", "empty", "full", "global_",
    "local", "maximum", "minimum", "operand", "prefix", "runs", "scalar", "sink", "sliding",
    "tree", "truth",
    # errors and warnings
    "MaskError", "MaskSyntaxError", "MaskNameError", "MaskTypeError", "MaskValueError",
    "MaskLimitError", "MaskRecursionError", "OperandError", "BackendError", "ConfigError",
    "MissingExtraError", "ConfigWarning", "Span",
    # types public functions take and return
    "Mask", "MaskLike", "ComputableMask", "BlockMap", "MaskConfig", "OperandDecl", "MaskSpec",
    "MaskView", "Equivalence", "Verification", "Layout", "Explanation", "PartReport",
    # modules
    "ir", "kernels", "formats", "config", "trees",
]

_deprecated.install()


def __getattr__(name: str) -> _Any:
  """`maskc.kernels`, imported on first access; and the names that moved to `maskc.ir`."""
  if name == "kernels":
    import importlib
    return importlib.import_module("maskc.kernels")
  if name in _deprecated.IR_NAMES:
    return _deprecated.ir_name(name)
  raise AttributeError(f"module 'maskc' has no attribute {name!r}")
