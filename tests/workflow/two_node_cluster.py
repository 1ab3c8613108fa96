"""A real two-node SLURM for the multi-node tests: slurmctld on the host and two slurmd daemons, each in a network
namespace of its own with its own address, all started and stopped here.

The namespaces `tgnode1`/`tgnode2` each hold one end of a veth pair (10.77.0.2, 10.77.0.3); the host ends sit in a
bridge (`tgbr0`, 10.77.0.1, where slurmctld listens), so the nodes reach each other and the controller as two
machines on one switch would. Each slurmd runs inside its namespace (`ip netns exec`) under its own node name
(`slurmd -N`), so every job step it starts — a cell's supervisor, a rank — has that node's network and no other:
gloo between ranks on the two nodes crosses the veth links (and a `tc` limit on a node's end of its link slows
them: the slow-link fault). The file system is shared, as a cluster's is.

Everything created here is removed on the way out, whatever happened: the daemons stopped, the namespaces,
veths and bridge deleted, the config this helper wrote removed (`leftovers()` says what would remain).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from slurm_cluster import (
    ETC,
    MARKER,
    conf_text,
    munge_up,
    quiet,
    remove_config,
    short_spool,
    stop_daemons,
    wait_for_nodes,
)

BRIDGE = "tgbr0"
HOST_ADDR = "10.77.0.1"
NODES = {"tgnode1": "10.77.0.2", "tgnode2": "10.77.0.3"}  # node name = namespace name -> its address


def _host_veth(node: str) -> str:
    return f"tgv{node[-1]}h"


def _node_veth(node: str) -> str:
    return f"tgv{node[-1]}n"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """None where the cluster can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, slurmd)"
    for tool in ("ip", "tc", "nsenter", "munge", "sinfo", "srun", "sbatch"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    for daemon in ("munged", "slurmctld", "slurmd"):
        if not Path(f"/usr/sbin/{daemon}").exists():
            return f"/usr/sbin/{daemon} not found"
    probe = "tgprobe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def make_network() -> None:
    """The bridge, two namespaces and their veth links; undone by remove_network (also after a half-made one)."""
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{HOST_ADDR}/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    for node, addr in NODES.items():
        _ip("netns", "add", node)
        _ip("link", "add", _host_veth(node), "type", "veth", "peer", "name", _node_veth(node))
        _ip("link", "set", _node_veth(node), "netns", node)
        _ip("link", "set", _host_veth(node), "master", BRIDGE)
        _ip("link", "set", _host_veth(node), "up")
        _ip("-n", node, "addr", "add", f"{addr}/24", "dev", _node_veth(node))
        _ip("-n", node, "link", "set", _node_veth(node), "up")
        _ip("-n", node, "link", "set", "lo", "up")


def remove_network() -> None:
    for node in NODES:
        _ip("link", "del", _host_veth(node), check=False)  # its peer goes with it
        _ip("netns", "del", node, check=False)
    _ip("link", "del", BRIDGE, check=False)


def leftovers() -> list[str]:
    """What of this helper's network and processes still exists (empty once a cluster is torn down)."""
    found = [f"netns {name}" for name in _ip("netns", "list", check=False).stdout.split() if name in NODES]
    links = _ip("-o", "link", "show", check=False).stdout
    found += [
        f"link {name}" for name in (BRIDGE, *map(_host_veth, NODES)) if f" {name}:" in links or f" {name}@" in links
    ]
    found += [f"process {line}" for line in _ps_lines("tunegrid-2node")]
    return found


def _ps_lines(mark: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [line.strip() for line in out if mark in line and "ps -eo" not in line]


def node_processes(node: str, pattern: str) -> list[str]:
    """The processes matching `pattern` that run inside node's namespace (what `pgrep` inside it would find)."""
    found = _ip("netns", "pids", node, check=False).stdout.split()
    lines = []
    for pid in found:
        with suppress(OSError):
            args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if pattern in args:
                lines.append(f"{pid} {args.strip()}")
    return lines


def write_config(root: Path, spool: Path, cpus: int = 2, memory_mb: int = 8000, min_job_age_s: int = 60) -> Path:
    for sub in ("state", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for node in NODES:
        (spool / node).mkdir(parents=True, exist_ok=True)
    conf = ETC / "slurm.conf"
    if conf.exists() and MARKER not in conf.read_text():
        raise RuntimeError(f"{conf} exists and is not ours: not starting a test cluster over a real one")
    running = subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True, text=True).stdout.split()
    if running:  # another test's cluster on this host (its config would be overwritten under it, and ours by it)
        raise RuntimeError(f"a slurmctld already runs here (pid {', '.join(running)}): one test cluster at a time")
    ETC.mkdir(parents=True, exist_ok=True)
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    nodes = "".join(
        f"NodeName={node} NodeAddr={addr} CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN\n"
        for node, addr in NODES.items()
    )
    conf.write_text(conf_text("tunegrid-2node", f"{host}({HOST_ADDR})", root, f"{spool}/%n", min_job_age_s, nodes))
    return conf


@contextmanager
def two_node_cluster(root: Path, timeout_s: float = 40.0) -> Iterator[dict[str, str]]:
    """Network, munged (if none runs), slurmctld and the two slurmd; yield the env for sbatch/squeue/srun;
    stop and remove everything made here on the way out."""
    started: list[subprocess.Popen[bytes]] = []
    munge_started = False
    started_at = time.time()
    spool = short_spool()
    try:
        make_network()
        conf = write_config(root, spool)
        env = {**os.environ, "SLURM_CONF": str(conf)}
        munge_started = munge_up()
        started.append(subprocess.Popen(["/usr/sbin/slurmctld", "-D", "-f", str(conf)], env=env, **quiet()))
        for node in NODES:
            command = ["nsenter", f"--net=/run/netns/{node}", "/usr/sbin/slurmd", "-D", "-N", node, "-f", str(conf)]
            started.append(subprocess.Popen(command, env=env, **quiet()))
        wait_for_nodes(env, root, started, list(NODES), started_at + timeout_s)
        env["TUNEGRID_SLURM_STARTUP_S"] = f"{time.time() - started_at:.1f}"
        yield env
    finally:
        stop_daemons(started, munge_started)
        for node in NODES:  # a step a slurmd left behind dies with its namespace's processes
            for pid in _ip("netns", "pids", node, check=False).stdout.split():
                with suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        remove_network()
        remove_config()
        shutil.rmtree(spool, ignore_errors=True)
