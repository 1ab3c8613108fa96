"""A headless browser that never ends its page is killed with every process it started, and a fresh one draws the
page (tunegrid.run.ui._browse)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import tunegrid.run.ui as ui


def test_a_hung_browser_is_killed_with_its_children_and_a_fresh_one_draws_the_page(tmp_path, monkeypatch):
    marker, pids = tmp_path / "tried", tmp_path / "pids"
    browser = tmp_path / "browser"
    # the first browser starts a child and hangs; the second writes its screenshot (--screenshot=<path>)
    browser.write_text(
        "#!/bin/bash\n"
        f"if [ ! -e {marker} ]; then touch {marker}; sleep 300 & echo $! >> {pids}; echo $$ >> {pids}; sleep 300; fi\n"
        'for arg in "$@"; do case "$arg" in --screenshot=*) echo png > "${arg#--screenshot=}";; esac; done\n'
    )
    browser.chmod(0o755)
    monkeypatch.setattr(ui, "chromium", lambda: str(browser))
    monkeypatch.setattr(ui, "BROWSER_TRY_MIN_S", 2.0)
    started = time.monotonic()
    out = ui.screenshot("http://127.0.0.1:1/", tmp_path / "page.png", timeout_s=6.0)
    assert out.read_text().strip() == "png" and time.monotonic() - started < 60
    for pid in (int(line) for line in pids.read_text().split()):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        assert Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", f"process {pid} outlived its browser"
