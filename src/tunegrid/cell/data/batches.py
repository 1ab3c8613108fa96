"""A cell's batches: the data set tokenized to fixed-length rows (tokenize_examples) and drawn, epoch by epoch,
as micro-batches in a seeded order (BatchStream); cell/data/packing.py builds the stream a cell trains on.
"""

from __future__ import annotations

from typing import Any

from tunegrid.dataset import PROMPT_TEMPLATE


def tokenize_examples(examples: list[dict[str, str]], tokenizer: Any, seq_len: int) -> dict[str, Any]:
    """Token ids, attention mask and labels (prompt tokens masked with -100), padded to seq_len."""
    import torch

    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids_rows, label_rows, mask_rows = [], [], []
    for ex in examples:
        prompt = bos + tokenizer.encode(PROMPT_TEMPLATE.format(instruction=ex["instruction"]), add_special_tokens=False)
        answer = tokenizer.encode(ex["response"], add_special_tokens=False) + eos
        ids = (prompt + answer)[:seq_len]
        labels = ([-100] * len(prompt) + answer)[:seq_len]
        n = len(ids)
        ids_rows.append(ids + [pad] * (seq_len - n))
        label_rows.append(labels + [-100] * (seq_len - n))
        mask_rows.append([1] * n + [0] * (seq_len - n))
    return {
        "input_ids": torch.tensor(ids_rows, dtype=torch.long),
        "attention_mask": torch.tensor(mask_rows, dtype=torch.long),
        "labels": torch.tensor(label_rows, dtype=torch.long),
    }


class BatchStream:
    """Endless seeded shuffles of a tokenized set; the rows of step k are a pure function of (seed, k).

    A step draws batch_size x accum rows (the effective batch) and hands them out as `accum` micro-batches
    of batch_size rows, so how a step is split changes no row it trains on. A flat stream hands each
    (micro-)batch out as one row of batch_size x seq_len tokens (flash attention reads boundaries only then).
    """

    def __init__(
        self,
        tensors: dict[str, Any],
        batch_size: int,
        seed: int,
        row_tokens: Any = None,
        accum: int = 1,
        *,
        flat: bool = False,
    ) -> None:
        self.tensors = tensors
        self.flat = flat
        self.batch_size = batch_size
        self.accum = accum
        self.seed = seed
        self.n, width = tensors["input_ids"].shape[:2]
        if row_tokens is None:  # packed rows carry no attention mask to count real tokens from: they pass row_tokens
            mask = tensors.get("attention_mask")
            row_tokens = mask.sum(dim=1) if mask is not None else tensors["input_ids"].new_full((self.n,), width)
        self.row_tokens = row_tokens

    @property
    def rows_per_step(self) -> int:
        return self.batch_size * self.accum

    def batch(self, step: int) -> dict[str, Any]:
        """Every row of the step at once (the effective batch)."""
        idx = self.indices(step)
        return self.shaped({k: v[idx] for k, v in self.tensors.items()})

    def micro_batches(self, step: int) -> list[dict[str, Any]]:
        """The step's rows as `accum` micro-batches of batch_size rows, in order."""
        return [
            self.shaped({k: v[part] for k, v in self.tensors.items()})
            for part in self.indices(step).split(self.batch_size)
        ]

    def real_positions(self, step: int) -> list[Any]:
        """Per micro-batch, True at real tokens and False at padding, shaped like its input_ids. Rows are padded at
        their end, so row_tokens says where padding starts (token ids cannot: a tokenizer's pad may be its eos)."""
        import torch

        width = self.tensors["input_ids"].shape[1]
        return [
            self.shaped({"input_ids": torch.arange(width)[None, :] < self.row_tokens[part][:, None]})["input_ids"]
            for part in self.indices(step).split(self.batch_size)
        ]

    def shaped(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A (micro-)batch in the layout the model reads: rows as drawn, or one row of them all (flat)."""
        return {k: v.reshape(1, -1) for k, v in batch.items()} if self.flat else batch

    def real_tokens(self, step: int) -> int:
        """Tokens of the whole step (every micro-batch), padding excluded."""
        return int(self.row_tokens[self.indices(step)].sum())

    def indices(self, step: int) -> Any:
        import torch

        size = self.rows_per_step
        per_epoch = max(1, self.n // size)
        epoch, offset = divmod(step, per_epoch)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(self.n, generator=gen)
        idx = order[offset * size : (offset + 1) * size]
        if idx.numel() < size:  # batch larger than the set: wrap around
            idx = order[torch.arange(offset * size, (offset + 1) * size) % self.n]
        return idx
