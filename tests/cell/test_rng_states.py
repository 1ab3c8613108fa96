"""The random generators a replay and a resume put back, CUDA's included, checked on CPU through a patched
torch.cuda: one visible device whose generator is a stand-in that records what is read from and written to it."""

from __future__ import annotations

import pytest
import torch
from conftest import one_cell, ready_trainer

from tunegrid.cell.loop.resume import rng_states, set_rng_states
from tunegrid.cell.nonfinite.origin import FailingStepReplay


class StandInGenerator:
    """torch.cuda.default_generators[0] as torch.cuda.random reads and writes it (get_state/set_state)."""

    def __init__(self) -> None:
        self.state = torch.tensor([1], dtype=torch.uint8)
        self.restored: list[torch.Tensor] = []

    def get_state(self) -> torch.Tensor:
        return self.state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self.state = state.clone()
        self.restored.append(state.clone())

    def draw(self) -> None:  # what a dropout kernel does to it
        self.state = self.state + 1


@pytest.fixture
def one_cuda_device(monkeypatch):
    """Makes torch.cuda look like a machine with one initialised GPU, without one; returns its generator.
    A callable, so that a trainer can be set up first and keep its CPU device."""

    def install() -> StandInGenerator:
        generator = StandInGenerator()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "default_generators", (generator,))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda.random, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda.random, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda.random, "_lazy_init", lambda: None)
        return generator

    return install


def test_resume_with_fewer_visible_gpus_restores_only_the_device_in_use(one_cuda_device):
    """A resume state of an attempt that saw two GPUs (one state per device) resumed where one is visible."""
    generator = one_cuda_device()
    states = rng_states()
    states["cuda"] = [torch.tensor([5], dtype=torch.uint8), torch.tensor([9], dtype=torch.uint8)]
    set_rng_states(states)  # torch.cuda.set_rng_state_all addressed device 1: IndexError
    assert [int(s) for s in generator.restored] == [5]


def test_a_resume_state_saves_and_restores_the_cuda_generator(one_cuda_device):
    generator = one_cuda_device()
    saved = rng_states()
    generator.draw()
    set_rng_states(saved)
    assert int(generator.state) == 1


def test_the_origin_replay_starts_each_micro_batch_from_its_cuda_generator_state(
    checkpoints, dataset_path, tmp_path, one_cuda_device
):
    """Dropout on CUDA draws from the CUDA generator: a replay that put back only the CPU one would trace
    other masks than the step that failed."""
    spec = one_cell(model="gemma3-hot", precision="fp32", batch=2, lora={"r": 4, "alpha": 8, "dropout": 0.1})
    trainer = ready_trainer(spec, checkpoints, dataset_path, tmp_path)
    optimizer_step = trainer.build_optimizer()
    batch = trainer.stream.micro_batches(0)
    generator = one_cuda_device()
    result = optimizer_step.run(0, batch)
    recorded = int(generator.state)
    generator.draw()  # the steps after it moved the generator on
    FailingStepReplay(optimizer_step).replay_micro_batch(0, 0, batch[0], result, None)
    assert [int(s) for s in generator.restored] == [recorded]
