"""The NaN tracer and the fp16 headroom meter read real tokens only: a value injected at a padding position
is left out of the headroom and traced as `at: padding`, one at a real position as `at: real`, with packing
on (position ids) and off (one example per row, mostly padding), and for one flattened row."""

from __future__ import annotations

import math

import pytest
from conftest import make_study, one_cell, run_in_process

from tunegrid.outcome import origin_label
from tunegrid.runtime.files import read_jsonl
from tunegrid.study.config import ConfigError, resolve_study

MODEL = "qwen3moe-tiny"  # routed experts: their (batch*seq, ...) and token-subset outputs are read too
LAST_MLP = "model.layers.1.mlp"  # nothing attends after it, so a padding value reaches no real position in forward


def _positions(spec: dict, checkpoints: dict, dataset_path) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """A step of the cell's own stream with padding in its first micro-batch: (step, a padding (row, token),
    a real (row, token)), from the cell's real-token masks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunegrid.cell.data.packing import build_stream
    from tunegrid.cell_spec import CellSpec
    from tunegrid.dataset import read_dataset

    model_dir = checkpoints[MODEL]
    stream, facts = build_stream(
        read_dataset(dataset_path),
        AutoTokenizer.from_pretrained(model_dir),
        AutoModelForCausalLM.from_pretrained(model_dir),
        CellSpec.from_json(spec).data,
        spec["train"]["seq_len"],
        spec["axes"]["batch_size"],
        spec["axes"]["seed"],
    )
    assert facts["packing"] == ("position_ids" if spec["data"]["packing"] else "off")
    for step in range(spec["train"]["steps"]):
        real = stream.real_positions(step)[0]
        assert real.shape == stream.micro_batches(step)[0]["input_ids"].shape
        padding = (~real).nonzero().tolist()
        if padding:
            return step, tuple(padding[-1]), tuple(real.nonzero().tolist()[-1])
    raise AssertionError("no step with padding: the test would say nothing")


def _cell(packing: bool, step: int, position: tuple[int, int]) -> dict:
    injection = {"module": LAST_MLP, "step": step, "position": {"row": position[0], "token": position[1]}}
    return one_cell(
        model=MODEL,
        train={"steps": step + 1, "headroom_every": 1},
        data={"examples": 64, "packing": packing},
        debug={"inject_nonfinite": injection},
    )


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "one-example-per-row"])
def test_a_value_at_padding_is_traced_as_padding_and_left_out_of_the_headroom(
    packing, checkpoints, dataset_path, tmp_path
):
    step, padding, real = _positions(_cell(packing, 0, (0, 0)), checkpoints, dataset_path)

    at_padding = run_in_process(_cell(packing, step, padding), checkpoints, dataset_path, tmp_path / "padding")
    # no loss term at padding, yet 0 * nan in backward poisons the gradients: still a nan cell, with its origin
    assert at_padding["outcome"] == "nan", at_padding["reason"]
    origin = at_padding["diagnosis"]["nan"]["origin"]
    assert origin["forward"]["module"].endswith(LAST_MLP) and origin["forward"]["at"] == "padding"
    # in backward the padding rows' nan grads reach real positions through attention (0 * nan): traced as
    # real, naming the padding value that came first
    backward = origin["backward"]
    assert backward["at"] == "padding" or backward["preceded_by"]["at"] == "padding", backward
    assert "at padding positions only" in at_padding["reason"]
    assert origin_label(origin["forward"]).endswith(f"{LAST_MLP} (padding)")  # summary.csv's and the tags' label
    headroom = read_jsonl(tmp_path / "padding" / "headroom.jsonl")
    assert headroom and all(line["positions"] == "real" for line in headroom)
    assert all(math.isfinite(m["max_abs"]) for line in headroom for m in line["modules"]), "padding was measured"
    assert at_padding["fp16_headroom"]["positions"] == "real"

    at_real = run_in_process(_cell(packing, step, real), checkpoints, dataset_path, tmp_path / "real")
    assert at_real["outcome"] == "nan", at_real["reason"]
    origin = at_real["diagnosis"]["nan"]["origin"]
    assert origin["forward"]["module"].endswith(LAST_MLP) and origin["forward"]["at"] == "real"
    assert "padding" not in at_real["reason"]
    assert origin["backward"]["at"] == "real" and "preceded_by" not in origin["backward"]
    assert origin_label(origin["forward"]).endswith(LAST_MLP)


def test_instruments_read_a_flattened_row_and_flattened_tokens_by_position():
    """A flattening stream's micro-batch is one row of batch_size x seq_len tokens; some modules flatten
    (batch, seq) into one dim. Poisoned directly: a padding value is padding in both layouts."""
    import torch

    from tunegrid.cell.data.batches import BatchStream
    from tunegrid.cell.loop.instrument import HeadroomMeter, OriginTracer

    seq_len, hidden = 4, 3
    tensors = {"input_ids": torch.zeros(2, seq_len, dtype=torch.long), "labels": torch.zeros(2, seq_len)}
    stream = BatchStream(tensors, batch_size=2, seed=0, row_tokens=torch.tensor([3, 2]), flat=True)
    (real,) = stream.real_positions(0)
    rows = stream.indices(0).tolist()
    assert real.shape == (1, 2 * seq_len)
    assert real.reshape(2, seq_len).sum(dim=1).tolist() == [[3, 2][r] for r in rows]

    class Flattens(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(hidden, hidden)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.inner(x.reshape(-1, hidden)).reshape(x.shape)  # inner sees (batch*seq, hidden)

    model = torch.nn.Sequential(Flattens())
    pad = int((~real[0]).nonzero()[0])
    for where, position in (("padding", pad), ("real", int(real[0].nonzero()[0]))):
        tracer, meter = OriginTracer(model, real), HeadroomMeter()
        meter.real = real
        x = torch.ones(1, 2 * seq_len, hidden)
        x[0, position] = 1e12  # finite in fp32, far over fp16's largest
        with meter.attached(model):
            model(x)
        x[0, position] = math.inf
        with tracer.attached():
            model(x)
        assert tracer.forward_origin["module"] == "0.inner" and tracer.forward_origin["at"] == where
        worst = meter.collect(0)["max_ratio"]
        assert worst < 1 if where == "padding" else worst > 1e6


def test_an_injection_position_outside_the_micro_batch_is_refused():
    study = make_study(debug={"inject_nonfinite": {"module": "q_proj", "position": {"row": 2, "token": 0}}})
    with pytest.raises(ConfigError, match=r"debug\.inject_nonfinite\.position\.row.*batch_size"):
        resolve_study(study)
    study = make_study(debug={"inject_nonfinite": {"module": "q_proj", "position": {"row": 0, "token": 32}}})
    with pytest.raises(ConfigError, match=r"debug\.inject_nonfinite\.position\.token.*seq_len"):
        resolve_study(study)


def test_a_tensor_without_token_positions_is_read_whole_and_marked_unlocated():
    """A routed expert's tokens (a subset, padding tokens among them) have no positions to mask: their
    non-finite values are the origin only when no real position went non-finite, marked unlocated."""
    import torch

    from tunegrid.cell.loop.instrument import OriginTracer

    class Routed(torch.nn.Module):
        def forward(self, x):  # type: ignore[no-untyped-def]
            return x.reshape(-1, x.shape[-1])[::3]  # every third token, as a router might pick them

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.expert = Routed()

        def forward(self, x):  # type: ignore[no-untyped-def]
            self.expert(x)
            return x * 1.0

    real = torch.tensor([[True, True, True, False, False, False]])
    x = torch.ones(1, 6, 2)
    x[0, 3] = math.inf  # padding, and one of the routed tokens
    for mask, at in ((real, "unlocated"), (None, "real")):
        tracer = OriginTracer(torch.nn.Sequential(Block()), mask)
        with tracer.attached():
            tracer.model(x)
        assert tracer.forward_origin["module"] == "0.expert" and tracer.forward_origin["at"] == at
    x[0, 1] = math.inf  # now a real position too: the block's output is the origin, after the unlocated value
    tracer = OriginTracer(torch.nn.Sequential(Block()), real)
    with tracer.attached():
        tracer.model(x)
    origin = tracer.forward_origin
    assert origin["module"] == "0" and origin["at"] == "real"
    assert origin["preceded_by"] == {"module": "0.expert", "at": "unlocated"}
