"""CPU seconds per test, beside pytest's wall-clock `--durations`: on a shared or 2-core host a test's wall time
is mostly what the others left it, while its CPU time (this process's and every child it waited for: Snakemake,
its rules, the cell workers, those the session's warm worker forked for it) is what it costs. `--cpu-durations N`
prints the N costliest tests at the end (the suite's addopts ask for 30; a pytest-xdist run gathers them from its
workers)."""

from __future__ import annotations

import os
import resource
from typing import Any

import pytest

KEY = "cpu_s"


# Children of this process that outlive a test and fork work for it (the session's warm worker, tests/conftest.py):
# their CPU and that of the processes they reaped count as they go, since RUSAGE_CHILDREN holds a child's only once
# it is reaped. Whoever reaps one takes it out of here in the same step.
TRACKED: set[int] = set()


def _tracked_cpu(pid: int) -> float:
    """utime + stime + cutime + cstime of a live child, from /proc (0 where it cannot be read)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + sum(map(_tracked_cpu, TRACKED))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-durations",
        type=int,
        default=0,
        metavar="N",
        help="print the N tests that cost the most CPU seconds, their children's included (0: none)",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown":  # setup, call and teardown so far: the test's cost with its fixtures'
        report.user_properties.append((KEY, _cpu() - item.config.stash.get(_START, {}).get(item.nodeid, _cpu())))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.config.stash.setdefault(_START, {})[item.nodeid] = _cpu()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for key, value in report.user_properties:
        if key == KEY and report.when == "teardown":
            _COSTS[report.nodeid] = float(value)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    count = config.getoption("--cpu-durations")
    if not count or not _COSTS:
        return
    terminalreporter.write_sep("=", f"costliest {count} tests in CPU seconds (children included)")
    for nodeid, seconds in sorted(_COSTS.items(), key=lambda item: -item[1])[:count]:
        terminalreporter.write_line(f"{seconds:8.1f}s cpu  {nodeid}")
    terminalreporter.write_line(f"{sum(_COSTS.values()):8.1f}s cpu  all {len(_COSTS)} tests")


_START = pytest.StashKey[dict]()
_COSTS: dict[str, float] = {}
