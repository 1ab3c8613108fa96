"""The rank context of a cell: this process's place among the cell's ranks, its process group, DDP over the LoRA
parameters, the stop the ranks agree on, and the injected faults (a straggler, a crashed rank) the
collective-timeout studies use. A single-process cell has one too (world 1): its faults are injected the same way.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from tunegrid.cell_spec import DebugSpec, DistributedSpec
from tunegrid.runtime.rundir import Heartbeat


@dataclass(frozen=True)
class Ranks:
    """This process's place in a distributed cell (env set by the supervisor, as torchrun would)."""

    rank: int = 0
    world: int = 1
    local: int = 0

    @classmethod
    def from_env(cls) -> Ranks:
        return cls(
            int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
        )

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def device(self, planned: str) -> Any:
        """The torch.device this rank trains on: its own GPU where the plan trains the cell on CUDA (the supervisor
        made this rank's GPU its local index), else the CPU, even where a GPU is visible (gpus_per_rank 0)."""
        import torch

        if planned != "cuda":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise RuntimeError("the cell's plan trains it on CUDA, and this process sees no CUDA device")
        return torch.device("cuda", self.local)


@dataclass
class RankContext:
    ranks: Ranks
    device: Any  # torch.device this rank trains on
    heartbeat: Heartbeat
    debug: DebugSpec  # the cell's debug section: the rank faults
    ddp: Any = None  # DistributedDataParallel around the model, once wrapped (distributed cells only)
    inner_forward_at: float = 0.0  # when DDP last handed over to the model (perf_counter)

    @property
    def distributed(self) -> bool:
        return self.ranks.distributed

    @property
    def rank(self) -> int:
        return self.ranks.rank

    def group_facts(self, settings: DistributedSpec) -> dict[str, Any]:
        """What result.json keeps of the process group (recorded before joining it: a join can time out)."""
        backend = settings.backend if settings.backend != "auto" else ("nccl" if self.device.type == "cuda" else "gloo")
        return {
            "backend": backend,
            "world_size": self.ranks.world,
            "collective_timeout_s": settings.collective_timeout_s,
        }

    def init_process_group(self, settings: DistributedSpec, backend: str) -> None:
        """Join the cell's process group (on a node of a multi-node cell, over the interface of its node's address)."""
        import datetime

        import torch
        import torch.distributed as dist

        from tunegrid.runtime.netif import pin_interface

        pin_interface(os.environ)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.heartbeat.beat("init_process_group")
        dist.init_process_group(
            backend,
            rank=self.ranks.rank,
            world_size=self.ranks.world,
            timeout=datetime.timedelta(seconds=settings.collective_timeout_s),
            device_id=self.device if backend == "nccl" else None,
        )

    def wrap(self, model: Any) -> None:
        """DDP over the trainable (LoRA) parameters; frozen base weights are not synchronized."""
        from torch.nn.parallel import DistributedDataParallel

        self.heartbeat.beat("ddp")
        # when DDP hands over to the model: what DDP did before (a sync of the ranks) is no rank's local time
        model.register_forward_pre_hook(lambda *_: setattr(self, "inner_forward_at", time.perf_counter()))
        self.ddp = DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            broadcast_buffers=False,  # nothing to sync, and a replayed step must not add a collective
        )

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """No gradient all-reduce in the backward run inside it (a micro-batch before the last, a replay)."""
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()

    def any_rank_stops(self, stop: bool) -> bool:
        """The decision to stop, made by all ranks together (one all-reduce of a flag per step).

        A rank's own loss is not all-reduced (only gradients are): one rank can see its loss go non-finite
        and stop while a peer, whose loss stayed finite, records a GradScaler skip and goes on into the next
        step's all-reduce, where it waits until the collective timeout."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(stop)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def inject_faults(self, step: int) -> None:
        """debug.stall_rank / slow_rank / kill_rank: a rank that pauses once, one slower at every step, or a
        crashed rank, on purpose. Called inside the step's local time (what a straggler shows)."""
        import signal

        # each fault a free-form request, as the study wrote it (rank -1: none)
        stall, kill, slow = self.debug.stall_rank, self.debug.kill_rank, self.debug.slow_rank
        if stall.get("rank") == self.ranks.rank and stall.get("step") == step and stall.get("seconds", 0) > 0:
            self.heartbeat.beat(f"step {step} stalled (injected, {stall['seconds']} s)")
            time.sleep(stall["seconds"])
            self.heartbeat.beat(f"step {step} forward+backward")
        if slow.get("rank") == self.ranks.rank:
            time.sleep(slow.get("seconds", 0) + slow.get("growth_s", 0) * step)
        if kill.get("rank") == self.ranks.rank and kill.get("step") == step:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def leaves_loop(self, step: int) -> bool:
        """debug.skip_collective: this rank takes another path before `step` (as if its data ran out) and never
        joins that step's all-reduce."""
        skip = self.debug.skip_collective
        return self.ranks.distributed and skip.get("rank") == self.ranks.rank and skip.get("step") == step

    def agree_finished(self, last_step: int) -> None:
        """The end-of-training barrier: every rank has finished its steps before any saves or leaves. A rank
        that left the loop early waits here while its peers wait in a step's all-reduce: the ranks are in
        different collectives (its heartbeat names this one), which the timeout diagnosis reads."""
        import torch.distributed as dist

        self.heartbeat.beat(f"end of training after step {last_step} (barrier: every rank finished its steps)")
        dist.barrier()


def lora_digest(trainable_named: list[tuple[str, Any]]) -> str:
    """sha256 of the trainable weights: every rank of a DDP cell must end with the same one."""
    import hashlib

    digest = hashlib.sha256()
    for name, param in sorted(trainable_named, key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()
