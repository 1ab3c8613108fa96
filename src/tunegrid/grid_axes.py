"""The grid axes that stand for a study setting (activation checkpointing, the collective timeout, the rank
faults injected): their defaults taken from that setting, what one cell's spec holds for them, and the checks
of the debug section's fault injection against the grid.

Light module (the Snakefile reads it through tunegrid.config at parse time): standard library only.
"""

from __future__ import annotations

from typing import Any

# the debug section's rank faults, by the grid.fault value that selects each
RANK_FAULTS = {
    "slow-rank": "slow_rank",
    "stall-rank": "stall_rank",
    "skip-collective": "skip_collective",
    "kill-rank": "kill_rank",
}


# axis -> the study setting it stands for, as (section, key)
SETTING_AXES = {
    "activation_checkpointing": ("train", "gradient_checkpointing"),
    "collective_timeout_s": ("distributed", "collective_timeout_s"),
}


def fill_setting_axes(config: dict[str, Any]) -> None:
    """An axis the grid does not list takes its study setting's single value where the study sets it:
    train.gradient_checkpointing for activation_checkpointing, distributed.collective_timeout_s for
    collective_timeout_s (studies written before these axes existed keep their meaning). Runs on the raw
    config, before the schema fills defaults; what neither sets takes the axis's schema default."""
    grid = config.get("grid")
    if not isinstance(grid, dict):
        return  # the schema names what is wrong
    for axis, (section, key) in SETTING_AXES.items():
        setting = config.get(section)
        if axis not in grid and isinstance(setting, dict) and key in setting:
            grid[axis] = [setting[key]]


def cell_debug(debug: dict[str, Any], fault: str) -> dict[str, Any]:
    """The debug section one cell sees: all of it for fault `debug`; otherwise only the named rank fault
    (none for `none`), the others off (rank -1), so twins differ in that fault alone."""
    if fault == "debug":
        return debug
    kept = RANK_FAULTS.get(fault)
    return {k: (v if k == kept or k not in RANK_FAULTS.values() else {**v, "rank": -1}) for k, v in debug.items()}


def debug_problems(config: dict[str, Any]) -> list[str]:
    """Fault injections must name ranks, micro-batches and positions the grid has; a grid.fault value must
    name a fault the debug section sets."""
    debug, grid = config["debug"], config["grid"]
    worlds = grid["world_size"]
    problems = []
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
