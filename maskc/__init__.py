"""maskc: an attention-mask compiler for JAX.

Write a mask as text, `causal & chunk(8192) | bidirectional(img)`, or with
Python builders; maskc parses it into an IR, simplifies it, evaluates it
densely, and lowers it to block-sparsity metadata for attention kernels.

>>> import maskc
>>> m = maskc.parse("causal & chunk(8192)")
>>> m == maskc.causal() & maskc.chunk(8192)
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING as _TYPE_CHECKING, Any as _Any

from maskc._errors import (BackendError as BackendError, MaskError as MaskError,
                           MaskLimitError as MaskLimitError, MaskNameError as MaskNameError,
                           MaskRecursionError as MaskRecursionError,
                           MaskSyntaxError as MaskSyntaxError, MaskTypeError as MaskTypeError,
                           MaskValueError as MaskValueError, OperandError as OperandError,
                           Span as Span)
from maskc._ir import (And as And, Arith as Arith, BoolConst as BoolConst, Call as Call,
                       Compare as Compare, Const as Const, Definition as Definition, Fn as Fn,
                       Mask as Mask, Neg as Neg, Node as Node, Not as Not, Operand as Operand,
                       OperandSpec as OperandSpec, Or as Or, PairRead as PairRead, Pos as Pos,
                       Read as Read, Scalar as Scalar, Term as Term, Truth as Truth, Xor as Xor)
from maskc import _ir, _printer, _simplify  # noqa: F401  (the last two attach to the IR)
from maskc._parse import known_mask_names as _known_mask_names, parse as parse
from maskc._builders import (bidirectional as bidirectional, causal as causal, chunk as chunk,
                             compare as compare, document as document, empty as empty,
                             full as full, global_ as global_, k as k, local as local,
                             maximum as maximum, minimum as minimum, operand as operand,
                             prefix as prefix, q as q, runs as runs, scalar as scalar,
                             sink as sink, sliding as sliding, truth as truth)
from maskc._bind import (ComputableMask as ComputableMask, additive_bias as additive_bias,
                         materialize as materialize)

if _TYPE_CHECKING:
  import numpy as np


def _mask_bind(self: Mask, q_len: int, kv_len: int | None = None, *,
               q_offset: int | None = None,
               operands: dict[str, _Any] | None = None) -> ComputableMask:
  """This mask at a shape with static operands: a lazy `ComputableMask`.

  >>> import maskc
  >>> maskc.parse("causal").bind(3)[1:, :].astype(int)
  array([[1, 1, 0],
         [1, 1, 1]])
  """
  return ComputableMask(self, q_len, kv_len, q_offset=q_offset, operands=operands)


def _mask_to_dense(self: Mask, q_len: int, kv_len: int | None = None, *,
                   q_offset: int | None = None,
                   operands: dict[str, _Any] | None = None) -> np.ndarray:
  """The mask as a NumPy bool array `[..., q_len, kv_len]`.

  >>> import maskc
  >>> maskc.parse("causal").to_dense(2, 3).astype(int)
  array([[1, 1, 0],
         [1, 1, 1]])
  """
  return self.bind(q_len, kv_len, q_offset=q_offset, operands=operands)[:, :]


# The IR imports nothing above it: the methods that need the binding and the parser are
# attached here, by the public face (see `maskc._ir`'s docstring), before the modules below
# are imported.
Mask.bind = _mask_bind
Mask.to_dense = _mask_to_dense
_ir.install_parser(parse, _known_mask_names)

from maskc._blockmap import BlockMap as BlockMap
from maskc._lower import compile as compile

__version__ = "0.1.0"
from maskc._config import (ConfigError as ConfigError, ConfigWarning as ConfigWarning,
                           MaskConfig as MaskConfig, MaskSpec as MaskSpec,
                           OperandDecl as OperandDecl, load_config as load_config,
                           mask_field as mask_field)
from maskc._show import MaskView as MaskView, show as show
from maskc._equivalence import equivalent as equivalent


def attention(*args, **kwargs):
  """Masked attention with a compiled mask: `maskc.kernels.attention` (see its docstring).

  Imported on first call, so `import maskc` loads no kernel code.
  """
  from maskc.kernels.api import attention as _attention
  return _attention(*args, **kwargs)
