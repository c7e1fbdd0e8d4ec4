"""The notebooks in notebooks/ execute from top to bottom without an error."""

import pathlib

import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def test_the_notebooks_are_there():
  assert {"tour.ipynb", "model_configs.ipynb", "property_testing.ipynb"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_without_outputs(name):
  nbformat = pytest.importorskip("nbformat")
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, (
          f"{name} holds outputs; clear them before committing")


@pytest.mark.notebooks
@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes(name):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  # "python3" is ipykernel's own spec; jupyter_client runs it with this interpreter
  client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                   resources={"metadata": {"path": str(NOTEBOOKS)}})
  client.execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors
