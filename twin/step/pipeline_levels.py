"""A deep GPU pipeline's actions timed a level at a time with numpy (twin/step/pipeline_sim.py says when).

A GPU rank's action starts when its previous action ends (or, with blocking sends, when that action's message
has arrived), or when what it waits for is there (a message, an earlier action of its rank, its stage's ZeRO-3
gather), whichever is latest; a message arrives when its link is free after the send. Those are maxima and sums
of times, and what each action waits for depends only on the schedule. So the actions fall into levels — one
more than the deepest of what they wait for — and every action of a level can be timed at once from the levels
before it: a few numpy operations per level instead of a few Python operations per action. A pp-128 ZB-H1 step of
166 microbatches has 63,744 actions in 625 levels.

The graph (`Graph`) is worked out once per schedule and kept with its steps (pipeline_steps.Schedule). Timing it
does exactly the float operations the action-by-action loop does (`PipelineSim.evaluate`), so each action's start
and end are the same to the bit; what a rank's waits add up to is summed by numpy, in another order, so those
sums can differ from the loop's in the last digit.

Hand-written: numpy evaluates the arithmetic; grouping a graph's nodes by depth to do so is not in numpy, and
networkx's topological generations would walk the same graph node by node in Python at several times the cost.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from twin.step.pipeline_data import Exposure, Slice, Spans
from twin.step.pipeline_steps import MESSAGE, OWN_RANK, Key, PriceKey, Schedule, Step

Ints = np.ndarray[Any, np.dtype[np.int64]]
Floats = np.ndarray[Any, np.dtype[np.float64]]


@dataclass(frozen=True)
class Graph:
    """A schedule's actions (rank by rank, in each rank's order) and messages as index arrays. Time slots past
    the actions: `done` (n, a time of 0: nothing before a rank's first action) and `never` (n + 1, minus
    infinity: nothing to wait for); message slot m likewise holds minus infinity."""

    steps: tuple[Step, ...]
    rank: Ints
    prev: Ints
    """The rank's previous action, or n."""
    prev_sent: Ints
    """The message the rank's previous action sent, or m."""
    message: Ints
    """The message each action waits for, or m."""
    own: Ints
    """The earlier action of its rank each action waits for (the turn of a "V"), or n + 1."""
    sends: Ints
    """The message each action sends, or -1."""
    sender: Ints
    """The action that sends each message."""
    queued_after: Ints
    """The message sent before each on the same link, or m."""
    hop: Ints
    """Each message's index in `hops`."""
    hops: tuple[tuple[int, int], ...]
    """(sending stage, stage it feeds): the keys of PipelineInput.p2p_s."""
    keys: tuple[Key, ...]
    """Each message's (kind, the stage it feeds, microbatch)."""
    price: Ints
    """Each action's index in `prices`."""
    microbatch: Ints
    prices: tuple[PriceKey, ...]
    levels: tuple[tuple[Ints, Ints, Ints], ...]
    """Per level: its actions, those of them that send, and the messages they send."""
    first_forward: Ints
    """Actions that are their stage's first forward on their rank (they wait for its ZeRO-3 gather)."""
    final_grad: Ints
    """Actions that are their stage's last gradient pass (its DP buckets become ready while they run)."""
    last: Ints
    """Each rank's last action."""


def graph_of(schedule: Schedule) -> Graph:
    """The schedule's graph, kept with it."""
    cached = schedule.graph
    if cached is None:
        cached = _build(schedule)
        schedule.keep_graph(cached)
    assert isinstance(cached, Graph)
    return cached


def _build(schedule: Schedule) -> Graph:
    steps = tuple(s for r in schedule.ranks for s in r.steps)
    n = len(steps)
    starts = np.cumsum([0, *(len(r.steps) for r in schedule.ranks)])
    rank = np.repeat(np.arange(len(schedule.ranks)), np.diff(starts))
    ids: dict[Key, int] = {}
    sends = np.full(n, -1)
    sender: list[int] = []
    queued_after: list[int] = []
    hop: list[int] = []
    hops: dict[tuple[int, int], int] = {}
    prices: dict[PriceKey, int] = {}
    price = np.empty(n, dtype=np.int64)
    link_last: dict[tuple[int, int], int] = {}
    done_index: dict[Key, int] = {}
    first_forward: list[int] = []
    final_grad: list[int] = []
    for g, s in enumerate(steps):
        price[g] = prices.setdefault(s.price, len(prices))
        if s.done is not None:
            done_index[s.done] = g
        if s.first_forward:
            first_forward.append(g)
        if s.final_grad:
            final_grad.append(g)
        if s.sends is not None:
            sends[g] = ids[s.sends] = len(sender)
            sender.append(g)
            link = (int(rank[g]), s.to)
            queued_after.append(link_last.get(link, -1))
            link_last[link] = sends[g]
            hop.append(hops.setdefault(s.hop, len(hops)))
    m = len(sender)
    message = np.full(n, m)
    own = np.full(n, n + 1)
    for g, s in enumerate(steps):
        if s.waits == MESSAGE:
            message[g] = ids[s.key]
        elif s.waits == OWN_RANK:
            own[g] = done_index[s.key]
    firsts = starts[:-1]
    prev = np.arange(n) - 1
    prev[firsts[firsts < n]] = n
    prev_sent = np.where(prev < n, sends[np.minimum(prev, n - 1)], -1)
    prev_sent[prev_sent < 0] = m
    queued = np.array(queued_after, dtype=np.int64)
    queued[queued < 0] = m
    sender_arr = np.array(sender, dtype=np.int64)
    levels = _levels(schedule, starts, message, sender_arr, n)
    by_level = np.argsort(levels, kind="stable")
    bounds = np.cumsum(np.bincount(levels))
    grouped = []
    for actions in np.split(by_level, bounds[:-1]):
        sending = actions[sends[actions] >= 0]
        grouped.append((actions, sending, sends[sending]))
    return Graph(
        steps=steps,
        rank=rank,
        prev=prev,
        prev_sent=prev_sent,
        message=message,
        own=own,
        sends=sends,
        sender=sender_arr,
        queued_after=queued,
        hop=np.array(hop, dtype=np.int64),
        hops=tuple(hops),
        keys=tuple(ids),
        price=price,
        microbatch=np.array([s.action.microbatch for s in steps], dtype=np.int64),
        prices=tuple(prices),
        levels=tuple(grouped),
        first_forward=np.array(first_forward, dtype=np.int64),
        final_grad=np.array(final_grad, dtype=np.int64),
        last=starts[1:] - 1,
    )


def _levels(schedule: Schedule, starts: Ints, message: Ints, sender: Ints, n: int) -> Ints:
    """One more than the deepest of what each action waits for: its rank's previous action and the sender of the
    message it waits for (an earlier action of its own rank, and the message before on its link, come before its
    previous action). Walked in the schedule's dependency order, so each sender's level is known when needed."""
    level = np.zeros(n, dtype=np.int64).tolist()
    m = len(sender)
    senders, messages = sender.tolist(), message.tolist()
    for rank, first, stop in schedule.order:
        base = int(starts[rank])
        for g in range(base + first, base + stop):
            depth = level[g - 1] + 1 if g > base else 0
            waited = messages[g]
            if waited != m:
                depth = max(depth, level[senders[waited]] + 1)
            level[g] = depth
    return np.array(level, dtype=np.int64)


@dataclass(frozen=True)
class Timed:
    """A graph's actions timed: each one's `ready` (its previous action done), `waited` (what it waits for there
    too), `start` and `end`, and each message's `arrival`."""

    graph: Graph
    ready: Floats
    waited: Floats
    start: Floats
    end: Floats
    arrival: Floats


def time_graph(graph: Graph, total: Floats, p2p: Floats, gathered: Floats | None, blocking: bool) -> Timed:
    """Time every action of `graph`, a level at a time: `total` seconds per price, `p2p` per hop, `gathered` the
    time each first forward's ZeRO-3 gather is done (None: no gathers)."""
    n, m = len(graph.steps), len(graph.sender)
    cost = total[graph.price]
    moved = p2p[graph.hop]
    end = np.empty(n + 2)
    end[n], end[n + 1] = 0.0, -np.inf
    arrival = np.empty(m + 1)
    arrival[m] = -np.inf
    ready, waited, start = np.empty(n), np.empty(n), np.empty(n)
    gate = np.full(n, -np.inf)
    if gathered is not None:
        gate[graph.first_forward] = gathered
    prev, prev_sent, message, own = graph.prev, graph.prev_sent, graph.message, graph.own
    queued_after = graph.queued_after
    for actions, sending, messages in graph.levels:
        r = end[prev[actions]]
        if blocking:
            r = np.maximum(r, arrival[prev_sent[actions]])
        w = np.maximum(r, np.maximum(arrival[message[actions]], end[own[actions]]))
        s = np.maximum(w, gate[actions])
        end[actions] = s + cost[actions]
        ready[actions], waited[actions], start[actions] = r, w, s
        if len(sending):
            sent = end[sending]
            arrival[messages] = np.maximum(sent, arrival[queued_after[messages]]) + moved[messages]
    return Timed(graph, ready, waited, start, end[:n], arrival[:m])


def rank_waits(timed: Timed, ranks: int, blocking: bool) -> dict[str, Any]:
    """What each rank's waits add to its times: pp (a message on the wire, a blocking send), bubble (waiting
    for a message not yet sent) and dp (a ZeRO-3 gather), summed per rank."""
    g = timed.graph
    waiting = g.message < len(g.sender)
    at = timed.arrival[g.message[waiting]]
    ready = timed.ready[waiting]
    late = at > ready
    sent = timed.end[g.sender[g.message[waiting]]]
    on_wire = np.where(late, np.minimum(at - ready, at - sent), 0.0)
    idle = np.where(late, at - ready - on_wire, 0.0)
    rank = g.rank[waiting]
    pp = np.bincount(rank, on_wire, ranks)
    if blocking:
        sending = g.sends >= 0
        pp += np.bincount(g.rank[sending], timed.arrival[g.sends[sending]] - timed.end[sending], ranks)
    gate = timed.start - timed.waited
    dp = np.bincount(g.rank, np.where(gate > 0, gate, 0.0), ranks)
    return {"pp": pp, "bubble": np.bincount(rank, idle, ranks), "dp": dp}


class LevelSpans(Spans):
    """The timeline of a step timed level by level: its spans made from the arrays only when read."""

    def __init__(
        self, timed: Timed, prices: Mapping[PriceKey, Any], blocking: bool, after: Sequence[Slice] = ()
    ) -> None:
        super().__init__()
        self.timed, self.prices, self.blocking = timed, prices, blocking
        self.after = after
        """The spans recorded after the actions (each rank's end of step: DP reduction, barrier, optimizer)."""

    @cached_property
    def _spans(self) -> tuple[tuple[Slice, ...], tuple[Exposure, ...]]:
        t, g = self.timed, self.timed.graph
        recorded: list[Slice] = []
        exposures: list[Exposure] = []
        for i, s in enumerate(g.steps):
            a, rank = s.action, int(g.rank[i])
            ready, waited, start, end = t.ready[i], t.waited[i], t.start[i], t.end[i]
            msg = g.message[i]
            if msg < len(g.sender) and waited > ready:
                at = float(t.arrival[msg])
                on_wire = min(at - ready, at - float(t.end[g.sender[msg]]))
                if on_wire > 0:
                    recorded.append(Slice(rank, a.stage, "PP", a.microbatch, at - on_wire, at, "comm"))
            if start > waited:
                recorded.append(Slice(rank, a.stage, "DP", a.microbatch, float(waited), float(start), "comm"))
            recorded.append(Slice(rank, a.stage, a.kind, a.microbatch, float(start), float(end)))
            _, _, exposed, exposed_s = self.prices[s.price]
            if exposed:
                exposures.append((len(recorded) - 1, rank, a.stage, a.microbatch, float(end) - exposed_s, exposed))
            if self.blocking and s.sends is not None:
                arrived = float(t.arrival[g.sends[i]])
                if arrived > end:
                    recorded.append(Slice(rank, a.stage, "PP", a.microbatch, float(end), arrived, "comm"))
        return (*recorded, *self.after), tuple(exposures)

    @property
    def recorded(self) -> Sequence[Slice]:
        return self._spans[0]

    @property
    def exposures(self) -> Sequence[Exposure]:
        return self._spans[1]

    def actions(self) -> tuple[Sequence[tuple[str, int]], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        g = self.timed.graph
        pairs = tuple((kind, stage) for kind, stage, _ in g.prices)
        return pairs, g.price, g.microbatch, self.timed.start, self.timed.end

    def first(self, rank: int, kind: str) -> Slice:
        g, t = self.timed.graph, self.timed
        i = next(i for i in range(len(g.steps)) if g.rank[i] == rank and g.steps[i].action.kind == kind)
        a = g.steps[i].action
        return Slice(rank, a.stage, a.kind, a.microbatch, float(t.start[i]), float(t.end[i]))


class Arrivals(Mapping[Key, float]):
    """When each message arrived, by its key: a dict made only when read."""

    def __init__(self, timed: Timed) -> None:
        self.timed = timed

    @cached_property
    def _by_key(self) -> dict[Key, float]:
        return dict(zip(self.timed.graph.keys, self.timed.arrival.tolist(), strict=True))

    def __getitem__(self, key: Key) -> float:
        return self._by_key[key]

    def __iter__(self) -> Iterator[Key]:
        return iter(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)

    def items(self) -> ItemsView[Key, float]:
        return self._by_key.items()
