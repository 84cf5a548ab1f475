"""Launching the executor: the torchrun command for a plan, its environment, and what a finished run did.

The only place the project starts the executor (`torchrun -m executor.train`) as a subprocess; `twin execute` and
`twin.api.execute` call `launch` here.

The twin never imports the executor (DESIGN.md: the plan and the run records are their only contract); it builds
the torchrun command for the plan's world size, runs it, and reads back the records it wrote. A single-node run
keeps its rendezvous and gloo/NCCL sockets on loopback; multi-node flags pass through to torchrun.

`--nnodes MIN:MAX` is elastic membership: each node (one `twin execute` each, the same --out, --master-addr and
--master-port) runs world_size / MAX ranks, torchrun's c10d rendezvous admits between MIN and MAX nodes, and the
executor (`--elastic`) re-derives dp from the world it is given. A node lost mid-run stops the gang; the nodes
left rendezvous again once the lost one's keep-alive expires and the last call has passed (`--rdzv-conf`
last_call_timeout, keep_alive_interval, keep_alive_max_attempt; torch's defaults 30 s, 5 s and 3) and resume
from the last checkpoint with a smaller dp.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plan.cache import CACHE_ENV, cache_dir, default_corpus
from plan.device import fp8_refusal
from plan.loader import PlanError
from plan.records import EventRecord, RecordError, StepRecord, iter_records
from plan.reliability import FaultSpec
from plan.schema import Plan
from twin.outputs import output_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
ELASTIC_RESTARTS = 3  # default restarts of an elastic run: a few lost nodes before giving up
DEFAULT_TIMEOUT_S = 24 * 3600.0
"""Wall limit of one executor launch unless the caller sets one: a day, far beyond any run this project starts
on a CPU host, but finite, so a wedged gang cannot hold a terminal or a test forever."""


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
    nnodes: int | str = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    inject: list[str] | None = None,
    max_restarts: int = 0,
    rdzv_conf: str | None = None,
    stats_every: int = 10,
    profile_step: int | None = None,
) -> list[str]:
    """The torchrun command line that runs `plan` on `nnodes` (N or MIN:MAX) nodes of world_size / MAX ranks each.

    With restarts or a range of nodes, rendezvous goes through torchrun's c10d backend: the static one hands a
    restarted gang the stale gloo addresses of the previous one ('connectFullMesh failed'), and admits no range;
    see also `child_env`. The rendezvous id is the run directory's name: nodes given the same --out meet.
    """
    world = plan.layout.world_size
    least, most = parse_nnodes(nnodes)
    if world % most:
        raise PlanError(f"--nnodes {nnodes}: {most} does not divide the plan's world size {world}; choose a divisor")
    port = str(master_port or free_port())
    elastic = least < most
    if elastic:
        check_gang_sizes(plan, least, most)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{least}:{most}" if elastic else str(most)]
    if max_restarts or elastic:
        cmd += ["--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-id", out.name]
        cmd += ["--rdzv-endpoint", f"{master_addr}:{port}", *(["--rdzv-conf", rdzv_conf] if rdzv_conf else [])]
    else:
        cmd += ["--node-rank", str(node_rank), "--master-addr", master_addr, "--master-port", port]
    cmd += ["--nproc-per-node", str(world // most), "-m", "executor.train", "--plan", plan_source]
    for item in overrides:
        cmd += ["--set", item]
    for fault in inject or []:
        cmd += ["--inject", fault]
    cmd += ["--steps", str(steps), "--device", device, "--out", str(out), "--stats-every", str(stats_every)]
    cmd += ["--profile-step", str(profile_step)] if profile_step is not None else []
    return [*cmd, *(["--elastic"] if elastic else [])]


def check_gang_sizes(plan: Plan, least: int, most: int) -> None:
    """Every gang the rendezvous may form (MIN to MAX nodes of world_size / MAX ranks) must carry the plan's
    model-parallel layout and split its global batch evenly over the dp it gets; PlanError names those that cannot.
    """
    lay, per_node = plan.layout, plan.layout.world_size // most
    model_ranks = lay.tp * lay.pp * lay.cp
    bad = [
        k
        for k in range(least, most + 1)
        if (k * per_node) % model_ranks or plan.training.global_batch % (k * per_node // model_ranks)
    ]
    if bad:
        raise PlanError(
            f"--nnodes {least}:{most}: a gang of {', '.join(map(str, bad))} node(s) of {per_node} ranks cannot run "
            f"the plan: its ranks must be a multiple of tp·pp·cp = {model_ranks} and dp = ranks / {model_ranks} must "
            f"divide training.global_batch={plan.training.global_batch}; narrow the range"
        )


def parse_nnodes(text: int | str) -> tuple[int, int]:
    """`N` or `MIN:MAX` (torchrun's syntax) as (MIN, MAX); PlanError in one line when malformed."""
    least, colon, most = str(text).partition(":")
    most = most if colon else least
    if not (least.isdigit() and most.isdigit()) or not 1 <= int(least) <= int(most):
        raise PlanError(f"--nnodes {text}: write N or MIN:MAX with 1 <= MIN <= MAX, e.g. 1:2")
    return int(least), int(most)


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


def child_env(nnodes: int, master_addr: str = "127.0.0.1") -> dict[str, str]:
    """The environment for torchrun: this checkout first on the path; one node, or several simulated on this
    machine around a loopback rendezvous, talk over loopback only."""
    env = dict(os.environ)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # a restarted gang must not reuse the old store's addresses
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if nnodes == 1 or master_addr in ("127.0.0.1", "localhost"):
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env.setdefault(var, "lo")
    return env


def summarise(run_dir: Path, since_unix: float = 0.0) -> dict[str, Any]:
    """Rank 0's figures of what ran since `since_unix`: distinct steps, restarts, the steps replayed after them,
    the gangs' world sizes, the last loss, and median tokens/s and MFU after the first step.

    A restart replays the steps after its checkpoint, so step records repeat; each gang's rank 0 writes one
    `start` event, so the gangs after the first are the restarts.
    """
    steps: list[StepRecord] = []
    worlds: list[int] = []
    for r in iter_records(run_dir / "records.jsonl"):
        if isinstance(r, StepRecord) and r.rank == 0 and r.time_unix >= since_unix:
            steps.append(r)
        elif isinstance(r, EventRecord) and r.event == "start" and r.time_unix >= since_unix:
            worlds.append(int(r.detail["world_size"]))
    if not steps:
        return {"steps": 0, "restarts": max(0, len(worlds) - 1)}
    last = {r.step: r for r in steps}  # a replayed step's last record is the one that counts
    steady = steps[1:] or steps  # the first step pays for warm-up (allocations, first collectives)
    return {
        "steps": len(last),
        "first_step": min(last),
        "restarts": max(0, len(worlds) - 1),
        "steps_replayed": len(steps) - len(last),
        "world_sizes": worlds,
        "loss": last[max(last)].loss,
        "tokens_per_s": statistics.median(r.tokens_per_s or 0.0 for r in steady),
        "mfu": statistics.median(r.mfu or 0.0 for r in steady),
        "step_s": statistics.median(r.step_s for r in steady),
    }


def summary_line(summary: dict[str, Any], plan: Plan, run_dir: Path) -> str:
    """The one line `twin execute` prints for a finished run."""
    worlds = " → ".join(str(w) for w in dict.fromkeys(summary["world_sizes"])) or str(plan.layout.world_size)
    first = f" (from step {summary['first_step']})" if summary["first_step"] else ""
    restarts = summary["restarts"]
    again = (
        f"; {restarts} restart{'s' * (restarts != 1)}, {summary['steps_replayed']} step(s) replayed" if restarts else ""
    )
    return (
        f"done: {summary['steps']} steps{first} of {plan.name} on {worlds} ranks → {run_dir}{again}; "
        f"loss {summary['loss']:.4f}, {summary['tokens_per_s']:,.0f} tokens/s, MFU {100 * summary['mfu']:.2f}%"
    )


@dataclass(frozen=True)
class Launch:
    """A finished executor launch: how it ended, where it wrote, and rank 0's summary of what ran."""

    returncode: int
    run_dir: Path
    world_size: int
    summary: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """The last line the gang printed on stderr when it failed (captured launches only)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def to_json(self) -> dict[str, Any]:
        extra = {"error": self.error} if self.error else {}
        return {"ok": self.ok, "returncode": self.returncode, "run_dir": str(self.run_dir),
                "world_size": self.world_size, **self.summary, **extra}  # fmt: skip


def run_gang(cmd: list[str], env: dict[str, str], capture: bool, timeout_s: float) -> tuple[int, str]:
    """Run a torchrun command in its own process group; past `timeout_s` (or on Ctrl-C) the whole group — torchrun
    and every rank it started — is killed, so no rank outlives the launch. Returns (exit code, stderr)."""
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
        return proc.returncode, stderr or ""
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return 124, f"the executor ran past its wall limit of {timeout_s:.0f} s and was stopped; raise the limit"
    except KeyboardInterrupt:
        _kill_group(proc)
        raise


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def default_max_restarts(faults: tuple[FaultSpec, ...], elastic: bool) -> int:
    """One restart per rank-killing fault; an elastic gang at least ELASTIC_RESTARTS (a lost node stops the gang
    and the nodes left need a restart to go on)."""
    restarts = sum(f.kind in ("crash", "hang", "ckpt-crash") for f in faults)
    return max(restarts, ELASTIC_RESTARTS) if elastic else restarts


def _capability(device: str) -> tuple[int, int] | None:
    """The local GPU's compute capability, where the gang runs on this host's GPUs."""
    if device != "cuda":
        return None
    import torch  # only for a GPU run: `twin execute` on CPU does not pay torch's import here

    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None  # type: ignore[return-value]


def launch(
    plan_source: str,
    plan: Plan,
    *,
    overrides: list[str],
    steps: int,
    device: str,
    out: Path,
    nnodes: str = "1",
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    inject: list[str] | None = None,
    max_restarts: int | None = None,
    rdzv_conf: str | None = None,
    capture: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    stats_every: int = 10,
    profile_step: int | None = None,
) -> Launch:
    """Run `plan` under torchrun until it ends (or `timeout_s` passes, which kills the gang) and summarise it.

    With `capture`, the gang's output is collected instead of shown (its last stderr line becomes `error`)."""
    if device not in ("cpu", "cuda"):
        raise PlanError(f"--device {device!r}: use cpu or cuda")
    if refusal := fp8_refusal(plan, device, _capability(device)):  # one line here, not one per rank
        raise PlanError(f"{plan.name}: {refusal}")
    faults = plan_faults(plan, inject or [])
    least, most = parse_nnodes(nnodes)
    out = output_dir(out, "--out")  # before any rank starts: a bad --out is one line, not a gang's tracebacks
    if not (default_corpus() / "index.json").is_file():
        output_dir(cache_dir(), f"the data cache (set {CACHE_ENV} to move it)")
    restarts = default_max_restarts(faults, least < most) if max_restarts is None else max_restarts
    cmd = torchrun_command(
        plan_source, plan, overrides=overrides, steps=steps, device=device, out=out, nnodes=nnodes,
        node_rank=node_rank, master_addr=master_addr, master_port=master_port, inject=inject,
        max_restarts=restarts, rdzv_conf=rdzv_conf, stats_every=stats_every, profile_step=profile_step,
    )  # fmt: skip
    launched = time.time()
    code, stderr = run_gang(cmd, child_env(most, master_addr), capture, timeout_s)
    try:
        summary = summarise(out, launched) if (out / "records.jsonl").exists() else {"steps": 0}
    except RecordError as exc:
        summary = {"steps": 0, "records_error": str(exc)}
    tail = stderr.strip().splitlines()[-1:] if code else []
    return Launch(code, out, plan.layout.world_size, summary, tail[0] if tail else None)
