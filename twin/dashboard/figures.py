"""The dashboard's figures and tables: pure functions from the twin's results to Plotly figures and pandas frames,
so tests check them without Streamlit and app.py only lays them out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from twin.run.summary import RunPrediction, Sweep
from twin.search.engine import Candidate, SearchResult
from twin.step.memory import MemoryBreakdown
from twin.step.predict import StepPrediction

KIND_COLOURS = {
    "F": "#4C78A8",
    "B": "#F58518",
    "W": "#54A24B",
    "TP": "#E45756",
    "CP": "#72B7B2",
    "EP": "#B279A2",
    "DP": "#9D755D",
    "PP": "#FF9DA6",
    "barrier": "#BAB0AC",
    "optimizer": "#EECA3B",
    "runs": "#D9D9D9",
}
KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight grad", "runs": "other schedule runs"}
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "transient", "reserved")


def headline(pred: StepPrediction, usd_per_gpu_hour: float) -> dict[str, str]:
    """The figures a planner reads first, formatted."""
    return {
        "step time": f"{pred.step_time_s:.3f} s",
        "tokens/s": f"{pred.tokens_per_s:,.0f}",
        "MFU / HFU": f"{pred.mfu:.1%} / {pred.hfu:.1%}",
        "days to train": f"{pred.days_to_train:,.1f}",
        "cost to train": f"${pred.gpu_hours * usd_per_gpu_hour / 1e6:,.2f}M",
        "memory per GPU": f"{pred.memory.peak:,.1f} of {pred.memory.capacity:,.1f} GiB",
    }


def breakdown_bar(pred: StepPrediction) -> go.Figure:
    """Where the step goes on its critical pipeline rank: one stacked horizontal bar."""
    fig = go.Figure()
    for name, seconds in pred.breakdown_s.items():
        if seconds > 0:
            fig.add_bar(y=["step"], x=[seconds], name=name, orientation="h", hovertemplate="%{x:.3f} s")
    fig.update_layout(barmode="stack", height=220, xaxis_title="seconds", margin={"t": 30, "b": 40})
    return fig


def memory_bars(ranks: Sequence[MemoryBreakdown]) -> go.Figure:
    """Memory per GPU on every pipeline rank, stacked by what holds it, against the HBM line."""
    fig = go.Figure()
    x = [f"pp {b.pipeline_rank}" for b in ranks]
    for part in MEMORY_PARTS:
        fig.add_bar(x=x, y=[getattr(b, part) for b in ranks], name=part, hovertemplate="%{y:.1f} GiB")
    if ranks:
        fig.add_hline(y=ranks[0].capacity, line_dash="dash", line_color="red", annotation_text="HBM usable")
    fig.update_layout(barmode="stack", yaxis_title="GiB per GPU", height=360, margin={"t": 30})
    return fig


def timeline_gantt(pred: StepPrediction) -> go.Figure:
    """The simulated step as a Gantt chart, from the events `--trace` writes: per pipeline rank a lane of its
    actions (forward, backward, weight gradient; microbatch, stage and chunk on hover) ending in the barrier and
    the optimizer, and a lane of its exposed communication (TP, CP, EP, DP, PP)."""
    fig = go.Figure()
    frame = pd.DataFrame(pred.timeline)
    if frame.empty:
        return fig
    lanes = zip(frame["rank"], frame["track"], strict=True)
    frame["lane"] = [f"pp {r}" + (" comm" if t == "comm" else "") for r, t in lanes]
    for kind, group in frame.groupby("kind"):
        fig.add_bar(
            y=group["lane"],
            x=group["end_s"] - group["start_s"],
            base=group["start_s"],
            orientation="h",
            name=KIND_NAMES.get(str(kind), str(kind)),
            marker_color=KIND_COLOURS.get(str(kind), "#888888"),
            customdata=group[["microbatch", "stage", "chunk"]],
            hovertemplate="mb %{customdata[0]} stage %{customdata[1]} chunk %{customdata[2]}: from %{base:.3f} s",
        )
    fig.add_vline(x=pred.step_time_s, line_dash="dash", annotation_text="step end")
    fig.update_layout(barmode="overlay", xaxis_title="seconds", height=120 + 22 * frame["lane"].nunique())
    fig.update_yaxes(autorange="reversed")
    return fig


def collectives_table(pred: StepPrediction) -> pd.DataFrame:
    """Each parallel axis's typical collective: its operation, algorithm, tier, span and bus bandwidth."""
    rows = [
        {
            "axis": axis,
            "op": c["op"],
            "algorithm": c["algorithm"],
            "tier": c["tier"],
            "ranks": c["ranks"],
            "MB": c["bytes"] / 1e6,
            "ms": c["seconds"] * 1e3,
            "busbw GB/s": c["busbw_GBps"],
        }
        for axis, c in pred.collectives.items()
    ]
    return pd.DataFrame(rows)


def lost_time_bar(runs: Sequence[RunPrediction]) -> go.Figure:
    """Where a run's wall time goes beyond its ideal days, mean over the seeds (hours)."""
    parts = {
        "restarts": [r.restart_hours - r.wait_hours for r in runs],
        "waiting for nodes": [r.wait_hours for r in runs],
        "lost work": [r.lost_work_hours for r in runs],
        "checkpoint stalls": [r.checkpoint_stall_hours for r in runs],
        "degraded": [r.degraded_hours for r in runs],
    }
    fig = go.Figure()
    for name, values in parts.items():
        fig.add_bar(x=[name], y=[sum(values) / max(1, len(values))], name=name, showlegend=False)
    fig.update_layout(yaxis_title="hours (mean over seeds)", height=320, margin={"t": 30})
    return fig


def failure_timeline(run: RunPrediction) -> go.Figure:
    """One seeded run's interruptions over time, by cause, sized by the work each lost."""
    frame = pd.DataFrame([e for e in run.events if e.get("event") == "interrupt"])
    fig = go.Figure()
    if frame.empty:
        fig.add_annotation(text="no interruption in this run", showarrow=False)
        return fig
    for cause, group in frame.groupby("cause"):
        fig.add_scatter(
            x=group["time_h"] / 24,
            y=[str(cause)] * len(group),
            mode="markers",
            name=str(cause),
            marker={"size": 4 + 40 * group["lost_h"].clip(upper=1.0)},
            hovertemplate="day %{x:.2f}",
        )
    fig.update_layout(xaxis_title="day of the run", height=320, showlegend=False, margin={"t": 30})
    return fig


def checkpoint_sweep(sweep: Sweep) -> go.Figure:
    """Goodput against checkpoint interval, with the simulated optimum, Young's and Daly's intervals marked."""
    fig = go.Figure(go.Scatter(x=sweep.intervals_min, y=sweep.goodput_mean, mode="lines+markers", name="goodput"))
    for x, name, dash in (
        (sweep.young_min, "Young", "dot"),
        (sweep.daly_min, "Daly", "dash"),
        (sweep.optimum_min, "simulated optimum", "solid"),
    ):
        fig.add_vline(x=x, line_dash=dash, annotation_text=name)
    fig.update_layout(xaxis_type="log", xaxis_title="checkpoint interval (min)", yaxis_title="goodput", height=360)
    return fig


def pareto_scatter(result: SearchResult) -> go.Figure:
    """Every simulated layout by days to train and memory headroom, the Pareto front highlighted; each point's
    customdata is its index in `result.simulated` (a click picks it)."""
    fig = go.Figure()
    front = {id(c) for c in result.pareto}
    for on_front, name in ((False, "simulated"), (True, "Pareto front")):
        index = [i for i, c in enumerate(result.simulated) if (id(c) in front) == on_front]
        cands = [result.simulated[i] for i in index]
        fig.add_scatter(
            x=[c.outcome.days_to_train for c in cands],
            y=[c.headroom_GiB for c in cands],
            mode="markers",
            name=name,
            text=[c.label for c in cands],
            customdata=index,
            marker={"size": 11 if on_front else 6},
            hovertemplate="%{text}<br>%{x:.1f} days, %{y:.1f} GiB free",
        )
    fig.update_layout(xaxis_title="days to train", yaxis_title="memory headroom (GiB)", height=420)
    return fig


def candidates_table(cands: Sequence[Candidate]) -> pd.DataFrame:
    """Layouts as rows: degrees, schedule, step, MFU, headroom, days and cost."""
    return pd.DataFrame(
        [
            {
                "layout": c.label,
                "GPUs": c.shape.gpus,
                "batch (M tokens)": c.plan.tokens_per_step / 1e6,
                "step (s)": c.outcome.step_time_s,
                "MFU": c.outcome.mfu,
                "free GiB": c.headroom_GiB,
                "days": c.outcome.days_to_train,
                "cost ($M)": c.cost_usd / 1e6,
            }
            for c in cands
        ]
    )


def compare_table(scenarios: Mapping[str, StepPrediction]) -> pd.DataFrame:
    """Scenarios side by side, with each figure's change against the first."""
    rows: list[dict[str, Any]] = []
    first = next(iter(scenarios.values()), None)
    for name, p in scenarios.items():
        rows.append(
            {
                "scenario": name,
                "GPUs": p.world_size,
                "step (s)": p.step_time_s,
                "MFU": p.mfu,
                "days": p.days_to_train,
                "GPU hours": p.gpu_hours,
                "days vs first": p.days_to_train / first.days_to_train - 1 if first else 0.0,
            }
        )
    return pd.DataFrame(rows)


def compare_bars(scenarios: Mapping[str, StepPrediction]) -> go.Figure:
    """The scenarios' step breakdowns, overlaid as grouped stacks."""
    fig = go.Figure()
    names = list(scenarios)
    keys = sorted({k for p in scenarios.values() for k, v in p.breakdown_s.items() if v > 0})
    for key in keys:
        fig.add_bar(x=names, y=[scenarios[n].breakdown_s.get(key, 0.0) for n in names], name=key)
    fig.update_layout(barmode="stack", yaxis_title="seconds per step", height=380)
    return fig


FLEET_FIGURES = (("wall_days", "days (whole run)"), ("cost_usd", "cost ($)"), ("energy_mwh", "energy (MWh)"))


def fleet_table(frame: pd.DataFrame) -> pd.DataFrame:
    """A fleet comparison (twin/search/fleet.py) as the dashboard shows it: a row per fleet, worst days last."""
    shown = frame.rename(
        columns={
            "cluster": "fleet",
            "fleet_gpus": "fleet GPUs",
            "gpus": "GPUs",
            "step_time_s": "step (s)",
            "mfu": "MFU",
            "ideal_days": "days (no failures)",
            "wall_days": "days (whole run)",
            "cost_usd": "cost ($M)",
            "energy_mwh": "energy (MWh)",
            "published_rows": "published runs checked",
            "published_mean_abs_error": "their mean error",
            "reason": "why it cannot run",
            "note": "note",
        }
    )
    shown["cost ($M)"] = shown["cost ($M)"] / 1e6  # as the search's table prints cost
    shown = shown.sort_values("days (whole run)", na_position="last").drop(columns=["memory_peak_GiB", "batch_tokens"])
    shown.attrs = {}  # the best plans ride in attrs; a table shows figures (Arrow cannot serialise a Plan)
    return shown


def fleet_bars(frame: pd.DataFrame) -> go.Figure:
    """Days, cost and energy of each fleet that can run the model, each against the best fleet (1 = the best)."""
    ok = frame[frame["reason"] == ""]
    fig = go.Figure()
    for column, label in FLEET_FIGURES:
        best = ok[column].min()
        hover = "%{x}: %{customdata:,.4g}<extra>" + label + "</extra>"
        y = ok[column] / best if best else ok[column]
        fig.add_bar(x=ok["cluster"], y=y, name=label, customdata=ok[column], hovertemplate=hover)
    fig.update_layout(barmode="group", yaxis_title="times the best fleet", height=380)
    return fig
