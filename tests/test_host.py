"""Processor sharing of host cores (twin/host.py) against its closed forms, and its effect on CPU predictions."""

import pytest
import simpy

from plan import loader
from twin.host import SharedCores
from twin.predict import predict


def _finish_times(cores: float, weight: float, jobs: list[tuple[float, float]]) -> list[float]:
    """Run jobs given as (arrival s, work s) on one SharedCores; return each one's completion time."""
    env = simpy.Environment()
    cpu = SharedCores(env, cores, weight)
    done = [0.0] * len(jobs)

    def job(i: int, arrive: float, work: float):  # type: ignore[no-untyped-def]
        yield env.timeout(arrive)
        yield cpu.run(work)
        done[i] = env.now

    for i, (arrive, work) in enumerate(jobs):
        env.process(job(i, arrive, work))
    env.run()
    return done


def test_equal_jobs_share_one_core() -> None:
    # two 1 s jobs on one core run at half speed each: both end at 2 s
    assert _finish_times(1, 1, [(0, 1), (0, 1)]) == pytest.approx([2, 2])


def test_short_job_leaves_and_the_long_one_speeds_up() -> None:
    # 1 s and 2 s on one core: the short ends at 2 s (half speed), the long has 1 s left alone: ends at 3 s
    assert _finish_times(1, 1, [(0, 1), (0, 2)]) == pytest.approx([2, 3])


def test_late_arrival_slows_the_running_job() -> None:
    # job A (2 s) alone for 1 s, then B (1 s) arrives: both at half speed; B ends at 3, A (1 s left) at 3 too
    assert _finish_times(1, 1, [(0, 2), (1, 1)]) == pytest.approx([3, 3])


def test_enough_cores_run_at_full_speed_and_weight_counts_processes() -> None:
    assert _finish_times(4, 2, [(0, 1), (0, 1)]) == pytest.approx([1, 1])  # 4 processes on 4 cores
    assert _finish_times(2, 4, [(0, 1)]) == pytest.approx([2])  # one job standing for 4 processes on 2 cores


def test_cpu_prediction_slows_with_ranks_per_core() -> None:
    """Without a pipeline, every rank of a CPU node computes at once: 8 ranks on 2 cores take 4x the 2-rank
    step's compute, to within the fixed per-step costs (collectives, optimizer)."""
    base = loader.load("cpu-tiny", ["layout.tp=1", "layout.pp=1", "layout.dp=2", "training.global_batch=16"])
    wide = loader.load("cpu-tiny", ["layout.tp=1", "layout.pp=1", "layout.dp=8", "training.global_batch=64"])
    two, eight = predict(base), predict(wide)
    # same per-rank work (8 sequences per replica), 2 vs 8 processes on 2 cores
    ratio = eight.breakdown_s["compute"] / two.breakdown_s["compute"]
    assert ratio == pytest.approx(4.0, rel=1e-6)
