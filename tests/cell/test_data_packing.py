"""Packing: full rows, restarted position ids, -100 on prompts and padding, and losses equal to unpacked."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, one_cell_spec

from tunegrid.cell.data.batches import tokenize_examples
from tunegrid.cell.data.packing import IGNORE, build_stream, encode_record, pack, packing_mode
from tunegrid.prepare.data import generate_examples

CHATS = [json.loads(line) for line in (REPO / "examples" / "chat.jsonl").read_text().splitlines()]


def _tokenizer(checkpoints, name="gemma3-hot"):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoints[name])


def test_packed_rows_are_full_with_restarted_positions_and_masked_prompts(checkpoints):
    tok = _tokenizer(checkpoints)
    encoded = [encode_record(r, tok, "response") for r in CHATS[:60]]
    rows = pack(encoded, 128, tok.pad_token_id, tok.eos_token_id, "position_ids")
    ids, labels, positions = rows.tensors["input_ids"], rows.tensors["labels"], rows.tensors["position_ids"]
    assert "attention_mask" not in rows.tensors and ids.shape[1] == 128
    assert rows.row_tokens.numel() < 60 / 1.5
    assert float(rows.row_tokens.sum()) / ids.numel() > 0.85
    starts = {len(e[0]) for e in encoded}
    for row, n in enumerate(rows.row_tokens.tolist()):
        assert (labels[row, n:] == IGNORE).all()  # padding is never a target
        restarts = (positions[row, :n] == 0).nonzero().flatten().tolist()
        lengths = [b - a for a, b in zip(restarts, restarts[1:] + [n])]
        assert restarts[0] == 0 and all(length in starts for length in lengths)  # one restart per example
        for a in restarts:
            assert labels[row, a] == IGNORE  # no example's first token is learned from the one before
    trained = tok.decode([t for t in labels.flatten().tolist() if t != IGNORE])
    prompts = tok.decode([t for t, lab in zip(ids.flatten().tolist(), labels.flatten().tolist()) if lab == IGNORE])
    assert "Instruction" not in trained and "System" not in trained and "?" not in trained
    assert "Instruction" in prompts and "It is" not in prompts.replace("What is", "")


def test_loss_on_all_trains_prompts_too(checkpoints):
    tok = _tokenizer(checkpoints)
    ids, labels = encode_record(CHATS[0], tok, "all")
    assert labels[0] == IGNORE and labels[1:] == ids[1:]


def test_unpacked_rows_are_the_padded_tokenization(checkpoints):
    tok = _tokenizer(checkpoints)
    examples = generate_examples(16, 0)
    rows = pack([encode_record(e, tok, "response") for e in examples], 48, tok.pad_token_id, tok.eos_token_id, "off")
    expected = tokenize_examples(examples, tok, 48)
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(rows.tensors[key], expected[key]), key
    assert torch.equal(rows.row_tokens, expected["attention_mask"].sum(dim=1))


def test_eos_separated_rows_end_every_example_with_eos(checkpoints):
    tok = _tokenizer(checkpoints)
    encoded = [encode_record(r, tok, "response") for r in CHATS[:30]]
    rows = pack(encoded, 128, tok.pad_token_id, tok.eos_token_id, "eos_separated")
    mask, ids = rows.tensors["attention_mask"], rows.tensors["input_ids"]
    assert "position_ids" not in rows.tensors
    assert torch.equal(mask.sum(dim=1), rows.row_tokens)
    assert int((ids[mask == 1] == tok.eos_token_id).sum()) >= rows.examples


def test_chat_template_trains_only_assistant_turns(checkpoints):
    tok = _tokenizer(checkpoints)
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    chat = {
        "messages": [
            {"role": "user", "content": "Count to 3."},
            {"role": "assistant", "content": "1 2 3."},
            {"role": "user", "content": "What color is snow?"},
            {"role": "assistant", "content": "It is white."},
        ]
    }
    ids, labels = encode_record(chat, tok, "response")
    trained = tok.decode([t for t in labels if t != IGNORE])
    assert "1 2 3." in trained and "It is white." in trained and "<|end|>" in trained
    assert "Count" not in trained and "snow" not in trained and "user" not in trained


def _per_example_loss(logits: torch.Tensor, labels: list[int]) -> torch.Tensor:
    target = torch.tensor(labels[1:])
    return torch.nn.functional.cross_entropy(logits[: len(labels) - 1].float(), target, ignore_index=IGNORE)


@pytest.mark.parametrize("model_name", ["gemma3-hot", "qwen3moe-tiny", "olmoe-tiny"])
def test_packed_loss_of_each_example_equals_its_loss_alone(checkpoints, model_name):
    from transformers import AutoModelForCausalLM

    tok = _tokenizer(checkpoints, model_name)
    model = AutoModelForCausalLM.from_pretrained(checkpoints[model_name], dtype=torch.float32).eval()
    assert packing_mode(model, True) == "position_ids"
    data = one_cell_spec(data={"examples": 64, "packing": True}).data
    _, facts = build_stream(CHATS[:8], tok, model, data, 128, 2, 0)  # the trainer's own setup
    assert facts["packing"] == "position_ids" and model.config.use_cache is False
    (a_ids, a_labels), (b_ids, b_labels) = (encode_record(r, tok, "response") for r in CHATS[3:5])
    seq_len = len(a_ids) + len(b_ids) + 5
    rows = pack([(a_ids, a_labels), (b_ids, b_labels)], seq_len, tok.pad_token_id, tok.eos_token_id, "position_ids")
    assert rows.row_tokens.tolist() == [len(a_ids) + len(b_ids)]
    with torch.no_grad():
        packed = model(input_ids=rows.tensors["input_ids"], position_ids=rows.tensors["position_ids"]).logits[0]
        alone_a = model(input_ids=torch.tensor([a_ids])).logits[0]
        alone_b = model(input_ids=torch.tensor([b_ids])).logits[0]
        # the control: the same row without restarted positions lets B attend to A
        joined = model(input_ids=torch.tensor([a_ids + b_ids])).logits[0]
    n = len(a_ids)
    loss_a, loss_b = _per_example_loss(packed[:n], a_labels), _per_example_loss(packed[n:], b_labels)
    ref_a, ref_b = _per_example_loss(alone_a, a_labels), _per_example_loss(alone_b, b_labels)
    # 1e-5, relative above 1: the hot Gemma's loss is ~200, where one fp32 ulp is already 1.5e-5
    assert abs(loss_a - ref_a) <= 1e-5 * max(1.0, float(ref_a))
    assert abs(loss_b - ref_b) <= 1e-5 * max(1.0, float(ref_b))
    assert abs(_per_example_loss(joined[n:], b_labels) - ref_b) > 1e-3


def test_packing_mode_follows_the_attention_implementation(checkpoints):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3moe-tiny"], dtype=torch.float32)
    assert packing_mode(model, False) == "off"
    model.config._attn_implementation = "eager"
    assert packing_mode(model, True) == "position_ids"


def test_examples_whose_loss_tokens_lie_past_seq_len_are_dropped_and_none_left_is_refused_naming_the_key():
    """A row without a loss token makes a step's loss 0/0 (NaN): that would read as a precision failure."""
    from tunegrid.cell.data.packing import IGNORE, pack

    long_prompt = (list(range(1, 11)), [IGNORE] * 8 + [9, 10])  # the response at tokens 8-9
    short = ([1, 2, 3], [IGNORE, 2, 3])
    rows = pack([long_prompt, short], 6, 0, None, "off")
    assert rows.examples == 1 and rows.truncated_examples == 1
    with pytest.raises(ValueError, match=r"train.seq_len 6 leaves no loss token .* raise train.seq_len above 8"):
        pack([long_prompt, long_prompt], 6, 0, None, "off")
