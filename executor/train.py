"""The executor's entry point: `torchrun --nproc-per-node N -m executor.train --plan PLAN [--steps N] ...`.

Every rank loads the plan, joins the process group (gloo on CPU, NCCL on GPUs — the same code path), builds its
part of the layout and trains for `--steps` steps, appending one StepRecord per step to `<out>/records.jsonl`;
rank 0 writes `<out>/manifest.json`, the job-wide figures and the progress line. Bad input exits 2 with one
line; a non-finite loss or gradient norm exits 3 naming the step and rank. Processes end with `os._exit` once
their output is flushed: torch 2.13 processes that built a DeviceMesh sometimes abort in interpreter teardown.

Under faults (issue 6): checkpoints as the plan's reliability section says (`executor.checkpoint`), resume from
the latest good one on start, so a restart by `torchrun --max-restarts` continues where the gang left off; a
heartbeat per rank whose watchdog names a dead or hung rank (`executor.health`, exit 4); injected faults
(`--inject KIND@STEP[:RANK]`, `executor.faults`, an injected crash exits 17); a cross-replica weight checksum
that rolls back to the last checkpoint when replicas disagree.

Elastic (`--elastic`, which `twin execute --nnodes MIN:MAX` passes): the gang takes the world size the rendezvous
gives it, dp re-derived and the global batch kept (`executor.elastic`), and resumes resharded.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from executor.checkpoint import Checkpointer
from executor.ckpt_store import CheckpointError
from executor.contract import torch_version_warning, what_runs
from executor.data import DataError, Sampler, open_corpus, save_cursor
from executor.elastic import RestartTimer, fit_world, gang_facts, one_line
from executor.engine import StepResult, Trainer
from executor.faults import FaultInjector, check_faults, replicas_disagree, with_injected
from executor.health import Health
from executor.parallel import LayoutError, Topology, check_supported
from executor.profiling import StepProfiler
from executor.progress import Progress
from executor.sanity import NonFiniteError, SpikeDetector
from executor.scalars import Scalars
from executor.telemetry import (
    STRAGGLER_THRESHOLD,
    RecordWriter,
    build_manifest,
    command_line,
    hostname,
    job_figures,
    peak_flops_per_rank,
    peak_memory_MB,
    stragglers,
    write_manifest,
)
from plan import loader
from plan.device import fp8_refusal
from plan.loader import PlanError
from plan.records import EventRecord, LayerStatsRecord, RankCoords, StepRecord, profile_step_refusal
from plan.schema import Plan

EXIT_BAD_INPUT, EXIT_NON_FINITE = 2, 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="executor.train", description="Run a plan's parallel layout for real.")
    p.add_argument("--plan", required=True, help="plan YAML path or preset name")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="section.field=value (repeatable)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps to run")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out", type=Path, default=None, help="run directory (default runs/<plan>-<time>)")
    p.add_argument("--data", type=Path, default=None, help="token corpus directory (default: synthetic bytes)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="process-group timeout: a deadlock fails this fast")
    p.add_argument("--stats-every", type=int, default=10, help="per-layer norms every k steps (0: never)")
    p.add_argument("--straggler-threshold", type=float, default=STRAGGLER_THRESHOLD)
    p.add_argument("--compile", action="store_true", help="torch.compile each layer")
    mixed = "bf16 compute, gradients reduced in the plan's dtype (default: on GPUs unless the plan says fp32)"
    p.add_argument("--mixed-precision", action=argparse.BooleanOptionalAction, default=None, help=mixed)
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="default: <out>/checkpoints")
    p.add_argument("--resume-from", type=Path, default=None, help="a checkpoint directory (default: the latest good)")
    p.add_argument("--inject", action="append", default=[], help="KIND@STEP[:RANK], a fault to inject (repeatable)")
    p.add_argument("--elastic", action="store_true", help="run on the world size started: dp = world / (tp·pp·cp)")
    p.add_argument("--profile-step", type=int, default=None, help="trace step N (from 0) into <out>/profile/")
    p.add_argument("--no-tensorboard", action="store_true", help="no scalars in <out>/tensorboard/ (when installed)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if refusal := profile_step_refusal(args.profile_step, args.steps):
        p.error(refusal)
    return args


def init_distributed(device: str, timeout_s: float) -> torch.device:
    """Join the job's process group; a lone `python -m executor.train` becomes a world of one on loopback."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    local_rank = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=dt.timedelta(seconds=timeout_s))
    return dev


def default_run_dir(plan: Plan) -> Path:
    """runs/<plan>-<time>, chosen by rank 0 and shared so every rank writes to the same place."""
    box = [str(Path("runs") / f"{plan.name}-{time.strftime('%Y%m%d-%H%M%S')}")]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def open_data(plan: Plan, path: Path | None) -> Sampler:
    """The corpus, built once per node by local rank 0 while the others wait."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        corpus = open_corpus(path, plan.model.seq_len, plan.model.vocab)
    dist.barrier()
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        corpus = open_corpus(path, plan.model.seq_len, plan.model.vocab, build=False)
    return Sampler(corpus, plan.training.global_batch, plan.training.seed)


class RankReporter:
    """Turns each step's result into records; on rank 0 adds the job-wide figures, spikes and progress."""

    def __init__(self, plan: Plan, topo: Topology, out: Path, device: torch.device, args: argparse.Namespace):
        self.plan, self.topo, self.device, self.args = plan, topo, device, args
        self.writer = RecordWriter(out / "records.jsonl")
        self.coords = RankCoords(**topo.coords._asdict())
        dtype = "bf16" if device.type == "cuda" else "fp32"
        ranks_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        self.peak = peak_flops_per_rank(loader.plan_cluster(plan), dtype, ranks_on_node)
        self.cohorts = [int(c) for c in topo.grid.all_coords()["pp"]]
        self.spikes = {"loss": SpikeDetector(), "grad_norm": SpikeDetector()}
        self.progress = Progress(args.steps, enabled=topo.rank == 0 and not args.no_progress)
        self.scalars = Scalars(out / "tensorboard", enabled=topo.rank == 0 and not args.no_tensorboard)

    def report(self, res: StepResult) -> tuple[int, ...]:
        """Write the step's records; rank 0 returns the stragglers it found."""
        busy = res.phases["forward"] + res.phases["backward"] + res.phases["optimizer"]
        mine = torch.tensor([res.step_s, busy], dtype=torch.float64, device=self.device)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        extra: dict[str, Any] = {"stragglers": ()}
        if self.topo.rank == 0:
            extra = dict(job_figures(self.plan, [float(t[0]) for t in everyone], self.peak))
            busy_s = [float(t[1]) for t in everyone]
            extra["stragglers"] = stragglers(busy_s, self.cohorts, self.args.straggler_threshold)
            self.progress.update(res.step, res.job_loss, extra["tokens_per_s"], extra["mfu"])
        loss = res.job_loss if self.topo.rank == 0 else res.loss  # rank 0 carries the job's mean loss
        tokens = self.plan.tokens_per_step // self.plan.layout.dp
        record = StepRecord(
            step=res.step,
            rank=self.topo.rank,
            coords=self.coords,
            time_unix=time.time(),
            step_s=res.step_s,
            phases=res.phases,
            tokens=tokens,
            loss=loss,
            grad_norm=res.grad_norm,
            lr=res.lr,
            peak_memory_MB=peak_memory_MB(self.device),
            **extra,
        )
        self.writer.write(record)
        self.scalars.add(record)
        if res.param_grad_norm or res.activation_norm or res.expert_load:
            self.writer.write(
                LayerStatsRecord(
                    step=res.step,
                    rank=self.topo.rank,
                    grad_norm=res.param_grad_norm,
                    activation_norm=res.activation_norm,
                    expert_load=res.expert_load,
                    dropped=res.dropped,
                )
            )
        if self.topo.rank == 0:
            self._flag_spikes(res)
        return tuple(extra["stragglers"])

    def _flag_spikes(self, res: StepResult) -> None:
        for metric, value in (("loss", res.job_loss), ("grad_norm", res.grad_norm)):
            spike = self.spikes[metric].observe(value)
            if spike is not None:
                self.event("spike", res.step, {"metric": metric, **spike})

    def event(self, name: str, step: int, detail: dict[str, object], rank: int = -1, duration_s: float = 0.0) -> None:
        when = time.time()
        record = EventRecord(event=name, step=step, rank=rank, time_unix=when, duration_s=duration_s, detail=detail)
        self.writer.write(record)


def run_training(plan: Plan, args: argparse.Namespace, device: torch.device) -> list[StepResult]:
    """Train up to step `args.steps` of `plan` on this rank; every rank returns its own results."""
    topo = Topology.build(plan, device.type)
    sampler = open_data(plan, args.data)
    out = args.out or default_run_dir(plan)
    hosts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, hostname())
    token = [f"{hostname()}-{os.getpid()}-{time.time_ns()}"]  # rank 0's: names this gang
    dist.broadcast_object_list(token, src=0)
    if topo.rank == 0:
        facts = (dist.get_world_size(), [str(h) for h in hosts], sampler.corpus.version(), command_line())
        manifest = build_manifest(out.name, plan, device.type, *facts, args.mixed_precision)
        write_manifest(manifest, out)
    trainer = Trainer(plan, topo, sampler, device, args.compile, args.mixed_precision)
    reporter = RankReporter(plan, topo, out, device, args)
    health = Health(out, topo.rank, plan.reliability.heartbeat_timeout_s, reporter.event, gang_facts(plan), token[0])
    if topo.rank == 0:
        health.claim()
    dist.barrier()  # the manifest and the claim are written before any rank reads them
    faults = FaultInjector(plan, topo.rank, out, reporter.event, health)
    root = args.checkpoint_dir or out / "checkpoints"
    ckpt = Checkpointer(plan, trainer, sampler, root, reporter.event, faults.writer_fault, faults.crash, faults)
    health.start()
    try:
        return TrainLoop(plan, args, topo, trainer, reporter, health, faults, ckpt).run()
    except NonFiniteError as exc:
        if topo.rank == exc.rank:
            reporter.event("non-finite", exc.step, {"what": exc.what, "value": str(exc.value)}, rank=exc.rank)
        raise
    except RuntimeError as exc:
        if _peer_failure(exc):
            health.explain()  # names the dead or hung rank and exits, if the watchdog finds one
        raise
    finally:
        reporter.progress.close()
        reporter.writer.close()
        reporter.scalars.close()


def _peer_failure(exc: BaseException) -> bool:
    """Whether an error looks like a collective that lost a peer (gloo: connection reset; NCCL: DistError)."""
    chain: BaseException | None = exc
    while chain is not None:  # pipelining wraps the collective's error in its own
        text = str(chain).lower()
        if isinstance(chain, dist.DistError) or any(w in text for w in ("gloo", "connection", "timed out")):
            return True
        chain = chain.__cause__
    return False


class TrainLoop:
    """The steps of one attempt: resume, then train, check, checkpoint and report each step."""

    def __init__(
        self,
        plan: Plan,
        args: argparse.Namespace,
        topo: Topology,
        trainer: Trainer,
        reporter: RankReporter,
        health: Health,
        faults: FaultInjector,
        ckpt: Checkpointer,
    ) -> None:
        self.plan, self.args, self.topo, self.trainer, self.reporter = plan, args, topo, trainer, reporter
        self.health, self.faults, self.ckpt = health, faults, ckpt
        rel = plan.reliability
        bitflips = any(f.kind == "bitflip" for f in rel.faults)
        self.sdc_every = rel.sdc_check_every_steps or (1 if bitflips else 0)
        self.replicas = topo.replica_mesh.get_group() if topo.replica_mesh is not None else None
        self.gang = gang_facts(plan)
        run_dir = reporter.writer.path.parent
        self.restart = RestartTimer(run_dir, self.gang, reporter.event) if topo.rank == 0 else None
        self.profiler = StepProfiler(args.profile_step, run_dir, topo, trainer.device)

    def resume(self) -> int:
        info = self.ckpt.resume(self.args.resume_from)
        start = info.step if info else 0
        self.faults.resumed_from = start
        if self.topo.rank == 0:
            self.reporter.event("start", start, {"attempt": self.faults.attempt, **self.gang})
        if info is not None and self.topo.rank == 0:
            detail = {"path": str(info.path), "layout": info.manifest["layout"], "attempt": self.faults.attempt}
            detail["world_size"] = info.manifest.get("world_size")
            self.reporter.event("resume", start, detail)
        return start

    def run(self) -> list[StepResult]:
        step, results = self.resume(), []
        while step < self.args.steps:
            started_unix = time.time()
            self.health.beat(step)
            self.faults.before_step(step, self.trainer)
            stats = self.args.stats_every > 0 and step % self.args.stats_every == 0
            with self.profiler.around(step):
                res = self.trainer.step(step, stats=stats)
            self.faults.after_step(step, self.trainer)
            if self.sdc_every and (step + 1) % self.sdc_every == 0 and self._corrupt():
                step = self.roll_back(step)
                continue
            self.ckpt.poll()
            if self.ckpt.due(step, last=step == self.args.steps - 1):
                stall = self.ckpt.save(step + 1)
                res.phases["checkpoint"] = stall
                res.step_s += stall
            results.append(res)
            flagged = self.reporter.report(res)
            if self.topo.rank == 0:
                run_dir = self.reporter.writer.path.parent
                save_cursor(self.trainer.sampler.cursor(step + 1), run_dir / "data_cursor.json")
                if flagged:
                    self.faults.detected("slow", step, {"stragglers": list(flagged)}, ranks=flagged)
                self.faults.settle(step)
                if self.restart is not None:
                    self.restart.stepped(step, started_unix, self.faults.attempt, self.faults.resumed_from)
            step += 1
        self.ckpt.wait()
        self.health.finish()
        return results

    def _corrupt(self) -> bool:
        # routed experts differ between the ranks of an expert-parallel group: each is checked among its own copies
        dense, experts = self.trainer.dense_and_experts()
        device = self.trainer.device
        bad = replicas_disagree(dense, self.replicas, device)
        if self.topo.expert_parallel:  # the same on every rank: the check is a collective
            bad = replicas_disagree(experts, self.topo.expert_replica_group, device) or bad
        return bad

    def roll_back(self, step: int) -> int:
        """Replicas disagree after `step`: reload the last good checkpoint and go on from its step."""
        if self.topo.rank == 0:
            self.faults.detected("bitflip", step, {"check": "cross-replica weight checksum"})
        info = self.ckpt.resume()
        if info is None:
            raise CheckpointError(
                f"step {step}: the replicas' weights disagree (silent data corruption) and there is no checkpoint to "
                "roll back to; set reliability.checkpoint_every_steps so that one exists"
            )
        if self.topo.rank == 0:
            self.faults.rolled_back(info.step)
            self.reporter.event("rollback", step, {"to_step": info.step, "path": str(info.path)})
        return info.step


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        plan = with_injected(loader.load(args.plan, args.overrides), args.inject)
        if args.elastic:
            plan = fit_world(plan, world)
        check_supported(plan)
        check_faults(plan)
        if plan.layout.world_size != world:
            raise LayoutError(
                f"layout: the plan needs dp·tp·pp·cp = {plan.layout.world_size} ranks but {world} were started; "
                f"launch with torchrun --nproc-per-node {plan.layout.world_size} (twin execute does this)"
            )
        if device == "cuda" and not torch.cuda.is_available():
            raise LayoutError("--device cuda: no CUDA device is visible; use --device cpu")
        capability = torch.cuda.get_device_capability() if device == "cuda" else None
        if refusal := fp8_refusal(plan, device, capability):
            raise LayoutError(refusal)
    except (PlanError, LayoutError, ValueError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if int(os.environ.get("RANK", "0")) == 0:  # what runs otherwise than the plan says, once per gang
        for line in what_runs(plan, device, args.mixed_precision).mismatches:
            print(f"warning: {line}", file=sys.stderr)
        if version := torch_version_warning(torch.__version__):
            print(f"warning: {version}", file=sys.stderr)
    dev = init_distributed(device, args.timeout_s)
    try:
        run_training(plan, args, dev)
        code = 0
    except NonFiniteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_NON_FINITE
    except (DataError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_BAD_INPUT
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
