"""How `twin run` prints a run, many runs, or a checkpoint-interval sweep (rich tables, or one JSON object)."""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from plan.schema import Plan
from twin.reliability import daly_interval_s
from twin.runs import run_seeds, setup, simulate_run, summarise, sweep_checkpoint

console = Console()
FIGURES = (
    ("wall_days", "wall days", "{:,.2f}"),
    ("goodput", "goodput (ETTR)", "{:.1%}"),
    ("mtbf_hours", "MTBF (hours)", "{:,.2f}"),
    ("checkpoints", "checkpoints", "{:,.0f}"),
    ("lost_work_hours", "lost work (h)", "{:,.1f}"),
    ("restart_hours", "restart (h)", "{:,.1f}"),
    ("wait_hours", "waiting for nodes (h)", "{:,.1f}"),
    ("checkpoint_stall_hours", "checkpoint stall (h)", "{:,.1f}"),
    ("degraded_hours", "slow-node / shrunk (h)", "{:,.1f}"),
    ("cost_usd", "cost (USD)", "{:,.0f}"),
    ("energy_mwh", "energy (MWh)", "{:,.0f}"),
)


def _emit(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, default=float) + "\n")


def single(plan: Plan, seed: int, as_json: bool) -> None:
    result = simulate_run(setup(plan), seed)
    if as_json:
        _emit(result.to_json())
        return
    table = Table(
        title=f"{plan.name}: one run (seed {seed}), checkpoint every {result.checkpoint_interval_min:.1f} min"
        f" ({plan.reliability.checkpoint}), ideal {result.ideal_days:,.2f} days",
        show_header=False,
    )
    for key, label, fmt in FIGURES:
        table.add_row(label, fmt.format(getattr(result, key)))
    table.add_row("interruptions", ", ".join(f"{c} {n}" for c, n in result.interruptions.items()) or "none")
    console.print(table)


def many(plan: Plan, first: int, count: int, as_json: bool) -> None:
    run_setup = setup(plan)
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(f"simulating {count} runs", total=count)
        runs = run_seeds(run_setup, range(first, first + count), lambda: progress.advance(task))
    stats = summarise(runs)
    if as_json:
        _emit({"plan": plan.name, "seeds": count, "ideal_days": runs[0].ideal_days, **stats})
        return
    table = Table(title=f"{plan.name}: {count} runs (ideal {runs[0].ideal_days:,.2f} days)")
    for col in ("figure", "mean", "5th pct", "95th pct"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for key, label, fmt in FIGURES:
        s = stats[key]
        table.add_row(label, fmt.format(s["mean"]), fmt.format(s["p5"]), fmt.format(s["p95"]))
    console.print(table)
    console.print("mean interruptions: " + ", ".join(f"{c} {n:.1f}" for c, n in stats["interruptions"].items()))


def sweep(plan: Plan, first: int, count: int, as_json: bool) -> None:
    run_setup = setup(plan)
    mtbf = 1 / sum(run_setup.rates.values())
    daly = daly_interval_s(run_setup.ckpt.stall_s, mtbf)
    intervals = [daly * f for f in np.geomspace(0.25, 4.0, 13)]
    result = sweep_checkpoint(run_setup, intervals, range(first, first + max(count, 3)))
    if as_json:
        _emit(result.__dict__)
        return
    table = Table(
        title=f"{plan.name}: goodput against checkpoint interval ({plan.reliability.checkpoint}, stall "
        f"{run_setup.ckpt.stall_s:.1f} s, job MTBF {mtbf / 3600:.2f} h)"
    )
    table.add_column("interval (min)", justify="right")
    table.add_column("goodput", justify="right")
    table.add_column("")
    for minutes, goodput in zip(result.intervals_min, result.goodput_mean, strict=True):
        mark = "← Daly" if abs(minutes - result.daly_min) < 1e-9 else ""
        table.add_row(f"{minutes:,.2f}", f"{goodput:.2%}", mark)
    console.print(table)
    console.print(
        f"simulated optimum {result.optimum_min:,.2f} min; Daly {result.daly_min:,.2f} min; "
        f"Young {result.young_min:,.2f} min"
    )
