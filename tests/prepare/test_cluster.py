"""What a SLURM cluster offers a cell (sinfo's partitions), and a cell no node can hold refused before it is
submitted, naming what it needs and what exists."""

from __future__ import annotations

import copy

from conftest import make_study

from tunegrid.cell_spec import CellSpec
from tunegrid.prepare.cluster import parse_sinfo
from tunegrid.study.config import cell_spec, expand_cells, resolve_study
from tunegrid.targets import cluster_shortfall

# `sinfo -h -e -o "%P|%c|%m|%G|%D|%a"` on a cluster with a default CPU partition (nodes of two sizes), a GPU
# partition whose generic resources carry a type and sockets, and a partition that is down
SINFO = """\
cpu*|2|7800|(null)|4|up
cpu*|8+|31000|(null)|2|up
gpu|32|500000|gpu:a100:4(S:0-1),shard:8|3|up
old|64|250000|gpu:8|1|down
"""


def test_sinfo_lines_become_partitions():
    parts = parse_sinfo(SINFO + "garbage line\n")
    assert [(p.name, p.default, p.cpus_per_node, p.gpus_per_node, p.nodes, p.up) for p in parts] == [
        ("cpu", True, 2, 0, 4, True),
        ("cpu", True, 8, 0, 2, True),
        ("gpu", False, 32, 4, 3, True),
        ("old", False, 64, 8, 1, False),
    ]
    assert parts[2].memory_mb_per_node == 500000


def _spec(world: int, threads: int, gpus_per_rank: int) -> CellSpec:
    raw = make_study(train={"steps": 3, "seq_len": 32, "threads": threads}, hardware={"gpus_per_rank": gpus_per_rank})
    raw["grid"]["world_size"] = [world]
    study = resolve_study(raw)
    return cell_spec(study, next(iter(expand_cells(study))))


def _capabilities(sinfo: str) -> dict:
    from dataclasses import asdict

    return {"device": "cpu", "cluster": {"scheduler": "slurm", "partitions": [asdict(p) for p in parse_sinfo(sinfo)]}}


def test_a_cell_no_node_can_hold_is_unsupported_naming_what_it_needs_and_what_exists():
    capabilities = _capabilities(SINFO)
    assert cluster_shortfall(_spec(2, 4, 0), capabilities) is None  # 8 cores: the larger cpu nodes
    assert cluster_shortfall(_spec(4, 8, 1), capabilities) is None  # 32 cores and 4 GPUs: a gpu node
    outcome, reason = cluster_shortfall(_spec(8, 1, 1), capabilities)  # 8 GPUs: only on the node that is down
    assert outcome == "unsupported"
    assert "needs 8 CPUs and 8 GPUs on one node" in reason and "gpu: 3 node(s) of 32 CPUs, 4 GPUs" in reason
    assert "old" not in reason  # a partition that is down is no offer
    outcome, reason = cluster_shortfall(_spec(4, 16, 0), capabilities)
    assert "needs 64 CPUs and 0 GPUs on one node" in reason and "train.threads 16" in reason


def test_without_a_recorded_cluster_nothing_is_decided():
    spec = _spec(64, 64, 1)
    assert cluster_shortfall(spec, {"device": "cpu"}) is None
    assert cluster_shortfall(spec, {"device": "cpu", "cluster": None}) is None
    empty = copy.deepcopy(_capabilities(SINFO))
    empty["cluster"]["partitions"] = None  # sinfo did not answer when the probe ran
    assert cluster_shortfall(spec, empty) is None
