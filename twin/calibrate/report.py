"""The calibration report: one row per plan (measured, predicted before and after, error), a Markdown table and
Plotly figures of predicted against measured, per step and per phase. Figure builders are pure functions that
return `plotly.graph_objects.Figure`, for the report and the dashboard alike."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from twin.calibrate.fit import PHASE_GROUPS, SKEW_GROUP


@dataclass(frozen=True)
class Row:
    """One plan of a calibration: what it measured and what the twin said before and after."""

    label: str
    role: str
    """'fit' (calibrated on) or 'held out'."""
    measured_s: float
    measured_sd_s: float
    repeats: int
    before_s: float
    after_s: float
    low_s: float
    high_s: float
    """95% prediction interval of the calibrated profile (seconds)."""
    measured_phases: dict[str, float]
    """Phase groups (twin.calibrate.fit.PHASE_GROUPS), mean over pipeline ranks (seconds)."""
    predicted_phases: dict[str, float]

    @property
    def error_before(self) -> float:
        return self.before_s / self.measured_s - 1

    @property
    def error_after(self) -> float:
        return self.after_s / self.measured_s - 1

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "error_before": self.error_before, "error_after": self.error_after}


def phase_groups(
    stage_phases: list[dict[str, float]] | tuple[dict[str, float], ...], skew_s: float = 0.0
) -> dict[str, float]:
    """Phase groups averaged over pipeline ranks; `skew_s` (the twin's straggler time) joins synchronisation."""
    n = max(1, len(stage_phases))
    out = {g: sum(sum(ph.get(p, 0.0) for p in parts) for ph in stage_phases) / n for g, parts in PHASE_GROUPS.items()}
    out[SKEW_GROUP] += skew_s
    return out


def summary(rows: list[Row], role: str) -> dict[str, float]:
    """Median and worst absolute step-time error of the rows in `role`, before and after calibration."""
    chosen = [r for r in rows if r.role == role]
    if not chosen:
        return {}
    after = [abs(r.error_after) for r in chosen]
    before = [abs(r.error_before) for r in chosen]
    inside = sum(r.low_s <= r.measured_s <= r.high_s for r in chosen)
    return {
        "plans": len(chosen),
        "median_abs_error_before": statistics.median(before),
        "median_abs_error_after": statistics.median(after),
        "worst_abs_error_after": max(after),
        "inside_interval": inside,
    }


def markdown(rows: list[Row], title: str, notes: list[str]) -> str:
    lines = [f"# {title}", ""]
    lines += [
        "| layout | set | measured s (sd, repeats) | before s | after s [95% interval] | error before | error after |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.label} | {r.role} | {r.measured_s:.4f} ({r.measured_sd_s:.4f}, {r.repeats}) | {r.before_s:.4f} | "
            f"{r.after_s:.4f} [{r.low_s:.4f}, {r.high_s:.4f}] | {r.error_before:+.1%} | {r.error_after:+.1%} |"
        )
    for role in ("fit", "held out"):
        s = summary(rows, role)
        if s:
            lines += [
                "",
                f"**{role}** ({s['plans']:.0f} plans): median |error| {s['median_abs_error_before']:.1%} before → "
                f"{s['median_abs_error_after']:.1%} after; worst after {s['worst_abs_error_after']:.1%}; "
                f"{s['inside_interval']:.0f} of {s['plans']:.0f} inside their 95% interval.",
            ]
    lines += ["", "## Phases (seconds, mean over pipeline ranks: measured / predicted after)", ""]
    groups = list(PHASE_GROUPS)
    lines += ["| layout | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
    for r in rows:
        cells = [f"{r.measured_phases[g]:.4f} / {r.predicted_phases[g]:.4f}" for g in groups]
        lines.append(f"| {r.label} | " + " | ".join(cells) + " |")
    lines += ["", *notes]
    return "\n".join(lines) + "\n"


def step_figure(rows: list[Row]) -> go.Figure:
    """Predicted against measured step time, before and after calibration, with the 95% intervals."""
    fig = go.Figure()
    top = max(max(r.measured_s, r.after_s, r.before_s, r.high_s) for r in rows) * 1.1
    fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="exact", line={"dash": "dot"}))
    fig.add_trace(
        go.Scatter(
            x=[r.measured_s for r in rows], y=[r.before_s for r in rows], mode="markers", name="before",
            text=[r.label for r in rows], marker={"symbol": "x", "color": "grey"},
        )
    )  # fmt: skip
    for role, color in (("fit", "royalblue"), ("held out", "crimson")):
        chosen = [r for r in rows if r.role == role]
        fig.add_trace(
            go.Scatter(
                x=[r.measured_s for r in chosen], y=[r.after_s for r in chosen], mode="markers",
                name=f"after ({role})", text=[r.label for r in chosen], marker={"color": color, "size": 9},
                error_y={"type": "data", "symmetric": False, "array": [r.high_s - r.after_s for r in chosen],
                         "arrayminus": [r.after_s - r.low_s for r in chosen]},
                error_x={"type": "data", "array": [r.measured_sd_s for r in chosen]},
            )
        )  # fmt: skip
    fig.update_layout(
        title="Step time: predicted against measured", xaxis_title="measured (s)", yaxis_title="predicted (s)"
    )
    return fig


def phase_figure(rows: list[Row]) -> go.Figure:
    """Per plan, measured and predicted seconds of each phase group, side by side."""
    groups = list(PHASE_GROUPS)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("measured", "predicted (calibrated)"), shared_yaxes=True)
    labels = [r.label for r in rows]
    for g in groups:
        fig.add_trace(go.Bar(name=g, x=labels, y=[r.measured_phases[g] for r in rows], legendgroup=g), 1, 1)
        fig.add_trace(
            go.Bar(name=g, x=labels, y=[r.predicted_phases[g] for r in rows], legendgroup=g, showlegend=False), 1, 2
        )
    fig.update_layout(barmode="stack", title="Where each step goes, per phase", yaxis_title="seconds")
    return fig


def read_rows(out: Path) -> list[Row]:
    """The rows a `twin loop` wrote to `out`/rows.json (its derived error columns recomputed, not read)."""
    data = json.loads((out / "rows.json").read_text())
    fields = set(Row.__dataclass_fields__)
    return [Row(**{k: v for k, v in row.items() if k in fields}) for row in data["rows"]]


def write_report(out: Path, rows: list[Row], title: str, notes: list[str]) -> None:
    """report.md, report.html (both figures) and rows.json under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(markdown(rows, title, notes))
    html = step_figure(rows).to_html(full_html=False, include_plotlyjs=True)
    html += phase_figure(rows).to_html(full_html=False, include_plotlyjs=False)
    (out / "report.html").write_text(f"<html><head><title>{title}</title></head><body>{html}</body></html>")
    data = {"rows": [r.to_json() for r in rows], "fit": summary(rows, "fit"), "held_out": summary(rows, "held out")}
    (out / "rows.json").write_text(json.dumps(data, indent=1))
