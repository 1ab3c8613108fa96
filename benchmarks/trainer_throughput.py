#!/usr/bin/env python
"""Training throughput: tunegrid's loop vs Hugging Face `Trainer` + peft, same model, data, precision,
quantization and adapter, in the same run. Tokens/s = batch x seq_len / median step time (identical
for both). Goal: tunegrid / Trainer >= 1.0.

Both start from the same CellTrainer build (synthetic checkpoint, 4-bit load when asked, LoRA attached
by tunegrid's code), so only the loop differs: tunegrid's instrumented step vs Trainer's inner loop
(timed by a callback).

    python benchmarks/trainer_throughput.py                # CPU: ~25M Gemma 3, fp32 and bf16, no quantization
    python benchmarks/trainer_throughput.py --device cuda  # GPU: QLoRA (nf4) bf16 at seq 2048 on a Gemma 3 4B-width
                                                           # dense model and an OLMoE-1B-7B-width MoE (4 layers each)
    python benchmarks/trainer_throughput.py --smoke        # the default study's tiny Gemma 3, a few steps: checks
                                                           # that both loops run, measures nothing worth keeping

Writes results/benchmarks/trainer_throughput.json with the machine facts (machine.py).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from machine import device_from_argv  # noqa: E402

if __name__ == "__main__":  # --device cpu must hide the GPUs before torch is imported
    DEVICE = device_from_argv()

from machine import absolute_times, add_device_argument, describe, machine_facts, write_results  # noqa: E402
from nan_overhead import trainer_for  # noqa: E402
from widths import GEMMA3_25M as GEMMA3_25M_CONFIG  # noqa: E402
from widths import gemma3_4b_width, olmoe_width, synthetic  # noqa: E402

from tunegrid.cell.train import CellTrainer  # noqa: E402
from tunegrid.dataset import read_dataset  # noqa: E402
from tunegrid.prepare.checkpoints import produce_checkpoint  # noqa: E402
from tunegrid.prepare.data import corpus_texts, write_dataset  # noqa: E402
from tunegrid.prepare.probes import cpu_inventory, cpu_precision_support  # noqa: E402
from tunegrid.study.config import load_study  # noqa: E402

GEMMA3_25M = synthetic("gemma3_text", GEMMA3_25M_CONFIG)
GEMMA3_4B_WIDTH = synthetic("gemma3_text", gemma3_4b_width(layers=4))
OLMOE_WIDTH = synthetic("olmoe", olmoe_width(layers=4))
# (model name, model spec, precision, quant, batch, seq_len) per device
CASES = {
    "cpu": [("gemma3-25m", GEMMA3_25M, "fp32", "none", 4, 128), ("gemma3-25m", GEMMA3_25M, "bf16", "none", 4, 128)],
    "cuda": [
        ("gemma3-4b-width", GEMMA3_4B_WIDTH, "bf16", "nf4", 2, 2048),
        ("olmoe-width", OLMOE_WIDTH, "bf16", "nf4", 2, 2048),
    ],
}
STEPS = 24
SMOKE_STEPS = 6  # the median is taken after two warm-up steps


def ours(trainer: CellTrainer, steps: int) -> float:
    times = []
    for step in range(steps):
        batch = {k: v.to(trainer.device) for k, v in trainer.stream.batch(step).items()}  # as the cell's loop
        started = time.perf_counter()
        trainer.optimizer_step.run(step, [batch])
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def hf_trainer(trainer: CellTrainer, precision: str, batch: int, out: Path, steps: int) -> float:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    tensors = trainer.stream.tensors

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(tensors["input_ids"])

        def __getitem__(self, i: int) -> dict:
            return {k: v[i] for k, v in tensors.items()}

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.times.append(time.perf_counter() - self.started)

    timer = StepTimer()
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=1e-3,
        bf16=precision == "bf16",
        use_cpu=DEVICE == "cpu",
        logging_steps=1000,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        max_grad_norm=1.0,
        disable_tqdm=True,
    )
    Trainer(model=trainer.model, args=args, train_dataset=Rows(), callbacks=[timer]).train()
    return statistics.median(timer.times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    parser.add_argument("--smoke", action="store_true", help="the default study's tiny Gemma 3, fp32, a few steps")
    parser.add_argument("--out", default=str(REPO / "results" / "benchmarks"), help="folder of the JSON")
    args = parser.parse_args()
    facts = machine_facts(DEVICE)
    steps = SMOKE_STEPS if args.smoke else STEPS
    work = Path(tempfile.mkdtemp(prefix="tunegrid-trainer-"))
    data = work / "train.jsonl"
    write_dataset(data, 256, 0)
    texts = list(corpus_texts(read_dataset(data)))
    rows = []
    cases = CASES[DEVICE]
    if args.smoke:
        tiny = load_study(REPO / "configs" / "config.yaml")["models"]["gemma3-tiny"]
        cases = [("gemma3-tiny", tiny, "fp32", "none", 2, 32)]
    if DEVICE == "cpu" and cpu_precision_support(cpu_inventory()["isa_flags"])["bf16"] != "native":
        # emulated bf16 on a CPU runs minutes per step at this size, for both loops alike: nothing to learn
        print("this CPU has no native bf16 (no AVX512-BF16/AMX): the bf16 case is skipped")
        cases = [case for case in cases if case[2] != "bf16"]
    for name, model, precision, quant, batch, seq_len in cases:
        study = load_study(REPO / "configs" / "config.yaml")
        study["train"].update(threads=2, seq_len=seq_len, steps=steps, headroom_every=0)
        study["models"][name] = copy.deepcopy(model)
        if not (work / name).exists():
            produce_checkpoint(copy.deepcopy(model), texts, work / name)

        ours_cell = trainer_for(
            study, name, work / name, data, work / f"ours-{name}-{precision}", batch, precision, quant
        )
        hf_cell = trainer_for(study, name, work / name, data, work / f"hf-{name}-{precision}", batch, precision, quant)
        a = ours(ours_cell, steps)
        b = hf_trainer(hf_cell, precision, batch, work / f"hf-out-{name}-{precision}", steps)
        tokens = batch * seq_len
        rows.append(
            {
                "model": name,
                "precision": precision,
                "quant": quant,
                "batch_size": batch,
                "seq_len": seq_len,
                "tunegrid_step_s": a,
                "trainer_step_s": b,
                "tunegrid_tokens_per_s": tokens / a,
                "trainer_tokens_per_s": tokens / b,
                "ratio": b / a,
            }
        )
    write_results("trainer_throughput", facts, rows, args.out)
    print(describe(facts))
    for row in rows:
        absolute = (
            f"tunegrid {row['tunegrid_tokens_per_s']:.0f} tok/s, Trainer+peft {row['trainer_tokens_per_s']:.0f} tok/s, "
            if absolute_times(facts)
            else ""
        )
        print(
            f"{row['model']} {row['precision']} {row['quant']} bs{row['batch_size']} seq{row['seq_len']}: {absolute}"
            f"tunegrid/Trainer tokens/s = {row['ratio']:.3f} (goal >= 1.0)"
        )


if __name__ == "__main__":
    main()
