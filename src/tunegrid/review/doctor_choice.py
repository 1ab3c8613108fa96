"""The doctor's decisions between its waves, each from files: was the failure reproduced, and is it
deterministic (the same step and origin in a same-seed re-run) or transient; then which cells the second wave
holds, chosen from the diagnosis through the tables (never by name): a non-finite failure gets the precisions
of tunegrid.meanings.PRECISION_ROWS that the target can run natively (or that keep the failing arithmetic, as
fp16's own fixes do), in their `nan_fix_rank` order, or on a named target that is not the machine cheapest
first by the step time modelled on it from each twin's plan (tunegrid.targets.modelled_step); an out-of-memory
one the memory settings the grid lists, fewest settings and cheapest by their plans first, less those the estimate
says will still not fit; a collective timeout its class's fixes (tunegrid.review.timeout_advice). Each candidate
comes with the reference twin its loss parity is judged against (review.reference), where that is another cell.

Every candidate also carries what its plan says of its rank before it runs, in the terms the recommender ranks
fixes by: on a named target its modelled step time; on the machine itself the most tokens/s it could reach, its
tokens per step over its step's floor (tunegrid.prepare.liveness.step_floor_s: the matmul FLOPs it cannot skip
at the probe's rate for the arithmetic its products run in). The doctor runs them one try at a time, and
review.doctor_stop ends the second wave once a fix holds and no candidate left could rank above it in the report.

Light module: no torch (the doctor's rules run it between cells).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunegrid.meanings import PRECISION_ROWS, QUANT_ROWS, precision_row
from tunegrid.review.precision_advice import support_of
from tunegrid.review.summary import summary_row
from tunegrid.runtime.files import read_json, read_jsonl
from tunegrid.study.config import Cell, cells_by_id
from tunegrid.vocabulary import Outcome, axis_names

REPEAT = 1  # the same-seed re-run of a failing baseline is its repeat 1
MEMORY_AXES = ("quant", "optimizer", "activation_checkpointing", "loss", "batch_size", "grad_accum")
DETERMINISTIC, TRANSIENT, NOT_REPRODUCED = "deterministic", "transient", "not reproduced"
# a memory candidate whose plan charges its budget this many times over is not run: the margin the shipped
# out-of-memory study keeps its failing cells beyond (tests/workflow/test_memory_fixes_oom.py), wider than the
# estimate's error measured there, so a candidate that far over fails as surely as the baseline did
CLEAR_MISS = 1.2


def repeat_of(cell: Any) -> Any:
    return dataclasses.replace(cell, repeat=REPEAT)


def doctor_cells(study: dict[str, Any]) -> dict[str, Any]:
    """The cells the doctor may run beyond the grid: the repeat of every cell of it (only a failing baseline's
    is ever asked for)."""
    return {repeat_of(c).cell_id: repeat_of(c) for c in cells_by_id(study).values() if c.repeat == 0}


def signature(row: dict[str, Any]) -> dict[str, Any]:
    """What a failure is, for comparing two runs of one cell: its step and its origin. An out-of-memory
    failure's step is its stage (where the allocator gives up within a stage moves with the host's own use)."""
    outcome = row["outcome"]
    if outcome == Outcome.NAN:
        return {
            "outcome": outcome,
            "step": row["nan_step"],
            "origin": row["nan_forward_module"] or row["nan_backward_module"],
            "kind": row["nan_kind"],
        }
    if outcome in (Outcome.OOM, Outcome.PREDICTED_OOM):
        return {"outcome": outcome, "step": row["oom_stage"], "origin": "allocation"}
    if outcome == Outcome.TIMEOUT:
        return {
            "outcome": outcome,
            "step": row["collective_step"],
            "origin": f"rank {row['collective_missing_ranks']}"
            if row["collective_missing_ranks"]
            else row["collective_op"],
            "kind": row["collective_diagnosis"],
        }
    return {"outcome": outcome, "step": row["steps_run"], "origin": row["reason"]}


def _clean(value: Any) -> Any:
    return None if value is None or value != value else value


def result_row(path: str | Path) -> dict[str, Any]:
    return {k: _clean(v) for k, v in summary_row(read_json(path)).items()}


def tokens_run(run_dir: Path) -> int:
    """The real tokens a cell trained on, from its metrics.jsonl (tokens/s x step time per step)."""
    metrics = run_dir / "metrics.jsonl"
    lines = read_jsonl(metrics) if metrics.is_file() else []
    return int(sum(line.get("tokens_per_s", 0) * line.get("step_time_s", 0) for line in lines))


def reproduction(baseline: dict[str, Any], repeat: dict[str, Any] | None) -> dict[str, Any]:
    """The first wave's answer: not reproduced (the baseline ran ok), deterministic, or transient."""
    if baseline["outcome"] == Outcome.OK:
        return {"verdict": NOT_REPRODUCED, "baseline": signature(baseline)}
    first = signature(baseline)
    if repeat is None:
        return {"verdict": "pending", "baseline": first}
    again = signature(repeat)
    same = all(first.get(k) == again.get(k) for k in ("outcome", "step", "origin"))
    return {"verdict": DETERMINISTIC if same else TRANSIENT, "baseline": first, "repeat": again}


@dataclass
class Candidate:
    change: dict[str, Any]  # axis -> value, against the baseline
    cell_id: str
    reference: str | None  # the reference twin its parity needs, where another cell
    why: str
    # from its plan, before it runs: its step time modelled on a named target, and the most tokens/s it could reach
    # here (its tokens per step over its step's floor), with how that floor was found
    modelled_step_s: float | None = None
    ceiling_tokens_per_s: float | None = None
    ceiling_basis: str = ""


# how the recommender ranks a failure's fixes, which says when the candidates left cannot come first
BY_MODEL, BY_THROUGHPUT, BY_ORDER = "modelled step on the target", "measured throughput", "the candidates' order"


@dataclass
class Choice:
    """The second wave: the candidates in the order they are tried, and what was left out and why."""

    failure: str
    candidates: list[Candidate] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    ranked_by: str = BY_ORDER

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _twin(cells: dict[str, Any], baseline: Any, change: dict[str, Any]) -> Any | None:
    wanted = Cell(**{**baseline.axes(), **change})
    return cells.get(wanted.cell_id)


def _reference(study: dict[str, Any], cells: dict[str, Any], cell: Any, baseline: Any) -> str | None:
    reference = _twin(cells, cell, dict(study["review"]["reference"]))
    if reference is None or reference.cell_id in (cell.cell_id, baseline.cell_id):
        return None
    return reference.cell_id


def _precision_candidates(
    study: dict[str, Any],
    cells: dict[str, Any],
    baseline: Any,
    row: dict[str, Any],
    capabilities: dict[str, Any],
    plans: dict[str, dict[str, Any]],
) -> Choice:
    failing = precision_row(baseline.precision)
    target = row.get("target") or study["hardware"]["target"]
    choice = Choice("nan", ranked_by=BY_THROUGHPUT if target in (None, "native") else BY_MODEL)
    modelled = {cell: plan.get("modelled_step_s") for cell, plan in plans.items() if plan.get("modelled_step_s")}
    for precision in sorted(PRECISION_ROWS, key=lambda p: PRECISION_ROWS[p].nan_fix_rank):
        meaning = PRECISION_ROWS[precision]
        if precision == baseline.precision or (meaning.fp32_islands and meaning.arithmetic != failing.arithmetic):
            continue
        support = support_of(precision, target, capabilities)
        if support != "native" and not (support == "emulated" and meaning.arithmetic == failing.arithmetic):
            choice.skipped.append(f"precision {precision}: {support} {meaning.arithmetic} on {target}")
            continue
        twin = _twin(cells, baseline, {"precision": str(precision)})
        if twin is None:
            choice.skipped.append(f"precision {precision}: not in the study's grid.precision")
            continue
        step = modelled.get(twin.cell_id)
        why = f"{meaning.reason}; {step * 1e3:.3g} ms/step modelled on {target}" if step else meaning.reason
        reference = _reference(study, cells, twin, baseline)
        choice.candidates.append(
            _bounded(Candidate({"precision": str(precision)}, twin.cell_id, reference, why), plans)
        )
    # stable: the precision rows' order among equals, and after those modelled (fp32 islands count as fp16 here: which
    # modules become islands is measured when the cell starts)
    choice.candidates.sort(key=lambda c: modelled.get(c.cell_id) or float("inf"))
    return choice


def _memory_candidates(
    study: dict[str, Any], cells: dict[str, Any], baseline: Any, plans: dict[str, dict[str, Any]]
) -> Choice:
    """Every grid cell equal to the baseline but in memory settings (the same effective batch), less those the
    estimate predicts still will not fit: the plan's own verdict where the study skips predicted failures
    (`hardware.predicted_oom: skip`), a setting whose plan charges its budget `CLEAR_MISS` times over or more
    (`_clear_miss`), and a setting the estimate says saves nothing against the baseline, which did not fit. Nearer
    the budget the estimate does not decide: the baseline's own failure is the measurement. Ordered one setting at
    a time first (the least change to the recipe; a smaller micro-batch with the accumulation that keeps the
    effective batch is one setting), and among as many settings by what each plan bounds its cost at, cheapest
    first (`_cost_order`: the report ranks fixes by throughput, so `--first` stops at the likeliest first one),
    then by the predicted saving, largest first (the likeliest to fit)."""
    choice = Choice("oom", ranked_by=BY_THROUGHPUT)
    base_axes = baseline.axes()
    effective = baseline.batch_size * baseline.grad_accum
    base_estimate = (plans.get(baseline.cell_id) or {}).get("estimate_bytes")
    ranked = []
    for cell in cells.values():
        axes = cell.axes()
        if cell.cell_id == baseline.cell_id or cell.batch_size * cell.grad_accum != effective:
            continue
        if any(axes[a] != base_axes[a] for a in axis_names() if a not in MEMORY_AXES):
            continue
        if QUANT_ROWS[cell.quant].quantizes is False and QUANT_ROWS[baseline.quant].quantizes:
            continue  # dequantizing is never a memory fix
        change = {a: axes[a] for a in MEMORY_AXES if axes[a] != base_axes[a]}
        plan = plans.get(cell.cell_id) or {}
        estimate = plan.get("estimate_bytes")
        words = ", ".join(f"{k}={v}" for k, v in change.items())
        if plan.get("verdict") not in (None, "run"):
            choice.skipped.append(f"{words}: {plan['verdict']} ({plan.get('reason')})")
            continue
        miss = _clear_miss(plan)
        if miss:
            choice.skipped.append(f"{words}: {miss}")
            continue
        saving = (base_estimate - estimate) if base_estimate is not None and estimate is not None else None
        if saving is not None and saving <= 0:
            choice.skipped.append(f"{words}: the estimate predicts no saving ({-saving / 2**20:.0f} MiB more)")
            continue
        why = f"predicted to save {saving / 2**20:.0f} MiB" if saving else "no estimate of its saving"
        saving = saving or 0
        candidate = _bounded(Candidate(change, cell.cell_id, None, why), plans)
        ranked.append((_settings_changed(change), _cost_order(candidate), -saving, candidate))
    for *_, candidate in sorted(ranked, key=lambda item: item[:3]):
        candidate.reference = _reference(study, cells, cells[candidate.cell_id], baseline)
        choice.candidates.append(candidate)
    return choice


def _settings_changed(change: dict[str, Any]) -> int:
    """How many settings a memory change makes: batch_size and grad_accum changed together are one (the micro-batch)."""
    return len(change) - (1 if {"batch_size", "grad_accum"} <= set(change) else 0)


def _cost_order(candidate: Candidate) -> tuple[int, float]:
    """A candidate's place by what its plan bounds its cost at, cheapest first: its step time modelled on a named
    target, then the most tokens/s it could reach here, largest first; unbounded last."""
    if candidate.modelled_step_s:
        return 0, candidate.modelled_step_s
    return (1, -candidate.ceiling_tokens_per_s) if candidate.ceiling_tokens_per_s else (2, 0.0)


def _clear_miss(plan: dict[str, Any]) -> str:
    """Why a memory candidate's own plan rules it out, or "": what its estimate charges the budget
    (contract.CellPlan.charge_bytes) is `CLEAR_MISS` times the budget or more."""
    charge, budget = plan.get("charge_bytes"), plan.get("budget_bytes")
    if not charge or not budget or charge < CLEAR_MISS * budget:
        return ""
    return (
        f"its plan charges {charge / 2**20:.0f} MiB against the {budget / 2**20:.0f} MiB budget "
        f"({charge / budget:.2f}x, {CLEAR_MISS}x or more: out of memory too)"
    )


def _bounded(candidate: Candidate, plans: dict[str, dict[str, Any]]) -> Candidate:
    """The candidate with what its plan says of its rank before it runs."""
    plan = plans.get(candidate.cell_id) or {}
    candidate.modelled_step_s = plan.get("modelled_step_s")
    candidate.ceiling_tokens_per_s = plan.get("ceiling_tokens_per_s")
    candidate.ceiling_basis = plan.get("ceiling_basis") or ""
    return candidate


def _timeout_candidates(cells: dict[str, Any], baseline: Any, row: dict[str, Any]) -> Choice:
    """long_pause: the larger collective timeouts the grid lists, smallest first (the report names the smallest
    that ran ok, so the first that holds is its fix); straggler: the twin without the slow rank; mismatch: none
    (no setting fixes ranks that took different paths)."""
    from tunegrid.vocabulary import NO_FAULT

    kind = row.get("collective_diagnosis")
    choice = Choice(f"timeout:{kind}")
    if kind == "long_pause":
        larger = sorted(
            (c for c in cells.values() if _only_differs(c, baseline, "collective_timeout_s")),
            key=lambda c: c.collective_timeout_s,
        )
        for cell in (c for c in larger if c.collective_timeout_s > baseline.collective_timeout_s):
            why = "a rank paused once past the timeout: a larger one lets it catch up"
            choice.candidates.append(
                Candidate({"collective_timeout_s": cell.collective_timeout_s}, cell.cell_id, None, why)
            )
    elif kind == "straggler":
        twin = _twin(cells, baseline, {"fault": NO_FAULT})
        if twin is not None and twin.cell_id != baseline.cell_id:
            choice.candidates.append(Candidate({"fault": NO_FAULT}, twin.cell_id, None, "the ranks balanced"))
        choice.skipped.append("a larger collective timeout: it only delays a straggler's failure")
    else:
        choice.skipped.append(f"{kind or 'undiagnosed'}: no setting fixes ranks that took different code paths")
    return choice


def _only_differs(cell: Any, baseline: Any, axis: str) -> bool:
    a, b = cell.axes(), baseline.axes()
    return a[axis] != b[axis] and all(a[k] == b[k] for k in a if k != axis)


def precision_choice_cells(study: dict[str, Any], baseline: Any) -> list[str]:
    """The baseline's precision twins, whose contracts' plans (FLOPs, estimate) order a non-finite choice on a named
    target and bound each candidate's rank before it runs (on the machine itself the choice keeps the plans'
    order)."""
    return [c.cell_id for c in cells_by_id(study).values() if _only_differs(c, baseline, "precision")]


def memory_choice_cells(study: dict[str, Any], baseline: Any) -> list[str]:
    """The cells whose contracts' plans (estimate, verdict) the out-of-memory choice reads."""
    base = baseline.axes()
    return [
        c.cell_id
        for c in cells_by_id(study).values()
        if all(c.axes()[a] == base[a] for a in axis_names() if a not in MEMORY_AXES)
    ]


def choose(
    study: dict[str, Any],
    baseline: Any,
    row: dict[str, Any],
    capabilities: dict[str, Any],
    plans: dict[str, dict[str, Any]] | None = None,
) -> Choice:
    """The second wave for the failure `row` (the baseline's summary row) shows."""
    cells = cells_by_id(study)
    outcome = row["outcome"]
    if outcome == Outcome.NAN:
        return _precision_candidates(study, cells, baseline, row, capabilities, plans or {})
    if outcome in (Outcome.OOM, Outcome.PREDICTED_OOM):
        return _memory_candidates(study, cells, baseline, plans or {})
    if outcome == Outcome.TIMEOUT:
        return _timeout_candidates(cells, baseline, row)
    return Choice(str(outcome), skipped=[f"{outcome}: no table of fixes for it; read the cell's log"])


def tries(choice: dict[str, Any], passed: Any = ()) -> list[list[str]]:
    """The cells of each try: one candidate and its reference twin (where not run already) per try, in order, and
    none for a candidate `passed` over (review.doctor_stop.passed_over: it adds settings to a fix that already
    holds). Both modes run them so; they differ in where they stop (`stop`)."""
    seen: set[str] = set()
    out = []
    for c in choice["candidates"]:
        if c["cell_id"] in passed:
            out.append([])
            continue
        group = [c["cell_id"], *([c["reference"]] if c["reference"] else [])]
        out.append([cell for cell in group if cell not in seen])
        seen.update(group)
    return out
