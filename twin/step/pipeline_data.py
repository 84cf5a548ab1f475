"""What one pipeline step's simulation (twin/step/pipeline.py) takes and gives: each action's cost, the step's
inputs, and its result — the time, where each rank's time went, and the timeline."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, overload

import numpy as np

from twin.step.host import HostSharing
from twin.step.schedules import Action


@dataclass(frozen=True)
class ActionCost:
    """Seconds one action takes on its rank, by what the time is spent on (communication here is exposed)."""

    compute: float = 0.0
    recompute: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0
    dp: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.tp + self.cp + self.ep + self.dp


@dataclass(frozen=True)
class PipelineInput:
    """Everything the simulation needs; costs are per (kind, stage) and the same for every microbatch."""

    orders: tuple[tuple[Action, ...], ...]
    stage_rank: tuple[int, ...]
    costs: Mapping[tuple[str, int], ActionCost]
    p2p_s: Mapping[tuple[int, int], float]
    """Seconds to send one microbatch's activation (or its gradient) from stage a to stage b."""
    split_w: bool
    dp_stage_s: Mapping[int, float] = field(default_factory=dict)
    """Seconds of data-parallel gradient reduction of each stage's weights, overlapped with its final backward."""
    tied_stage_s: Mapping[int, float] = field(default_factory=dict)
    """Seconds of the tied word embedding's gradient all-reduce between the first and the last stage, which their
    ranks run once the pipeline has flushed, back to back with the rest of their data-parallel reduction, before the
    step-end barrier (comm_costs.tied_embedding_s)."""
    gather_stage_s: Mapping[int, float] = field(default_factory=dict)
    """Seconds of ZeRO-3 parameter gathering of each stage before its first forward (pipelined FSDP)."""
    optimizer_s: Mapping[int, float] = field(default_factory=dict)
    """Seconds of the optimizer step on each rank."""
    barrier_s: float = 0.0
    """Seconds of the job-wide all-reduce every rank joins between its gradient reduction and its optimizer step
    (the gradient norm for clipping): a barrier, so a rank done early waits there for the slowest."""
    buckets: int = 4
    """Gradient buckets per stage (Megatron's default bucket is 40M parameters; a handful per stage)."""
    dp_overlap: float = 1.0
    """Share of each stage's gradient reduction that is bucketed under its final backward; the rest runs after
    the rank's last computation."""
    host: HostSharing | None = None
    """Ranks share host cores (CPU clusters): actions are work at full speed, slowed by the busy ranks."""
    blocking_sends: bool = False
    """A rank waits for its own send to reach the next stage before going on (blocking p2p, Megatron 2021); else
    sends run beside its next action (asynchronous p2p)."""
    overlap_costs: Mapping[tuple[str, int], ActionCost] = field(default_factory=dict)
    """Costs of actions run as one half of an overlapped forward-backward pair (DualPipe), where they differ."""

    def tied_rank_s(self, rank: int) -> float:
        """Seconds of the tied embedding's all-reduce (tied_stage_s) that `rank`'s stages run."""
        return sum(seconds for stage, seconds in self.tied_stage_s.items() if self.stage_rank[stage] == rank)

    def cost(self, a: Action) -> ActionCost:
        """What action `a` costs."""
        return self.cost_of(a.kind, a.stage, a.overlap)

    def cost_of(self, kind: str, stage: int, overlap: bool) -> ActionCost:
        """What an action of `kind` on `stage` costs: its overlapped cost when it runs in an overlapped pair
        (`overlap`) and has one."""
        key = (kind, stage)
        return self.overlap_costs.get(key, self.costs[key]) if overlap else self.costs[key]


class Slice(NamedTuple):
    """One action as it ran (kind F, B, W; track "compute"), the exposed communication inside or around it (TP, CP,
    EP, DP, PP; track "comm"), or the step's end on a rank (barrier, optimizer; stage and microbatch -1). A named
    tuple: a step at pp 128 records a few hundred thousand, and a frozen dataclass costs several times as much to
    make."""

    rank: int
    stage: int
    kind: str
    microbatch: int
    start: float
    end: float
    track: str = "compute"


Exposure = tuple[int, int, int, int, float, tuple[tuple[str, float], ...]]
"""The collectives left exposed at the end of one action: (the index of the action's span among the recorded
ones, rank, stage, microbatch, when the first starts, ((axis, seconds), ...) in the order they run)."""


Columns = tuple[Sequence[tuple[str, int]], np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Actions' spans as columns: the (kind, stage) pairs, and per action the index of its pair, its microbatch, start
and end (what twin/step/steady.py compares steps by)."""


def columns_of(spans: Iterable[Slice]) -> Columns:
    """The actions among `spans` as columns."""
    return _columns(
        (s.kind, s.stage, s.microbatch, s.start, s.end) for s in spans if s.track == "compute" and s.microbatch >= 0
    )


def arrival_columns(arrivals: Iterable[tuple[tuple[str, int, int], float]]) -> Columns:
    """Messages' arrivals as columns: the (kind, stage it feeds) pairs, and per message the index of its pair, its
    microbatch, and its arrival twice (as start and end)."""
    return _columns((kind, stage, microbatch, t, t) for (kind, stage, microbatch), t in arrivals)


def _columns(rows: Iterable[tuple[str, int, int, float, float]]) -> Columns:
    pairs: dict[tuple[str, int], int] = {}
    codes, microbatches, starts, ends = [], [], [], []
    for kind, stage, microbatch, start, end in rows:
        codes.append(pairs.setdefault((kind, stage), len(pairs)))
        microbatches.append(microbatch)
        starts.append(start)
        ends.append(end)
    ints = np.int64
    return tuple(pairs), np.array(codes, ints), np.array(microbatches, ints), np.array(starts), np.array(ends)


class Spans(Sequence[Slice]):
    """A step's timeline: the spans recorded as it ran (actions, waits, the step's end), and the collectives left
    exposed after actions, which become spans, each right after its action's, only when the timeline is first read.
    A step at pp 128 leaves some 85,000 exposed collectives that most callers (a search, a fleet table) never read,
    and a span costs a microsecond to make."""

    def __init__(
        self, recorded: Sequence[Slice] = (), exposures: Sequence[Exposure] = (), tail: Sequence[Slice] = ()
    ) -> None:
        self._recorded, self._exposures = recorded, exposures
        self.tail = tail
        """Spans after all the others (what the step adds past the simulated pipeline)."""

    @property
    def recorded(self) -> Sequence[Slice]:
        """The spans made as the step ran, in their order: every action's among them."""
        return self._recorded

    @property
    def exposures(self) -> Sequence[Exposure]:
        return self._exposures

    def first(self, rank: int, kind: str) -> Slice:
        """The first span of `kind` on `rank` (its first forward, say)."""
        return next(s for s in self.recorded if s.rank == rank and s.kind == kind)

    def actions(self) -> Columns:
        """Every action's span as columns (`columns_of`)."""
        return columns_of(self.recorded)

    def then(self, tail: Sequence[Slice]) -> Spans:
        """These spans with `tail` after them."""
        out = copy.copy(self)
        out.tail = (*self.tail, *tail)
        out.__dict__.pop("_all", None)
        return out

    @cached_property
    def _all(self) -> tuple[Slice, ...]:
        return tuple(self._made())

    def _made(self) -> Iterator[Slice]:
        pending = iter(self.exposures)
        due = next(pending, None)
        for i, recorded in enumerate(self.recorded):
            yield recorded
            while due is not None and due[0] == i:
                _, rank, stage, microbatch, at, exposed = due
                for axis, seconds in exposed:
                    yield Slice(rank, stage, axis, microbatch, at, at + seconds, "comm")
                    at += seconds
                due = next(pending, None)
        yield from self.tail

    @overload
    def __getitem__(self, i: int) -> Slice: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Slice]: ...
    def __getitem__(self, i: int | slice) -> Slice | Sequence[Slice]:
        return self._all[i]

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[Slice]:
        return iter(self._all)


@dataclass
class RankTimes:
    """Where one rank's step went (seconds)."""

    compute: float = 0.0
    recompute: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0
    dp: float = 0.0
    pp: float = 0.0
    forward: float = 0.0
    """Of `compute`, what forward actions took."""
    bubble: float = 0.0
    optimizer: float = 0.0
    end: float = 0.0

    def phases(self) -> dict[str, float]:
        """These times in the executor's record vocabulary (plan.records.PHASES): backward holds the recompute."""
        return {
            "forward": self.forward,
            "backward": self.compute - self.forward + self.recompute,
            "optimizer": self.optimizer,
            "comm_tp": self.tp,
            "comm_cp": self.cp,
            "comm_ep": self.ep,
            "comm_pp": self.pp,
            "comm_dp": self.dp,
            "bubble": self.bubble,
        }


@dataclass(frozen=True)
class PipelineResult:
    step_s: float
    ranks: tuple[RankTimes, ...]
    slices: Spans
    events: int
    """SimPy events the simulation scheduled."""
    extended_from: int | None = None
    """Microbatches of the simulation whose steady state was extended to this step's (twin/step/steady.py); its
    timeline is that simulation's. None: every microbatch simulated."""
    arrivals: Mapping[tuple[str, int, int], float] = field(default_factory=dict)
    """When each cross-rank message (kind, stage it feeds, microbatch) arrived: with the actions' slices, every
    time the pipeline's events happen at (twin/step/steady.py compares two simulations by them)."""

    def arrived(self) -> Columns:
        """The arrivals as columns (`arrival_columns`; a level-timed step's straight from its arrays)."""
        columns = getattr(self.arrivals, "columns", None)
        return columns() if columns is not None else arrival_columns(self.arrivals.items())
