"""The shell commands of the README and docs run as written on a fresh clone.

`make demo` and `make test` install maskc (and jax) into `.venv` only, so a document that
runs `python <script>` or `maskc` must first say to activate `.venv`, or call
`.venv/bin/python` and `.venv/bin/maskc` itself.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ACTIVATE = "source .venv/bin/activate"
# A command that needs the venv: python running a script of the checkout, or the CLI.
COMMAND = re.compile(r"(?<![\w/.-])(python (?:examples|benchmarks)/\S+"
                     r"|maskc (?:check|dense|show)\b)")


@pytest.mark.parametrize("doc", ["README.md", "docs/flax.md", "docs/benchmarks.md"])
def test_commands_run_after_activating_the_venv(doc):
  text = (ROOT / doc).read_text()
  commands = list(COMMAND.finditer(text))
  assert commands, f"{doc} runs no script: update this test's list"
  activated = text.find(ACTIVATE)
  before = [m.group() for m in commands if activated < 0 or m.start() < activated]
  assert not before, (f"{doc} runs {before[0]!r} before it says `{ACTIVATE}` (or uses "
                      f"`.venv/bin/...`): on a fresh clone jax is only in .venv")


def test_the_readme_activates_the_venv_in_its_quick_start():
  text = (ROOT / "README.md").read_text()
  quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
  assert ACTIVATE in quick_start and ".venv/bin/python" in quick_start
