import re

from tunegrid.track.records import flatten, metrics_from_records
from tunegrid.track.store import redact_uri, resolve_tracking_uri


def test_credentials_never_leave_the_uri():
    assert redact_uri("https://alice:s3cret@mlflow.example:5000/path") == "https://***@mlflow.example:5000/path"
    assert redact_uri("sqlite:////x/mlflow.db") == "sqlite:////x/mlflow.db"


def test_uri_precedence(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri() == f"sqlite:///{tmp_path.resolve()}/results/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert resolve_tracking_uri() == "http://127.0.0.1:5000"
    assert resolve_tracking_uri("sqlite:///a.db") == "sqlite:///a.db"


def test_metrics_keep_nonfinite_values():
    metrics = metrics_from_records([{"step": 3, "time": 1.0, "loss": float("nan"), "grad_norm": 2.0}])
    by_key = {m.key: m for m in metrics}
    assert by_key["loss"].step == 3 and by_key["loss"].value != by_key["loss"].value
    assert by_key["grad_norm"].value == 2.0


def test_flatten_nested_config():
    assert flatten("", {"a": {"b": 1, "c": [1, 2]}}, {}) == {"a.b": "1", "a.c": "[1, 2]"}


def test_every_metric_the_docs_name_reaches_mlflow():
    import re
    from pathlib import Path

    from tunegrid.outcome import METRIC_KEYS

    page = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "review.md").read_text()
    listed = page[page.index("Metrics have the same names in every cell") :]
    listed = listed[: listed.index(")")]
    named = set(re.findall(r"`([a-z0-9_]+)`", listed))
    differ = sorted(named ^ set(METRIC_KEYS))
    assert named == set(METRIC_KEYS), f"docs/guide/review.md names {differ} differently from METRIC_KEYS"


def test_metric_keys_are_the_step_record_fields():
    """A step's metrics.jsonl line is a StepMetrics: whatever it holds besides step and time is a metric key."""
    from tunegrid.outcome import METRIC_KEYS, StepMetrics

    values = {k: 1.0 for k in METRIC_KEYS}
    record = StepMetrics(step=0, time=0.0, **values).as_record()
    assert set(record) - {"step", "time"} == set(METRIC_KEYS)
    optional = StepMetrics(step=0, time=0.0, **{**values, "loss_scale": None}).as_record()
    assert "loss_scale" not in optional  # not measured in that step: not written, not sent


def test_pyproject_declares_every_third_party_package_the_package_imports():
    import ast
    import sys
    import tomllib
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    declared = {
        re.split(r"[<>=\[ ]", d)[0].lower().replace("-", "_")
        for d in tomllib.loads((repo / "pyproject.toml").read_text())["project"]["dependencies"]
    }
    aliases = {"yaml": "pyyaml", "PIL": "pillow"}
    imported = set()
    for path in (repo / "src" / "tunegrid").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "tunegrid"}
    missing = {m for m in third_party if aliases.get(m, m).lower().replace("-", "_") not in declared}
    assert not missing, f"imported but not in pyproject's dependencies: {sorted(missing)}"
