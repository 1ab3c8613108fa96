"""The repository speaks of itself only: no pointers to files a user of tunegrid does not have."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Pointers outside the project (a sibling folder, design notes that do not ship) or to how it was built.
OUTSIDE = re.compile(r"\.\./shared|CASES\.md|CASES §|DESIGN\.md|STYLE\.md|seed case|(?:were|was) lent|a later issue")


def test_no_reference_to_files_outside_the_project() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in tracked:
        path = REPO / name
        if name.startswith(".ci/") or not path.is_file() or path.suffix in {".png", ".parquet", ".db"}:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line) and name != "tests/test_hygiene.py":
                hits.append(f"{name}:{number}: {line.strip()}")
    assert not hits, "\n".join(hits)
