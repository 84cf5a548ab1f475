"""Processor sharing of host cores (twin/step/host.py) against its closed forms, and its effect on CPU predictions."""

import pytest
import simpy

from plan import loader
from twin.calibrate.fit import with_fields
from twin.step.host import HostSharing, SharedCores
from twin.step.pipeline import simulate
from twin.step.pipeline_data import ActionCost, PipelineInput, PipelineResult
from twin.step.predict import predict
from twin.step.schedules import build


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


def test_others_busy_is_the_mean_load_of_the_other_owners_over_the_window() -> None:
    env = simpy.Environment()
    cpu = SharedCores(env, cores=4, weight=2)  # enough cores: jobs run at full speed

    def job(owner: int, arrive: float, work: float):  # type: ignore[no-untyped-def]
        yield env.timeout(arrive)
        yield cpu.run(work, owner=owner)

    env.process(job(0, 0.0, 1.0))  # owner 0 busy over [0, 1]
    env.process(job(1, 0.5, 1.0))  # owner 1 busy over [0.5, 1.5]
    env.run(until=1.2)
    # over [0.2, 1.2]: owner 0 busy 0.8 of it, owner 1 busy 0.7; 2 processes each
    assert cpu.others_busy(owner=1, window_s=1.0) == pytest.approx(2 * 0.8)
    assert cpu.others_busy(owner=0, window_s=1.0) == pytest.approx(2 * 0.7)
    assert cpu.others_busy(owner=0, window_s=0.0) == pytest.approx(2.0)  # no window: the load right now


def _pp2_gpipe(physical: float, wakeup_s: float) -> PipelineResult:
    """Two pipeline ranks sharing one node of `physical` cores (one rank process each), GPipe over 2
    microbatches, forwards and backwards of 1 s, free transfers."""
    costs = {(k, s): ActionCost(compute=1.0) for k in "FB" for s in (0, 1)}
    sends = {(0, 1): 0.0, (1, 0): 0.0}
    host = HostSharing(cores=physical, weight=1, ranks_per_pool=2, physical_cores=physical, wakeup_s=wakeup_s)
    return simulate(PipelineInput(build("gpipe", 2, 1, 2), (0, 1), costs, sends, False, host=host))


def test_a_woken_rank_waits_for_a_core_only_when_the_cores_are_full() -> None:
    # Rank 1 sleeps until F0 of stage 0 ends at 1 s; rank 0 goes straight on to F1, so on one core the woken
    # rank 1 finds it busy over the whole wake-up window and starts wakeup_s late; on two cores it starts at once.
    def first_start(result: PipelineResult) -> float:
        return min(s.start for s in result.slices if s.rank == 1)

    assert first_start(_pp2_gpipe(physical=2, wakeup_s=0.25)) == pytest.approx(1.0)
    assert first_start(_pp2_gpipe(physical=1, wakeup_s=0.25)) == pytest.approx(1.25)
    assert first_start(_pp2_gpipe(physical=1, wakeup_s=0.0)) == pytest.approx(1.0)
    slow = _pp2_gpipe(physical=1, wakeup_s=0.25)
    assert slow.ranks[1].bubble > _pp2_gpipe(physical=1, wakeup_s=0.0).ranks[1].bubble  # the wait is waiting


def test_every_rank_waits_at_the_step_end_barrier_before_its_optimizer() -> None:
    """Stage 1 costs twice stage 0: rank 0 reaches the barrier early and waits (bubble) until rank 1 arrives;
    both then run the all-reduce and their optimizer, so the step is rank 1's end + barrier + the longer step."""
    costs = {("F", 0): ActionCost(compute=1.0), ("B", 0): ActionCost(compute=1.0)}
    costs |= {("F", 1): ActionCost(compute=2.0), ("B", 1): ActionCost(compute=2.0)}
    inp = PipelineInput(
        build("1f1b", 2, 1, 1), (0, 1), costs, {(0, 1): 0.0, (1, 0): 0.0}, False,
        optimizer_s={0: 0.5, 1: 0.1}, barrier_s=0.2,
    )  # fmt: skip
    result = simulate(inp)
    # F0 [0, 1], F1 [1, 3], B1 [3, 5], B0 [5, 6]: rank 1 arrives at 5, rank 0 at 6
    assert result.step_s == pytest.approx(6 + 0.2 + 0.5)
    assert result.ranks[1].bubble == pytest.approx(1 + 1 + 0.2 + 0.4)  # fill, barrier wait, all-reduce, tail
    assert result.ranks[0].bubble == pytest.approx(4 + 0.2)  # waiting for F1 and B1, then the all-reduce
    assert result.ranks[0].optimizer == pytest.approx(0.5) and result.ranks[1].optimizer == pytest.approx(0.1)


def test_ranks_sharing_a_nodes_cores_straggle_as_its_cores_not_as_its_ranks() -> None:
    """A work-conserving scheduler gives the time one co-located rank loses to another: on the 2-core host the
    straggler skew of dp8 is that of 2 independent ranks, the same share of the step as dp2's."""
    cluster = with_fields(loader.load_cluster("localhost-cpu"), {"stragglers.jitter_cv": 0.1})
    skews = []
    for dp in (2, 8):
        result = predict(loader.load("cpu-tiny", ["layout.tp=1", "layout.pp=1", f"layout.dp={dp}"]), cluster)
        skews.append(result.breakdown_s["straggler"] / (result.step_time_s - result.breakdown_s["straggler"]))
    assert skews[0] > 0
    assert skews[1] == pytest.approx(skews[0], rel=1e-9)
