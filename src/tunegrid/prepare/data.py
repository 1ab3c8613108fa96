"""The training set: small instruction/response pairs generated deterministically from a seed.

Generated rather than downloaded because the default study and the tests run with no network.
The tasks are learnable by a tiny model (copying, reversing, counting), so the loss visibly falls.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tunegrid.dataset import template_turns

_WORDS = (
    "apple river stone cloud tiger lemon piano rocket garden silver window candle forest "
    "planet marble dragon violet harbor pepper falcon meadow copper ocean ember willow"
).split()


def _example(rng: random.Random) -> dict[str, str]:
    kind = rng.randrange(6)
    w1, w2, w3 = rng.sample(_WORDS, 3)
    a, b = rng.randrange(50), rng.randrange(50)
    if kind == 0:
        return {"instruction": f"Reverse the word {w1}.", "response": w1[::-1]}
    if kind == 1:
        return {"instruction": f"Add {a} and {b}.", "response": str(a + b)}
    if kind == 2:
        return {"instruction": f"Write {w1} in capitals.", "response": w1.upper()}
    if kind == 3:
        return {"instruction": f"Repeat {w1} twice.", "response": f"{w1} {w1}"}
    if kind == 4:
        return {"instruction": f"Sort: {w1} {w2} {w3}.", "response": " ".join(sorted((w1, w2, w3)))}
    return {"instruction": f"Which is larger, {a} or {b}?", "response": str(max(a, b))}


def generate_examples(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [_example(rng) for _ in range(n)]


def write_dataset(path: str | Path, n: int, seed: int) -> None:
    from tunegrid.runtime.files import atomic_write_text

    lines = "".join(json.dumps(ex, sort_keys=True) + "\n" for ex in generate_examples(n, seed))
    atomic_write_text(path, lines)


def corpus_texts(examples: list[dict[str, Any]]) -> Iterator[str]:
    """The text a tokenizer is trained on: exactly what the model sees."""
    for ex in examples:
        yield "".join(text for text, _ in template_turns(ex))
