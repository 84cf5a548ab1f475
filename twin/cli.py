"""The `twin` command: a thin front door over plan/ and twin/.

Every command takes a plan path or preset name, repeatable `--set section.field=value` overrides and `--json`
(exactly one JSON object on stdout). Bad input prints one line naming the file, field and fix, and exits 2.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from plan import loader
from plan.loader import PlanError
from plan.model_math import model_flops_per_token, param_count
from plan.records import RecordError
from plan.schema import Plan

app = typer.Typer(
    name="twin",
    help="ClusterTwin: predict, simulate and execute training plans on clusters up to 100k GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

PlanArg = Annotated[str, typer.Argument(help="A plan YAML path or a preset name (see `twin presets`).")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a field: section.field=value (repeatable), e.g. layout.tp=4."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")]

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(func: F) -> F:
    """Turn bad input into one line on stderr (or a JSON error object with --json) and exit code 2."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (PlanError, RecordError) as exc:
            if kwargs.get("as_json"):
                print(json.dumps({"ok": False, "error": str(exc)}))
            else:
                err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def emit_json(obj: Any) -> None:
    """Write one JSON object to stdout."""
    sys.stdout.write(json.dumps(obj, default=str) + "\n")


def derived_facts(plan: Plan) -> dict[str, Any]:
    """What follows from a plan and its cluster: sizes a user checks before running it."""
    cluster = loader.plan_cluster(plan)
    params = param_count(plan.model)
    world = plan.layout.world_size
    return {
        "world_size": world,
        "nodes": -(-world // cluster.node.gpus),
        "cluster_gpus": cluster.gpus,
        "accelerator": cluster.accelerator.name,
        "params_total": params.total,
        "params_active": params.active,
        "model_flops_per_token": model_flops_per_token(plan.model),
        "microbatches_per_replica": plan.num_microbatches,
        "tokens_per_step": plan.tokens_per_step,
        "total_steps": plan.total_steps,
        "stage_layers": list(plan.stage_layer_counts),
    }


@app.command()
@user_errors
def validate(plan: PlanArg, overrides: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Check a plan: schema, layout against model, and fit on its cluster."""
    p = loader.load(plan, overrides or [])
    facts = derived_facts(p)
    if as_json:
        emit_json({"ok": True, "plan": p.name, **facts})
        return
    console.print(
        f"[green]ok[/]: {p.name} — {facts['world_size']:,} ranks on {p.cluster} "
        f"({facts['cluster_gpus']:,} × {facts['accelerator']}), {human_count(facts['params_total'])} parameters",
        highlight=False,
        soft_wrap=True,
    )


@app.command()
@user_errors
def show(plan: PlanArg, overrides: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Show the resolved plan, overrides applied, with what follows from it."""
    p = loader.load(plan, overrides or [])
    facts = derived_facts(p)
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


@app.command()
@user_errors
def predict(
    plan: PlanArg,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
    trace: Annotated[Path | None, typer.Option("--trace", help="Write the step as a Chrome/Perfetto trace.")] = None,
    timeline: Annotated[bool, typer.Option("--timeline", help="With --json, include every simulated action.")] = False,
) -> None:
    """Predict one optimizer step: time, breakdown, memory, MFU, and days to train."""
    from twin.predict import predict as run_predict
    from twin.trace import write_trace

    p = loader.load(plan, overrides or [])
    pred = run_predict(p)
    if trace is not None:
        write_trace(pred, trace)
    if as_json:
        emit_json(pred.to_json(timeline=timeline))
        return
    show_prediction(pred, trace)


def show_prediction(pred: Any, trace: Path | None) -> None:
    """The prediction as two tables: headline figures and where the step goes."""
    head = Table(title=f"{pred.plan} on {pred.cluster} — {pred.world_size:,} GPUs", show_header=False)
    head.add_column(style="cyan")
    head.add_column()
    mem = pred.memory
    for key, value in (
        ("step time", f"{pred.step_time_s:.3f} s  ({pred.num_microbatches} microbatches per replica)"),
        ("throughput", f"{pred.tokens_per_s:,.0f} tokens/s"),
        ("MFU / HFU", f"{pred.mfu:.1%} / {pred.hfu:.1%}  ({pred.tflops_per_gpu:.0f} model TFLOP/s per GPU)"),
        ("bubble", f"{pred.bubble_fraction:.1%}"),
        (
            "memory",
            f"{mem.peak:.1f} of {mem.capacity:.1f} GiB — params {mem.params:.1f}, grads {mem.grads:.1f}, "
            f"optimizer {mem.optimizer:.1f}, activations {mem.activations:.1f}, transient {mem.transient:.1f}",
        ),
        ("fits", ("yes" if pred.fits else "[bold red]NO[/]") + f" — {mem.reason}"),
        ("to train", f"{pred.days_to_train:,.1f} days, {pred.gpu_hours:,.0f} GPU-hours"),
        ("simulated", f"{pred.events:,} events"),
    ):
        head.add_row(key, value)
    console.print(head)
    parts = Table(title="where the step goes")
    parts.add_column("phase", style="cyan")
    parts.add_column("seconds", justify="right")
    parts.add_column("share", justify="right")
    for key, value in pred.breakdown_s.items():
        parts.add_row(key, f"{value:.4f}", f"{value / pred.step_time_s:.1%}")
    console.print(parts)
    comm = Table(title="collectives (one typical call per axis)")
    for col in ("axis", "op", "algorithm", "tier", "ranks", "busbw GB/s", "seconds"):
        comm.add_column(col)
    for axis, c in pred.collectives.items():
        comm.add_row(
            axis, c["op"], c["algorithm"], c["tier"], str(c["ranks"]), f"{c['busbw_GBps']:.1f}", f"{c['seconds']:.2e}"
        )
    console.print(comm)
    if trace is not None:
        console.print(f"trace written to {trace} (open in ui.perfetto.dev)")


@app.command("run")
@user_errors
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
    from twin import run_report

    p = loader.load(plan, overrides or [])
    if sweep_checkpoint:
        run_report.sweep(p, seed, seeds, as_json)
    elif seeds > 1:
        run_report.many(p, seed, seeds, as_json)
    else:
        run_report.single(p, seed, as_json)


@app.command()
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


@app.command()
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


from twin.calibrate_cli import bench, calibrate_command, loop  # noqa: E402
from twin.launch import execute  # noqa: E402

app.command()(user_errors(execute))
app.command()(user_errors(bench))
app.command("calibrate")(user_errors(calibrate_command))
app.command()(user_errors(loop))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
