"""The README's Python examples run as written and show what the README says they show."""

import pathlib
import re

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _readme_line(pattern: str) -> str:
  """The one README line that matches `pattern`, its comment cut."""
  lines = [line for line in README.splitlines() if re.search(pattern, line)]
  assert len(lines) == 1, (pattern, lines)
  return lines[0].split("  #")[0].strip()


def test_explain_shows_the_image_span():
  # The quick start's mask and image span, then the Python section's explain call.
  scope = {"np": np, "maskc": __import__("maskc")}
  for pattern in (r"^m = maskc\.parse\(", r"^img = np\.zeros"):
    exec(_readme_line(pattern), scope)
  call = _readme_line(r"maskc\.explain\(")
  text = eval(call.removeprefix("print(").removesuffix(")"), scope)
  report = str(text)
  row = next(line for line in report.splitlines() if line.strip().startswith("bidirectional"))
  full, partial, _ = (int(x.replace(",", "")) for x in row.split()[2:5])
  # The span [1000, 3000) in 128-token tiles: 15 tiles inside it and 2 cut by its ends, on
  # each axis; the span's queries are in the explained rows.
  start, stop, tile = 1000, 3000, 128
  inside = sum(1 for t in range(32768 // tile) if t * tile >= start and (t + 1) * tile <= stop)
  touched = sum(1 for t in range(32768 // tile) if t * tile < stop and (t + 1) * tile > start)
  assert (full, partial) == (inside ** 2, touched ** 2 - inside ** 2) == (225, 64), report
