"""`twin predict`: one optimizer step as two tables (headline figures and where the step goes), or JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

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
    styled,
)
from twin.fit import oom_message
from twin.outputs import output_file
from twin.step.predict import PredictOptions, StepPrediction


def predict(
    plan: PlanArg,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
    trace: Annotated[Path | None, typer.Option("--trace", help="Write the step as a Chrome/Perfetto trace.")] = None,
    timeline: Annotated[bool, typer.Option("--timeline", help="With --json, include every simulated action.")] = False,
    limit: LimitOpt = None,
    allow_oom: AllowOomOpt = False,
) -> None:
    """Predict one optimizer step: time, breakdown, memory, MFU, and days to train. A plan that does not fit in
    memory exits 2 (with what would make it fit) unless --allow-oom."""
    from twin.step.trace import write_trace

    limits = limits_from(limit)
    trace = output_file(trace, "--trace") if trace is not None else None
    loaded = api.load_plan(plan, overrides or [], limits)
    if not allow_oom:
        api.check_fit(loaded, limits)
    every = PredictOptions(every_microbatch=trace is not None or timeline)  # a timeline of every action
    pred = api.predict(loaded, every, limits=limits)
    if trace is not None:
        write_trace(pred, trace)
    if not pred.fits:
        warning = oom_message(loaded, api.cluster_of(loaded), pred.memory, allow_hint=False)
        err_console.print(styled(("warning:", "bold yellow"), " ", warning), soft_wrap=True)
    for note in pred.notes:
        err_console.print(styled(("note:", "bold yellow"), " ", note), soft_wrap=True)
    checked = api.published_fidelity(loaded)
    if as_json:
        emit_json({**pred.to_json(timeline=timeline), "published_fidelity": checked.to_json()})
        return
    show_prediction(pred, trace, checked.line)


def _utilisation(pred: StepPrediction) -> str:
    """MFU and HFU by the published convention; for fp8 plans, MFU against the bf16 peak beside."""
    bf16 = f", {pred.mfu_bf16:.1%} of the bf16 peak" if abs(pred.mfu_bf16 - pred.mfu) > 1e-12 else ""
    return f"{pred.mfu:.1%} / {pred.hfu:.1%}{bf16}  ({pred.tflops_per_gpu:.0f} model TFLOP/s per GPU)"


def show_prediction(pred: StepPrediction, trace: Path | None, record: str | None = None) -> None:
    """The prediction as two tables: headline figures and where the step goes; `record`, the twin's record on
    published runs of the plan's kind (twin/fidelity.py)."""
    head = Table(title=f"{pred.plan} on {pred.cluster} — {pred.world_size:,} GPUs", show_header=False)
    head.add_column(style="cyan")
    head.add_column()
    mem = pred.memory
    for key, value in (
        ("step time", f"{pred.step_time_s:.3f} s  ({pred.num_microbatches} microbatches per replica)"),
        ("throughput", f"{pred.tokens_per_s:,.0f} tokens/s"),
        ("MFU / HFU", _utilisation(pred)),
        ("bubble", f"{pred.bubble_fraction:.1%}"),
        (
            "memory",
            f"{mem.peak:.1f} of {mem.capacity:.1f} GiB — params {mem.params:.1f}, grads {mem.grads:.1f}, "
            f"optimizer {mem.optimizer:.1f}, activations {mem.activations:.1f}, transient {mem.transient:.1f}",
        ),
        ("fits", styled(("yes", "") if pred.fits else ("NO", "bold red"), f" — {mem.reason}")),
        ("to train", f"{pred.days_to_train:,.1f} days, {pred.gpu_hours:,.0f} GPU-hours"),
        ("simulated", f"{pred.events:,} events"),
        ("checked on", record),
    ):
        if value is not None:
            head.add_row(key, value)
    console.print(head)
    parts = Table(title="where the step goes")
    parts.add_column("phase", style="cyan")
    parts.add_column("seconds", justify="right")
    parts.add_column("share", justify="right")
    for phase, seconds in pred.breakdown_s.items():
        parts.add_row(phase, f"{seconds:.4f}", f"{seconds / pred.step_time_s:.1%}")
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
