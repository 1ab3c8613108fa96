"""The dataset rule writes each record as the tool it came from would build it (data.layout): per type, a record
and the text expected from the tool's prompter source and documentation, written by the dataset rule, read back as
the cell reads it, and trained on the response only unless data.loss_on is all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_study

from tunegrid.cell.data.packing import IGNORE, encode_record
from tunegrid.dataset import read_dataset, template_turns
from tunegrid.prepare.datasets_io import DataError, write_study_dataset
from tunegrid.study.config import ConfigError, resolve_study

# axolotl's AlpacaPrompter (src/axolotl/prompters.py; docs/dataset-formats/inst_tune.qmd, alpaca)
SYSTEM_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.")  # fmt: skip
SYSTEM = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
PAIR = {"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"}
SQL = {"question": "How many heads?", "context": "CREATE TABLE head (age INTEGER)", "answer": "SELECT COUNT(*)"}
CASES = {  # layout -> (record, prompt, response) as the tool builds them
    "alpaca, an input": (
        "alpaca", PAIR,
        f"{SYSTEM_INPUT}\n\n### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 2\n\n### Response:\n", "4",
    ),
    "alpaca, no input": (
        "alpaca", {**PAIR, "input": ""}, f"{SYSTEM}\n\n### Instruction:\nAdd the numbers.\n\n### Response:\n", "4",
    ),
    "alpaca:chatml": (
        "alpaca:chatml", {"instruction": "Hi", "output": "Hello"},
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "Hello",
    ),
    "alpaca:chat, an input": (
        "alpaca:chat", PAIR, f"SYSTEM: {SYSTEM_INPUT}\nUSER: Add the numbers.\n2 and 2\nASSISTANT:", "4",
    ),
    "oasst": (
        "oasst", {"INSTRUCTION": "Hi", "RESPONSE": "Hello", "SOURCE": "x"},
        f"{SYSTEM}\n\n### Instruction:\nHi\n\n### Response:\n", "Hello",
    ),
    "alpaca_chat.load_qa": (
        "alpaca_chat.load_qa", {"question": "2+2?", "answer": "4"}, f"SYSTEM: {SYSTEM}\nUSER: 2+2?\nASSISTANT:", "4",
    ),
    "context_qa.load_v2": (  # prompt_strategies/context_qa.py: ContextV2Prompter, no system prompt
        "context_qa.load_v2", {"context": "Paris is in France.", "question": "Where is Paris?", "answer": "France"},
        "Context: Paris is in France.\nQuestion: Where is Paris?\n", "Answer: France",
    ),
    # the custom type (docs/dataset-formats/inst_tune.qmd: format / no_input_format / system_prompt)
    "custom, an input": (
        {"field_instruction": "question", "field_input": "context", "field_output": "answer",
         "system_prompt": "You write SQL.", "format": "[INST] {instruction}\n{input} [/INST]"}, SQL,
        "You write SQL.[INST] How many heads?\nCREATE TABLE head (age INTEGER) [/INST]", "SELECT COUNT(*)",
    ),
    "custom, no input, the record's system": (
        {"field_instruction": "question", "field_output": "answer", "field_system": "sys",
         "system_format": "<<SYS>>{system}<</SYS>>\n", "no_input_format": "[INST] {instruction} [/INST]"},
        {"question": "Hi?", "answer": "Hello", "sys": "Be brief."},
        "<<SYS>>Be brief.<</SYS>>\n[INST] Hi? [/INST]", "Hello",
    ),
    "custom, axolotl's defaults": (
        {"field_instruction": "q", "field_output": "a"}, {"q": "Hi?", "a": "Hello"}, "Hi? ", "Hello",
    ),
    "TRL prompt-completion": (
        "prompt_completion", {"prompt": "The sky is", "completion": " blue."}, "The sky is", " blue.",
    ),
}  # fmt: skip


class CharTokenizer:
    """One token a character, BOS 1 and EOS 2; a chat template it has is never used for a tool's layout."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0
    chat_template = "{{ messages }}"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) + 3 for c in text]


def _write(tmp_path: Path, records: list[dict], data: dict, name: str = "in.jsonl") -> list[dict]:
    source = tmp_path / name
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    study = resolve_study(make_study(data={"source": "jsonl", "path": str(source), **data}))
    written = tmp_path / "train.jsonl"
    assert write_study_dataset(written, study["data"]) == len(records)
    return read_dataset(written)


@pytest.mark.parametrize("case", list(CASES))
def test_the_dataset_rule_writes_the_tools_text(tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    layout, record, prompt, response = CASES[case]
    (written,) = _write(tmp_path, [record], {"layout": layout})
    assert written["text"] == prompt + response
    assert template_turns(written) == [(prompt, False), (response, True)]
    ids, labels = encode_record(written, CharTokenizer(), "response")
    tok = CharTokenizer()
    assert ids == [1, *tok.encode(prompt), *tok.encode(response), 2], "BOS, the prompt, the response, EOS"
    assert labels == [IGNORE] * (1 + len(prompt)) + tok.encode(response) + [2], "the loss on the response"
    _, every = encode_record(written, tok, "all")  # axolotl's train_on_inputs: true
    assert every == [IGNORE, *ids[1:]]


def test_input_output_trains_the_labelled_segments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # docs/input_output.qmd: segments of text, each trained or not (label)
    segments = [{"label": False, "text": "<s>Hello\n"}, {"label": True, "text": "hi there!. "},
                {"label": False, "text": "goodbye "}, {"label": True, "text": "farewell</s>"}]  # fmt: skip
    (written,) = _write(tmp_path, [{"segments": segments}], {"layout": "input_output"})
    assert written["text"] == "<s>Hello\nhi there!. goodbye farewell</s>"
    assert template_turns(written) == [(s["text"], s["label"]) for s in segments]


def test_completion_sharegpt_and_the_default_shapes_are_unchanged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _write(tmp_path, [{"body": "raw text"}], {"fields": {"text": "body"}}) == [{"text": "raw text"}]
    chat = {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}
    fields = {"messages": "conversations", "role": "from", "content": "value"}
    assert _write(tmp_path, [chat], {"fields": fields}) == [
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    ]
    pairs = _write(tmp_path, [{"prompt": "p", "response": "r"}], {})
    assert pairs == [{"instruction": "p", "response": "r"}]


def test_a_json_array_file_is_read_as_axolotl_reads_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs.json").write_text(json.dumps([PAIR, {**PAIR, "output": "four"}], indent=2))
    study = resolve_study(make_study(data={"source": "jsonl", "path": "pairs.json", "layout": "alpaca"}))
    assert write_study_dataset(tmp_path / "train.jsonl", study["data"]) == 2
    assert [r["text"].rsplit(":\n", 1)[1] for r in read_dataset(tmp_path / "train.jsonl")] == ["4", "four"]
    (tmp_path / "bad.json").write_text(json.dumps([PAIR, {"instruction": "x"}]))
    with pytest.raises(ConfigError, match=r"'data.layout': record 2 has no field 'output'"):
        resolve_study(make_study(data={"source": "jsonl", "path": "bad.json", "layout": "alpaca"}))


def test_a_record_without_the_layouts_fields_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"'data.layout': .* line 1 has no field 'INSTRUCTION'.*'oasst'"):
        _write(tmp_path, [PAIR], {"layout": "oasst"})
    data = {"source": "jsonl", "path": str(tmp_path / "in.jsonl"), "layout": "oasst"}
    with pytest.raises(DataError, match=r"'data.layout': .* line 1 has no field 'INSTRUCTION'"):
        write_study_dataset(tmp_path / "train.jsonl", {**resolve_study(make_study())["data"], **data})
    with pytest.raises(ConfigError, match="'data.layout': 'alpaca:llama9' is no layout"):
        _write(tmp_path, [PAIR], {"layout": "alpaca:llama9"})
