"""`twin trace`: the twin's predicted step beside the step a run profiled, in one Perfetto trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from plan.records import plan_as_ran, read_manifest
from twin import api
from twin.cli.options import JsonOpt, LimitOpt, SetOpt, console, emit_json, limits_from
from twin.outputs import output_file
from twin.step.predict import PredictOptions


def trace(
    measured: Annotated[
        Path, typer.Option("--measured", help="A run directory written with --profile-step N (twin execute).")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="The merged trace to write (JSON).")],
    plan: Annotated[str | None, typer.Argument(help="The plan the run used (default: the run's, as it ran).")] = None,
    overrides: SetOpt = None,
    limit: LimitOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write the predicted step and the run's profiled step as one Perfetto trace: process 0 the twin, process 1
    the run, with the same two tracks per pipeline rank (compute, comm). Open it in ui.perfetto.dev."""
    from twin.step.merge_trace import merge_traces, read_profile
    from twin.step.trace import chrome_trace

    limits = limits_from(limit)
    out = output_file(out, "--out")
    source = plan if plan is not None else plan_as_ran(read_manifest(measured))
    loaded = api.load_plan(source, overrides or [], limits)
    step, traces = read_profile(measured, loaded.layout.pp)
    pred = api.predict(loaded, PredictOptions(every_microbatch=True), limits=limits)
    merged = merge_traces(chrome_trace(pred), traces, step)
    out.write_text(json.dumps(merged))
    predicted, measured_n = (sum(e["ph"] == "X" and e["pid"] == p for e in merged["traceEvents"]) for p in (0, 1))
    if as_json:
        emit_json({"ok": True, "out": str(out), "step": step, "predicted": predicted, "measured": measured_n})
        return
    console.print(
        f"trace written to {out}: {predicted:,} predicted and {measured_n:,} measured events (step {step} of "
        f"{measured}); open it in ui.perfetto.dev",
        soft_wrap=True,
    )
