"""Writes examples/chat.jsonl: 200 short chats (system/user/assistant) built from small fact tables.

Deterministic (seeded), so the committed file can be re-made byte for byte:
    python scripts/make_example_chat.py examples/chat.jsonl
"""

from __future__ import annotations

import json
import random
import sys

COLORS = {
    "grass": "green",
    "the sky on a clear day": "blue",
    "snow": "white",
    "a ripe banana": "yellow",
    "a ripe tomato": "red",
    "coal": "black",
    "an orange": "orange",
    "a plum": "purple",
}
OPPOSITES = {
    "hot": "cold",
    "up": "down",
    "early": "late",
    "light": "dark",
    "open": "closed",
    "full": "empty",
    "fast": "slow",
    "loud": "quiet",
    "wet": "dry",
    "old": "new",
}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SYSTEMS = ["You are a concise assistant.", "Answer in one short sentence.", "You are a helpful tutor."]


def _turn(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        thing = rng.choice(sorted(COLORS))
        return f"What color is {thing}?", f"It is {COLORS[thing]}."
    if kind == 1:
        word = rng.choice(sorted(OPPOSITES))
        return f"What is the opposite of {word}?", f"The opposite of {word} is {OPPOSITES[word]}."
    if kind == 2:
        day = rng.randrange(7)
        return f"Which day comes after {DAYS[day]}?", f"{DAYS[(day + 1) % 7]} comes after {DAYS[day]}."
    if kind == 3:
        a, b = rng.randrange(2, 20), rng.randrange(2, 20)
        return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."
    n = rng.randrange(3, 9)
    return f"Count to {n}.", " ".join(str(i) for i in range(1, n + 1)) + "."


def chat(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []
    for _ in range(1 + (rng.random() < 0.35)):  # one or two exchanges
        question, answer = _turn(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def main(path: str, n: int = 200, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(n):
            fh.write(json.dumps(chat(rng), sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
