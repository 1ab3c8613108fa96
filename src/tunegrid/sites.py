"""Where an activation is measured, in the words a user reads: a decoder layer's output is the residual stream after
that layer (the sum its additions carry from the embeddings on), a module's input is what it was fed.

Light module: standard library only (the recommender and the report read it without torch).
"""

from __future__ import annotations

import re

# A decoder block in the model's list of layers (model.layers.N, transformer.h.N, ...): its output is the residual
# stream after it, the sum its additions carry from the embeddings on
BLOCK_NAME = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)$")
INPUT = "input"
OUTPUT = "output"


def site_words(module: str, site: str = OUTPUT) -> str:
    """A measured site in words a user reads: a decoder block's output is the residual stream after that layer;
    a module's input is what it was fed (a norm's input is the residual stream too)."""
    block = BLOCK_NAME.search(module)
    if site == OUTPUT and block:
        return f"the residual stream after layer {block.group(1)}"
    return f"the input of {module}" if site == INPUT else f"the output of {module}"
