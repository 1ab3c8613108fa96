"""The cell's training entry from a command line, for the warm worker's forked children (the same call
`tunegrid.cli worker` makes, without going through the CLI and everything it imports)."""

from __future__ import annotations

import argparse

from tunegrid.runtime.files import read_json


def run_worker_from_argv(argv: list[str]) -> int:
    """`... worker --spec S --model-dir M --data D --run-dir R`, as the supervisor's command line names them."""
    from tunegrid.cell.train import run_worker

    parser = argparse.ArgumentParser(prog="tunegrid worker")
    for option in ("--spec", "--model-dir", "--data", "--run-dir"):
        parser.add_argument(option, required=True)
    args = parser.parse_args(argv[argv.index("worker") + 1 :])
    run_worker(read_json(args.spec), args.model_dir, args.data, args.run_dir)
    return 0
