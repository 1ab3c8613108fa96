"""Where the doctor's second wave ends, after each try: `--first` at the first fix of the baseline that holds; the
default mode once a fix holds and no candidate left could rank above it in the grid's report, judged by what each
one's plan says before it runs (review.doctor_choice puts it in the choice): where the report ranks by the
candidates' own order (a collective timeout's smallest larger timeout), at once; on a named target by the step time
modelled there; on the machine itself by the most tokens/s each could reach (its tokens per step over its step's
floor, tunegrid.prepare.liveness.step_floor_s) against the fastest proven fix's measured tokens/s, less that fix's
noise where the report counts fixes within it as equally fast (review.precision_advice.equally_fast). A memory
candidate that adds settings to a fix that already holds is passed over, whatever its bound: the report ranks it
after that fix (review.memory_advice.least_change_first), so it cannot come first. So the fix the doctor names is
the one the grid ranks first, and a candidate with no bound is always run.

Light module: no torch (the doctor's rules run it between cells).
"""

from __future__ import annotations

from typing import Any

from tunegrid.review.doctor_choice import BY_MODEL, BY_ORDER
from tunegrid.review.memory_advice import adds_to


def _words(change: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in change.items())


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value == value and value > 0 else None


def stop(
    choice: dict[str, Any], fixes: list[dict[str, Any]], rows: dict[str, dict[str, Any]], ran: list[str], first: bool
) -> tuple[bool, list[str]]:
    """After a try: whether the second wave ends here, and why each candidate not run is not needed. `fixes` are the
    recommender's fixes of the baseline over the cells run so far (its order), `rows` those cells' summary rows.
    `first` ends at the first fix that holds. The default mode ends once a fix holds and no candidate left could
    rank above it, by what its plan says before it runs: where the report ranks by the candidates' order (the
    smallest larger collective timeout), at once; on a named target, when each one left is modelled slower there
    than the fix (an unmodelled fix ranks after every modelled one); on the machine itself, when the most tokens/s
    each one left could reach is below the fastest proven fix's measured tokens/s, less that fix's noise where the
    report counts fixes within it as equally fast (precision fixes: review.precision_advice.equally_fast), every
    ceiling raised where a cell run here beat its own (`_probe_shortfall`). A candidate with no such bound is run;
    one `passed_over` is not, and is said first."""
    left = [c for c in choice["candidates"] if c["cell_id"] not in ran]
    if not fixes:
        return False, []
    top = fixes[0]
    if first or not left:
        return True, [f"{_words(c['change'])}: not run (--first)" for c in left]
    passed = passed_over(choice, fixes, ran)
    left = [c for c in left if c["cell_id"] not in passed]
    done, why = _bounded_below(choice, top, fixes, rows, ran, left) if left else (True, [])
    return done, [*passed.values(), *why] if done else []


def passed_over(choice: dict[str, Any], fixes: list[dict[str, Any]], ran: list[str]) -> dict[str, str]:
    """The memory candidates not run that add settings to a fix that holds, by cell, each with why it is not run:
    the report ranks a fix after every fix it adds settings to (review.memory_advice.least_change_first), so none
    of them can come first, and each changes more of the recipe for a failure already ended. A try skips them
    (doctor_choice.tries)."""
    if choice.get("failure") != "oom":
        return {}
    out = {}
    for c in choice["candidates"]:
        under = next((f for f in fixes if adds_to(c["change"], f["change"])), None)
        if c["cell_id"] in ran or under is None:
            continue
        more = _words({k: v for k, v in c["change"].items() if k not in under["change"]})
        out[c["cell_id"]] = (
            f"{_words(c['change'])}: adds {more} to {_words(under['change'])} ({under['cell_id']}), which already "
            "holds: ranked after it"
        )
    return out


def _bounded_below(
    choice: dict[str, Any],
    top: dict[str, Any],
    fixes: list[dict[str, Any]],
    rows: dict[str, dict[str, Any]],
    ran: list[str],
    left: list[dict[str, Any]],
) -> tuple[bool, list[str]]:
    """Whether every candidate in `left` is bounded below the fix that ranks first, and each one's bound."""
    named = f"{_words(top['change'])} ({top['cell_id']})"
    why = []
    if choice.get("ranked_by") == BY_ORDER:
        return True, [f"{_words(c['change'])}: ranked after {named}, the smallest that holds" for c in left]
    mine = _number((rows.get(top["cell_id"]) or {}).get("modelled_step_s"))
    if choice.get("ranked_by") == BY_MODEL and mine is not None:
        for c in left:
            theirs = _number(c.get("modelled_step_s"))
            if theirs is not None and theirs <= mine:
                return False, []
            where = f"modelled {theirs * 1e3:.3g} ms/step" if theirs else "not modelled"
            why.append(f"{_words(c['change'])}: {where} on the target, above {named}'s {mine * 1e3:.3g} ms/step")
        return True, why
    # a fix that adds settings to another ranks after it however fast: the bar is the fastest of those that add to none
    least = [f for f in fixes if not any(adds_to(f["change"], g["change"]) for g in fixes)]
    measured = [(rows.get(f["cell_id"]) or {}, f) for f in least]
    measured = [(row, f) for row, f in measured if _number(row.get("tokens_per_s"))]
    if not measured:
        return False, []
    row, fastest = max(measured, key=lambda item: float(item[0]["tokens_per_s"]))
    noise = (_number(row.get("step_time_noise")) or 0.0) if choice.get("failure") == "nan" else 0.0
    bar = float(row["tokens_per_s"]) * (1 - noise)
    scale = _probe_shortfall(choice, rows, ran)
    raised = f", x{scale:.2f}: a cell here beat its own ceiling" if scale > 1 else ""
    alike: dict[tuple[float, str], list[str]] = {}  # candidates of one bound, said once
    for c in left:
        ceiling = _number(c.get("ceiling_tokens_per_s"))
        if ceiling is None or ceiling * scale >= bar:
            return False, []
        alike.setdefault((ceiling * scale, str(c.get("ceiling_basis"))), []).append(_words(c["change"]))
    margin = f" less its {noise:.0%} noise" if noise else ""
    for (ceiling, basis), names in alike.items():
        why.append(
            f"{'; '.join(names)}: at most {ceiling:.0f} tokens/s here ({basis}{raised}), below the "
            f"{float(row['tokens_per_s']):.0f} measured for {_words(fastest['change'])}{margin}"
        )
    return True, why


def _probe_shortfall(choice: dict[str, Any], rows: dict[str, dict[str, Any]], ran: list[str]) -> float:
    """How far the probe's rates fell short of what the cells run here reached: the largest ratio of a cell's
    measured tokens/s to its own ceiling, at least 1. A floor's weakest part is the probe's rate, measured in
    seconds on a host others may share; where a cell beat its own ceiling, every ceiling left is raised as much."""
    ratios = [1.0]
    for c in choice["candidates"]:
        measured = _number((rows.get(c["cell_id"]) or {}).get("tokens_per_s")) if c["cell_id"] in ran else None
        ceiling = _number(c.get("ceiling_tokens_per_s"))
        if measured is not None and ceiling is not None:
            ratios.append(measured / ceiling)
    return max(ratios)
