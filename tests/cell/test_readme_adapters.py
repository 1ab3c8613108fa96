"""The docs' adapter-reuse snippet (docs/guide/review.md), run as the page writes it, reproduces the reference loss of
every `ok` cell of the default study's grid (configs/config.yaml: both models, fp32/bf16/fp16/fp16-islands, both
batch sizes, none/nf4/nf4-experts, less the grid's exclusions), as README's main job trained it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

from tunegrid.cell.nonfinite import fp16_matmul
from tunegrid.runtime.files import read_json
from tunegrid.study.config import cell_spec, expand_cells, load_study, resolve_study

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
def default_study_run(default_study_clone):
    """The default study as README's main job ran it (conftest's one shared end-to-end run): its models and,
    per cell, the resolved spec, the run folder and result.json."""
    study_dir = default_study_clone / "results" / "default"
    study = resolve_study(load_study(REPO / "configs" / "config.yaml"))
    cells = []
    for cell_id in sorted(cell_spec(study, cell).to_json()["cell_id"] for cell in expand_cells(study)):
        run_dir = study_dir / "runs" / cell_id
        cells.append((read_json(study_dir / "specs" / f"{cell_id}.json"), run_dir, read_json(run_dir / "result.json")))
    models = {spec["model"]["name"]: study_dir / "models" / spec["model"]["name"] for spec, _, _ in cells}
    return models, cells


@pytest.mark.slow
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
        try:
            exec(compile(code, "review.md", "exec"), namespace)  # noqa: S102 — the page's own snippet, as written
        finally:
            fp16_matmul.uninstall()  # this process goes on with torch's own kernels
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
