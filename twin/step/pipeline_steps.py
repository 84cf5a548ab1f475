"""What each pipeline rank's actions need from one another, worked out once per schedule: which message or earlier
action each waits for, which it sends, where a stage's ZeRO-3 gather and gradient buckets fall. A GPU rank's
process (twin/step/pipeline_sim.py) then only does arithmetic per action; a CPU host's (pipeline_host.py) asks the
same questions of each action as it runs.

Hand-written: the answers are kept for each schedule's orders by their identity. `schedules.build` caches the
orders, so the same object comes back for every prediction of a schedule, pipeline depth and microbatch count,
while hashing its tens of thousands of actions for an lru_cache would cost what the answers save.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from typing import NamedTuple

from twin.step.kept import Kept
from twin.step.schedules import Action, receiver

Key = tuple[str, int, int]
"""(kind, stage, microbatch): an action's end, or a message by the stage it feeds."""
PriceKey = tuple[str, int, bool]
"""(kind, stage, overlapped): what an action costs depends on these only."""

NO_WAIT, OWN_RANK, MESSAGE = 0, 1, 2
NOTHING: Key = ("", -1, -1)
"""The key of what an action that waits for nothing waits for."""


class Step(NamedTuple):
    """One action of a rank's order with everything about it that does not depend on time."""

    action: Action
    waits: int
    """NO_WAIT; OWN_RANK: for an earlier action of this rank (the turn of a "V"); MESSAGE: from another rank."""
    key: Key
    """What it waits for: the earlier action (its kind, stage, microbatch), the message, or NOTHING."""
    price: PriceKey
    first_forward: bool
    """Its stage's first forward on this rank: the stage's ZeRO-3 gather must be done before it."""
    final_grad: bool
    """Its stage's last gradient pass: the stage's DP gradient buckets become ready while it runs."""
    done: Key | None
    """Its own key where a later action of this rank waits for its end."""
    sends: Key | None
    """The message it sends to a stage on another rank."""
    to: int
    """The rank that message goes to (-1: none)."""
    hop: tuple[int, int]
    """The message's (sending stage, stage it feeds): its link time is PipelineInput.p2p_s[hop] ((-1, -1): none)."""


class RankSteps(NamedTuple):
    steps: tuple[Step, ...]
    counts: dict[PriceKey, int]
    """How many of the rank's actions have each price: what they cost in all is charged once per price."""


Segment = tuple[int, int, int]
"""(rank, first, stop): a run of one rank's steps, `steps[first:stop]`."""


class Schedule:
    """A schedule's steps by rank, and an order to time them in."""

    __slots__ = ("graph", "order", "ranks")

    def __init__(self, ranks: tuple[RankSteps, ...], order: tuple[Segment, ...]) -> None:
        self.ranks = ranks
        self.order = order
        """Every rank's steps in runs, in an order where each message is sent in an earlier run than the one
        whose first step waits for it (`dependency_order`)."""
        self.graph: object | None = None
        """The arrays twin/step/pipeline_levels.py times a deep pipeline's step with, kept here once built."""


_CACHE: Kept[tuple[object, tuple[int, ...], bool, Schedule]] = Kept(entries=16, weight=300_000)
"""Schedules' steps by their orders' identity, weighed by their actions: a pp-128 step of 166 microbatches holds
18 MB of them, and sixteen 3,072-microbatch steps at pp 16 (295k actions each) would hold over a gigabyte."""


def _actions(schedule: Schedule) -> int:
    return sum(len(r.steps) for r in schedule.ranks)


def rank_steps(
    orders: tuple[tuple[Action, ...], ...], stage_rank: tuple[int, ...], split_w: bool
) -> tuple[RankSteps, ...]:
    """Every rank's steps, from the orders of one schedule (kept by the orders' identity: see the module)."""
    return schedule_steps(orders, stage_rank, split_w).ranks


def schedule_steps(orders: tuple[tuple[Action, ...], ...], stage_rank: tuple[int, ...], split_w: bool) -> Schedule:
    """Every rank's steps and the order to time them in (kept by the orders' identity: see the module)."""
    hit = _CACHE.get(id(orders))
    if hit is not None and hit[0] is orders and hit[1] == stage_rank and hit[2] == split_w:
        return hit[3]
    final = _final_gradients(orders, split_w)
    awaited = _awaited_on_own_rank(stage_rank)
    stages = len(stage_rank)
    ranks = []
    for rank, order in enumerate(orders):
        steps, gathered = [], set()
        for a in order:
            waits, key = _waits_for(a, rank, stage_rank)
            first = a.kind == "F" and a.stage not in gathered
            if first:
                gathered.add(a.stage)
            target = receiver(a, stages)
            sends = (a.kind, target, a.microbatch) if target is not None and stage_rank[target] != rank else None
            done = (a.kind, a.stage, a.microbatch) if (a.kind, a.stage) in awaited else None
            to = stage_rank[target] if sends is not None and target is not None else -1
            hop = (a.stage, target) if sends is not None and target is not None else (-1, -1)
            price = (a.kind, a.stage, a.overlap)
            steps.append(Step(a, waits, key, price, first, id(a) in final, done, sends, to, hop))
        ranks.append(RankSteps(tuple(steps), dict(Counter(s.price for s in steps))))
    schedule = Schedule(tuple(ranks), dependency_order(ranks))
    _CACHE.put(id(orders), (orders, stage_rank, split_w, schedule), _actions(schedule))
    return schedule


def dependency_order(ranks: Sequence[RankSteps]) -> tuple[Segment, ...]:
    """Each rank's steps in runs that stop where a step waits for a message not sent yet, in an order where every
    message is sent before it is waited for: each rank runs as far as it can, then waits (first come, first
    served) for the run that sends what it needs. Timing the runs in this order times every step after all it
    depends on, which is all a GPU rank's step needs (pipeline_sim.PipelineSim.evaluate). A step never waits for
    a later one of its own rank, so only messages can hold a rank up.

    Hand-written: a topological order of the step's dependency graph, found by walking the ranks' orders as they
    would run; building the graph for networkx would cost more than walking it."""
    position = [0] * len(ranks)
    sent: set[Key] = set()
    waiting: dict[Key, list[int]] = {}
    runnable = deque(range(len(ranks)))
    order: list[Segment] = []
    while runnable:
        rank = runnable.popleft()
        steps = ranks[rank].steps
        first = i = position[rank]
        while i < len(steps):
            step = steps[i]
            if step.waits == MESSAGE and step.key not in sent:
                waiting.setdefault(step.key, []).append(rank)
                break
            if step.sends is not None:
                sent.add(step.sends)
                runnable.extend(waiting.pop(step.sends, ()))
            i += 1
        if i > first:
            order.append((rank, first, i))
        position[rank] = i
    stuck = [r for r, rank in enumerate(ranks) if position[r] < len(rank.steps)]
    if stuck:  # a schedule's orders that wait in a circle: a bug in schedules.py, not in the plan
        step = ranks[stuck[0]].steps[position[stuck[0]]]
        raise RuntimeError(f"pipeline schedule deadlocks: rank {stuck[0]} waits for {step.key}, which is never sent")
    return tuple(order)


def _waits_for(a: Action, rank: int, stage_rank: Sequence[int]) -> tuple[int, Key]:
    """What `a` waits for: a forward for the previous stage's forward, a backward for the next stage's backward."""
    if a.kind == "F" and a.stage > 0:
        source = a.stage - 1
    elif a.kind == "B" and a.stage < len(stage_rank) - 1:
        source = a.stage + 1
    else:
        return NO_WAIT, NOTHING
    if stage_rank[source] == rank:
        return OWN_RANK, (a.kind, source, a.microbatch)
    return MESSAGE, (a.kind, a.stage, a.microbatch)


def _final_gradients(orders: Sequence[Sequence[Action]], split_w: bool) -> set[int]:
    """The last gradient action of each stage, by identity (hashing an action by its fields costs a call)."""
    kind = "W" if split_w else "B"
    last: dict[int, Action] = {}
    for order in orders:
        for a in order:
            if a.kind == kind:
                last[a.stage] = a
    return {id(a) for a in last.values()}


def _awaited_on_own_rank(stage_rank: Sequence[int]) -> set[tuple[str, int]]:
    """(kind, stage) of the actions whose result the next stage takes on the same rank (the turn of a "V"), the
    only ones whose end someone waits for on their own rank."""
    last = len(stage_rank) - 1
    forward = {("F", s) for s in range(last) if stage_rank[s + 1] == stage_rank[s]}
    return forward | {("B", s) for s in range(1, last + 1) if stage_rank[s - 1] == stage_rank[s]}
