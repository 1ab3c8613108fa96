"""The training loop of one cell, readable top to bottom: setup -> model -> data -> loop -> record.

Deliberately not HF Trainer: Trainer on CPU ignores fp16 silently, filters NaN losses
out of its logs and hides the GradScaler. Models, tokenizers, peft and bitsandbytes are used through
their public APIs; only the loop is ours.

This runs in the worker process the supervisor starts; it writes metrics.jsonl (one line per step),
events.jsonl (non-finite events) and worker.json (the facts the supervisor turns into result.json).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tunegrid.cell.adapt import AdaptSteps
from tunegrid.cell.checkpointing import CheckpointSteps
from tunegrid.cell.distributed import Ranks
from tunegrid.cell.faults import classify_distributed, classify_exception, missing_autograd_fails
from tunegrid.cell.islands import IslandSteps
from tunegrid.cell.loop_state import LoopState
from tunegrid.cell.model import load_model
from tunegrid.cell.origin import OriginReplay
from tunegrid.cell.ranks import RankSteps
from tunegrid.cell.records import StepRecords
from tunegrid.cell.step import OptimizerSteps
from tunegrid.files import JsonlAppender, write_json
from tunegrid.rundir import Heartbeat, rank_dir
from tunegrid.vocabulary import Outcome


class CellTrainer(OptimizerSteps, AdaptSteps, RankSteps, CheckpointSteps, OriginReplay, StepRecords, IslandSteps):
    """One cell from setup to record. The optimizer step, the audited LoRA attachment, the distributed steps,
    checkpointing, the origin replay, the step records and the fp32 islands live in their own mixins
    (cell/step.py, adapt.py, ranks.py, checkpointing.py, origin.py, records.py, islands.py); this file is the
    recipe."""

    def __init__(self, spec: dict[str, Any], model_dir: Path, data_path: Path, run_dir: Path) -> None:
        self.spec = spec
        self.model_dir = model_dir
        self.data_path = data_path
        self.run_dir = run_dir
        self.facts: dict[str, Any] = {"outcome": Outcome.ERROR, "reason": "did not start", "stage": "setup"}
        self.heartbeat = Heartbeat(run_dir / "heartbeat")
        self.ranks = Ranks.from_env()
        self.ddp: Any = None
        self.facts["rank"] = self.ranks.rank

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        import torch

        from tunegrid.cell.precision import plan_precision
        from tunegrid.memory import MemoryMeter

        train = self.spec["train"]
        torch.set_num_threads(train["threads"])
        torch.manual_seed(self.spec["axes"]["seed"])  # the same on every rank: identical LoRA init
        self.device = torch.device("cuda", self.ranks.local) if torch.cuda.is_available() else torch.device("cpu")
        if self.ranks.distributed:
            self.init_distributed()
        self.plan = plan_precision(self.spec["axes"]["precision"], self.device.type)
        print(self.plan.describe(), flush=True)
        self.facts["precision_plan"] = self.plan.__dict__
        self.meter = MemoryMeter(self.device.type)
        self.memory: dict[str, Any] = {"device": self.device.type}

    # ---------------------------------------------------------------- model
    def build_model(self) -> None:
        from transformers import AutoTokenizer

        from tunegrid.memory import apply_memory_budget
        from tunegrid.prepare.checkpoints import verify_checkpoint
        from tunegrid.prepare.probes import runtime_baseline_bytes

        self.facts["stage"] = "load"
        self.heartbeat.beat("load")
        self.manifest = verify_checkpoint(self.model_dir)
        if self.device.type == "cpu":  # what the estimate's calibrated runtime constant stands for
            self.memory["runtime_bytes_measured"] = runtime_baseline_bytes()
        budget = (self.spec.get("plan") or {}).get("budget_bytes")
        if budget:
            self.memory["budget_enforcement"] = apply_memory_budget(self.device.type, budget, self.device.index)
        self.meter.reset()
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.model_dir, trust_remote_code=bool(self.spec["model"].get("trust_remote_code"))
        )
        self.model = load_model(self.model_dir, self.spec, self.plan, self.device)
        self.audit_and_adapt()
        self.model.train()
        self.memory["load_peak_bytes"] = self.meter.peak_bytes()
        self.trainable_named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.trainable = [p for _, p in self.trainable_named]
        self.facts["params"] = {
            "total": sum(p.numel() for p in self.model.parameters()),
            "trainable": sum(p.numel() for p in self.trainable),
        }
        self.facts["precision_in_effect"] = {
            "base_weight_dtypes": sorted(
                {str(p.dtype).removeprefix("torch.") for p in self.model.parameters() if not p.requires_grad}
            ),
            "adapter_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in self.trainable}),
        }

    # ---------------------------------------------------------------- data
    def build_data(self) -> None:
        from tunegrid.cell.packing import build_stream
        from tunegrid.prepare.data import read_dataset

        # each rank draws its own batches (batch_size is per rank); rank 0 sees what a 1-process cell sees
        seed = self.spec["axes"]["seed"] + 7919 * self.ranks.rank
        self.stream, self.facts["data"] = build_stream(
            read_dataset(self.data_path),
            self.tokenizer,
            self.model,
            self.spec.get("data") or {},
            self.spec["train"]["seq_len"],
            self.spec["axes"]["batch_size"],
            seed,
            self.spec["axes"].get("grad_accum", 1),
        )

    # ---------------------------------------------------------------- loop
    def loop(self) -> None:
        """The recipe: for each optimizer step (grad_accum micro-batches), train it, record it, and stop where
        a non-finite event says so."""
        from tqdm.auto import tqdm

        steps, every = self.spec["train"]["steps"], self.spec["train"]["headroom_every"]
        self.build_optimizer()
        state = self.begin_loop()
        logs = {name: JsonlAppender(self.run_dir / f"{name}.jsonl") for name in ("metrics", "events", "headroom")}
        self.facts["stage"] = "step"
        progress = tqdm(
            total=steps, initial=state.start, desc=self.spec["cell_id"], unit="step", mininterval=2.0, file=sys.stderr
        )
        try:
            for step in range(state.start, steps):
                if self.leaves_loop(step):
                    break
                state.last_step = step
                if self.checkpointer is not None and self.checkpointer.due(step, state.start):
                    self.save_checkpoint(
                        step,
                        state.tallies(),
                        state.skipped_total,
                        state.consecutive_skips,
                        state.census,
                        state.headroom,
                    )
                micro_batches = [
                    {k: v.to(self.device) for k, v in micro.items()} for micro in self.stream.micro_batches(step)
                ]
                self.last_batch = micro_batches[-1]
                measure_headroom = every > 0 and step % every == 0
                fact = self.train_step(
                    step,
                    micro_batches,
                    state.census if step == 0 else None,
                    state.headroom if measure_headroom else None,
                    [mask.to(self.device) for mask in self.stream.real_positions(step)],
                )
                self.record(step, fact, measure_headroom, state, logs)
                progress.set_postfix(loss=f"{fact['loss']:.4g}", refresh=False)
                progress.update()
                stop = bool(state.unsupported) or self.on_nonfinite(step, micro_batches, fact, state, logs)
                if self.ranks.distributed and self.any_rank_stops(stop, step, state):
                    state.stopped = True
                    break  # every rank leaves at the same step, or the one that went on waits in the next all-reduce
                if stop:
                    state.stopped = True
                    break
            if self.ranks.distributed and not state.stopped:
                self.agree_finished(state.last_step)
        finally:
            progress.close()
            for log in logs.values():
                log.close()
        self.summarise(state)

    def begin_loop(self) -> LoopState:
        """A fresh state, or the one a checkpoint of this same cell left (its logs put back as they were)."""
        from tunegrid.cell.instrument import DtypeCensus, HeadroomMeter

        state = LoopState(census=DtypeCensus(), headroom=HeadroomMeter())
        self.checkpointer = self.make_checkpointer()
        resumed = self.resume()  # before the logs open: it puts them back as they were at its step
        if resumed is not None:
            state.start, state.skipped_total, state.consecutive_skips = self.refill(
                resumed, state.tallies(), state.census, state.headroom
            )
        state.last_step = state.start - 1
        return state

    def finish_cell(self) -> None:
        """An `ok` cell's adapter is its product; any concluded cell's checkpoint has served its purpose."""
        from tunegrid.cell.adapters import base_record, reference_loss, save_adapter
        from tunegrid.cell.precision import autocast_context

        if self.facts["outcome"] == Outcome.OK and self.ranks.rank == 0:
            self.facts["stage"] = "adapter"
            self.heartbeat.beat("adapter")
            loss = reference_loss(self.model, self.last_batch, autocast_context(self.plan))
            self.facts["training"]["reference_batch_loss"] = loss
            islands = [island["module"] for island in (self.facts.get("fp32_islands") or {}).get("modules", [])]
            record = base_record(self.spec, self.manifest, self.plan, islands)
            self.facts["adapter"] = save_adapter(self.run_dir, self.model, self.last_batch, loss, record)
        if self.checkpointer is not None:
            self.checkpointer.discard()

    # ---------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        started = time.time()
        try:
            self.setup()
            self.build_model()
            self.build_data()
            self.place_fp32_islands()  # fp16-islands only: measured (or named) before the first step
            self.loop()
            self.finish_cell()
        except BaseException as exc:  # a failure is a result; only tunegrid bugs should fail the rule
            kind = classify_exception(exc) if not isinstance(exc, KeyboardInterrupt) else Outcome.ERROR
            stage = self.facts.get("stage", "setup")
            self.facts.update(outcome=kind, reason=f"{type(exc).__name__} during {stage}: {str(exc)[:300]}")
            collective = classify_distributed(exc) if self.ranks.distributed else None
            if collective is not None:
                self.facts["outcome"] = Outcome.TIMEOUT if collective == "collective_timeout" else Outcome.ERROR
                self.facts["diagnosis"] = {
                    collective: {
                        "rank": self.ranks.rank,
                        "waiting_in": self.heartbeat.last,
                        "timeout_s": self.spec["distributed"]["collective_timeout_s"],
                        "message": str(exc)[:400],
                    }
                }
            self.facts["traceback"] = traceback.format_exc()[-4000:]
            if kind == Outcome.OOM:
                self.facts["diagnosis"] = {"oom": {"stage": stage, **self.meter_at_failure()}}
            traceback.print_exc()
        finally:
            self.facts["memory"] = getattr(self, "memory", {})
            if getattr(self, "optimizer", None) is not None:
                from tunegrid.cell.optimizers import optimizer_facts

                self.facts["optimizer"] = optimizer_facts(self.optimizer, self.optimizer_name, self.device.type)
            self.facts["wall_s"] = time.time() - started
            write_json(self.run_dir / "worker.json", self.facts)
        return self.facts

    def meter_at_failure(self) -> dict[str, int | None]:
        meter = getattr(self, "meter", None)  # in use as the failure is handled, and the high-water mark
        if meter is None:
            return {}
        facts = {"bytes_at_failure": meter.current_bytes(), "peak_bytes": meter.peak_bytes()}
        reserved = meter.reserved_peak_bytes()
        if reserved is not None:  # what a CUDA budget caps: the allocated peak can stay under it
            facts["reserved_peak_bytes"] = reserved
        return facts


def run_worker(spec: dict[str, Any], model_dir: str, data_path: str, run_dir: str) -> int:
    from tunegrid import lifeline

    lifeline.hold()  # never train on after the supervisor is gone (a kill -9 of the job)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ranks = Ranks.from_env()
    run = rank_dir(Path(run_dir), ranks.rank)
    run.mkdir(parents=True, exist_ok=True)
    with missing_autograd_fails():
        facts = CellTrainer(spec, Path(model_dir), Path(data_path), run).run()
    if ranks.distributed:
        import torch.distributed as dist

        if facts["outcome"] in (Outcome.OK, Outcome.NAN) and dist.is_initialized():
            dist.destroy_process_group()
        else:  # a broken group can hang in teardown (NCCL abort); the facts are written, leave now
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    return 0
