"""`twin fidelity`: the twin's record on published runs, every group or the one a plan is checked in."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated

import typer
from rich.table import Table

from plan.errors import PlanError
from twin import api
from twin.cli.options import JsonOpt, SetOpt, console, emit_json, styled
from twin.fidelity import FILE, Fidelity, recorded


def fidelity(
    plan: Annotated[str | None, typer.Argument(help="A plan: show the record it is checked on.")] = None,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The twin's error on published training runs, by accelerator, precision and MoE (validation rows only;
    `python benchmarks/published_figures.py` writes them); with PLAN, the record of the plan's kind, or why none
    applies."""
    if plan is not None:
        checked = api.published_fidelity(api.load_plan(plan, overrides or []))
        if as_json:
            emit_json({"plan": plan, **checked.to_json()})
            return
        console.print(styled(("checked on: ", "bold"), checked.line))
        return
    groups = recorded()
    if groups is None:
        raise PlanError(f"{FILE} is missing: `python benchmarks/published_figures.py` writes it")
    if as_json:
        emit_json({"groups": [g.to_json() for g in groups]})
        return
    console.print(groups_table(groups))
    console.print(styled(("tables: ", "dim"), ", ".join(sorted({t for g in groups for t in g.tables}))))


def groups_table(groups: Iterable[Fidelity]) -> Table:
    """The record's groups as a table (`twin fidelity`, and benchmarks/published_figures.py as it writes them)."""
    table = Table(title="the twin against published runs it was not fitted on, worst group first")
    for col in ("accelerator", "precision", "model", "rows", "mean |error|", "9 in 10 within", "optimistic", "worst"):
        table.add_column(col, justify="left" if col in ("accelerator", "precision", "model", "worst") else "right")
    for g in groups:
        table.add_row(
            g.accelerator, g.precision, "MoE" if g.moe else "dense", str(g.rows), f"{g.mean_abs_error:.1%}",
            f"{g.p90_abs_error:.1%}", str(g.optimistic_rows), f"{g.worst_error:+.1%} {g.worst}",
        )  # fmt: skip
    return table
