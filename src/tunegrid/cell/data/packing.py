"""Examples to training rows: tokenized with the tokenizer's chat template (or the project's prompt
template), then packed several to a row so a step is nearly all real tokens.

Packed rows keep examples apart with `position_ids` that restart at 0 for every example and no attention
mask, the format transformers' DataCollatorWithFlattening produces. transformers (masking_utils) turns
such position ids into a block-diagonal causal mask for eager/sdpa/flex attention in every model that
builds its mask with `create_causal_mask`, but only without attention mask and without KV cache; flash
attention instead derives varlen boundaries from them, but only for a single flattened row
(`_is_packed_sequence` requires batch size 1), so rows are flattened there. A model whose code builds its
own mask would ignore the boundaries: it gets examples concatenated with EOS separators instead, and the
cell says so (`data.packing` in its result).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from tunegrid.cell.data.batches import BatchStream
from tunegrid.cell_spec import DataSpec
from tunegrid.dataset import template_turns

IGNORE = -100
MASKED_ATTENTION = ("eager", "sdpa", "flex_attention")

Encoded = tuple[list[int], list[int]]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def as_messages(record: dict[str, Any]) -> list[dict[str, str]]:
    if "messages" in record:
        return record["messages"]
    return [{"role": "user", "content": record["instruction"]}, {"role": "assistant", "content": record["response"]}]


def encode_record(record: dict[str, Any], tokenizer: Any, loss_on: str) -> Encoded:
    """Token ids and labels of one example; labels are -100 except on response tokens (or all, by choice).

    The first label is always -100: no token of the example predicts it, and in a packed row it would
    be learned from the end of the previous example."""
    if has_chat_template(tokenizer) and "text" not in record:  # raw text is never laid out as a chat
        ids, labels = _encode_chat_template(record, tokenizer, loss_on)
    else:
        ids, labels = _encode_project_template(record, tokenizer, loss_on)
    return ids, [IGNORE, *labels[1:]] if labels else labels


def _encode_project_template(record: dict[str, Any], tokenizer: Any, loss_on: str) -> Encoded:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids, labels = list(bos), [IGNORE] * len(bos)
    for text, is_response in template_turns(record):
        tokens = tokenizer.encode(text, add_special_tokens=False) + (eos if is_response else [])
        ids += tokens
        labels += tokens if is_response or loss_on == "all" else [IGNORE] * len(tokens)
    return ids, labels


def _encode_chat_template(record: dict[str, Any], tokenizer: Any, loss_on: str) -> Encoded:
    messages = as_messages(record)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = _assistant_spans(messages, text, tokenizer)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"])
    trained = [loss_on == "all" or any(s <= start < e for s, e in spans) for start, _ in encoding["offset_mapping"]]
    return ids, [t if keep else IGNORE for t, keep in zip(ids, trained)]


def _assistant_spans(messages: list[dict[str, str]], text: str, tokenizer: Any) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in the rendered chat: from the end of the prompt that asks
    for the turn (generation prompt included) to the end of the turn (its end-of-turn marker included)."""
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if text.startswith(before) and text.startswith(through):
            spans.append((len(before), len(through)))
        else:  # a template that renders earlier turns differently once later ones exist: find the content
            start = text.find(message["content"], cursor)
            if start < 0:
                continue
            spans.append((start, start + len(message["content"])))
        cursor = spans[-1][1]
    return spans


def packing_mode(model: Any, enabled: bool) -> str:
    """How example boundaries are kept in a packed row for this model: position_ids, eos_separated or off."""
    if not enabled:
        return "off"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    impl = str(getattr(base.config, "_attn_implementation", None) or "eager")
    if "flash" in impl:
        return "position_ids"
    module = sys.modules.get(type(base).__module__)
    if impl in MASKED_ATTENTION and hasattr(module, "create_causal_mask"):
        return "position_ids"
    return "eos_separated"


def keep_boundaries(model: Any) -> None:
    """No KV cache in training: transformers reads packed position_ids only when there is no cache,
    and a model whose config has use_cache on builds one on every forward, in training too."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.use_cache = False


def flattens_rows(model: Any) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "flash" in str(getattr(base.config, "_attn_implementation", None) or "")


@dataclass
class Rows:
    tensors: dict[str, Any]
    row_tokens: Any
    examples: int
    dropped_examples: int = 0  # in the packing's remainder row (see `pack`)
    truncated_examples: int = 0  # whose loss tokens all lay past seq_len


def pack(encoded: list[Encoded], seq_len: int, pad_id: int, eos_id: int | None, mode: str) -> Rows:
    """Rows of seq_len tokens: one example each (off), or as many whole examples as fit (packed).

    Packed, every row but the last opened is at least seq_len minus the longest example full (an example
    that fit no open row opened a new one); the last is the remainder and may hold a few tokens. A remainder
    emptier than that is dropped, as a chunked stream drops its last partial chunk, so that no step the
    stream draws it into trains on a mostly padded row.
    """
    examples = [(ids[:seq_len], labels[:seq_len]) for ids, labels in encoded if ids]
    kept = _with_loss_tokens(examples, encoded, seq_len)
    cut, examples = len(examples) - len(kept), kept
    if mode == "eos_separated":
        examples = [_ends_with_eos(ids, labels, eos_id, seq_len) for ids, labels in examples]
    rows = [[ex] for ex in examples] if mode == "off" else _fill_rows(examples, seq_len)
    dropped = 0
    if mode != "off" and len(rows) > 1:
        guaranteed = seq_len - max(len(ids) for ids, _ in examples)
        if sum(len(ids) for ids, _ in rows[-1]) < guaranteed:
            dropped = len(rows.pop())
    tensors, counts = _row_tensors(rows, seq_len, pad_id, mode)
    return Rows(tensors, counts, len(examples) - dropped, dropped, cut)


def _with_loss_tokens(examples: list[Encoded], encoded: list[Encoded], seq_len: int) -> list[Encoded]:
    """The examples with a loss token within seq_len. One whose loss tokens all lie past it trains nothing: a step
    of such rows has a loss of 0/0 (NaN), which would read as a precision failure. Dropped, and refused when none
    is left."""
    kept = [(ids, labels) for ids, labels in examples if any(t != IGNORE for t in labels)]
    if not kept and examples:
        starts = sorted(next((i for i, t in enumerate(lb) if t != IGNORE), len(lb)) for _, lb in encoded if lb)
        first = starts[len(starts) // 2] if starts else seq_len
        raise ValueError(
            f"train.seq_len {seq_len} leaves no loss token in any example: with this tokenizer's template the "
            f"response starts at token {first} (the median example); raise train.seq_len above {first}"
        )
    return kept


def _row_tensors(rows: list[list[Encoded]], seq_len: int, pad_id: int, mode: str) -> tuple[dict[str, Any], Any]:
    """The rows padded to seq_len as the model's inputs (ids, labels, and the attention mask or, packed by
    position, the position ids), and each row's real tokens."""
    import torch

    ids_rows, label_rows, extra_rows, counts = [], [], [], []
    for row in rows:
        ids = [t for ex_ids, _ in row for t in ex_ids]
        labels = [t for _, ex_labels in row for t in ex_labels]
        n = len(ids)
        ids_rows.append(ids + [pad_id] * (seq_len - n))
        label_rows.append(labels + [IGNORE] * (seq_len - n))
        if mode == "position_ids":  # the padding is one more "example": it attends only to itself
            extra_rows.append([p for ex_ids, _ in row for p in range(len(ex_ids))] + list(range(seq_len - n)))
        else:
            extra_rows.append([1] * n + [0] * (seq_len - n))
        counts.append(n)
    extra = "position_ids" if mode == "position_ids" else "attention_mask"
    tensors = {
        "input_ids": torch.tensor(ids_rows, dtype=torch.long),
        extra: torch.tensor(extra_rows, dtype=torch.long),
        "labels": torch.tensor(label_rows, dtype=torch.long),
    }
    return tensors, torch.tensor(counts, dtype=torch.long)


def _ends_with_eos(ids: list[int], labels: list[int], eos_id: int | None, seq_len: int) -> Encoded:
    if eos_id is None or ids[-1] == eos_id:
        return ids, labels
    return (ids + [eos_id])[:seq_len], (labels + [eos_id if labels[-1] != IGNORE else IGNORE])[:seq_len]


OPEN_ROWS = 64  # rows still taking examples: first fit over a window keeps packing linear in the set's size


def _fill_rows(examples: list[Encoded], seq_len: int) -> list[list[Encoded]]:
    """Whole examples (none is split), each into the first of the open rows with room for it."""
    rows: list[list[Encoded]] = []
    free: list[int] = []  # room left in rows[first_open:]
    first_open = 0
    for example in examples:
        size = len(example[0])
        slot = next((i for i, room in enumerate(free) if room >= size), None)
        if slot is None:
            rows.append([])
            free.append(seq_len)
            slot = len(free) - 1
        rows[first_open + slot].append(example)
        free[slot] -= size
        if len(free) > OPEN_ROWS:  # the oldest open row is closed as it is
            free.pop(0)
            first_open += 1
    return rows


def build_stream(
    records: list[dict[str, Any]],
    tokenizer: Any,
    model: Any,
    data: DataSpec,
    seq_len: int,
    batch_size: int,
    seed: int,
    accum: int = 1,
) -> tuple[BatchStream, dict[str, Any]]:
    """The cell's batches and the facts about them (result["data"])."""
    mode = packing_mode(model, data.packing)
    loss_on = data.loss_on
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = pack([encode_record(r, tokenizer, loss_on) for r in records], seq_len, pad, tokenizer.eos_token_id, mode)
    if mode == "position_ids":
        keep_boundaries(model)
    flat = mode == "position_ids" and flattens_rows(model)
    stream = BatchStream(rows.tensors, batch_size, seed, rows.row_tokens, accum, flat=flat)
    n_rows = int(rows.row_tokens.numel())
    facts = {
        "source": data.source,
        "packing": mode,
        "flattened": flat,
        "template": "chat_template" if has_chat_template(tokenizer) else "prompt_template",
        "loss_on": loss_on,
        "examples": rows.examples,
        "examples_dropped": rows.dropped_examples,  # the packing's underfilled remainder row
        "examples_without_loss_tokens": rows.truncated_examples,  # their responses lie past seq_len
        "rows": n_rows,
        "tokens": int(rows.row_tokens.sum()),  # real tokens of one pass over the set
        "fill": float(rows.row_tokens.sum()) / max(1, n_rows * seq_len),  # real tokens / row capacity
    }
    return stream, facts
