"""`twin validate`, `twin show`, `twin schema` and `twin presets`: plans and what follows from them."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from plan import loader
from plan.cluster import Cluster
from plan.clusters import WhatIf
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
    """Show the resolved plan and cluster, overrides applied (cluster what-ifs marked), with what follows."""
    p = api.load_plan(plan, overrides or [])
    facts = api.facts(p, fabric=True)
    cluster, what_if = api.cluster_what_if(p)
    if as_json:
        emit_json(
            {
                "plan": p.model_dump(mode="json"),
                "derived": facts,
                "cluster": cluster.model_dump(mode="json", exclude_none=True),
                "cluster_what_if": {"set": list(what_if.set_paths), "derived": what_if.derived},
            }
        )
        return
    table = Table(title=f"plan {p.name}", show_lines=False)
    table.add_column("field", style="cyan")
    table.add_column("value")
    for section in ("model", "layout", "training", "reliability"):
        for key, value in getattr(p, section).model_dump(mode="json").items():
            table.add_row(f"{section}.{key}", _fmt(value))
    table.add_row("cluster", escape(str(p.cluster)))
    table.add_section()
    for key, value in facts.items():
        table.add_row(f"[bold]{key}[/]", _fmt(value))
    console.print(table)
    console.print(cluster_table(cluster, what_if))


def cluster_table(cluster: Cluster, what_if: WhatIf) -> Table:
    """Every number of the resolved cluster (sources left out), the fields a what-if set or moved marked."""
    title = f"cluster {cluster.name}" + (" — [bold yellow]what-if[/]" if what_if.set_paths else "")
    table = Table(title=title)
    table.add_column("field", style="cyan", no_wrap=True)
    table.add_column("value")
    table.add_column("")
    data = cluster.model_dump(mode="json", exclude_none=True, exclude={"description", "calibration"})
    for path, value in flatten(data):
        mark = "[bold yellow]set by what-if[/]" if path in what_if.set_paths else ""
        mark = mark or (f"[yellow]{escape(what_if.derived[path])}[/]" if path in what_if.derived else "")
        table.add_row(path, escape(_fmt(value)), mark)
    return table


def flatten(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """A nested mapping as (dotted path, leaf value) pairs; list elements by index; `source` texts left out."""
    if isinstance(node, dict):
        items = [(k, v) for k, v in node.items() if k != "source"]
    elif isinstance(node, list) and any(isinstance(v, dict | list) for v in node):
        items = [(str(i), v) for i, v in enumerate(node)]
    else:
        return [(prefix, node)]
    return [pair for key, value in items for pair in flatten(value, f"{prefix}.{key}" if prefix else key)]


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
