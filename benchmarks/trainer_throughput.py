#!/usr/bin/env python
"""Training throughput: tunegrid's loop vs Hugging Face `Trainer` + peft, same model, data and
adapter, in the same run; fp32 and bf16 on CPU. Tokens/s = batch x seq_len / median step time
(padded tokens, identical for both). Goal: tunegrid / Trainer >= 1.0.

Both start from the same CellTrainer build (synthetic checkpoint, LoRA attached by tunegrid's code), so
only the loop differs: tunegrid's instrumented step vs Trainer's inner loop (timed by a callback).

    python benchmarks/trainer_throughput.py     # writes results/benchmarks/trainer_throughput.json
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from tunegrid.checkpoints import produce_checkpoint  # noqa: E402
from tunegrid.config import load_study  # noqa: E402
from tunegrid.data import corpus_texts, read_dataset, write_dataset  # noqa: E402
from tunegrid.train import CellTrainer  # noqa: E402
from nan_overhead import trainer_for  # noqa: E402

MODEL = {  # ~25M parameters: Gemma 3 text at width 512, 6 layers
    "source": "synthetic", "architecture": "gemma3_text", "seed": 0,
    "config": {"vocab_size": 512, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 6,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64},
}
BATCH, SEQ, STEPS = 4, 128, 24


def build(study: dict, precision: str, model_dir: Path, data: Path, run_dir: Path) -> CellTrainer:
    return trainer_for(study, "bench", model_dir, data, run_dir, BATCH, precision)


def ours(trainer: CellTrainer) -> float:
    times = []
    for step in range(STEPS):
        batch = trainer.stream.batch(step)
        started = time.perf_counter()
        trainer.train_step(step, batch)
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def hf_trainer(trainer: CellTrainer, precision: str, out: Path) -> float:
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
        output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=1e-3,
        bf16=precision == "bf16", use_cpu=True, logging_steps=1000, save_strategy="no", report_to=[],
        dataloader_num_workers=0, max_grad_norm=1.0, disable_tqdm=True,
    )
    Trainer(model=trainer.model, args=args, train_dataset=Rows(), callbacks=[timer]).train()
    return statistics.median(timer.times[2:])


def main() -> None:
    study = load_study(REPO / "configs" / "config.yaml")
    study["train"].update(threads=2, seq_len=SEQ, steps=STEPS, headroom_every=0)
    work = Path(tempfile.mkdtemp(prefix="tunegrid-trainer-"))
    data = work / "train.jsonl"
    write_dataset(data, 256, 0)
    produce_checkpoint(copy.deepcopy(MODEL), list(corpus_texts(read_dataset(data))), work / "bench")
    study["models"]["bench"] = MODEL
    rows = []
    for precision in ("fp32", "bf16"):
        a = ours(build(study, precision, work / "bench", data, work / f"ours-{precision}"))
        b = hf_trainer(build(study, precision, work / "bench", data, work / f"hf-{precision}"), precision, work / f"hf-out-{precision}")
        tokens = BATCH * SEQ
        rows.append({"precision": precision, "tunegrid_tokens_per_s": tokens / a, "trainer_tokens_per_s": tokens / b, "ratio": b / a})
    out = REPO / "results" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    (out / "trainer_throughput.json").write_text(json.dumps(rows, indent=2))
    for row in rows:
        print(f"{row['precision']}: tunegrid {row['tunegrid_tokens_per_s']:.0f} tok/s, Trainer+peft {row['trainer_tokens_per_s']:.0f} tok/s, "
              f"tunegrid/Trainer = {row['ratio']:.3f} (goal >= 1.0)")


if __name__ == "__main__":
    main()
