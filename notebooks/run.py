"""Executes the notebooks of this folder and writes them back with their outputs.

    python notebooks/run.py [NAME.ipynb ...]        # or: make notebooks

The outputs are committed, so they are kept deterministic: no timing metadata, the kernel's
language info cut to its name (its Python version differs between environments), printed
text in one output per stream however it was flushed, and execution counts from 1 in
order. `tests/test_notebooks.py` runs the notebooks the same way (`execute`) and checks
that the committed outputs are what they print.
"""

from __future__ import annotations

import pathlib
import sys

import nbclient
import nbformat

HERE = pathlib.Path(__file__).resolve().parent
TIMEOUT_S = 300  # per cell


def names() -> list[str]:
  """The notebooks of this folder, by file name."""
  return sorted(p.name for p in HERE.glob("*.ipynb"))


def execute(name: str) -> nbformat.NotebookNode:
  """The notebook `name`, executed top to bottom in a fresh kernel, its outputs normalized.

  Raises:
    nbclient.exceptions.CellExecutionError: a cell raised.
  """
  nb = nbformat.read(HERE / name, as_version=4)
  # "python3" is ipykernel's own spec; jupyter_client runs it with this interpreter.
  client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                                   record_timing=False,
                                   resources={"metadata": {"path": str(HERE)}})
  client.execute()
  return normalize(nb)


def normalize(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
  """`nb` without what differs between runs and environments but its outputs: timing
  metadata, the kernel's version, and how a cell's printed text was cut into messages
  (consecutive stream outputs of one name are joined, as a notebook shows them)."""
  nb.metadata["language_info"] = {"name": "python"}
  for cell in nb.cells:
    cell.metadata.pop("execution", None)
    if cell.cell_type != "code":
      continue
    outputs: list[nbformat.NotebookNode] = []
    for out in cell.outputs:
      last = outputs[-1] if outputs else None
      if (out.output_type == "stream" and last is not None and last.output_type == "stream"
          and last.name == out.name):
        last.text += out.text
      else:
        outputs.append(out)
    cell.outputs = outputs
  return nb


def main(argv: list[str]) -> int:
  for name in argv or names():
    nb = execute(name)
    path = HERE / name
    before = path.read_text()
    nbformat.write(nb, path)
    after = path.read_text()
    state = "unchanged" if after == before else "updated"
    print(f"{name}: {state}, {len(after.encode()) / 1024:.1f} KiB")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
