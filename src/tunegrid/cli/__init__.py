"""The `tunegrid` command: the parser (main) and what each command does (commands)."""

from tunegrid.cli.main import build_parser, main, run

__all__ = ["build_parser", "main", "run"]
