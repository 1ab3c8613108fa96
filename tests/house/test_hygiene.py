"""The repository speaks of itself only: no pointers to files a user of tunegrid does not have."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Pointers outside the project (a sibling folder, design notes that do not ship) or to how it was built.
# (spaces written as [ ] so that this line does not match itself)
OUTSIDE = re.compile(
    r"\.\./shared|CASES\.md|CASES[ ]§|DESIGN\.md|STYLE\.md|seed[ ]case|(?:were|was)\s+lent|a[ ]later[ ]issue"
)


def test_no_reference_to_files_outside_the_project() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in tracked:
        path = REPO / name
        if name.startswith(".ci/") or not path.is_file():
            continue
        if path.suffix in {".png", ".parquet", ".db", ".safetensors"}:
            continue
        text = path.read_text(errors="replace")
        for match in OUTSIDE.finditer(text):  # whole text: a phrase may wrap across lines
            hits.append(f"{name}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)!r}")
    assert not hits, "\n".join(hits)
