"""`twin search`: the best layouts for a model on a fleet (or, with --sweep, a table of given variants)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pandas as pd
import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from plan.errors import PlanError
from twin import api
from twin.cli import fleet_cmd
from twin.cli.options import JsonOpt, LimitOpt, SetOpt, console, emit_json, err_console, limits_from, styled
from twin.outputs import output_file
from twin.search import front
from twin.search.engine import OBJECTIVES, Candidate, SearchResult, Tally, why_better


def search_command(
    source: Annotated[str, typer.Argument(help="A model preset (with --cluster) or a plan (preset or YAML path).")],
    cluster: Annotated[str | None, typer.Option("--cluster", help="The fleet: a cluster in topologies/.")] = None,
    gpus: Annotated[str | None, typer.Option("--gpus", help="Use at most N GPUs.")] = None,
    gpus_range: Annotated[str | None, typer.Option("--gpus-range", help="GPU counts FEWEST:MOST to explore.")] = None,
    batch_tokens: Annotated[str | None, typer.Option("--batch-tokens", help="Global batch in tokens.")] = None,
    batch_range: Annotated[str | None, typer.Option("--batch-range", help="Global batch LOW:HIGH tokens.")] = None,
    objective: Annotated[str, typer.Option("--objective", help="time | cost | mfu | goodput-time.")] = "time",
    top: Annotated[int, typer.Option("--top", min=1, help="How many layouts to list.")] = 5,
    fix: Annotated[
        list[str] | None, typer.Option("--fix", help="Pin a field: section.field=value (repeatable).")
    ] = None,
    sweep: Annotated[
        list[str] | None,
        typer.Option(
            "--sweep",
            help="No search: compare variants field=a,b,c (repeatable; any plan or cluster field); cluster=a,b,c "
            "alone compares fleets, each at its best layout (twin fleet).",
        ),
    ] = None,
    overrides: SetOpt = None,
    workers: Annotated[int | None, typer.Option("--workers", help="Worker processes (default: every core).")] = None,
    ray: Annotated[
        str | None, typer.Option("--ray", help="Simulate on a Ray cluster: ADDRESS, or 'local' (the 'ray' extra).")
    ] = None,
    seeds: Annotated[int, typer.Option("--seeds", help="Seeds per finalist for --objective goodput-time.")] = 3,
    csv: Annotated[Path | None, typer.Option("--csv", help="Write every simulated layout (or variant) as CSV.")] = None,
    as_json: JsonOpt = False,
    limit: LimitOpt = None,
) -> None:
    """Find the best layouts of a model on a fleet: the top K by the objective, why each beats the next, the Pareto
    front over time to train, GPUs and memory headroom, and the plan as given beside them."""
    limits = limits_from(limit)
    csv = output_file(csv, "--csv") if csv is not None else None
    if sweep and len(sweep) == 1 and sweep[0].startswith("cluster="):  # fleets, each at its best layout
        fleets = [c.strip() for c in sweep[0].removeprefix("cluster=").split(",") if c.strip()]
        batch = front.coerce_range(batch_range or batch_tokens, "--batch-range" if batch_range else "--batch-tokens")
        fleet_cmd.show(source, fleets, overrides or [], gpus, batch, objective,
                       fix or [], seeds, workers, csv, as_json, limits)  # fmt: skip
        return
    if sweep:
        _sweep(source, sweep, overrides or [], csv, as_json)
        return
    if objective not in OBJECTIVES:
        raise PlanError(f"--objective {objective!r}: choose one of {', '.join(OBJECTIVES)}")
    if gpus and gpus_range:
        raise PlanError("--gpus and --gpus-range: give one (at most N GPUs, or a range FEWEST:MOST)")
    if batch_tokens and batch_range:
        raise PlanError("--batch-tokens and --batch-range: give one")
    gpu_arg = front.coerce_range(gpus_range, "--gpus-range") if gpus_range else front.coerce_range(gpus, "--gpus")
    if isinstance(gpu_arg, float):
        gpu_arg = int(gpu_arg)
    batch_arg = front.coerce_range(batch_range or batch_tokens, "--batch-range" if batch_range else "--batch-tokens")
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True, disable=as_json) as bar:
        task = bar.add_task("enumerating layouts", total=None)

        def shown(t: Tally) -> None:
            bar.update(task, description=f"{t.shapes:,} layouts seen, {t.pruned:,} pruned by bound, "
                                         f"{t.over_memory:,} over memory, {t.simulated:,} simulated")  # fmt: skip

        result, notes = front.run(
            source, cluster, overrides or [], gpu_arg, batch_arg, objective, top, fix or [], workers, shown, seeds,
            limits, ray,
        )  # fmt: skip
    if csv is not None:
        rows = [front.row(c, c.plan.model.seq_len) for c in result.simulated]
        pd.DataFrame(rows).sort_values("objective").to_csv(csv, index=False)
    if as_json:
        checked = api.published_fidelity(result.top[0].plan).to_json() if result.top else None
        emit_json({**front.as_mapping(result, notes), "published_fidelity": checked})
        return
    _show(result, notes, csv)


def _show(result: SearchResult, notes: tuple[str, ...], csv: Path | None) -> None:
    for note in notes:
        console.print(styled(("assumed: ", "dim"), note))
    console.print(_table(f"top {len(result.top)} by {result.objective}", result.top))
    console.print(_table("Pareto front: time to train, GPUs, memory headroom", result.pareto))
    for i, c in enumerate(result.top[:-1]):
        console.print(styled((f"#{i + 1} beats #{i + 2}: ", "dim"), why_better(c, result.top[i + 1])))
    given = result.given
    if isinstance(given, Candidate):
        best = result.top[0] if result.top else None
        gap = f" ({given.objective / best.objective - 1:+.1%} against the best)" if best else ""
        step = f"{given.outcome.step_time_s:.3f} s per step, MFU {given.outcome.mfu:.1%}{gap}"
        console.print(styled(("the plan as given: ", "bold"), f"{given.label}, {step}"))
    elif isinstance(result.given, str):
        console.print(styled(("the plan as given cannot run: ", "bold red"), result.given))
    if result.top:
        console.print(styled(("checked on: ", "dim"), api.published_fidelity(result.top[0].plan).line))
    t = result.tally
    console.print(styled(("searched: ", "dim"), f"{t.shapes:,} layouts; {t.pruned:,} pruned by bound, "
                         f"{t.over_memory:,} trades over memory, {t.invalid:,} invalid, {t.simulated:,} simulated"
                         + (f"; all simulated layouts in {csv}" if csv else "")))  # fmt: skip


def _table(title: str, cands: list[Candidate]) -> Table:
    table = Table(title=title)
    heads = ["#", "layout", "GPUs", "batch", "step s", "MFU", "free GiB", "days", "$M"]
    for head in heads + (["run days"] if any(c.run_wall_days for c in cands) else []):
        table.add_column(head, justify="left" if head == "layout" else "right", no_wrap=head == "layout")
    for i, c in enumerate(cands):
        o = c.outcome
        cells = [str(i + 1), c.label, f"{c.shape.gpus:,}", f"{c.shape.global_batch * c.plan.model.seq_len / 1e6:.1f}M",
                 f"{o.step_time_s:.3f}", f"{o.mfu:.1%}", f"{c.headroom_GiB:.1f}", f"{o.days_to_train:.1f}",
                 f"{c.cost_usd / 1e6:.2f}"]  # fmt: skip
        if any(x.run_wall_days for x in cands):
            wall = c.run_wall_days
            cells.append("" if not wall else f"{wall:.1f}" if wall < float("inf") else "cannot finish")
        table.add_row(*cells)
    return table


def _sweep(source: str, fields: list[str], overrides: list[str], csv: Path | None, as_json: bool) -> None:
    frame = front.sweep(source, fields, overrides)
    if csv is not None:
        frame.to_csv(csv, index=False)
    if as_json:
        emit_json({"variants": frame.to_dict(orient="records")})
        return
    table = Table(title=f"{source}: {len(frame)} variants")
    for col in frame.columns:
        table.add_column(col)
    for rec in frame.to_dict(orient="records"):
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in rec.values()))
    console.print(table)
