"""`twin fleet`: the same model on several fleets, each at its best layout, with time, cost, energy and goodput
(also what `twin search --sweep cluster=a,b,c` prints)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Annotated, Any

import pandas as pd
import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from plan.errors import PlanError
from plan.limits import Limits
from twin.cli.options import JsonOpt, LimitOpt, SetOpt, console, emit_json, err_console, limits_from, styled
from twin.outputs import output_file
from twin.search import fleet, front
from twin.search.engine import OBJECTIVES, Tally


def fleet_command(
    source: Annotated[str, typer.Argument(help="A model preset or a plan (preset or YAML path).")],
    clusters: Annotated[str, typer.Option("--clusters", help="Fleets to compare, comma-separated (topologies/).")],
    gpus: Annotated[str | None, typer.Option("--gpus", help="Use at most N GPUs of each fleet.")] = None,
    batch_tokens: Annotated[str | None, typer.Option("--batch-tokens", help="Global batch in tokens.")] = None,
    batch_range: Annotated[str | None, typer.Option("--batch-range", help="Global batch LOW:HIGH tokens.")] = None,
    objective: Annotated[str, typer.Option("--objective", help="time | cost | mfu | goodput-time.")] = "time",
    fix: Annotated[
        list[str] | None, typer.Option("--fix", help="Pin a field: section.field=value (repeatable).")
    ] = None,
    overrides: SetOpt = None,
    seeds: Annotated[int, typer.Option("--seeds", help="Whole-run seeds per fleet (goodput, cost, energy).")] = 1,
    workers: Annotated[int | None, typer.Option("--workers", help="Worker processes (default: every core).")] = None,
    csv: Annotated[Path | None, typer.Option("--csv", help="Write the comparison as CSV.")] = None,
    as_json: JsonOpt = False,
    limit: LimitOpt = None,
) -> None:
    """Compare fleets for one model: each fleet's best layout by the objective (a search on that fleet), then its
    whole run with failures and checkpoints: step, MFU, days, goodput, cost and energy, a row per fleet."""
    if batch_tokens and batch_range:
        raise PlanError("--batch-tokens and --batch-range: give one")
    names = [c.strip() for c in clusters.split(",") if c.strip()]
    batch = front.coerce_range(batch_range or batch_tokens, "--batch-range" if batch_range else "--batch-tokens")
    show(source, names, overrides or [], gpus, batch, objective, fix or [], seeds, workers, csv, as_json,
         limits_from(limit))  # fmt: skip


def show(
    source: str,
    clusters: list[str],
    overrides: list[str],
    gpus: str | None,
    batch: front.Range | None,
    objective: str,
    fixes: list[str],
    seeds: int,
    workers: int | None,
    csv: Path | None,
    as_json: bool,
    limits: Limits,
) -> None:
    """Run the comparison with a progress line and print (or write) it; `gpus` caps each fleet (--gpus N)."""
    cap = front.coerce_range(gpus, "--gpus")
    if isinstance(cap, tuple):
        raise PlanError(f"--gpus {gpus}: give one count; each fleet is searched up to it")
    if objective not in OBJECTIVES:
        raise PlanError(f"--objective {objective!r}: choose one of {', '.join(OBJECTIVES)}")
    csv = output_file(csv, "--csv") if csv is not None else None
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True, disable=as_json) as bar:
        task = bar.add_task("", total=None)

        def shown(name: str, t: Tally | None) -> None:
            seen = f"{t.shapes:,} layouts seen, {t.simulated:,} simulated" if t else "starting"
            bar.update(task, description=f"{name}: {seen}")

        frame = fleet.compare(
            source, clusters, overrides, gpus=int(cap) if cap else None, batch_tokens=batch, objective=objective,
            fixes=fixes, seeds=seeds, workers=workers, progress=shown, limits=limits,
        )  # fmt: skip
    if csv is not None:
        frame.to_csv(csv, index=False)
    if as_json:
        emit_json({"fleets": _json_records(frame)})
        return
    console.print(_table(source, frame))
    for rec in frame[frame.reason != ""].to_dict(orient="records"):
        console.print(styled((f"{rec['cluster']} cannot run: ", "bold red"), rec["reason"]))
    for rec in frame[frame.note != ""].to_dict(orient="records"):
        console.print(styled((f"{rec['cluster']}: ", "bold yellow"), rec["note"]))


def _table(source: str, frame: pd.DataFrame) -> Table:
    table = Table(title=f"{source}: {len(frame)} fleets, each at its best layout")
    heads = ["fleet", "accelerator", "GPUs", "layout", "step s", "MFU", "days", "run days", "goodput", "$M", "MWh",
             "published check"]  # fmt: skip
    for head in heads:
        table.add_column(head, justify="left" if head in ("fleet", "accelerator", "layout") else "right")
    for r in frame.to_dict(orient="records"):
        if not isinstance(r["layout"], str):  # no layout fits (or the fleet is unknown)
            accelerator = r["accelerator"] if isinstance(r["accelerator"], str) else ""
            table.add_row(r["cluster"], accelerator, "", "cannot run", *[""] * 8)
            continue
        gpus = f"{r['gpus']:,.0f} of {r['fleet_gpus']:,.0f}"
        step = [gpus, r["layout"], f"{r['step_time_s']:.2f}", f"{r['mfu']:.1%}", f"{r['ideal_days']:.1f}"]
        checked = _checked(r)
        if r["reason"]:  # the step stands, the whole run does not finish
            table.add_row(r["cluster"], r["accelerator"], *step, "cannot finish", "", "", "", checked)
            continue
        table.add_row(r["cluster"], r["accelerator"], *step, f"{r['wall_days']:.1f}", f"{r['goodput']:.1%}",
                      f"{r['cost_usd'] / 1e6:,.2f}", f"{r['energy_mwh']:,.0f}", checked)  # fmt: skip
    return table


COUNTS = ("fleet_gpus", "gpus", "published_rows")
"""Columns of whole numbers that pandas holds as floats once a row lacks them."""


def _json_records(frame: pd.DataFrame) -> list[dict[Hashable, Any]]:
    """The rows as JSON takes them: a figure a row lacks as null (pandas holds it as NaN, which JSON has no word for
    and strict parsers refuse), counts as integers."""
    records = frame.astype(object).where(frame.notna(), None).to_dict(orient="records")
    for r in records:
        for col in COUNTS:
            if isinstance(r.get(col), float):
                r[col] = int(r[col])
    return records


def _checked(r: Mapping[Hashable, Any]) -> str:
    """The twin's record on published runs of the best plan's kind on the fleet (twin/fidelity.py), in brief: how
    many, and their mean absolute error."""
    rows = r.get("published_rows")
    if not isinstance(rows, (int, float)) or rows != rows:  # no plan (NaN), or an older frame
        return ""
    if rows == 0:
        return "none"
    return f"{int(rows)} runs, {r['published_mean_abs_error']:.1%}"
