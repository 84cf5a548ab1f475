"""`twin run`: the whole training run — one seed, many seeds, or goodput against checkpoint interval — as rich
tables or one JSON object."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from plan.schema import Plan
from twin import api
from twin.cli.options import JsonOpt, PlanArg, SetOpt, console, emit_json

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


def run_command(
    plan: PlanArg,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the first run.")] = 0,
    seeds: Annotated[int, typer.Option("--seeds", min=1, help="Runs to simulate; >1 reports mean and 5th/95th.")] = 1,
    sweep_checkpoint: Annotated[
        bool, typer.Option("--sweep-checkpoint", help="Goodput against checkpoint interval, optimum vs Young/Daly.")
    ] = False,
) -> None:
    """Simulate the whole training run: failures, checkpoints, recovery, goodput, cost and energy."""
    p = api.load_plan(plan, overrides or [])
    if sweep_checkpoint:
        sweep(p, seed, seeds, as_json)
    elif seeds > 1:
        many(p, seed, seeds, as_json)
    else:
        single(p, seed, as_json)


def single(plan: Plan, seed: int, as_json: bool) -> None:
    result = api.simulate_run(plan, seed)
    if as_json:
        emit_json(result.to_json())
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
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(f"simulating {count} runs", total=count)
        summary = api.simulate_runs(plan, range(first, first + count), lambda: progress.advance(task))
    stats = summary.stats
    if as_json:
        emit_json({"plan": plan.name, "seeds": count, "ideal_days": summary.runs[0].ideal_days, **stats})
        return
    table = Table(title=f"{plan.name}: {count} runs (ideal {summary.runs[0].ideal_days:,.2f} days)")
    for col in ("figure", "mean", "5th pct", "95th pct"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for key, label, fmt in FIGURES:
        s = stats[key]
        table.add_row(label, fmt.format(s["mean"]), fmt.format(s["p5"]), fmt.format(s["p95"]))
    console.print(table)
    console.print("mean interruptions: " + ", ".join(f"{c} {n:.1f}" for c, n in stats["interruptions"].items()))


def sweep(plan: Plan, first: int, count: int, as_json: bool) -> None:
    result = api.sweep_checkpoint(plan, range(first, first + max(count, 3)))
    if as_json:
        emit_json(result.__dict__)
        return
    table = Table(
        title=f"{plan.name}: goodput against checkpoint interval ({plan.reliability.checkpoint}, stall "
        f"{result.stall_s:.1f} s, job MTBF {result.mtbf_s / 3600:.2f} h)"
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
