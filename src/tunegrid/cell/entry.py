"""The cell's training entry from a command line, for the warm worker's forked children (the same call
`tunegrid.cli worker` makes, without going through the CLI and everything it imports)."""

from __future__ import annotations

import argparse

from tunegrid.contract import CellContract


def run_worker_from_argv(argv: list[str]) -> int:
    """`... worker --contract C`, as the supervisor's command line names it (the cell's contract file)."""
    from tunegrid.cell.train import run_worker

    parser = argparse.ArgumentParser(prog="tunegrid worker")
    parser.add_argument("--contract", required=True)
    args = parser.parse_args(argv[argv.index("worker") + 1 :])
    run_worker(CellContract.read(args.contract))
    return 0
