"""The hub, for the checkpoint and dataset rules: a model or dataset at a pinned 40-hex commit, or an unpinned
one (a recipe as its author wrote it) resolved to the commit its branch or tag points at when the rule
fetches, and recorded: the model's manifest.json and the dataset's train.source.json hold the commit, with
`pinned: false`; the cells' results, their MLflow tags and the report's header read it from there
(tunegrid.study.sources); and `tunegrid pin <study>` writes it back into the study file.

Offline (HF_HUB_OFFLINE, or no network) an unpinned id is resolved from the local hub cache's refs when it
holds one; else the fetch fails naming the model and how to give it as a local folder.

`HUB` is the client: huggingface_hub's own API. Tests replace it with a stand-in that says it is one.
Light module: no torch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Protocol

from tunegrid.study.errors import ConfigError

HEX40 = re.compile(r"^[0-9a-f]{40}$")


class HubClient(Protocol):
    name: str

    def commit_of(self, kind: str, repo_id: str, ref: str) -> str: ...

    def snapshot(self, repo_id: str, revision: str, patterns: list[str], out_dir: Path) -> None: ...


class HuggingFaceHub:
    """huggingface_hub's API; the token comes from HF_TOKEN, never from a config."""

    name = "huggingface_hub"

    def commit_of(self, kind: str, repo_id: str, ref: str) -> str:
        from huggingface_hub import HfApi

        api = HfApi(token=os.environ.get("HF_TOKEN") or None)
        info = api.model_info(repo_id, revision=ref) if kind == "model" else api.dataset_info(repo_id, revision=ref)
        return str(info.sha)

    def snapshot(self, repo_id: str, revision: str, patterns: list[str], out_dir: Path) -> None:
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=patterns, local_dir=out_dir)


HUB: HubClient = HuggingFaceHub()


def cached_commit(kind: str, repo_id: str, ref: str) -> str | None:
    """The commit the local hub cache's refs/<ref> names (what an offline `from_pretrained` would load)."""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return None
    folder = Path(HF_HUB_CACHE) / f"{kind}s--{repo_id.replace('/', '--')}" / "refs" / ref
    sha = folder.read_text().strip() if folder.is_file() else ""
    return sha if HEX40.match(sha) else None


def resolve(
    kind: str, repo_id: str, revision: str, ref: str, key: str, error: type[Exception] = ConfigError
) -> tuple[str, bool]:
    """(the 40-hex commit to fetch, whether the study pinned it). `key` is the study key a user would set."""
    if HEX40.match(revision or ""):
        return revision, True
    ref = ref or "main"
    try:
        return HUB.commit_of(kind, repo_id, ref), False
    except Exception as exc:  # no network, offline mode, not found, gated: one sentence each
        cached = cached_commit(kind, repo_id, ref)
        if cached:
            return cached, False
        raise error(unresolved_sentence(kind, repo_id, ref, key, exc)) from None


def unresolved_sentence(kind: str, repo_id: str, ref: str, key: str, exc: Exception) -> str:
    name = type(exc).__name__
    what = f"hub {kind} {repo_id} (not pinned, {ref!r})"
    if name in {"GatedRepoError", "RepositoryNotFoundError", "RevisionNotFoundError"}:
        return f"{what}: not found or gated ({name}); check the id and ref, or export HF_TOKEN for a gated repo"
    local = "source: local with path: <folder>" if kind == "model" else "source: jsonl (or parquet) with path: <file>"
    return (
        f"{what} cannot be fetched: no network or HF_HUB_OFFLINE is set, and the hub cache holds no copy. "
        f"Download it where there is network (huggingface-cli download {repo_id}"
        f"{' --repo-type dataset' if kind == 'dataset' else ''} --local-dir <folder>) and give it locally: "
        f"{key} as {local}, or --{'model' if kind == 'model' else 'dataset'} <folder> when importing a recipe"
    )


def source_record(repo_id: str, revision: str, pinned: bool, ref: str) -> dict[str, Any]:
    """What the manifest / the dataset's source file record about where the files came from."""
    record: dict[str, Any] = {"kind": "hub", "repo_id": repo_id, "revision": revision, "pinned": pinned}
    if not pinned:
        record["ref"] = ref or "main"
    return record


def download_error_sentence(repo_id: str, revision: str, exc: Exception) -> str:
    name = type(exc).__name__
    where = f"hub model {repo_id}@{revision[:12]}"
    if name == "GatedRepoError":
        return f"{where} is gated: accept its licence on the hub and export HF_TOKEN (never put it in the config)"
    if name in {"RepositoryNotFoundError", "RevisionNotFoundError"}:
        return (
            f"{where}: repository or revision not found (check repo_id and the 40-hex revision, "
            "or HF_TOKEN for private repos)"
        )
    # the offline/no-network family differs across huggingface_hub releases (1.x raises httpx's ConnectError)
    if (
        name in {"LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectError", "ConnectTimeout"}
        or "connect" in str(exc).lower()
    ):
        return (
            f"{where} cannot be downloaded: no network or HF_HUB_OFFLINE is set; "
            "download it elsewhere and use source: local"
        )
    return f"{where} could not be downloaded ({name}); see the rule log"
