"""`twin execute`: run a plan's parallel layout for real under torchrun (through `twin.api.execute`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from plan.reliability import FAULT_KINDS
from twin import api
from twin.cli.launch import DEFAULT_TIMEOUT_S, summary_line
from twin.cli.options import JsonOpt, PlanArg, SetOpt, console, emit_json


def execute(
    plan: PlanArg,
    overrides: SetOpt = None,
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps to run.")] = 10,
    device: Annotated[str, typer.Option(help="cpu (gloo) or cuda (NCCL).")] = "cpu",
    out: Annotated[Path | None, typer.Option(help="Run directory (default runs/<plan>-<time>).")] = None,
    nnodes: Annotated[
        str, typer.Option(help="Nodes, N or MIN:MAX (elastic: world_size / MAX ranks per node; passed to torchrun).")
    ] = "1",
    node_rank: Annotated[int, typer.Option(min=0, help="This node's rank (passed to torchrun).")] = 0,
    master_addr: Annotated[str, typer.Option(help="Rendezvous host (passed to torchrun).")] = "127.0.0.1",
    master_port: Annotated[int | None, typer.Option(help="Rendezvous port (default: a free one).")] = None,
    inject: Annotated[
        list[str] | None,
        typer.Option(help="Inject a fault: KIND@STEP[:RANK], KIND one of " + ", ".join(FAULT_KINDS) + " (repeatable)."),
    ] = None,
    max_restarts: Annotated[
        int | None,
        typer.Option(
            min=0, help="Gang restarts torchrun allows (default: one per crash, hang, ckpt-crash; elastic: at least 3)."
        ),
    ] = None,
    rdzv_conf: Annotated[
        str | None,
        typer.Option(help="torchrun's --rdzv-conf, e.g. last_call_timeout=2,keep_alive_interval=1 (elastic)."),
    ] = None,
    timeout_s: Annotated[
        float, typer.Option("--timeout-s", min=1, help="Wall limit of the whole launch; the gang is killed past it.")
    ] = DEFAULT_TIMEOUT_S,
    stats_every: Annotated[
        int, typer.Option(min=0, help="Record per-layer norms and MoE expert loads every k steps (0: never).")
    ] = 10,
    profile_step: Annotated[
        int | None,
        typer.Option(min=0, help="Trace step N (from 0) on every rank with torch.profiler into <out>/profile/."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run the plan's parallel layout for real with torchrun and the executor; records go to the run directory."""
    run = api.execute(
        plan, overrides or [], steps=steps, device=device, out=out, nnodes=nnodes, node_rank=node_rank,
        master_addr=master_addr, master_port=master_port, inject=inject or [], max_restarts=max_restarts,
        rdzv_conf=rdzv_conf, capture=as_json, timeout_s=timeout_s, stats_every=stats_every, profile_step=profile_step,
    )  # fmt: skip
    if as_json:
        emit_json(run.to_json())
    elif run.ok and run.summary.get("steps"):
        loaded = api.load_plan(plan, overrides or [])
        console.print(summary_line(run.summary, loaded, run.run_dir), highlight=False, soft_wrap=True)
    if run.returncode:
        raise typer.Exit(run.returncode)
