"""Missing optional dependencies: each error names the extra that installs it, in the form
that works from a checkout (`pip install -e ".[flax]"`), as `install_command` writes it."""

import subprocess
import sys

import pytest

import maskc
import maskc.testing
from maskc.cli import commands as cli
from maskc.language.errors import MissingExtraError, install_command


def test_install_command_names_the_extra_on_the_checkout():
  assert install_command("plot") == 'pip install -e ".[plot]"'


def test_import_maskc_flax_without_flax_names_the_extra():
  # A fresh interpreter in which `import flax` fails, as where Flax is not installed.
  code = ("import sys; sys.modules['flax'] = None\n"
          "import maskc\n"
          "try:\n  import maskc.flax\n"
          "except ImportError as e:\n"
          "  print(type(e).__name__, isinstance(e, maskc.MaskError)); print(e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       timeout=300).stdout
  assert out.splitlines()[0] == "MissingExtraError True", out
  assert "needs Flax" in out and 'pip install -e ".[flax]"' in out


def test_cli_png_without_matplotlib_names_the_extra(capsys, monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  code = cli.main(["show", "causal", "--q-len", "8", "--png", str(tmp_path / "m.png")])
  err = capsys.readouterr().err
  assert code == 1
  assert "--png needs matplotlib" in err and 'pip install -e ".[plot]"' in err and "--svg" in err


def test_testing_strategies_without_hypothesis_name_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "hypothesis.strategies", None)
  with pytest.raises(ImportError) as info:
    maskc.testing.masks()
  assert isinstance(info.value, MissingExtraError) and isinstance(info.value, maskc.MaskError)
  assert 'pip install -e ".[test]"' in str(info.value)
