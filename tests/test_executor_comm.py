"""Exposed communication per axis: the timer charges a blocked collective to its group's axis and phase, caps
pipeline waits at the transfer estimate, leaves nothing patched behind; a real step reports comm_tp, comm_dp and
comm_pp where those axes exist, and exact zeros where no axis has two ranks."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.pipelining.schedules as schedules
import torch.multiprocessing as mp
from test_executor_dist import SINGLE, run_variants  # pytest puts tests/ on the path; one gang launcher
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from executor import bench
from executor.commtime import CommTimer, LinkModel
from plan.records import StepRecord, iter_records
from twin.cli.launch import free_port

SLEEP_S = 0.3  # how long one rank holds its peer in a collective; the peer must see most of it
BUDGET_S = 0.02  # the pipeline transfer estimate the test's p2p wait is capped at
COMM = ("comm_tp", "comm_cp", "comm_pp", "comm_dp")


def _hooks() -> list[Any]:
    work = dist.distributed_c10d.Work
    return [funcol.all_reduce, funcol.wait_tensor, dist.all_gather_single, schedules._batch_p2p, vars(work)["wait"]]


def _late(rank: int, who: int) -> None:
    dist.barrier()
    if rank == who:
        time.sleep(SLEEP_S)


def _timer_worker(rank: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=dt.timedelta(seconds=30)
    )
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    replica, pp = dist.new_group([0, 1]), dist.new_group([0, 1])
    axes = {str(tp.get_group().group_name): "tp", str(pp.group_name): "pp"}
    timer = CommTimer(axes, str(replica.group_name), LinkModel(latency_s=BUDGET_S, s_per_byte=0.0))
    before, x = _hooks(), torch.ones(4, 8)
    with timer.measuring():
        timer.phase = "forward"  # a DTensor all-reduce, waited at first use of its result: rank 0 waits
        _late(rank, 1)
        reduced = DTensor.from_local(x, tp, [Partial()]).redistribute(tp, [Replicate()], async_op=True).to_local()
        assert torch.equal(reduced + 0, 2 * x)
        timer.phase = "backward"  # FSDP2's all-gather, then the same asynchronously: rank 1 waits both times
        out = torch.empty(8, 8)
        _late(rank, 0)
        dist.all_gather_single(out, x, group=replica)
        _late(rank, 0)
        work = dist.all_gather_single(out, x, group=replica, async_op=True)
        assert work is not None
        work.wait()
        timer.phase = "schedule"  # a pipeline receive whose sender is late: capped at the transfer estimate
        buf = x.clone() if rank == 0 else torch.empty_like(x)
        op = dist.P2POp(dist.isend if rank == 0 else dist.irecv, buf, 1 - rank, pp)
        _late(rank, 0)
        schedules._wait_batch_p2p(schedules._batch_p2p([op]))
        _late(rank, 1)
        dist.all_reduce(x)  # the default group spans no axis: not counted
    assert _hooks() == before, "a hook was left in place"
    spent = timer.reset()
    # (axis, phase) -> (the rank that waited, how many sleeps it waited out)
    waits = {("tp", "forward"): (0, 1), ("dp", "backward"): (1, 2)}
    for key, (waiter, sleeps) in waits.items():
        if rank == waiter:
            assert spent.seconds[key] > 0.7 * sleeps * SLEEP_S, (key, spent)
    assert 0 < spent.axis("pp") <= BUDGET_S + 1e-9 and spent.during("schedule") == spent.axis("pp")
    assert spent.axis("cp") == 0 and sum(spent.seconds.values()) < 4 * SLEEP_S  # the untimed all-reduce
    assert torch.equal(buf, torch.ones(4, 8))
    dist.destroy_process_group()


def test_timer_charges_blocked_time_to_the_axis_and_phase_and_caps_pipeline_waits() -> None:
    port = free_port()
    mp.spawn(_timer_worker, args=(port,), nprocs=2, join=True)


def test_a_timer_without_axes_patches_nothing() -> None:
    before = _hooks()
    with CommTimer().measuring():
        assert _hooks() == before
    assert CommTimer().reset().seconds == {}


# One launch, three layouts of cpu-tiny on two ranks, each with one axis that talks.
LAYOUTS = {
    "tp2": [*SINGLE, "layout.tp=2"],
    "zero3": [*SINGLE, "layout.dp=2", "layout.zero=3"],
    "pp2": [*SINGLE, "layout.pp=2", "layout.schedule=1f1b"],
}


def _steps(tmp: Path, name: str) -> list[StepRecord]:
    return [r for r in iter_records(tmp / f"run-{name}" / "records.jsonl") if isinstance(r, StepRecord)]


SLOW = pytest.mark.slow  # torchrun gangs (about 30 s together): CI's second step keeps the default run under 5 min


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("comm")
    run_variants(LAYOUTS, 2, tmp)
    return tmp


def _only(record: StepRecord, axis: str | None) -> None:
    """Phases add up to the step; the named axis talked, the others did not; compute kept some time."""
    p = record.phases
    assert abs(sum(p.model_dump().values()) - record.step_s) < 1e-6
    assert p.forward > 0 and p.backward > 0
    for name in COMM:
        assert (getattr(p, name) > 0) == (name == f"comm_{axis}"), (name, p)


@SLOW
def test_tp_collectives_leave_forward_and_backward(layouts: Path) -> None:
    steps = _steps(layouts, "tp2")
    assert len(steps) == 6
    for r in steps:
        _only(r, "tp")
        # Without SP every TP collective runs inside a chunk, so forward + backward + comm_tp is the compute wall
        # and only the loop's own bookkeeping is left over.
        assert r.phases.other < 0.05 * r.step_s


@SLOW
def test_fsdp_gathers_and_reduce_scatters_are_comm_dp(layouts: Path) -> None:
    for r in _steps(layouts, "zero3"):
        _only(r, "dp")


@SLOW
def test_pipeline_p2p_is_comm_pp_and_the_bubble_keeps_the_waiting(layouts: Path) -> None:
    for r in _steps(layouts, "pp2"):
        _only(r, "pp")
        assert r.phases.bubble >= 0 and r.phases.other < 0.05 * r.step_s


@SLOW
def test_one_rank_per_axis_reports_exactly_zero_comm(tmp_path: Path) -> None:
    run_variants({"single": [*SINGLE, "training.global_batch=4"]}, 1, tmp_path)  # a small batch: a short run
    steps = _steps(tmp_path, "single")
    assert steps and all(getattr(r.phases, name) == 0.0 for r in steps for name in COMM)


def test_the_step_end_barrier_is_waiting_not_optimizer_work() -> None:
    """The job-wide metrics all-reduce before the optimizer waits for the slowest rank: its wall is bubble, as the
    twin's step-end barrier counts it, and the optimizer keeps only its own work."""
    from executor.engine import Trainer
    from executor.pipeline import StageClock

    class NoComm:
        def reset(self) -> NoComm:
            return self

        def during(self, phase: str) -> float:
            return 0.0

        def axis(self, axis: str) -> float:
            return 0.0

    clock = StageClock()
    clock.forward, clock.backward = 0.2, 0.3
    engine: Any = SimpleNamespace(clock=clock, topo=SimpleNamespace(comm=NoComm()), schedule=None)
    phases = Trainer._phases(engine, 0.01, 0.5, 1.0, barrier_s=0.25)
    assert phases["bubble"] == pytest.approx(0.25)
    assert phases["optimizer"] == pytest.approx(1.0 - 0.01 - 0.5 - 0.25)
    assert sum(phases.values()) == pytest.approx(1.0)


def test_the_microbenchmark_times_a_collective_by_its_mean_and_a_gemm_by_its_median(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step pays every collective one after another, so a gloo hand-off that waits a scheduler tick now and then
    counts at its mean (nccl-tests' convention); a GEMM timed alone keeps the median."""
    durations = iter([0.0, 1.0, 1.0, 1.0, 9.0] * 2)  # warm-up, then three calls of 1 s and one of 9 s
    clock = [0.0]

    def call() -> None:
        clock[0] += next(durations)

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    assert bench._timed(call, torch.device("cpu"), calls=4) == pytest.approx(3.0)
    monkeypatch.setattr(bench, "TARGET_S", 11.5)  # the sweep stops after the same four calls
    assert bench._timed(call, torch.device("cpu")) == pytest.approx(1.0)
