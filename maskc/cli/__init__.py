"""The `maskc` command line: `maskc check`, `maskc dense`, `maskc show`, `maskc verify`,
`maskc config`."""

from maskc.cli.commands import main as main

__all__ = ["main"]
