"""What a whole-run simulation will cost, and whether the run can make progress at all, before it starts.

The run model draws every interruption (twin/run/sim.py), so its cost grows with the number of failures in the
run's wall time; a run whose failures outpace its recovery would draw them forever. Daly's complete model
(Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps", §3: exponential
failures of mean M, which also strike during the restart R) gives the expected wall time of W seconds of work
checkpointed every τ seconds with a stall δ:

    T = M · e^(R/M) · (e^((τ+δ)/M) − 1) · W / τ

Interruptions that lose no work (planned maintenance, quarantined slow nodes) add their restart on top. The
outlook is an estimate (mean recovery over the causes, repairs as waits); the simulation's own counters
(`RunSim`) are the hard stop.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sized
from dataclasses import dataclass

import numpy as np

from plan.errors import PlanError
from plan.limits import Limits, over
from twin.run.reliability import CORRELATED, HANG_CAUSES, NODE_LOSS
from twin.run.state import RunSetup

MIN_GOODPUT = 0.01
"""Below this expected goodput the run stops before simulating: it would take over 100 times its ideal length,
which no plan is meant to do, and its simulation would draw failures for as long."""

NO_LOSS = frozenset({"planned"})
"""Interruptions that checkpoint first and lose no work (see twin/run/sim.py)."""


@dataclass(frozen=True)
class Outlook:
    """What a run is expected to do, from Daly's complete model (seconds and counts)."""

    mtbf_s: float
    """Mean time between the job's interruptions."""
    recovery_s: float
    """Mean time to detect an interruption, replace nodes, restart and reload."""
    wall_s: float
    """Expected wall time of the whole run (inf when it cannot finish)."""
    goodput: float
    interruptions: float
    checkpoints: float


def recovery_s(setup: RunSetup, cause: str) -> float:
    """Expected seconds from an interruption of `cause` to training again: detection, a replacement node (a hot
    spare at once, a cold node after provisioning, else a wait for the repair), restart, reload."""
    policy = setup.plan.reliability
    if cause in ("planned", "straggler", "sdc"):
        detect = 0.0
    elif cause in HANG_CAUSES:
        detect = policy.watchdog_timeout_s
    else:
        detect = policy.heartbeat_timeout_s
    replace = 0.0
    if cause in NODE_LOSS or cause in CORRELATED or cause == "straggler":
        if policy.hot_spares:
            replace = 0.0
        elif setup.free_nodes:
            replace = policy.provision_min * 60
        elif not (policy.elastic and setup.plan.layout.dp > 1):
            replace = setup.cluster.failures.repair_hours * 3600
    return detect + replace + policy.restart_min * 60 + setup.ckpt.restore_s


def outlook(setup: RunSetup) -> Outlook:
    """The run's expected wall time, goodput, interruptions and checkpoints (see the module's docstring)."""
    rates = dict(setup.rates)
    slow = setup.cluster.stragglers
    if slow.slow_node_rate_per_node_day > 0 and slow.slow_node_slowdown > 1:
        rates["straggler"] = slow.slow_node_rate_per_node_day * setup.job_nodes / 86400
    losing = {c: r for c, r in rates.items() if c not in NO_LOSS and c != "straggler"}
    keeping = {c: r for c, r in rates.items() if c not in losing}
    work, tau, delta = setup.useful_s, setup.interval_s, setup.ckpt.stall_s
    lam = sum(losing.values())
    recover = sum(r * recovery_s(setup, c) for c, r in losing.items()) / lam if lam else 0.0
    if work <= 0:
        log_wall = -math.inf
    elif math.isinf(tau):  # no checkpoints (nothing fails)
        log_wall = math.log(work)
    elif lam:
        x = lam * (tau + delta)
        log_segment = -math.log(lam) + lam * recover + (x if x > 50 else math.log(math.expm1(x)))
        log_wall = log_segment + math.log(work / tau)
    else:
        log_wall = math.log(work * (1 + delta / tau))
    share = sum(r * recovery_s(setup, c) for c, r in keeping.items())  # restarts that lose nothing, per second
    wall = math.exp(min(log_wall, 700.0)) / (1 - share) if share < 1 and log_wall < 700 else math.inf
    total = sum(rates.values())
    return Outlook(
        mtbf_s=1 / total if total else math.inf,
        recovery_s=(recover * lam + share) / total if total else 0.0,
        wall_s=wall,
        goodput=work / wall if wall > 0 else 1.0,
        interruptions=total * wall,
        checkpoints=work / tau,
    )


def check_run(setup: RunSetup, limits: Limits) -> Outlook:
    """The outlook if the run can be simulated within `limits`; otherwise PlanError naming what stops it: failures
    (or checkpoints) that outpace progress, or more checkpoints or interruptions than the limits allow."""
    plan, ahead = setup.plan, outlook(setup)
    tau, delta = setup.interval_s, setup.ckpt.stall_s
    ideal = f"{setup.useful_s / 86400:,.4g} ideal days"
    if ahead.goodput < MIN_GOODPUT:
        stretch = (
            f"expected goodput {_percent(ahead.goodput)} (Daly's model): about {1 / max(ahead.goodput, 1e-300):,.2g}× "
            f"its {ideal}"
        )
        if delta / tau > 1 / MIN_GOODPUT - 1:
            raise PlanError(
                f"{plan.name}: checkpoints outpace progress: each stalls training {duration(delta)} but they come "
                f"every {duration(tau)} of training; {stretch}; lengthen reliability.checkpoint_interval_min "
                f"(or use auto)"
            )
        raise PlanError(
            f"{plan.name}: failures outpace progress: the job's {setup.job_nodes:,} nodes are interrupted every "
            f"{duration(ahead.mtbf_s)} on average, but a recovery takes {duration(ahead.recovery_s)} "
            f"(detection, replacement, restart, reload); {stretch}; lower reliability.failure_rates or "
            f"reliability.restart_min, add reliability.hot_spares, or use fewer nodes"
        )
    if ahead.checkpoints > limits.run_checkpoints:
        raise over(
            f"{plan.name}: a run of {ideal} checkpointing every {duration(tau)} takes checkpoints",
            ahead.checkpoints,
            "run_checkpoints",
            limits,
            "lower training.tokens or lengthen reliability.checkpoint_interval_min",
        )
    if ahead.interruptions > limits.run_interruptions:
        raise over(
            f"{plan.name}: a run of {ideal} (about {ahead.wall_s / 86400:,.4g} days of wall time, one interruption "
            f"every {duration(ahead.mtbf_s)}) draws interruptions",
            ahead.interruptions,
            "run_interruptions",
            limits,
            "lower training.tokens or the failure rates",
        )
    return ahead


def duration(seconds: float) -> str:
    """1.2 µs, 84 s, 10.7 min, 3.5 h, 12 days."""
    for scale, unit in ((86400, " days"), (3600, " h"), (60, " min"), (1, " s"), (1e-3, " ms"), (1e-6, " µs")):
        if seconds >= scale:
            return f"{seconds / scale:,.3g}{unit}"
    return f"{seconds:.3g} s"


def _percent(share: float) -> str:
    return f"{100 * share:.2g}%" if share >= 1e-4 else f"{100 * share:.1e}%"


def check_runs(runs: int, limits: Limits) -> None:
    if runs > limits.runs:
        raise PlanError(
            f"seeds: {runs:,} runs are past the limit of {limits.runs:,} runs per command; simulate fewer seeds "
            f"(--seeds), or raise the limit with --limit runs={runs}"
        )


def seed_list_of(seeds: int | Iterable[int], limits: Limits) -> list[int]:
    """The seeds as a list, checked; a count past `limits.runs` is refused before it is spelled out."""
    if isinstance(seeds, bool):
        raise PlanError(f"seeds {seeds}: give a count of seeds or the seeds themselves")
    if isinstance(seeds, int):
        if seeds < 1:
            raise PlanError(f"seeds {seeds}: give at least one seed")
        check_runs(seeds, limits)
        return list(range(seeds))
    if isinstance(seeds, Sized):
        check_runs(len(seeds), limits)
    seed_list = list(itertools.islice(seeds, limits.runs + 1))
    check_runs(len(seed_list), limits)
    if not seed_list:
        raise PlanError("seeds: give at least one seed")
    for seed in seed_list:
        check_seed(seed)
    return seed_list


def check_seed(seed: object) -> None:
    """PlanError unless `seed` is a whole number >= 0 (numpy's generators take no other)."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise PlanError(f"seed {seed!r}: give a whole number >= 0, e.g. --seed 5")
