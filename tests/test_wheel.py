"""The wheel: built from the sources, installed on its own, it imports and parses.

The editable install reads the checkout; this checks that a plain wheel carries every
subpackage of `maskc/`, the grammar's data files and `py.typed` too. The build runs offline
(`--no-build-isolation`, `--no-index`) from a copy of the sources, so the checkout gets no
`build/`.
"""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = ["pyproject.toml", "setup.cfg", "setup.py", "MANIFEST.in", "README.md", "LICENSE",
           "maskc"]


def _pip(*args, cwd):
  env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
             PYTHONNOUSERSITE="1")
  result = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, f"pip {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
  return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """A target directory holding maskc installed from a freshly built wheel."""
  pytest.importorskip("wheel", reason="building a wheel offline needs the `wheel` package")
  root = tmp_path_factory.mktemp("wheel")
  src, dist, target = root / "src", root / "dist", root / "target"
  src.mkdir()
  ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
  for name in SOURCES:
    path = REPO / name
    if path.is_dir():
      shutil.copytree(path, src / name, ignore=ignore)
    elif path.is_file():
      shutil.copy2(path, src / name)
  if not (src / "README.md").exists():  # pyproject's `readme`; the wheel needs the file
    (src / "README.md").write_text("maskc\n")
  _pip("wheel", str(src), "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist),
       cwd=root)
  wheels = list(dist.glob("maskc-*.whl"))
  assert len(wheels) == 1, wheels
  _pip("install", "--no-deps", "--no-index", "--target", str(target), str(wheels[0]), cwd=root)
  return root, target, wheels[0]


def test_wheel_contains_the_packages_and_data(installed):
  _, target, _ = installed
  assert (target / "maskc" / "__init__.py").is_file()
  assert (target / "maskc" / "py.typed").is_file()
  assert (target / "maskc" / "grammar" / "maskc.lark").is_file()
  assert (target / "maskc" / "grammar" / "prelude.mask").is_file()
  source = {p.relative_to(REPO).as_posix() for p in (REPO / "maskc").rglob("*.py")}
  installed = {p.relative_to(target).as_posix() for p in (target / "maskc").rglob("*.py")}
  assert source <= installed, sorted(source - installed)
  assert {"maskc/cli/commands.py", "maskc/kernels/xla.py",
          "maskc/lowering/closed_forms/band.py"} <= installed


def test_installed_wheel_imports_and_parses(installed):
  root, target, _ = installed
  code = textwrap.dedent(f"""
      import sys
      target = {str(target)!r}
      sys.path.insert(0, target)
      import maskc, maskc.grammar, maskc.kernels, maskc.cli
      for module in (maskc, maskc.grammar, maskc.kernels, maskc.cli):
        assert module.__file__.startswith(target), module.__file__
      m = maskc.parse("causal & chunk(8192)")
      assert m == maskc.causal() & maskc.chunk(8192)
      assert str(m) == "causal & chunk(8192)"
      assert maskc.materialize("causal", 3).sum() == 6
      assert "causal" in maskc.grammar.prelude_text()
      print("ok", maskc.__file__)
      """)
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
  env.update(PYTHONPATH=str(target), PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1")
  outside = root / "elsewhere"
  outside.mkdir(exist_ok=True)
  result = subprocess.run([sys.executable, "-c", code], cwd=outside, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith("ok " + str(target))


def test_installed_wheel_runs_the_cli(installed):
  root, target, _ = installed
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
  env.update(PYTHONPATH=str(target), PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1")
  code = (f"import sys; sys.path.insert(0, {str(target)!r}); from maskc.cli import main; "
          "sys.exit(main(sys.argv[1:]))")
  result = subprocess.run([sys.executable, "-c", code, "check", "causal | bidirectional(img)"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert "canonical:  causal | bidirectional(img)" in result.stdout


def test_wheel_declares_the_console_script(installed):
  _, target, _ = installed
  entry_points = next(target.glob("maskc-*.dist-info")) / "entry_points.txt"
  assert "maskc = maskc.cli:main" in entry_points.read_text()
