"""Recipe keys of loss kernels that never hold the full logits are carried as train.loss: chunked: axolotl's
CutCrossEntropyPlugin (cut_cross_entropy on by default once listed), its LigerPlugin's
liger_fused_linear_cross_entropy, and transformers' / TRL's use_liger_kernel (unless liger_kernel_config turns
the fused linear cross entropy off); Liger's other kernels stay run differently."""

from __future__ import annotations

import pytest
import yaml
from conftest import AXOLOTL_QLORA_RECIPE, TRL_PEFT_RECIPE

from tunegrid.recipes.importer import import_recipe

AXOLOTL, TRL = AXOLOTL_QLORA_RECIPE, TRL_PEFT_RECIPE
CCE = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"
LIGER = "axolotl.integrations.liger.LigerPlugin"


def _import(tmp_path, raw: dict):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    study, recipe, header = import_recipe({"recipe": str(path), "failure": "oom"})
    return study, recipe, "\n".join(header)


@pytest.mark.parametrize("extra", [{}, {"cut_cross_entropy": True}], ids=["plugin-alone", "key-set"])
def test_cut_cross_entropy_is_the_chunked_loss(tmp_path, extra):
    study, recipe, header = _import(tmp_path, {**AXOLOTL, "plugins": [CCE], **extra})
    assert study["train"]["loss"] == "chunked"
    assert not any("CutCrossEntropy" in key or "cut_cross" in key for key in recipe.differs)
    assert "Cut Cross Entropy is carried as train.loss: chunked" in header


def test_cut_cross_entropy_turned_off_is_the_full_loss(tmp_path):
    study, recipe, _ = _import(tmp_path, {**AXOLOTL, "plugins": [CCE], "cut_cross_entropy": False})
    assert study["train"].get("loss", "full") == "full" and "cut_cross_entropy" not in recipe.unknown


def test_liger_fused_linear_cross_entropy_is_carried_and_the_other_kernels_differ(tmp_path):
    raw = {**AXOLOTL, "plugins": [LIGER], "liger_fused_linear_cross_entropy": True, "liger_rms_norm": True}
    study, recipe, header = _import(tmp_path, raw)
    assert study["train"]["loss"] == "chunked" and "liger_fused_linear_cross_entropy" not in recipe.differs
    assert "plugins: LigerPlugin" in recipe.differs and "liger_rms_norm" in recipe.differs
    assert 'liger_fused_linear_cross_entropy -> train.loss = "chunked"' in header


def test_use_liger_kernel_carries_its_fused_loss_unless_its_config_turns_it_off(tmp_path):
    study, recipe, header = _import(tmp_path, {**TRL, "use_liger_kernel": True})
    assert study["train"]["loss"] == "chunked" and "use_liger_kernel" not in recipe.differs
    assert "Liger's other kernels" in header
    off = {**TRL, "use_liger_kernel": True, "liger_kernel_config": {"fused_linear_cross_entropy": False}}
    study, recipe, _ = _import(tmp_path, off)
    assert study["train"].get("loss", "full") == "full"
    assert "use_liger_kernel" not in recipe.unknown and "liger_kernel_config" not in recipe.unknown
