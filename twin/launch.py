"""`twin execute`: run a plan's layout for real by starting `torchrun -m executor.train` as a subprocess.

The twin never imports the executor (DESIGN.md: the plan and the run records are their only contract); it builds
the torchrun command for the plan's world size, runs it, and reads back the records it wrote. A single-node run
keeps its rendezvous and gloo/NCCL sockets on loopback; multi-node flags pass through to torchrun.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from plan import loader
from plan.loader import PlanError
from plan.records import RecordError, StepRecord, iter_records
from plan.schema import FAULT_KINDS, FaultSpec, Plan

REPO_ROOT = Path(__file__).resolve().parent.parent
console = Console()

# The same options as twin.cli's (which registers this command and wraps it in its `user_errors`); repeated here
# so this module does not import the CLI that imports it.
PlanArg = Annotated[str, typer.Argument(help="A plan YAML path or a preset name (see `twin presets`).")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a field: section.field=value (repeatable), e.g. layout.tp=4."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_command(
    plan_source: str,
    plan: Plan,
    *,
    overrides: list[str],
    steps: int,
    device: str,
    out: Path,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    inject: list[str] | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """The torchrun command line that runs `plan` on `nnodes` nodes of world_size / nnodes ranks each.

    With restarts, rendezvous goes through torchrun's c10d backend: the static one hands a restarted gang the
    stale gloo addresses of the previous one ('connectFullMesh failed'); see also `child_env`.
    """
    world = plan.layout.world_size
    if world % nnodes:
        raise PlanError(f"--nnodes {nnodes}: does not divide the plan's world size {world}; choose a divisor")
    port = str(master_port or free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes)]
    if max_restarts:
        cmd += [
            "--max-restarts",
            str(max_restarts),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{master_addr}:{port}",
        ]
    else:
        cmd += ["--node-rank", str(node_rank), "--master-addr", master_addr, "--master-port", port]
    cmd += ["--nproc-per-node", str(world // nnodes), "-m", "executor.train", "--plan", plan_source]
    for item in overrides:
        cmd += ["--set", item]
    for fault in inject or []:
        cmd += ["--inject", fault]
    return [*cmd, "--steps", str(steps), "--device", device, "--out", str(out)]


def plan_faults(plan: Plan, inject: list[str]) -> tuple[FaultSpec, ...]:
    """The plan's faults and `--inject`'s, checked: a malformed one raises PlanError in one line."""
    try:
        added = tuple(FaultSpec.parse(text) for text in inject)
    except ValueError as exc:
        raise PlanError(f"--inject: {exc}") from None
    for fault in added:
        if fault.rank >= plan.layout.world_size:
            raise PlanError(
                f"--inject {fault.label()}: rank {fault.rank} is not among the plan's "
                f"{plan.layout.world_size} ranks; pick one of 0-{plan.layout.world_size - 1}"
            )
    return (*plan.reliability.faults, *added)


def child_env(nnodes: int) -> dict[str, str]:
    """The environment for torchrun: this checkout first on the path; one node talks over loopback only."""
    env = dict(os.environ)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # a restarted gang must not reuse the old store's addresses
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if nnodes == 1:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env.setdefault(var, "lo")
    return env


def summarise(run_dir: Path) -> dict[str, Any]:
    """Rank 0's figures of a finished run: steps, last loss, median tokens/s and MFU after the first step."""
    records = [r for r in iter_records(run_dir / "records.jsonl") if isinstance(r, StepRecord) and r.rank == 0]
    if not records:
        return {"steps": 0}
    steady = records[1:] or records  # the first step pays for warm-up (allocations, first collectives)
    return {
        "steps": len(records),
        "loss": records[-1].loss,
        "tokens_per_s": statistics.median(r.tokens_per_s or 0.0 for r in steady),
        "mfu": statistics.median(r.mfu or 0.0 for r in steady),
        "step_s": statistics.median(r.step_s for r in steady),
    }


def execute(
    plan: PlanArg,
    overrides: SetOpt = None,
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps to run.")] = 10,
    device: Annotated[str, typer.Option(help="cpu (gloo) or cuda (NCCL).")] = "cpu",
    out: Annotated[Path | None, typer.Option(help="Run directory (default runs/<plan>-<time>).")] = None,
    nnodes: Annotated[int, typer.Option(min=1, help="Nodes (passed to torchrun).")] = 1,
    node_rank: Annotated[int, typer.Option(min=0, help="This node's rank (passed to torchrun).")] = 0,
    master_addr: Annotated[str, typer.Option(help="Rendezvous host (passed to torchrun).")] = "127.0.0.1",
    master_port: Annotated[int | None, typer.Option(help="Rendezvous port (default: a free one).")] = None,
    inject: Annotated[
        list[str] | None,
        typer.Option(help="Inject a fault: KIND@STEP[:RANK], KIND one of " + ", ".join(FAULT_KINDS) + " (repeatable)."),
    ] = None,
    max_restarts: Annotated[
        int | None,
        typer.Option(min=0, help="Gang restarts torchrun allows (default: one per crash, hang, ckpt-crash)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run the plan's parallel layout for real with torchrun and the executor; records go to the run directory."""
    if device not in ("cpu", "cuda"):
        raise PlanError(f"--device {device!r}: use cpu or cuda")
    p = loader.load(plan, overrides or [])
    faults = plan_faults(p, inject or [])
    if max_restarts is None:
        max_restarts = sum(f.kind in ("crash", "hang", "ckpt-crash") for f in faults)
    run_dir = out or Path("runs") / f"{p.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = torchrun_command(
        plan, p, overrides=overrides or [], steps=steps, device=device, out=run_dir, nnodes=nnodes,
        node_rank=node_rank, master_addr=master_addr, master_port=master_port, inject=inject,
        max_restarts=max_restarts,
    )  # fmt: skip
    result = subprocess.run(cmd, env=child_env(nnodes), capture_output=as_json, text=True, check=False)
    try:
        summary = summarise(run_dir) if (run_dir / "records.jsonl").exists() else {"steps": 0}
    except RecordError as exc:
        summary = {"steps": 0, "records_error": str(exc)}
    if as_json:
        tail = (result.stderr or "").strip().splitlines()[-1:] if result.returncode else []
        print(json.dumps({"ok": result.returncode == 0, "returncode": result.returncode, "run_dir": str(run_dir),
                   "world_size": p.layout.world_size, **summary, **({"error": tail[0]} if tail else {})}))  # fmt: skip
    elif result.returncode == 0 and summary["steps"]:
        console.print(
            f"[green]done[/]: {summary['steps']} steps of {p.name} on {p.layout.world_size} ranks → {run_dir}; "
            f"loss {summary['loss']:.4f}, {summary['tokens_per_s']:,.0f} tokens/s, MFU {100 * summary['mfu']:.2f}%",
            highlight=False,
            soft_wrap=True,
        )
    if result.returncode:
        raise typer.Exit(result.returncode)
