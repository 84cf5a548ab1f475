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
networkx's topological generations would walk the same graph node by node in Python, as `_levels` does, after
building it as a dictionary of dictionaries first.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from twin.step.pipeline_data import Columns
from twin.step.pipeline_steps import MESSAGE, OWN_RANK, Key, PriceKey, Schedule, Step

Ints = np.ndarray[Any, np.dtype[np.int64]]
Floats = np.ndarray[Any, np.dtype[np.float64]]


@dataclass(frozen=True)
class Graph:
    """A schedule's actions and messages as index arrays, numbered level by level (within a level, the actions that
    send a message first, their messages numbered in the same order), so that each level's actions, and the
    messages they send, are a contiguous run of each array. Times live in one array of `slots`: each action's end
    (0 to n - 1), then slot n holding 0 (nothing before a rank's first action), n + 1 holding minus infinity
    (nothing to wait for), each message's arrival (n + 2 to n + m + 1) and, last, minus infinity again."""

    steps: tuple[Step, ...]
    rank: Ints
    prev: Ints
    """The slot of the rank's previous action's end, or n."""
    prev_sent: Ints
    """The slot of the arrival of the message the rank's previous action sent, or the last (blocking sends)."""
    depends: Ints
    """The slot of what each action waits for besides its previous one: a message's arrival, the end of an earlier
    action of its rank (the turn of a "V"), or n + 1."""
    queued_after: Ints
    """The slot of the arrival of the message sent before each on the same link, or the last."""
    message: Ints
    """The message each action waits for, or m."""
    sends: Ints
    """The message each action sends, or -1."""
    sender: Ints
    """The action that sends each message."""
    hop: Ints
    """Each message's index in `hops`."""
    hops: tuple[tuple[int, int], ...]
    """(sending stage, stage it feeds): the keys of PipelineInput.p2p_s."""
    keys: tuple[Key, ...]
    """Each message's (kind, the stage it feeds, microbatch)."""
    feeds: tuple[tuple[str, int], ...]
    """The (kind, stage fed) pairs of the messages."""
    feed: Ints
    """Each message's index in `feeds`."""
    message_microbatch: Ints
    price: Ints
    """Each action's index in `prices`."""
    microbatch: Ints
    prices: tuple[PriceKey, ...]
    levels: tuple[tuple[int, int, int, int], ...]
    """Per level: (first action, one past its last, how many of them send, their first message)."""
    first_forward: Ints
    """Actions that are their stage's first forward on their rank (they wait for its ZeRO-3 gather)."""
    final_grad: Ints
    """Actions that are their stage's last gradient pass (its DP buckets become ready while they run)."""
    last: Ints
    """Each rank's last action."""

    @cached_property
    def pairs(self) -> tuple[tuple[str, int], ...]:
        """The (kind, stage) of each price."""
        return tuple((kind, stage) for kind, stage, _ in self.prices)

    def action_columns(self, lo: int, hi: int, start: Floats, end: Floats) -> Columns:
        """Actions lo to hi, which start and end at `start` and `end`, as columns (pipeline_data.columns_of)."""
        return self.pairs, self.price[lo:hi], self.microbatch[lo:hi], start, end

    def arrival_columns(self, lo: int, hi: int, at: Floats) -> Columns:
        """Messages lo to hi, which arrive at `at`, as columns (pipeline_data.arrival_columns)."""
        return self.feeds, self.feed[lo:hi], self.message_microbatch[lo:hi], at, at


def graph_of(schedule: Schedule) -> Graph:
    """The schedule's graph, kept with it."""
    cached = schedule.graph
    if cached is None:
        cached = schedule.graph = _build(schedule)
    assert isinstance(cached, Graph)
    return cached


def _build(schedule: Schedule) -> Graph:
    """The graph, first rank by rank (index g), then renumbered level by level."""
    steps = [s for r in schedule.ranks for s in r.steps]
    n = len(steps)
    starts = np.cumsum([0, *(len(r.steps) for r in schedule.ranks)])
    rank = np.repeat(np.arange(len(schedule.ranks)), np.diff(starts))
    ids: dict[Key, int] = {}
    sends = np.full(n, -1)
    sender: list[int] = []
    queued: list[int] = []
    hop: list[int] = []
    hops: dict[tuple[int, int], int] = {}
    link_last: dict[tuple[int, int], int] = {}
    done_index: dict[Key, int] = {}
    prices: dict[PriceKey, int] = {}
    price = np.empty(n, dtype=np.int64)
    firsts: list[int] = []
    finals: list[int] = []
    for g, s in enumerate(steps):
        price[g] = prices.setdefault(s.price, len(prices))
        if s.first_forward:
            firsts.append(g)
        if s.final_grad:
            finals.append(g)
        if s.done is not None:
            done_index[s.done] = g
        if s.sends is not None:
            sends[g] = ids[s.sends] = len(sender)
            sender.append(g)
            link = (int(rank[g]), s.to)
            queued.append(link_last.get(link, -1))
            link_last[link] = sends[g]
            hop.append(hops.setdefault(s.hop, len(hops)))
    m = len(sender)
    message = np.full(n, m)
    own = np.full(n, -1)
    for g, s in enumerate(steps):
        if s.waits == MESSAGE:
            message[g] = ids[s.key]
        elif s.waits == OWN_RANK:
            own[g] = done_index[s.key]
    prev = np.arange(n) - 1
    prev[starts[:-1][starts[:-1] < n]] = -1
    sender_g = np.array(sender, dtype=np.int64)
    level = _levels(schedule, starts, message, sender_g, n)
    # renumber: by level, a level's senders first; messages in the order of their senders
    order = np.lexsort((sends < 0, level))
    new = np.empty(n, dtype=np.int64)
    new[order] = np.arange(n)
    msg_order = np.argsort(new[sender_g], kind="stable")
    new_msg = np.empty(m, dtype=np.int64)
    new_msg[msg_order] = np.arange(m)
    arrival = n + 2 + np.append(new_msg, m)  # a message's arrival slot; m: the last, minus infinity
    ends = np.append(new, [n, n + 1])  # an action's end slot; -1: n (0.0), -2: n + 1 (minus infinity)
    prev_slot = ends[np.where(prev >= 0, prev, n)]
    prev_sent = np.where(prev >= 0, sends[np.maximum(prev, 0)], -1)
    depends = np.where(message < m, arrival[message], ends[np.where(own >= 0, own, n + 1)])
    queued_g = np.array(queued, dtype=np.int64)
    per_level = np.bincount(level)
    sending = np.bincount(level, weights=sends >= 0, minlength=len(per_level)).astype(np.int64)
    lows = np.concatenate(([0], np.cumsum(per_level)[:-1]))
    first_msgs = np.concatenate(([0], np.cumsum(sending)[:-1]))
    keys = list(ids)
    ordered_keys = [keys[i] for i in msg_order.tolist()]
    feeds: dict[tuple[str, int], int] = {}
    feed = np.array([feeds.setdefault((kind, stage), len(feeds)) for kind, stage, _ in ordered_keys], np.int64)
    return Graph(
        steps=tuple(steps[g] for g in order.tolist()),
        rank=rank[order],
        prev=prev_slot[order],
        prev_sent=arrival[np.where(prev_sent >= 0, prev_sent, m)][order],
        depends=depends[order],
        queued_after=arrival[np.where(queued_g >= 0, queued_g, m)][msg_order] if m else np.zeros(0, np.int64),
        message=np.where(message < m, np.append(new_msg, m)[message], m)[order],
        sends=np.where(sends >= 0, np.append(new_msg, -1)[sends], -1)[order],
        sender=new[sender_g][msg_order],
        hop=np.array(hop, dtype=np.int64)[msg_order] if m else np.zeros(0, np.int64),
        hops=tuple(hops),
        keys=tuple(ordered_keys),
        feeds=tuple(feeds),
        feed=feed,
        message_microbatch=np.array([mb for _, _, mb in ordered_keys], dtype=np.int64),
        price=price[order],
        microbatch=np.array([s.action.microbatch for s in steps], dtype=np.int64)[order],
        prices=tuple(prices),
        levels=tuple(zip(*(x.tolist() for x in (lows, lows + per_level, sending, first_msgs)), strict=True)),
        first_forward=np.sort(new[firsts]) if firsts else np.zeros(0, np.int64),
        final_grad=np.sort(new[finals]) if finals else np.zeros(0, np.int64),
        last=new[starts[1:] - 1],
    )


def _levels(schedule: Schedule, starts: Ints, message: Ints, sender: Ints, n: int) -> Ints:
    """One more than the deepest of what each action waits for: its rank's previous action and the sender of the
    message it waits for (an earlier action of its own rank, and the message before on its link, come before its
    previous action). Walked in the schedule's dependency order, so each sender's level is known when needed."""
    level = [0] * n
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


class LevelTimer:
    """Times a graph's actions a level at a time, resumably: `run` goes on from where it stopped, so a caller can
    look at the actions timed so far (twin/step/steady.py watches a zero-bubble step until it repeats). Only the
    ends and arrivals are needed level by level; when each action was ready, had what it waited for and started
    follow from them at once after (`times`)."""

    def __init__(self, graph: Graph, total: Floats, p2p: Floats, gathered: Floats | None, blocking: bool) -> None:
        n, m = len(graph.steps), len(graph.sender)
        self.graph, self.blocking, self.n = graph, blocking, n
        self.cost = total[graph.price]
        self.moved = p2p[graph.hop]
        self.t = np.empty(n + m + 3)
        self.t[n], self.t[n + 1], self.t[n + m + 2] = 0.0, -np.inf, -np.inf
        self.gate: Floats | None = None
        if gathered is not None:
            self.gate = np.full(n, -np.inf)
            self.gate[graph.first_forward] = gathered
        self.level = 0
        self.actions = self.messages = 0
        """How many actions and messages (from the first) are timed so far."""

    def run(self, horizon: float = np.inf) -> bool:
        """Time levels up to one whose first action starts at or past `horizon` (every level, if none does); False
        once all are timed."""
        g, t, cost, moved, gate, n = self.graph, self.t, self.cost, self.moved, self.gate, self.n
        prev, prev_sent, depends, queued_after = g.prev, g.prev_sent, g.depends, g.queued_after
        maximum, levels = np.maximum, g.levels
        while self.level < len(levels):
            lo, hi, k, first = levels[self.level]
            self.level += 1
            r = t[prev[lo:hi]]
            if self.blocking:
                r = maximum(r, t[prev_sent[lo:hi]])
            w = maximum(r, t[depends[lo:hi]])
            if gate is not None:
                w = maximum(w, gate[lo:hi])
            t[lo:hi] = w + cost[lo:hi]
            if k:
                a = n + 2 + first
                t[a : a + k] = maximum(t[lo : lo + k], t[queued_after[first : first + k]]) + moved[first : first + k]
            self.actions, self.messages = hi, first + k
            if w[0] >= horizon:  # one of the level's starts: where to stop is a choice of when to look, not a result
                break
        return self.level < len(levels)

    def resume(self, other: LevelTimer) -> bool:
        """Take the levels `other` has timed as this graph's own, where this graph begins with the same ones: the
        same actions and messages numbered alike, waiting on the same slots, at the same costs and gates (a short
        zero-bubble step begins as the longer step watched before it, twin/step/steady.py). Those float operations
        would give the same times, so copying them is exact; anything else about the two graphs is not assumed
        but compared. False, with nothing taken, where they differ or this timer has begun."""
        done, a, k = other.level, other.actions, other.messages
        g, h = self.graph, other.graph
        if self.level or not done or g.levels[:done] != h.levels[:done] or self.blocking != other.blocking:
            return False
        same = (
            np.array_equal(self.cost[:a], other.cost[:a])
            and np.array_equal(self.moved[:k], other.moved[:k])
            and all(np.array_equal(_slots(x[:a], self), _slots(y[:a], other)) for x, y in _waits(g, h, self.blocking))
            and np.array_equal(_slots(g.queued_after[:k], self), _slots(h.queued_after[:k], other))
            and (self.gate is None) == (other.gate is None)
            and (self.gate is None or np.array_equal(self.gate[:a], other.gate[:a]))  # type: ignore[index]
        )
        if not same:
            return False
        self.t[:a] = other.t[:a]
        self.t[self.n + 2 : self.n + 2 + k] = other.t[other.n + 2 : other.n + 2 + k]
        self.level, self.actions, self.messages = done, a, k
        return True

    def times(self, lo: int = 0, hi: int | None = None) -> tuple[Floats, Floats, Floats, Floats]:
        """(ready, waited, start, end) of actions lo to hi (all timed)."""
        g, t = self.graph, self.t
        hi = self.actions if hi is None else hi
        ready = t[g.prev[lo:hi]]
        if self.blocking:
            ready = np.maximum(ready, t[g.prev_sent[lo:hi]])
        waited = np.maximum(ready, t[g.depends[lo:hi]])
        start = waited if self.gate is None else np.maximum(waited, self.gate[lo:hi])
        return ready, waited, start, t[lo:hi].copy()

    def arrivals(self, lo: int = 0, hi: int | None = None) -> Floats:
        """Arrivals of messages lo to hi (all timed)."""
        hi = self.messages if hi is None else hi
        return self.t[self.n + 2 + lo : self.n + 2 + hi].copy()

    def timed(self) -> Timed:
        """Every action's times, once `run` has timed them all."""
        assert self.level == len(self.graph.levels)
        return Timed(self.graph, *self.times(), self.arrivals())


def _waits(g: Graph, h: Graph, blocking: bool) -> list[tuple[Ints, Ints]]:
    """The slots two graphs' actions wait on, side by side: previous action, what else, the previous send."""
    pairs = [(g.prev, h.prev), (g.depends, h.depends)]
    return [*pairs, (g.prev_sent, h.prev_sent)] if blocking else pairs


def _slots(slots: Ints, timer: LevelTimer) -> Ints:
    """Slots numbered as any graph of the same first levels numbers them: an action's end as it is, zero as -1,
    a message's arrival as -3 - its message, minus infinity (either slot) as -2."""
    n, last = timer.n, len(timer.t) - 1
    out = np.where(slots >= n + 2, n - 1 - slots, slots)
    out[slots == n] = -1
    out[(slots == n + 1) | (slots == last)] = -2
    return out


def message_waits(timed: Timed) -> tuple[Floats, Floats]:
    """Each action's wait for its message, split as the action-by-action loop splits it: the part while the
    message was on the wire (or queued for its link), and the idle part before it was sent; 0 where none."""
    g = timed.graph
    waiting = g.message < len(g.sender)
    at = timed.arrival[g.message[waiting]]
    ready = timed.ready[waiting]
    sent = timed.end[g.sender[g.message[waiting]]]
    late = at > ready
    on_wire, idle = np.zeros(len(g.steps)), np.zeros(len(g.steps))
    on_wire[waiting] = np.where(late, np.minimum(at - ready, at - sent), 0.0)
    idle[waiting] = np.where(late, at - ready - on_wire[waiting], 0.0)
    return on_wire, idle


def rank_waits(timed: Timed, ranks: int, blocking: bool) -> dict[str, Any]:
    """What each rank's waits add to its times: pp (a message on the wire, a blocking send), bubble (waiting
    for a message not yet sent) and dp (a ZeRO-3 gather), summed per rank."""
    g = timed.graph
    on_wire, idle = message_waits(timed)
    pp = np.bincount(g.rank, on_wire, ranks)
    if blocking:
        sending = g.sends >= 0
        pp += np.bincount(g.rank[sending], timed.arrival[g.sends[sending]] - timed.end[sending], ranks)
    gate = timed.start - timed.waited
    dp = np.bincount(g.rank, np.where(gate > 0, gate, 0.0), ranks)
    return {"pp": pp, "bubble": np.bincount(g.rank, idle, ranks), "dp": dp}
