"""A cell across nodes (`grid.nodes` > 1) on SLURM: the cell's job holds `nodes` nodes, one task each; its supervisor
runs in the first and starts each rank as a step of its own on its node (`srun --overlap --nodes=1 --ntasks=1
--nodelist=<node>`), with the environment torch.distributed's env:// rendezvous reads (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR = the first node's address, MASTER_PORT). Ranks fill the nodes in order (rank r on node
r // ranks_per_node). Each step is a process of the supervisor's, so it sees every rank's exit code (srun's
128 + signal read back as the signal) and stops a rank by stopping its step, on whatever node it runs; heartbeats,
logs and collective positions arrive through the shared run folder as on one node.

The slow-link fault (debug.slow_link) runs its rank under `python -m tunegrid.run.nodes slow-link`: a `tc` tbf
rate limit on the interface of that rank's node for the rank's life, removed when it ends; where the supervisor
stopped the rank (srun ends a step with SIGKILL), a step of `python -m tunegrid.run.nodes clear-link` on that node
removes it. Only a supervisor killed outright leaves it (`tc qdisc del dev <interface> root` removes it by hand).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tunegrid.cell_spec import CellSpec
from tunegrid.runtime.netif import NODE_ADDR_ENV, interface_of
from tunegrid.vocabulary import Outcome

# the allocation's identity: every other SLURM_* variable of the supervisor's own step (its task count, its node
# list, its CPU binding) would shape the rank's step instead of the flags given here
KEEP_SLURM = {"SLURM_JOB_ID", "SLURM_JOBID", "SLURM_CLUSTER_NAME", "SLURM_CONF", "SLURM_SUBMIT_DIR"}


class RankStep(subprocess.Popen[bytes]):
    """A rank's `srun` step: its exit code is the rank's, a signal that ended the rank read back from srun's
    128 + signal as the negative number subprocess gives a signalled child. `cleanup`: a command (a step on the
    rank's node) that undoes what the rank set up there, run once the supervisor has stopped it."""

    cleanup: tuple[list[str], dict[str, str]] | None = None

    def after_stop(self) -> None:
        """A stopped step's processes may have been killed (srun ends a step with SIGKILL) before they undid their
        set-up: undo it from here."""
        if self.cleanup is not None:
            command, env = self.cleanup
            try:
                subprocess.run(command, env=env, capture_output=True, timeout=60)
            except (OSError, subprocess.SubprocessError) as exc:
                print(f"could not undo a rank's set-up ({' '.join(command)}): {exc}", flush=True)

    @property
    def returncode(self) -> int | None:
        return self._code

    @returncode.setter
    def returncode(self, value: int | None) -> None:
        self._code = -(value - 128) if value is not None and 128 < value < 128 + 65 else value


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True, timeout=30).stdout


def allocation_nodes(env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """The job's nodes in order, each with its address (NodeAddr): [] outside a SLURM job."""
    env = dict(os.environ if env is None else env)
    job = env.get("SLURM_JOB_ID")
    if not job:
        return []
    # the job's own record: inside a job step (the SLURM executor runs the job's command under `srun -n1`) the
    # environment's node list can be the step's, one node
    found = re.search(r"\bNodeList=(\S+)", _scontrol("show", "job", "-o", job))
    listed = found.group(1) if found else env.get("SLURM_JOB_NODELIST") or ""
    names = _scontrol("show", "hostnames", listed).split() if listed else []
    nodes = []
    for name in names:
        found = re.search(r"\bNodeAddr=(\S+)", _scontrol("show", "node", "-o", name))
        nodes.append((name, found.group(1) if found else name))
    return nodes


def nodes_shortfall(spec: CellSpec, nodes: list[tuple[str, str]] | None = None) -> tuple[str, str] | None:
    """`unsupported` before launch for a cell across nodes outside a SLURM job that holds that many nodes."""
    wanted = spec.axes.nodes
    if wanted == 1:
        return None
    try:
        held = allocation_nodes() if nodes is None else nodes
    except (OSError, subprocess.SubprocessError) as exc:
        return Outcome.UNSUPPORTED, f"needs {wanted} nodes; scontrol could not list this job's: {exc}"
    if len(held) >= wanted:
        return None
    where = f"this SLURM job holds {len(held)}" if os.environ.get("SLURM_JOB_ID") else "not inside a SLURM job"
    return Outcome.UNSUPPORTED, (
        f"needs {wanted} nodes (grid.nodes; its ranks started with srun on each), {where}: "
        "run the study with `--profile slurm`"
    )


def step_env(env: dict[str, str]) -> dict[str, str]:
    """The environment a rank's step starts from: the job's identity kept, the supervisor's own step's shape and the
    supervisor's pid (meaningless on another node: the step ties the rank's life to the job instead) dropped."""
    from tunegrid.runtime.lifeline import SUPERVISOR_PID_ENV

    kept = {k: v for k, v in env.items() if not (k.startswith(("SLURM_", "SRUN_", "SBATCH_")) and k not in KEEP_SLURM)}
    kept.pop(SUPERVISOR_PID_ENV, None)
    return kept


def launch_on_nodes(spec: CellSpec, run_dir: Path, command: list[str], env: dict[str, str]) -> list[RankStep]:
    """One srun step per rank on its node; each rank's output in ranks/rank<r>.log."""
    from tunegrid.run.ui import free_port

    world, wanted = spec.axes.world_size, spec.axes.nodes
    nodes = allocation_nodes(env)[:wanted]
    per_node = world // wanted
    master = nodes[0][1]
    base = step_env(env)
    base.update(MASTER_ADDR=master, MASTER_PORT=str(free_port("0.0.0.0")), WORLD_SIZE=str(world))
    threads = str(spec.train.threads)
    slow = spec.debug.slow_link  # free-form: the fault's request, as the study wrote it (rank -1: none)
    steps: list[RankStep] = []
    for rank in range(world):
        name, addr = nodes[rank // per_node]
        rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank % per_node), NODE_ADDR_ENV: addr}
        srun = ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={name}", f"--cpus-per-task={threads}"]
        srun += ["--mem=0", "--cpu-bind=none", f"--job-name=rank{rank}", "--kill-on-bad-exit=0", "--quiet"]
        wrapped, module = command, [sys.executable, "-m", "tunegrid.run.nodes"]
        if slow.get("rank") == rank:
            wrapped = [*module, "slow-link", str(slow.get("rate", "2mbit")), "--", *command]
        log_path = run_dir / "ranks" / f"rank{rank}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            step = RankStep(
                [*srun, *wrapped], start_new_session=True, env=rank_env, stdout=log, stderr=subprocess.STDOUT
            )
        if wrapped is not command:  # a limit left on the node's link by a killed wrapper is removed after a stop
            clear = ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={name}", "--quiet"]
            step.cleanup = ([*clear, *module, "clear-link"], rank_env)
        steps.append(step)
        print(f"rank {rank}: srun step on {name} ({addr})", flush=True)
    return steps


def _tc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tc", "qdisc", *args], capture_output=True, text=True)


def clear_link() -> int:
    """Remove a tbf limit from the interface of this node's address (NODE_ADDR_ENV), where one is there."""
    device = interface_of(os.environ.get(NODE_ADDR_ENV, ""))
    if device is None or "tbf" not in _tc("show", "dev", device, "root").stdout:
        return 0
    return _tc("del", "dev", device, "root").returncode


def slow_link(rate: str, command: list[str]) -> int:
    """Run `command` with the link of this node's address (NODE_ADDR_ENV) limited to `rate` (tc tbf, root); the
    limit is removed when the command ends or this process is stopped. Returns the command's exit status, a signal
    that ended it re-raised on this process."""
    device = interface_of(os.environ.get(NODE_ADDR_ENV, ""))
    if device is None:
        print(f"slow_link: no interface holds {os.environ.get(NODE_ADDR_ENV)!r}; nothing limited", flush=True)
    else:
        made = _tc("replace", "dev", device, "root", "tbf", "rate", rate, "burst", "16kb", "latency", "500ms")
        print(f"slow_link: tc tbf rate {rate} on {device}: {made.returncode} {made.stderr.strip()}", flush=True)
    child = subprocess.Popen(command)
    signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))
    try:
        code = child.wait()
    finally:
        if device is not None:
            _tc("del", "dev", device, "root")
    if code < 0:  # ended by a signal: end the same way, so that srun reports it as the rank's
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "slow-link" and sys.argv[3] == "--":
        sys.exit(slow_link(sys.argv[2], sys.argv[4:]))
    if sys.argv[1:] == ["clear-link"]:
        sys.exit(clear_link())
    sys.exit("usage: python -m tunegrid.run.nodes slow-link <rate> -- <command ...> | clear-link")
