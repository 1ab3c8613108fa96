"""What is installed: a package's version as the interpreter that runs tunegrid sees it (its metadata, never an
import of the package itself)."""

from __future__ import annotations

import importlib.metadata


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
