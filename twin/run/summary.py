"""Whole-run predictions: set a run up from a plan and its step model, run one seed or many, sweep the checkpoint
interval. The simulation itself is twin/run/sim.py."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from plan import loader
from plan.cluster import Cluster
from plan.limits import DEFAULT_LIMITS, Limits
from plan.loader import PlanError
from plan.rank_grid import RankGrid
from plan.schema import Plan
from twin.run.budget import check_run, check_seed
from twin.run.reliability import checkpoint_cost, daly_interval_s, job_failure_rates, young_interval_s
from twin.run.sim import RunSim
from twin.run.state import RunSetup
from twin.step.predict import PredictOptions, predict

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True)
class RunPrediction:
    """A whole training run, simulated."""

    plan: str
    seed: int
    wall_days: float
    ideal_days: float
    """Days the run would take with no failure, checkpoint or slow node."""
    goodput: float
    """Useful training time over wall time (effective training time ratio, ETTR)."""
    mtbf_hours: float
    """Wall hours per interruption."""
    interruptions: dict[str, int]
    checkpoints: int
    checkpoint_interval_min: float
    lost_work_hours: float
    restart_hours: float
    """Detection, node replacement, restart and reload, waits for repairs included."""
    wait_hours: float
    """Part of restart_hours spent waiting for repaired nodes (gang scheduling with no spare left)."""
    checkpoint_stall_hours: float
    degraded_hours: float
    """Wall time lost to training slower than healthy (slow nodes, shrunk data parallelism)."""
    cost_usd: float
    energy_mwh: float
    events: list[dict[str, Any]] = field(repr=False)

    def events_frame(self) -> pd.DataFrame:
        """The event log as a table (time in hours)."""
        import pandas as pd

        return pd.DataFrame(self.events)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("events")
        return out


def _step_for_dp(plan: Plan, cluster: Cluster, step_s: float) -> Callable[[int], float]:
    """Step time when only `dp` replicas are left at the same global batch, so each does dp_0/dp times the
    microbatches. Once the pipeline is full a step is linear in its microbatches, a + b·m, so the step model is
    evaluated at m and 2m and the line extrapolated (a direct prediction at dp = 1 would simulate the whole
    batch as one replica's microbatches)."""
    lay = plan.layout
    m = plan.num_microbatches
    try:
        doubled = loader.validate_plan(
            {
                **plan.model_dump(mode="json"),
                "training": {**plan.training.model_dump(mode="json"), "global_batch": 2 * plan.training.global_batch},
            },
            "elastic",
        )
        slope = (predict(doubled, cluster).step_time_s - step_s) / m  # m more microbatches: this much each
    except PlanError:
        slope = step_s / m
    intercept = step_s - slope * m

    def step(dp: int) -> float:
        return step_s if dp >= lay.dp else intercept + slope * m * lay.dp / dp

    return step


def _remote_step_s(plan: Plan, cluster: Cluster, step_s: float) -> float:
    """Step time with one node of rank 0's data-parallel group (or its pipeline neighbour) replaced by the nearest
    node outside the job and its spares, as a scheduler without a local spare would place it."""
    job_nodes = -(-plan.layout.world_size // cluster.node.gpus)
    outside = job_nodes + plan.reliability.hot_spares
    axes = ("dp", "cp") if plan.layout.weight_replicas > 1 else ("pp",)
    grid = RankGrid.from_layout(plan.layout)
    group = grid.group_of(0, *axes)
    if outside >= cluster.nodes or len(group) < 2:
        return step_s
    moved = int(group[1]) // cluster.node.gpus
    options = PredictOptions(relocated=((moved, outside),))
    return max(step_s, predict(plan, cluster, options).step_time_s)


def setup(plan: Plan, cluster: Cluster | None = None, step_s: float | None = None) -> RunSetup:
    """Everything the run simulation needs for `plan`."""
    cluster = cluster or loader.plan_cluster(plan)
    step_s = step_s if step_s is not None else predict(plan, cluster).step_time_s
    ckpt = checkpoint_cost(plan, cluster)
    rates = job_failure_rates(plan, cluster)
    interval = plan.reliability.checkpoint_interval_min
    if interval != "auto":
        interval_s = interval * 60
    elif rates:
        interval_s = daly_interval_s(ckpt.stall_s, 1 / sum(rates.values()))
    else:  # nothing fails: Young/Daly's interval grows without bound, and no checkpoint is worth its stall
        interval_s = math.inf
    job_nodes = -(-plan.layout.world_size // cluster.node.gpus)
    return RunSetup(
        plan=plan,
        cluster=cluster,
        step_s=step_s,
        useful_s=plan.total_steps * step_s,
        interval_s=interval_s,
        ckpt=ckpt,
        rates=rates,
        job_nodes=job_nodes,
        free_nodes=max(0, cluster.nodes - job_nodes - plan.reliability.hot_spares),
        leaf_nodes=cluster.fabric.tiers[0].span_nodes if cluster.fabric.tiers else 1,
        replica_nodes=max(1, -(-plan.layout.world_size // plan.layout.dp // cluster.node.gpus)),
        remote_step_s=_remote_step_s(plan, cluster, step_s),
        # only an elastic run changes dp; the others never ask for another dp, so skip the doubled-batch prediction
        step_for_dp=_step_for_dp(plan, cluster, step_s) if plan.reliability.elastic else lambda dp: step_s,
    )


def simulate_run(run_setup: RunSetup, seed: int = 0, limits: Limits = DEFAULT_LIMITS) -> RunPrediction:
    """One seeded run; PlanError, before simulating, if its failures outpace its progress or its expected
    interruptions and checkpoints are past `limits` (twin/run/budget.py), and during it past the same limits."""
    check_seed(seed)
    check_run(run_setup, limits)
    sim = RunSim(run_setup, int(seed), limits)
    tally = sim.run()
    wall = sim.env.now
    plan, cluster = run_setup.plan, run_setup.cluster
    held_nodes = run_setup.job_nodes + plan.reliability.hot_spares
    interruptions = dict(sorted(tally.causes.items()))
    count = sum(interruptions.values())
    hours = wall / 3600
    return RunPrediction(
        plan=plan.name,
        seed=seed,
        wall_days=wall / 86400,
        ideal_days=run_setup.useful_s / 86400,
        goodput=run_setup.useful_s / wall,
        mtbf_hours=hours / count if count else float("inf"),
        interruptions=interruptions,
        checkpoints=tally.checkpoints,
        checkpoint_interval_min=run_setup.interval_s / 60,
        lost_work_hours=tally.lost_work_s / 3600,
        restart_hours=tally.restart_s / 3600,
        wait_hours=tally.wait_s / 3600,
        checkpoint_stall_hours=(tally.stall_s + tally.sdc_check_s) / 3600,
        degraded_hours=tally.degraded_s / 3600,
        cost_usd=held_nodes * cluster.node.gpus * hours * cluster.economics.usd_per_gpu_hour,
        energy_mwh=held_nodes * cluster.node.power_kW * hours * cluster.economics.pue / 1000,
        events=tally.events,
    )


def run(plan: Plan, seed: int = 0) -> RunPrediction:
    """Simulate the whole run of `plan` once."""
    return simulate_run(setup(plan), seed)


SUMMARY_FIELDS = (
    "wall_days",
    "goodput",
    "mtbf_hours",
    "checkpoints",
    "lost_work_hours",
    "restart_hours",
    "wait_hours",
    "checkpoint_stall_hours",
    "degraded_hours",
    "cost_usd",
    "energy_mwh",
)


def summarise(runs: list[RunPrediction]) -> dict[str, dict[str, float]]:
    """Mean and 5th/95th percentiles of each figure over seeds; interruptions as mean counts by cause."""
    out: dict[str, dict[str, float]] = {}
    for name in SUMMARY_FIELDS:
        values = np.array([getattr(r, name) for r in runs], dtype=float)
        if (values == values[0]).all():  # also every run failure-free (MTBF inf), where interpolating gives inf - inf
            out[name] = dict.fromkeys(("mean", "p5", "p95"), float(values[0]))
            continue
        finite = np.isfinite(values).all()  # interpolating toward inf gives nan: take the nearest seed's instead
        out[name] = {
            "mean": float(values.mean()),
            "p5": float(np.percentile(values, 5) if finite else np.percentile(values, 5, method="nearest")),
            "p95": float(np.percentile(values, 95) if finite else np.percentile(values, 95, method="nearest")),
        }
    causes = sorted({c for r in runs for c in r.interruptions})
    out["interruptions"] = {c: float(np.mean([r.interruptions.get(c, 0) for r in runs])) for c in causes}
    return out


def run_seeds(
    run_setup: RunSetup,
    seeds: Iterable[int],
    progress: Callable[[], None] | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> list[RunPrediction]:
    """One run per seed (the same setup, so the step model runs once)."""
    results = []
    for seed in seeds:
        results.append(simulate_run(run_setup, seed, limits))
        if progress:
            progress()
    return results


@dataclass(frozen=True)
class Sweep:
    """Goodput against checkpoint interval, with the simulated optimum beside Young's and Daly's."""

    intervals_min: list[float]
    goodput_mean: list[float]
    optimum_min: float
    young_min: float
    daly_min: float
    stall_s: float
    """Training stall of one checkpoint (seconds)."""
    mtbf_s: float
    """Mean time between the job's interruptions (seconds)."""


def sweep_checkpoint(
    run_setup: RunSetup,
    intervals_s: Iterable[float],
    seeds: Iterable[int],
    limits: Limits = DEFAULT_LIMITS,
    progress: Callable[[], None] | None = None,
) -> Sweep:
    """Mean goodput at each interval over the same seeds (common random numbers: the failure draws do not depend
    on the interval), and the optimum from a quadratic fit of goodput in log-interval around the best point."""
    intervals = sorted(intervals_s)
    seeds = list(seeds)
    means = []
    for interval in intervals:
        runs = run_seeds(replace(run_setup, interval_s=interval), seeds, progress, limits)
        means.append(float(np.mean([r.goodput for r in runs])))
    best = int(np.argmax(means))
    lo, hi = max(0, best - 2), min(len(intervals), best + 3)
    x, y = np.log(intervals[lo:hi]), np.array(means[lo:hi])
    optimum = intervals[best]
    if len(x) >= 3:
        a, b, _ = np.polyfit(x, y, 2)
        if a < 0:
            optimum = float(np.exp(np.clip(-b / (2 * a), x.min(), x.max())))
    mtbf = 1 / sum(run_setup.rates.values())
    delta = run_setup.ckpt.stall_s
    return Sweep(
        [i / 60 for i in intervals],
        means,
        optimum / 60,
        young_interval_s(delta, mtbf) / 60,
        daly_interval_s(delta, mtbf) / 60,
        delta,
        mtbf,
    )
