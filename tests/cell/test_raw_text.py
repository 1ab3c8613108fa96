"""Raw-text records (`data.fields: {text: <column>}`, axolotl's `completion` type): read from the study's own
file, never laid out as a chat, every token trained, ended by EOS."""

from __future__ import annotations

import json

from tunegrid.cell.data.packing import IGNORE, encode_record
from tunegrid.prepare.datasets_io import load_records
from tunegrid.study.data_checks import config_problems


def test_raw_text_is_tokenized_whole_and_trained_on_every_token(checkpoints):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoints["gemma3-hot"])
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    text = "### Human: 2+2? ### Assistant: 4"
    ids, labels = encode_record({"text": text}, tok, "response")
    assert tok.decode(ids, skip_special_tokens=True) == text and "<|" not in tok.decode(ids)
    assert labels[0] == IGNORE and labels[1:] == ids[1:] and ids[-1] == tok.eos_token_id


def test_a_text_column_is_read_alone(tmp_path):
    path = tmp_path / "guanaco.jsonl"
    path.write_text(json.dumps({"text": "### Human: hi ### Assistant: hello", "lang": "en"}) + "\n")
    data = {"source": "jsonl", "path": str(path), "fields": {"text": "text"}, "loss_on": "all", "packing": True}
    assert load_records(data) == [{"text": "### Human: hi ### Assistant: hello"}]
    assert config_problems({**data, "fields": {"text": "text", "prompt": "p"}}) == [
        "config key 'data.fields': raw text is {text: <column>} alone"
    ]
