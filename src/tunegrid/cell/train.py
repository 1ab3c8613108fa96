"""The recipe of one cell, readable top to bottom: setup -> model -> data -> islands -> the loop -> the record.

Deliberately not HF Trainer: Trainer on CPU ignores fp16 silently, filters NaN losses out of its logs and hides
the GradScaler. Models, tokenizers, peft and bitsandbytes are used through their public APIs; only the loop is
ours.

The recipe is built from components it constructs and passes what they need, each with a declared type:
- `RankContext` (cell/loop/ranks.py): this process's rank, its process group and DDP, the ranks' agreed stop, the
  injected rank faults;
- `OptimizerStep` (cell/loop/step.py): the model, optimizer, schedule and GradScaler, and one step over its
  micro-batches; each step leaves a `StepResult`;
- `StepLog` and `StepFiles` (cell/loop/records.py): what each step records, the running tallies and the summary that
  decides the outcome;
- `FailingStepReplay` (cell/nonfinite/origin.py): the failing step replayed with hooks, where a non-finite value came
  from;
- `ResumeStore` / `ResumeState` (cell/loop/resume.py): what a killed cell restarts from;
- `audit_and_adapt` (cell/load/adapt.py) and `place_fp32_islands` (cell/nonfinite/islands.py): the model's set-up
  passes.

This runs in the worker process the supervisor starts; it writes metrics.jsonl (one line per step),
events.jsonl (non-finite events) and worker.json (the facts the supervisor turns into result.json).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tunegrid.cell.load.adapt import audit_and_adapt
from tunegrid.cell.load.library_api import missing_api_of, require_apis
from tunegrid.cell.load.model import load_model, load_tokenizer
from tunegrid.cell.loop.faults import classify_distributed, classify_exception, missing_autograd_fails
from tunegrid.cell.loop.liveness import block_progress
from tunegrid.cell.loop.ranks import RankContext, Ranks, lora_digest
from tunegrid.cell.loop.records import StepFiles, StepLog, on_nonfinite, record_step, summarise
from tunegrid.cell.loop.resume import ResumeStore, training_key
from tunegrid.cell.loop.step import OptimizerStep
from tunegrid.cell.memory.weight_offload import WeightOffload, weight_offload_of
from tunegrid.cell.nonfinite.islands import place_fp32_islands
from tunegrid.cell.nonfinite.origin import FailingStepReplay
from tunegrid.contract import CellContract
from tunegrid.diagnosis import Diagnosis, OomDiagnosis
from tunegrid.runtime.files import write_json
from tunegrid.runtime.memory import MemoryMeter
from tunegrid.runtime.rundir import Heartbeat, rank_dir
from tunegrid.vocabulary import Outcome


def weight_dtypes(model: Any, trainable: bool) -> list[str]:
    """The dtypes the model's frozen (base) or trainable (adapter) parameters are stored in."""
    return sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad == trainable})


class CellTrainer:
    """One cell from setup to record. Each stage is a method that builds its components and hands them on; the
    stages' products are kept here (the loaded model, the data stream, the optimizer step) so a test can stop
    after any stage."""

    optimizer_step: OptimizerStep | None = None  # from build_optimizer on
    weight_offload: WeightOffload | None = None  # train.weight_offloading on a GPU, from build_optimizer on
    resume_store: ResumeStore | None = None  # a single-process cell's, from the loop's start on

    def __init__(self, contract: CellContract, run_dir: Path) -> None:
        self.contract = contract  # the spec, the plan and the job, as the cell_plan rule made them (tunegrid.contract)
        self.spec = contract.spec  # what the cell trains with, section by section (tunegrid.cell_spec)
        self.model_dir = Path(contract.job.model_dir)
        self.data_path = Path(contract.job.data_path)
        self.run_dir = run_dir
        self.facts: dict[str, Any] = {"outcome": Outcome.ERROR, "reason": "did not start", "stage": "setup"}
        self.heartbeat = Heartbeat(run_dir / "heartbeat")
        self.facts["rank"] = Ranks.from_env().rank

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        import torch

        from tunegrid.cell.loop.precision import precision_setup

        require_apis(self.spec)  # a library stack without an API this cell calls: unsupported, before any load
        torch.set_num_threads(self.spec.train.threads)
        torch.manual_seed(self.spec.axes.seed)  # the same on every rank: identical LoRA init
        ranks = Ranks.from_env()
        self.device = ranks.device(self.contract.plan.device)  # the plan's (tunegrid.runtime.devices.training_device)
        self.ranks = RankContext(ranks, self.device, self.heartbeat, self.spec.debug)
        if self.ranks.distributed:
            self.facts["distributed"] = self.ranks.group_facts(self.spec.distributed)
            self.ranks.init_process_group(self.spec.distributed, self.facts["distributed"]["backend"])
        self.precision = precision_setup(self.spec.axes.precision, self.device.type)
        print(self.precision.describe(), flush=True)
        self.facts["precision_plan"] = self.precision.__dict__
        self.meter = MemoryMeter(self.device.type)
        self.memory: dict[str, Any] = {"device": self.device.type}

    # ---------------------------------------------------------------- model
    def build_model(self) -> None:
        from tunegrid.manifest import verify_checkpoint
        from tunegrid.runtime.memory import (
            apply_memory_budget,
            map_large_blocks,
            read_checkpoint_in_order,
            runtime_baseline_bytes,
        )

        self.facts["stage"] = "load"
        self.heartbeat.beat("load")
        self.manifest = verify_checkpoint(self.model_dir)
        if self.device.type == "cpu":  # memory that follows the tensors alive; the runtime constant's measure
            self.memory["large_blocks"] = map_large_blocks()
            self.memory["checkpoint_read"] = read_checkpoint_in_order()
            self.memory["runtime_bytes_measured"] = runtime_baseline_bytes()
        budget = self.contract.plan.budget_bytes
        if budget:
            self.memory["budget_enforcement"] = apply_memory_budget(self.device.type, budget, self.device.index)
        self.meter.reset()
        self.tokenizer = load_tokenizer(self.model_dir, self.spec.model.trust_remote_code)
        self.model = load_model(self.model_dir, self.spec, self.precision, self.contract.plan.kernels, self.device)
        self.model, self.facts["quant_audit"] = audit_and_adapt(self.model, self.spec, self.run_dir)
        self.model.train()
        self.memory["load_peak_bytes"] = self.meter.peak_bytes()
        self.trainable_named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.facts["params"] = {
            "total": sum(p.numel() for p in self.model.parameters()),
            "trainable": sum(p.numel() for _, p in self.trainable_named),
        }
        self.facts["precision_in_effect"] = {
            "base_weight_dtypes": weight_dtypes(self.model, trainable=False),
            "adapter_dtypes": weight_dtypes(self.model, trainable=True),
        }

    # ---------------------------------------------------------------- data
    def build_data(self) -> None:
        from tunegrid.cell.data.packing import build_stream
        from tunegrid.dataset import read_dataset

        # each rank draws its own batches (batch_size is per rank); rank 0 sees what a 1-process cell sees
        seed = self.spec.axes.seed + 7919 * self.ranks.rank
        self.stream, self.facts["data"] = build_stream(
            read_dataset(self.data_path),
            self.tokenizer,
            self.model,
            self.spec.data,
            self.spec.train.seq_len,
            self.spec.axes.batch_size,
            seed,
            self.spec.axes.grad_accum,
        )

    # ---------------------------------------------------------------- fp32 islands (fp16-islands only)
    def place_fp32_islands(self) -> None:
        """Measured (or named) before the first step, on the model the steps train."""
        if not self.precision.fp32_islands:
            return
        self.facts["stage"] = "islands"
        self.heartbeat.beat("fp32 island calibration")
        self.facts["fp32_islands"] = place_fp32_islands(
            self.model, self.stream, self.device, self.ranks.distributed, self.spec.train
        )
        self.facts["precision_in_effect"]["base_weight_dtypes"] = weight_dtypes(self.model, trainable=False)

    # ---------------------------------------------------------------- the optimizer step
    def build_optimizer(self) -> OptimizerStep:
        self.optimizer_step = OptimizerStep.build(
            self.spec, self.model, self.trainable_named, self.precision, self.meter, self.ranks
        )
        if self.ranks.distributed:
            self.facts["stage"] = "ddp"
            self.ranks.wrap(self.model)
        # after DDP, whose construction broadcasts every parameter: from here each layer's base weights sit on the host
        self.weight_offload = weight_offload_of(self.spec, self.model, self.device)
        if self.spec.train.weight_offloading:  # 0 on a CPU cell: nothing moves
            self.memory["weights_offloaded_bytes"] = getattr(self.weight_offload, "offloaded_bytes", 0)
        return self.optimizer_step

    # ---------------------------------------------------------------- the loop
    def loop(self) -> None:
        """For each optimizer step (grad_accum micro-batches): save the resume state when due, train the step,
        record it, and stop where a non-finite event (or, distributed, any rank's) says so. A step the GradScaler
        skipped changed no weight and does not count: the loop runs until `steps` steps counted, at most
        `max_skipped_steps` more (every rank skips alike: its scaler reads the all-reduced gradients), and the
        step after a skip trains on the skipped step's batch, so the k-th update of every cell of a study trains
        on the same batch and the loss after it is measured on the same next one (review/quality.py)."""
        from tqdm.auto import tqdm

        from tunegrid.cell.loop.instrument import DtypeCensus, HeadroomMeter

        train = self.spec.train
        steps, every = train.steps, train.headroom_every
        optimizer_step = self.build_optimizer()
        log = StepLog(census=DtypeCensus(), headroom=HeadroomMeter())
        self.resume(optimizer_step, log)  # before the files open: a resume puts them back as they were at its step
        log.last_step = log.start - 1
        files = StepFiles.open(self.run_dir)
        replay = FailingStepReplay(optimizer_step)
        scaled = optimizer_step.scaler is not None
        last = steps + (train.max_skipped_steps if scaled else 0)  # the most steps the loop runs
        self.facts["stage"] = "step"
        progress = tqdm(
            total=steps, initial=log.start, desc=self.spec.cell_id, unit="step", mininterval=2.0, file=sys.stderr
        )
        try:
            for step in range(log.start, last):
                batch = log.counted(step)  # a skipped step's batch is drawn again: the k-th update trains on batch k
                if batch >= steps:  # every step counted: the GradScaler's skips were made up for
                    break
                if self.ranks.leaves_loop(step):
                    break
                log.last_step = step
                if self.resume_store is not None and self.resume_store.due(step, log.start):
                    self.save_resume_state(step, optimizer_step, log)
                micro_batches = [
                    {k: v.to(self.device) for k, v in micro.items()} for micro in self.stream.micro_batches(batch)
                ]
                self.last_batch = micro_batches[-1]  # an ok cell's reference batch
                measure_headroom = every > 0 and step % every == 0
                result = optimizer_step.run(
                    step,
                    micro_batches,
                    log.census if step == 0 else None,
                    log.headroom if measure_headroom else None,
                    [mask.to(self.device) for mask in self.stream.real_positions(batch)],
                )
                if step == 0:  # the first step's peak, apart from the steady steps'
                    self.memory["first_step_peak_bytes"] = result.peak
                    if optimizer_step.offload is not None:  # what the step's saved tensors put in host memory
                        self.memory["activations_offloaded_bytes"] = optimizer_step.offload.moved_bytes
                    if self.weight_offload is not None:  # the most offloaded weight bytes on the device at once
                        self.memory["weights_resident_peak_bytes"] = self.weight_offload.peak_resident_bytes
                tokens = self.stream.real_tokens(batch)  # padding excluded, packed or not
                record_step(log, files, step, result, tokens, measure_headroom, scaled)
                progress.set_postfix(loss=f"{result.loss:.4g}", refresh=False)
                if result.scaler_skipped and progress.total < last:
                    progress.total += 1  # a step that does not count
                progress.update()
                stop = bool(log.unsupported) or on_nonfinite(
                    log, files, step, micro_batches, result, replay, train, scaled
                )
                if self.ranks.distributed:
                    # every rank leaves at the same step, or the one that went on waits in the next all-reduce
                    agreed = self.ranks.any_rank_stops(stop)
                    if agreed and not stop:
                        log.stopped_by_peer = step  # this rank stops because a peer did
                    stop = agreed
                if stop:
                    log.stopped = True
                    break
            if self.ranks.distributed and not log.stopped:
                self.ranks.agree_finished(log.last_step)
        finally:
            progress.close()
            files.close()
            if scaled:
                log.loss_scale_end = optimizer_step.scaler.get_scale()
        # ------------------------------------------------------------ the record
        summarise(log, self.spec, self.facts, self.memory)
        if self.ranks.distributed:
            self.facts["lora_sha256"] = lora_digest(self.trainable_named)

    # ---------------------------------------------------------------- the resume state
    def resume(self, optimizer_step: OptimizerStep, log: StepLog) -> None:
        """A single-process cell picks up the resume state of this same cell, if one is there (its weights,
        optimizer, schedule, scaler and RNG back in place, its files as they were, its log refilled); a
        distributed cell's ranks would each need their own, so it starts afresh."""
        from tunegrid.cell.adapters import base_model_identity

        every = self.spec.train.checkpoint_every
        self.facts["checkpoint"] = {"every": every, "applied": not self.ranks.distributed}  # result.json's key
        if self.ranks.distributed:
            return
        key = training_key(self.spec, base_model_identity(self.manifest))
        self.resume_store = store = ResumeStore(self.run_dir, every, key)
        o = optimizer_step
        resumed = store.restore(o.trainable_named, o.optimizer, o.scheduler, o.scaler)
        if store.discarded:
            self.facts["checkpoint"]["discarded"] = store.discarded
        if resumed is not None:
            self.facts["resumed_from_step"] = resumed.step
            print(f"resuming from the resume state of step {resumed.step}", flush=True)
            log.refill(resumed, self.memory)

    def save_resume_state(self, step: int, optimizer_step: OptimizerStep, log: StepLog) -> None:
        assert self.resume_store is not None
        self.heartbeat.beat(f"step {step} resume state")
        o = optimizer_step
        self.resume_store.save(step, o.trainable_named, o.optimizer, o.scheduler, o.scaler, log.saved(self.memory))
        self.facts["checkpoint"]["last_step"] = step

    # ---------------------------------------------------------------- the adapter
    def finish_cell(self) -> None:
        """An `ok` cell's adapter is its product; any concluded cell's resume state has served its purpose."""
        from tunegrid.cell.adapters import base_record, reference_loss, save_adapter
        from tunegrid.cell.loop.precision import autocast_context

        if self.facts["outcome"] == Outcome.OK and self.ranks.rank == 0:
            self.facts["stage"] = "adapter"
            self.heartbeat.beat("adapter")
            loss = reference_loss(self.model, self.last_batch, autocast_context(self.precision))
            self.facts["training"]["reference_batch_loss"] = loss
            islands = [island["module"] for island in (self.facts.get("fp32_islands") or {}).get("modules", [])]
            record = base_record(self.spec, self.manifest, self.precision, islands)
            self.facts["adapter"] = save_adapter(self.run_dir, self.model, self.last_batch, loss, record)
        if self.resume_store is not None:
            self.resume_store.discard()

    def signs_of_life(self) -> contextlib.AbstractContextManager[None]:
        """A single-process cell beats its heartbeat at every decoder block (cell/loop/liveness.py), so a slow step is
        never taken for a hang; distributed ranks beat at their collectives."""
        if self.ranks.distributed:
            return contextlib.nullcontext()
        return block_progress(self.model, self.heartbeat)

    # ---------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        started = time.time()
        try:
            self.setup()
            self.build_model()
            with self.signs_of_life():
                self.build_data()
                self.place_fp32_islands()
                self.loop()
                self.finish_cell()
        except BaseException as exc:  # a failure is a result; only tunegrid bugs should fail the rule
            self.record_failure(exc)
        finally:
            self.facts["memory"] = getattr(self, "memory", {})
            enforcement = self.facts["memory"].get("budget_enforcement") or {}
            if enforcement.get("mechanism") == "RLIMIT_AS":
                from tunegrid.runtime.memory import address_space_added

                enforcement["address_space_added_peak"] = address_space_added(enforcement)
            if self.optimizer_step is not None:
                from tunegrid.cell.memory.optimizers import optimizer_facts

                o = self.optimizer_step
                self.facts["optimizer"] = optimizer_facts(o.optimizer, o.optimizer_name, self.device.type)
            self.facts["wall_s"] = time.time() - started
            write_json(self.run_dir / "worker.json", self.facts)
        return self.facts

    def record_failure(self, exc: BaseException) -> None:
        """The outcome a caught exception stands for, with its diagnosis (a collective's, an out-of-memory's)."""
        kind = classify_exception(exc) if not isinstance(exc, KeyboardInterrupt) else Outcome.ERROR
        stage = self.facts.get("stage", "setup")
        self.facts.update(outcome=kind, reason=f"{type(exc).__name__} during {stage}: {str(exc)[:300]}")
        missing = missing_api_of(exc)
        if missing is not None:  # the libraries this cell runs on (its stack), not the cell, lack something
            self.facts.update(outcome=Outcome.UNSUPPORTED, reason=f"{missing} (during {stage})")
        ranks = getattr(self, "ranks", None)
        distributed = ranks.distributed if ranks is not None else Ranks.from_env().distributed
        collective = classify_distributed(exc) if distributed else None
        if collective is not None:
            self.facts["outcome"] = Outcome.TIMEOUT if collective == "collective_timeout" else Outcome.ERROR
            self.facts["diagnosis"] = {
                collective: {
                    "rank": self.facts["rank"],
                    "waiting_in": self.heartbeat.last,
                    "timeout_s": self.spec.distributed.collective_timeout_s,
                    "message": str(exc)[:400],
                }
            }
        self.facts["traceback"] = traceback.format_exc()[-4000:]
        if kind == Outcome.OOM:
            oom = OomDiagnosis(stage=stage, **meter_at_failure(getattr(self, "meter", None)))
            self.facts["diagnosis"] = Diagnosis(oom=oom).to_json()
        traceback.print_exc()


def meter_at_failure(meter: MemoryMeter | None) -> dict[str, int | None]:
    """In use as the failure is handled, and the high-water mark."""
    if meter is None:
        return {}
    facts = {"bytes_at_failure": meter.current_bytes(), "peak_bytes": meter.peak_bytes()}
    reserved = meter.reserved_peak_bytes()
    if reserved is not None:  # what a CUDA budget caps: the allocated peak can stay under it
        facts["reserved_peak_bytes"] = reserved
    return facts


def run_worker(contract: CellContract) -> int:
    """The worker process of one rank of the contract's cell (`tunegrid worker --contract`)."""
    from tunegrid.runtime import lifeline
    from tunegrid.runtime.memory import keep_one_malloc_arena

    keep_one_malloc_arena(contract.plan.budget_bytes)  # before the lifeline's thread
    lifeline.hold()  # never train on after the supervisor is gone (a kill -9 of the job)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ranks = Ranks.from_env()
    run = rank_dir(contract.job.run, ranks.rank)
    run.mkdir(parents=True, exist_ok=True)
    with missing_autograd_fails():
        facts = CellTrainer(contract, run).run()
    if ranks.distributed:
        import torch.distributed as dist

        if facts["outcome"] in (Outcome.OK, Outcome.NAN) and dist.is_initialized():
            dist.destroy_process_group()
        else:  # a broken group can hang in teardown (NCCL abort); the facts are written, leave now
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    return 0
