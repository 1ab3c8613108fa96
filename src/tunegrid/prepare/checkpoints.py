"""Model checkpoints from four sources (hub, local path, synthetic, gguf), one folder layout, one manifest.

The folder holds config.json, *.safetensors, the tokenizer files and manifest.json (source, revision or
config, size and sha256 of every file). Loading is safetensors-only: pickle checkpoints are refused.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tunegrid.manifest import CheckpointError, sha256_file
from tunegrid.runtime.files import open_to_umask, write_json

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
HUB_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "tokenizer*", "*.model", "*.txt"]


def write_manifest(model_dir: Path, source: dict[str, Any], known: dict[str, Any] | None = None) -> dict[str, Any]:
    """The folder's manifest.json. `known`: what the source already measured or knows beside `source` (a gguf
    folder's `cache` and its tokenizer footprint, kept in the cache with the folder), not measured again."""
    open_to_umask(model_dir)  # safetensors writes its files 0600; a team member reads the checkpoint too
    files = {}
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name != "manifest.json"):
        real = path.resolve()
        files[str(path.relative_to(model_dir))] = {"bytes": real.stat().st_size, "sha256": sha256_file(real)}
    manifest = {"source": source, "files": files, **(known or {})}
    if "tokenizer_resident_bytes" not in manifest:
        from tunegrid.prepare.probes import tokenizer_resident_bytes

        manifest["tokenizer_resident_bytes"] = tokenizer_resident_bytes(model_dir)
    write_json(model_dir / "manifest.json", manifest)
    return manifest


# --- synthetic ---------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained offline on the study's own data."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)


# Models up to this many parameters are built whole and saved by transformers (one seed for the whole
# init); larger ones are written module by module by the same init functions, never whole.
IN_MEMORY_PARAMS = 2**28
SHARD_BYTES = 2 * 2**30


def build_synthetic(spec: dict[str, Any], texts: list[str], out_dir: Path) -> dict[str, Any]:
    """Random-init checkpoint of a real transformers architecture at the size the config gives."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = dict(spec["config"])
    vocab_size = int(overrides.get("vocab_size", 512))
    tokenizer = train_tokenizer(texts, vocab_size)
    overrides.update(
        vocab_size=vocab_size,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    try:
        config = AutoConfig.for_model(spec["architecture"], **overrides)
    except ValueError as exc:
        raise CheckpointError(f"architecture {spec['architecture']!r}: {exc}") from None
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in skeleton.parameters())
    out_dir.mkdir(parents=True, exist_ok=True)
    streamed = n_params > IN_MEMORY_PARAMS
    scales = spec.get("init_scale") or {}
    if not streamed:
        torch.manual_seed(spec["seed"])
        model = AutoModelForCausalLM.from_config(config)
        scale_initial_weights(model.named_parameters(), scales)
        model.save_pretrained(out_dir, safe_serialization=True)
    else:
        write_streamed(skeleton, spec["seed"], out_dir, scales)
        config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return write_manifest(
        out_dir,
        {
            "kind": "synthetic",
            "architecture": spec["architecture"],
            "config": overrides,
            "seed": spec["seed"],
            "params": n_params,
            **({"written": "streamed"} if streamed else {}),
            **({"init_scale": scales} if scales else {}),
        },
    )


def scale_initial_weights(named: Any, scales: dict[str, float]) -> None:
    """Multiply the initialised parameters whose name matches a glob of `init_scale` by its factor (the first
    matching glob wins), e.g. to give one module real Gemma 3's activation range while the embeddings keep
    the architecture's own scale."""
    import fnmatch

    import torch

    if not scales:
        return
    with torch.no_grad():
        for name, param in named:
            factor = next((f for pattern, f in scales.items() if fnmatch.fnmatchcase(name, pattern)), None)
            if factor is not None and param.is_floating_point():
                param.mul_(factor)


def write_streamed(skeleton: Any, seed: int, out_dir: Path, scales: dict[str, float] | None = None) -> None:
    """Sharded safetensors (+ index) of `skeleton`, one module at a time: each module that owns
    parameters is materialized alone, initialized by the architecture's own `_init_weights` under a
    seed of its own (the study's seed and its name), converted to the names and shapes save_pretrained
    writes (transformers' reverse weight conversion, e.g. fused experts back to one tensor per expert),
    queued for the current shard and dropped; at most one shard and one module are in memory."""
    import zlib

    import torch
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    stored = dict(skeleton.named_parameters())  # a tied tensor once, as save_pretrained stores it
    parts: list[Path] = []
    shard: dict[str, Any] = {}
    names_per_part: list[list[str]] = []
    size = total = 0

    def flush() -> None:
        parts.append(out_dir / f"part-{len(parts):05d}.safetensors")
        save_file(shard, str(parts[-1]), metadata={"format": "pt"})
        names_per_part.append(list(shard))
        shard.clear()

    for module_name, module in skeleton.named_modules():
        own = {
            f"{module_name}.{name}" if module_name else name: param
            for name, param in module.named_parameters(recurse=False)
        }
        own = {name: param for name, param in own.items() if stored.get(name) is param}
        if not own:
            continue
        module.to_empty(device="cpu", recurse=False)
        torch.manual_seed(seed * 2**32 + zlib.crc32(module_name.encode()))
        with torch.no_grad():
            skeleton._init_weights(module)
        values = {name: getattr(module, name.rpartition(".")[2]).detach() for name in own}
        scale_initial_weights(values.items(), scales or {})
        for name, value in revert_weight_conversion(skeleton, values).items():
            nbytes = value.numel() * value.element_size()
            if shard and size + nbytes > SHARD_BYTES:
                flush()
                size = 0
            shard[name] = value.contiguous().clone()  # its own storage: safetensors refuses shared ones
            size += nbytes
            total += nbytes
        del values
        module.to_empty(device="meta", recurse=False)
    if shard:
        flush()
    weight_map = {}
    for index, (part, names) in enumerate(zip(parts, names_per_part, strict=True), start=1):
        filename = f"model-{index:05d}-of-{len(parts):05d}.safetensors"
        part.rename(out_dir / filename)
        weight_map.update(dict.fromkeys(names, filename))
    write_json(out_dir / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


# --- hub ---------------------------------------------------------------------------------------------


def download_hub(spec: dict[str, Any], out_dir: Path, key: str = "models.<name>") -> dict[str, Any]:
    """A safetensors-only snapshot at the pinned revision, or, unpinned, at the commit `ref` points at now
    (prepare/hub.py resolves it, the manifest records it); remote code runs only once pinned."""
    from tunegrid.prepare import hub

    repo_id = spec["repo_id"]
    revision, pinned = hub.resolve("model", repo_id, spec.get("revision") or "", spec.get("ref") or "main", key,
                                   CheckpointError)  # fmt: skip
    patterns = HUB_PATTERNS + (PICKLE_PATTERNS if spec.get("allow_pickle") else [])
    patterns += ["*.py"] if spec.get("trust_remote_code") else []
    try:
        hub.HUB.snapshot(repo_id, revision, patterns, out_dir)
    except Exception as exc:  # the hub library raises many types; the user needs one sentence
        raise CheckpointError(hub.download_error_sentence(repo_id, revision, exc)) from None
    if not list(out_dir.glob("*.safetensors")):
        pickles = sorted(p for pattern in PICKLE_PATTERNS for p in out_dir.glob(pattern))
        if not (spec.get("allow_pickle") and pickles):
            raise CheckpointError(
                f"{repo_id}@{revision} has no *.safetensors files; tunegrid refuses pickle weights "
                f"(models.<name>.allow_pickle: true converts them with torch.load(weights_only=True))"
            )
        convert_pickles(pickles, out_dir)
        for path in pickles:
            path.unlink()
    manifest = write_manifest(out_dir, hub.source_record(repo_id, revision, pinned, spec.get("ref") or "main"))
    if spec.get("trust_remote_code") and not pinned:  # the code that runs must be the code someone reviewed
        raise CheckpointError(
            f"{key}.trust_remote_code: {repo_id} is not pinned; fetched at {revision}: review its *.py files in "
            f"{out_dir}, then `tunegrid pin <study>` writes revision {revision} into the study and it runs"
        )
    return manifest


PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth"]


def convert_pickles(paths: list[Path], out_dir: Path) -> None:
    """Opt-in only: read pickle state dicts with the restricted unpickler (weights_only=True, which
    refuses arbitrary objects and code) and write them as one safetensors file."""
    import pickle

    import torch
    from safetensors.torch import save_file

    state: dict[str, Any] = {}
    for path in paths:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
            raise CheckpointError(
                f"{path.name}: refused by torch.load(weights_only=True) — it holds more than tensors "
                f"(possibly code); not loading it ({str(exc).splitlines()[0][:200]})"
            ) from None
        if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise CheckpointError(f"{path.name}: not a state dict of tensors")
        state.update(
            {k: v.contiguous().clone() for k, v in loaded.items()}
        )  # clone: safetensors refuses shared storage
    save_file(
        state,
        str(out_dir / "model.safetensors"),
        metadata={"format": "pt", "converted_from": ",".join(p.name for p in paths)},
    )


# --- local -------------------------------------------------------------------------------------------


def link_local(spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Link a local checkpoint's files into the study (no copy) and record their hashes. Hidden files are other
    tools' (a folder another Snakemake run made holds its .snakemake_timestamp, whose older time linked into this
    rule's output would read to Snakemake as clock skew on every run; .git* files): never part of a checkpoint."""
    src = Path(spec["path"]).resolve()
    if not (src / "config.json").is_file():
        raise CheckpointError(f"local checkpoint {src}: no config.json")
    out_dir.mkdir(parents=True, exist_ok=True)
    if not list(src.glob("*.safetensors")):
        pickles = sorted(p for pattern in PICKLE_PATTERNS for p in src.glob(pattern))
        if not (pickles and spec.get("allow_pickle")):
            hint = (
                f" (found pickle files {[p.name for p in pickles]}: convert them to safetensors, or opt in with "
                "models.<name>.allow_pickle: true, which reads them with torch.load(weights_only=True))"
                if pickles
                else ""
            )
            raise CheckpointError(f"local checkpoint {src}: no *.safetensors weights{hint}")
        convert_pickles(pickles, out_dir)
    for path in src.iterdir():
        if path.name.startswith(".") or path.name == "manifest.json":
            continue
        if path.is_file() and path.suffix not in {".bin", ".pt", ".pth", ".pkl"}:
            target = out_dir / path.name
            if not target.exists():
                os.symlink(path, target)
    return write_manifest(out_dir, {"kind": "local", "path": str(src)})


def produce_checkpoint(
    spec: dict[str, Any], texts: list[str], out_dir: str | Path, key: str = "models.<name>"
) -> dict[str, Any]:
    out_dir = Path(out_dir)
    source = spec["source"]
    if source == "synthetic":
        return build_synthetic(spec, texts, out_dir)
    if source == "hub":
        return download_hub(spec, out_dir, key)
    if source == "gguf":
        from tunegrid.prepare.gguf_checkpoint import dequantize_gguf
        from tunegrid.study.gguf_files import GgufSourceError

        try:
            source, known = dequantize_gguf(spec, out_dir)
            return write_manifest(out_dir, source, known)
        except GgufSourceError as exc:
            raise CheckpointError(str(exc)) from None
    return link_local(spec, out_dir)
