"""Write the examples' local model: the default study's gemma3-tiny (a Gemma 3 text decoder at toy width whose
activations exceed fp16's range, as real Gemma 3's do) as a plain transformers checkpoint folder, with a
tokenizer trained on examples/chat.jsonl. Usage: python scripts/make_example_model.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def main() -> None:
    from tunegrid.dataset import read_dataset
    from tunegrid.prepare.checkpoints import produce_checkpoint
    from tunegrid.prepare.data import corpus_texts
    from tunegrid.study.config import resolve_study

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="examples/models/gemma3-tiny")
    parser.add_argument("--data", default="examples/chat.jsonl")
    args = parser.parse_args()
    default = resolve_study(yaml.safe_load((REPO / "configs" / "config.yaml").read_text()))
    manifest = produce_checkpoint(
        default["models"]["gemma3-tiny"], list(corpus_texts(read_dataset(args.data))), args.out
    )
    print(f"{args.out}: {len(manifest['files'])} files")


if __name__ == "__main__":
    main()
