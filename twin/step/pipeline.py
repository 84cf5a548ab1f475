"""One optimizer step of one pipeline replica, simulated in SimPy.

Each pipeline rank is a process that runs its schedule's actions in order, waiting for the activation (or the
gradient) its action needs. A cross-rank send holds the link between the two ranks in that direction for the
message's time, so sends queue when they contend (a timed event behind the link's previous message; a process
holding a SimPy resource on a CPU host). Data-parallel gradient buckets become ready
as each stage's final backward runs and queue on the rank's data-parallel link, overlapping the backward; what is
left after the rank's last computation is exposed. Time a rank spends waiting is pipeline communication while the
message it waits for is on the wire (or queued for it), and bubble otherwise. Every rank then joins the job-wide
gradient-norm all-reduce, a barrier: a rank done early waits there for the slowest (bubble) before its optimizer
step. On a CPU host a rank woken from a wait may find every core busy and wait for one. (SimPy's "machine shop" pattern:
processes for workers, resources for shared links; records collected in lists, tables built after `env.run()`.)
"""

from __future__ import annotations

import gc
from collections.abc import Generator, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import simpy

from twin.step.host import SharedCores
from twin.step.pipeline_data import ActionCost, PipelineInput, PipelineResult, RankTimes, Slice
from twin.step.schedules import Action, receiver


class _Sim:
    def __init__(self, inp: PipelineInput) -> None:
        self.inp = inp
        self.env = simpy.Environment()
        self.done: dict[tuple[str, int, int], simpy.Event] = {}
        self.arrived: dict[tuple[str, int, int], simpy.Event] = {}
        self.sent_at: dict[tuple[str, int, int], float] = {}
        self.arrived_at: dict[tuple[str, int, int], float] = {}
        self.links: dict[tuple[int, int], simpy.Resource] = {}
        self.link_free: dict[tuple[int, int], float] = {}
        self.dp_link = [simpy.Resource(self.env, capacity=1) for _ in inp.orders]
        self.gathered: dict[int, simpy.Event] = {}
        self.pending_dp: list[list[simpy.Event]] = [[] for _ in inp.orders]
        self.times = [RankTimes() for _ in inp.orders]
        self.slices: list[Slice] = []
        self.events = 0
        self.last_stage = len(inp.stage_rank) - 1
        self.final_grad = self._final_grad_actions()
        self.awaited_here = self._awaited_on_own_rank()
        self.arrived_ranks = 0
        self.barrier = self.env.event()
        self.pools: list[SharedCores] = []
        if inp.host is not None:
            n_pools = -(-len(inp.orders) // inp.host.ranks_per_pool)
            self.pools = [SharedCores(self.env, inp.host.cores, inp.host.weight) for _ in range(n_pools)]

    def work(self, rank: int, seconds: float) -> simpy.Event:
        """`seconds` of a rank's work at full speed: shared with the busy ranks of its node on a CPU host."""
        if not self.pools or seconds <= 0:
            return self.timeout(seconds)
        assert self.inp.host is not None
        self.events += 1
        return self.pools[rank // self.inp.host.ranks_per_pool].run(seconds, owner=rank)

    def wakeup_s(self, rank: int, slept_s: float) -> float:
        """Seconds before a rank that a message wakes runs again; 0 off CPU hosts, where no event is spent on it.
        On a CPU host whose busy processes fill the physical cores, it waits for a core (HostSharing.wakeup_s) for
        the share of its processes that find none. A wait shorter than that latency counts in proportion
        (`slept_s`), so a prediction does not jump as a message arrives just before or after its receiver asks
        for it. (Collectives inside actions price their rounds' scheduling with host.blocked_stretch instead.)"""
        host = self.inp.host
        if not self.pools or host is None or host.wakeup_s <= 0:
            return 0.0
        runnable = self.pools[rank // host.ranks_per_pool].others_busy(rank, host.wakeup_s) + host.weight
        short = min(1.0, max(0.0, (runnable - host.physical_cores) / host.weight))
        slept = min(1.0, slept_s / host.wakeup_s)
        return host.wakeup_s * short * slept

    def _final_grad_actions(self) -> set[int]:
        """The last gradient action of each stage, by identity (hashing an action by its fields costs a call)."""
        kind = "W" if self.inp.split_w else "B"
        last: dict[int, Action] = {}
        for order in self.inp.orders:
            for a in order:
                if a.kind == kind:
                    last[a.stage] = a
        return {id(a) for a in last.values()}

    def _awaited_on_own_rank(self) -> set[tuple[str, int]]:
        """(kind, stage) of the actions whose result the next stage takes on the same rank (the turn of a "V"), the
        only ones whose end is an event someone waits for."""
        ranks, last = self.inp.stage_rank, self.last_stage
        forward = {("F", s) for s in range(last) if ranks[s + 1] == ranks[s]}
        return forward | {("B", s) for s in range(1, last + 1) if ranks[s - 1] == ranks[s]}

    def event(self, table: dict[Any, simpy.Event], key: Any) -> simpy.Event:
        if key not in table:
            table[key] = self.env.event()
            self.events += 1
        return table[key]

    def timeout(self, seconds: float) -> simpy.Event:
        self.events += 1
        return self.env.timeout(max(0.0, seconds))

    def start(self) -> None:
        for stage in self.inp.gather_stage_s:
            self.event(self.gathered, stage)
        for rank in range(len(self.inp.orders)):
            if self.inp.gather_stage_s:
                self.env.process(self.gather(rank))
            self.env.process(self.rank(rank))

    def result(self) -> PipelineResult:
        step = max(t.end for t in self.times)
        for t in self.times:  # a rank that finishes early idles until the slowest one is done
            t.bubble += step - t.end
        return PipelineResult(step, tuple(self.times), tuple(self.slices), self.events, arrivals=self.arrived_at)

    def dependency(self, a: Action, rank: int) -> tuple[str, int, int] | None:
        """The result `a` waits for from another stage, keyed as (kind, stage it feeds, microbatch)."""
        if a.kind == "F" and a.stage > 0:
            return ("F", a.stage, a.microbatch)
        if a.kind == "B" and a.stage < self.last_stage:
            return ("B", a.stage, a.microbatch)
        return None

    def wait_for(self, key: tuple[str, int, int], a: Action, rank: int) -> simpy.Event:
        source = a.stage - 1 if key[0] == "F" else a.stage + 1
        if self.inp.stage_rank[source] == rank:
            return self.event(self.done, (key[0], source, key[2]))
        return self.event(self.arrived, key)

    def rank(self, rank: int) -> Generator[simpy.Event, Any, None]:
        times = self.times[rank]
        first_forward: set[int] = set()
        for a in self.inp.orders[rank]:
            key = self.dependency(a, rank)
            if key is not None:
                ev = self.wait_for(key, a, rank)
                t0 = self.env.now
                yield ev
                waited = self.env.now - t0
                on_wire = min(waited, max(0.0, self.env.now - self.sent_at.get(key, self.env.now)))
                times.pp += on_wire
                self.mark(rank, "PP", self.env.now - on_wire, self.env.now, a)
                times.bubble += waited - on_wire
                late = self.wakeup_s(rank, waited) if waited > 0 else 0.0
                if late > 0:
                    yield self.timeout(late)
                    times.bubble += late
            if a.kind == "F" and a.stage in self.gathered and a.stage not in first_forward:
                first_forward.add(a.stage)
                t0 = self.env.now
                yield self.gathered[a.stage]
                times.dp += self.env.now - t0
                self.mark(rank, "DP", t0, self.env.now, a)
            cost = self.inp.cost(a)
            start = self.env.now
            if id(a) in self.final_grad and self.inp.dp_stage_s.get(a.stage, 0.0) > 0:
                self.launch_buckets(rank, a.stage, start, cost.total)
            yield from self.run_action(rank, a, cost, times)
            self.slices.append(Slice(rank, a.stage, a.kind, a.microbatch, start, self.env.now))
            exposed = cost.tp + cost.cp + cost.ep + cost.dp
            if exposed > 0:  # an action's exposed collectives end it
                at = self.env.now - exposed
                for axis, seconds in (("TP", cost.tp), ("CP", cost.cp), ("EP", cost.ep), ("DP", cost.dp)):
                    at = self.mark(rank, axis, at, at + seconds, a)
            if (a.kind, a.stage) in self.awaited_here:
                self.event(self.done, (a.kind, a.stage, a.microbatch)).succeed()
            sent = self.send(a, rank)
            if sent is not None and self.inp.blocking_sends:
                t0 = self.env.now
                yield sent
                times.pp += self.env.now - t0
                self.mark(rank, "PP", t0, self.env.now, a)
        compute_end = self.env.now
        if self.pending_dp[rank]:
            yield self.env.all_of(self.pending_dp[rank])
        stages = {a.stage for a in self.inp.orders[rank]}
        after = (1 - self.inp.dp_overlap) * sum(self.inp.dp_stage_s.get(s, 0.0) for s in stages)
        if after > 0:
            yield self.work(rank, after)
        times.dp += self.env.now - compute_end
        self.mark(rank, "DP", compute_end, self.env.now)
        start = self.env.now
        yield from self.join_barrier(rank, times)
        self.mark(rank, "barrier", start, self.env.now, track="compute")
        start = self.env.now
        yield self.work(rank, self.inp.optimizer_s.get(rank, 0.0))
        times.optimizer += self.env.now - start
        self.mark(rank, "optimizer", start, self.env.now, track="compute")
        times.end = self.env.now

    def mark(
        self, rank: int, kind: str, start: float, end: float, a: Action | None = None, track: str = "comm"
    ) -> float:
        """Record a span of a rank's step for the timeline (nothing if it is empty); returns its end."""
        if end > start:
            self.slices.append(Slice(rank, a.stage if a else -1, kind, a.microbatch if a else -1, start, end, track))
        return end

    def join_barrier(self, rank: int, times: RankTimes) -> Generator[simpy.Event, Any, None]:
        """Wait for every rank to reach the step-end all-reduce, then run it; all of it is waiting for peers."""
        start = self.env.now
        self.arrived_ranks += 1
        if self.arrived_ranks == len(self.inp.orders):
            self.barrier.succeed()
        else:
            yield self.barrier
            late = self.wakeup_s(rank, self.env.now - start)
            if late > 0:
                yield self.timeout(late)
        yield self.timeout(self.inp.barrier_s)
        times.bubble += self.env.now - start

    def run_action(self, rank: int, a: Action, cost: ActionCost, times: RankTimes) -> Generator[Any, Any, None]:
        """One action's time. On a CPU host its compute shares the cores with the busy ranks and its blocked
        collectives wait for peers scheduled among all of the node's ranks; elsewhere it is one timeout."""
        work_stretch = comm_stretch = 1.0
        if self.inp.host is None:
            yield self.timeout(cost.total)
        else:
            work = cost.compute + cost.recompute
            t0 = self.env.now
            yield self.work(rank, work)
            work_stretch = (self.env.now - t0) / work if work > 0 else 1.0
            comm_stretch = self.inp.host.blocked_stretch
            if cost.total > work:
                yield self.timeout((cost.total - work) * comm_stretch)
        times.compute += cost.compute * work_stretch
        times.recompute += cost.recompute * work_stretch
        times.tp += cost.tp * comm_stretch
        times.cp += cost.cp * comm_stretch
        times.ep += cost.ep * comm_stretch
        times.dp += cost.dp * comm_stretch
        if a.kind == "F":
            times.forward += cost.compute * work_stretch

    def send(self, a: Action, rank: int) -> simpy.Event | None:
        """Start sending what `a` produced to the stage that needs it; the transfer, or None if none is needed."""
        target = receiver(a, len(self.inp.stage_rank))
        if target is None:
            return None
        dst = self.inp.stage_rank[target]
        if dst == rank:
            return None
        key = (a.kind, target, a.microbatch)
        self.sent_at[key] = self.env.now
        seconds = self.inp.p2p_s[(a.stage, target)]
        if self.pools:
            return self.env.process(self.transfer(rank, dst, key, seconds))
        # Only this rank sends on the link, one message after another in its order, so the link's queue is a
        # running maximum: a SimPy resource and a process per message cost half the step's simulation for the same
        # times. On a CPU host (above) the receiver's share of the cores makes a transfer's length depend on when
        # it runs, so it stays a process.
        end = max(self.env.now, self.link_free.get((rank, dst), 0.0)) + seconds
        self.link_free[(rank, dst)] = self.arrived_at[key] = end
        wire = self.timeout(end - self.env.now)
        arrived = self.event(self.arrived, key)

        def arrive(_: simpy.Event) -> None:
            arrived.succeed()

        wire.callbacks.append(arrive)
        return wire

    def transfer(self, src: int, dst: int, key: tuple[str, int, int], seconds: float) -> Generator[Any, Any, None]:
        link = self.links.setdefault((src, dst), simpy.Resource(self.env, capacity=1))
        with link.request() as req:
            yield req
            # On a CPU host the receiver needs a core to take the message in: it waits for its share
            yield self.work(dst, seconds)
        self.arrived_at[key] = self.env.now
        self.event(self.arrived, key).succeed()

    def launch_buckets(self, rank: int, stage: int, start: float, duration: float) -> None:
        per_bucket = self.inp.dp_overlap * self.inp.dp_stage_s[stage] / self.inp.buckets
        if per_bucket <= 0:
            return
        for i in range(self.inp.buckets):
            ready = start + duration * (i + 1) / self.inp.buckets
            done = self.env.event()
            self.events += 1
            self.pending_dp[rank].append(done)
            self.env.process(self.reduce_bucket(rank, ready, per_bucket, done))

    def reduce_bucket(self, rank: int, ready: float, seconds: float, done: simpy.Event) -> Generator[Any, Any, None]:
        yield self.timeout(ready - self.env.now)
        with self.dp_link[rank].request() as req:
            yield req
            yield self.timeout(seconds)
        done.succeed()

    def gather(self, rank: int) -> Generator[Any, Any, None]:
        stages = sorted(
            {a.stage for a in self.inp.orders[rank]},
            key=lambda s: next(i for i, a in enumerate(self.inp.orders[rank]) if a.stage == s),
        )
        for stage in stages:
            ev = self.gathered[stage]
            with self.dp_link[rank].request() as req:
                yield req
                yield self.timeout(self.inp.gather_stage_s.get(stage, 0.0))
            ev.succeed()


@contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Python's cycle collector paused while a step is simulated: the simulation allocates a few objects per event
    (hundreds of thousands at pp 128), which set the collector off again and again to walk them all for nothing —
    30% of a large step's time. What it would have found is collected once it resumes."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def simulate(inp: PipelineInput) -> PipelineResult:
    """Run one step of the pipeline and return its time, per-rank breakdown and timeline."""
    with no_cycle_collection():
        sim = _Sim(inp)
        sim.start()
        sim.env.run()
        return sim.result()


class Watched:
    """One step simulated a stretch of simulated time at a time, so that its caller can look at what has happened
    so far (`slices`, `arrivals`) and stop early (twin/step/steady.py stops a long step once it repeats)."""

    def __init__(self, inp: PipelineInput) -> None:
        self._sim = _Sim(inp)
        self._sim.start()

    @property
    def slices(self) -> list[Slice]:
        return self._sim.slices

    @property
    def arrivals(self) -> Mapping[tuple[str, int, int], float]:
        return self._sim.arrived_at

    def advance(self, seconds: float) -> bool:
        """Simulate `seconds` more; False once the step is over (nothing left to happen)."""
        env = self._sim.env
        if env.peek() == float("inf"):
            return False
        with no_cycle_collection():
            env.run(until=env.now + seconds)
        return env.peek() != float("inf")

    def finish(self) -> PipelineResult:
        """Simulate the rest of the step and return it."""
        with no_cycle_collection():
            self._sim.env.run()
            return self._sim.result()
