"""`twin validate`, `twin show`, `twin schema` and `twin presets`: plans and what follows from them."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from plan import loader
from twin import api
from twin.cli.options import JsonOpt, PlanArg, SetOpt, console, emit_json, err_console


def validate(plan: PlanArg, overrides: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Check a plan: schema, layout against model, and fit on its cluster."""
    p = api.load_plan(plan, overrides or [])
    facts = api.facts(p)
    if as_json:
        emit_json({"ok": True, "plan": p.name, **facts})
        return
    console.print(
        f"[green]ok[/]: {p.name} — {facts['world_size']:,} ranks on {p.cluster} "
        f"({facts['cluster_gpus']:,} × {facts['accelerator']}), {human_count(facts['params_total'])} parameters",
        highlight=False,
        soft_wrap=True,
    )


def show(plan: PlanArg, overrides: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Show the resolved plan, overrides applied, with what follows from it."""
    p = api.load_plan(plan, overrides or [])
    facts = api.facts(p)
    if as_json:
        emit_json({"plan": p.model_dump(mode="json"), "derived": facts})
        return
    table = Table(title=f"plan {p.name}", show_lines=False)
    table.add_column("field", style="cyan")
    table.add_column("value")
    for section in ("model", "layout", "training", "reliability"):
        for key, value in getattr(p, section).model_dump(mode="json").items():
            table.add_row(f"{section}.{key}", _fmt(value))
    table.add_row("cluster", p.cluster)
    table.add_section()
    for key, value in facts.items():
        table.add_row(f"[bold]{key}[/]", _fmt(value))
    console.print(table)


def human_count(n: float) -> str:
    """218k, 8.03B, 1.01T."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:g}"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, list) and len(value) > 12:
        return f"[{', '.join(map(str, value[:6]))}, … {len(value)} entries]"
    return "—" if value is None else str(value)


def schema(
    kind: Annotated[str, typer.Argument(help="plan, cluster or record.")] = "plan",
) -> None:
    """Print the JSON Schema of a plan (or cluster, or run record) file, for editors and validators."""
    from plan.schema_export import json_schema

    try:
        emit_json(json_schema(kind))
    except ValueError as exc:
        err_console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None


def presets(as_json: JsonOpt = False) -> None:
    """List the built-in plans, models and clusters."""
    listing = {
        "plans": loader.plan_presets(),
        "models": loader.model_presets(),
        "clusters": loader.cluster_names(),
    }
    if as_json:
        emit_json(listing)
        return
    for kind, names in listing.items():
        console.print(f"[bold]{kind}[/]: {', '.join(names)}")
