"""A real one-node SLURM (Debian's slurm-wlm + munge) for the scheduler test: started and stopped here.

Minimal on purpose: proctrack/linuxproc, task/none, no accounting daemon (so `sacct` does not work and
the executor must poll with squeue; MinJobAge keeps finished jobs visible to squeue long enough).
Three fake GPUs (device files /dev/null, /dev/zero, /dev/full) so that a rule's `gpu=1` really becomes `--gpus=1`,
and a one-rank and a two-rank cell are scheduled side by side rather than one after the other.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")


def available() -> bool:
    return all(shutil.which(d) or Path(f"/usr/sbin/{d}").exists() for d in DAEMONS) and os.geteuid() == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


MARKER = "# written by tunegrid's tests/workflow/slurm_cluster.py; removed when the test ends"
ETC = Path("/etc/slurm")
FAKE_GPUS = ("/dev/null", "/dev/zero", "/dev/full")  # character devices every Linux has


def short_spool() -> Path:
    """A spool folder for slurmd with a short path. slurmstepd makes a Unix socket there per job step
    (`<node>_<job>.<step>`), and a socket's path holds at most 108 bytes: under a pytest folder (its run number,
    the xdist worker, the test's name) the path can be longer, and every job then fails to launch and is held."""
    return Path(tempfile.mkdtemp(prefix="tgspool", dir="/tmp"))


def conf_text(cluster: str, controller: str, root: Path, spool: str | Path, min_job_age_s: int, nodes: str) -> str:
    """slurm.conf for a test cluster: its controller, its `nodes` lines (a slurmd per node: `%n` in a path is the
    node's name), the state, logs and pid files under root, slurmd's spool `spool` (a short path: short_spool)."""
    return f"""\
{MARKER}
ClusterName={cluster}
SlurmctldHost={controller}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={root}/state
SlurmdSpoolDir={spool}
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge={min_job_age_s}
InactiveLimit=0
KillWait=5
{nodes}PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


def munge_up() -> bool:
    """Start munged if no munged answers; True when this call started it (stop_daemons then stops it)."""
    if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
        return False
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
    return True


def stop_daemons(started: list[subprocess.Popen[bytes]], munge_started: bool) -> None:
    """Cancel every job, stop the daemons started (last first), and munged where munge_up started it."""
    with suppress(Exception):
        subprocess.run(["scancel", "--full", "-u", "root"], capture_output=True, timeout=10)
    for proc in reversed(started):
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if munge_started:
        with suppress(ProcessLookupError, ValueError, FileNotFoundError):
            os.kill(int(Path("/run/munge/munged.pid").read_text().strip()), signal.SIGTERM)


def wait_for_nodes(
    env: dict[str, str], root: Path, started: list[subprocess.Popen[bytes]], nodes: list[str], deadline: float
) -> None:
    """Until sinfo shows every node idle (or mixed); past the deadline, or once a daemon has died, the daemons'
    logs in the error."""
    while True:
        state = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True)
        states = dict(line.split() for line in state.stdout.splitlines() if len(line.split()) == 2)
        if state.returncode == 0 and all(states.get(node) in ("idle", "mixed") for node in nodes):
            return
        if time.time() > deadline or any(p.poll() is not None for p in started):
            logs = "".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in (root / "log").glob("*.log"))
            raise RuntimeError(f"SLURM did not come up (sinfo: {state.stdout!r} {state.stderr!r}):\n{logs}")
        time.sleep(0.5)


def quiet() -> dict[str, int]:
    return {"stdout": subprocess.DEVNULL, "stderr": subprocess.STDOUT}


def write_config(root: Path, spool: Path, cpus: int = 8, memory_mb: int = 16000, min_job_age_s: int = 60) -> Path:
    """slurm.conf + gres.conf in /etc/slurm, the default path: the executor's job step strips every
    SLURM_* variable (SLURM_CONF included) before calling srun, so a config elsewhere is not found
    inside jobs. Refuses to touch a slurm.conf that this helper did not write."""
    host = socket.gethostname()
    for sub in ("state", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = ETC / "slurm.conf"
    if conf.exists() and MARKER not in conf.read_text():
        raise RuntimeError(f"{conf} exists and is not ours: not starting a test cluster over a real one")
    ETC.mkdir(parents=True, exist_ok=True)
    nodes = f"NodeName={host} CPUs={cpus} RealMemory={memory_mb} Gres=gpu:{len(FAKE_GPUS)} State=UNKNOWN\n"
    conf.write_text(conf_text("tunegrid-ci", host, root, spool, min_job_age_s, "GresTypes=gpu\n" + nodes))
    gres = "".join(f"NodeName={host} Name=gpu File={device}\n" for device in FAKE_GPUS)
    (ETC / "gres.conf").write_text(f"{MARKER}\n{gres}")
    return conf


def remove_config() -> None:
    for name in ("slurm.conf", "gres.conf"):
        path = ETC / name
        if path.exists() and MARKER in path.read_text():
            path.unlink()


@contextmanager
def slurm_cluster(root: Path, timeout_s: float = 30.0) -> Iterator[dict[str, str]]:
    """Start munged (if not running), slurmctld and slurmd; yield the env for sbatch/squeue; stop what we started."""
    spool = short_spool()
    conf = write_config(root, spool)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started: list[subprocess.Popen[bytes]] = []
    started_at = time.time()
    munge_started = munge_up()
    try:
        started.append(subprocess.Popen(["/usr/sbin/slurmctld", "-D", "-f", str(conf)], env=env, **quiet()))
        started.append(subprocess.Popen(["/usr/sbin/slurmd", "-D", "-f", str(conf)], env=env, **quiet()))
        wait_for_nodes(env, root, started, [socket.gethostname()], started_at + timeout_s)
        env["TUNEGRID_SLURM_STARTUP_S"] = f"{time.time() - started_at:.1f}"
        yield env
    finally:
        stop_daemons(started, munge_started)
        remove_config()
        shutil.rmtree(spool, ignore_errors=True)
