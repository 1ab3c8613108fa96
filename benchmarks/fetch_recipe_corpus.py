"""Fetch the public recipe corpus (benchmarks/recipe_corpus.tsv) into a folder, each file at its commit, laid out
as <owner>__<name>/<path> so that a recipe's relative paths (its data file, a model folder's config.json) resolve
as they did in its repository.

    python benchmarks/fetch_recipe_corpus.py <folder> [--held-out no|yes|all] [--git]

By default each file comes from raw.githubusercontent.com/<owner>/<name>/<commit>/<path>; `--git` instead
fetches each repository's commit into a bare clone beside the folder (`git fetch --depth 1 origin <commit>`) and
reads the files with `git show`. The files are others' work under their own licences (the list's `licence`
column): they are fetched to measure, never committed here. Rows of kind `data` are the files the recipes name
(a local dataset, a model folder's config) that their repository holds.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import urllib.request
from pathlib import Path

LIST = Path(__file__).with_name("recipe_corpus.tsv")


def rows(held_out: str) -> list[dict[str, str]]:
    with open(LIST, newline="") as handle:
        table = list(csv.DictReader(handle, delimiter="\t"))
    return [r for r in table if held_out == "all" or r["kind"] == "data" or r["held_out"] == held_out]


def by_url(row: dict[str, str]) -> bytes:
    url = f"https://raw.githubusercontent.com/{row['repo']}/{row['commit']}/{row['path']}"
    with urllib.request.urlopen(url, timeout=60) as response:  # noqa: S310 (a fixed https host)
        return response.read()


def by_git(row: dict[str, str], clones: Path) -> bytes:
    clone = clones / row["repo"].replace("/", "__")
    if not clone.is_dir():
        subprocess.run(["git", "init", "--bare", "-q", str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "remote", "add", "origin", f"https://github.com/{row['repo']}"],
                       check=True)  # fmt: skip
    have = subprocess.run(["git", "-C", str(clone), "cat-file", "-e", row["commit"]], capture_output=True)
    if have.returncode:
        subprocess.run(["git", "-C", str(clone), "fetch", "-q", "--depth", "1", "origin", row["commit"]], check=True)
    return subprocess.run(
        ["git", "-C", str(clone), "show", f"{row['commit']}:{row['path']}"], capture_output=True, check=True
    ).stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--held-out", default="no", choices=["no", "yes", "all"], help="which recipes (default: no)")
    parser.add_argument("--git", action="store_true", help="fetch with git instead of raw.githubusercontent.com")
    args = parser.parse_args()
    failed = 0
    for row in rows(args.held_out):
        dest = args.folder / row["repo"].replace("/", "__") / row["path"]
        if dest.is_file():
            continue
        try:
            text = by_git(row, args.folder.parent / f"{args.folder.name}.git") if args.git else by_url(row)
        except Exception as exc:  # a repository gone or renamed: said, and the rest fetched
            print(f"not fetched: {row['repo']} {row['commit']} {row['path']}: {exc}", file=sys.stderr)
            failed += 1
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(text)
    print(f"{args.folder}: {len(rows(args.held_out)) - failed} files ({failed} not fetched)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
