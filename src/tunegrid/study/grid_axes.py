"""The grid axes that stand for a study setting (activation checkpointing, the loss, the collective timeout, the
rank faults injected): at their neutral value the study's setting holds, what one cell's spec holds for them,
and the checks of the debug section's fault injection against the grid.

Light module (the Snakefile reads it through tunegrid.study.config at parse time): standard library only.
"""

from __future__ import annotations

from typing import Any

# the debug section's rank faults, by the grid.fault value that selects each
RANK_FAULTS = {
    "slow-rank": "slow_rank",
    "stall-rank": "stall_rank",
    "skip-collective": "skip_collective",
    "kill-rank": "kill_rank",
    "slow-link": "slow_link",  # the link of the node that holds the rank
}


# axis -> the study setting it stands for, as (section, key); the axis's neutral value defers to the setting
NEUTRAL = {"activation_checkpointing": False, "collective_timeout_s": 600, "loss": "full"}
SETTING_AXES = {
    "activation_checkpointing": ("train", "gradient_checkpointing"),
    "loss": ("train", "loss"),
    "collective_timeout_s": ("distributed", "collective_timeout_s"),
}


def setting_values(study: dict[str, Any], cell: Any) -> dict[str, Any]:
    """What a cell trains with for the axes that stand for a study setting: the axis where it leaves its
    neutral value, else the study's setting (studies written before these axes keep their meaning and ids)."""
    values = {}
    for axis, (section, key) in SETTING_AXES.items():
        own = getattr(cell, axis)
        values[axis] = own if own != NEUTRAL[axis] else study[section].get(key, NEUTRAL[axis])
    return values


def setting_problems(config: dict[str, Any]) -> list[str]:
    """A grid that lists an axis's neutral value beside others while the study's setting says otherwise
    would train its neutral cells at the setting, not at the value their id names."""
    problems = []
    for axis, (section, key) in SETTING_AXES.items():
        listed, setting = config["grid"][axis], config[section][key]
        if len(listed) > 1 and NEUTRAL[axis] in listed and setting != NEUTRAL[axis]:
            problems.append(
                f"config key 'grid.{axis}': lists {NEUTRAL[axis]!r} while {section}.{key} is {setting!r}; remove "
                f"{section}.{key} (the axis decides per cell) or list only the other values"
            )
    return problems


def cell_debug(debug: dict[str, Any], fault: str, repeat: int = 0) -> dict[str, Any]:
    """The debug section one cell sees: all of it for fault `debug`; otherwise only the named rank fault
    (none for `none`), the others off (rank -1), so twins differ in that fault alone. A `transient` non-finite
    injection happens in the cell's first run only: a repeat (grid.repeat > 0) sees none."""
    debug = {**debug, "inject_nonfinite": _injection_of_run(debug.get("inject_nonfinite") or {}, repeat)}
    if fault == "debug":
        return debug
    kept = RANK_FAULTS.get(fault)
    return {k: (v if k == kept or k not in RANK_FAULTS.values() else {**v, "rank": -1}) for k, v in debug.items()}


def _injection_of_run(injection: dict[str, Any], repeat: int) -> dict[str, Any]:
    """The injection one run makes (the `transient` flag is spent here, so specs without it are unchanged)."""
    transient = injection.get("transient", False)
    injection = {k: v for k, v in injection.items() if k != "transient"}
    if transient and repeat > 0:
        return {**injection, "module": "", "also": []}
    return injection


def injected_faults(debug: dict[str, Any]) -> list[str]:
    """The debug section's injections that are on for a cell (its own section, after `cell_debug`): a
    non-finite value into a module, and each rank fault that names a rank. Empty: the cell injects nothing."""
    names = []
    inject = debug.get("inject_nonfinite") or {}
    if inject.get("module") or inject.get("also"):
        names.append("inject_nonfinite")
    names += [key for key in RANK_FAULTS.values() if (debug.get(key) or {}).get("rank", -1) >= 0]
    return names


def debug_problems(config: dict[str, Any]) -> list[str]:
    """Fault injections must name ranks, micro-batches and positions the grid has; a grid.fault value must
    name a fault the debug section sets."""
    debug, grid = config["debug"], config["grid"]
    worlds = grid["world_size"]
    problems = setting_problems(config)
    for key in RANK_FAULTS.values():
        rank = debug[key]["rank"]
        if rank >= 0 and rank >= max(worlds):
            problems.append(
                f"config key 'debug.{key}.rank': {rank} does not exist; grid.world_size is at most {max(worlds)} "
                f"(ranks 0..{max(worlds) - 1})"
            )
    for fault in grid["fault"]:
        key = RANK_FAULTS.get(fault)
        if key and debug[key]["rank"] < 0:
            problems.append(
                f"config key 'grid.fault': {fault!r} injects debug.{key}, which sets no rank; set "
                f"debug.{key}.rank (and its step/seconds)"
            )
    problems += [
        f"config key 'grid.nodes': {nodes} nodes do not divide grid.world_size {world} (ranks per node); "
        "exclude the pair (grid.exclude) or choose a world size that is a multiple"
        for nodes in grid.get("nodes", [1])
        for world in worlds
        if world % nodes and not _excluded(grid, world_size=world, nodes=nodes)
    ]
    injection, accums = debug["inject_nonfinite"], grid["grad_accum"]
    if injection.get("rank", 0) >= max(worlds):
        problems.append(
            f"config key 'debug.inject_nonfinite.rank': {injection['rank']} does not exist; grid.world_size is at "
            f"most {max(worlds)} (ranks 0..{max(worlds) - 1})"
        )
    for index, request in enumerate([injection, *injection.get("also", [])]):
        micro = request.get("micro_batch", 0)
        if request.get("module") and micro >= max(accums):
            key = "debug.inject_nonfinite" + (f".also.{index - 1}" if index else "")
            problems.append(
                f"config key '{key}.micro_batch': {micro} does not exist; grid.grad_accum is at most {max(accums)} "
                f"(micro-batches 0..{max(accums) - 1})"
            )
        problems += _position_problems(request.get("position"), index, config)
    return problems


def _position_problems(position: dict[str, int] | None, index: int, config: dict[str, Any]) -> list[str]:
    """An injection's (row, token) must lie inside every cell's micro-batch."""
    if not position:
        return []
    key = "debug.inject_nonfinite" + (f".also.{index - 1}" if index else "") + ".position"
    rows, seq_len = min(config["grid"]["batch_size"]), config["train"]["seq_len"]
    problems = []
    if position["row"] >= rows:
        problems.append(
            f"config key '{key}.row': {position['row']} does not exist; the smallest grid.batch_size is {rows} "
            f"(rows 0..{rows - 1})"
        )
    if position["token"] >= seq_len:
        problems.append(
            f"config key '{key}.token': {position['token']} does not exist; train.seq_len is {seq_len} "
            f"(tokens 0..{seq_len - 1})"
        )
    return problems


def _excluded(grid: dict[str, Any], **values: Any) -> bool:
    """Whether the grid's `exclude` list drops every cell with these axis values."""
    return any(
        set(rule) <= set(values) and all(values[k] == v for k, v in rule.items()) for rule in grid.get("exclude", [])
    )
