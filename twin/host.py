"""Host CPU cores shared by the ranks that compute on them at the same moment (processor sharing).

On a CPU cluster every rank is an OS process, and a node often runs more ranks than it has cores (8 gloo ranks on
a 2-core VM). A rank waiting for a message sleeps without using a core (gloo blocks on a condition variable; its
process CPU time stays flat while it waits), so the ranks that are busy share the cores equally, as Linux's fair
scheduler gives runnable processes equal shares. A pipeline stage's work therefore runs faster while another stage
sits in its bubble — a static `cores / ranks` share cannot express that, so the pipeline simulation runs each
action's work through a `SharedCores` of its node.

A rank blocked in a collective is different: every step of the collective needs each peer to be scheduled, and
a peer competes with all of the node's ranks, busy or about to wake; the time it blocks stretches by ranks per
physical core (`blocked_stretch`). Compute sees the host's effective cores, which `twin calibrate` may find above
the physical count (measured here: 8 ranks on 2 cores run their compute 2.7 cores' worth, not 2).

SimPy's resources grant whole servers to queued requests; none slows every holder as more arrive, which is what
an oversubscribed host does, hence this small hand-written processor-sharing server.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import simpy

_EPS_S = 1e-12  # work left below this is done (seconds; float round-off of remaining / rate)


@dataclass(frozen=True)
class HostSharing:
    """How a pipeline replica's ranks share host cores."""

    cores: float
    """Cores of one node (count)."""
    weight: float
    """OS processes each simulated pipeline rank stands for on its node: the dp·cp·tp ranks doing the same work."""
    ranks_per_pool: int
    """Consecutive pipeline ranks whose processes share one node's cores."""
    blocked_stretch: float = 1.0
    """How much longer a blocked collective takes than on an idle host: every peer must be scheduled once per
    step of the collective, among all of the node's ranks (ranks / physical cores, at least 1)."""


class SharedCores:
    """A node's cores: each job is `weight` processes, all running at min(1, cores / busy processes) speed."""

    def __init__(self, env: simpy.Environment, cores: float, weight: float) -> None:
        self.env, self.cores, self.weight = env, cores, weight
        self.jobs: dict[int, list[Any]] = {}  # id -> [work left at full speed (s), done event]
        self.next_id = 0
        self.last = 0.0
        self.wake = env.event()
        env.process(self._serve())

    def rate(self) -> float:
        busy = len(self.jobs) * self.weight
        return min(1.0, self.cores / busy) if busy else 1.0

    def run(self, work_s: float) -> simpy.Event:
        """An event that fires when `work_s` seconds of full-speed work are done at the shared rate."""
        done = self.env.event()
        if work_s <= _EPS_S:
            return done.succeed()
        self._advance()
        self.jobs[self.next_id] = [work_s, done]
        self.next_id += 1
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
            for key in [k for k, job in self.jobs.items() if job[0] <= _EPS_S]:
                self.jobs.pop(key)[1].succeed()
