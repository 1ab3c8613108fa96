"""The optimizer axis: bitsandbytes' 8-bit AdamW trains (its loss follows torch AdamW's), its state is what the
estimate says byte for byte, and on a CPU the paged variant is the same optimizer (nothing to page to)."""

from __future__ import annotations

import pytest
from conftest import one_cell, run_in_process

from tunegrid.prepare.memory_estimate import optimizer_state_bytes

LORA = {"r": 64, "alpha": 128, "target_modules": ["q_proj", "v_proj"]}  # lora_A of q_proj: 64 x 64 = 4096


def _train(optimizer, checkpoints, dataset_path, tmp_path):
    spec = one_cell(
        model="qwen3moe-tiny",
        world=1,
        train={"steps": 6, "threads": 1, "lr": 1e-3},
        axes={"optimizer": optimizer},
        lora=LORA,
    )
    run_dir = tmp_path / spec["cell_id"]
    return spec, run_in_process(spec, checkpoints, dataset_path, run_dir)


@pytest.fixture(scope="module")
def trained(checkpoints, dataset_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("optimizers")
    return {name: _train(name, checkpoints, dataset_path, tmp) for name in ("adamw", "adamw-8bit", "paged-adamw-8bit")}


def test_eight_bit_state_is_what_the_estimate_says(trained):
    for name, (_spec, facts) in trained.items():
        assert facts["outcome"] == "ok", facts["reason"]
        optimizer = facts["optimizer"]
        assert optimizer["name"] == name
        # per layer (hidden 64; q_proj 64 -> 64, v_proj 64 -> 32): lora_A 64x64 and lora_B 64x64 of q_proj,
        # lora_A 64x64 and lora_B 32x64 of v_proj (under 4096 elements: fp32 moments in bitsandbytes too)
        numels = [4096, 4096, 4096, 2048] * 2
        assert facts["params"]["trainable"] == sum(numels)
        assert optimizer["state_bytes"] == optimizer_state_bytes(numels, name)
    plain, eight = trained["adamw"][1]["optimizer"], trained["adamw-8bit"][1]["optimizer"]
    assert eight["class"] == "bitsandbytes.optim.adamw.AdamW8bit" and eight["tensors_8bit"] > 0
    assert plain["tensors_8bit"] == 0 and plain["tensors_fp32"] == eight["tensors_8bit"] + eight["tensors_fp32"]
    assert eight["state_bytes"] < plain["state_bytes"] / 2


def test_eight_bit_adamw_follows_adamw(trained):
    plain, eight = (trained[n][1]["training"] for n in ("adamw", "adamw-8bit"))
    assert eight["final_loss"] < eight["initial_loss"]  # it learns
    assert abs(eight["final_loss"] - plain["final_loss"]) < 0.02 * plain["final_loss"]


def test_paged_on_cpu_is_the_unpaged_optimizer(trained):
    """bitsandbytes on a CPU allocates the paged optimizer's state as ordinary tensors: same numbers."""
    paged, eight = trained["paged-adamw-8bit"][1], trained["adamw-8bit"][1]
    assert paged["optimizer"]["paging"].startswith("cpu: not paged") and paged["optimizer"]["paged_bytes"] == 0
    assert paged["optimizer"]["state_bytes"] == eight["optimizer"]["state_bytes"]
    assert paged["training"]["final_loss"] == eight["training"]["final_loss"]
