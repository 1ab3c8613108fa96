"""Building a library stack: a virtual environment layered on the environment tunegrid runs in, with the
stack's pins installed by pip from the package registry (tunegrid.study.stacks names its folder and key).

    results/stacks/<key>/pip.log     pip's output of the build, beside what tunegrid.study.stacks lists

The stack's own site-packages come first on its sys.path, so a pinned package shadows the base's copy and
everything unpinned (torch, peft, bitsandbytes, tunegrid's own dependencies) is the base's. pip runs from the
base (`pip --python <stack python> install`): it sees the base's packages as installed outside the stack and
never touches them. A set of pins pip cannot resolve is refused with pip's own account of the conflict.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import site
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tunegrid.study.errors import ConfigError
from tunegrid.study.stacks import (
    FREEZE_FILE,
    RECORD_FILE,
    REPORTED_PACKAGES,
    base_identity,
    requirements,
    stack_dir,
    stack_python,
)

BASE_PTH = "_tunegrid_base.pth"
PIP_TIMEOUT_S = 1800


class StackError(ConfigError):
    """A stack that cannot be built (pip cannot resolve its pins, or the registry cannot be reached)."""


# pip's account of a failed resolution: the "ERROR:" lines and the block after "The conflict is caused by:"
_CONFLICT_BLOCK = re.compile(r"The conflict is caused by:\n((?:[ \t]+\S.*\n?)+)")
_ERROR_LINE = re.compile(r"^ERROR: (.+)$", re.MULTILINE)
_UNRESOLVED = (
    "ResolutionImpossible",
    "No matching distribution",
    "Could not find a version",
    "conflicting dependencies",
)


def pip_refusal(name: str, reqs: list[str], output: str) -> str:
    """One message for a stack pip could not install: the stack, its pins, pip's errors and the conflict."""
    errors = [line.strip() for line in _ERROR_LINE.findall(output) if "dependency resolver does not" not in line]
    conflict = _CONFLICT_BLOCK.search(output)
    detail = "; ".join(errors[:3]) or (output.strip().splitlines() or ["pip failed without output"])[-1]
    if conflict:
        causes = [line.strip() for line in conflict.group(1).splitlines() if line.strip()]
        detail += "; the conflict is caused by: " + "; ".join(causes)
    unresolved = any(marker in output for marker in _UNRESOLVED)
    why = "pip cannot resolve" if unresolved else "pip failed to install"
    return (
        f"stack {name!r} cannot be built: {why} {' '.join(reqs)}: {detail}. Change the pins under 'stacks.{name}' "
        "(or the package index pip reads)"
    )


def _base_site_dirs() -> list[str]:
    """The base's site-packages, in its own order (a venv's, or the interpreter's own)."""
    dirs = [p for p in site.getsitepackages() if Path(p).is_dir()]
    user = site.getusersitepackages()
    if site.ENABLE_USER_SITE and Path(user).is_dir():
        dirs.append(user)
    return dirs


def _make_venv(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # `import` lines of a .pth run at start-up: addsitedir also reads the base's own .pth files (editable
    # installs), which a plain path line would not
    lines = [f"import site; site.addsitedir({d!r})" for d in _base_site_dirs()]
    (Path(purelib) / BASE_PTH).write_text("\n".join(lines) + "\n")


def _versions(python: Path, packages: list[str]) -> dict[str, str]:
    code = (
        "import json, sys, importlib.metadata as m\n"
        "def v(n):\n"
        "    try:\n        return m.version(n)\n"
        "    except m.PackageNotFoundError:\n        return ''\n"
        "print(json.dumps({n: v(n) for n in sys.argv[1:]}))"
    )
    done = subprocess.run([str(python), "-c", code, *packages], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _layered(python: Path) -> dict[str, str]:
    """The packages the stack installed itself (its own site-packages), each with its version."""
    code = (
        "import json, sysconfig, importlib.metadata as m\n"
        "found = m.distributions(path=[sysconfig.get_paths()['purelib']])\n"
        "print(json.dumps({d.metadata['Name']: d.version for d in found}))"
    )
    done = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True)
    return dict(sorted(json.loads(done.stdout.strip().splitlines()[-1]).items()))


def _disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def build_stack(
    name: str, pins: dict[str, str], results: str | Path, pip_args: tuple[str, ...] = (), log: Any = None
) -> dict[str, Any]:
    """The stack's record, building its environment unless the cache holds it (then `reused` is true).

    One build per key at a time (a lock file): two studies asking for the same pins build it once."""
    log = log or sys.stdout
    folder = stack_dir(results, pins)
    folder.mkdir(parents=True, exist_ok=True)
    reqs = requirements(pins)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record_path = folder / RECORD_FILE
        if record_path.exists():
            record = json.loads(record_path.read_text())
            print(f"stack {name!r}: reusing {folder} (built {record['built_at']}, {record['build_s']:.0f} s)", file=log)
            if "runtime_baseline_bytes" not in record:  # built by an earlier version: measured once, kept
                record["runtime_baseline_bytes"] = runtime_baselines(stack_python(folder))
                _write_record(record_path, record)
            return {**record, "name": name, "reused": True}
        started = time.time()
        venv = folder / "venv"
        shutil.rmtree(venv, ignore_errors=True)  # a build that died half-way
        _make_venv(venv)
        python = stack_python(folder)
        command = [sys.executable, "-m", "pip", "--python", str(python), "install", "--disable-pip-version-check"]
        command += ["--no-input", *pip_args, *reqs]
        print(f"stack {name!r}: {' '.join(command)}", file=log, flush=True)
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        (folder / "pip.log").write_text(done.stdout + done.stderr)
        print(done.stdout + done.stderr, file=log, flush=True)
        if done.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            raise StackError(pip_refusal(name, reqs, done.stdout + done.stderr))
        freeze = subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(python), "freeze", "--disable-pip-version-check"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        (folder / FREEZE_FILE).write_text(freeze)
        record = {
            "name": name,
            "key": folder.name,
            "pins": dict(pins),
            "requirements": reqs,
            "base": base_identity(),
            "python": str(python.absolute()),  # not resolved: the venv's python is a link to the base's
            "versions": _versions(python, sorted({*REPORTED_PACKAGES, *pins})),
            "layered": _layered(python),  # what pip installed into the stack, over the base
            # pip's warnings about base packages that declare other versions of what the stack pins
            "base_conflicts": [line for line in (done.stdout + done.stderr).splitlines() if " requires " in line],
            "build_s": round(time.time() - started, 1),
            "disk_bytes": _disk_bytes(venv),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "runtime_baseline_bytes": runtime_baselines(python),
        }
        _write_record(record_path, record)  # written last: its presence is what "built" means
        return {**record, "reused": False}


FRESH_BASELINE = "from tunegrid.runtime.memory import runtime_baseline_bytes\nprint(runtime_baseline_bytes())"
SOURCE = Path(__file__).resolve().parent.parent.parent  # the folder tunegrid is imported from


def fresh_runtime_baseline_bytes(python: str = "") -> int | None:
    """The runtime baseline (tunegrid.runtime.memory.runtime_baseline_bytes) of a fresh process of `python` (a
    library stack's interpreter; default this process's), tunegrid imported from where this process imports it;
    None if it fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SOURCE), os.environ.get("PYTHONPATH")]))}
    line = [python or sys.executable, "-c", FRESH_BASELINE]
    done = subprocess.run(line, capture_output=True, text=True, env=env, timeout=900, check=False)
    lines = done.stdout.strip().splitlines()
    return int(lines[-1]) if done.returncode == 0 and lines and lines[-1].isdigit() else None


def runtime_baselines(python: Path) -> dict[str, int | None]:
    """What a fresh process holds with the training stack imported (tunegrid.runtime.memory.runtime_baseline_bytes),
    in the stack's interpreter and in the base's, one after the other: the memory estimate adds the difference to a
    stack cell's runtime (tunegrid.study.stacks.stack_memory; transformers 4.57's imports hold ~90 MiB more than
    5.23's on a CPU)."""
    return {"stack": fresh_runtime_baseline_bytes(str(python)), "base": fresh_runtime_baseline_bytes()}


def _write_record(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def write_stack(name: str, pins: dict[str, str], results: str | Path, record_out: Path, freeze_out: Path) -> None:
    """The stack rule's job: build (or reuse) the stack, then its record and freeze beside the study."""
    record = build_stack(name, pins, results)
    shutil.copyfile(stack_dir(results, pins) / FREEZE_FILE, freeze_out)
    tmp = Path(record_out).with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, record_out)
