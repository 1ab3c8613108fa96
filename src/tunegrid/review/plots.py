"""The report's figures: the outcome matrix, the loss curves and the peak memory per cell (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunegrid.vocabulary import Axis, CurvePlace, MatrixPlace, Outcome, axis, axis_table

OUTCOME_COLOURS = {
    Outcome.OK: "#4caf50",
    Outcome.NAN: "#e53935",
    Outcome.OOM: "#8e24aa",
    Outcome.PREDICTED_OOM: "#ce93d8",
    Outcome.TIMEOUT: "#fb8c00",
    Outcome.ERROR: "#424242",
    Outcome.UNSUPPORTED: "#bdbdbd",
}
MIB = 2**20
# Line colours and styles by the value's place in its axis's list (fp32/bf16/fp16; none/nf4/nf4-experts)
LINE_COLOURS = ("#1e88e5", "#43a047", "#e53935", "#6d4c41", "#00897b", "#fdd835")
LINE_STYLES = ("-", "--", ":", "-.")


class PlotLayoutError(ValueError):
    """The grid varies an axis the figures cannot place."""


def _varying(frame: Any, name: str) -> bool:
    return name in frame.columns and frame[name].nunique() > 1


def _placed(frame: Any) -> list[Axis]:
    """The axes the figures show: those whose role says always, and those that vary in this grid. A varying
    axis without a role is refused: its cells would overwrite each other in the matrix."""
    unplaced = [a.name for a in axis_table() if a.plot is None and _varying(frame, a.name)]
    if unplaced:
        raise PlotLayoutError(
            f"axis {unplaced} varies in this grid but has no plot role; give it a PlotRole in "
            "tunegrid.vocabulary.AXIS_TABLE (a matrix row or column, a curve panel, colour or style)"
        )
    return [a for a in axis_table() if a.plot is not None and (a.plot.always or _varying(frame, a.name))]


def _order(name: str) -> Any:
    """Values of an axis in its declared order (an enum's listing), else sorted by value."""
    listed = axis(name).items.get("enum")
    return (lambda v: listed.index(v) if v in listed else len(listed)) if listed else (lambda v: (str(type(v)), v))


def _keys(frame: Any, names: list[str]) -> list[tuple[Any, ...]]:
    present = {tuple(r) for r in frame[names].itertuples(index=False)}
    orders = [_order(n) for n in names]
    return sorted(present, key=lambda key: tuple(order(v) for order, v in zip(orders, key)))


def _value_label(name: str, value: Any) -> str:
    """'bs 2' for an axis shown by prefix in the id, the value alone for a named one (fp16, nf4)."""
    row = axis(name)
    return f"{row.id_prefix} {value}" if row.id_prefix else str(value)


def _sub_label(names: list[str], values: tuple[Any, ...]) -> str:
    """'bs 2', or 'bs 2 x ga 4' (micro-batch x accumulation) where accumulation varies."""
    return " x ".join(_value_label(n, v) for n, v in zip(names, values))


def _matrix_layout(frame: Any) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[str], list[str]]:
    """Rows and columns from the axis table's roles, e.g. rows model x quant (x seed, x world size when they
    vary); columns precision x batch size (x gradient accumulation when it varies)."""
    placed = _placed(frame)
    row_axes = [a.name for a in placed if a.plot.matrix == MatrixPlace.ROW]
    col_axes = [a.name for a in placed if a.plot.matrix == MatrixPlace.COLUMN]
    return _keys(frame, row_axes), _keys(frame, col_axes), row_axes, col_axes


def _cell_label(row: Any) -> str:
    if row["outcome"] == Outcome.NAN:
        return f"nan\n{row['nan_kind'] or ''}".replace("grad_nonfinite_finite_loss", "grad").replace(
            "loss_nonfinite", "loss"
        )
    if row["outcome"] == Outcome.OK and (row.get("skipped_steps") or 0) > 0:
        return f"ok\n{int(row['skipped_steps'])} skipped"
    return str(row["outcome"]).replace("predicted_oom", "pred. oom")


def plot_outcomes(frame: Any, path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    rows, cols, row_axes, col_axes = _matrix_layout(frame)
    fig, ax = plt.subplots(figsize=(1.3 * len(cols) + 3.5, 0.55 * len(rows) + 1.8))
    indexed = {tuple(r[a] for a in row_axes + col_axes): r for _, r in frame.iterrows()}
    for y, row_key in enumerate(rows):
        for x, col_key in enumerate(cols):
            cell = indexed.get(tuple(row_key) + tuple(col_key))
            colour = OUTCOME_COLOURS.get(cell["outcome"], "#ffffff") if cell is not None else "#ffffff"
            ax.add_patch(Rectangle((x, y), 1, 1, facecolor=colour, edgecolor="white", linewidth=2))
            if cell is not None:
                ax.text(
                    x + 0.5,
                    y + 0.5,
                    _cell_label(cell),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if cell["outcome"] in (Outcome.NAN, Outcome.ERROR, Outcome.OOM) else "black",
                )
    ax.set_xlim(0, len(cols))
    ax.set_ylim(len(rows), 0)
    labels = [f"{c[0]}\n{_sub_label(col_axes[1:], c[1:])}" for c in cols]
    ax.set_xticks([x + 0.5 for x in range(len(cols))], labels, fontsize=8)
    ax.set_yticks([y + 0.5 for y in range(len(rows))], [" / ".join(map(str, r)) for r in rows], fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    present = [o for o in OUTCOME_COLOURS if o in set(frame["outcome"])]
    ax.legend(
        handles=[Patch(color=OUTCOME_COLOURS[o], label=o) for o in present],
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
        fontsize=8,
        frameon=False,
    )
    ax.set_title(f"Outcome per cell ({' / '.join(row_axes)} x {' / '.join(col_axes)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_losses(frame: Any, curves: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """One panel per model x batch size (x accumulation, seed, world size where they vary); one line per
    precision (colour) and quant (style): the roles in the axis table."""
    import matplotlib.pyplot as plt

    placed = _placed(frame)
    panel_axes = [a.name for a in placed if a.plot.curves == CurvePlace.PANEL]
    (colour_axis,) = [a.name for a in placed if a.plot.curves == CurvePlace.COLOUR]
    (style_axis,) = [a.name for a in placed if a.plot.curves == CurvePlace.STYLE]
    panels = _keys(frame, panel_axes)
    ncols = min(2, len(panels)) or 1
    nrows = (len(panels) + ncols - 1) // ncols or 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, 3.4 * nrows), squeeze=False)
    colour_of, style_of = _order(colour_axis), _order(style_axis)
    for ax, panel in zip(axes.flat, panels):
        sub = frame
        for name, value in zip(panel_axes, panel):
            sub = sub[sub[name] == value]
        for _, row in sub.iterrows():
            points = [r for r in curves.get(row["cell_id"], []) if r.get("loss") is not None]
            if not points:
                continue
            steps = [p["step"] for p in points]
            losses = [_finite_or_nan(p["loss"]) for p in points]
            label = f"{row[colour_axis]} {row[style_axis]}" + (" (nan)" if row["outcome"] == Outcome.NAN else "")
            ax.plot(
                steps,
                losses,
                LINE_STYLES[style_of(row[style_axis]) % len(LINE_STYLES)],
                color=LINE_COLOURS[colour_of(row[colour_axis]) % len(LINE_COLOURS)],
                label=label,
                linewidth=1.2,
            )
            if row["outcome"] == Outcome.NAN and row["nan_step"] == row["nan_step"]:
                mark_nonfinite(ax, row["nan_step"], LINE_COLOURS[colour_of(row[colour_axis]) % len(LINE_COLOURS)])
        ax.set_title(f"{panel[0]}, {_sub_label(panel_axes[1:], panel[1:])}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("loss", fontsize=8)
        ax.legend(fontsize=6, ncol=2)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle("Loss per step (x and dotted line: the first non-finite step)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(frame: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    sub = frame.sort_values("cell_id")
    fig, ax = plt.subplots(figsize=(8, 0.22 * len(sub) + 1.5))
    y = range(len(sub))
    peaks = [(v or 0) / MIB if v == v else 0 for v in sub["peak_bytes"]]
    estimates = [(v or 0) / MIB if v == v else 0 for v in sub["estimate_bytes"]]
    ax.barh(list(y), peaks, color=[OUTCOME_COLOURS.get(o, "grey") for o in sub["outcome"]], label="measured peak")
    ax.plot(estimates, list(y), "k|", markersize=9, label="estimate")
    if "budget_bytes" in sub and sub["budget_bytes"].notna().any():
        ax.axvline(float(sub["budget_bytes"].dropna().iloc[0]) / MIB, color="red", linestyle="--", label="budget")
    ax.set_yticks(list(y), list(sub["cell_id"]), fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("MiB (process peak: host RSS on CPU, allocator peak on GPU)", fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Peak memory per cell, estimate beside it", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mark_nonfinite(ax: Any, step: float, colour: str) -> Any:
    """The first non-finite step where it happened: a dotted line at that step across the panel and an x on
    its top edge. A non-finite loss has no height, so the mark never sits at a loss value (0 or the last
    finite one) that the step did not have. Returns the x marker's artist."""
    ax.axvline(step, color=colour, linestyle=":", linewidth=1.0)
    (marker,) = ax.plot(
        [step], [1.0], "x", color="black", markersize=8, transform=ax.get_xaxis_transform(), clip_on=False
    )
    return marker


def _finite_or_nan(value: Any) -> float:
    number = float(value)  # metrics.jsonl writes non-finite values as the strings "nan"/"inf"
    return number if abs(number) != float("inf") else float("nan")
