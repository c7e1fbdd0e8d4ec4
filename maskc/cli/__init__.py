"""The `maskc` command line: `maskc check`, `maskc dense`, `maskc show`."""

from maskc.cli.main import main as main

__all__ = ["main"]
