"""How quantities are written for people, in one place (the report, the recommender and the plan)."""

from __future__ import annotations

from typing import Any


def human_bytes(value: Any) -> str:
    """1024-based units, one decimal: "384.0 MiB", "13.0 GiB"; "n/a" for a missing value."""
    if value is None or value != value:
        return "n/a"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
