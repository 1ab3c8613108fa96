"""The training set as a cell reads it: the JSONL records (a pair: instruction and response; a chat: its turns;
raw text; a tool's layout: its text and its pieces, each trained or not) and the project's prompt template they
are written in where a tokenizer has no chat template of its own. The prepare stage writes the file
(tunegrid.prepare.data, datasets_io); the worker reads it here.

Light module: standard library only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n### Response:\n"
SYSTEM_TEMPLATE = "### System:\n{content}\n"


def read_dataset(path: str | Path) -> list[dict[str, str]]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def template_turns(record: dict[str, Any]) -> list[tuple[str, bool]]:
    """A record in the project's prompt template as (text, is_response) pieces, for tokenizers without
    a chat template. A pair is one instruction and its response; a chat is its turns in order; raw text is
    itself, trained whole; a tool's layout (data.layout) is its pieces, each trained or not."""
    if "pieces" in record:
        return [(str(text), bool(trained)) for text, trained in record["pieces"]]
    if "text" in record:
        return [(record["text"], True)]
    if "messages" not in record:
        return [(PROMPT_TEMPLATE.format(instruction=record["instruction"]), False), (record["response"], True)]
    pieces = []
    for message in record["messages"]:
        if message["role"] == "system":
            pieces.append((SYSTEM_TEMPLATE.format(content=message["content"]), False))
        elif message["role"] == "user":
            pieces.append((PROMPT_TEMPLATE.format(instruction=message["content"]), False))
        else:
            pieces.append((message["content"], True))
    return pieces
