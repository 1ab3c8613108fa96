from tunegrid.tracking import flatten, metrics_from_records, redact_uri, resolve_tracking_uri


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
