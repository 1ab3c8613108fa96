"""Library versions as a fix: a cell that failed, ran unsupported, or left MoE experts in full precision on one
library stack, beside its twin on another stack (every other axis equal) that ran ok. The fix is to pin that
stack's versions; it is offered only where the twin holds (review/quality.py: it learned and matched its
reference), with its cost against the failing cell measured in the same grid (peaks by stage, tokens/s): a
pin that closes the experts' quantization gap may still raise the load peak (4.x maps the checkpoint).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from tunegrid.review.advice import Fix, Recommendation, holds, number, parity_of, siblings, unproven_name
from tunegrid.review.moe_advice import EXPERT_GAP_SHARE
from tunegrid.units import human_bytes
from tunegrid.vocabulary import BASE_STACK, Outcome

PEAKS = (("load", "load_peak_bytes"), ("steady", "steady_peak_bytes"))  # by stage: a pin may move them apart


def _packages(row: Any) -> str:
    packages = row.get("stack_packages")
    return packages if isinstance(packages, str) and packages else "the environment tunegrid runs in"


def _concern(row: Any) -> str:
    """Why a cell needs another stack, or "" if it does not."""
    if row["outcome"] != Outcome.OK:
        return f"ended {row['outcome']} ({row['reason']})"
    share = number(row.get("flagged_share"))
    if share == share and share != float("inf") and share >= EXPERT_GAP_SHARE and number(row.get("expert_bytes")) > 0:
        return f"left {human_bytes(row['flagged_bytes'])} ({share:.0%} of its weights) in full precision"
    return ""


def _ratio(new: Any, old: Any) -> float | None:
    new, old = number(new), number(old)
    ok = all(v == v and v not in (float("inf"), 0.0) for v in (new, old))
    return new / old if ok else None


Pair = tuple[Any, Any, str]  # the cell of concern, its ok twin on another stack, why it is of concern


def stack_fixes(frame: Any) -> list[Recommendation]:
    """One recommendation per (model, failing stack, fixing stack)."""
    if "stack" not in frame.columns or frame["stack"].nunique() < 2:
        return []
    return [
        _recommendation(model, stack, fixing, members)
        for (model, stack, fixing), members in _stack_pairs(frame).items()
    ]


def _stack_pairs(frame: Any) -> dict[tuple[str, str, str], list[Pair]]:
    """Each cell of concern with each twin on another stack that ran ok without one, by (model, stack, fixing)."""
    groups: dict[tuple[str, str, str], list[Pair]] = defaultdict(list)
    for _, row in frame.iterrows():
        why = _concern(row)
        if not why:
            continue
        for _, twin in siblings(frame, row, "stack").iterrows():
            if twin["outcome"] != Outcome.OK or _concern(twin):
                continue
            gap_closed = number(twin.get("flagged_bytes")) < number(row.get("flagged_bytes"))
            if row["outcome"] == Outcome.OK and not gap_closed:
                continue  # the twin must fix what the finding is about: the weights left in full precision
            groups[(row["model"], row["stack"], twin["stack"])].append((row, twin, why))
    return groups


def _recommendation(model: str, stack: str, fixing: str, members: list[Pair]) -> Recommendation:
    proven = [twin for _, twin, _ in members if holds(twin)]
    unproven = sorted({unproven_name(twin) for _, twin, _ in members if not holds(twin)})
    lines = [f"{row['cell_id']} {why}; {twin['cell_id']} ran ok{_measured(row, twin)}" for row, twin, why in members]
    pin = _packages(members[0][1])
    text = f"On stack {stack} ({_packages(members[0][0])}) vs {fixing} ({pin}): " + "; ".join(lines) + "."
    if unproven:
        text += (
            " Twins that ran ok but are no evidence of a fix (a fix must learn and match the reference): "
            + ", ".join(unproven)
            + "."
        )
    fixes = [_pin_fix(members, fixing, pin, proven)] if proven else []
    failed = sorted(r["cell_id"] for r, _, _ in members if r["outcome"] != Outcome.OK)
    return Recommendation(
        signature=f"stack:{fixing}",
        title=f"{model}: library versions — stack {fixing} instead of {stack}",
        text=text,
        failing=failed,
        evidence=sorted(t["cell_id"] for t in proven),
        fixes=fixes,
        concerns=sorted({r["cell_id"] for r, _, _ in members}),
    )


def _measured(row: Any, twin: Any) -> str:
    """Both cells' peaks by stage and full-precision weights, where measured: " (...)", or nothing."""
    peaks = ", ".join(
        f"{stage} peak {human_bytes(row[column])} -> {human_bytes(twin[column])}"
        for stage, column in PEAKS
        if number(row.get(column)) != float("inf") and number(twin.get(column)) != float("inf")
    )
    before, after = number(row.get("flagged_bytes")), number(twin.get("flagged_bytes"))
    known = float("inf") not in (before, after)
    flagged = f", full-precision weights {human_bytes(before)} -> {human_bytes(after)}" if known else ""
    return f" ({peaks}{flagged})".replace("(, ", "(") if peaks or flagged else ""


def _pin_fix(members: list[Pair], fixing: str, pin: str, proven: list[Any]) -> Fix:
    """The fix: pin the twins' stack, priced against the first cell of concern by its first twin whose quality
    holds."""
    row, twin = members[0][0], next(t for _, t, _ in members if holds(t))
    cost = {
        "peak_bytes_ratio": _ratio(twin["peak_bytes"], row["peak_bytes"]),
        **{f"{column}_ratio": _ratio(twin.get(column), row.get(column)) for _, column in PEAKS},
        "tokens_per_s_ratio": _ratio(twin.get("tokens_per_s"), row.get("tokens_per_s")),
        "against": row["cell_id"],
    }
    measured = [(f"{stage} peak", cost[f"{column}_ratio"]) for stage, column in PEAKS]
    measured.append(("tokens/s", cost["tokens_per_s_ratio"]))
    shown = [f"{ratio:.2f}x the {what}" for what, ratio in measured if ratio is not None]
    # a failed cell's figures are no baseline: the ratios are kept in the cost, not said
    priced = f": {', '.join(shown)} of {row['cell_id']}" if shown and row["outcome"] == Outcome.OK else ""
    parities = [p for p in (parity_of(t) for t in proven) if p is not None]
    what = f"pin {pin}" if fixing != BASE_STACK else "use the environment tunegrid runs in"
    return Fix(
        {"stack": fixing},
        f"{what} (stack {fixing}){priced}",
        sorted(t["cell_id"] for t in proven),
        max(parities) if parities else None,
        cost,
    )


def stack_facts(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per library stack the cells ran on (none where every cell ran in the base environment)."""
    stacks: dict[str, dict[str, Any]] = {}
    for result in results.values():
        stack = (result.get("env") or {}).get("stack")
        if stack:
            stacks.setdefault(stack["name"], stack)
    facts = []
    for name, stack in sorted(stacks.items()):
        versions = stack.get("versions") or {}
        shown = ", ".join(
            f"{k} {v}" for k, v in versions.items() if k in ("torch", "transformers", "peft", "bitsandbytes")
        )
        pins = " ".join(
            f"{k}{v if v[:1] in '=!<>~' else '==' + v}" for k, v in sorted((stack.get("pins") or {}).items())
        )
        facts.append({"fact": f"stack {name}", "value": f"{shown} (pinned: {pins}; environment {stack.get('key')})"})
    return facts
