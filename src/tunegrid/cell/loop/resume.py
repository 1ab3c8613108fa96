"""The resume state: what a killed cell restarts from. Every `train.checkpoint_every` steps the loop's whole
state goes to <run>/checkpoint/ (the setting's and the folder's names are kept from earlier versions, so their
studies and their saved states still resume).

A cell started again (a re-run after a kill, a retry, a wall-clock timeout) continues from the last resume
state saved for the same training spec, so its loss curve is the one an uninterrupted run draws. A resume state
is one folder, replaced by rename: a kill mid-write leaves the previous one whole.

What it holds: the trainable (LoRA) weights as safetensors; optimizer, LR scheduler and GradScaler state,
the RNG states (torch CPU/CUDA, python) and the loop's step log (its tallies) in state.pt (read back with
torch.load(weights_only=True), which refuses anything but tensors and plain containers); the
metrics/events/headroom lines written before the step; meta.json with the spec key and the step.
Batches are a pure function of (seed, step), so the step is the data position.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunegrid.cell_spec import CellSpec
from tunegrid.runtime.files import open_to_umask, read_json, write_json

RESUME_DIR = "checkpoint"  # the folder's name on disk, as earlier versions wrote it
LOG_FILES = ("metrics.jsonl", "events.jsonl", "headroom.jsonl")

# Settings that change no number the training computes: a resume state stays valid across edits of them.
NON_TRAINING: dict[str, tuple[str, ...] | None] = {
    "hardware": None,
    "train": ("time_limit_s", "retries", "heartbeat_timeout_s", "checkpoint_every"),
    "debug": ("stall_rank", "kill_rank", "slow_rank", "skip_collective", "slow_link"),
    "distributed": ("collective_timeout_s", "flight_recorder", "trace_buffer_size", "exit_grace_s"),
}


def training_key(spec: CellSpec, base_model: dict[str, Any]) -> str:
    """sha256 of the spec minus NON_TRAINING, plus the base model's identity (a rebuilt base is new). Taken over the
    spec's JSON, key for key: the key a resume state written by an earlier run holds stays the same."""
    kept: dict[str, Any] = {}
    for section, value in spec.to_json().items():
        dropped = NON_TRAINING.get(section, ())
        if dropped is None:
            continue
        kept[section] = (
            {k: v for k, v in value.items() if k not in dropped} if dropped and isinstance(value, dict) else value
        )
    text = json.dumps({"spec": kept, "base_model": base_model}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class ResumeState:
    """What a killed cell restarts from, once its weights, optimizer, schedule, scaler and RNG are back."""

    step: int  # steps already done: the loop goes on with this one
    tallies: dict[str, Any]  # the step log as it was at that step (StepLog.saved)


def rng_states() -> dict[str, Any]:
    """torch's CPU generator, the CUDA generator of the device this process trains on (dropout there draws
    from it), and python's; nothing in a cell draws from numpy's. What a resume state saves and what each
    micro-batch's replay starts from."""
    import torch

    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()  # the current device: the one this process trains on
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Put back what rng_states() took. A CUDA state goes to this process's device only: a resume that sees
    fewer GPUs than the attempt that saved it must not address devices that are gone."""
    import torch

    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    cuda = states.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return
    if isinstance(cuda, (list, tuple)):  # one state per device then visible (get_rng_state_all)
        index = torch.cuda.current_device()
        cuda = cuda[index] if index < len(cuda) else None
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


class ResumeStore:
    """Writes, finds and removes one cell's resume state (single-process cells)."""

    def __init__(self, run_dir: Path, every: int, key: str) -> None:
        self.run_dir = run_dir
        self.every = every
        self.key = key
        self.path = run_dir / RESUME_DIR
        self._previous = run_dir / f".{RESUME_DIR}.previous"
        self.discarded = ""  # why a resume state found at the start was not resumed from

    def due(self, step: int, start: int) -> bool:
        """At the top of step `step`: every K steps, never for the state just resumed from."""
        return self.every > 0 and step > start and step % self.every == 0

    def save(
        self,
        step: int,
        named_params: list[tuple[str, Any]],
        optimizer: Any,
        scheduler: Any,
        scaler: Any,
        tallies: dict[str, Any],
    ) -> None:
        import torch
        from safetensors.torch import save_file

        staging = self.run_dir / f".{RESUME_DIR}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        save_file(
            {name: p.detach().cpu().contiguous().clone() for name, p in named_params},
            str(staging / "adapter.safetensors"),
        )
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "rng": rng_states(),
                "tallies": tallies,
            },
            staging / "state.pt",
        )
        for name in LOG_FILES:
            if (self.run_dir / name).exists():
                shutil.copyfile(self.run_dir / name, staging / name)
        write_json(staging / "meta.json", {"key": self.key, "step": step, "data_position": {"step": step}})
        open_to_umask(staging)  # safetensors writes its files 0600
        _fsync_tree(staging)
        self._replace_with(staging)

    def _replace_with(self, staging: Path) -> None:
        """Two renames; between them only `.checkpoint.previous` exists, and `_recover` takes it back."""
        shutil.rmtree(self._previous, ignore_errors=True)
        if self.path.exists():
            os.replace(self.path, self._previous)
        os.replace(staging, self.path)
        shutil.rmtree(self._previous, ignore_errors=True)

    def _recover(self) -> None:
        if not self.path.exists() and self._previous.exists():
            os.replace(self._previous, self.path)
        for stale in self.run_dir.glob(f".{RESUME_DIR}.tmp-*"):  # a save cut short
            shutil.rmtree(stale, ignore_errors=True)

    def discard(self, why: str = "") -> None:
        if why and self.path.exists():
            self.discarded = why
            print(f"resume state {self.path} removed: {why}", flush=True)
        for path in (self.path, self._previous):
            shutil.rmtree(path, ignore_errors=True)

    def find(self) -> dict[str, Any] | None:
        """meta.json of a usable resume state of this spec; one of another spec is removed."""
        self._recover()
        meta_path = self.path / "meta.json"
        if not meta_path.exists():
            self.discard("incomplete" if self.path.exists() else "")
            return None
        meta = read_json(meta_path)
        if meta.get("key") != self.key:
            self.discard("written for a different training spec")
            return None
        return meta

    def restore(
        self, named_params: list[tuple[str, Any]], optimizer: Any, scheduler: Any, scaler: Any
    ) -> ResumeState | None:
        """Load the resume state into the live objects and put the run's logs back as they were at its step."""
        import torch
        from safetensors.torch import load_file

        meta = self.find()
        if meta is None:
            return None
        weights = load_file(str(self.path / "adapter.safetensors"))
        if sorted(weights) != sorted(name for name, _ in named_params):
            self.discard("its adapter tensors do not match this model's")
            return None
        state = torch.load(self.path / "state.pt", map_location="cpu", weights_only=True)
        with torch.no_grad():
            for name, param in named_params:
                param.copy_(weights[name])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and state["scaler"]:
            scaler.load_state_dict(state["scaler"])
        for name in LOG_FILES:  # lines past the resume state's step belong to the attempt that died
            saved, live = self.path / name, self.run_dir / name
            if saved.exists():
                shutil.copyfile(saved, live)
            else:
                live.unlink(missing_ok=True)
        set_rng_states(state["rng"])
        return ResumeState(step=int(meta["step"]), tallies=state["tallies"])


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
