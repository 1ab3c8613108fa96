#!/usr/bin/env python
"""Entry point the Snakemake rules call: `python scripts/tunegrid.py <stage> ...` (see tunegrid.cli)."""

import sys
from pathlib import Path

# Works from a plain checkout too (a SLURM node without the editable install): the package is in src/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tunegrid.cli import run  # noqa: E402

if __name__ == "__main__":  # the probe's all-reduce ranks re-import this file (spawn): they must not re-run it
    run()
