"""The simulation of one pipeline step (twin/step/pipeline.py says what it models): the state every rank's
process shares, and a GPU rank's process, which times its actions by arithmetic on its own clock and meets
SimPy's only to wait for a message not yet sent. A CPU host's ranks share cores, so theirs run event by event
(twin/step/pipeline_host.py)."""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import Any

import simpy

from twin.step.pipeline_data import ActionCost, Exposure, PipelineInput, PipelineResult, RankTimes, Slice, Spans
from twin.step.pipeline_steps import MESSAGE, OWN_RANK, PriceKey, rank_steps
from twin.step.schedules import Action

Priced = tuple[ActionCost, float, tuple[tuple[str, float], ...], float]
"""An action's cost, its seconds, and its exposed collectives (axis, seconds) and their seconds."""


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
        self.prices = self._prices()
        self.dp_link = [simpy.Resource(self.env, capacity=1) for _ in inp.orders]
        self.gathered: dict[int, simpy.Event] = {}
        self.pending_dp: list[list[simpy.Event]] = [[] for _ in inp.orders]
        self.times = [RankTimes() for _ in inp.orders]
        self.slices: list[Slice] = []
        self.exposures: list[Exposure] = []
        self.events = 0
        self.arrived_ranks = 0
        self.barrier = self.env.event()

    def work(self, rank: int, seconds: float) -> simpy.Event:
        """`seconds` of a rank's work at full speed (a CPU host shares it with the busy ranks of its node)."""
        return self.timeout(seconds)

    def wakeup_s(self, rank: int, slept_s: float) -> float:
        """Seconds before a rank that a message wakes runs again: none off CPU hosts."""
        return 0.0

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
        spans = Spans(tuple(self.slices), tuple(self.exposures))
        return PipelineResult(step, tuple(self.times), spans, self.events, arrivals=self.arrived_at)

    def rank(self, rank: int) -> Generator[simpy.Event, Any, None]:
        """A rank's actions off CPU hosts, each timed by arithmetic on the rank's own clock `t`, which runs ahead
        of the simulation's: nothing else shares a GPU rank or its outgoing links, so an action starts when the
        previous one ends or when what it needs arrives, whichever is later, and a message arrives when its link
        is free after the send. The process meets the simulation's clock only where it needs a message not yet
        sent, waiting there for the event its sender triggers: a few events per microbatch, not a few per action.
        What the actions cost is charged to the rank's times once per kind of action, by count."""
        times, t = self.times[rank], 0.0
        steps, counts = rank_steps(self.inp.orders, self.inp.stage_rank, self.inp.split_w)[rank]
        slices, exposures, prices = self.slices, self.exposures, self.prices
        arrived_at, done_at, env, p2p_s = self.arrived_at, self.done_at, self.env, self.inp.p2p_s
        link_free: dict[int, float] = {}  # by the rank each link goes to: only this rank sends on them
        new = tuple.__new__  # a span made straight from its fields: Slice(...) calls a Python-level __new__
        for a, waits, key, price, first_forward, final_grad, done, sends, to, hop in steps:
            if waits == OWN_RANK:  # the turn of a "V": an earlier action of this rank, ended before this one
                at = done_at[key]
                t = at if at > t else t
            elif waits == MESSAGE:
                if key not in arrived_at:  # `until_known`, inline: a generator per wait cost 10% at pp 128
                    if t > env.now:
                        yield self.timeout(t - env.now)
                    if key not in arrived_at:
                        yield self.event(self.arrived, key)
                at = arrived_at[key]
                if at > t:
                    on_wire = min(at - t, at - self.sent_at[key])
                    times.pp += on_wire
                    times.bubble += at - t - on_wire
                    if on_wire > 0:  # `mark`, inline
                        slices.append(new(Slice, (rank, a.stage, "PP", a.microbatch, at - on_wire, at, "comm")))
                    t = at
            if first_forward and self.gathered:
                if a.stage not in self.gathered_at:
                    yield from self.until_known(self.gathered_at, a.stage, t, self.gathered)
                at = self.gathered_at[a.stage]
                if at > t:
                    times.dp += at - t
                    t = self.mark(rank, "DP", t, at, a)
            _, total, exposed, exposed_s = prices[price]
            start, t = t, t + total
            if final_grad and self.inp.dp_stage_s.get(a.stage, 0.0) > 0:
                self.launch_buckets(rank, a.stage, start, total)
            slices.append(new(Slice, (rank, a.stage, a.kind, a.microbatch, start, t, "compute")))
            if exposed:  # `mark_exposed`, inline: once per action
                exposures.append((len(slices) - 1, rank, a.stage, a.microbatch, t - exposed_s, exposed))
            if done is not None:
                done_at[done] = t
            if sends is not None:  # its link sends one message after another in order: a running maximum
                free = link_free.get(to, 0.0)
                end = link_free[to] = (t if t > free else free) + p2p_s[hop]
                self.send_at(sends, t, end)
                if self.inp.blocking_sends:
                    times.pp += end - t
                    t = self.mark(rank, "PP", t, end, a) if end > t else t
        for price, n in counts.items():
            self.charge(times, price[0] == "F", prices[price][0], n)
        yield from self.meet(t)
        yield from self.finish_rank(rank, times)

    def meet(self, t: float) -> Generator[simpy.Event, Any, None]:
        """Bring the simulation's clock to a rank's own clock `t`."""
        if t > self.env.now:
            yield self.timeout(t - self.env.now)

    def until_known(
        self, known: Mapping[Any, float], key: Any, t: float, events: dict[Any, simpy.Event]
    ) -> Generator[simpy.Event, Any, None]:
        """Wait for the time of `key` (a message's arrival, a gather's end) that a rank at its own clock `t` needs
        and `known` does not hold yet: meet the simulation's clock first, since it may come to be known before
        then, else wait for the event (from `events`) that whoever makes it known triggers."""
        yield from self.meet(t)
        if key not in known:
            yield self.event(events, key)

    def mark_exposed(
        self, rank: int, a: Action, end: float, exposed: tuple[tuple[str, float], ...], exposed_s: float
    ) -> None:
        """Record the exposed collectives (axis, seconds) that end action `a` at `end`, in their order, after the
        action's span (made the last): spans only when the timeline is read (`Spans`)."""
        if exposed:
            self.exposures.append((len(self.slices) - 1, rank, a.stage, a.microbatch, end - exposed_s, exposed))

    def _prices(self) -> dict[PriceKey, Priced]:
        """Every action's cost by (kind, stage, overlapped), its seconds, and its exposed collectives in the order
        they run at its end (by axis) with their seconds."""
        prices = {}
        for kind, stage in self.inp.costs:
            for overlap in (False, True):
                cost = self.inp.cost_of(kind, stage, overlap)
                axes = (("TP", cost.tp), ("CP", cost.cp), ("EP", cost.ep), ("DP", cost.dp))
                exposed = tuple((axis, s) for axis, s in axes if s > 0)
                prices[(kind, stage, overlap)] = (cost, cost.total, exposed, cost.tp + cost.cp + cost.ep + cost.dp)
        return prices

    def send_at(self, key: tuple[str, int, int], t: float, end: float) -> None:
        """The message `key` (kind, the stage it feeds on another rank, microbatch), sent at `t` off CPU hosts,
        arrives at `end`; a receiver already waiting for it is woken then."""
        self.sent_at[key] = t
        self.arrived_at[key] = end
        waiting = self.arrived.get(key)
        if waiting is not None:

            def wake(_: simpy.Event) -> None:
                waiting.succeed()

            self.timeout(end - self.env.now).callbacks.append(wake)

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
