"""What a whole-run simulation holds: its setup, the segments of training between interruptions, what stops or
slows the job, and the tally of where wall time went. Data only; the SimPy processes are twin/run/sim.py."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from plan.cluster import Cluster
from plan.schema import Plan
from twin.run.reliability import CheckpointCost


@dataclass(frozen=True)
class Hit:
    """Something that stops the job."""

    cause: str
    nodes: int
    """Nodes it takes out of the job (replaced from spares)."""
    loses_work: bool = True
    """False for planned maintenance and quarantines, which checkpoint first."""
    corrupted_at: float | None = None
    """For silent data corruption: the training progress (s) when the data went bad."""


@dataclass(frozen=True)
class SpeedChange:
    """A slow node joins or leaves: the training rate changes, nothing is lost."""


@dataclass(frozen=True)
class Segment:
    """Training from wall time `start` at `progress`, with checkpoints at next_ckpt, next_ckpt + interval, ... up
    to (not at) `end`, each stalling `stall` seconds, at `rate` useful seconds per wall second."""

    start: float
    progress: float
    next_ckpt: float
    interval: float
    stall: float
    rate: float
    end: float
    check_share: float = 0.0
    """Share of training time spent in periodic SDC checks (already folded into `rate`)."""

    def checkpoints(self) -> int:
        """Checkpoints before the end of training."""
        if self.next_ckpt >= self.end:
            return 0
        return math.floor((self.end - self.next_ckpt) / self.interval - 1e-12) + 1

    def wall_to_end(self) -> float:
        return (self.end - self.progress) / self.rate + self.checkpoints() * self.stall

    def after(self, elapsed: float) -> tuple[float, list[tuple[float, float]]]:
        """Progress after `elapsed` wall seconds, and the checkpoints completed by then as (progress, wall)."""
        n = self.checkpoints()
        first = (self.next_ckpt - self.progress) / self.rate
        if n == 0 or elapsed < first:
            return min(self.end, self.progress + elapsed * self.rate), []
        cycle = self.interval / self.rate + self.stall
        since = elapsed - first
        j = min(n - 1, int(since // cycle))
        within = since - j * cycle
        done = j + 1 if within >= self.stall else j  # checkpoint j completes once its stall is over
        taken = [(self.next_ckpt + k * self.interval, self.start + first + self.stall + k * cycle) for k in range(done)]
        at = self.next_ckpt + j * self.interval
        progress = at if within < self.stall else at + (within - self.stall) * self.rate
        return min(self.end, progress), taken


@dataclass(frozen=True)
class RunSetup:
    """What the run simulation needs, derived once from the plan, its cluster and its step time."""

    plan: Plan
    cluster: Cluster
    step_s: float
    useful_s: float
    """Training time the run needs at the healthy step time (seconds)."""
    interval_s: float
    """Training seconds between checkpoints."""
    ckpt: CheckpointCost
    rates: dict[str, float]
    """Job failures per second, by cause."""
    job_nodes: int
    free_nodes: int
    """Healthy cluster nodes beyond the job and its hot spares (the cold pool)."""
    leaf_nodes: int
    replica_nodes: int
    """Nodes one data-parallel replica occupies (tp · pp · cp accelerators)."""
    remote_step_s: float
    """Step time while a replacement from outside the job's rail group sits in a data-parallel (or pipeline)
    group, so that group crosses a higher tier (the step model with that node relocated)."""
    step_for_dp: Callable[[int], float]
    """Step time with fewer data-parallel replicas (elastic shrink), from the step model."""

    def replicas_back(self, dp: int, pool: int) -> int:
        """Dropped replicas a job at `dp` could take back from `pool` free nodes."""
        return max(0, min(self.plan.layout.dp - dp, pool // self.replica_nodes))

    def regrow(self, dp: int, pool: int) -> int:
        """Replicas an elastic job shrunk to `dp` should stop training to take back from `pool` free nodes: as many
        as the pool holds, where the training that gains before the next failure expected at the larger size
        outweighs the restart (a scale-up restarts the workers: TorchElastic does so when a node joins); else 0."""
        back = self.replicas_back(dp, pool)
        if back == 0:
            return 0
        failures_per_s = sum(self.rates.values()) * (dp + back) / self.plan.layout.dp
        restart_s = self.plan.reliability.restart_min * 60 + self.ckpt.restore_s
        gain = 1 - self.step_for_dp(dp + back) / self.step_for_dp(dp)
        return back if gain > restart_s * failures_per_s else 0


@dataclass
class Tally:
    """What the run spent its wall time on, and what happened (seconds and counts)."""

    lost_work_s: float = 0.0
    restart_s: float = 0.0
    wait_s: float = 0.0
    stall_s: float = 0.0
    sdc_check_s: float = 0.0
    degraded_s: float = 0.0
    """Wall time lost to training slower than healthy: slow nodes, shrunk data parallelism."""
    checkpoints: int = 0
    causes: Counter[str] = field(default_factory=Counter)
    events: list[dict[str, Any]] = field(default_factory=list)
