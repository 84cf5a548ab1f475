"""A pipeline step on a CPU host, event by event: its ranks share the host's cores, so how long an action's work
takes depends on which other ranks are busy while it runs, and a rank cannot run ahead of the simulation's clock
as a GPU rank does (twin/step/pipeline_sim.py). A message is a process holding its link while the receiver takes
it in on its share of the cores; a rank woken from a wait may find every core busy and wait for one."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import simpy

from twin.step.host import SharedCores
from twin.step.pipeline_data import ActionCost, PipelineInput, RankTimes, Slice
from twin.step.pipeline_sim import PipelineSim
from twin.step.pipeline_steps import awaited_on_own_rank, final_gradients
from twin.step.schedules import Action, receiver


class HostPipelineSim(PipelineSim):
    """`PipelineSim` with each node's ranks sharing its cores (SharedCores pools)."""

    def __init__(self, inp: PipelineInput) -> None:
        super().__init__(inp)
        assert inp.host is not None
        self.host = inp.host
        self.done: dict[tuple[str, int, int], simpy.Event] = {}
        self.final_grad = final_gradients(inp.orders, inp.split_w)
        self.awaited_here = awaited_on_own_rank(inp.stage_rank)
        self.links: dict[tuple[int, int], simpy.Resource] = {}
        n_pools = -(-len(inp.orders) // inp.host.ranks_per_pool)
        self.pools = [SharedCores(self.env, inp.host.cores, inp.host.weight) for _ in range(n_pools)]

    def work(self, rank: int, seconds: float) -> simpy.Event:
        """`seconds` of a rank's work at full speed, shared with the busy ranks of its node."""
        if seconds <= 0:
            return self.timeout(seconds)
        self.events += 1
        return self.pools[rank // self.host.ranks_per_pool].run(seconds, owner=rank)

    def wakeup_s(self, rank: int, slept_s: float) -> float:
        """Seconds before a rank that a message wakes runs again. On a host whose busy processes fill the physical
        cores, it waits for a core (HostSharing.wakeup_s) for
        the share of its processes that find none. A wait shorter than that latency counts in proportion
        (`slept_s`), so a prediction does not jump as a message arrives just before or after its receiver asks
        for it. (Collectives inside actions price their rounds' scheduling with host.blocked_stretch instead.)"""
        host = self.host
        if host.wakeup_s <= 0:
            return 0.0
        runnable = self.pools[rank // host.ranks_per_pool].others_busy(rank, host.wakeup_s) + host.weight
        short = min(1.0, max(0.0, (runnable - host.physical_cores) / host.weight))
        slept = min(1.0, slept_s / host.wakeup_s)
        return host.wakeup_s * short * slept

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
        yield from self.finish_rank(rank, times)

    def run_action(self, rank: int, a: Action, cost: ActionCost, times: RankTimes) -> Generator[Any, Any, None]:
        """One action's time: its compute shares the cores with the busy ranks, its blocked collectives wait for
        peers scheduled among all of the node's ranks."""
        work = cost.compute + cost.recompute
        t0 = self.env.now
        yield self.work(rank, work)
        work_stretch = (self.env.now - t0) / work if work > 0 else 1.0
        comm_stretch = self.host.blocked_stretch
        if cost.total > work:
            yield self.timeout((cost.total - work) * comm_stretch)
        self.charge(times, a.kind == "F", cost, 1, work_stretch, comm_stretch)

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
        return self.env.process(self.transfer(rank, dst, key, seconds))

    def transfer(self, src: int, dst: int, key: tuple[str, int, int], seconds: float) -> Generator[Any, Any, None]:
        link = self.links.setdefault((src, dst), simpy.Resource(self.env, capacity=1))
        with link.request() as req:
            yield req
            # On a CPU host the receiver needs a core to take the message in: it waits for its share
            yield self.work(dst, seconds)
        self.arrived_at[key] = self.env.now
        self.event(self.arrived, key).succeed()
