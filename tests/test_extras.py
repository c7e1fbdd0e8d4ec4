"""Missing optional dependencies: each error names the extra that installs it, in the form
that works from a checkout (`pip install -e ".[flax]"`), as `install_command` writes it."""

import sys

import pytest

import maskc
import maskc.testing
from maskc.cli import commands as cli
from maskc.language.errors import MissingExtraError, install_command


def test_install_command_names_the_extra_on_the_checkout():
  assert install_command("plot") == 'pip install -e ".[plot]"'


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
