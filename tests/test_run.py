"""The whole-run model: invariants, the arithmetic of checkpoints between interruptions, published failure mix,
and the Young/Daly optimum."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from benchmarks.published import LLAMA3_TABLE_5
from plan import loader
from twin.run.reliability import CheckpointCost, daly_interval_s, young_interval_s
from twin.run.sim import RunSim
from twin.run.state import Hit, RunSetup, Segment
from twin.run.summary import run_seeds, setup, simulate_run, summarise, sweep_checkpoint
from twin.step.predict import predict


def synthetic(mtbf_h: float, cost_s: float, useful_h: float, interval_s: float = 600.0) -> RunSetup:
    """A run with a fixed step time, one exponential failure cause, a fixed checkpoint cost and instant detection:
    the world of Young's and Daly's models."""
    plan = loader.load(
        "cpu-tiny", ["reliability.checkpoint=sync", "reliability.restart_min=1", "reliability.heartbeat_timeout_s=1"]
    )
    base = setup(plan, step_s=1.0)
    no_slow = base.cluster.model_copy(
        update={"stragglers": base.cluster.stragglers.model_copy(update={"slow_node_rate_per_node_day": 0.0})}
    )
    return replace(
        base,
        cluster=no_slow,
        useful_s=useful_h * 3600,
        interval_s=interval_s,
        rates={"gpu": 1 / (mtbf_h * 3600)},
        ckpt=CheckpointCost(1.0, cost_s, 0.0, 0.0, 0.0),
        free_nodes=10**6,
        step_for_dp=lambda dp: 1.0,
    )


@pytest.mark.parametrize(
    ("progress", "next_ckpt", "elapsed", "expected", "taken"),
    [
        (0.0, 10.0, 5.0, 5.0, 0),  # before the first checkpoint
        (0.0, 10.0, 11.0, 10.0, 0),  # inside the first stall: not yet taken
        (0.0, 10.0, 12.5, 10.5, 1),  # after it
        (0.0, 10.0, 35.0, 30.0, 2),  # inside the third stall
        (0.0, 10.0, 1000.0, 95.0, 9),  # the end: no checkpoint at 95
    ],
)
def test_segment_arithmetic(progress: float, next_ckpt: float, elapsed: float, expected: float, taken: int) -> None:
    seg = Segment(start=0.0, progress=progress, next_ckpt=next_ckpt, interval=10.0, stall=2.0, rate=1.0, end=95.0)
    got, ckpts = seg.after(elapsed)
    assert got == pytest.approx(expected) and len(ckpts) == taken
    assert seg.wall_to_end() == pytest.approx(95.0 + 9 * 2.0)
    assert [c[0] for c in ckpts] == [10.0 * (k + 1) for k in range(taken)]


def test_no_failures_costs_only_checkpoint_stalls() -> None:
    run_setup = replace(synthetic(1.0, 30.0, 10.0), rates={})
    result = simulate_run(run_setup, 0)
    stalls = int(10 * 3600 / 600 - 1e-9) * 30.0  # a checkpoint every 600 s, none at the very end
    assert result.wall_days * 86400 == pytest.approx(10 * 3600 + stalls)
    assert result.lost_work_hours == 0 and not result.interruptions


@pytest.mark.parametrize("name", ["llama3-405b-16k", "reference-100k"])
def test_run_invariants_and_determinism(name: str) -> None:
    run_setup = setup(loader.load(name, ["training.tokens=2.0e+12"]))
    a, b = simulate_run(run_setup, 3), simulate_run(run_setup, 3)
    assert a.to_json() == b.to_json()
    assert 0 < a.goodput < 1 and a.wall_days >= a.ideal_days
    accounted = a.ideal_days * 24 + a.lost_work_hours + a.restart_hours + a.checkpoint_stall_hours + a.degraded_hours
    assert accounted == pytest.approx(a.wall_days * 24, rel=1e-6)  # every wall hour is useful or explained


@pytest.mark.consistency
def test_llama3_54_day_interruption_mix_matches_table_5() -> None:
    # A consistency check, not validation: the catalogue's failure rates were derived from Table 5 itself. It
    # proves the run model turns rates per node-day back into the counts they came from (16,384 H100, 54 days;
    # Table 5's counts are Poisson draws of the same rates).
    run_setup = setup(loader.load("llama3-405b-16k"))
    run_setup = replace(run_setup, useful_s=54 * 86400 * 0.9)
    runs = run_seeds(run_setup, range(20))
    days = np.mean([r.wall_days for r in runs])
    for cause, published in LLAMA3_TABLE_5.items():
        simulated = np.mean([r.interruptions.get(cause, 0) for r in runs]) * 54 / days
        assert simulated == pytest.approx(published, abs=3 * np.sqrt(published) / np.sqrt(20) + 1), cause
    total = np.mean([sum(v for k, v in r.interruptions.items() if k != "straggler") for r in runs]) * 54 / days
    assert total == pytest.approx(466, rel=0.05)
    assert summarise(runs)["goodput"]["mean"] > 0.8  # Llama 3 reports >90% effective training time


def test_hot_spares_and_in_memory_checkpoints_beat_sync_on_a_100k_fleet() -> None:
    slack = ["layout.dp=760", "training.global_batch=24320", "training.tokens=2.0e+12"]
    sync = loader.load(
        "reference-100k", [*slack, "reliability.checkpoint=sync", "reliability.checkpoint_interval_min=30"]
    )
    fast = loader.load(
        "reference-100k",
        [
            *slack,
            "reliability.checkpoint=in-memory",
            "reliability.hot_spares=128",
            "reliability.restart_min=0.5",
            "reliability.heartbeat_timeout_s=10",
        ],
    )
    slow_goodput = summarise(run_seeds(setup(sync), range(3)))["goodput"]["mean"]
    fast_goodput = summarise(run_seeds(setup(fast), range(3)))["goodput"]["mean"]
    assert fast_goodput > slow_goodput + 0.2


def test_daly_reduces_to_young_for_cheap_checkpoints() -> None:
    assert daly_interval_s(1.0, 1e6) == pytest.approx(young_interval_s(1.0, 1e6), rel=1e-3)
    assert daly_interval_s(10.0, 3.0) == 3.0  # delta >= 2M: checkpoint every MTBF


@pytest.mark.slow
@pytest.mark.parametrize("mtbf_h", [1.0, 4.0])
@pytest.mark.parametrize("cost_s", [30.0, 300.0])
def test_simulated_optimal_interval_is_dalys(mtbf_h: float, cost_s: float) -> None:
    base = synthetic(mtbf_h, cost_s, useful_h=1500 * mtbf_h)
    daly = daly_interval_s(cost_s, mtbf_h * 3600)
    intervals = [daly * f for f in np.geomspace(0.4, 2.5, 11)]
    result = sweep_checkpoint(base, intervals, range(6))
    assert result.optimum_min * 60 == pytest.approx(daly, rel=0.10)


def test_replacements_from_outside_the_rail_group_slow_the_job_until_repacked() -> None:
    # an FSDP job filling a 384-node pod of Meta's cluster: the nearest free node is in the next pod, so a cold
    # replacement puts a data-parallel ring hop across the 1:7 aggregation layer. The same pod split as 380 job
    # nodes and 4 hot spares reserved inside it keeps replacements local.
    model = [
        "model=llama3-8b",
        "layout.tp=8",
        "layout.pp=1",
        "layout.schedule=1f1b",
        "layout.virtual_stages=1",
        "layout.zero=3",
        "training.tokens=2.0e+12",
        "reliability.failure_rates={gpu: 0.002}",
    ]
    full = setup(
        loader.load(
            "llama3-405b-16k", [*model, "layout.dp=384", "training.global_batch=384", "reliability.hot_spares=0"]
        )
    )
    spared = setup(
        loader.load(
            "llama3-405b-16k", [*model, "layout.dp=380", "training.global_batch=380", "reliability.hot_spares=4"]
        )
    )
    assert full.remote_step_s > 1.2 * full.step_s
    slowed = np.mean([simulate_run(full, s).degraded_hours for s in range(4)])
    kept = np.mean([simulate_run(spared, s).degraded_hours for s in range(4)])
    assert slowed > 1.0 and slowed > 3 * kept


def test_a_shrunk_step_is_the_step_model_at_that_many_replicas() -> None:
    """Elastic shrink keeps the global batch, so each replica left runs dp0/dp times the microbatches: the line
    through the step and the doubled batch's step gives the step model's own prediction at that dp (it once
    took the doubled batch's extra seconds as the cost of one microbatch: 10% fewer replicas made a 4x step)."""
    plan = loader.load("llama3-405b-16k", ["reliability.elastic=true"])
    run = setup(plan)
    for dp in (64, 32):
        fewer = loader.load("llama3-405b-16k", ["reliability.elastic=true", f"layout.dp={dp}"])
        assert run.step_for_dp(dp) == pytest.approx(predict(fewer).step_time_s, rel=0.01)


QUIET = [  # nothing fails and no node slows unless a test says so
    "reliability.elastic=true",
    "reliability.hot_spares=0",
    "cluster.failures.rate_scale=0",
    "cluster.stragglers.slow_node_rate_per_node_day=0",
]


def test_an_elastic_job_cut_off_whole_grows_back_once_its_nodes_return() -> None:
    """A leaf switch that cuts off more nodes than the job can spare shrinks it to one replica that still waits;
    when the nodes come back the job resumes at its full size, not at the one replica it shrank to."""
    plan = loader.load("reference-100k", QUIET)
    sim = RunSim(setup(plan), 0)
    sim.cold = 0

    def cut() -> Generator[Any, Any, None]:
        yield sim.env.timeout(3600.0)
        for _ in range(sim.s.job_nodes):
            sim.env.process(sim.repair(None))
        sim.strike(Hit("switch", sim.s.job_nodes))

    sim.env.process(cut())
    sim.env.run(until=3600.0 * (2 + sim.s.cluster.failures.repair_hours))
    assert [e["dp"] for e in sim.t.events if e["event"] == "shrink"] == [1]
    last = sim.t.events[-1]
    assert sim.dp == plan.layout.dp and (last["event"], last["dp"]) == ("resumed", plan.layout.dp)


def test_a_shrunk_job_stops_to_grow_back_only_where_the_gain_outweighs_the_restart() -> None:
    """Whether a shrunk job should stop to take back returned replicas: where the training it gains before the
    next failure expected at the larger size outweighs the restart. At 100k GPUs (a failure about every 27
    minutes against a 10-minute restart) a job one replica short (0.1% slower) carries on; one at a quarter of its
    replicas (4x slower) stops and takes back all it can."""
    plan = loader.load("reference-100k", ["reliability.elastic=true", "reliability.hot_spares=0"])
    run, dp, per = setup(plan), plan.layout.dp, setup(plan).replica_nodes
    assert run.regrow(dp - 1, 10 * per) == 0
    assert run.regrow(dp // 4, dp * per) == dp - dp // 4
    assert run.regrow(dp // 4, dp // 2 * per) == dp // 2  # what the pool holds
    assert run.regrow(dp // 4, 3 * per) == 0  # three replicas of 195 more: 1.5% faster, not worth a restart
    assert run.regrow(dp, 10 * per) == 0  # nothing dropped


def test_a_shrunk_job_takes_back_its_replicas_as_their_nodes_return_while_it_trains() -> None:
    """Nothing fails (so a regrow always pays): the nodes of a dropped replica come back from repair while the
    job trains, and it stops (checkpointed, losing nothing) to run on them."""
    plan = loader.load("reference-100k", QUIET)
    sim = RunSim(setup(plan), 0)
    sim.dp, sim.cold = plan.layout.dp - 1, 0
    for _ in range(sim.s.replica_nodes):
        sim.env.process(sim.repair(None))
    sim.env.run(until=3600.0 * (1 + sim.s.cluster.failures.repair_hours))
    assert sim.dp == plan.layout.dp
    regrow = [e for e in sim.t.events if e["event"] == "interrupt"]
    assert [(e["cause"], e["lost_h"]) for e in regrow] == [("regrow", 0.0)]
