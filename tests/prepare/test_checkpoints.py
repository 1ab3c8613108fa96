import copy
import json
import os
import shutil

import pytest

from tunegrid.manifest import verify_checkpoint
from tunegrid.prepare.checkpoints import CheckpointError, link_local


def test_synthetic_round_trip(checkpoints):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = checkpoints["qwen3moe-tiny"]
    manifest = verify_checkpoint(model_dir, hashes=True)
    assert manifest["source"]["kind"] == "synthetic"
    assert manifest["source"]["architecture"] == "qwen3_moe"
    assert any(name.endswith(".safetensors") for name in manifest["files"])
    assert all(len(fact["sha256"]) == 64 for fact in manifest["files"].values())
    model = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.model_type == "qwen3_moe"
    assert tok.pad_token == "<pad>" and model.config.pad_token_id == tok.pad_token_id
    experts = [p for n, p in model.named_parameters() if "experts" in n]
    assert experts and all(p.dim() == 3 for p in experts)  # v5 fused experts


def test_truncated_weights_are_caught(checkpoints, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(checkpoints["gemma3-hot"], copy)
    weights = next(copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated or replaced"):
        verify_checkpoint(copy)


def test_wrong_hash_is_caught(checkpoints, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(checkpoints["gemma3-hot"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    name = next(n for n in manifest["files"] if n.endswith(".safetensors"))
    manifest["files"][name]["sha256"] = "0" * 64
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="sha256"):
        verify_checkpoint(copy, hashes=True)


def test_local_pickle_only_checkpoint_is_refused(tmp_path):
    src = tmp_path / "pickled"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "pytorch_model.bin").write_bytes(b"not really")
    with pytest.raises(CheckpointError, match="pickle"):
        link_local({"path": str(src)}, tmp_path / "out")


def test_local_checkpoint_is_linked_with_manifest(checkpoints, tmp_path):
    manifest = link_local({"path": str(checkpoints["gemma3-hot"])}, tmp_path / "linked")
    assert manifest["source"]["kind"] == "local"
    verify_checkpoint(tmp_path / "linked", hashes=True)


def test_a_folder_another_snakemake_run_made_is_linked_without_its_hidden_files(checkpoints, tmp_path):
    src = tmp_path / "made-elsewhere"
    shutil.copytree(checkpoints["gemma3-hot"], src)
    (src / ".snakemake_timestamp").write_text("")  # Snakemake's marker of a directory() output
    os.utime(src / ".snakemake_timestamp", (1, 1))  # older than anything this run writes: "clock skew"
    (src / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    manifest = link_local({"path": str(src)}, tmp_path / "linked")
    assert not [p.name for p in (tmp_path / "linked").iterdir() if p.name.startswith(".")]
    assert not [name for name in manifest["files"] if name.startswith(".")]
    assert any(name.endswith(".safetensors") for name in manifest["files"])
    verify_checkpoint(tmp_path / "linked", hashes=True)


def test_unknown_architecture_is_a_clear_error(dataset_path, tmp_path):
    from tunegrid.prepare.checkpoints import build_synthetic

    with pytest.raises(CheckpointError, match="not-a-model"):
        build_synthetic({"architecture": "not-a-model", "config": {}, "seed": 0}, ["hello world"], tmp_path / "m")


FIXTURE_NAMES = {"OLMOE": "olmoe-tiny", "QWEN_MOE": "qwen3moe-tiny", "GEMMA_HOT": "gemma3-hot"}


@pytest.mark.parametrize("spec_name", sorted(FIXTURE_NAMES))
def test_streamed_synthetic_checkpoint_has_save_pretrained_names_in_shards(
    spec_name, checkpoints, dataset_path, tmp_path, monkeypatch
):
    """A model too large to build whole is written tensor by tensor: the same tensor names and shapes as
    transformers' save_pretrained (one tensor per expert), sharded with an index, and it loads with no
    missing or unexpected keys, its dtype the config's, its values drawn by the architecture's own init
    (Gemma's zero-centred norms zeros, others' ones; matrices at the model's scale)."""
    import conftest
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tunegrid.dataset import read_dataset
    from tunegrid.prepare import checkpoints as module
    from tunegrid.prepare.data import corpus_texts

    spec = copy.deepcopy(getattr(conftest, spec_name))
    spec["config"]["dtype"] = "bfloat16"
    monkeypatch.setattr(module, "IN_MEMORY_PARAMS", 0)
    monkeypatch.setattr(module, "SHARD_BYTES", 64 * 1024)
    out = tmp_path / "streamed"
    manifest = module.build_synthetic(spec, list(corpus_texts(read_dataset(dataset_path))), out)
    assert manifest["source"]["written"] == "streamed"
    verify_checkpoint(out, hashes=True)

    def stored(folder):
        shapes = {}
        for path in folder.glob("*.safetensors"):
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    shapes[name] = (tuple(handle.get_slice(name).get_shape()), handle.get_slice(name).get_dtype())
        return shapes

    reference = stored(checkpoints[FIXTURE_NAMES[spec_name]])
    streamed = stored(out)
    assert {k: v[0] for k, v in streamed.items()} == {k: v[0] for k, v in reference.items()}
    assert {v[1] for v in streamed.values()} == {"BF16"}
    assert len(list(out.glob("*.safetensors"))) > 1
    from safetensors.torch import load_file

    ours = {k: v for path in out.glob("*.safetensors") for k, v in load_file(path).items()}
    theirs = {
        k: v for path in checkpoints[FIXTURE_NAMES[spec_name]].glob("*.safetensors") for k, v in load_file(path).items()
    }
    for name, want in theirs.items():
        got, want = ours[name].float(), want.float()
        if want.numel() >= 4096:
            assert abs(got.std() / want.std() - 1) < 0.1, name
        elif want.std() == 0 or want.numel() == 1:
            assert torch.equal(got, want), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(streamed)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        logits = model(input_ids=torch.arange(12).view(1, 12)).logits
    assert torch.isfinite(logits).all() and logits.float().std() > 0


def test_init_scale_multiplies_exactly_the_matching_initial_weights(dataset_path, tmp_path):
    """The default study's gemma widens its MLP init: same seed, the matching tensors x10, every other equal."""
    import copy

    from conftest import GEMMA_HOT
    from safetensors.torch import load_file

    from tunegrid.dataset import read_dataset
    from tunegrid.prepare.checkpoints import produce_checkpoint
    from tunegrid.prepare.data import corpus_texts

    texts = list(corpus_texts(read_dataset(dataset_path)))
    plain, scaled = copy.deepcopy(GEMMA_HOT), copy.deepcopy(GEMMA_HOT)
    scaled["init_scale"] = {"*.mlp.*": 10}
    produce_checkpoint(plain, texts, tmp_path / "plain")
    manifest = produce_checkpoint(scaled, texts, tmp_path / "scaled")
    assert manifest["source"]["init_scale"] == {"*.mlp.*": 10}
    a, b = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "scaled" / "model.safetensors")
    widened = [name for name in a if ".mlp." in name]
    assert len(widened) == 6  # gate, up, down in each of 2 layers
    for name in a:
        assert b[name].equal(a[name] * 10 if name in widened else a[name]), name
