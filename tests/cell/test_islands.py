"""fp16 with fp32 islands: the islands are the modules the fp32 calibration measured over the threshold, they
remove fp16's overflow, and the cell then trains what the fp32 reference trains (Gemma 3 and a held-out family),
with activation checkpointing, a 4-bit base and two gloo ranks too."""

from __future__ import annotations

import copy

import pytest
from conftest import GEMMA_HOT, make_study, one_cell, one_cell_spec, ready_trainer, run_in_process, run_supervised

from tunegrid.review.quality import default_review, loss_deviation, loss_fall, trained_curve
from tunegrid.runtime.files import read_jsonl

DEFAULT_REVIEW = default_review()

LORA = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _hot(architecture: str, init_scale: dict[str, float]) -> dict:
    """A model whose MLP (or whatever init_scale widens) overflows fp16 while its embeddings let LoRA learn."""
    spec = copy.deepcopy(GEMMA_HOT)
    spec["architecture"] = architecture
    spec["config"]["initializer_range"] = 0.3
    if architecture != "gemma3_text":
        spec["config"].pop("head_dim")
    spec["init_scale"] = init_scale
    return spec


MODELS = {
    "gemma3-overflow": _hot("gemma3_text", {"*.mlp.*": 10}),
    "gemma3-overflow-layer1": _hot("gemma3_text", {"*.layers.1.mlp.*": 10}),
    "llama-overflow": _hot("llama", {"*.mlp.*": 10}),
}


@pytest.fixture(scope="module")
def hot_checkpoints(tmp_path_factory, dataset_path):
    from tunegrid.dataset import read_dataset
    from tunegrid.prepare.checkpoints import produce_checkpoint
    from tunegrid.prepare.data import corpus_texts

    texts = list(corpus_texts(read_dataset(dataset_path)))
    root = tmp_path_factory.mktemp("hot-models")
    for name, spec in MODELS.items():
        produce_checkpoint(copy.deepcopy(spec), texts, root / name)
    return {name: root / name for name in MODELS}


def _spec(model: str, precision: str, *, quant: str = "none", train: dict | None = None, world: int = 1) -> dict:
    study = make_study()
    return one_cell(
        model=model,
        precision=precision,
        quant=quant,
        world=world,
        train={"steps": 12, "seq_len": 64, "headroom_every": 0, **(train or {})},
        models={**study["models"], **copy.deepcopy(MODELS)},
        lora=LORA,
    )


def _run(spec, checkpoints, dataset_path, tmp_path):
    run_dir = tmp_path / spec["cell_id"]
    facts = run_in_process(spec, checkpoints, dataset_path, run_dir)
    return facts, trained_curve(read_jsonl(run_dir / "metrics.jsonl"))[0]  # the curve quality judges


def _fp32_maxima(checkpoints, dataset_path, tmp_path, model: str) -> dict[str, float]:
    """An independent reference: the model loaded in fp32, plain forward hooks, max |output| at real tokens of
    the same calibration batches (no tunegrid instrument involved)."""
    import torch

    trainer = ready_trainer(_spec(model, "fp32"), checkpoints, dataset_path, tmp_path)
    names = {id(m): n.removeprefix("base_model.model.") for n, m in trainer.model.named_modules()}
    maxima: dict[str, float] = {}
    real = None

    def hook(module, _inputs, output):
        out = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
        if out is None and isinstance(output, tuple) and isinstance(output[0], torch.Tensor):
            out = output[0]
        if out is None or not out.is_floating_point() or tuple(out.shape[:2]) != tuple(real.shape):
            return
        value = float(out.detach().abs()[real].max())
        name = names[id(module)]
        maxima[name] = max(maxima.get(name, 0.0), value)

    handles = [m.register_forward_hook(hook) for m in trainer.model.modules()]
    with torch.no_grad():
        for step in range(2):  # train.island_calibration_batches' default
            for micro, mask in zip(trainer.stream.micro_batches(step), trainer.stream.real_positions(step)):
                real = mask
                trainer.model(**micro)
    for handle in handles:
        handle.remove()
    return maxima


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("gemma3-overflow", {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}),
        ("gemma3-overflow-layer1", {"model.layers.1.mlp.down_proj"}),  # the overflow moved: so do the islands
    ],
)
def test_islands_are_the_modules_whose_fp32_maxima_exceed_the_threshold(
    model, expected, hot_checkpoints, dataset_path, tmp_path
):
    trainer = ready_trainer(_spec(model, "fp16-islands"), hot_checkpoints, dataset_path, tmp_path)
    trainer.place_fp32_islands()
    record = trainer.facts["fp32_islands"]
    chosen = {m["module"] for m in record["modules"]}
    assert chosen == expected
    reference = _fp32_maxima(hot_checkpoints, dataset_path, tmp_path / "ref", model)
    threshold = record["threshold_abs"]
    # every module the independent fp32 forward saw over the threshold is an island or holds one (its mlp, ...)
    over = {name for name, value in reference.items() if value > threshold and name.count(".") >= 3}
    assert over and all(any(name == c or c.startswith(name + ".") for c in chosen) for name in over)
    for island in record["modules"]:
        assert island["max_abs"] == pytest.approx(reference[island["module"]], rel=2e-2)  # fp16-stored weights
        assert island["ratio_to_fp16_max"] > DEFAULT_REVIEW["loss_tolerance"]  # sanity: a ratio, not bytes
    others = [m for m in record["measured_top"] if m["module"] not in chosen and "lora" not in m["module"]]
    assert all(m["max_abs"] <= threshold or any(m["module"] in c or c in m["module"] for c in chosen) for m in others)
    assert all(trainer.model.get_submodule("base_model.model." + c)._tunegrid_fp32_island for c in chosen)


@pytest.mark.parametrize("model", ["gemma3-overflow", "llama-overflow"])
def test_islands_remove_the_overflow_and_train_what_fp32_trains(model, hot_checkpoints, dataset_path, tmp_path):
    fp16, _ = _run(_spec(model, "fp16"), hot_checkpoints, dataset_path, tmp_path)
    assert fp16["outcome"] == "nan" and "mlp.down_proj" in fp16["reason"], fp16["reason"]
    islands, curve = _run(_spec(model, "fp16-islands"), hot_checkpoints, dataset_path, tmp_path)
    assert islands["outcome"] == "ok", islands["reason"]
    assert {m["module"].rsplit(".", 1)[-1] for m in islands["fp32_islands"]["modules"]} == {"down_proj"}
    assert "float16" in islands["precision_in_effect"]["forward"]  # the rest still runs in fp16
    reference, reference_curve = _run(_spec(model, "fp32"), hot_checkpoints, dataset_path, tmp_path)
    assert reference["outcome"] == "ok"
    assert loss_fall(reference_curve) >= DEFAULT_REVIEW["min_loss_fall"]  # a reference that learned
    assert loss_deviation(curve, reference_curve) <= DEFAULT_REVIEW["loss_tolerance"]


def test_islands_hold_under_gradient_checkpointing_on_a_4bit_base(hot_checkpoints, dataset_path, tmp_path):
    train = {"gradient_checkpointing": True}
    fp16, _ = _run(_spec("gemma3-overflow", "fp16", quant="nf4", train=train), hot_checkpoints, dataset_path, tmp_path)
    assert fp16["outcome"] == "nan"
    facts, curve = _run(
        _spec("gemma3-overflow", "fp16-islands", quant="nf4", train=train), hot_checkpoints, dataset_path, tmp_path
    )
    assert facts["outcome"] == "ok", facts["reason"]
    assert len(facts["fp32_islands"]["modules"]) == 2
    _, reference_curve = _run(_spec("gemma3-overflow", "fp32"), hot_checkpoints, dataset_path, tmp_path)
    assert loss_deviation(curve, reference_curve) <= DEFAULT_REVIEW["loss_tolerance"]


def test_named_islands_train_exactly_as_the_measured_ones(hot_checkpoints, dataset_path, tmp_path):
    """The calibration leaves no trace: same islands by name or by measurement, the same curve step for step."""
    auto, auto_curve = _run(_spec("gemma3-overflow", "fp16-islands"), hot_checkpoints, dataset_path, tmp_path / "a")
    named, named_curve = _run(
        _spec("gemma3-overflow", "fp16-islands", train={"fp32_islands": ["*.mlp.down_proj"]}),
        hot_checkpoints,
        dataset_path,
        tmp_path / "n",
    )
    assert named["fp32_islands"]["mode"] == "patterns" and auto["fp32_islands"]["mode"] == "auto"
    assert [m["module"] for m in named["fp32_islands"]["modules"]] == [
        m["module"] for m in auto["fp32_islands"]["modules"]
    ]
    assert named_curve == auto_curve


def test_a_pattern_that_matches_nothing_is_an_error_naming_the_key(hot_checkpoints, dataset_path, tmp_path):
    facts, _ = _run(
        _spec("gemma3-overflow", "fp16-islands", train={"fp32_islands": ["mlp.down_proj"]}),
        hot_checkpoints,
        dataset_path,
        tmp_path,
    )
    assert facts["outcome"] == "error"
    assert "train.fp32_islands" in facts["reason"] and "*.mlp.down_proj" in facts["reason"]


@pytest.mark.slow  # a supervised cell of two ranks
def test_two_gloo_ranks_agree_on_the_islands(hot_checkpoints, dataset_path, tmp_path):
    spec = _spec("gemma3-overflow", "fp16-islands", world=2, train={"steps": 3, "threads": 1})
    run_dir = tmp_path / "runs" / spec["cell_id"]
    result = run_supervised(spec, hot_checkpoints, dataset_path, run_dir)
    assert result["outcome"] == "ok", result["reason"]
    assert result["distributed"]["lora_identical"] is True
    assert [m["module"] for m in result["fp32_islands"]["modules"]] == [
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.down_proj",
    ]


def test_a_matmul_fed_past_fp16s_range_by_an_island_computes_in_fp32_too() -> None:
    """`up` returns 8e4 (past 65504) and becomes an island; `down` returns 64, in range, but is fed 8e4: under
    autocast its input would be cast to fp16 (inf) before it runs. Only with `down` an island too is the
    output finite."""
    import torch

    from tunegrid.cell.nonfinite.islands import IslandCalibration, islands_over, place_fp32_islands

    class Chain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(8, 8, bias=False)
            self.down = torch.nn.Linear(8, 8, bias=False)
            with torch.no_grad():
                self.up.weight.fill_(1e4)
                self.down.weight.fill_(1e-4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(self.up(x))

    class Stream:
        def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
            return [{"x": torch.ones(1, 4, 8)}]

        def real_positions(self, step: int) -> list[torch.Tensor]:
            return [torch.ones(1, 4, dtype=torch.bool)]

    calibration = IslandCalibration(batches=1, maxima={"up": 8e4, "down": 64.0}, input_maxima={"down": 8e4})
    assert islands_over(calibration, 0.5 * 65504) == ["down", "up"]
    assert islands_over(IslandCalibration(batches=1, maxima={"up": 8e4, "down": 64.0}), 0.5 * 65504) == ["up"]

    model = Chain()
    calibrated = {"fp32_islands": "auto", "island_threshold": 0.5, "island_calibration_batches": 1}
    train = one_cell_spec(train=calibrated).train
    record = place_fp32_islands(model, Stream(), torch.device("cpu"), False, train)
    assert [island["module"] for island in record["modules"]] == ["down", "up"]
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(torch.ones(1, 4, 8))
    assert torch.isfinite(out).all() and float(out.max()) == pytest.approx(64.0, rel=1e-3)
