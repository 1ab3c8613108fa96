"""tunegrid's cache folder, one per user, as the Hugging Face hub keeps one: what costs minutes to make and
depends only on its inputs and the code that made it (a dequantized GGUF, prepare/gguf_cache.py; the probe's
calibration, run/calibration_cache.py), kept under a key that is the hash of those inputs.

<cache> is $TUNEGRID_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/tunegrid; TUNEGRID_CACHE=off turns every cache off
(each is then made afresh, every time). A cache only saves time: one that cannot be read or written is warned
about, and the work is done without it.

Light module: standard library only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CACHE_ENV = "TUNEGRID_CACHE"
OFF = "off"


def cache_root() -> Path | None:
    """Where the cache lives, or None when TUNEGRID_CACHE=off."""
    chosen = os.environ.get(CACHE_ENV, "")
    if chosen == OFF:
        return None
    if chosen:
        return Path(chosen).expanduser().absolute()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser().absolute() / "tunegrid"


def warn(message: str) -> None:
    """To stderr, which the rule sends to its log: the study goes on without the cache."""
    print(f"warning: tunegrid cache: {message}", file=sys.stderr, flush=True)
