"""A level-timed step's timeline and arrivals (twin/step/pipeline_levels.py), read off its arrays only when asked
for: a deep pipeline's step has tens of thousands of spans and arrivals that a search or a fleet table never reads."""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, Mapping, Sequence
from functools import cached_property
from typing import Any

import numpy as np

from twin.step.pipeline_data import Columns, Exposure, Slice, Spans
from twin.step.pipeline_levels import Timed, message_waits
from twin.step.pipeline_steps import Key, PriceKey


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
        wire, _ = message_waits(t)
        for i, s in enumerate(g.steps):
            a, rank = s.action, int(g.rank[i])
            waited, start, end = t.waited[i], t.start[i], t.end[i]
            on_wire = float(wire[i])
            if on_wire > 0:  # the message's last stretch on the wire ends as it arrives, when the action may go on
                recorded.append(
                    Slice(rank, a.stage, "PP", a.microbatch, float(waited) - on_wire, float(waited), "comm")
                )
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

    def actions(self) -> Columns:
        return self.timed.graph.action_columns(0, len(self.timed.graph.steps), self.timed.start, self.timed.end)

    def first(self, rank: int, kind: str) -> Slice:
        g, t = self.timed.graph, self.timed
        i = next(i for i in np.flatnonzero(g.rank == rank).tolist() if g.steps[i].action.kind == kind)
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

    def columns(self, lo: int = 0, hi: int | None = None) -> Columns:
        """Messages lo to hi (all) as columns (pipeline_data.arrival_columns)."""
        hi = len(self.timed.graph.sender) if hi is None else hi
        return self.timed.graph.arrival_columns(lo, hi, self.timed.arrival[lo:hi])
