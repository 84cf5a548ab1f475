"""The simulation of one pipeline step (twin/step/pipeline.py says what it models): the state every rank's
process shares, and a GPU rank's process, which times its actions by arithmetic on its own clock and meets
SimPy's only to wait for a message not yet sent. A CPU host's ranks share cores, so theirs run event by event
(twin/step/pipeline_host.py)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import simpy

from twin.step.pipeline_data import ActionCost, PipelineInput, PipelineResult, RankTimes, Slice
from twin.step.schedules import Action, receiver

Priced = tuple[ActionCost, float, tuple[tuple[str, float], ...], float, int | None]
"""An action's cost, its seconds, its exposed collectives (axis, seconds) and their seconds, and the stage on
another rank it sends its result to (None: none)."""


class PipelineSim:
    """One step: a SimPy process per pipeline rank (`rank`), a process per gradient bucket and per ZeRO-3 gather,
    and the barrier they all join."""

    def __init__(self, inp: PipelineInput) -> None:
        self.inp = inp
        self.env = simpy.Environment()
        self.arrived: dict[tuple[str, int, int], simpy.Event] = {}
        self.sent_at: dict[tuple[str, int, int], float] = {}
        self.arrived_at: dict[tuple[str, int, int], float] = {}
        self.done_at: dict[tuple[str, int, int], float] = {}
        self.gathered_at: dict[int, float] = {}
        self.prices: dict[tuple[str, int, bool], Priced] = {}
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

    def work(self, rank: int, seconds: float) -> simpy.Event:
        """`seconds` of a rank's work at full speed (a CPU host shares it with the busy ranks of its node)."""
        return self.timeout(seconds)

    def wakeup_s(self, rank: int, slept_s: float) -> float:
        """Seconds before a rank that a message wakes runs again: none off CPU hosts."""
        return 0.0

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

    def rank(self, rank: int) -> Generator[simpy.Event, Any, None]:
        """A rank's actions off CPU hosts, each timed by arithmetic on the rank's own clock `t`, which runs ahead
        of the simulation's: nothing else shares a GPU rank or its outgoing links, so an action starts when the
        previous one ends or when what it needs arrives, whichever is later, and a message arrives when its link
        is free after the send. The process meets the simulation's clock only where it needs a message not yet
        sent, waiting there for the event its sender triggers: a few events per microbatch, not a few per action.
        What the actions cost is charged to the rank's times once per kind of action, by count."""
        times, t = self.times[rank], 0.0
        ranks, last, slices, env = self.inp.stage_rank, self.last_stage, self.slices, self.env
        arrived_at, done_at, awaited_here, final_grad = (
            self.arrived_at,
            self.done_at,
            self.awaited_here,
            self.final_grad,
        )
        ran: dict[tuple[str, int, bool], int] = {}
        first_forward: set[int] = set()
        for a in self.inp.orders[rank]:
            kind, stage, mb = a.kind, a.stage, a.microbatch
            source = stage - 1 if kind == "F" and stage > 0 else stage + 1 if kind == "B" and stage < last else None
            if source is not None:
                if ranks[source] == rank:  # the turn of a "V": an earlier action of this rank
                    at = done_at[(kind, source, mb)]
                else:
                    key = (kind, stage, mb)
                    if key not in arrived_at:
                        if t > env.now:  # meet the simulation's clock: the message may be sent before then
                            yield self.timeout(t - env.now)
                        if key not in arrived_at:
                            yield self.event(self.arrived, key)
                    at = arrived_at[key]
                    if at > t:
                        on_wire = min(at - t, at - self.sent_at[key])
                        times.pp += on_wire
                        times.bubble += at - t - on_wire
                        self.mark(rank, "PP", at - on_wire, at, a)
                t = max(t, at)
            if kind == "F" and stage in self.gathered and stage not in first_forward:
                first_forward.add(stage)
                if stage not in self.gathered_at:
                    if t > env.now:
                        yield self.timeout(t - env.now)
                    if stage not in self.gathered_at:
                        yield self.gathered[stage]
                at = max(t, self.gathered_at[stage])
                times.dp += at - t
                t = self.mark(rank, "DP", t, at, a) if at > t else t
            _, total, exposed, exposed_s, target = self.priced(a, rank)
            start, t = t, t + total
            ran[(kind, stage, a.overlap)] = ran.get((kind, stage, a.overlap), 0) + 1
            if id(a) in final_grad and self.inp.dp_stage_s.get(stage, 0.0) > 0:
                self.launch_buckets(rank, stage, start, total)
            slices.append(Slice(rank, stage, kind, mb, start, t))
            at = t - exposed_s
            for axis, seconds in exposed:  # an action's exposed collectives end it
                slices.append(Slice(rank, stage, axis, mb, at, at + seconds, "comm"))
                at += seconds
            if (kind, stage) in awaited_here:
                done_at[(kind, stage, mb)] = t
            if target is not None:
                end = self.send_at(rank, (kind, target, mb), t)
                if self.inp.blocking_sends:
                    times.pp += end - t
                    t = self.mark(rank, "PP", t, end, a) if end > t else t
        for priced, n in ran.items():
            self.charge(times, priced[0] == "F", self.prices[priced][0], n)
        if t > env.now:
            yield self.timeout(t - env.now)
        yield from self.finish_rank(rank, times)

    def priced(self, a: Action, rank: int) -> Priced:
        """What `a` costs, its seconds, its exposed collectives in the order they run at its end (by axis), their
        seconds, and the stage on another rank it sends its result to (None: none)."""
        key = (a.kind, a.stage, a.overlap)
        if key not in self.prices:
            cost = self.inp.cost(a)
            axes = (("TP", cost.tp), ("CP", cost.cp), ("EP", cost.ep), ("DP", cost.dp))
            exposed = tuple((axis, s) for axis, s in axes if s > 0)
            target = receiver(a, len(self.inp.stage_rank))
            if target is not None and self.inp.stage_rank[target] == rank:
                target = None
            self.prices[key] = (cost, cost.total, exposed, cost.tp + cost.cp + cost.ep + cost.dp, target)
        return self.prices[key]

    def send_at(self, rank: int, key: tuple[str, int, int], t: float) -> float:
        """Send the message `key` (kind, the stage it feeds on another rank, microbatch) at `t` off CPU hosts; when
        it arrives. Only this rank sends on the link, one message after another in its order, so the link's queue
        is a running maximum. A receiver already waiting for it is woken then."""
        kind, target, _ = key
        dst = self.inp.stage_rank[target]
        self.sent_at[key] = t
        end = (
            max(t, self.link_free.get((rank, dst), 0.0))
            + self.inp.p2p_s[(target - 1 if kind == "F" else target + 1, target)]
        )
        self.link_free[(rank, dst)] = self.arrived_at[key] = end
        if key in self.arrived:
            waiting = self.arrived[key]

            def wake(_: simpy.Event) -> None:
                waiting.succeed()

            self.timeout(end - self.env.now).callbacks.append(wake)
        return end

    def finish_rank(self, rank: int, times: RankTimes) -> Generator[simpy.Event, Any, None]:
        """A rank's step after its last action: the rest of its gradient reduction, the barrier, its optimizer."""
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

    @staticmethod
    def charge(
        times: RankTimes, forward: bool, cost: ActionCost, n: int = 1, work: float = 1.0, comm: float = 1.0
    ) -> None:
        """Add what `n` actions costing `cost` (forwards or not) took to a rank's `times`: their work stretched by
        `work` (a CPU host's sharing), their blocked collectives by `comm` (waiting for peers scheduled among the
        host's ranks)."""
        times.compute += n * cost.compute * work
        times.recompute += n * cost.recompute * work
        times.tp += n * cost.tp * comm
        times.cp += n * cost.cp * comm
        times.ep += n * cost.ep * comm
        times.dp += n * cost.dp * comm
        if forward:
            times.forward += n * cost.compute * work

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
            self.gathered_at[stage] = self.env.now
            ev.succeed()
