"""Safe loading, secrets, paths and bad input: each refusal is a clear ConfigError/CheckpointError."""

from __future__ import annotations

import copy
import importlib.metadata
import os
import re
import shutil
import time

import pytest
import torch
from conftest import REPO, make_study
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from tunegrid.manifest import verify_checkpoint
from tunegrid.prepare.checkpoints import CheckpointError, link_local
from tunegrid.study.config import ConfigError, resolve_study

CANARY_TOKEN = "hf_CANARYcanaryCANARYcanary0123456789"


# ---------------------------------------------------------------- pickle and remote code


class _Exploit:
    """A pickle that would run a command on load (what weights_only=True exists to refuse)."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/tunegrid-pwned",))


def _pickled_checkpoint(tmp_path, payload):
    src = tmp_path / "pickled"
    src.mkdir()
    (src / "config.json").write_text("{}")
    torch.save(payload, src / "pytorch_model.bin")
    return src


def test_pickle_weights_refused_by_default(tmp_path):
    src = _pickled_checkpoint(tmp_path, {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"allow_pickle: true.*weights_only=True"):
        link_local({"path": str(src)}, tmp_path / "out")


def test_pickle_opt_in_converts_plain_tensors_to_safetensors(tmp_path):
    src = _pickled_checkpoint(tmp_path, {"w": torch.arange(4.0), "b": torch.zeros(2)})
    link_local({"path": str(src), "allow_pickle": True}, tmp_path / "out")
    converted = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(converted["w"], torch.arange(4.0))
    assert not (tmp_path / "out" / "pytorch_model.bin").exists()
    verify_checkpoint(tmp_path / "out", hashes=True)


def test_pickle_opt_in_still_refuses_code(tmp_path):
    if os.path.exists("/tmp/tunegrid-pwned"):
        os.remove("/tmp/tunegrid-pwned")
    src = _pickled_checkpoint(tmp_path, {"w": _Exploit()})
    with pytest.raises(CheckpointError, match="refused by torch.load"):
        link_local({"path": str(src), "allow_pickle": True}, tmp_path / "out")
    assert not os.path.exists("/tmp/tunegrid-pwned")


@pytest.mark.parametrize(
    "model",
    [
        {"source": "synthetic", "trust_remote_code": True},
        {"source": "hub", "repo_id": "org/model", "revision": "a" * 40, "trust_remote_code": True, "path": ""},
    ],
)
def test_trust_remote_code_needs_a_pinned_hub_revision(model):
    raw = make_study()
    raw["models"]["m"] = model
    if model["source"] == "synthetic":
        with pytest.raises(ConfigError, match=r"models.m.trust_remote_code.*pinned"):
            resolve_study(raw)
    else:
        assert resolve_study(raw)["models"]["m"]["trust_remote_code"] is True


def test_trust_remote_code_is_off_by_default():
    assert resolve_study(make_study())["models"]["gemma3-hot"]["trust_remote_code"] is False


# ---------------------------------------------------------------- secrets in the config


@pytest.mark.parametrize(
    ("mutate", "key"),
    [
        (lambda s: s["models"]["gemma3-hot"]["config"].update(note=CANARY_TOKEN), "models.gemma3-hot.config.note"),
        (lambda s: s["models"]["gemma3-hot"]["config"].update(api_token="abc"), "models.gemma3-hot.config.api_token"),
        (lambda s: s.update(tracking={"tracking_uri": "http://user:CANARYpw@127.0.0.1:5000"}), "tracking.tracking_uri"),
        (lambda s: s.update(tracking={"experiment": CANARY_TOKEN}), "tracking.experiment"),
    ],
)
def test_secret_in_config_is_refused_without_echoing_it(mutate, key):
    raw = make_study()
    mutate(raw)
    with pytest.raises(ConfigError) as info:
        resolve_study(raw)
    message = str(info.value)
    assert f"config key '{key}'" in message and "environment" in message
    assert "CANARY" not in message


# ---------------------------------------------------------------- paths cannot escape results/


@pytest.mark.parametrize("name", ["..", "../x", "/abs", "a/b", "s3://bucket", "file:x", ".hidden", "a b", ""])
def test_names_that_become_paths_cannot_escape(name):
    for mutate in (lambda s: s.update(study=name), lambda s: s["models"].update({name: {"source": "synthetic"}})):
        raw = make_study()
        mutate(raw)
        with pytest.raises(ConfigError):
            resolve_study(raw)


def test_mlflow_ui_binds_loopback_unless_allowed_hosts_are_set():
    assert resolve_study(make_study())["tracking"]["ui_host"] == "127.0.0.1"
    with pytest.raises(ConfigError, match="ui_allowed_hosts"):
        resolve_study(make_study(tracking={"ui_host": "0.0.0.0"}))
    assert resolve_study(make_study(tracking={"ui_host": "0.0.0.0", "ui_allowed_hosts": "mlflow.lab.example"}))


# ---------------------------------------------------------------- property-based bad input


def _alias_bomb(levels: int = 8) -> list:
    """What YAML aliases load as: one list shared ten times per level (10^8 values once expanded)."""
    node: list = ["x"] * 10
    for _ in range(levels):
        node = [node] * 10
    return node


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.lists(st.integers(-2, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.just("x" * 20_000),
    st.just(_alias_bomb()),
    st.sampled_from(["not_a_model", "llama", "qwen3_moe"]),
)
PATHS = [
    ("study",),
    ("grid",),
    ("grid", "model"),
    ("grid", "precision"),
    ("grid", "batch_size"),
    ("grid", "quant"),
    ("grid", "world_size"),
    ("train",),
    ("train", "steps"),
    ("train", "lr"),
    ("train", "on_nonfinite"),
    ("lora", "r"),
    ("lora", "target_modules"),
    ("models",),
    ("models", "gemma3-hot"),
    ("models", "gemma3-hot", "source"),
    ("hardware", "target"),
    ("debug", "stall_rank"),
    ("tracking", "ui_port"),
    ("distributed", "collective_timeout_s"),
    ("models", "gemma3-hot", "architecture"),
    ("data", "path"),
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), value=JUNK, extra_key=st.booleans())
def test_any_mangled_config_is_valid_or_one_clear_config_error(path, value, extra_key):
    started = time.monotonic()
    raw = make_study()
    node = raw
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = copy.deepcopy(value)
    if extra_key:
        raw["not_a_key"] = 1
    try:
        resolve_study(raw)
    except ConfigError as exc:
        message = str(exc)
        assert message.startswith("invalid study config:")
        assert re.search(r"config key '[^']*'", message), message  # every problem names its key
        assert "Traceback" not in message
    assert time.monotonic() - started < 5  # hostile values (alias bombs, huge strings) never hang validation
    # anything else (KeyError, TypeError ...) fails the test: a traceback would reach the user


# ---------------------------------------------------------------- versions with the fixes we rely on


def test_installed_versions_meet_the_security_minimums():
    def major_minor(name):
        return tuple(int(x) for x in re.findall(r"\d+", importlib.metadata.version(name))[:2])

    assert major_minor("torch") >= (2, 10), "torch >= 2.10: weights_only unpickler hardening"
    assert major_minor("mlflow") >= (3, 11), "mlflow >= 3.11"
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"torch>=2.10"' in pyproject and '"mlflow>=3.11"' in pyproject


def test_no_pickle_loader_in_the_package():
    """torch.load appears only in the opt-in converter and the resume checkpoint, always with weights_only=True."""
    sources = {p.name: p.read_text() for p in (REPO / "src" / "tunegrid").rglob("*.py")}
    calls = [
        (name, line)
        for name, text in sources.items()
        for line in text.splitlines()
        if "torch.load(" in line and "def " not in line
    ]
    assert calls and all("weights_only=True" in line for _, line in calls), calls


# ---------------------------------------------------------------- hub without network, broken checkpoints


def test_hub_model_while_offline_fails_before_any_job(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    raw = make_study()
    raw["models"]["real"] = {"source": "hub", "repo_id": "google/gemma-3-4b-it", "revision": "b" * 40}
    with pytest.raises(ConfigError, match=r"models.real.source.*HF_HUB_OFFLINE.*source: local"):
        resolve_study(raw)


def test_hub_download_without_network_is_one_sentence(monkeypatch, tmp_path):
    """The checkpoint rule's own error when the hub is unreachable (no hub exists here: nothing is mocked,
    the real client fails offline)."""
    from tunegrid.prepare.checkpoints import download_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError) as info:
        download_hub({"repo_id": "google/gemma-3-4b-it", "revision": "c" * 40}, tmp_path / "m")
    message = str(info.value)
    assert "google/gemma-3-4b-it" in message and "source: local" in message and "\n" not in message


def test_missing_weight_file_is_caught(checkpoints, tmp_path):
    copy_dir = tmp_path / "copy"
    shutil.copytree(checkpoints["gemma3-hot"], copy_dir)
    for weights in copy_dir.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        verify_checkpoint(copy_dir, hashes=True)
