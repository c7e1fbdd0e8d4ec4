"""JAX's and tokamax's splash mask objects as maskc masks: `from_splash(mask)`.

Splash's masks are lazy objects over a shape `(q_len, kv_len)`: row `i`, column `j`. maskc's
rows are positions `q = q_offset + i` with `q_offset = kv_len - q_len` by default
(bottom-right alignment), columns `k = j`. So a splash row `i` is maskc position
`q = i + D`, `D = kv_len - q_len`, and an offset `o` of splash's `CausalMask` /
`LocalMask` (which shift row `i` to `i + o`) becomes a shift of `o - D`: a `CausalMask`
whose offset is `kv_len - q_len` (the decode alignment) is maskc's plain `causal`, one with
offset 0 on a wide shape is `k <= q - D`. `ChunkedCausalMask` has no offset (row `i` is
position `i`), so on a wide shape its chunks count from `q - D`.

Splash's modules are imported inside `from_splash`, never at `import maskc`.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from maskc.language.errors import MaskTypeError, MaskValueError, short_repr
from maskc.language.ir import Mask
from maskc.language.parse import parse
from maskc.lowering.compile import compile as compile_mask
from maskc.semantics.dense import materialize

# Where splash's mask classes live: JAX's Pallas TPU ops, and tokamax's copy.
_MODULES = ("jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask",
            "tokamax._src.ops.experimental.tpu.splash_attention.splash_attention_mask")
_CLASSES = ("FullMask", "CausalMask", "LocalMask", "ChunkedCausalMask", "NumpyMask",
            "LogicalAnd", "LogicalOr", "MultiHeadMask", "Mask")


@dataclasses.dataclass(frozen=True)
class SplashImport:
  """A splash mask object as maskc masks, with the arrays they read.

  Attributes:
    mask: the Mask, or a tuple of Masks (one per head) for a `MultiHeadMask`.
    operands: the arrays of `NumpyMask`s, as pairwise operands `[q_len, kv_len]` by name.
    q_len, kv_len: the splash mask's shape.

  `materialize()` is the splash object's own array, `mask[:, :]` (`[H, q_len, kv_len]`
  for heads), at maskc's default alignment (`q_offset = kv_len - q_len`).
  """
  mask: Mask | tuple[Mask, ...]
  operands: Mapping[str, np.ndarray]
  q_len: int
  kv_len: int

  def materialize(self) -> np.ndarray:
    """The dense bool mask, as `maskc.materialize` gives it."""
    out = materialize(self.mask if isinstance(self.mask, Mask) else list(self.mask), self.q_len,
                      self.kv_len, operands=dict(self.operands))
    return np.asarray(out)

  def compile(self, **options: Any) -> Any:
    """`maskc.compile` of the masks at the splash shape, with their operands."""
    return compile_mask(self.mask if isinstance(self.mask, Mask) else list(self.mask),
                        self.q_len, self.kv_len, operands=dict(self.operands), **options)


def _shift(d: int) -> str:
  """`q` shifted by d, as text."""
  return "q" if d == 0 else (f"q + {d}" if d > 0 else f"q - {-d}")


def _classes() -> dict[str, tuple[type, ...]]:
  """Each splash class name -> the classes of that name in JAX and tokamax (as installed)."""
  found: dict[str, list[type]] = {name: [] for name in _CLASSES}
  for module in _MODULES:
    try:
      mod = importlib.import_module(module)
    except ImportError:
      continue
    for name in _CLASSES:
      cls = getattr(mod, name, None)
      if isinstance(cls, type):
        found[name].append(cls)
  return {name: tuple(v) for name, v in found.items()}


class _Reader:
  """Turns one splash mask tree into mask text, collecting NumpyMask arrays."""

  def __init__(self, classes: dict[str, tuple[type, ...]], shape: tuple[int, int]):
    self.classes, self.shape = classes, shape
    self.d = shape[1] - shape[0]
    self.arrays: dict[str, np.ndarray] = {}

  def kind(self, obj: Any) -> str | None:
    for name, classes in self.classes.items():
      if name != "Mask" and type(obj) in classes:  # exact: a subclass may compute otherwise
        return name
    return None

  def check_rows(self, obj: Any, name: str) -> None:
    seq = getattr(obj, "q_sequence", None)
    if seq is not None and not np.array_equal(np.asarray(seq), np.arange(self.shape[0])):
      raise MaskValueError(
          f"this {name} has a permuted q_sequence (rows at positions {short_repr(seq)})",
          hint="maskc keeps masks apart from layouts: import the mask with rows in order, and "
               "pass the permutation as q_positions= to maskc.compile / maskc.materialize (see "
               "maskc.Layout).")

  def text(self, obj: Any) -> str:
    name = self.kind(obj)
    if name is None:
      raise MaskTypeError(
          f"from_splash does not know {type(obj).__module__}.{type(obj).__name__}",
          hint="It reads splash's own FullMask, CausalMask, LocalMask, ChunkedCausalMask, "
               "NumpyMask, MultiHeadMask and their & and | (JAX's or tokamax's). For another "
               "class, import its array: from_splash(NumpyMask(m[:, :])).")
    if tuple(obj.shape[-2:]) != self.shape:
      raise MaskValueError(f"a part of the mask has shape {obj.shape}, expected {self.shape}")
    d = self.d
    if name == "FullMask":
      return "full"
    if name in ("LogicalAnd", "LogicalOr"):
      op = " & " if name == "LogicalAnd" else " | "
      return f"({self.text(obj.left)}){op}({self.text(obj.right)})"
    if name == "NumpyMask":
      arr = np.asarray(obj.array, bool)
      key = next((k for k, v in self.arrays.items() if v is arr or np.array_equal(v, arr)), None)
      if key is None:
        key = f"splash_array{len(self.arrays)}"
        self.arrays[key] = arr
      return f"{key}[{_shift(-d)}, k]"
    self.check_rows(obj, name)
    if name == "CausalMask":
      delta = int(obj.offset) - d
      return "causal" if delta == 0 else f"k <= {_shift(delta)}"
    if name == "LocalMask":
      left, right = obj.window_size
      delta = int(obj.offset) - d
      if left is None and right is None:
        return "full"
      if delta == 0 and left is not None and right is not None:
        return f"local({int(left)}, {int(right)})"
      parts = []
      if left is not None:
        parts.append(f"{_shift(delta - int(left))} <= k")
      if right is not None:
        parts.append(f"k <= {_shift(delta + int(right))}")
      return " & ".join(parts)
    if name == "ChunkedCausalMask":
      c = int(obj.chunk_size)
      if d == 0:
        return f"causal & chunk({c})"
      row = _shift(-d)
      return f"({row}) // {c} == k // {c} & k <= {row}"
    raise AssertionError(name)  # MultiHeadMask is read by from_splash itself


def from_splash(obj: Any) -> SplashImport:
  """A JAX (or tokamax) splash mask object as maskc masks.

  Reads `FullMask`, `CausalMask` and `LocalMask` (with their offsets), `ChunkedCausalMask`,
  `NumpyMask` (as a pairwise operand), `MultiHeadMask` (one mask per head; JAX's only,
  tokamax gives one mask to every head) and the `&` / `|` combinations of any of them,
  from JAX's `jax.experimental.pallas.ops.tpu.splash_attention` or tokamax's copy.

  Args:
    obj: a splash mask object.

  Returns:
    A `SplashImport`: `.mask` (a Mask, or a tuple per head), `.operands` (NumpyMask
    arrays), `.q_len`, `.kv_len`; `.materialize()` equals `obj[:, :]` (module docstring:
    how offsets map to maskc's alignment).

  Raises:
    MaskTypeError: a class from_splash does not know (a subclass included: it may compute
      something else), or an object that is no splash mask.
    MaskValueError: rows in a permuted order (`q_sequence`), or parts of unequal shapes.

  >>> from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  >>> import maskc
  >>> m = maskc.from_splash(sm.LocalMask((4, 6), window_size=(1, 0), offset=2)
  ...                       & sm.CausalMask((4, 6), offset=2))
  >>> str(m.mask)
  'local(1, 0) & causal'
  """
  mask: Any = obj
  classes = _classes()
  shape = getattr(mask, "shape", None)
  is_splash = any(isinstance(mask, cls) for cls in classes["Mask"])
  if not is_splash or not isinstance(shape, tuple) or len(shape) not in (2, 3):
    raise MaskTypeError(f"from_splash takes a splash mask object, got {type(mask).__name__}",
                        hint="For a dense array m, pass NumpyMask(m) (a pairwise operand).")
  q_len, kv_len = int(shape[-2]), int(shape[-1])
  reader = _Reader(classes, (q_len, kv_len))
  if type(mask) in classes["MultiHeadMask"]:
    heads = tuple(parse(reader.text(m)) for m in mask.masks)
    result: Mask | tuple[Mask, ...] = heads
  else:
    result = parse(reader.text(mask))
  return SplashImport(mask=result, operands=dict(reader.arrays), q_len=q_len, kv_len=kv_len)
