"""The distributed side of a cell's trainer: the process group, DDP over the LoRA parameters, and the
injected faults (a straggler, a crashed rank) the collective-timeout studies use. Mixed into CellTrainer.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any


class RankSteps:
    def init_distributed(self) -> None:
        import datetime

        import torch
        import torch.distributed as dist

        settings = self.spec["distributed"]
        backend = (
            settings["backend"] if settings["backend"] != "auto" else ("nccl" if self.device.type == "cuda" else "gloo")
        )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.facts["distributed"] = {
            "backend": backend,
            "world_size": self.ranks.world,
            "collective_timeout_s": settings["collective_timeout_s"],
        }
        self.heartbeat.beat("init_process_group")
        dist.init_process_group(
            backend,
            rank=self.ranks.rank,
            world_size=self.ranks.world,
            timeout=datetime.timedelta(seconds=settings["collective_timeout_s"]),
            device_id=self.device if backend == "nccl" else None,
        )

    def wrap_ddp(self) -> None:
        """DDP over the trainable (LoRA) parameters; frozen base weights are not synchronized."""
        from torch.nn.parallel import DistributedDataParallel

        self.facts["stage"] = "ddp"
        self.heartbeat.beat("ddp")
        # when DDP hands over to the model: what DDP did before (a sync of the ranks) is no rank's local time
        self.model.register_forward_pre_hook(lambda *_: setattr(self, "inner_forward_at", time.perf_counter()))
        self.ddp = DistributedDataParallel(
            self.model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            broadcast_buffers=False,  # nothing to sync, and a replayed step must not add a collective
        )

    def any_rank_stops(self, stop: bool, step: int, state: Any) -> bool:
        """The decision to stop, made by all ranks together (one all-reduce of a flag per step).

        A rank's own loss is not all-reduced (only gradients are): one rank can see its loss go non-finite
        and stop while a peer, whose loss stayed finite, records a GradScaler skip and goes on into the next
        step's all-reduce, where it waits until the collective timeout. A rank that stops because a peer did
        says so (`state.stopped_by_peer`)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(stop)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not stop:
            state.stopped_by_peer = step
        return bool(flag.item())

    def inject_rank_faults(self, step: int) -> None:
        """debug.stall_rank / slow_rank / kill_rank: a rank that pauses once, one slower at every step, or a
        crashed rank, on purpose. Called inside the step's local time (what a straggler shows)."""
        import signal

        debug = self.spec.get("debug") or {}
        stall, kill = debug.get("stall_rank") or {}, debug.get("kill_rank") or {}
        slow = debug.get("slow_rank") or {}
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
        skip = (self.spec.get("debug") or {}).get("skip_collective") or {}
        return self.ranks.distributed and skip.get("rank") == self.ranks.rank and skip.get("step") == step

    def agree_finished(self, last_step: int) -> None:
        """The end-of-training barrier: every rank has finished its steps before any saves or leaves. A rank
        that left the loop early waits here while its peers wait in a step's all-reduce: the ranks are in
        different collectives (its heartbeat names this one), which the timeout diagnosis reads."""
        import torch.distributed as dist

        self.heartbeat.beat(f"end of training after step {last_step} (barrier: every rank finished its steps)")
        dist.barrier()

    def lora_digest(self) -> str:
        """sha256 of the trainable weights: every rank of a DDP cell must end with the same one."""
        import hashlib

        digest = hashlib.sha256()
        for name, param in sorted(self.trainable_named, key=lambda item: item[0]):
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().numpy().tobytes())
        return digest.hexdigest()
