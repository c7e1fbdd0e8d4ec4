"""The test suite's own layout, read from the source with `ast` (nothing is imported).

Test modules (`tests/test_*.py`) share code only through helper modules (`tests/helpers.py`,
`tests/sampling.py`, `tests/attention_reference.py`, the workers): no module under tests/
imports a test module, so each test file can be run, renamed or split alone, and pytest never
collects one test module's tests through another.
"""

from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent


def imported_modules(source: str) -> set[str]:
  """The top-level names of the modules `source` imports, wherever the import stands (in a
  function too); relative imports count by the module they name."""
  names = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names.update(alias.name.split(".")[0] for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module.split(".")[0])
    elif isinstance(node, ast.ImportFrom):  # `from . import test_x`
      names.update(alias.name.split(".")[0] for alias in node.names)
  return names


def imports_of_test_modules(folder: pathlib.Path) -> dict[str, set[str]]:
  """For each module under `folder` that imports one, the test modules (`test_*.py` of
  `folder`) it imports."""
  tests = {p.stem for p in folder.glob("test_*.py")}
  found = {}
  for path in sorted(folder.rglob("*.py")):
    hits = imported_modules(path.read_text(encoding="utf-8")) & (tests - {path.stem})
    if hits:
      found[str(path.relative_to(folder))] = hits
  return found


def test_no_module_imports_a_test_module():
  assert imports_of_test_modules(TESTS) == {}


def test_the_reader_sees_the_helpers_imported():
  """Not vacuous: the modules that share helpers are found importing them."""
  readers = {p.name for p in TESTS.glob("test_*.py")
             if "helpers" in imported_modules(p.read_text(encoding="utf-8"))}
  assert {"test_soundness.py", "test_lowering_rules.py", "test_splash_shards.py"} <= readers


def test_every_import_form_is_caught(tmp_path):
  (tmp_path / "test_a.py").write_text("def test_x():\n  pass\n")
  (tmp_path / "test_b.py").write_text("def test_y():\n  from test_a import test_x\n")
  (tmp_path / "test_c.py").write_text("import test_a as a\n")
  (tmp_path / "test_d.py").write_text("from . import test_a\n")
  (tmp_path / "helper.py").write_text("import test_a.sub\n")
  (tmp_path / "test_e.py").write_text("import helper, numpy\nfrom test_e import x\n")
  assert imports_of_test_modules(tmp_path) == {
      "test_b.py": {"test_a"}, "test_c.py": {"test_a"}, "test_d.py": {"test_a"},
      "helper.py": {"test_a"}}
