"""A config's layers: which mask each layer uses, from a list or a repeating pattern with
overrides, and the per-head entries' head counts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from maskc.config.files import key_path
from maskc.config.mask_spec import Layer
from maskc.config.texts import MaskTexts
from maskc.config.where import Where, did_you_mean, shown
from maskc.language.errors import short_repr

# A layer's entry and where it sits; None for a layer that takes the default.
Entry = tuple[Layer | None, str]


def read_entry(texts: MaskTexts, value: Any, path: str) -> Layer | None:
  """A layer entry: mask text, `{mask: text}`, `{heads: [text, ...]}` or null (the
  default)."""
  where = texts.where
  if value is None:
    return None
  if isinstance(value, str):
    return texts.mask(value, path)
  if isinstance(value, Mapping):
    for key in value:
      if key not in ("mask", "heads"):
        raise where.error(f"unknown key `{shown(key)}` in a layer entry",
                          key_path(path, str(key)),
                          hint=did_you_mean(key, ("mask", "heads"))
                          + "A layer entry has `mask: text` or `heads: [text, ...]`.")
    if ("mask" in value) == ("heads" in value):
      raise where.error("a layer entry needs exactly one of `mask` and `heads`", path,
                        hint="{mask: causal} or {heads: [causal, \"sliding(128)\"]}")
    if "mask" in value:
      return texts.mask(value["mask"], key_path(path, "mask"))
    heads = value["heads"]
    hp = key_path(path, "heads")
    if isinstance(heads, str) or not isinstance(heads, Sequence) or not heads:
      raise where.error(f"heads must be a non-empty list of mask texts, got "
                        f"{short_repr(heads)}", hp)
    return tuple(texts.mask(h, key_path(hp, i)) for i, h in enumerate(heads))
  raise where.error(f"a layer entry is mask text, {{mask: ...}}, {{heads: [...]}} or null, "
                    f"got {type(value).__name__} {short_repr(value)}", path)


def read_layers(texts: MaskTexts, raw: Any, num_layers: int | None) -> list[Entry]:
  """`layers:`, a list of entries or `{pattern: [...], overrides: {i: entry}}`, as one
  entry per layer (`num_layers` of them when given)."""
  where = texts.where
  base = where.path("layers")
  if raw is None:
    if num_layers is None:
      raise where.error("the config gives neither `layers` nor `num_layers`", where.root,
                        hint="Add `num_layers: N` (every layer takes `default`) or a "
                             "`layers` list.")
    return [(None, "") for _ in range(num_layers)]
  if isinstance(raw, Sequence) and not isinstance(raw, str):
    if not raw:
      raise where.error("layers is an empty list", base)
    if num_layers is not None and len(raw) != num_layers:
      raise where.error(f"layers lists {len(raw)} layers but num_layers is {num_layers}", base,
                        hint="List one entry per layer, or use `layers: {pattern: [...]}` to "
                             "repeat a pattern.")
    return [(read_entry(texts, v, key_path(base, i)), key_path(base, i))
            for i, v in enumerate(raw)]
  if not isinstance(raw, Mapping):
    raise where.error(f"layers must be a list or {{pattern: [...]}}, got {type(raw).__name__}",
                      base)
  for key in raw:
    if key not in ("pattern", "overrides"):
      raise where.error(f"unknown key `{shown(key)}` in layers", key_path(base, str(key)),
                        hint=did_you_mean(key, ("pattern", "overrides"))
                        + "layers: {pattern: [...], overrides: {0: ...}}")
  if num_layers is None:
    raise where.error("a layer pattern needs num_layers", base,
                      hint="Add `num_layers: N`; the pattern repeats to fill N layers.")
  out: list[Entry] = [(None, "") for _ in range(num_layers)]
  pattern = raw.get("pattern")
  if pattern is not None:
    pp = key_path(base, "pattern")
    if isinstance(pattern, str) or not isinstance(pattern, Sequence) or not pattern:
      raise where.error(f"pattern must be a non-empty list of layer entries, got "
                        f"{short_repr(pattern)}", pp,
                        hint="pattern: [local, local, local, causal]")
    entries = [(read_entry(texts, v, key_path(pp, i)), key_path(pp, i))
               for i, v in enumerate(pattern)]
    out = [entries[i % len(entries)] for i in range(num_layers)]
  overrides = raw.get("overrides")
  if overrides is not None:
    op = key_path(base, "overrides")
    if not isinstance(overrides, Mapping):
      raise where.error(f"overrides must map layer numbers to entries, got "
                        f"{short_repr(overrides)}", op, hint="overrides: {0: causal}")
    for key, v in overrides.items():
      kp = key_path(op, str(key))
      i = key if isinstance(key, int) and not isinstance(key, bool) else (
          int(key) if isinstance(key, str) and key.strip().isdigit() else None)
      if i is None or not 0 <= i < num_layers:
        raise where.error(f"override key {short_repr(key)} is not a layer number in "
                          f"0..{num_layers - 1}", kp)
      out[i] = (read_entry(texts, v, kp), kp)
  return out


def check_heads(where: Where, masks: Sequence[Layer], layers: Sequence[Entry],
                num_heads: int | None) -> None:
  """Every per-head layer lists the same number of head masks, `num_heads` when given."""
  seen = None
  for (_, path), m in zip(layers, masks):
    if isinstance(m, tuple):
      path = path or where.path("default")
      n = len(m)
      if num_heads is not None and n != num_heads:
        raise where.error(f"the entry lists {n} head masks"
                          f" but num_heads is {num_heads}", key_path(path, "heads"),
                          hint="Give one mask per head.")
      if seen is not None and n != seen[0]:
        raise where.error(f"this entry lists {n} head masks but {seen[1]} lists {seen[0]}",
                          key_path(path, "heads"), hint="Give every per-head layer the same "
                                                    "number of heads, or set num_heads.")
      seen = seen or (n, key_path(path, "heads"))
