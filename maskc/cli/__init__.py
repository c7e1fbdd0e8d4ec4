"""The `maskc` command line: `maskc check`, `maskc dense`, `maskc show`."""

from maskc.cli.commands import main as main

__all__ = ["main"]
