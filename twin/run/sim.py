"""A whole training run in SimPy: failures by component, detection, recovery, checkpoints, spares, stragglers.

Simulated at the granularity of what changes the run, not step by step (shared/DESIGN.md): the job is a process
that trains between checkpoints at the step model's rate; one process per failure cause draws that cause's
failures and interrupts it (SimPy's machine-shop pattern); repairs return nodes to the spare pool; slow nodes
change the training rate until the per-rank step-time check quarantines them. Useful work is measured in seconds
of training at the healthy step time, so goodput (ETTR) is useful time over wall time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator
from math import gamma
from typing import Any

import numpy as np
import simpy

from plan.errors import PlanError
from plan.limits import DEFAULT_LIMITS, Limits, over
from twin.run.reliability import CORRELATED, HANG_CAUSES, LEAF_SWITCH_SHARE, NODE_LOSS
from twin.run.state import Hit, RunSetup, Segment, SpeedChange, Tally

SDC_LATENCY_S = 6 * 3600.0
"""Assumption: without periodic checks, a silent corruption surfaces as a loss spike or divergence hours later
(Llama 3 §3.3.4 and Dixit et al. 2021 describe SDC found through training anomalies; no published latency)."""

FENCE_UNIT_GPUS = 8
"""Accelerators of the server `reliability.fence_after` counts failures of: the 8-GPU server Llama 3's failure
rates are per (Dubey et al. 2024, Table 5), which the catalogue's larger nodes rescale (x 9 for an NVL72 rack)."""

STRAGGLER_WINDOW_STEPS = 20
"""Steps a slow node runs before it is quarantined. Assumption: the executor flags a rank on any step 20% slower
than its cohort's median (executor/telemetry.py), and a policy waits for it to persist this long before evicting."""


class RunSim:
    """One seeded simulation of the whole run, stopped with PlanError past `limits` (its interruptions and
    checkpoints) or when the job can never again gather its nodes."""

    def __init__(self, setup: RunSetup, seed: int, limits: Limits = DEFAULT_LIMITS) -> None:
        self.s = setup
        self.limits = limits
        self.policy = setup.plan.reliability
        self.env = simpy.Environment()
        self.rng = np.random.default_rng(seed)
        self.progress = 0.0
        self.segment: Segment | None = None
        self.next_ckpt = setup.interval_s
        # checkpoints taken: (progress, wall time durable on storage, wall time held in a peer's memory)
        self.saved: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)]
        self.last_flush = 0.0
        self.hot = self.policy.hot_spares  # reserved inside the job's rail groups (topology-aware)
        self.local = 0  # repaired job nodes back in the pool beyond the hot spares: still inside the rail groups
        self.cold = setup.free_nodes  # the rest of the cluster: a node from here lands outside the rail groups
        self.remote = 0  # job nodes running outside their rail group
        self.dp = setup.plan.layout.dp
        self.missing = 0  # nodes the job lacks until replacements arrive
        self.slow = 1.0
        self.corruptions: list[float] = []
        self.node_failures: Counter[int] = Counter()
        self.repairing = 0  # nodes out for repair that will come back
        self.fenced = 0  # nodes fenced off for good
        self.returned = self.env.event()
        self.t = Tally()
        self.done = False
        self.job = self.env.process(self.train())
        for cause, rate in setup.rates.items():
            self.env.process(self.failures(cause, rate))
        slow_rate = setup.cluster.stragglers.slow_node_rate_per_node_day * setup.job_nodes / 86400
        if slow_rate > 0 and setup.cluster.stragglers.slow_node_slowdown > 1:
            self.env.process(self.slow_nodes(slow_rate))

    # --- the job ------------------------------------------------------------------------------------------------

    def rate(self) -> float:
        """Useful seconds of training per wall second now (periodic SDC checks take their share)."""
        return self.base_rate() * (1 - self.check_share())

    def base_rate(self) -> float:
        placement = self.s.remote_step_s / self.s.step_s if self.remote else 1.0
        return self.s.step_s / (self.s.step_for_dp(self.dp) * self.slow * placement)

    def check_share(self) -> float:
        """Share of training wall time that periodic SDC checks take."""
        check = self.policy.sdc_check_interval_min * 60
        if check == 0:
            return 0.0
        paid = self.policy.sdc_check_s * self.base_rate()
        return paid / (check + paid)

    def log(self, event: str, **detail: Any) -> None:
        self.t.events.append({"time_h": self.env.now / 3600, "event": event, **detail})

    def train(self) -> Generator[Any, Any, None]:
        """Train to the end, interrupted by failures and rate changes. Checkpoints between two interruptions are
        not events: `Segment` works out arithmetically which were taken and when each became durable."""
        self.next_ckpt = self.s.interval_s
        while self.progress < self.s.useful_s:
            seg = Segment(
                self.env.now,
                self.progress,
                self.next_ckpt,
                self.s.interval_s,
                self.s.ckpt.stall_s,
                self.rate(),
                self.s.useful_s,
            )
            self.segment = seg
            try:
                yield self.env.timeout(seg.wall_to_end())
                self.close(seg, seg.wall_to_end())
            except simpy.Interrupt as stop:
                self.close(seg, self.env.now - seg.start)
                if isinstance(stop.cause, Hit):
                    yield from self.recover(stop.cause)
                    self.next_ckpt = self.progress + self.s.interval_s
        self.done = True
        self.log("finished")

    def close(self, seg: Segment, elapsed: float) -> None:
        """Book what a segment did in `elapsed` wall seconds: progress, checkpoints taken, stalls, slow time."""
        progress, taken = seg.after(elapsed)
        for ckpt_progress, completed_wall in taken:
            self.record_checkpoint(ckpt_progress, completed_wall)
        if self.t.checkpoints > self.limits.run_checkpoints:
            raise self.past_limit("checkpoints", self.t.checkpoints, "run_checkpoints")
        training = (progress - seg.progress) / seg.rate
        self.t.stall_s += elapsed - training  # whole stalls, and one a failure cut short
        self.t.sdc_check_s += training * seg.check_share
        self.t.degraded_s += training * (1 - seg.check_share) - (progress - seg.progress)
        self.progress = progress
        self.next_ckpt = taken[-1][0] + seg.interval if taken else seg.next_ckpt
        self.segment = None

    def record_checkpoint(self, progress: float, wall: float) -> None:
        """A checkpoint finished its stall at `wall`: when is it durable on storage, and in a peer's memory."""
        kind, ckpt = self.policy.checkpoint, self.s.ckpt
        self.t.checkpoints += 1
        if kind == "sync":
            self.saved.append((progress, wall, wall))
        elif kind == "async":
            self.saved.append((progress, wall + ckpt.write_s, float("inf")))
        else:
            flush = wall - self.last_flush >= self.policy.in_memory_flush_min * 60
            if flush:
                self.last_flush = wall
            disk = self.s.cluster.storage
            write_GBps = min(disk.write_GBps, self.s.job_nodes * disk.per_node_write_GBps)
            storage = wall + ckpt.size_bytes / (write_GBps * 1e9) if flush else float("inf")
            self.saved.append((progress, storage, wall + ckpt.write_s))

    def wait(self, seconds: float) -> Generator[Any, Any, None]:
        """A stall that a rate change does not cut short; a failure propagates."""
        end = self.env.now + seconds
        while self.env.now < end:
            try:
                yield self.env.timeout(end - self.env.now)
            except simpy.Interrupt as stop:
                if not isinstance(stop.cause, SpeedChange):
                    raise

    def current_progress(self) -> float:
        if self.segment is None:
            return self.progress
        return self.segment.after(self.env.now - self.segment.start)[0]

    # --- recovery -----------------------------------------------------------------------------------------------

    def restore_point(self, hit: Hit) -> tuple[float, float]:
        """(progress to resume from, seconds to load it) after `hit`: the newest checkpoint that is durable now —
        on storage, or in a peer's memory if the failure spared the peer — and older than any corruption."""
        limit = hit.corrupted_at if hit.corrupted_at is not None else float("inf")
        # host memory outlives a switch or GPU failure, and peers sit under another leaf (Gemini, SOSP'23, places
        # replicas across groups), so the in-memory copy is lost only to corruption
        memory_ok = self.policy.checkpoint == "in-memory"
        for progress, on_storage, in_memory in reversed(self.saved):
            if progress > limit:
                continue
            if on_storage <= self.env.now:
                return progress, self.s.ckpt.restore_s
            if memory_ok and in_memory <= self.env.now:
                return progress, self.s.ckpt.restore_memory_s
        return 0.0, 0.0

    def recover(self, first: Hit) -> Generator[Any, Any, None]:
        """Detect, replace nodes, restart and reload; a failure during recovery starts it over."""
        pending = [first]
        while pending:
            hit = pending.pop()
            point, load_s = self.restore_point(hit)
            if not hit.loses_work:  # it checkpointed first
                point, load_s = self.progress, self.s.ckpt.restore_s
            lost = max(0.0, self.progress - point)
            self.progress = point
            self.t.lost_work_s += lost
            while len(self.saved) > 1 and self.saved[-1][0] > point:  # checkpoints past the restore point are gone
                self.saved.pop()
            if hit.cause == "sdc":
                self.corruptions = [c for c in self.corruptions if c > point]
            self.log("interrupt", cause=hit.cause, lost_h=lost / 3600, nodes=hit.nodes)
            start = self.env.now
            try:
                yield from self.wait(self.detection_s(hit))
                provision = yield from self.replace(hit.nodes)
                yield from self.wait(self.policy.restart_min * 60 + provision + load_s)
            except simpy.Interrupt as again:
                if isinstance(again.cause, Hit):
                    pending.append(again.cause)
            finally:
                self.t.restart_s += self.env.now - start
        self.log("resumed", progress_h=self.progress / 3600, dp=self.dp)

    def detection_s(self, hit: Hit) -> float:
        if hit.cause in ("planned", "straggler", "sdc", "regrow"):
            return 0.0  # announced, flagged by the step-time check, found by the check or the loss spike, chosen
        if hit.cause in HANG_CAUSES:
            return self.policy.watchdog_timeout_s
        return self.policy.heartbeat_timeout_s

    def replace(self, nodes: int) -> Generator[Any, Any, float]:
        """Make up the job's missing nodes (`nodes` more now): hot spares first, then cold nodes (which need
        provisioning); if none are left, drop whole data-parallel replicas (elastic: their healthy nodes fill the
        holes) or wait for repairs — a shortfall survives a failure that interrupts the wait. Grow dropped replicas
        back when the pool allows. Returns the provisioning delay."""
        self.missing += nodes
        provision = self.fill()
        per_replica = self.s.replica_nodes
        if self.missing and self.policy.elastic and self.dp > 1:
            dropped = min(self.dp - 1, -(-self.missing // per_replica))
            self.dp -= dropped
            self.local += max(0, dropped * per_replica - self.missing)
            self.missing = max(0, self.missing - dropped * per_replica)
            self.log("shrink", dp=self.dp)
        start = self.env.now
        try:
            while self.missing:
                if not self.repairing:
                    raise self.stranded()
                yield self.returned
                provision |= self.fill()
        finally:
            self.t.wait_s += self.env.now - start
        regrow = self.s.replicas_back(self.dp, self.hot + self.local + self.cold)
        if regrow > 0:  # what the pool holds now, repairs it waited for included
            self.missing += regrow * per_replica
            self.dp += regrow
            provision |= self.fill()
            self.log("grow", dp=self.dp)
        return self.policy.provision_min * 60 if provision else 0.0

    def fill(self) -> bool:
        """Take missing nodes from the hot spares, then repaired local nodes, then the rest of the cluster (which
        lands outside the rail groups); first swap remote nodes back for local ones where their placement slows the
        job (topology-aware re-pack).
        True if a node needing provisioning was used."""
        back = min(self.remote, self.hot + self.local) if self.s.remote_step_s > self.s.step_s else 0
        self.remote -= back
        self.missing += back
        self.cold += back
        hot = min(self.hot, self.missing)
        local = min(self.local, self.missing - hot)
        cold = min(self.cold, self.missing - hot - local)
        self.hot, self.local, self.cold = self.hot - hot, self.local - local, self.cold - cold
        self.missing -= hot + local + cold
        self.remote += cold
        return local + cold > 0

    # --- the fleet ----------------------------------------------------------------------------------------------

    def gap(self, rate: float) -> float:
        """Time to the next failure of one cause: exponential, or Weibull of the same mean (cluster's shape)."""
        shape = self.s.cluster.failures.weibull_shape
        if shape == 1.0:
            return float(self.rng.exponential(1 / rate))
        return float(self.rng.weibull(shape)) / (rate * gamma(1 + 1 / shape))

    def failures(self, cause: str, rate: float) -> Generator[Any, Any, None]:
        while not self.done:
            yield self.env.timeout(self.gap(rate))
            if self.done:
                return
            if self.left_out():
                continue
            self.t.causes[cause] += 1
            self.count_interruption()
            if cause == "planned":
                self.strike(Hit("planned", 0, loses_work=False))
                continue
            if cause in CORRELATED:  # a link cuts one node off; a whole leaf switch every node under it
                nodes = self.s.leaf_nodes if self.rng.random() < LEAF_SWITCH_SHARE else 1
                for _ in range(nodes):  # they come back unharmed when the switch or link is fixed
                    self.env.process(self.repair(None))
            elif cause in NODE_LOSS:
                nodes = 1
                self.env.process(self.repair(int(self.rng.integers(self.s.job_nodes))))
            else:  # a software fault: restart on the same nodes
                nodes = 0
            if cause == "sdc":
                self.env.process(self.surface(self.current_progress()))
            else:
                self.strike(Hit(cause, nodes))

    def left_out(self) -> bool:
        """Whether a draw at the whole job's rate struck a node an elastic shrink has left out (Poisson thinning)."""
        return self.dp < self.s.plan.layout.dp and self.rng.random() * self.s.plan.layout.dp >= self.dp

    def strike(self, hit: Hit | SpeedChange) -> None:
        if not self.done and self.job.is_alive:
            self.job.interrupt(hit)

    def surface(self, corrupted_at: float) -> Generator[Any, Any, None]:
        """A corruption is found at the next periodic check, or without checks as a loss spike hours later; the
        run then rolls back past it."""
        self.corruptions.append(corrupted_at)
        check = self.policy.sdc_check_interval_min * 60
        if check > 0:  # checks every `check` seconds of training: the next one is this far ahead
            delay = (check - corrupted_at % check) / self.rate()
        else:
            delay = float(self.rng.exponential(SDC_LATENCY_S))
        yield self.env.timeout(delay)
        if corrupted_at in self.corruptions:
            self.strike(Hit("sdc", 1, True, corrupted_at))

    def repair(self, node: int | None) -> Generator[Any, Any, None]:
        """A failed node (None: one a switch cut off) is back after the repair; a fenced one's new one after rma_days"""
        out_s = self.s.cluster.failures.repair_hours * 3600
        if node is not None:
            self.node_failures[node] += 1
            # a node of many servers' worth (an NVL72 rack, a Trn2 UltraServer) fails that many times as often, one
            # tray at a time: it is fenced after as many failures per 8-accelerator server as a server would be
            servers = max(1, self.s.cluster.node.gpus // FENCE_UNIT_GPUS)
            if self.node_failures[node] >= self.policy.fence_after * servers:
                self.fenced += 1
                self.node_failures[node] = 0  # its place in the job is taken by another node, with no failures
                self.log("fenced", node=node)
                if self.policy.rma_days is None:
                    return
                out_s = self.policy.rma_days * 86400  # new hardware in its place, from the vendor
        self.repairing += 1
        yield self.env.timeout(out_s)
        self.repairing -= 1
        if node is None:  # cut off by a switch: it returns to its place in the job's pool
            self.local += 1
        elif self.hot < self.policy.hot_spares:
            self.hot += 1
        else:
            self.local += 1
        self.returned.succeed()
        self.returned = self.env.event()
        if self.segment is not None and not self.missing and self.s.regrow(self.dp, self.hot + self.local + self.cold):
            self.strike(Hit("regrow", 0, loses_work=False))  # a shrunk job takes its replicas back, checkpointed first

    def slow_nodes(self, rate: float) -> Generator[Any, Any, None]:
        slowdown = self.s.cluster.stragglers.slow_node_slowdown
        while not self.done:
            yield self.env.timeout(float(self.rng.exponential(1 / rate)))
            if self.done or self.slow > 1 or self.left_out():
                continue
            self.slow = slowdown
            self.strike(SpeedChange())
            self.log("slow node", slowdown=slowdown)
            yield self.env.timeout(STRAGGLER_WINDOW_STEPS * self.s.step_s * slowdown)
            self.slow = 1.0
            self.strike(SpeedChange())
            self.t.causes["straggler"] += 1
            self.count_interruption()
            self.env.process(self.repair(int(self.rng.integers(self.s.job_nodes))))
            self.strike(Hit("straggler", 1, loses_work=False))

    # --- budgets ------------------------------------------------------------------------------------------------

    def count_interruption(self) -> None:
        drawn = sum(self.t.causes.values())
        if drawn > self.limits.run_interruptions:
            raise self.past_limit("interruptions", drawn, "run_interruptions")

    def past_limit(self, what: str, count: int, limit: str) -> PlanError:
        done = self.current_progress() / max(self.s.useful_s, 1e-300)
        at = f"by day {self.env.now / 86400:,.4g} of its simulated wall time at {done:.1%} of its training"
        fix = "lower training.tokens or the failure rates"
        return over(f"{self.s.plan.name}: the run drew {what} {at}", count, limit, self.limits, fix)

    def stranded(self) -> PlanError:
        """The job lacks nodes that no repair will return: it can never run again."""
        plan, elastic = self.s.plan, self.policy.elastic and self.s.plan.layout.dp > 1
        return PlanError(
            f"{plan.name}: the run cannot finish: by day {self.env.now / 86400:,.4g} {self.fenced:,} node(s) were "
            f"fenced off for good after {self.policy.fence_after} failures each, and the job (at "
            f"{self.dp * self.s.replica_nodes:,} of its {self.s.job_nodes:,} nodes) lacks {self.missing:,} that no "
            f"repair will return, of the cluster's {self.s.cluster.nodes:,}; set reliability.rma_days (fenced nodes "
            f"replaced), add reliability.hot_spares with cluster nodes for them (cluster.nodes), "
            f"{'' if elastic else 'set reliability.elastic, '}or raise reliability.fence_after"
        )

    def run(self) -> Tally:
        """Run to the end of training."""
        self.env.run(until=self.job)
        return self.t
