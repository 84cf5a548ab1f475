"""`twin validate`, `twin show`, `twin schema` and `twin presets`: plans and what follows from them."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from plan import loader
from plan.cluster import Cluster
from plan.clusters import WhatIf
from plan.errors import PlanError
from twin import api, fit
from twin.cli.options import (
    AllowOomOpt,
    JsonOpt,
    LimitOpt,
    PlanArg,
    SetOpt,
    console,
    emit_json,
    err_console,
    fail,
    limits_from,
    styled,
)
from twin.fit import oom_message


def validate(
    plan: PlanArg,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
    limit: LimitOpt = None,
    allow_oom: AllowOomOpt = False,
) -> None:
    """Check a plan: schema, layout against model, size on its cluster, and that it fits in memory."""
    result = api.validate(plan, overrides or [], limits_from(limit), allow_oom=allow_oom)
    if not result.ok or result.plan is None:
        raise PlanError(result.reasons[0])
    p, facts = result.plan, result.facts
    if as_json:
        emit_json({"ok": True, "plan": p.name, **facts})
        return
    console.print(
        styled(
            ("ok", "green"),
            f": {p.name} — {facts['world_size']:,} ranks on {p.cluster} "
            f"({facts['cluster_gpus']:,} × {facts['accelerator']}), {human_count(facts['params_total'])} parameters, "
            f"{facts['memory_peak_GiB']:,.1f} of {facts['memory_capacity_GiB']:,.1f} GiB per GPU",
        ),
        soft_wrap=True,
    )
    if not facts["fits"]:
        cluster = api.cluster_of(p)
        err_console.print(
            styled(("warning:", "bold yellow"), " ", oom_message(p, cluster, fit.memory(p, cluster), False))
        )


def show(plan: PlanArg, overrides: SetOpt = None, as_json: JsonOpt = False, limit: LimitOpt = None) -> None:
    """Show the resolved plan and cluster, overrides applied (cluster what-ifs marked), with what follows; a
    catalogue cluster's name shows that cluster alone (`--set PATH=value` what-ifs on its fields)."""
    limits = limits_from(limit)
    if plan in loader.cluster_names() and plan not in loader.plan_presets():
        cluster, what_if = api.load_cluster_what_if(plan, overrides or [], limits)
        if as_json:
            emit_json({"cluster": cluster.model_dump(mode="json", exclude_none=True)})
        else:
            console.print(cluster_table(cluster, what_if))
        return
    p = api.load_plan(plan, overrides or [], limits)
    facts = api.facts(p, fabric=True, limits=limits)
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
    table.add_row("cluster", str(p.cluster))
    table.add_section()
    for key, value in facts.items():
        table.add_row(styled((key, "bold")), _fmt(value))
    console.print(table)
    console.print(cluster_table(cluster, what_if))


def cluster_table(cluster: Cluster, what_if: WhatIf) -> Table:
    """Every number of the resolved cluster (sources left out), the fields a what-if set or moved marked."""
    title = styled(f"cluster {cluster.name}")
    if what_if.set_paths:
        title.append(" — ").append("what-if", style="bold yellow")
    table = Table(title=title)
    table.add_column("field", style="cyan", no_wrap=True)
    table.add_column("value")
    table.add_column("")
    data = cluster.model_dump(mode="json", exclude_none=True, exclude={"description", "calibration"})
    for path, value in flatten(data):
        mark = styled(("set by what-if", "bold yellow")) if path in what_if.set_paths else styled()
        if not mark and path in what_if.derived:
            mark = styled((what_if.derived[path], "yellow"))
        table.add_row(path, _fmt(value), mark)
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
        fail(str(exc), as_json=False)


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
        console.print(styled((kind, "bold"), f": {', '.join(names)}"))
