"""The suite's scheduler (tests/xdist_groups.py): with three workers, the last runs only the groups whose every
test waits, and the others run the rest first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from xdist_groups import next_group, waiting_groups


def item(nodeid: str, waits: bool) -> SimpleNamespace:
    """A collected test as waiting_groups reads it: its id and its `waits` mark, or none."""
    return SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: name if waits and name == "waits" else None)


def test_a_group_waits_only_when_every_test_of_it_does():
    items = [item("a", True), item("b", True), item("c", True), item("d", False), item("e", False)]
    groups = {"b": "module b", "c": "module b", "d": "module d", "a": "a"}
    groups["e"] = "module b"  # a test of module b that uses the CPU: the whole group stays with the others
    assert waiting_groups(items, groups) == ["a"]
    assert waiting_groups([item("x", True)], {}) == ["x"]  # a test in no group is its own


@pytest.mark.parametrize(
    ("queue", "lane", "expected"),
    [
        (["cpu1", "wait1", "cpu2", "wait2"], True, "wait1"),
        (["cpu1", "wait1", "cpu2", "wait2"], False, "cpu1"),
        (["wait1", "cpu2"], False, "cpu2"),  # the others leave the waiting groups to the lane while they can
        (["wait2"], False, "wait2"),  # ... and take them once nothing else is left
        (["cpu1", "cpu2"], True, None),  # the lane stops: it never takes a CPU-bound group
        ([], False, None),
    ],
)
def test_the_lane_takes_the_waiting_groups_and_the_others_the_rest(queue, lane, expected):
    assert next_group(queue, {"wait1", "wait2"}, lane) == expected
