"""MLflow's own server over a study's store, and headless Chromium to look at it (tests, docs).

The server binds to 127.0.0.1 unless told otherwise. Chromium needs a virtual-time budget: without it
the screenshot is MLflow's blank loading page.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--hide-scrollbars",
)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# MLflow's server also starts a job runner (huey consumers, for its GenAI evaluation jobs and periodic tasks): ~7
# processes and ~7 CPU-s a start on a 2-core host, and ~2 s later to answer, for runs and metrics that need none of it
JOBS_OFF = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def server_env() -> dict[str, str]:
    """The server's environment: this process's, with MLflow's job runner off unless the user set it."""
    return {**JOBS_OFF, **os.environ}


@contextmanager
def mlflow_server(
    store_uri: str,
    host: str = "127.0.0.1",
    port: int | None = None,
    timeout_s: float = 60.0,
    allowed_hosts: str = "",
    log_path: Path | None = None,
) -> Iterator[str]:
    """`mlflow server --workers 1` on the store; yields its base URL; stops it (and its workers) after.

    The server runs in a session of its own (a terminal's Ctrl-C reaches only its owner, which stops it
    cleanly) and dies with its owner if the owner is killed."""
    from tunegrid.runtime.lifeline import die_with_parent

    port = port or free_port(host)
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    log = open(log_path, "w+b") if log_path else tempfile.TemporaryFile()  # noqa: SIM115 — closed below
    command = [
        mlflow,
        "server",
        "--backend-store-uri",
        store_uri,
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    if allowed_hosts:
        command += ["--allowed-hosts", allowed_hosts]
    if store_uri.startswith("sqlite:///"):
        # runs made through the server (an experiment without an artifact location of its own) keep their artifacts
        # beside the store: MLflow's default is ./mlartifacts under whatever folder the server was started in
        store = Path(store_uri.removeprefix("sqlite:///"))
        command += ["--artifacts-destination", str(store.parent.resolve() / "mlartifacts")]
    proc = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent,
        env=server_env(),
    )
    url = f"http://{host}:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                log.seek(0)
                raise RuntimeError(f"mlflow server did not start on {url}:\n{log.read().decode()[-2000:]}")
            time.sleep(0.3)
        _SERVERS[url] = proc
        yield url
    finally:
        import os
        import signal

        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _SERVERS.pop(url, None)
        log.close()


_SERVERS: dict[str, subprocess.Popen[bytes]] = {}


def server_running(url: str) -> bool:
    proc = _SERVERS.get(url)
    return proc is not None and proc.poll() is None


UI_STATE_FILE = "mlflow_ui.json"  # beside the UI's log: whose UI it is (the invocation), its pid, and its state


def _write_ui_state(path: Path | None, state: str) -> None:
    from tunegrid.runtime.files import write_json
    from tunegrid.track.execution import current_execution_id

    if path is not None:
        write_json(path, {"execution_id": current_execution_id(), "pid": os.getpid(), "state": state})


def _read_ui_state(logs: str | Path) -> dict:
    """This invocation's UI state ({} when the file names another invocation's UI, or there is none)."""
    from tunegrid.track.execution import current_execution_id

    try:
        state = json.loads((Path(logs) / UI_STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if state.get("execution_id") and state["execution_id"] == current_execution_id() else {}


def forward_sigterm_to_ui(logs: str) -> None:
    """For Snakemake's own process (its onstart hook): a SIGTERM to Snakemake alone makes it wait for its running
    jobs, and the UI job would serve on; so the signal is passed on to this invocation's UI first, which stops."""
    previous = signal.getsignal(signal.SIGTERM)

    def forward(signum: int, frame: object) -> None:
        state = _read_ui_state(logs)
        if state.get("state") == "serving":
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(state["pid"]), signal.SIGTERM)
        if callable(previous):
            previous(signum, frame)

    with contextlib.suppress(ValueError):  # not the main thread: nothing to forward from
        signal.signal(signal.SIGTERM, forward)


def ui_stopped_on_request(logs: str | Path) -> bool:
    """Whether this invocation served the UI and a Ctrl-C or SIGTERM ended it (Snakemake, signalled too, then
    counts its run as failed: the hook ends it cleanly instead). A server that exited on its own is not."""
    return _read_ui_state(logs).get("state") in ("serving", "stopped")


def serve_until_stopped(
    store_uri: str,
    host: str,
    port: int,
    allowed_hosts: str = "",
    log_path: Path | None = None,
    experiment_id: str = "",
) -> int:
    """`snakemake mlflow_ui`: serve until Ctrl-C or SIGTERM, then stop the server and return 0. It prints
    the study's runs page (its view of the current cell runs: tunegrid.track.view), not MLflow's home page."""
    import threading

    from tunegrid.track.view import runs_view

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    state_path = log_path.parent / UI_STATE_FILE if log_path else None
    with mlflow_server(store_uri, host, port, timeout_s=120, allowed_hosts=allowed_hosts, log_path=log_path) as url:
        page = runs_view(url, experiment_id) if experiment_id else url
        _write_ui_state(state_path, "serving")  # before the address: a signal on seeing it finds the UI to stop
        print(f"MLflow UI: {page} (the study's runs; Ctrl-C stops it)", flush=True)
        while not stop.wait(1.0):
            if not server_running(url):
                _write_ui_state(state_path, "failed")
                print(f"mlflow server exited on its own; see {log_path or 'its output'}", flush=True)
                return 1
    _write_ui_state(state_path, "stopped")
    print("MLflow UI stopped", flush=True)
    return 0


def rest(url: str, endpoint: str, payload: dict | None = None, method: str = "POST") -> dict:
    """One call of MLflow's REST API (api/2.0/mlflow/...)."""
    data = json.dumps(payload or {}).encode() if method == "POST" else None
    request = urllib.request.Request(
        f"{url}/api/2.0/mlflow/{endpoint}", data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def runs_page(url: str, experiment_id: str, search_filter: str = "") -> str:
    """The experiment's runs page, optionally with a filter typed in its search box (MLflow keeps it in the URL)."""
    page = f"{url}/#/experiments/{experiment_id}/runs"
    return f"{page}?searchFilter={quote(search_filter)}" if search_filter else page


def compare_page(url: str, experiment_id: str, run_ids: list[str]) -> str:
    runs = quote(json.dumps(run_ids, separators=(",", ":")))
    return f"{url}/#/compare-runs?runs={runs}&experiments={quote(json.dumps([experiment_id]))}"


BROWSER_TRIES = 3
BROWSER_TRY_MIN_S = 60.0  # a hang guard: a loaded host draws MLflow's pages slowly, never this slowly


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _browse(url: str, extra: list[str], budget_ms: int, timeout_s: float) -> subprocess.CompletedProcess[str]:
    binary = chromium()
    if binary is None:
        raise RuntimeError("no chromium on PATH: install Debian's `chromium` (apt-get install chromium)")
    # Headless Chromium now and then never ends a page whose virtual time budget is spent (seen on MLflow's runs
    # page on a loaded host: 10 minutes, then killed, where a fresh browser draws it in seconds). So the budget
    # is split over BROWSER_TRIES fresh browsers (a minute each at least), each killed with every process it started
    # when its share ends.
    for attempt in range(1, BROWSER_TRIES + 1):
        with tempfile.TemporaryDirectory() as profile:
            command = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}"]
            browser = subprocess.Popen(
                [*command, *extra, url],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            try:
                stdout, stderr = browser.communicate(timeout=max(timeout_s / BROWSER_TRIES, BROWSER_TRY_MIN_S))
                return subprocess.CompletedProcess(browser.args, browser.returncode, stdout, stderr)
            except subprocess.TimeoutExpired:
                os.killpg(browser.pid, signal.SIGKILL)  # the browser and its renderer, GPU and zygote processes
                browser.communicate()
                if attempt == BROWSER_TRIES:
                    raise
    raise AssertionError("unreachable")


def dump_dom(url: str, budget_ms: int = 10000, timeout_s: float = 120.0, size: tuple[int, int] = (1600, 1000)) -> str:
    """The page's DOM after its scripts ran, in a window of `size` (a virtualised table renders only the
    rows that fit: what a user sees on the first screen)."""
    return _browse(url, ["--dump-dom", f"--window-size={size[0]},{size[1]}"], budget_ms, timeout_s).stdout


def screenshot(
    url: str, out: Path, size: tuple[int, int] = (1600, 1000), budget_ms: int = 10000, timeout_s: float = 120.0
) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = _browse(url, [f"--screenshot={out.resolve()}", f"--window-size={size[0]},{size[1]}"], budget_ms, timeout_s)
    if not out.exists():
        raise RuntimeError(f"chromium wrote no screenshot of {url}: {proc.stderr[-1000:]}")
    return out
