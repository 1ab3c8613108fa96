#!/usr/bin/env python3
"""Run each test that pytest selects in a process of its own, several side by side, each with its own temporary
folder: the GPU tests each run a whole study, and each study's cells claim the GPU through lock files in the
temporary folder, so in one folder the studies would train one after the other (one GPU, one claim at a time).
One after the other they take ~10 minutes on an H100; side by side, about as long as the longest.

    python scripts/gpu/pytest_each.py --workers 8 --junit-dir DIR -- -m gpu tests

Writes DIR/<n>.xml (JUnit) per test and DIR/collected.txt; exits 1 when a test failed or could not be collected.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def collect(selection: list[str], junit_dir: Path) -> tuple[list[str], list[str]]:
    """The selected test ids, and the lines of any module that could not be collected."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-n", "0", *selection],
        capture_output=True,
        text=True,
    )
    (junit_dir / "collected.txt").write_text(done.stdout + done.stderr)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line and not line.startswith(("ERROR", " "))]
    errors = [line.strip() for line in done.stdout.splitlines() if line.startswith("ERROR")]
    return ids, errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--junit-dir", type=Path, required=True)
    parser.add_argument("selection", nargs="+", help="pytest's selection: markers and paths (after --)")
    args = parser.parse_args()
    args.junit_dir.mkdir(parents=True, exist_ok=True)
    ids, errors = collect(args.selection, args.junit_dir)
    for line in errors:
        print(f"not collected: {line}", flush=True)
    print(f"{len(ids)} tests, {args.workers} at a time", flush=True)
    waiting = list(enumerate(ids))
    running: dict[int, tuple[str, subprocess.Popen, float, str]] = {}
    failed = bool(errors)
    while waiting or running:
        while waiting and len(running) < args.workers:
            number, test_id = waiting.pop(0)
            # a short temporary folder of its own (device claims, the warm worker's socket: at most 107 bytes);
            # the test's own folders (its study's results) under the JUnit folder, packed as evidence
            tmp = tempfile.mkdtemp(prefix=f"tg-test{number}-")
            env = {**os.environ, "TMPDIR": tmp}
            # -n 0: one test per process already; pyproject's `-n 2` would start two pytest-xdist workers for it
            command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-n", "0"]
            command += [f"--basetemp={args.junit_dir / f'test-{number}'}"]
            command += [f"--junitxml={args.junit_dir / f'{number}.xml'}", test_id]
            log = (args.junit_dir / f"{number}.log").open("w")
            running[number] = (
                test_id,
                subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT),
                time.monotonic(),
                tmp,
            )
        for number, (test_id, process, started, tmp) in list(running.items()):
            if process.poll() is None:
                continue
            del running[number]
            shutil.rmtree(tmp, ignore_errors=True)
            verdict = "ok" if process.returncode == 0 else f"exit {process.returncode}"
            failed |= process.returncode != 0
            print(f"{test_id}: {verdict} in {time.monotonic() - started:.0f} s", flush=True)
        time.sleep(0.5)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
