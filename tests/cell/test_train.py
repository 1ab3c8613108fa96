"""The training loop on tiny synthetic models, in-process (the worker's own entry point)."""

from __future__ import annotations

import pytest
from conftest import make_study, one_cell, run_in_process, work_cell

from tunegrid.runtime.files import read_json, read_jsonl
from tunegrid.study.config import cell_spec, expand_cells, resolve_study


def _run(
    checkpoints, dataset_path, tmp_path, *, model="gemma3-hot", precision="fp32", quant="none", batch=2, train=None
):
    spec = one_cell(model=model, precision=precision, quant=quant, batch=batch, train=train)
    run_dir = tmp_path / spec["cell_id"]
    return run_in_process(spec, checkpoints, dataset_path, run_dir), run_dir


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_gemma_hot_reproduces_fp16_nan_with_origin_in_layer0_mlp(checkpoints, dataset_path, tmp_path, precision):
    facts, run_dir = _run(checkpoints, dataset_path, tmp_path, precision=precision, batch=8, train={"steps": 12})
    if precision == "fp16":
        assert facts["outcome"] == "nan", facts["reason"]
        nan = facts["diagnosis"]["nan"]
        assert nan["kind"] == "loss_nonfinite"
        forward = nan["origin"]["forward"]
        assert ".layers.0.mlp." in forward["module"] and "proj" in forward["module"]
        assert forward["dtype"] == "float16"
        events = read_jsonl(run_dir / "events.jsonl")
        assert events and events[0]["step"] == nan["step"]
    else:
        assert facts["outcome"] == "ok", facts["reason"]


def test_same_seed_same_origin(checkpoints, dataset_path, tmp_path):
    a, _ = _run(checkpoints, dataset_path, tmp_path / "a", precision="fp16", batch=8, train={"steps": 12})
    b, _ = _run(checkpoints, dataset_path, tmp_path / "b", precision="fp16", batch=8, train={"steps": 12})
    assert a["diagnosis"]["nan"]["step"] == b["diagnosis"]["nan"]["step"]
    assert a["diagnosis"]["nan"]["origin"]["forward"]["module"] == b["diagnosis"]["nan"]["origin"]["forward"]["module"]


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")])
def test_precision_in_effect_matches_request(checkpoints, dataset_path, tmp_path, precision, dtype):
    facts, _ = _run(checkpoints, dataset_path, tmp_path, model="qwen3moe-tiny", precision=precision, quant="nf4")
    seen = facts["precision_in_effect"]
    assert facts["outcome"] == "ok", facts["reason"]
    assert dtype in seen["forward"]
    assert seen["adapter_dtypes"] == ["float32"]
    if precision != "fp32":
        # under autocast the projections compute in the low dtype, not silently in fp32
        assert seen["forward"][dtype] >= seen["forward"].get("float32", 0) / 4


def test_metrics_every_step_and_loss_falls_in_fp32(checkpoints, dataset_path, tmp_path):
    facts, run_dir = _run(checkpoints, dataset_path, tmp_path, model="qwen3moe-tiny", batch=8, train={"steps": 25})
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(25))
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "mem_peak_bytes"):
        assert all(key in r for r in records)
    first = sum(r["loss"] for r in records[:3]) / 3
    last = sum(r["loss"] for r in records[-3:]) / 3
    assert last < first - 0.5, (first, last)
    assert facts["memory"]["peak_bytes"] > 0 and facts["memory"]["load_peak_bytes"] > 0


def test_nf4_quantizes_linear_layers(checkpoints, dataset_path, tmp_path):
    facts, _ = _run(checkpoints, dataset_path, tmp_path, model="qwen3moe-tiny", quant="nf4")
    assert "uint8" in facts["precision_in_effect"]["base_weight_dtypes"]  # Params4bit storage


def test_lora_target_matching_nothing_is_an_error_outcome(checkpoints, dataset_path, tmp_path):
    grid = {"model": ["qwen3moe-tiny"], "precision": ["fp32"], "batch_size": [2], "quant": ["none"], "seed": [0]}
    study = resolve_study(make_study(grid=grid, lora={"target_modules": ["no_such_module"]}))
    spec = cell_spec(study, expand_cells(study)[0]).to_json()
    work_cell(spec, checkpoints["qwen3moe-tiny"], dataset_path, tmp_path / "r")
    facts = read_json(tmp_path / "r" / "worker.json")
    assert facts["outcome"] == "error"
    assert "no_such_module" in facts["reason"]


def _run_with(checkpoints, dataset_path, tmp_path, *, model, precision, debug=None, train=None, batch=2):
    spec = one_cell(model=model, precision=precision, batch=batch, train=train, debug=debug or {})
    return run_in_process(spec, checkpoints, dataset_path, tmp_path), tmp_path


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_injected_nonfinite_is_found_at_that_module_and_step(checkpoints, dataset_path, tmp_path, phase):
    target = "model.layers.0.self_attn.o_proj"  # layer 0: the next layer's attention spreads it to scored tokens
    debug = {"inject_nonfinite": {"module": target, "step": 2, "phase": phase}}
    facts, run_dir = _run_with(
        checkpoints, dataset_path, tmp_path, model="qwen3moe-tiny", precision="fp32", debug=debug, train={"steps": 5}
    )
    nan = facts["diagnosis"]["nan"]
    assert facts["outcome"] == "nan"
    assert nan["step"] == 2
    origin = nan["origin"][phase]
    assert origin["module"].endswith(target)
    if phase == "forward":
        assert nan["kind"] == "loss_nonfinite"
    else:
        # the loss was finite, only the gradients overflowed
        assert nan["kind"] == "grad_nonfinite_finite_loss"
        assert nan["origin"]["forward"] is None


def test_fp16_backward_overflow_is_a_scaler_skip_not_ok(checkpoints, dataset_path, tmp_path):
    debug = {"inject_nonfinite": {"module": "model.layers.0.mlp", "step": 1, "phase": "backward"}}
    facts, run_dir = _run_with(
        checkpoints,
        dataset_path,
        tmp_path,
        model="qwen3moe-tiny",
        precision="fp16",
        debug=debug,
        train={"steps": 4, "on_nonfinite": "stop"},
    )
    assert facts["outcome"] == "nan"
    assert facts["diagnosis"]["nan"]["kind"] == "scaler_skip"
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert records[-1]["skipped_steps"] >= 1 and "loss_scale" in records[-1]


def test_scaler_skips_the_scaler_recovers_from_are_counted_not_failed(checkpoints, dataset_path, tmp_path):
    debug = {"inject_nonfinite": {"module": "model.layers.0.mlp", "step": 1, "phase": "backward"}}
    facts, run_dir = _run_with(
        checkpoints,
        dataset_path,
        tmp_path,
        model="qwen3moe-tiny",
        precision="fp16",
        debug=debug,
        train={"steps": 4},
    )
    assert facts["outcome"] == "ok"
    skipped = facts["training"]["skipped_steps"]
    assert skipped >= 1
    assert facts["diagnosis"]["recovered_scaler_skips"]["step"] == 1
    # a skipped step does not count: the cell ran one more for each, and the reason says both
    assert facts["training"]["updates_applied"] == 4 and facts["training"]["steps_run"] == 4 + skipped
    reason = facts["reason"]
    assert f"trained all 4 steps with finite loss ({4 + skipped} run: {skipped} skipped by the GradScaler" in reason
    assert [e["kind"] for e in read_jsonl(run_dir / "events.jsonl")] == ["scaler_skip"]


def test_injection_naming_no_module_is_a_clear_error(checkpoints, dataset_path, tmp_path):
    debug = {"inject_nonfinite": {"module": "no.such.module", "step": 0}}
    facts, _ = _run_with(checkpoints, dataset_path, tmp_path, model="qwen3moe-tiny", precision="fp32", debug=debug)
    assert facts["outcome"] == "error" and "no.such.module" in facts["reason"]


def test_bf16_run_measures_fp16_headroom_before_fp16_is_tried(checkpoints, dataset_path, tmp_path):
    facts, run_dir = _run_with(
        checkpoints,
        dataset_path,
        tmp_path,
        model="gemma3-hot",
        precision="bf16",
        batch=8,
        train={"steps": 12, "headroom_every": 3},
    )
    assert facts["outcome"] == "ok"
    lines = read_jsonl(run_dir / "headroom.jsonl")
    assert [line["step"] for line in lines] == [0, 3, 6, 9]
    worst = facts["fp16_headroom"]["worst_modules"][0]
    assert worst["ratio_to_fp16_max"] > 1.0  # this model would overflow fp16: the report can say so up front
    assert ".mlp." in worst["module"] or "lm_head" in worst["module"]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert "fp16_headroom_max_ratio" in records[0] and "fp16_headroom_max_ratio" not in records[1]


def test_recovered_skip_then_later_overflow_ends_nan_with_the_later_origin(checkpoints, dataset_path, tmp_path):
    # step 1: a backward overflow the GradScaler skips and recovers from; step 3: a forward overflow
    debug = {
        "inject_nonfinite": {
            "module": "model.layers.0.mlp",
            "step": 1,
            "phase": "backward",
            "also": [{"module": "model.layers.0.self_attn.o_proj", "step": 3, "phase": "forward"}],
        }
    }
    facts, run_dir = _run_with(
        checkpoints,
        dataset_path,
        tmp_path,
        model="qwen3moe-tiny",
        precision="fp16",
        debug=debug,
        train={"steps": 8, "on_nonfinite": "stop_after_skips"},
    )
    assert facts["outcome"] == "nan", facts["reason"]
    nan = facts["diagnosis"]["nan"]
    assert nan["step"] == 3 and nan["kind"] == "loss_nonfinite"
    assert nan["origin"]["forward"]["module"].endswith("layers.0.self_attn.o_proj")
    assert facts["diagnosis"]["recovered_scaler_skips"]["step"] == 1
    # 4 steps ran; the skipped step 1 does not count toward the 8
    assert facts["training"]["steps_run"] == 4
    assert "stopped after 3 of 8 steps (1 more skipped by the GradScaler)" in facts["reason"]
    events = read_jsonl(run_dir / "events.jsonl")
    assert [(e["step"], e["kind"]) for e in events] == [(1, "scaler_skip"), (3, "loss_nonfinite")]
    assert all(e.get("origin") for e in events)  # each event that degraded or ended the cell has its origin
    lr = {r["step"]: r["lr"] for r in read_jsonl(run_dir / "metrics.jsonl")}
    assert lr[0] != lr[1] == lr[2] != lr[3]  # the skipped step 1 changed no weight, so the schedule waits a step


def test_failing_step_headroom_is_measured_not_only_the_samples(checkpoints, dataset_path, tmp_path):
    facts, run_dir = _run_with(
        checkpoints,
        dataset_path,
        tmp_path,
        model="gemma3-hot",
        precision="fp16",
        batch=8,
        train={"steps": 12, "headroom_every": 50},  # only step 0 sampled
    )
    assert facts["outcome"] == "nan"
    headroom = facts["fp16_headroom"]
    failing = facts["diagnosis"]["nan"]["step"]
    assert headroom["failing_steps_measured"] == [failing]
    assert facts["diagnosis"]["nan"]["headroom"]["step"] == failing
    assert (
        float(headroom["worst_modules"][0]["ratio_to_fp16_max"]) >= 1.0
    )  # ("inf" in strict JSON) the overflow itself is in the worst figure
    assert any(line.get("failing_step") for line in read_jsonl(run_dir / "headroom.jsonl"))


def test_nan_origin_under_gradient_checkpointing(checkpoints, dataset_path, tmp_path):
    facts, _ = _run_with(
        checkpoints,
        dataset_path,
        tmp_path,
        model="gemma3-hot",
        precision="fp16",
        batch=8,
        train={"steps": 12, "gradient_checkpointing": True},
    )
    assert facts["outcome"] == "nan", facts["reason"]
    assert ".layers.0.mlp.down_proj" in facts["diagnosis"]["nan"]["origin"]["forward"]["module"]


def _replay_memory_budget(monkeypatch, forward_only_fits):
    """A memory budget that holds the training step under activation checkpointing but not the origin replay
    without it: while activation checkpointing is switched off, a forward with gradients raises torch's own
    OutOfMemoryError (and, with `forward_only_fits` False, a forward without them too)."""
    import torch

    import tunegrid.cell.load.model as model_module

    real_switch, handles = model_module.set_activation_checkpointing, []

    def over_budget(module, args, kwargs):
        if torch.is_grad_enabled() or not forward_only_fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected budget)")

    def switch(model, on):
        real_switch(model, on)
        if not on:
            handles.append(model.register_forward_pre_hook(over_budget, with_kwargs=True))
        elif handles:  # (on at load time too)
            handles.pop().remove()

    monkeypatch.setattr(model_module, "set_activation_checkpointing", switch)
    return handles


def test_nan_replay_out_of_memory_keeps_the_outcome_and_finds_the_forward_origin(
    checkpoints, dataset_path, tmp_path, monkeypatch
):
    handles = _replay_memory_budget(monkeypatch, forward_only_fits=True)
    facts, run_dir = _run_with(
        checkpoints,
        dataset_path,
        tmp_path,
        model="gemma3-hot",
        precision="fp16",
        batch=8,
        train={"steps": 12, "gradient_checkpointing": True},
    )
    assert handles == []  # activation checkpointing was switched back on after the replay
    assert facts["outcome"] == "nan", facts["reason"]  # never `oom` at stage step
    origin = facts["diagnosis"]["nan"]["origin"]
    assert ".layers.0.mlp.down_proj" in origin["forward"]["module"]  # as with a full replay
    assert origin["replay"] == "forward only" and origin["backward"] is None
    # a loss non-finite in its forward is replayed forward only from the start (no backward ran in the step), so
    # the full replay the budget would have refused is never tried
    assert "backward origin not traced" in origin["unlocated"]
    assert [e["kind"] for e in read_jsonl(run_dir / "events.jsonl")] == ["loss_nonfinite"]


def test_nan_replay_with_no_memory_left_is_nan_with_the_origin_unlocated_and_why(
    checkpoints, dataset_path, tmp_path, monkeypatch
):
    _replay_memory_budget(monkeypatch, forward_only_fits=False)
    facts, run_dir = _run_with(
        checkpoints,
        dataset_path,
        tmp_path,
        model="gemma3-hot",
        precision="fp16",
        batch=8,
        train={"steps": 12, "gradient_checkpointing": True},
    )
    assert facts["outcome"] == "nan", facts["reason"]
    origin = facts["diagnosis"]["nan"]["origin"]
    assert origin["forward"] is None and origin["backward"] is None and origin["replay"] == "out of memory"
    assert "forward-only replay ran out of memory" in origin["unlocated"]
    assert "out of memory" in facts["reason"] and "loss_nonfinite at step" in facts["reason"]


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_a_step_where_no_adapter_gets_a_gradient_ends_unsupported_not_error(
    checkpoints, dataset_path, tmp_path, monkeypatch, precision
):
    """The gradients of every adapter cut off after backward (what an op without an autograd kernel leaves):
    under fp16 GradScaler.step used to assert "No inf checks were recorded"; the cell must end unsupported."""
    from tunegrid.cell.loop.step import OptimizerStep

    real = OptimizerStep.forward_backward

    def no_adapter_gradient(self, *args, **kwargs):
        loss = real(self, *args, **kwargs)
        for param in self.trainable:
            param.grad = None
        return loss

    monkeypatch.setattr(OptimizerStep, "forward_backward", no_adapter_gradient)
    facts, run_dir = _run_with(checkpoints, dataset_path, tmp_path, model="gemma3-hot", precision=precision)
    assert facts["outcome"] == "unsupported", facts["reason"]
    assert all(".lora_" in name for name in facts["diagnosis"]["params_without_grad"])
    (line,) = read_jsonl(run_dir / "metrics.jsonl")
    assert line["step"] == 0 and line["grad_norm"] == 0.0


def _few_token_data(dataset_path, tmp_path):
    """One short example ("Add 8 and 48." -> "56") 64 times: a step of one row has few loss tokens, so at the
    GradScaler's default first scale the scaled gradients overflow fp16, and every step sees the same batch."""
    record = next(line for line in dataset_path.read_text().splitlines() if '"Add 8 and 48."' in line)
    data = tmp_path / "one-example.jsonl"
    data.write_text((record + "\n") * 64)
    return data


def _scaled_run(checkpoints, data, run_dir, precision, **train):
    base = {"steps": 4, "seq_len": 32, "lr": 0.01, "warmup_steps": 0, "headroom_every": 0, "loss_scale_init": 65536}
    spec = one_cell(model="qwen3moe-tiny", precision=precision, batch=1, train={**base, **train})
    return run_in_process(spec, checkpoints, data, run_dir), read_jsonl(run_dir / "metrics.jsonl")


def test_steps_the_grad_scaler_skipped_do_not_count_so_an_fp16_fix_trains_its_steps_and_learns(
    checkpoints, dataset_path, tmp_path
):
    """The scaler skips its first steps (scaled gradients overflow at 65536; no update, the scale halved, the
    schedule waits). They are not `steps`: the cell runs until it applied 4 updates and learns what its fp32 twin
    learned over 4. (It stopped after 4 steps run, 2 of them skipped, its last quarter before any real update.)"""
    data = _few_token_data(dataset_path, tmp_path)
    facts, lines = _scaled_run(checkpoints, data, tmp_path / "mixed", "fp16-mixed")
    reference, reference_lines = _scaled_run(checkpoints, data, tmp_path / "fp32", "fp32")
    assert facts["outcome"] == "ok", facts["reason"]
    skipped = lines[-1]["skipped_steps"]
    assert skipped >= 1 and lines[0]["skipped_steps"] == 1  # the scaler's warm-up: its first step skipped
    assert len(lines) == 4 + skipped  # one more step for each skipped
    training = facts["training"]
    assert training["scaler_skipped_steps"] == skipped
    assert training["updates_applied"] == 4 and training["steps_run"] == 4 + skipped
    assert training["loss_scale_end"] == 65536 / 2**skipped
    reason = facts["reason"]
    assert f"trained all 4 steps with finite loss ({4 + skipped} run: {skipped} skipped by the GradScaler" in reason
    assert lines[-1]["lr"] == reference_lines[-1]["lr"]  # the schedule advanced 4 times, as fp32's did
    from tunegrid.review.quality import default_review, loss_deviation, loss_fall, trained_curve

    curve, left_out = trained_curve(lines)
    fp32_curve, _ = trained_curve(reference_lines)
    assert left_out == skipped and len(curve) == len(fp32_curve) == 4
    review = default_review()
    assert loss_fall(curve) >= review["min_loss_fall"], curve
    assert loss_deviation(curve, fp32_curve) <= review["loss_tolerance"], (curve, fp32_curve)


def test_the_skips_made_up_for_are_bounded_by_max_skipped_steps(checkpoints, dataset_path, tmp_path):
    """Past train.max_skipped_steps the cell ends with fewer updates than `steps`, and its reason says so; at 0
    every step counts, skipped or not."""
    data = _few_token_data(dataset_path, tmp_path)
    facts, lines = _scaled_run(checkpoints, data, tmp_path / "one", "fp16-mixed", max_skipped_steps=1)
    training = facts["training"]
    assert facts["outcome"] == "ok" and training["scaler_skipped_steps"] >= 2, facts["reason"]
    assert len(lines) == 5 and training["updates_applied"] == 5 - training["scaler_skipped_steps"]
    assert "train.max_skipped_steps 1 used up" in facts["reason"]
    facts, lines = _scaled_run(checkpoints, data, tmp_path / "none", "fp16-mixed", max_skipped_steps=0)
    assert len(lines) == 4 and facts["training"]["updates_applied"] < 4


def test_the_step_after_a_skip_trains_on_the_skipped_steps_batch(checkpoints, dataset_path, tmp_path):
    """On the study's varied data: a skipped step's batch is drawn again by the next step, so the k-th update
    trains on the batch the fp32 twin's k-th did, and the curves compare update by update."""
    train = {"lr": 0.02, "warmup_steps": 2, "steps": 8}
    facts, lines = _scaled_run(checkpoints, dataset_path, tmp_path / "fp16", "fp16", **train)
    _, reference_lines = _scaled_run(checkpoints, dataset_path, tmp_path / "fp32", "fp32", **train)
    assert facts["outcome"] == "ok", facts["reason"]
    counts = [0] + [line["skipped_steps"] for line in lines]
    skipped = [i for i in range(len(lines)) if counts[i + 1] > counts[i]]
    assert skipped and skipped[-1] < len(lines) - 1, counts  # a skip, and a step after it
    for i in skipped:  # the same batch and the same weights: the same loss
        assert lines[i + 1]["loss"] == lines[i]["loss"], (i, lines[i]["loss"], lines[i + 1]["loss"])
    from tunegrid.review.quality import default_review, loss_deviation, trained_curve

    curve, _ = trained_curve(lines)
    fp32_curve, _ = trained_curve(reference_lines)
    assert loss_deviation(curve, fp32_curve) <= default_review()["loss_tolerance"], (curve, fp32_curve)
