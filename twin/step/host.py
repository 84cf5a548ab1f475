"""Host CPU cores shared by the ranks that compute on them at the same moment (processor sharing).

On a CPU cluster every rank is an OS process, and a node often runs more ranks than it has cores (8 gloo ranks on
a 2-core VM). A rank waiting for a message sleeps without using a core (gloo blocks on a condition variable; its
process CPU time stays flat while it waits), so the ranks that are busy share the cores equally, as Linux's fair
scheduler gives runnable processes equal shares. A pipeline stage's work therefore runs faster while another stage
sits in its bubble — a static `cores / ranks` share cannot express that, so the pipeline simulation runs each
action's work through a `SharedCores` of its node.

A rank blocked in a collective is different: every step of the collective needs each peer to be scheduled, and
a peer competes with all of the node's ranks, busy or about to wake; the time it blocks stretches by ranks per
physical core (`blocked_stretch`). Compute sees the host's effective cores: the physical count unless the
profile says SMT or a hypervisor gives more (on this VM dp2 and dp8 burn the same CPU-seconds per sequence).

A rank that a message wakes from such a sleep runs at once only if a physical core is free; when the node's
runnable processes fill every core it waits for the running process's time slice to end (`wakeup_s`, the
cluster's node.wakeup_latency_us). The load it meets is the other ranks' mean over the last `wakeup_s` (a
mean-field reading: the instantaneous count would make predictions jump as actions reorder, which least-squares
fitting cannot step across). That cost scales with the waits a schedule has, not with its compute, which
is why interleaved 1F1B (p·v - 1 rank crossings per microbatch each way, where 1F1B has p - 1) loses more to
an oversubscribed host than 1F1B does.

SimPy's resources grant whole servers to queued requests; none slows every holder as more arrive, which is what
an oversubscribed host does, hence this small hand-written processor-sharing server.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import simpy

from plan.cluster import Cluster

_EPS_S = 1e-12  # work left below this is done (seconds; float round-off of remaining / rate)


def shares_cores(cluster: Cluster) -> bool:
    """Whether a cluster's ranks share host cores (a `cpu` accelerator is a rank slot on a host's cores): the
    pipeline simulation then shares them among the busy ranks."""
    return cluster.accelerator.kind == "cpu"


@dataclass(frozen=True)
class HostSharing:
    """How a pipeline replica's ranks share host cores."""

    cores: float
    """Cores of one node (count)."""
    weight: float
    """OS processes each simulated pipeline rank stands for on its node: the dp·cp·tp ranks doing the same work."""
    ranks_per_pool: int
    """Consecutive pipeline ranks whose processes share one node's cores."""
    physical_cores: float = 1.0
    """Cores of one node as the OS schedules them (count): more runnable processes than this and some wait."""
    wakeup_s: float = 0.0
    """Seconds a process woken by a message waits for a core when its node's runnable processes fill every
    physical core: the running process keeps its core until its time slice ends."""
    blocked_stretch: float = 1.0
    """How much longer a blocked collective takes than on an idle host: every peer must be scheduled once per
    step of the collective, among all of the node's ranks (ranks / physical cores, at least 1)."""


class _Load:
    """A count that changes in steps over simulated time, integrated so its mean over any window is exact."""

    def __init__(self) -> None:
        self.marks: list[float] = [0.0]
        self.points: list[tuple[float, float]] = [(0.0, 0.0)]
        """At each mark: the count integrated up to it, and the count from it on."""

    def integral(self, t: float) -> float:
        i = bisect.bisect_right(self.marks, t) - 1
        integral, count = self.points[i]
        return integral + count * (t - self.marks[i])

    def set(self, t: float, count: float) -> None:
        self.points.append((self.integral(t), count))
        self.marks.append(t)

    def mean(self, start: float, end: float) -> float:
        """The count's mean over [start, end]; its latest value where the window is empty."""
        if end <= start:
            return self.points[-1][1]
        return (self.integral(end) - self.integral(start)) / (end - start)


class SharedCores:
    """A node's cores: each job is `weight` processes, all running at min(1, cores / busy processes) speed."""

    def __init__(self, env: simpy.Environment, cores: float, weight: float) -> None:
        self.env, self.cores, self.weight = env, cores, weight
        self.jobs: dict[int, list[Any]] = {}  # id -> [work left at full speed (s), done event, owner]
        self.next_id = 0
        self.last = 0.0
        self.wake = env.event()
        self.load = _Load()
        """Busy processes over time."""
        self.owner_load: dict[int, _Load] = {}
        """Busy processes of each owner's jobs over time."""
        env.process(self._serve())

    def rate(self) -> float:
        busy = self.busy_processes()
        return min(1.0, self.cores / busy) if busy else 1.0

    def busy_processes(self) -> float:
        """OS processes computing on these cores now (each job is `weight` of them)."""
        return len(self.jobs) * self.weight

    def others_busy(self, owner: int, window_s: float) -> float:
        """Busy processes of other owners averaged over the last `window_s` seconds: the load a process of
        `owner` waking now meets (an average, so a prediction does not jump when another rank's action ends a
        moment earlier or later)."""
        now = self.env.now
        start = max(0.0, now - window_s)
        own = self.owner_load.get(owner)
        return self.load.mean(start, now) - (own.mean(start, now) if own else 0.0)

    def _changed(self, owners: set[int]) -> None:
        """Record the load after jobs of `owners` started or finished."""
        now = self.env.now
        self.load.set(now, self.busy_processes())
        for owner in owners:
            count = sum(self.weight for job in self.jobs.values() if job[2] == owner)
            self.owner_load.setdefault(owner, _Load()).set(now, count)

    def run(self, work_s: float, owner: int = -1) -> simpy.Event:
        """An event that fires when `work_s` seconds of full-speed work are done at the shared rate."""
        done = self.env.event()
        if work_s <= _EPS_S:
            return done.succeed()
        self._advance()
        self.jobs[self.next_id] = [work_s, done, owner]
        self.next_id += 1
        self._changed({owner})
        if not self.wake.triggered:
            self.wake.succeed()
        return done

    def _advance(self) -> None:
        """Credit every job with the work done since the last change, at the rate that held meanwhile."""
        done_work = (self.env.now - self.last) * self.rate()
        self.last = self.env.now
        for job in self.jobs.values():
            job[0] -= done_work

    def _serve(self) -> Generator[simpy.Event, Any, None]:
        while True:
            if not self.jobs:
                yield self.wake
                self.wake = self.env.event()
                continue
            shortest = min(job[0] for job in self.jobs.values())
            yield self.env.any_of([self.env.timeout(max(0.0, shortest) / self.rate()), self.wake])
            if self.wake.triggered:
                self.wake = self.env.event()
            self._advance()
            negligible = max(_EPS_S, 2 * math.ulp(self.env.now) * self.rate())  # below the clock's resolution
            finished = [k for k, job in self.jobs.items() if job[0] <= negligible]
            owners = set()
            for key in finished:
                _, done, owner = self.jobs.pop(key)
                done.succeed()
                owners.add(owner)
            if finished:
                self._changed(owners)
