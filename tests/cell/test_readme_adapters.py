"""The docs' adapter-reuse snippet (docs/guide/review.md), run as the page writes it, reproduces the reference loss of
every `ok` cell of the default study's grid (configs/config.yaml: both models, fp32/bf16/fp16/fp16-islands, both
batch sizes, none/nf4/nf4-experts, less the grid's exclusions; fewer steps, to keep the suite's time)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
from conftest import REPO

from tunegrid.config import cell_spec, expand_cells, load_study, resolve_study
from tunegrid.files import read_json

# relative bound per precision: the same weights through the same kernels (measured 0 on CPU for every cell,
# bf16 and fp16 under autocast included)
BOUND = {"fp32": 1e-6, "bf16": 1e-6, "fp16": 1e-6, "fp16-islands": 1e-6}


def readme_snippet() -> str:
    text = (REPO / "docs" / "guide" / "review.md").read_text()
    section = text[text.index("## Reusing a winning cell's adapter") :]
    section = section.split("\n## ", 1)[0]  # up to the next section, if any
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the adapter section of docs/guide/review.md holds one python snippet"
    return blocks[0]


@pytest.fixture(scope="module")
def default_study_run(tmp_path_factory):
    from tunegrid.cell.train import run_worker
    from tunegrid.prepare.checkpoints import produce_checkpoint
    from tunegrid.prepare.data import corpus_texts, read_dataset, write_dataset

    raw = load_study(REPO / "configs" / "config.yaml")
    study = resolve_study({**copy.deepcopy(raw), "train": {**raw["train"], "steps": 3}})
    root = tmp_path_factory.mktemp("default-study")
    data = root / "train.jsonl"
    write_dataset(data, study["data"]["examples"], study["data"]["seed"])
    texts = list(corpus_texts(read_dataset(data)))
    models = {}
    for name, model in study["models"].items():
        produce_checkpoint(copy.deepcopy(model), texts, root / "models" / name)
        models[name] = root / "models" / name
    cells = []
    for cell in expand_cells(study):
        spec = cell_spec(study, cell)
        run_dir = root / "runs" / spec["cell_id"]
        run_worker(spec, str(models[spec["model"]["name"]]), str(data), str(run_dir))
        cells.append((spec, run_dir, read_json(run_dir / "worker.json")))
    return models, cells


def test_readme_snippet_reproduces_every_ok_cells_reference_loss(default_study_run):
    models, cells = default_study_run
    snippet = readme_snippet()
    ok = [(spec, run_dir, facts) for spec, run_dir, facts in cells if facts["outcome"] == "ok"]
    assert len(ok) >= 24, [(s["cell_id"], f["outcome"]) for s, _, f in cells]
    assert {s["axes"]["quant"] for s, _, _ in ok} == {"none", "nf4", "nf4-experts"}
    assert {s["axes"]["precision"] for s, _, _ in ok} >= {"fp32", "bf16"}
    off = {}
    for spec, run_dir, facts in ok:
        code = snippet.replace("results/<study>/models/<model>", str(models[spec["model"]["name"]])).replace(
            "results/<study>/runs/<cell_id>/adapter", str(Path(run_dir) / "adapter")
        )
        namespace: dict = {}
        exec(compile(code, "review.md", "exec"), namespace)  # noqa: S102 — the page's own snippet, as written
        expected = facts["training"]["reference_batch_loss"]
        assert namespace["record"]["reference"]["loss"] == expected
        off[spec["cell_id"]] = abs(namespace["loss"] - expected) / abs(expected)
    too_far = {c: r for c, r in off.items() if r > BOUND[c.split("_")[1]]}
    assert not too_far, too_far
    print("relative difference, largest:", max(off.values()), "over", len(off), "ok cells")

    # not vacuous: the same snippet with the KV cache left on misses the loss (packed position_ids ignored)
    spec, run_dir, facts = next(c for c in ok if c[0]["axes"]["precision"] == "fp32")
    without = snippet.replace("base.config.use_cache = False", "pass")
    assert without != snippet
    code = without.replace("results/<study>/models/<model>", str(models[spec["model"]["name"]])).replace(
        "results/<study>/runs/<cell_id>/adapter", str(Path(run_dir) / "adapter")
    )
    namespace = {}
    exec(compile(code, "review.md", "exec"), namespace)  # noqa: S102
    expected = facts["training"]["reference_batch_loss"]
    assert abs(namespace["loss"] - expected) / abs(expected) > 1e-5
