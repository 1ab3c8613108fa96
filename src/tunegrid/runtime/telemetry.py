"""No library tunegrid drives reports usage to its vendor unless the user asks for it.

MLflow 3 sends usage telemetry from every process that uses it (it stays quiet only where it detects CI), and
huggingface_hub can too. tunegrid's runs are often offline or on clusters whose firewall drops packets, where
the lookup of a telemetry host waits out the resolver's timeouts; and a study's own usage is not ours to
report. So every tunegrid process (the CLI's entry point, and the Snakemake invocation for all its jobs) sets
these off. A user's own setting of either variable wins.

Light module: standard library only (the Snakefile reads it).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

TELEMETRY_OFF = {"MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_DISABLE_TELEMETRY": "1"}


def telemetry_off(env: MutableMapping[str, str] | None = None) -> None:
    """Turn the libraries' telemetry off in `env` (this process's environment, which its children inherit),
    leaving any variable the user set as it is."""
    env = os.environ if env is None else env
    for name, value in TELEMETRY_OFF.items():
        env.setdefault(name, value)
