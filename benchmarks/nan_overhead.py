#!/usr/bin/env python
"""Cost of tunegrid's always-on NaN detection, measured side by side in one run.

For each model: median step time of (a) a bare loop (forward, backward, clip, step, loss.item()),
(b) tunegrid's instrumented step (fused loss/grad-norm finiteness check, memory meter, RNG capture
for replay), (c) the bare loop under torch.autograd.detect_anomaly. Variants are interleaved in rounds
so machine drift hits all three alike. Prints b/a and c/a last; writes results/benchmarks/nan_overhead.{json,csv}.

    python benchmarks/nan_overhead.py            # default tiny model + a ~25M-param synthetic model
    python benchmarks/nan_overhead.py --quick    # fewer steps
    python benchmarks/nan_overhead.py --device cuda   # bf16, seq 2048, plus 2 layers at Gemma 3 4B width
    python benchmarks/nan_overhead.py --smoke    # the tiny Gemma 3 alone, one round of 2 steps: checks that it runs

On a GPU the figures are absolute and relative; on a CPU only the ratios are printed (machine.py).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import device_from_argv  # noqa: E402

if __name__ == "__main__":  # --device cpu must hide the GPUs before torch is imported
    DEVICE = device_from_argv()

from machine import absolute_times, add_device_argument, describe, machine_facts, write_results  # noqa: E402
from widths import GEMMA3_25M, gemma3_4b_width  # noqa: E402

from tunegrid.cell.train import CellTrainer  # noqa: E402
from tunegrid.contract import CellJob  # noqa: E402
from tunegrid.dataset import read_dataset  # noqa: E402
from tunegrid.prepare.cell_plan import make_contract  # noqa: E402
from tunegrid.prepare.checkpoints import produce_checkpoint  # noqa: E402
from tunegrid.prepare.data import corpus_texts, write_dataset  # noqa: E402
from tunegrid.study.config import cell_spec, expand_cells, load_study  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def trainer_for(
    study: dict,
    model: str,
    model_dir: Path,
    data: Path,
    run_dir: Path,
    batch: int,
    precision: str = "fp32",
    quant: str = "none",
) -> CellTrainer:
    study = copy.deepcopy(study)
    study["grid"].update(model=[model], precision=[precision], batch_size=[batch], quant=[quant], seed=[0])
    spec = cell_spec(study, expand_cells(study)[0])
    run_dir.mkdir(parents=True, exist_ok=True)
    job = CellJob(model_dir=str(model_dir), data_path=str(data), run_dir=str(run_dir), result_path=str(run_dir / "r"))
    trainer = CellTrainer(make_contract(spec, job, warm_worker=False, capabilities={}), run_dir)  # as the rule plans it
    trainer.setup()
    trainer.build_model()
    trainer.build_data()
    trainer.build_optimizer()
    return trainer


def on_device(trainer: CellTrainer, step: int) -> dict:
    """The step's rows where the model is, as the trainer's own loop moves them."""
    return {k: v.to(trainer.device) for k, v in trainer.stream.batch(step).items()}


def bare_step(trainer: CellTrainer, batch: dict, anomaly: bool) -> None:
    """A plain loop in the cell's own precision: under the same autocast (bf16 and the fp16 modes compute under
    it), so the two loops differ by tunegrid's instruments only."""
    import torch

    from tunegrid.cell.loop.precision import autocast_context

    context = torch.autograd.detect_anomaly(check_nan=True) if anomaly else torch.enable_grad()
    with context, autocast_context(trainer.optimizer_step.precision):
        loss = trainer.model(**batch).loss
        loss.backward()
    torch.nn.utils.clip_grad_norm_(trainer.optimizer_step.trainable, 1.0)
    trainer.optimizer_step.optimizer.step()
    trainer.optimizer_step.optimizer.zero_grad(set_to_none=True)
    loss.item()  # every loop logs its loss: the bare loop pays this sync too


def measure(trainer: CellTrainer, rounds: int, steps_per_round: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"bare": [], "tunegrid": [], "detect_anomaly": []}
    step = 0
    for _ in range(2):  # warm-up
        bare_step(trainer, on_device(trainer, step), anomaly=False)
    for _ in range(rounds):
        for variant in times:
            for _ in range(steps_per_round):
                batch = on_device(trainer, step)
                started = time.perf_counter()
                if variant == "tunegrid":
                    trainer.optimizer_step.run(step, [batch])
                else:
                    bare_step(trainer, batch, anomaly=variant == "detect_anomaly")
                times[variant].append(time.perf_counter() - started)
                step += 1
    return {variant: statistics.median(values) for variant, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the tiny Gemma 3 alone, one round of 2 steps")
    parser.add_argument("--out", default=str(REPO / "results" / "benchmarks"))
    add_device_argument(parser)
    args = parser.parse_args()
    facts = machine_facts(DEVICE)
    on_gpu = DEVICE == "cuda"
    rounds, per_round = (1, 2) if args.smoke else (3, 5) if args.quick else (5, 8)

    study = load_study(REPO / "configs" / "config.yaml")
    study["train"]["threads"] = 2
    if on_gpu:  # a real step: bf16 at seq 2048, where a per-step host read would show if it cost anything
        study["train"]["seq_len"] = 2048
    precision = "bf16" if on_gpu else "fp32"
    work = Path(tempfile.mkdtemp(prefix="tunegrid-bench-"))
    data = work / "train.jsonl"
    write_dataset(data, 256, 0)
    texts = list(corpus_texts(read_dataset(data)))
    study["models"]["gemma3-25m"] = {**study["models"]["gemma3-tiny"], "config": GEMMA3_25M}
    gemma3_4b_2l = gemma3_4b_width(layers=2, vocab_size=4096)
    study["models"]["gemma3-4b-width-2l"] = {**study["models"]["gemma3-tiny"], "config": gemma3_4b_2l}
    models = [("gemma3-tiny", 8), ("qwen3moe-tiny", 8), ("gemma3-25m", 4)]
    if on_gpu:
        models.append(("gemma3-4b-width-2l", 2))
    if args.smoke:
        models = models[:1]
    rows = []
    for model, batch in models:
        spec = copy.deepcopy(study["models"][model])
        if model in ("gemma3-25m", "gemma3-4b-width-2l"):
            spec["config"]["initializer_range"] = 0.02
        produce_checkpoint(spec, texts, work / model)
        study["models"][model] = spec
        trainer = trainer_for(study, model, work / model, data, work / f"run-{model}", batch, precision)
        medians = measure(trainer, rounds, per_round)
        params = sum(p.numel() for p in trainer.model.parameters())
        rows.append(
            {
                "model": model,
                "params": params,
                "batch_size": batch,
                "seq_len": study["train"]["seq_len"],
                "precision": precision,
                "bare_s": medians["bare"],
                "tunegrid_s": medians["tunegrid"],
                "detect_anomaly_s": medians["detect_anomaly"],
                "tunegrid_over_bare": medians["tunegrid"] / medians["bare"],
                "anomaly_over_bare": medians["detect_anomaly"] / medians["bare"],
            }
        )
        del trainer

    write_results("nan_overhead", facts, rows, args.out)
    print(describe(facts))
    if absolute_times(facts):
        print(f"{'model':<20}{'params':>14}{'bare ms':>10}{'tunegrid ms':>13}{'anomaly ms':>12}{'b/a':>8}{'c/a':>8}")
        for r in rows:
            print(
                f"{r['model']:<20}{r['params']:>14,}{r['bare_s'] * 1e3:>10.1f}{r['tunegrid_s'] * 1e3:>13.1f}"
                f"{r['detect_anomaly_s'] * 1e3:>12.1f}{r['tunegrid_over_bare']:>8.3f}{r['anomaly_over_bare']:>8.2f}"
            )
    else:
        print(f"{'model':<20}{'params':>14}{'tunegrid/bare':>15}{'anomaly/bare':>14}   (CPU: ratios only)")
        for r in rows:
            print(f"{r['model']:<20}{r['params']:>14,}{r['tunegrid_over_bare']:>15.3f}{r['anomaly_over_bare']:>14.2f}")
    print("goal: tunegrid/bare <= 1.03")


if __name__ == "__main__":
    main()
