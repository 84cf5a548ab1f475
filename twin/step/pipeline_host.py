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
from twin.step.pipeline_steps import NO_WAIT, OWN_RANK, rank_steps
from twin.step.schedules import Action


class HostPipelineSim(PipelineSim):
    """`PipelineSim` with each node's ranks sharing its cores (SharedCores pools)."""

    def __init__(self, inp: PipelineInput) -> None:
        super().__init__(inp)
        assert inp.host is not None
        self.host = inp.host
        self.done: dict[tuple[str, int, int], simpy.Event] = {}
        self.links: dict[tuple[int, int], simpy.Resource] = {}
        n_pools = -(-len(inp.orders) // inp.host.ranks_per_pool)
        self.pools = [SharedCores(self.env, inp.host.cores, inp.host.weight) for _ in range(n_pools)]

    def start(self) -> None:
        """A process per rank, and per rank's ZeRO-3 gathers."""
        for stage in self.inp.gather_stage_s:
            self.event(self.gathered, stage)
        for rank in range(len(self.inp.orders)):
            if self.inp.gather_stage_s:
                self.env.process(self.gather(rank))
            self.env.process(self.rank(rank))

    def advance(self, seconds: float) -> bool:
        """Simulate `seconds` more; False once the step is over (nothing left to happen)."""
        if self.env.peek() == float("inf"):
            return False
        self.env.run(until=self.env.now + seconds)
        return self.env.peek() != float("inf")

    def run(self) -> None:
        self.env.run()

    def work(self, rank: int, seconds: float) -> simpy.Event:
        """`seconds` of a rank's work at full speed, shared with the busy ranks of its node."""
        if seconds <= 0:
            return self.timeout(seconds)
        self.events += 1
        return self.pools[rank // self.host.ranks_per_pool].run(seconds, owner=rank)

    def wakeup_s(self, rank: int, slept_s: float) -> float:
        """Seconds before a rank that a message wakes runs again. On a host whose busy processes fill the physical
        cores, it waits for a core (HostSharing.wakeup_s) for the share of its processes that find none. A wait
        shorter than that latency counts in proportion (`slept_s`), so a prediction does not jump as a message
        arrives just before or after its receiver asks for it. (Collectives inside actions price their rounds'
        scheduling with host.blocked_stretch instead.)"""
        host = self.host
        if host.wakeup_s <= 0:
            return 0.0
        runnable = self.pools[rank // host.ranks_per_pool].others_busy(rank, host.wakeup_s) + host.weight
        short = min(1.0, max(0.0, (runnable - host.physical_cores) / host.weight))
        slept = min(1.0, slept_s / host.wakeup_s)
        return host.wakeup_s * short * slept

    def rank(self, rank: int) -> Generator[simpy.Event, Any, None]:
        times = self.times[rank]
        steps, _ = rank_steps(self.inp.orders, self.inp.stage_rank, self.inp.split_w)[rank]
        for a, waits, key, price, first_forward, final_grad, done, sends, to, hop in steps:
            if waits != NO_WAIT:
                t0 = self.env.now
                yield self.event(self.done if waits == OWN_RANK else self.arrived, key)
                waited = self.env.now - t0
                on_wire = min(waited, max(0.0, self.env.now - self.sent_at.get(key, self.env.now)))
                times.pp += on_wire
                self.mark(rank, "PP", self.env.now - on_wire, self.env.now, a)
                times.bubble += waited - on_wire
                late = self.wakeup_s(rank, waited) if waited > 0 else 0.0
                if late > 0:
                    yield self.timeout(late)
                    times.bubble += late
            if first_forward and self.gathered:
                t0 = self.env.now
                yield self.gathered[a.stage]
                times.dp += self.env.now - t0
                self.mark(rank, "DP", t0, self.env.now, a)
            cost, total, exposed, exposed_s = self.prices[price]
            start = self.env.now
            if final_grad and self.inp.dp_stage_s.get(a.stage, 0.0) > 0:
                self.launch_buckets(rank, a.stage, start, total)
            yield from self.run_action(rank, a, cost, times)
            self.slices.append(Slice(rank, a.stage, a.kind, a.microbatch, start, self.env.now))
            self.mark_exposed(rank, a, self.env.now, exposed, exposed_s)
            if done is not None:
                self.event(self.done, done).succeed()
            if sends is not None:
                self.sent_at[sends] = self.env.now
                sent = self.env.process(self.transfer(rank, to, sends, self.inp.p2p_s[hop]))
                if self.inp.blocking_sends:
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

    def transfer(self, src: int, dst: int, key: tuple[str, int, int], seconds: float) -> Generator[Any, Any, None]:
        link = self.links.setdefault((src, dst), simpy.Resource(self.env, capacity=1))
        with link.request() as req:
            yield req
            # On a CPU host the receiver needs a core to take the message in: it waits for its share
            yield self.work(dst, seconds)
        self.arrived_at[key] = self.env.now
        self.event(self.arrived, key).succeed()
