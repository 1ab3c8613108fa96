"""The precision fixes for a non-finite failure, each with its evidence, its loss parity and its cost.

A precision is a candidate fix where a twin of a failing cell (every other axis equal) ran in it, ended ok and
its quality `holds` (review/quality.py: it learned, and its loss matched the reference twin's within
tolerance); an ok twin that did not learn or deviates is named as no evidence. A fix is offered only where its
arithmetic is native on both the study's target and the probed device (so a T4 target never gets bf16),
except one that keeps the arithmetic the failing setting already runs (fp16-islands for fp16). Each fix
carries its cost measured in the same grid: the median over failing/fixed pairs of the tokens/s and
peak-memory ratios (against the failing cell where it ran a timed step; one that failed in its first step has
no throughput, so then against its fp32 twin, and the text says so). Where the study's target is a named card
and not the machine, each fix also carries its cost on that card as modelled from its data sheet (the summary's
modelled_step_s, tunegrid.targets.modelled_step: the median over pairs of the failing cell's modelled step time
over the fix's), and the fixes are ranked by it, the host's measured cost shown beside: the machine's own speeds
say nothing of a card whose fp16 tensor cores run at eight times its fp32 rate. On the machine itself they are
ranked by throughput: the fastest that holds first. Fixes whose throughput is within the fastest's measurement
noise of it (the median absolute deviation of its step times, relative to their median: summary.step_time_noise)
are equally fast as measured, and the rows' nan_fix_rank picks the first among them, so a host's jitter does not
decide between two fixes it cannot tell apart, and the doctor, which runs fewer cells, names the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Any

from tunegrid.meanings import PRECISION_ROWS, precision_row
from tunegrid.review.advice import Fix, holds, ok_cells, siblings
from tunegrid.sites import BLOCK_NAME, site_words
from tunegrid.targets import TARGETS

# the candidates in the rows' order (the order of equals in throughput)
CANDIDATES = sorted(PRECISION_ROWS, key=lambda p: PRECISION_ROWS[p].nan_fix_rank)
# what a fix's cost falls back to being measured against: the precision without autocast (full precision)
FULL_PRECISION = next(p for p, row in PRECISION_ROWS.items() if not row.autocast)


def support_of(precision: str, target: str | None, capabilities: dict[str, Any]) -> str:
    """native | emulated | absent for a precision's arithmetic on the target and the probed device together:
    the weaker of the two (a named target's data sheet, and what the probe measured here)."""
    arithmetic = precision_row(precision).arithmetic
    rank = {"native": 2, "emulated": 1, "absent": 0}
    found = [(capabilities.get("precision") or {}).get(arithmetic)]
    if target and target in TARGETS and target != "native":
        found.append(TARGETS[target].precision.get(arithmetic, "absent"))
    known = [s for s in found if s in rank]
    return min(known, key=rank.__getitem__) if known else "absent"


@dataclass
class Candidate:
    precision: str
    evidence: list[str]
    unproven: list[str]  # ok twins that are no evidence, with why
    tokens_ratio: float | None
    peak_ratio: float | None
    parity: float | None  # the largest loss deviation from the reference among the evidence
    islands: list[str]
    against: str  # the precision its cost is measured against (the failing one where it ran a timed step)
    is_baseline: bool = False  # it is what the others' cost is measured against: no cost of its own to state
    # on the study's named target: the failing cell's modelled step time over the fix's (its modelled tokens/s
    # ratio against the failing setting), and the fix's own modelled step time
    modelled_ratio: float | None = None
    modelled_step_s: float | None = None
    noise: float | None = None  # the largest step-time noise among its evidence cells (summary.step_time_noise)

    @property
    def speed(self) -> float | None:
        """Its measured tokens/s against the cost baseline; the baseline itself 1.0."""
        return 1.0 if self.is_baseline else self.tokens_ratio

    def modelled_text(self, target: str, failing: str) -> str:
        if self.modelled_ratio is None or self.modelled_step_s is None:
            return f"not modelled on {target}"
        return (
            f"on {target} modelled {self.modelled_ratio:.2f}x the tokens/s of {failing}, the failing setting, at "
            f"{self.modelled_step_s * 1e3:.3g} ms/step (its FLOPs at the data sheet's peak rates, its bytes at its "
            "memory bandwidth)"
        )

    def cost_text(self) -> str:
        if self.is_baseline:
            return (
                f"the baseline the other fixes' cost is measured against (the failing cell ran no timed step, "
                f"so its {self.precision} twin stands for it)"
            )
        parts = []
        if self.tokens_ratio is not None:
            parts.append(f"{self.tokens_ratio:.2f}x the tokens/s")
        if self.peak_ratio is not None:
            parts.append(f"{self.peak_ratio:.2f}x the peak memory")
        return f"{' and '.join(parts)} of {self.against} in this grid" if parts else "cost not measured"

    def parity_text(self) -> str:
        return f"loss within {self.parity:.1%} of the reference" if self.parity is not None else "parity unknown"


def _ratio(values: list[float]) -> float | None:
    finite = [v for v in values if v == v and v not in (float("inf"), 0.0)]
    return median(finite) if finite else None


def _measured(row: Any, column: str) -> float | None:
    value = row.get(column)
    return float(value) if value is not None and value == value and float(value) > 0 else None


def baseline(frame: Any, row: Any) -> tuple[Any, str] | None:
    """What a fix's cost is measured against: the failing cell where it ran a step that was timed, else (it
    failed in its first step) its twin in fp32, which every precision fix can be read against alike."""
    if _measured(row, "tokens_per_s") is not None:
        return row, row["precision"]
    twins = ok_cells(siblings(frame, row, "precision"))
    twins = twins[twins["precision"].map(lambda p: p in PRECISION_ROWS and p == FULL_PRECISION)]
    return (twins.iloc[0], str(FULL_PRECISION)) if not twins.empty else None


def candidates(frame: Any, rows: list[Any], failing: str) -> list[Candidate]:
    out = []
    for precision in CANDIDATES:
        meaning = PRECISION_ROWS[precision]
        # a variant of an arithmetic (fp16-islands, fp16-mixed, fp16-residual) fixes the arithmetic it keeps
        variant_elsewhere = meaning.arithmetic != precision and meaning.arithmetic != precision_row(failing).arithmetic
        if precision == failing or variant_elsewhere:
            continue
        evidence, unproven, tokens, peaks, parity, islands, against = [], [], [], [], [], set(), set()
        modelled, steps = [], []  # the modelled tokens/s ratios against the failing cell, the fix's modelled steps
        noise = []
        baseline_pairs = 0  # failing cells whose cost baseline is this very precision (fp32 against fp32)
        for row in rows:
            twins = ok_cells(siblings(frame, row, "precision"))
            base = baseline(frame, row)
            for _, twin in twins[twins["precision"] == precision].iterrows():
                if not holds(twin):
                    unproven.append(f"{twin['cell_id']} ({twin.get('quality')})")
                    continue
                evidence.append(twin["cell_id"])
                noise.append(_measured(twin, "step_time_noise") or 0.0)
                mine, theirs = _measured(twin, "modelled_step_s"), _measured(row, "modelled_step_s")
                if mine is not None:
                    steps.append(mine)
                    if theirs is not None:
                        modelled.append(theirs / mine)
                if base is not None and base[1] == precision:
                    baseline_pairs += 1  # a fix is never costed against itself ("1.00x of fp32")
                elif base is not None:
                    against.add(base[1])
                    for column, ratios in (("tokens_per_s", tokens), ("peak_bytes", peaks)):
                        mine, theirs = _measured(twin, column), _measured(base[0], column)
                        if mine is not None and theirs is not None:
                            ratios.append(mine / theirs)
                deviation = twin.get("loss_deviation")
                if deviation is not None and deviation == deviation:
                    parity.append(float(deviation))
                if isinstance(twin.get("fp32_islands"), str):
                    islands.update(twin["fp32_islands"].split(","))
        if evidence or unproven:
            out.append(
                Candidate(
                    precision,
                    sorted(set(evidence)),
                    sorted(set(unproven)),
                    _ratio(tokens),
                    _ratio(peaks),
                    max(parity) if parity else None,
                    sorted(islands),
                    " and ".join(sorted(against)) or failing,
                    is_baseline=bool(baseline_pairs) and not against,
                    modelled_ratio=_ratio(modelled),
                    modelled_step_s=_ratio(steps),
                    noise=max(noise) if noise else None,
                )
            )
    return out


def residual_stream_notes(rows: list[Any]) -> list[str]:
    """Why the fixes that widen modules differ from those that widen the residual stream, where the failing cells'
    first non-finite forward output was a whole decoder layer's (no module inside it returned one)."""
    layers = sorted(
        {str(r.get("nan_forward_module")) for r in rows if BLOCK_NAME.search(str(r.get("nan_forward_module")))}
    )
    if not layers:
        return []
    first = min(layers, key=lambda name: int(BLOCK_NAME.search(name).group(1)))  # type: ignore[union-attr]
    return [
        f"The first non-finite value is a whole layer's output ({site_words(first)}): no module inside a layer "
        "exceeded fp16's range, the sum of their outputs did. fp16-residual and fp16-mixed keep that stream in "
        "fp32; fp16-islands can only widen modules, so it turns whole layers into fp32 islands."
    ]


def precision_fixes(
    frame: Any, rows: list[Any], failing: str, target: str | None, capabilities: dict[str, Any], short: Any
) -> tuple[list[Fix], list[str]]:
    """(the fixes ranked fastest first, sentences on what is not offered and why)."""
    where = f"target {target}" if target and target != "native" else "this machine"
    fixes, notes, offered = [], [], []
    notes += residual_stream_notes(rows)
    for candidate in candidates(frame, rows, failing):
        if candidate.unproven:
            notes.append(
                f"{candidate.precision} ran ok in {', '.join(candidate.unproven)}: no evidence of a fix "
                "(a fix must learn and match the reference)."
            )
        if not candidate.evidence:
            continue
        support = support_of(candidate.precision, target, capabilities)
        arithmetic = precision_row(candidate.precision).arithmetic
        # a fix runs natively, or keeps the arithmetic the failing setting already ran (fp16-islands on fp16)
        if support != "native" and not (support == "emulated" and arithmetic == precision_row(failing).arithmetic):
            notes.append(
                f"The same cells in {candidate.precision} were ok, but {where} has {support} {arithmetic}"
                f" ({'slow software path' if support == 'emulated' else 'not available'})."
            )
            continue
        offered.append(candidate)
    # on a named target that is not the machine, its modelled cost ranks them where it is known
    on_target = bool(target and target in TARGETS and target != "native")
    by_model = on_target and any(c.modelled_ratio is not None for c in offered)
    # the baseline ranks as what it is, 1.00x of itself
    offered.sort(key=lambda c: -(c.speed if c.speed is not None else -1.0))
    tied = equally_fast(offered)
    if tied:  # the rows' order among those the measurement cannot tell apart (min: the fastest among equal ranks)
        first = min(tied, key=lambda c: PRECISION_ROWS[c.precision].nan_fix_rank)
        offered.remove(first)
        offered.insert(0, first)
    if by_model:  # stable: measured throughput, then the rows' order, among equals on the target
        offered.sort(key=lambda c: -(c.modelled_ratio if c.modelled_ratio is not None else -1.0))
    for candidate in offered:
        kept = f" (islands: {', '.join(short(i) for i in candidate.islands)})" if candidate.islands else ""
        measured = candidate.cost_text()
        if on_target:
            measured = f"{candidate.modelled_text(str(target), failing)}; measured on this machine: {measured}"
        why = (
            f"switch to {candidate.precision}{kept}: ok in {len(candidate.evidence)} cell(s), "
            f"{candidate.parity_text()}, {measured}"
        )
        cost = {
            "tokens_per_s_ratio": candidate.tokens_ratio,
            "peak_bytes_ratio": candidate.peak_ratio,
            "against": "itself: the baseline of the others" if candidate.is_baseline else candidate.against,
        }
        if on_target:
            cost.update(target=target, modelled_tokens_per_s_ratio=candidate.modelled_ratio, modelled_against=failing)
        fixes.append(Fix({"precision": candidate.precision}, why, candidate.evidence, candidate.parity, cost))
    if len(offered) > 1:
        notes.append(_ranking_note(offered, str(target), failing, by_model, on_target, tied))
    return fixes, notes


def equally_fast(ranked: list[Candidate]) -> list[Candidate]:
    """The fixes, ranked fastest first, whose measured throughput is within the fastest's noise of it (itself
    included); none where the fastest has no measured throughput."""
    if not ranked or ranked[0].speed is None:
        return []
    floor = ranked[0].speed * (1 - (ranked[0].noise or 0.0))
    return [c for c in ranked if c.speed is not None and c.speed >= floor]


def _ranking_note(
    offered: list[Candidate], target: str, failing: str, by_model: bool, on_target: bool, tied: list[Candidate]
) -> str:
    # the baseline the ratios are measured against: a fix's own (never the baseline's, which names the failing
    # setting it stands for), and the baseline itself at 1.00x of itself
    against = next((c.against for c in offered if not c.is_baseline and c.tokens_ratio is not None), None)
    speeds = ", ".join(
        f"{c.precision} {1.0 if c.is_baseline else c.tokens_ratio:.2f}x"
        for c in offered
        if c.is_baseline or c.tokens_ratio is not None
    )
    measured = f"{speeds} the tokens/s of {against}, measured in this grid" if against else ""
    if not by_model:
        where = " on this machine" if on_target else ""
        unmodelled = f"; none modelled on target {target}" if on_target else ""
        ties = ""
        if len(tied) > 1:
            fastest = max(tied, key=lambda c: c.speed or 0.0)
            names = ", ".join(c.precision for c in tied)
            ties = (
                f"; {names} within {fastest.noise or 0.0:.0%} of the fastest, its step times' noise: equally fast "
                "as measured, the rows' nan_fix_rank first"
            )
        return (
            f"Ranked by throughput among the fixes that hold: {offered[0].precision} first ({measured}{where}"
            f"{ties}{unmodelled})."
        )
    model = ", ".join(f"{c.precision} {c.modelled_ratio:.2f}x" for c in offered if c.modelled_ratio is not None)
    return (
        f"Ranked by the cost modelled on target {target} among the fixes that hold: {offered[0].precision} first "
        f"({model} the tokens/s of {failing} on {target}: each step's FLOPs at the data sheet's peak rate for its "
        f"arithmetic, fp32 islands at the fp32 rate, and its bytes moved at the memory bandwidth; "
        f"{measured + ' on this machine' if measured else 'the tokens/s not measured on this machine'}, which is "
        "not the target)."
    )
