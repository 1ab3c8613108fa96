"""The chunked loss (`train.loss: chunked`): the causal-LM loss without the full [tokens x vocab] logits.

The model runs without labels and with its output head standing aside: the head's forward is swapped, for
the model's call only, for one that keeps its input (the final norm's output, as the model hands it to the
head) and returns no logits. The loss is then taken over the loss tokens alone (labels shifted by one, as
transformers' ForCausalLMLoss shifts them; -100 ignored, so padding, prompts and a packed row's example
starts hold no logits), a chunk of `train.loss_chunk_tokens` at a time: the head, Gemma's final logit
softcapping where the config sets it, fp32 cross entropy summed. Each chunk runs under torch's non-reentrant
checkpoint, so its logits are freed after its forward and rebuilt, one chunk at a time, in backward: the
device holds one chunk's logits at once instead of all of them. The sum is normalised as the model's own loss
is (over `num_items_in_batch` where the model takes it, else the mean over its loss tokens), and an MoE
model's router auxiliary loss is added as the model adds it when given labels.

The same trade as Liger Kernel's fused linear cross entropy and Apple's Cut Cross Entropy (which fuse the
chunks into Triton kernels, CUDA only); here plain torch ops, on any device, the same arithmetic per token.
What the instruments see: the head's hooks fire for the model's call with its full input (and an empty
output) and again for each chunk, whose logits are the loss tokens' only, without token positions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tunegrid.cell.data.packing import IGNORE
from tunegrid.cell_spec import CellSpec
from tunegrid.vocabulary import SCALED_LOGIT_KEYS

FULL, CHUNKED = "full", "chunked"  # train.loss


def head_of(model: Any) -> Any:
    """The output head module the model's forward calls (peft's wrapper where it wraps it)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if head is None:
        raise ValueError(f"train.loss: chunked needs a model with an output head; {type(base).__name__} has none")
    return head


def text_config(model: Any) -> Any:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@contextlib.contextmanager
def head_input_kept(head: Any) -> Iterator[list[Any]]:
    """For the duration, the head's forward keeps its input and returns no logits ([..., 0]); its hooks still
    fire (the module is called as before). An instance-level forward already there (accelerate's) comes back."""
    kept: list[Any] = []
    had = head.__dict__.get("forward")

    def keep(hidden: Any, *_args: Any, **_kwargs: Any) -> Any:
        kept.append(hidden)
        return hidden[..., :0]

    head.forward = keep
    try:
        yield kept
    finally:
        if had is None:
            del head.forward
        else:
            head.forward = had


def _chunk_loss(hidden: Any, targets: Any, head: Any, softcap: float | None) -> Any:
    """One chunk's summed fp32 cross entropy, the logits post-processed as the model does (Gemma's softcap)."""
    import torch

    logits = head(hidden)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")


def loss_positions(labels: Any) -> tuple[Any, Any]:
    """The flat positions of the loss tokens (labels shifted by one, as ForCausalLMLoss shifts them; IGNORE
    skipped) and their targets. On CUDA one host sync, taken before the model's forward is queued."""
    import torch

    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:].reshape(-1)
    kept = (shifted != IGNORE).nonzero().squeeze(1)
    return kept, shifted.index_select(0, kept)


def chunked_token_loss(
    hidden: Any, kept: Any, targets: Any, head: Any, chunk_tokens: int, softcap: float | None = None
) -> Any:
    """The summed cross entropy of the loss tokens at flat positions `kept` of `hidden` ([..., seq, hidden]),
    over the head's logits of `chunk_tokens` tokens at a time, each chunk rebuilt in backward."""
    import torch
    from torch.utils.checkpoint import checkpoint

    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, kept.to(hidden.device))
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, rows.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        total = total + checkpoint(_chunk_loss, rows[part], targets[part], head, softcap, use_reentrant=False)
    return total


@dataclass
class ChunkedLoss:
    """How a cell with `train.loss: chunked` takes its micro-batch loss."""

    head: Any
    chunk_tokens: int
    softcap: float | None
    aux_coef: float  # the router auxiliary loss's weight (MoE configs that output it)

    @classmethod
    def of(cls, model: Any, chunk_tokens: int) -> ChunkedLoss:
        config = text_config(model)
        scaled = [key for key in SCALED_LOGIT_KEYS if getattr(config, key, None) not in (None, 1, 1.0)]
        if scaled:
            raise ValueError(
                f"train.loss: chunked does not reproduce {type(config).__name__}'s {scaled[0]} "
                f"({getattr(config, scaled[0])}) on the logits; use train.loss: full for this model"
            )
        softcap = getattr(config, "final_logit_softcapping", None)
        return cls(
            head=head_of(model),
            chunk_tokens=chunk_tokens,
            softcap=float(softcap) if softcap else None,
            aux_coef=float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0),
        )

    def loss(self, call: Any, batch: dict[str, Any], num_items: Any = None) -> Any:
        """The micro-batch's loss as the model returns it with labels: summed token loss over `num_items`
        (the model takes num_items_in_batch) or its mean over the micro-batch's loss tokens, plus the router
        auxiliary loss where the model outputs one. `call`: the model, or DDP around it."""
        kept, targets = loss_positions(batch["labels"])
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        with head_input_kept(self.head) as seen:
            output = call(**inputs)
        (hidden,) = seen
        total = chunked_token_loss(hidden, kept, targets, self.head, self.chunk_tokens, self.softcap)
        count = num_items if num_items is not None else kept.numel()  # the mean: over the loss tokens
        loss = total / (count.to(total.device) if hasattr(count, "to") else count)
        aux = getattr(output, "aux_loss", None)
        if aux is not None:
            loss = loss + self.aux_coef * aux.to(loss.device)
        return loss


def chunked_loss_of(spec: CellSpec, model: Any) -> ChunkedLoss | None:
    """The cell's chunked loss where `train.loss` is chunked."""
    if spec.train.loss != CHUNKED:
        return None
    return ChunkedLoss.of(model, spec.train.loss_chunk_tokens)
