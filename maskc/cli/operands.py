"""Operand values written on the command line: `--operand img=0,0,1*4,0`.

The syntax is small on purpose, so a mask can be tried from a shell without
writing Python:

- a bare integer, `4096`, is a scalar operand (`k < kv_len`);
- comma-separated items make a per-token array, each item an integer (`3`,
  `-1`) or `v*n`, the value `v` repeated `n` times (`0*3,1*5,0*4`);
- `@path.npy` loads any array (pairwise `[Lq, Lk]`, batched `[B, L]`, ...)
  with `numpy.load`;
- `LEN:DEFAULT,VALUE:START-STOP,...` writes a long per-token array by its
  ranges: LEN values, DEFAULT except on each half-open `[START, STOP)` (or at
  one position, `VALUE:POS`), so `32768:0,1:1000-2000` is one image span of
  1000 tokens in 32K (see `parse_ranges`). At least one range follows the
  `LEN:DEFAULT` head; a constant array is `v*n`.

Each item is parsed by `_parse_item`, so new item forms (ranges, say) slot in
there without touching the rest.
"""

from __future__ import annotations

import re

import numpy as np

from maskc.language.errors import MaskValueError

MAX_OPERAND_ITEMS = 1 << 22  # values one text may expand to: bounds memory on `1*99999999999`

_INT = re.compile(r"[+-]?[0-9]+")
_SYNTAX = "comma-separated integers or `v*n` (v repeated n times), a bare integer, or @file.npy"


def parse_operand_value(text: str) -> np.ndarray | int:
  """Parses one operand value from its command-line text.

  Args:
    text: `5` (a scalar), `0,0,1,1` or `0*2,1*2` (a 1-D int64 array), or `@path.npy`.

  Returns:
    An int for a bare integer, else a NumPy array.

  Raises:
    MaskValueError: the text is not in this syntax, or the file cannot be loaded.

  >>> parse_operand_value("0*2,1*3,0")
  array([0, 0, 1, 1, 1, 0])
  """
  if not isinstance(text, str):
    raise MaskValueError(f"an operand value must be text, got {type(text).__name__}")
  stripped = text.strip()
  if not stripped:
    raise MaskValueError("the operand value is empty", hint=f"Write {_SYNTAX}.")
  if stripped.startswith("@"):
    return _load(stripped[1:])
  if _INT.fullmatch(stripped):
    return int(stripped)
  if ":" in stripped and "," in stripped:
    return parse_ranges(stripped)
  pieces: list[np.ndarray] = []
  total = 0
  for position, item in enumerate(stripped.split(","), start=1):
    values = _parse_item(item.strip(), position, text)
    total += values.size
    if total > MAX_OPERAND_ITEMS:
      raise MaskValueError(f"the operand value expands to more than {MAX_OPERAND_ITEMS} entries",
                           hint="Load long operands from a file: `@values.npy`.")
    pieces.append(values)
  return np.concatenate(pieces).astype(np.int64)


def _parse_item(item: str, position: int, text: str) -> np.ndarray:
  """One comma-separated item as a 1-D array: `3` or `v*n`."""
  if not item:
    raise MaskValueError(f"item {position} of {text!r} is empty",
                         hint="Separate values with single commas, without a trailing comma; a "
                              "one-value array is `v*1`.")
  if _INT.fullmatch(item):
    return np.array([int(item)], dtype=np.int64)
  value, star, count = item.partition("*")
  value, count = value.strip(), count.strip()
  if star and _INT.fullmatch(value) and _INT.fullmatch(count):
    n = int(count)
    if n < 0:
      raise MaskValueError(f"a repeat count cannot be negative, got {item!r} in {text!r}",
                           hint="`v*n` repeats v n times, n >= 0.")
    if n > MAX_OPERAND_ITEMS:
      raise MaskValueError(f"the operand value expands to more than {MAX_OPERAND_ITEMS} entries",
                           hint="Load long operands from a file: `@values.npy`.")
    return np.full(n, int(value), dtype=np.int64)
  raise MaskValueError(f"cannot read item {position}, {item!r}, of the operand value {text!r}",
                       hint=f"Write {_SYNTAX}.")


_RANGE_HEAD = re.compile(r"([0-9]+):([+-]?[0-9]+)")
_RANGE_ITEM = re.compile(r"([+-]?[0-9]+):([0-9]+)(?:-([0-9]+))?")
_RANGE_SYNTAX = "LEN:DEFAULT,VALUE:START-STOP,... (e.g. 32768:0,1:1000-2000)"


def parse_ranges(text: str) -> np.ndarray:
  """A per-token array written as ranges: `LEN:DEFAULT,VALUE:START-STOP,...`.

  The first item gives the length and the value everywhere else; each later item
  (at least one) sets `VALUE` on the half-open range `[START, STOP)`, or at one
  position with `VALUE:POS`. Later items win where ranges overlap. For example
  `32768:0,1:1000-2000` is 32768 zeros with positions 1000 to 1999 set to 1: one
  image span for `bidirectional(img)`.

  Args:
    text: the ranges, without spaces or with spaces around items.

  Returns:
    A 1-D int64 array of length `LEN`.

  Raises:
    MaskValueError: an item is not in this form, a range is empty or reversed, or
      reaches past `LEN`, or `LEN` is larger than `MAX_OPERAND_ITEMS`.

  >>> parse_ranges("8:0,1:2-5,7:7")
  array([0, 0, 1, 1, 1, 0, 0, 7])
  """
  head, *items = [item.strip() for item in text.split(",")]
  match = _RANGE_HEAD.fullmatch(head)
  if not match or not items:
    raise MaskValueError(f"a range operand is LEN:DEFAULT and one or more VALUE:START-STOP, "
                         f"got {text!r}",
                         hint=f"Write {_RANGE_SYNTAX}.")
  length, default = int(match.group(1)), int(match.group(2))
  if not 0 <= length <= MAX_OPERAND_ITEMS:
    raise MaskValueError(f"a range operand's length must be 0 to {MAX_OPERAND_ITEMS}, got "
                         f"{length} in {text!r}", hint="Load long operands from a file: "
                                                       "`@values.npy`.")
  values = np.full(length, default, dtype=np.int64)
  for position, item in enumerate(items, start=2):
    match = _RANGE_ITEM.fullmatch(item)
    if not match:
      raise MaskValueError(f"cannot read item {position}, {item!r}, of the range operand "
                           f"{text!r}", hint=f"Write {_RANGE_SYNTAX}.")
    value, start = int(match.group(1)), int(match.group(2))
    stop = start + 1 if match.group(3) is None else int(match.group(3))
    if not start < stop <= length:
      raise MaskValueError(f"the range {item!r} in {text!r} is empty or reaches past the "
                           f"length {length}", hint="Ranges are half open, START-STOP with "
                                                    f"START < STOP <= {length}.")
    values[start:stop] = value
  return values


def _load(path: str) -> np.ndarray:
  """An array from a `.npy` file, refusing pickles."""
  if not path:
    raise MaskValueError("`@` must be followed by a file path", hint="`img=@img.npy`.")
  try:
    value = np.load(path, allow_pickle=False)
  except FileNotFoundError:
    raise MaskValueError(f"no such operand file: {path}") from None
  except (OSError, ValueError, EOFError) as e:
    raise MaskValueError(f"cannot load the operand file {path}: {e}",
                         hint="Save operands with `numpy.save`, as a .npy file.") from None
  if not isinstance(value, np.ndarray):  # an .npz archive
    value.close()
    raise MaskValueError(f"{path} holds several arrays (.npz); give one array as a .npy file")
  return value
