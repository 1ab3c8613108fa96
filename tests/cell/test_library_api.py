"""A cell whose libraries (its stack) lack an API it calls ends `unsupported`, naming the package, its version
and the API, before it loads anything; never `error`."""

from __future__ import annotations

import importlib.metadata

import pytest
from conftest import cell_contract, one_cell, one_cell_spec

from tunegrid.cell.load import library_api
from tunegrid.cell.load.library_api import Api, missing_api, missing_api_of
from tunegrid.cell.train import CellTrainer
from tunegrid.contract import CellContract
from tunegrid.vocabulary import Outcome

TRANSFORMERS = importlib.metadata.version("transformers")


def test_nf4_experts_on_a_transformers_without_v5_loading_ends_unsupported(
    checkpoints, dataset_path, tmp_path, monkeypatch
):
    """What transformers 4.x is to nf4-experts: no transformers.core_model_loading (blocked here)."""
    real_import = library_api._import

    def as_on_4x(module):
        if module == "transformers.core_model_loading":
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)
        return real_import(module)

    monkeypatch.setattr(library_api, "_import", as_on_4x)
    spec = one_cell(model="qwen3moe-tiny", quant="nf4-experts")
    facts = CellTrainer(CellContract.read(cell_contract(spec, checkpoints, dataset_path, tmp_path)), tmp_path).run()
    assert facts["outcome"] == Outcome.UNSUPPORTED
    assert facts["reason"].startswith(
        f"transformers {TRANSFORMERS} lacks transformers.core_model_loading.ConversionOps"
    )
    assert "nf4-experts" in facts["reason"] and facts["stage"] == "setup"  # refused before any load
    # plain nf4 does not need it: the same libraries run it
    assert missing_api(one_cell_spec(model="qwen3moe-tiny", quant="nf4")) is None


def test_any_missing_api_of_the_table_names_package_version_and_api(checkpoints, dataset_path, tmp_path, monkeypatch):
    needed = Api("peft", "NoSuchAdapterApi", "this test's adapters")
    monkeypatch.setattr(library_api, "APIS", (*library_api.APIS, needed))
    contract = CellContract.read(cell_contract(one_cell(), checkpoints, dataset_path, tmp_path))
    facts = CellTrainer(contract, tmp_path).run()
    assert facts["outcome"] == Outcome.UNSUPPORTED
    peft = importlib.metadata.version("peft")
    assert (
        facts["reason"] == f"peft {peft} lacks peft.NoSuchAdapterApi, which this test's adapters needs (during setup)"
    )


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (
            ImportError("cannot import name 'Foo' from 'transformers.integrations' (x.py)"),
            "transformers.integrations.Foo",
        ),
        (AttributeError("module 'peft.tuners' has no attribute 'Bar'"), "peft.tuners.Bar"),
        (
            ModuleNotFoundError(
                "No module named 'transformers.core_model_loading'", name="transformers.core_model_loading"
            ),
            "transformers.core_model_loading",
        ),
        (ImportError("cannot import name 'x' from 'tunegrid.cell.load.model'"), None),  # tunegrid's own: a bug, error
        (AttributeError("'NoneType' object has no attribute 'to'"), None),
    ],
)
def test_a_library_api_missing_at_run_time_is_read_as_the_stack_s(exc, expected):
    found = missing_api_of(exc)
    if expected is None:
        assert found is None
    else:
        assert found is not None and f"lacks {expected}" in found
