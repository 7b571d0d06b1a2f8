"""The command line: `router serve` and its configuration, the process supervisor, the demo, and the entry point."""

from router.cli.main import main

__all__ = ["main"]
