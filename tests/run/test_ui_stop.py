"""Stopping `snakemake mlflow_ui`: a SIGTERM to Snakemake alone reaches the UI job, and a UI stopped on request
ends the invocation cleanly, where a UI whose server died does not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from tunegrid.run.ui import UI_STATE_FILE, forward_sigterm_to_ui, ui_stopped_on_request
from tunegrid.track.execution import EXECUTION_ENV


def _state(logs, execution_id, pid, state):
    (logs / UI_STATE_FILE).write_text(json.dumps({"execution_id": execution_id, "pid": pid, "state": state}))


def test_a_sigterm_to_snakemake_reaches_this_invocations_ui(tmp_path, monkeypatch):
    monkeypatch.setenv(EXECUTION_ENV, "20260101T000000-1")
    ui = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda *_: seen.append("snakemake's own handler"))
    try:
        _state(tmp_path, "20260101T000000-1", ui.pid, "serving")
        forward_sigterm_to_ui(str(tmp_path))
        os.kill(os.getpid(), signal.SIGTERM)
        assert ui.wait(timeout=10) == -signal.SIGTERM and seen == ["snakemake's own handler"]
    finally:
        signal.signal(signal.SIGTERM, previous)
        if ui.poll() is None:
            ui.kill()


def test_only_this_invocations_ui_stopped_on_request_ends_it_cleanly(tmp_path, monkeypatch):
    monkeypatch.setenv(EXECUTION_ENV, "20260101T000000-1")
    assert not ui_stopped_on_request(tmp_path)  # no UI served
    _state(tmp_path, "20260101T000000-1", 1, "stopped")
    assert ui_stopped_on_request(tmp_path)
    _state(tmp_path, "20260101T000000-1", 1, "failed")  # its server exited on its own: a failure
    assert not ui_stopped_on_request(tmp_path)
    _state(tmp_path, "20250101T000000-9", 1, "stopped")  # another invocation's UI
    assert not ui_stopped_on_request(tmp_path)
