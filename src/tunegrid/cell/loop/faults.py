"""How a failure is named: exception classifiers for out-of-memory, collective timeouts and lost peers,
and the guard that turns PyTorch's "autograd kernel was not registered" warning into an error (a
gradient that silently skips a frozen base must never end `ok`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from tunegrid.vocabulary import Outcome

OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "defaultcpuallocator")


# PyTorch's fallback for an op with no autograd kernel (e.g. bitsandbytes' inference-only gemv_4bit) only
# warns, and the gradient through it is wrong or missing: a cell that sees it must end `error`, never `ok`.
MISSING_AUTOGRAD_WARNING = r".*an autograd kernel was not registered"


@contextlib.contextmanager
def missing_autograd_fails() -> Iterator[None]:
    """Turn PyTorch's missing-autograd-kernel warning into an exception (the cell's `error` with its text)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=MISSING_AUTOGRAD_WARNING)
        yield


def classify_exception(exc: BaseException) -> str:
    import torch

    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return Outcome.OOM
    if any(marker in str(exc).lower() for marker in OOM_MARKERS):
        return Outcome.OOM
    return Outcome.ERROR


COLLECTIVE_TIMEOUT_MARKERS = ("timed out", "watchdog caught collective operation timeout", "timeout")


PEER_LOST_MARKERS = ("connection closed by peer", "connection reset by peer", "remote worker crashing", "broken pipe")


def classify_distributed(exc: BaseException) -> str | None:
    text = str(exc).lower()
    if any(marker in text for marker in PEER_LOST_MARKERS):
        return "peer_lost"
    if any(marker in text for marker in COLLECTIVE_TIMEOUT_MARKERS):
        return "collective_timeout"
    return None
