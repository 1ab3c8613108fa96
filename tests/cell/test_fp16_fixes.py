"""The fp16 fixes that keep fp32 where real Gemma 3 overflows: fp32 master weights under fp16 autocast
(fp16-mixed), and fp16 weights with the residual stream in fp32 (fp16-residual)."""

from __future__ import annotations

import pytest

from tunegrid.cell.loop.precision import precision_setup
from tunegrid.review.precision_advice import residual_stream_notes


def test_each_fix_stores_and_computes_what_its_row_says() -> None:
    mixed, residual, plain = (precision_setup(p, "cpu") for p in ("fp16-mixed", "fp16-residual", "fp16"))
    assert (mixed.storage_dtype, mixed.compute_dtype, mixed.residual_fp32) == ("float32", "float16", False)
    assert (residual.storage_dtype, residual.compute_dtype, residual.residual_fp32) == ("float16", "float16", True)
    assert (plain.storage_dtype, plain.residual_fp32) == ("float16", False)
    assert all(p.grad_scaler and p.autocast for p in (mixed, residual, plain))


@pytest.mark.parametrize(("precision", "stream"), [("fp16", "float16"), ("fp16-residual", "float32")])
def test_fp16_residual_carries_the_stream_in_fp32_while_its_matmuls_stay_fp16(checkpoints, precision, stream) -> None:
    import torch
    from conftest import one_cell_spec

    from tunegrid.cell.load.model import load_model
    from tunegrid.contract import CellKernels

    spec = one_cell_spec(precision=precision)
    setup = precision_setup(precision, "cpu")
    model = load_model(checkpoints["gemma3-hot"], spec, setup, CellKernels(), torch.device("cpu"))
    seen: dict[str, torch.dtype] = {}

    def keep(name):
        def hook(_module, _inputs, output):
            seen[name] = (output[0] if isinstance(output, tuple) else output).dtype

        return hook

    layer = model.model.layers[0]
    layer.register_forward_hook(keep("layer"))
    layer.self_attn.q_proj.register_forward_hook(keep("q_proj"))
    ids = torch.randint(0, 512, (1, 8))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        model(input_ids=ids)
    assert seen["layer"] == getattr(torch, stream)
    assert seen["q_proj"] == torch.float16  # the matmuls still run in fp16
    assert {p.dtype for p in model.parameters()} == {torch.float16}  # and the weights stay fp16


def test_the_recommender_says_why_where_a_whole_layer_overflowed() -> None:
    layer_row = {"nan_forward_module": "base_model.model.model.layers.7"}
    (note,) = residual_stream_notes([layer_row, {"nan_forward_module": "base_model.model.model.layers.9"}])
    assert "the residual stream after layer 7" in note and "fp16-residual" in note
    assert residual_stream_notes([{"nan_forward_module": "model.layers.0.mlp.down_proj"}]) == []


def test_the_estimate_holds_autocasts_copies_of_weights_stored_wider_than_it_computes(checkpoints) -> None:
    """fp16-mixed keeps fp32 weights; each matmul's fp16 copy (the head's too) is saved for the backward."""
    import json

    from conftest import one_cell_spec

    from tunegrid.prepare.checkpoint_headers import tensor_shapes
    from tunegrid.prepare.memory_estimate import estimate_from_shapes

    folder = checkpoints["gemma3-hot"]
    config, shapes = json.loads((folder / "config.json").read_text()), tensor_shapes(folder)
    mixed, fp32 = (
        estimate_from_shapes(one_cell_spec(precision=p), config, shapes, 0).components.activations
        for p in ("fp16-mixed", "fp32")
    )
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    matmuls = sum(
        shape[0] * shape[1]
        for name, shape in shapes.items()
        if len(shape) == 2 and name.endswith(".weight") and shape[0] != vocab
    )
    assert mixed - fp32 == (matmuls + vocab * hidden) * 2


def test_a_norms_input_is_named_as_the_residual_stream_it_reads() -> None:
    from tunegrid.sites import INPUT, site_words

    assert site_words("model.layers.14.pre_feedforward_layernorm", INPUT).startswith("the residual stream (")
    assert site_words("model.layers.3", "output") == "the residual stream after layer 3"
    assert site_words("model.layers.3.mlp.down_proj", INPUT) == "the input of model.layers.3.mlp.down_proj"
