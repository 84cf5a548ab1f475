"""The simulation of one pipeline step (twin/step/pipeline.py says what it models): the state every rank shares,
and a GPU rank's actions timed by arithmetic on its own clock in the schedule's dependency order (a deep
pipeline's a level at a time, pipeline_levels.py), with SimPy running what contends after them: gradient buckets
on each rank's DP link, the barrier, the optimizer. A CPU host's ranks share cores, so theirs run event by event
(twin/step/pipeline_host.py)."""

from __future__ import annotations

from collections.abc import Generator, Mapping
from itertools import islice
from typing import Any

import numpy as np
import simpy

from twin.step.pipeline_data import (
    ActionCost,
    Columns,
    Exposure,
    PipelineInput,
    PipelineResult,
    RankTimes,
    Slice,
    Spans,
    arrival_columns,
    columns_of,
)
from twin.step.pipeline_levels import LevelTimer, Timed, graph_of, rank_waits
from twin.step.pipeline_steps import MESSAGE, OWN_RANK, PriceKey, schedule_steps
from twin.step.pipeline_views import Arrivals, LevelSpans
from twin.step.schedules import Action

LEVELS_FROM_RANKS = 4
"""Pipeline ranks from which a GPU step is timed a level at a time (`levels_pay`)."""


def levels_pay(inp: PipelineInput) -> bool:
    """Whether a GPU step's whole pipeline is better timed a level at a time than action by action: from
    LEVELS_FROM_RANKS ranks, where a level holds enough actions for numpy's per-call cost to pay (measured on the
    presets and Narayanan et al.'s rows, one core: about equal at pp 1-4, 1.2-2.6x faster at pp 8-16, 12x at
    pp 35)."""
    return inp.host is None and len(inp.orders) >= LEVELS_FROM_RANKS


Priced = tuple[ActionCost, float, tuple[tuple[str, float], ...], float]
"""An action's cost, its seconds, and its exposed collectives (axis, seconds) and their seconds."""


class PipelineSim:
    """One step: each GPU rank's actions timed in dependency order (`evaluate`; a level at a time, `level_timer`),
    then a SimPy process per rank for its step's end (`finish`), per gradient bucket, and the barrier they all join.
    A CPU host's step (HostPipelineSim) runs a process per rank and per rank's ZeRO-3 gathers."""

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
        self.timer: LevelTimer | None = None
        self.resume_from: LevelTimer | None = None
        """A longer step's timer whose levels timed so far this step may begin with (LevelTimer.resume)."""
        self.timed: Timed | None = None
        """A deep pipeline's actions as timed a level at a time, once all are (`level_timer`, `settle_levels`)."""
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
        """Set the step up: off CPU hosts, the ZeRO-3 gathers' times (each rank gathers its stages one after
        another on its DP link, in the order it first runs them, before any gradient bucket is ready) and the
        order to time the ranks' steps in."""
        self.schedule = schedule_steps(self.inp.orders, self.inp.stage_rank, self.inp.split_w)
        self.clock = [0.0] * len(self.inp.orders)
        self.link_free: list[dict[int, float]] = [{} for _ in self.inp.orders]
        self.next_run, self.horizon = 0, 0.0
        for rank in range(len(self.inp.orders)) if self.inp.gather_stage_s else ():
            t = 0.0
            for stage in self.stages_in_order(rank):
                t = self.gathered_at[stage] = t + max(0.0, self.inp.gather_stage_s.get(stage, 0.0))

    def stages_in_order(self, rank: int) -> list[int]:
        """The stages a rank holds, in the order it first runs them (the order it gathers them in)."""
        return list(dict.fromkeys(a.stage for a in self.inp.orders[rank]))

    def advance(self, seconds: float) -> bool:
        """Time the ranks' steps for `seconds` more of the step (a caller watching a long step looks at them as
        they come, `progress`; twin/step/steady.py): a deep pipeline's levels up to the first that starts past it,
        else the runs of the dependency order up to the first that does; False once every step is timed."""
        self.horizon += seconds
        timer = self.level_timer()
        if timer is not None:
            return timer.run(self.horizon)
        self.evaluate(self.horizon)
        return self.next_run < len(self.schedule.order)

    def run(self) -> None:
        """Time every step, then simulate what follows each rank's last: its gradient buckets' reduction, the
        barrier and its optimizer."""
        timer = self.level_timer()
        if timer is not None:
            timer.run()
            self.settle_levels(timer)
        self.evaluate(float("inf"))
        for rank in range(len(self.inp.orders)):
            self.env.process(self.finish(rank))
        self.env.run()

    def progress(self, since: tuple[int, int]) -> tuple[Columns, Columns, tuple[int, int]]:
        """The actions and the message arrivals timed since `since` (what an earlier call returned last; (0, 0) at
        first), as columns, and what to pass next time."""
        if self.timer is not None:
            g, timer = self.timer.graph, self.timer
            lo, hi, first, last = since[0], timer.actions, since[1], timer.messages
            _, _, start, end = timer.times(lo, hi)
            actions = g.action_columns(lo, hi, start, end)
            return actions, g.arrival_columns(first, last, timer.arrivals(first, last)), (hi, last)
        arrived = arrival_columns(islice(self.arrived_at.items(), since[1], None))
        return columns_of(self.slices[since[0] :]), arrived, (len(self.slices), len(self.arrived_at))

    def result(self) -> PipelineResult:
        step = max(t.end for t in self.times)
        for t in self.times:  # a rank that finishes early idles until the slowest one is done
            t.bubble += step - t.end
        if self.timed is not None:
            spans: Spans = LevelSpans(self.timed, self.prices, self.inp.blocking_sends, tuple(self.slices))
            arrivals: Mapping[tuple[str, int, int], float] = Arrivals(self.timed)
        else:
            spans, arrivals = Spans(tuple(self.slices), tuple(self.exposures)), self.arrived_at
        return PipelineResult(step, tuple(self.times), spans, self.events, arrivals=arrivals)

    def level_timer(self) -> LevelTimer | None:
        """The step's levels' timer where they are timed a level at a time (`levels_pay`, before any action is
        timed one by one): the same times `evaluate` gives, every action's to the bit."""
        if self.timer is None and levels_pay(self.inp) and self.next_run == 0:
            g = graph_of(self.schedule)
            total = np.array([self.prices[p][1] for p in g.prices])
            p2p = np.array([self.inp.p2p_s[h] for h in g.hops], dtype=float)
            gathered = None
            if self.gathered_at:
                stages = [g.steps[i].action.stage for i in g.first_forward.tolist()]
                gathered = np.array([self.gathered_at[stage] for stage in stages], dtype=float)
            self.timer = LevelTimer(g, total, p2p, gathered, self.inp.blocking_sends)
            if self.resume_from is not None:
                self.timer.resume(self.resume_from)
        return None if self.timed is not None else self.timer

    def settle_levels(self, timer: LevelTimer) -> None:
        """Once every level is timed: what the ranks' waits add to their times, their gradient buckets launched
        as their final gradient passes run, and each rank's clock at its last action's end."""
        timed, g, blocking = timer.timed(), timer.graph, self.inp.blocking_sends
        waits = rank_waits(timed, len(self.times), blocking)
        for rank, times in enumerate(self.times):
            times.pp += float(waits["pp"][rank])
            times.bubble += float(waits["bubble"][rank])
            times.dp += float(waits["dp"][rank])
        for i in g.final_grad.tolist():
            a = g.steps[i].action
            if self.inp.dp_stage_s.get(a.stage, 0.0) > 0:
                self.launch_buckets(int(g.rank[i]), a.stage, float(timed.start[i]), float(timer.cost[i]))
        for rank, i in enumerate(g.last.tolist()):
            sent = g.sends[i]
            end = float(timed.end[i])
            self.clock[rank] = max(end, float(timed.arrival[sent])) if blocking and sent >= 0 else end
        self.timed = timed
        self.next_run = len(self.schedule.order)

    def evaluate(self, horizon: float) -> None:
        """Time the runs of each rank's steps in the schedule's dependency order (pipeline_steps.dependency_order),
        stopping before the first run that starts at or past `horizon`, by arithmetic on each rank's own clock.
        Nothing but its own actions shares a GPU rank or the links it sends on, so an action starts when the
        previous one ends or when what it needs arrives, whichever is later, and a message arrives when its
        link is free after the send; the order has every message sent before a step waits for it. SimPy runs
        only what contends: each rank's gradient buckets on its DP link, the barrier, the optimizer
        (`finish`). What the actions cost is charged to the rank's times once per kind of action, by count.

        Hand-written rather than a SimPy process per rank: a process must yield to the simulation each time it
        needs a message its sender has not computed yet, and at pp 128 those meetings (an event each, about
        5 us) cost more than timing the actions; the CPU host's event-by-event step (pipeline_host.py), which
        tests/test_pipeline.py holds this one equal to, is the reference."""
        order, ranks = self.schedule.order, self.schedule.ranks
        slices, exposures, prices, gathered_at = self.slices, self.exposures, self.prices, self.gathered_at
        arrived_at, done_at, sent_at, p2p_s = self.arrived_at, self.done_at, self.sent_at, self.inp.p2p_s
        blocking, reduced = self.inp.blocking_sends, self.inp.dp_stage_s
        new = tuple.__new__  # a span made straight from its fields: Slice(...) calls a Python-level __new__
        while self.next_run < len(order):
            rank, first, stop = order[self.next_run]
            t = self.clock[rank]
            if t >= horizon:
                return
            self.next_run += 1
            times, links = self.times[rank], self.link_free[rank]
            for a, waits, key, price, first_forward, final_grad, done, sends, to, hop in ranks[rank].steps[first:stop]:
                if waits == OWN_RANK:  # the turn of a "V": an earlier action of this rank, ended before this one
                    at = done_at[key]
                    t = at if at > t else t
                elif waits == MESSAGE:
                    at = arrived_at[key]
                    if at > t:
                        on_wire = min(at - t, at - sent_at[key])
                        times.pp += on_wire
                        times.bubble += at - t - on_wire
                        if on_wire > 0:  # `mark`, inline
                            slices.append(new(Slice, (rank, a.stage, "PP", a.microbatch, at - on_wire, at, "comm")))
                        t = at
                if first_forward and gathered_at:
                    at = gathered_at[a.stage]
                    if at > t:
                        times.dp += at - t
                        t = self.mark(rank, "DP", t, at, a)
                _, total, exposed, exposed_s = prices[price]
                start, t = t, t + total
                if final_grad and reduced.get(a.stage, 0.0) > 0:
                    self.launch_buckets(rank, a.stage, start, total)
                slices.append(new(Slice, (rank, a.stage, a.kind, a.microbatch, start, t, "compute")))
                if exposed:  # `mark_exposed`, inline: once per action
                    exposures.append((len(slices) - 1, rank, a.stage, a.microbatch, t - exposed_s, exposed))
                if done is not None:
                    done_at[done] = t
                if sends is not None:  # its link sends one message after another in order: a running maximum
                    free = links.get(to, 0.0)
                    end = links[to] = (t if t > free else free) + p2p_s[hop]
                    sent_at[sends], arrived_at[sends] = t, end
                    if blocking:
                        times.pp += end - t
                        t = self.mark(rank, "PP", t, end, a) if end > t else t
            self.clock[rank] = t

    def finish(self, rank: int) -> Generator[simpy.Event, Any, None]:
        """A GPU rank's step after its actions are timed: their costs charged, then from its last action's end
        on (`finish_rank`)."""
        times = self.times[rank]
        for price, n in self.schedule.ranks[rank].counts.items():
            self.charge(times, price[0] == "F", self.prices[price][0], n)
        yield from self.meet(self.clock[rank])
        yield from self.finish_rank(rank, times)

    def meet(self, t: float) -> Generator[simpy.Event, Any, None]:
        """Bring the simulation's clock to a rank's own clock `t`."""
        if t > self.env.now:
            yield self.timeout(t - self.env.now)

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
        prices: dict[PriceKey, Priced] = {}
        for kind, stage in self.inp.costs:
            for overlap in (False, True):
                if overlap and (kind, stage) not in self.inp.overlap_costs:  # costs what it costs alone
                    prices[(kind, stage, True)] = prices[(kind, stage, False)]
                    continue
                cost = self.inp.cost_of(kind, stage, overlap)
                axes = (("TP", cost.tp), ("CP", cost.cp), ("EP", cost.ep), ("DP", cost.dp))
                exposed = tuple((axis, s) for axis, s in axes if s > 0)
                prices[(kind, stage, overlap)] = (cost, cost.total, exposed, cost.tp + cost.cp + cost.ep + cost.dp)
        return prices

    def finish_rank(self, rank: int, times: RankTimes) -> Generator[simpy.Event, Any, None]:
        """A rank's step after its last action: the rest of its gradient reduction, the barrier, its optimizer."""
        compute_end = self.env.now
        if self.pending_dp[rank]:
            yield self.env.all_of(self.pending_dp[rank])
        stages = [s for s, held_by in enumerate(self.inp.stage_rank) if held_by == rank]  # each has actions
        after = (1 - self.inp.dp_overlap) * sum(self.inp.dp_stage_s.get(s, 0.0) for s in stages)
        if after > 0:
            yield self.work(rank, after)
        times.dp += self.env.now - compute_end
        self.mark(rank, "DP", compute_end, self.env.now)
        tied = self.inp.tied_rank_s(rank)
        if tied > 0:  # after the data-parallel reduction, never under compute
            start = self.env.now
            yield self.work(rank, tied)
            times.pp += self.env.now - start
            self.mark(rank, "PP", start, self.env.now)
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
        """A CPU host rank's ZeRO-3 gathers, one stage after another on its DP link (`start` times a GPU rank's)."""
        for stage in self.stages_in_order(rank):
            ev = self.gathered[stage]
            with self.dp_link[rank].request() as req:
                yield req
                yield self.timeout(self.inp.gather_stage_s.get(stage, 0.0))
            self.gathered_at[stage] = self.env.now
            ev.succeed()
