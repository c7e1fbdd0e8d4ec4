"""The notebooks in notebooks/ are committed with their outputs, and those are what they print.

`make notebooks` (notebooks/run.py) re-runs them in place; this test runs them the same way
and compares.
"""

import importlib.util
import pathlib

import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
MAX_OUTPUT_BYTES = 48 * 1024   # one output (an SVG view, a PNG plot): no huge blobs
MAX_NOTEBOOK_BYTES = 160 * 1024


def _runner():
  spec = importlib.util.spec_from_file_location("notebook_runner", NOTEBOOKS / "run.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _comparable(outputs):
  """Outputs as compared: a PNG by its presence only (its bytes follow matplotlib's version)."""
  out = []
  for o in outputs:
    o = dict(o)
    if "data" in o:
      o["data"] = {k: ("<png>" if k == "image/png" else v) for k, v in o["data"].items()}
    out.append(o)
  return out


def test_the_notebooks_are_there():
  assert {"tour.ipynb", "model_configs.ipynb", "property_testing.ipynb"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_with_its_outputs(name):
  nbformat = pytest.importorskip("nbformat")
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), (
      f"{name} is not committed as one run from the top: run `make notebooks`")
  assert any(c.outputs for c in code)
  assert nb.metadata["language_info"] == {"name": "python"}
  assert not any("execution" in c.metadata for c in nb.cells)  # no timestamps
  for c in code:
    for o in c.outputs:
      assert o.output_type != "error", f"{name} holds an error output"
      assert len(nbformat.writes(nbformat.v4.new_notebook(cells=[
          nbformat.v4.new_code_cell(outputs=[o])]))) < MAX_OUTPUT_BYTES, (name, c.source)
  assert (NOTEBOOKS / name).stat().st_size < MAX_NOTEBOOK_BYTES


@pytest.mark.notebooks
@pytest.mark.parametrize("name", NAMES)
def test_notebook_prints_its_committed_outputs(name):
  nbformat = pytest.importorskip("nbformat")
  pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  committed = nbformat.read(NOTEBOOKS / name, as_version=4)
  fresh = _runner().execute(name)  # raises on a cell that raises
  for old, new in zip(committed.cells, fresh.cells, strict=True):
    if new.cell_type == "code":
      assert _comparable(new.outputs) == _comparable(old.outputs), (
          f"{name}: the cell\n{new.source}\nprints other outputs than committed: run "
          "`make notebooks` and commit the notebooks")
