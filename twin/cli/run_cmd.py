"""`twin run`: the whole training run — one seed, many seeds, or goodput against checkpoint interval — as rich
tables or one JSON object."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from plan.errors import PlanError
from plan.limits import Limits
from plan.schema import Plan
from twin import api
from twin.cli.options import (
    AllowOomOpt,
    JsonOpt,
    LimitOpt,
    PlanArg,
    SetOpt,
    console,
    emit_json,
    err_console,
    limits_from,
)
from twin.run.budget import duration

SWEEP_INTERVALS = 13  # api.sweep_checkpoint's default intervals
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
    seed: Annotated[int, typer.Option("--seed", help="Seed of the first run (>= 0).")] = 0,
    seeds: Annotated[int, typer.Option("--seeds", help="Runs to simulate; >1 reports mean and 5th/95th.")] = 1,
    sweep_checkpoint: Annotated[
        bool, typer.Option("--sweep-checkpoint", help="Goodput against checkpoint interval, optimum vs Young/Daly.")
    ] = False,
    limit: LimitOpt = None,
    allow_oom: AllowOomOpt = False,
) -> None:
    """Simulate the whole training run: failures, checkpoints, recovery, goodput, cost and energy. A plan that does
    not fit in memory exits 2 unless --allow-oom; a run whose failures outpace its progress exits 2 at once."""
    limits = limits_from(limit)
    api.check_seed(seed)
    if seeds < 1:
        raise PlanError(f"--seeds {seeds}: give at least 1")
    p = api.load_plan(plan, overrides or [], limits)
    if sweep_checkpoint:
        sweep(p, seed, seeds, as_json, limits, allow_oom)
    elif seeds > 1:
        many(p, seed, seeds, as_json, limits, allow_oom)
    else:
        single(p, seed, as_json, limits, allow_oom)


def single(plan: Plan, seed: int, as_json: bool, limits: Limits, allow_oom: bool) -> None:
    result = api.simulate_run(plan, seed, limits, allow_oom)
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
    table.add_row("step checked on", api.published_fidelity(plan).line)
    console.print(table)


def many(plan: Plan, first: int, count: int, as_json: bool, limits: Limits, allow_oom: bool) -> None:
    with SeedProgress(plan.name, count) as progress:
        summary = api.simulate_runs(plan, range(first, first + count), progress.advance, limits, allow_oom)
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
    console.print("step checked on: " + api.published_fidelity(plan).line)


class SeedProgress:
    """Progress of a many-run command on stderr: once two runs are done, how long all will take (one line, timed
    between the first run and the second, so the setup before them does not count), then a bar with the time left.
    Nothing shows before the first run ends, so a plan refused up front leaves its one error line alone."""

    def __init__(self, plan: str, count: int) -> None:
        self.plan, self.count = plan, count
        self.first_done: float | None = None
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        self.bar = Progress(*columns, console=err_console, transient=True)
        self.task = self.bar.add_task(f"simulating {count:,} runs", total=count)

    def advance(self) -> None:
        now = time.monotonic()
        if self.first_done is None:
            self.first_done = now
        elif not self.bar.live.is_started:
            each = now - self.first_done
            err_console.print(
                f"simulating {self.count:,} runs of {self.plan}: about {duration(each * self.count)} "
                f"({duration(each)} a run)",
                soft_wrap=True,
            )
            self.bar.start()
        self.bar.advance(self.task)

    def __enter__(self) -> SeedProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()


def sweep(plan: Plan, first: int, count: int, as_json: bool, limits: Limits, allow_oom: bool) -> None:
    seeds = range(first, first + max(count, 3))
    with SeedProgress(plan.name, SWEEP_INTERVALS * len(seeds)) as progress:
        result = api.sweep_checkpoint(plan, seeds, limits=limits, allow_oom=allow_oom, progress=progress.advance)
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
