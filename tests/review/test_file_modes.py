"""Results are written with the user's umask, so a team member can open a report on a shared machine."""

from __future__ import annotations

import os
import stat

import pytest

from tunegrid.files import atomic_write_text, write_json, write_text_if_changed


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_writes_take_the_users_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_json(tmp_path / "result.json", {"outcome": "ok"})
        atomic_write_text(tmp_path / "report" / "index.html", "<html></html>")
        write_text_if_changed(tmp_path / "summary.csv", "cell_id\n")
    finally:
        os.umask(old)
    for name in ("result.json", "report/index.html", "summary.csv"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name
    assert sorted(p.name for p in tmp_path.rglob(".*.tmp")) == []  # no temp file left behind
