"""Which tests run in the same pytest-xdist worker (pyproject.toml runs the suite with `-n 2 --dist loadgroup`).

Tests that share a fixture made once per module (or class), or one of COSTLY_SESSION_FIXTURES, form one group:
one worker makes the fixture once and runs them in their order, as without xdist. So do the GPU tests (one
device) and tests that carry an explicit `xdist_group` mark. Every other test is a group of its own, handed to
whichever worker is free.

pytest-xdist 3.8's own loadgroup tells the controller a test's group by appending it to the test's id, which
pytest 9.2's structured ids no longer take (pytest-xdist#1386: the groups are silently ignored). Here each worker
writes the groups it collected to a file in the run's base temporary folder, and the controller's scheduler
(loadscope's, with these groups as its scopes) reads them once every worker has collected.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

# Session fixtures too costly to make once per worker. The others (a dataset, three tiny checkpoints: conftest
# makes those once for all workers; an empty store) take seconds.
COSTLY_SESSION_FIXTURES = frozenset({"default_study_clone"})
GROUPS_FILE = "xdist-groups-{}.json"


def shared_fixture_groups(items: list[Any]) -> dict[str, str]:
    """nodeid -> group, for the tests that must share a worker (the others are left out)."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    keys_of: dict[str, list[str]] = {}
    for item in items:
        keys = [
            f"mark:{mark.args[0] if mark.args else mark.kwargs.get('name', 'default')}"
            for mark in item.iter_markers("xdist_group")
        ]
        keys += ["gpu"] if item.get_closest_marker("gpu") else []
        for name, defs in item._fixtureinfo.name2fixturedefs.items():
            scope = defs[-1].scope
            if scope in ("module", "class", "package"):
                owner = item.getparent({"module": pytest.Module, "class": pytest.Class}.get(scope, pytest.Package))
                keys.append(f"{name} of {owner.nodeid if owner else scope}")
            elif name in COSTLY_SESSION_FIXTURES:
                keys.append(name)
        for key in keys[1:]:
            parent[root(key)] = root(keys[0])
        if keys:
            keys_of[item.nodeid] = keys
    return {nodeid: root(keys[0]) for nodeid, keys in keys_of.items()}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[Any]) -> None:
    """In a worker: the `slow` tests first, then its collection's groups, for the controller (every worker
    collects the same tests, so they agree on the order).

    Why slow first: the controller hands the groups out in collection order, and the costliest tests (end-to-end
    studies, minutes each) sit in tests/workflow, collected last; started last, the longest of them ran alone for
    minutes while the other worker had nothing left. Started first, the many short tests fill the end on both.
    A group's tests stay together (one worker runs them in a row), so no module fixture is made twice."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the rest keep their order
    folder = config._tmp_path_factory.getbasetemp().parent  # the controller's, above each worker's own
    path = folder / GROUPS_FILE.format(worker)
    path.with_suffix(".tmp").write_text(json.dumps(shared_fixture_groups(items)))
    path.with_suffix(".tmp").replace(path)


def groups_scheduler(config: pytest.Config, log: Any) -> Any:
    """loadscope's scheduler whose scopes are the groups the workers wrote (a test alone is its own scope)."""
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                written = sorted(Path(config._tmp_path_factory.getbasetemp()).glob(GROUPS_FILE.format("*")))
                assert written, "no pytest-xdist worker wrote its test groups (tests/xdist_groups.py)"
                self.groups = json.loads(written[0].read_text())
            return self.groups.get(nodeid, nodeid)

    return SharedFixtureScheduling(config, log)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return groups_scheduler(config, log) if config.getvalue("dist") == "loadgroup" else None
