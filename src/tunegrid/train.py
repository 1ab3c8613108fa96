"""The training loop of one cell, readable top to bottom: setup -> model -> data -> loop -> record.

Deliberately not HF Trainer: Trainer on CPU ignores fp16 silently, filters NaN losses
out of its logs and hides the GradScaler. Models, tokenizers, peft and bitsandbytes are used through
their public APIs; only the loop is ours.

This runs in the worker process the supervisor starts; it writes metrics.jsonl (one line per step),
events.jsonl (non-finite events) and worker.json (the facts the supervisor turns into result.json).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunegrid.files import JsonlAppender, write_json

OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "defaultcpuallocator")


# PyTorch's fallback for an op with no autograd kernel (e.g. bitsandbytes' inference-only gemv_4bit) only
# warns, and the gradient through it is wrong or missing: a cell that sees it must end `error`, never `ok`.
MISSING_AUTOGRAD_WARNING = r".*an autograd kernel was not registered"


@contextlib.contextmanager
def missing_autograd_fails() -> Iterator[None]:
    """Turn PyTorch's missing-autograd-kernel warning into an exception (the cell's `error` with its text)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=MISSING_AUTOGRAD_WARNING)
        yield


def classify_exception(exc: BaseException) -> str:
    import torch

    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return "oom"
    if any(marker in str(exc).lower() for marker in OOM_MARKERS):
        return "oom"
    return "error"


COLLECTIVE_TIMEOUT_MARKERS = ("timed out", "watchdog caught collective operation timeout", "timeout")
PEER_LOST_MARKERS = ("connection closed by peer", "connection reset by peer", "remote worker crashing", "broken pipe")


@dataclass(frozen=True)
class Ranks:
    """This process's place in a distributed cell (env set by the supervisor, as torchrun would)."""

    rank: int = 0
    world: int = 1
    local: int = 0

    @classmethod
    def from_env(cls) -> "Ranks":
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)))

    @property
    def distributed(self) -> bool:
        return self.world > 1


def rank_dir(run_dir: Path, rank: int) -> Path:
    """Rank 0 writes the cell's files; every other rank writes the same set under ranks/rank<r>/."""
    return run_dir if rank == 0 else run_dir / "ranks" / f"rank{rank}"


def classify_distributed(exc: BaseException) -> str | None:
    text = str(exc).lower()
    if any(marker in text for marker in PEER_LOST_MARKERS):
        return "peer_lost"
    if any(marker in text for marker in COLLECTIVE_TIMEOUT_MARKERS):
        return "collective_timeout"
    return None


class Heartbeat:
    """A file whose mtime is the last sign of life; the supervisor reads it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    last = "start"

    def beat(self, stage: str) -> None:
        self.last = stage
        self.path.write_text(stage)


def load_model(model_dir: Path, spec: dict[str, Any], plan: Any, device: Any) -> Any:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs: dict[str, Any] = {
        "dtype": plan.torch_dtype("storage"),
        "use_safetensors": True,  # never a pickle
        "trust_remote_code": bool(spec["model"].get("trust_remote_code")),  # off unless pinned hub + opt-in
    }
    bnb = {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": plan.torch_dtype("compute"),
    }
    if spec["axes"]["quant"] == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(**bnb)
    if device.type == "cuda":
        kwargs["device_map"] = {"": device.index or 0}
    if spec["axes"]["quant"] == "nf4-experts":  # experts quantized as they are read: never all in full precision
        from tunegrid import expert_quant

        kwargs["quantization_config"] = expert_quant.load_config(bnb, model_dir, lambda m: attach_lora(m, spec), kwargs["trust_remote_code"])
        model = expert_quant.load_causal_lm(model_dir, kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    if spec["axes"]["quant"] != "none":
        from tunegrid.quant_audit import disable_cpu_inference_packing

        # before any forward: an eval-mode no_grad forward on an AVX512-BF16 CPU would repack the
        # 4-bit weights into a layout without backward, for good (see disable_cpu_inference_packing)
        disable_cpu_inference_packing(model)
    if device.type != "cuda":
        model.to(device)
    return model


def attach_lora(model: Any, spec: dict[str, Any]) -> Any:
    from peft import LoraConfig, get_peft_model

    lora = spec["lora"]
    if spec["train"]["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = LoraConfig(
        r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=list(lora["target_modules"]),
        target_parameters=list(lora["target_parameters"]) or None,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def lr_lambda(warmup: int, total: int):  # type: ignore[no-untyped-def]
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


class CellTrainer:
    def __init__(self, spec: dict[str, Any], model_dir: Path, data_path: Path, run_dir: Path) -> None:
        self.spec = spec
        self.model_dir = model_dir
        self.data_path = data_path
        self.run_dir = run_dir
        self.facts: dict[str, Any] = {"outcome": "error", "reason": "did not start", "stage": "setup"}
        self.heartbeat = Heartbeat(run_dir / "heartbeat")
        self.ranks = Ranks.from_env()
        self.ddp: Any = None
        self.facts["rank"] = self.ranks.rank

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        import torch

        from tunegrid.instrument import MemoryMeter
        from tunegrid.precision import plan_precision

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

    def init_distributed(self) -> None:
        import datetime

        import torch
        import torch.distributed as dist

        settings = self.spec["distributed"]
        backend = settings["backend"] if settings["backend"] != "auto" else ("nccl" if self.device.type == "cuda" else "gloo")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.facts["distributed"] = {"backend": backend, "world_size": self.ranks.world, "collective_timeout_s": settings["collective_timeout_s"]}
        self.heartbeat.beat("init_process_group")
        dist.init_process_group(
            backend, rank=self.ranks.rank, world_size=self.ranks.world,
            timeout=datetime.timedelta(seconds=settings["collective_timeout_s"]),
            device_id=self.device if backend == "nccl" else None,
        )

    def wrap_ddp(self) -> None:
        """DDP over the trainable (LoRA) parameters; frozen base weights are not synchronized."""
        from torch.nn.parallel import DistributedDataParallel

        self.facts["stage"] = "ddp"
        self.heartbeat.beat("ddp")
        self.ddp = DistributedDataParallel(
            self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            broadcast_buffers=False,  # nothing to sync, and a replayed step must not add a collective
        )

    def inject_rank_faults(self, step: int) -> None:
        """debug.stall_rank / debug.kill_rank: a straggler or a crashed rank, on purpose."""
        import signal

        debug = self.spec.get("debug") or {}
        stall, kill = debug.get("stall_rank") or {}, debug.get("kill_rank") or {}
        if stall.get("rank") == self.ranks.rank and stall.get("step") == step and stall.get("seconds", 0) > 0:
            self.heartbeat.beat(f"step {step} stalled (injected, {stall['seconds']} s)")
            time.sleep(stall["seconds"])
            self.heartbeat.beat(f"step {step} forward+backward")
        if kill.get("rank") == self.ranks.rank and kill.get("step") == step:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def lora_digest(self) -> str:
        """sha256 of the trainable weights: every rank of a DDP cell must end with the same one."""
        import hashlib

        digest = hashlib.sha256()
        for name, param in sorted(self.trainable_named, key=lambda item: item[0]):
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().numpy().tobytes())
        return digest.hexdigest()

    # ---------------------------------------------------------------- model
    def build_model(self) -> None:
        from transformers import AutoTokenizer

        from tunegrid.checkpoints import verify_checkpoint

        from tunegrid.instrument import apply_memory_budget
        from tunegrid.probes import runtime_baseline_bytes

        self.facts["stage"] = "load"
        self.heartbeat.beat("load")
        verify_checkpoint(self.model_dir)
        if self.device.type == "cpu":  # what the estimate's calibrated runtime constant stands for
            self.memory["runtime_bytes_measured"] = runtime_baseline_bytes()
        budget = (self.spec.get("plan") or {}).get("budget_bytes")
        if budget:
            self.memory["budget_enforcement"] = apply_memory_budget(self.device.type, budget)
        self.meter.reset()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, trust_remote_code=bool(self.spec["model"].get("trust_remote_code")))
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
            "base_weight_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in self.model.parameters() if not p.requires_grad}),
            "adapter_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in self.trainable}),
        }

    def audit_and_adapt(self) -> None:
        """Quantization audit after load, optional expert quantization and kbit preparation, LoRA, audit again.

        Writes audit.json; result.json gets its summary.
        """
        import torch
        from peft import prepare_model_for_kbit_training

        from tunegrid import quant_audit

        quant, lora = self.spec["axes"]["quant"], self.spec["lora"]
        four_bit = quant != "none"
        report: dict[str, Any] = {"quant": quant, "after_load": quant_audit.audit_model(self.model, four_bit_requested=four_bit)}
        if quant == "nf4-experts":
            from tunegrid.expert_quant import quantized_at_load

            at_load = quantized_at_load(self.model)
        if four_bit and lora["prepare_kbit_training"]:
            before = quant_audit.audit_model(self.model, four_bit_requested=four_bit)
            self.model = prepare_model_for_kbit_training(self.model, use_gradient_checkpointing=self.spec["train"]["gradient_checkpointing"])
            report["prepare_kbit_training"] = quant_audit.growth(before, quant_audit.audit_model(self.model, four_bit_requested=four_bit))
        self.model = attach_lora(self.model, self.spec)
        if quant == "nf4-experts":
            # the load quantized every expert tensor but those peft wraps (it cannot wrap a parametrized one):
            # the post-load pass lists those, and would catch any the load missed
            after_load = quant_audit.quantize_experts_post_load(self.model)
            report["expert_quantization"] = {
                "order": "at_load",
                "changed": at_load,
                "changed_after_load": [c["name"] for c in after_load["changed"]],
                "kept_for_lora": after_load["kept_for_lora"],
            }
        report["after_adapters"] = quant_audit.audit_model(self.model, four_bit_requested=four_bit)
        report["lora"] = quant_audit.lora_attachment(self.model, lora["target_modules"], lora["target_parameters"])
        if report["lora"]["unmatched"]:
            print(f"WARNING: LoRA targets matched nothing: {report['lora']['unmatched']} (peft does not warn)", file=sys.stderr)
        write_json(self.run_dir / "audit.json", report)
        quant_audit.require_trainable_layout(self.model)  # after every setup forward, before any training
        self.facts["quant_audit"] = {
            "after_load": quant_audit.summarize(report["after_load"]),
            "after_adapters": quant_audit.summarize(report["after_adapters"]),
            "expert_quantization": report.get("expert_quantization"),
            "prepare_kbit_training": report.get("prepare_kbit_training"),
            "lora": report["lora"],
        }

    # ---------------------------------------------------------------- data
    def build_data(self) -> None:
        from tunegrid.data import BatchStream, read_dataset, tokenize_examples

        tensors = tokenize_examples(read_dataset(self.data_path), self.tokenizer, self.spec["train"]["seq_len"])
        # each rank draws its own batches (batch_size is per rank); rank 0 sees what a 1-process cell sees
        seed = self.spec["axes"]["seed"] + 7919 * self.ranks.rank
        self.stream = BatchStream(tensors, self.spec["axes"]["batch_size"], seed)

    # ---------------------------------------------------------------- forward + backward
    def forward_backward(self, batch: dict[str, Any], scaler: Any | None = None, scale: float | None = None) -> Any:
        """Loss and grads; under fp16 the loss is scaled by the GradScaler (or by a fixed scale on replay)."""
        from tunegrid.precision import autocast_context

        with autocast_context(self.plan):
            loss = (self.ddp or self.model)(**batch).loss
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            (loss * scale if scale is not None else loss).backward()
        return loss

    # ---------------------------------------------------------------- optimizer
    def build_optimizer(self) -> None:
        import torch

        from tunegrid.instrument import NonfiniteInjector
        from tunegrid.precision import make_grad_scaler

        train = self.spec["train"]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=train["lr"], weight_decay=train["weight_decay"])
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(train["warmup_steps"], train["steps"]))
        self.scaler = make_grad_scaler(self.plan)
        injection = (self.spec.get("debug") or {}).get("inject_nonfinite")
        self.injector = NonfiniteInjector(self.model, injection) if injection and injection.get("module") else None
        if self.ranks.distributed:
            self.wrap_ddp()

    # ---------------------------------------------------------------- one step
    def train_step(self, step: int, batch: dict[str, Any], census: Any = None, headroom: Any = None) -> dict[str, Any]:
        """One optimizer step with the always-on instruments: memory peak and the fused finiteness check."""
        import torch

        scaler = self.scaler
        if self.ranks.distributed:
            self.heartbeat.beat(f"step {step} forward+backward (DDP all-reduce of gradients)")
        self.inject_rank_faults(step)  # a single rank too: a slow step or a crashed worker, on purpose
        fact: dict[str, Any] = {"rng_state": torch.get_rng_state(), "scale": scaler.get_scale() if scaler is not None else None}
        self.meter.reset()
        started = time.perf_counter()
        with contextlib.ExitStack() as hooks:
            for instrument in (census, headroom):
                if instrument is not None:
                    hooks.enter_context(instrument.attached(self.model))
            if self.injector is not None:
                hooks.enter_context(self.injector.attached(step))
            loss = self.forward_backward(batch, scaler)
        if step == 0:  # every adapter asked for must receive a gradient, or we train fewer params than requested
            fact["params_without_grad"] = [n for n, p in self.trainable_named if p.grad is None]
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.spec["train"]["max_grad_norm"])
        # The one host sync of the step: loss and grad norm together (the norm is needed for clipping
        # anyway, and its finiteness is the NaN check for every gradient at once).
        loss_value, norm_value = torch.stack([loss.detach().float(), grad_norm.float()]).tolist()
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        if scaler is not None:
            scaler.step(self.optimizer)  # skips the update itself when grads are inf/nan
            scaler.update()
            skipped = scaler.get_scale() < fact["scale"]
        elif finite:
            self.optimizer.step()
            skipped = False
        else:
            skipped = True  # never apply a non-finite update to the weights
        self.optimizer.zero_grad(set_to_none=True)
        fact.update(lr=self.scheduler.get_last_lr()[0], loss=loss_value, grad_norm=norm_value, skipped=skipped)
        self.scheduler.step()
        fact["elapsed"] = time.perf_counter() - started
        fact["peak"] = self.meter.peak_bytes()
        return fact

    def replay_origin(self, step: int, batch: dict[str, Any], rng_state: Any, scale: float | None,
                      headroom: Any = None) -> dict[str, Any]:
        """Re-run the failing step from the same state with hooks: which module went non-finite first.

        The weights are as they were before the step: a non-finite step never updates them. With a
        headroom meter, the failing step's activations are measured too, so the cell's worst headroom
        is never only the sampled steps'.
        """
        import torch

        from tunegrid.instrument import OriginTracer

        self.optimizer.zero_grad(set_to_none=True)
        torch.set_rng_state(rng_state)
        tracer = OriginTracer(self.model)
        with contextlib.ExitStack() as hooks:
            # Under activation checkpointing the hooked forward and its recomputation save different
            # tensor counts (CheckpointError); the replay is one step, so it runs without checkpointing.
            hooks.enter_context(self.checkpointing_off())
            if self.injector is not None:  # registered first, so the tracer sees what it injects
                hooks.enter_context(self.injector.attached(step))
            hooks.enter_context(tracer.attached())
            if headroom is not None:
                hooks.enter_context(headroom.attached(self.model))
            # no all-reduce on replay: every rank replays on its own (they all saw the same averaged norm)
            hooks.enter_context(self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext())
            self.forward_backward(batch, scale=scale)
        self.optimizer.zero_grad(set_to_none=True)
        origin = tracer.as_dict()
        if headroom is not None:
            origin["headroom"] = headroom.collect(step)
        return origin

    @contextlib.contextmanager
    def checkpointing_off(self):  # type: ignore[no-untyped-def]
        """Activation checkpointing off for the duration (the replay), then back as it was."""
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        on = getattr(base, "is_activation_checkpointing", None)  # transformers >= 5 name; the old one warns
        if not (on if on is not None else getattr(base, "is_gradient_checkpointing", False)):
            yield
            return
        base.gradient_checkpointing_disable()
        try:
            yield
        finally:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    # ---------------------------------------------------------------- loop
    def loop(self) -> None:
        from tqdm.auto import tqdm

        from tunegrid.instrument import DtypeCensus, HeadroomMeter

        train = self.spec["train"]
        steps, policy, every = train["steps"], train["on_nonfinite"], train["headroom_every"]
        self.build_optimizer()
        metrics = JsonlAppender(self.run_dir / "metrics.jsonl")
        events = JsonlAppender(self.run_dir / "events.jsonl")
        headroom_log = JsonlAppender(self.run_dir / "headroom.jsonl")
        census, headroom = DtypeCensus(), HeadroomMeter()
        step_times, tokens_per_s, steady_peaks = [], [], []
        skipped_total = consecutive_skips = 0
        nonfinite_events: list[dict[str, Any]] = []
        headroom_steps: list[int] = []  # the failing steps whose headroom was measured on replay
        stop_event: dict[str, Any] | None = None
        unsupported: list[str] = []
        losses: list[float] = []
        self.facts["stage"] = "step"
        progress = tqdm(total=steps, desc=self.spec["cell_id"], unit="step", mininterval=2.0, file=sys.stderr)
        try:
            for step in range(steps):
                batch = {k: v.to(self.device) for k, v in self.stream.batch(step).items()}
                measure_headroom = every > 0 and step % every == 0
                fact = self.train_step(step, batch, census if step == 0 else None, headroom if measure_headroom else None)
                tokens = int(batch["attention_mask"].sum())
                skipped_total += int(fact["skipped"])
                consecutive_skips = consecutive_skips + 1 if fact["skipped"] else 0
                if step == 0:
                    self.memory["first_step_peak_bytes"] = fact["peak"]
                    if fact["params_without_grad"]:
                        unsupported = fact["params_without_grad"]
                else:
                    step_times.append(fact["elapsed"])
                    tokens_per_s.append(tokens / fact["elapsed"])
                    steady_peaks.append(fact["peak"])
                record = {
                    "step": step,
                    "time": time.time(),
                    "loss": fact["loss"],
                    "grad_norm": fact["grad_norm"],
                    "lr": fact["lr"],
                    "tokens_per_s": tokens / fact["elapsed"],
                    "step_time_s": fact["elapsed"],
                    "mem_peak_bytes": fact["peak"],
                    "skipped_steps": skipped_total,
                }
                if self.scaler is not None:
                    record["loss_scale"] = fact["scale"]
                if measure_headroom:
                    worst = headroom.collect(step)
                    headroom_log.write(worst)
                    record["fp16_headroom_max_ratio"] = worst["max_ratio"]
                metrics.write(record)
                progress.set_postfix(loss=f"{fact['loss']:.4g}", refresh=False)
                progress.update()
                if unsupported:
                    break
                loss_finite, grad_finite = math.isfinite(fact["loss"]), math.isfinite(fact["grad_norm"])
                if loss_finite:
                    losses.append(fact["loss"])
                if loss_finite and grad_finite:
                    continue

                kind = "loss_nonfinite" if not loss_finite else ("scaler_skip" if self.scaler else "grad_nonfinite_finite_loss")
                event = {"step": step, "kind": kind, "loss": fact["loss"], "grad_norm": fact["grad_norm"], "loss_scale": fact["scale"]}
                stop = (
                    policy == "stop"
                    or (policy == "stop_after_skips" and kind != "scaler_skip")
                    or (policy == "stop_after_skips" and consecutive_skips >= train["max_consecutive_skips"])
                )
                # Every event that ends the cell or is the first of its kind gets its origin (a replay of
                # that step); repeats of a kind already traced under `continue` are recorded without one.
                if stop or kind not in {e["kind"] for e in nonfinite_events}:
                    event["origin"] = self.replay_origin(step, batch, fact["rng_state"], fact["scale"], headroom)
                    event["headroom"] = event["origin"].pop("headroom")
                    headroom_log.write({**event["headroom"], "failing_step": True})
                    headroom_steps.append(step)
                nonfinite_events.append(event)
                events.write(event)
                if stop:
                    stop_event = event
                    break
        finally:
            progress.close()
            for log in (metrics, events, headroom_log):
                log.close()

        self.memory["steady_peak_bytes"] = max(steady_peaks) if steady_peaks else None
        self.memory["peak_bytes"] = max(
            v for v in (self.memory.get("load_peak_bytes"), self.memory.get("first_step_peak_bytes"), self.memory["steady_peak_bytes"]) if v
        )
        self.facts["precision_in_effect"].update(census.as_dict())
        self.facts["fp16_headroom"] = {
            **headroom.summary(),
            "sampled_every": every,  # the worst is over these samples plus the failing steps, never only samples
            "failing_steps_measured": headroom_steps,
        }
        self.facts["throughput"] = {
            "tokens_per_s_median": statistics.median(tokens_per_s) if tokens_per_s else None,
            "step_time_s_median": statistics.median(step_times) if step_times else None,
        }
        self.facts["training"] = {
            "steps_run": step + 1,
            "initial_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            "skipped_steps": skipped_total,
        }
        self._conclude(nonfinite_events, stop_event, consecutive_skips, steps_run=step + 1)
        if self.ranks.distributed:
            self.facts["lora_sha256"] = self.lora_digest()
        if unsupported:
            self.facts.update(
                outcome="unsupported",
                reason=f"{len(unsupported)} adapter tensors get no gradient with this peft/bitsandbytes combination "
                f"(e.g. {unsupported[0]}); refusing to train fewer parameters than requested",
                diagnosis={"params_without_grad": unsupported},
            )

    def _conclude(self, events: list[dict[str, Any]], stop_event: dict[str, Any] | None, consecutive_skips: int,
                  steps_run: int) -> None:
        """ok only if every step ran and none ended non-finite; else nan with the event that decided it.

        The deciding event is the one that stopped the loop, else the first non-finite loss/gradient
        (under `continue`), else scaler skips the scaler did not recover from. Scaler skips it recovered
        from are listed, not failures.
        """
        train = self.spec["train"]
        hard = [e for e in events if e["kind"] != "scaler_skip"]
        unrecovered_skips = bool(events) and (train["on_nonfinite"] == "stop" or consecutive_skips >= train["max_consecutive_skips"])
        deciding = stop_event or (hard[0] if hard else None) or (events[0] if unrecovered_skips else None)
        recovered = [e for e in events if e["kind"] == "scaler_skip" and e is not deciding]
        diagnosis: dict[str, Any] = {"recovered_scaler_skips": recovered[0]} if recovered else {}
        if deciding is not None:
            origin = deciding.get("origin") or {}
            where = (origin.get("forward") or origin.get("backward") or {}).get("module", "unknown module")
            stopped = f"; stopped after {steps_run} of {train['steps']} steps" if steps_run < train["steps"] else ""
            self.facts.update(
                outcome="nan",
                reason=f"{deciding['kind']} at step {deciding['step']}, first non-finite at {where}{stopped}",
                diagnosis={**diagnosis, "nan": deciding, "nonfinite_events": len(events)},
            )
        elif steps_run < train["steps"]:  # never ok when the loop ended early, whatever the reason
            self.facts.update(outcome="error", reason=f"stopped after {steps_run} of {train['steps']} steps without a diagnosis",
                              diagnosis=diagnosis)
        else:
            self.facts.update(outcome="ok", reason=f"trained all {steps_run} steps with finite loss", diagnosis=diagnosis)

    # ---------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        started = time.time()
        try:
            self.setup()
            self.build_model()
            self.build_data()
            self.loop()
        except BaseException as exc:  # a failure is a result; only tunegrid bugs should fail the rule
            kind = classify_exception(exc) if not isinstance(exc, KeyboardInterrupt) else "error"
            stage = self.facts.get("stage", "setup")
            self.facts.update(outcome=kind, reason=f"{type(exc).__name__} during {stage}: {str(exc)[:300]}")
            collective = classify_distributed(exc) if self.ranks.distributed else None
            if collective is not None:
                self.facts["outcome"] = "timeout" if collective == "collective_timeout" else "error"
                self.facts["diagnosis"] = {collective: {
                    "rank": self.ranks.rank, "waiting_in": self.heartbeat.last,
                    "timeout_s": self.spec["distributed"]["collective_timeout_s"], "message": str(exc)[:400],
                }}
            self.facts["traceback"] = traceback.format_exc()[-4000:]
            if kind == "oom":
                self.facts["diagnosis"] = {"oom": {"stage": stage, "bytes_at_failure": self.meter_current()}}
            traceback.print_exc()
        finally:
            self.facts["memory"] = getattr(self, "memory", {})
            self.facts["wall_s"] = time.time() - started
            write_json(self.run_dir / "worker.json", self.facts)
        return self.facts

    def meter_current(self) -> int | None:
        meter = getattr(self, "meter", None)
        return meter.current_bytes() if meter else None


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

        if facts["outcome"] in ("ok", "nan") and dist.is_initialized():
            dist.destroy_process_group()
        else:  # a broken group can hang in teardown (NCCL abort); the facts are written, leave now
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    return 0
