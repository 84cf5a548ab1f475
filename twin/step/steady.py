"""A long pipeline step without simulating every microbatch: the steady state extended exactly.

A pipeline schedule with m microbatches per replica runs a warm-up, a steady state that repeats every `period`
microbatches (one for GPipe, 1F1B and the zero-bubble schedules; pp for interleaved 1F1B, whose order goes in rounds
of pp), and a cool-down. Once the step's events repeat, adding one period to m adds one more repetition of the
steady state and changes nothing else, so every figure of the step (its time, each rank's compute, communication
and bubble) grows by the same amount per period: it is affine in m past the warm-up.

Two ways to see that repeat, by how soon the schedule reaches it:

- GPipe, 1F1B and interleaved 1F1B repeat once every rank is past its warm-up. `simulate_extended` simulates
  counts a period apart from one pipeline depth on until the last three agree on every figure, and extends the
  last difference. GPipe and 1F1B repeat from one pipeline depth, a microbatch apart: 3·pp + 3 microbatches
  simulated, which is what lets a 512-microbatch step at pp 64 be extended at all (counts a depth apart from two
  depths, as before, cost 9·pp). Interleaved 1F1B goes in rounds of pp and needs two of them: 9·pp.
- The zero-bubble schedules (ZB-H1, ZBV, DualPipe-V) split the backward, and how their waits fall between ranks
  settles slowly: on GPT-3 175B over pp 8 the events repeat only after 80 microbatches (ZB-H1) and 134 (ZBV,
  DualPipe-V), and three short steps can agree on a rate the full step does not keep. Their step of m is simulated
  as it is, looking at its events as they happen (`pipeline.Watched`); once every event of a window of microbatches
  is the same as a period earlier shifted by one time (the window spans the farthest two consecutive actions of a
  rank are apart, so everything later follows from it), the steady state has been reached. Two short steps that
  hold that window, a period apart, are then simulated whole, checked event by event to be one another with a
  period inserted, and extended. The step watched is first a shorter one (WATCHED_WINDOWS windows of microbatches,
  doubled while its events do not repeat before its own cool-down), so that the step of m is built only where it
  must be simulated: where the repeat comes too late to save time, or the short steps do not check out, the step
  of m is simulated whole (run on, where the step watched was the step of m itself).

tests/test_steady.py holds the extended result equal to the full simulation for every schedule. A CPU host's
shared cores are state the events do not show, so a CPU host's steps keep counts a pipeline depth apart from two
depths. An extended result's event count is what its simulations scheduled, not the whole step's: off CPU hosts
a step's events are only what follows its ranks' actions (twin/step/pipeline.py), so the short steps' counts need
not be affine in m; only the figures are required to agree.

Hand-written: SimPy simulates what it is given; recognising that a simulated process repeats is outside it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, replace
from itertools import pairwise
from typing import Literal

import numpy as np

from twin.step.kept import Kept
from twin.step.pipeline import Watched, simulate
from twin.step.pipeline_data import Columns, PipelineInput, PipelineResult, RankTimes
from twin.step.pipeline_levels import LevelTimer
from twin.step.schedules import Action, receiver

EXTENDED = frozenset({"gpipe", "1f1b", "interleaved-1f1b"})
"""Schedules whose warm-up ends within two pipeline depths: three short simulations tell their steady state. The
zero-bubble ones are watched until their events repeat (`_watched_until_periodic`)."""

REACH_SPAN = 8
"""Pipeline depths of microbatches whose order holds every distance `reach` finds in a longer one: each schedule's
warm-up and cool-down span at most two depths and its steady phase repeats (tests/test_steady.py checks it)."""

TAIL_WINDOWS = 2
"""A zero-bubble short step runs this many repeating windows past the repeat seen: its cool-down reaches back less
far than that (`_two_short_steps` checks it)."""

WATCHED_WINDOWS = 16
"""Windows of microbatches a zero-bubble step is first watched over (twice as many each time its events do not
repeat in time): the step of m itself is built only where it must be simulated whole, not to be watched. A
choice, checked on GPT-3 175B: its repeats come at 103-317 microbatches, which 16 windows less the tail (window
5-33 microbatches at pp 4-16) hold from pp 8 on and one doubling holds at pp 4."""

REL_TOL = 1e-9
"""How closely the two differences must agree, relative to the figure, for the steady state to count as reached."""


def period(schedule: str, pp: int) -> int:
    """Microbatches after which the schedule's steady state repeats: pp for interleaved 1F1B (rounds of pp)."""
    return pp if schedule == "interleaved-1f1b" else 1


def sample_counts(schedule: str, pp: int, m: int, host: bool = False) -> tuple[int, int, int] | None:
    """The first three microbatch counts to simulate for a step of `m`: from the microbatches every rank's warm-up
    needs (pp; two rounds of pp for interleaved 1F1B, whose first rank warms up over (v-1)·pp + 2(pp-1) chunks), a
    period apart, congruent to m modulo the period; None where the schedule is simulated whole or simulating them
    costs more than simulating m. That the three show the steady state is checked, not assumed: `simulate_extended`
    goes on a period at a time until two differences agree. On a CPU `host` the counts are a pipeline depth apart
    from two depths (see the module's docstring)."""
    if schedule not in EXTENDED:
        return None
    if host:
        p, depth = max(period(schedule, pp), pp), 2 * pp
    else:
        p, depth = period(schedule, pp), (2 * pp if schedule == "interleaved-1f1b" else pp)
    first = depth + (m - depth) % p
    counts = (first, first + p, first + 2 * p)
    return counts if sum(counts) < m else None


def simulate_extended(
    inp: PipelineInput, orders_for: Callable[[int], tuple[tuple[Action, ...], ...]], schedule: str, pp: int, m: int
) -> PipelineResult:
    """The step of `m` microbatches from short simulations extended past their steady state where that is exact,
    else the full simulation (`inp` with the orders of m; its own orders are not used).

    GPipe and 1F1B: simulates counts a period apart from `sample_counts`' first until the last three agree (the two
    differences equal on every figure), one more count at a time while all of them together cost less than m
    microbatches. A zero-bubble schedule is watched until its events repeat (`_watched_until_periodic`). On a CPU
    host, whose shared cores are state the events do not show, a zero-bubble step is simulated whole.
    The timeline (`slices`) of an extended result is the last simulation's; `extended_from` says its count."""
    counts = sample_counts(schedule, pp, m, host=inp.host is not None)
    if counts is None:
        if schedule in EXTENDED or inp.host is not None:
            return simulate(replace(inp, orders=orders_for(m)))
        return _watched_until_periodic(inp, orders_for, m)
    step = counts[1] - counts[0]
    done = [simulate(replace(inp, orders=orders_for(n))) for n in counts]
    n, spent = counts[-1], sum(counts)
    while True:
        extended = _extend(done[-3], done[-2], done[-1], (m - n) / step, n, sum(r.events for r in done))
        if extended is not None:
            return extended
        n += step
        spent += n
        if spent >= m:
            full = simulate(replace(inp, orders=orders_for(m)))
            return replace(full, events=full.events + sum(r.events for r in done))
        done.append(simulate(replace(inp, orders=orders_for(n))))


def _extend(
    a: PipelineResult, b: PipelineResult, c: PipelineResult, steps: float, n: int, events: int
) -> PipelineResult | None:
    """`c` (of `n` microbatches) plus `steps` periods, if b - a and c - b agree on every figure; else None.
    `events`: what the simulations behind it scheduled."""

    return _combined((a, b, c), lambda x, y, z: grown(x, y, z, steps), n, events)


def grown(x: float, y: float, z: float, periods: float) -> float | None:
    """A figure seen at three counts a period apart (x, y, z), `periods` more periods on, if it grew alike over
    both (within REL_TOL); else None. The search's bound extends its longest path the same way."""
    if abs((z - y) - (y - x)) > REL_TOL * max(abs(z), 1e-9):
        return None
    return z + periods * (z - x) / 2


def _combined(
    results: Sequence[PipelineResult], grow: Callable[..., float | None], n: int, events: int
) -> PipelineResult | None:
    """A result whose every figure (the step, each rank's times) is `grow` of that figure in `results`, with the
    last one's timeline and `events` (the events simulated to find it); None where `grow` refuses a figure."""
    step = grow(*(r.step_s for r in results))
    if step is None:
        return None
    ranks = []
    for rank in zip(*(r.ranks for r in results), strict=True):
        values = {}
        for f in fields(RankTimes):
            value = grow(*(getattr(t, f.name) for t in rank))
            if value is None:
                return None
            values[f.name] = value
        ranks.append(RankTimes(**values))
    return PipelineResult(step, tuple(ranks), results[-1].slices, events, extended_from=n)


def _watched_until_periodic(
    inp: PipelineInput, orders_for: Callable[[int], tuple[tuple[Action, ...], ...]], m: int
) -> PipelineResult:
    """The step of `m` microbatches of a zero-bubble schedule (period one microbatch): simulated as it is until
    its events repeat over a window of `reach` + 1 microbatches, then from two short steps a microbatch apart
    that hold that window, extended; the step simulated to its end where that does not save time or the short
    steps do not check out."""
    short = orders_for(min(m, REACH_SPAN * (max(inp.stage_rank) + 1)))  # REACH_SPAN pipeline depths
    reaches = rank_reaches(inp, short)
    if _too_short(reaches[0] + 1, m):  # the first rank's reach: a floor under every rank's
        return simulate(replace(inp, orders=orders_for(m)))
    window = max(reaches) + 1
    if _too_short(window, m):
        return simulate(replace(inp, orders=orders_for(m)))
    slots = _slots(inp, short)  # microbatch 0's actions: the same in an order of any length
    look_s = window * _floor_per_microbatch_s(inp, short)
    length, events = min(m, WATCHED_WINDOWS * window), 0
    while True:
        watched = Watched(replace(inp, orders=orders_for(length)))
        outcome = _watch(watched, inp, orders_for, slots, look_s, window, length, m, events)
        events += watched.events
        if isinstance(outcome, PipelineResult):
            return outcome
        if length == m:  # the step of m itself, watched: the rest of it costs least
            return watched.finish()
        if outcome == "beyond":  # the repeat may come later than this step's own cool-down lets it show
            length = min(m, 2 * length)
            continue
        full = simulate(replace(inp, orders=orders_for(m)))
        return replace(full, events=full.events + events)


def _watch(
    watched: Watched,
    inp: PipelineInput,
    orders_for: Callable[[int], tuple[tuple[Action, ...], ...]],
    slots: dict[tuple[str, int, int], int],
    look_s: float,
    window: int,
    length: int,
    m: int,
    events: int,
) -> PipelineResult | Literal["costly", "unchecked", "beyond"]:
    """Watch a step of `length` microbatches (the first `length` of a step of `m` run the same until its own
    cool-down, which reaches back less than a tail) until its events repeat, and extend the step of m from there
    (the result); else why not: "costly" (extending would cost what the rest of the step of m does), "unchecked"
    (the short steps did not check out) or "beyond" (the events up to where this step's cool-down begins do not
    repeat yet). `events`: what earlier watches scheduled."""
    tail = TAIL_WINDOWS * window
    table = np.full((len(slots), length), np.nan)
    done = 0
    while watched.advance(look_s):
        done = _fill(table, slots, *watched.news(), done)
        n = done + tail
        if 2 * n + 1 >= m - done:  # the two short steps would cost what is left of the step of m
            return "costly"
        if done > window + 1 and _repeats(table[:, done - window - 1 : done], _tolerance(table, done)):
            extended = _two_short_steps(
                inp, orders_for, slots, table[:, :done], n, m, events + watched.events, watched.timer
            )
            return extended if extended is not None else "unchecked"
        if length < m and done >= length - tail:
            return "beyond"
    return "beyond" if length < m else "costly"


def _too_short(window: int, m: int) -> bool:
    """A step of `m` microbatches too short for a repeat over `window` of them to save time, even if seen at once:
    the earliest it can be seen, plus two short steps reaching a tail of two windows past it, cost m or more."""
    earliest = window + 2
    return 2 * (earliest + TAIL_WINDOWS * window) + 1 >= m - earliest


def _two_short_steps(
    inp: PipelineInput,
    orders_for: Callable[[int], tuple[tuple[Action, ...], ...]],
    slots: dict[tuple[str, int, int], int],
    seen: np.ndarray,
    n: int,
    m: int,
    watched: int,
    timer: LevelTimer | None = None,
) -> PipelineResult | None:
    """Steps of n and n + 1 microbatches, extended to m; None unless both begin with the events `seen` (so they
    hold its repeating window) and the longer is the shorter with one microbatch inserted, every event after it
    one period's time later. `watched`: the events the step of m scheduled before it was stopped. `timer`: the
    watched step's level timer, whose levels timed so far both begin with (exactly, where LevelTimer.resume finds
    them numbered, waiting and priced alike), so that they time only what follows."""
    a = simulate(replace(inp, orders=orders_for(n)), resume=timer)
    b = simulate(replace(inp, orders=orders_for(n + 1)), resume=timer)
    ta, tb = _table(slots, a, n), _table(slots, b, n + 1)
    done = seen.shape[1]
    tol = _tolerance(tb, n + 1)
    if not (_same(ta[:, :done], seen, tol) and _same(tb[:, :done], seen, tol)):
        return None
    if not _same(tb[:, done:] - (b.step_s - a.step_s), ta[:, done - 1 :], tol):
        return None
    return _affine(a, b, m - n - 1, n + 1, watched + a.events + b.events)


def _affine(a: PipelineResult, b: PipelineResult, periods: int, n: int, events: int) -> PipelineResult | None:
    """`b` (of `n` microbatches) plus `periods` more of what `b` adds to `a`."""
    return _combined((a, b), lambda x, y: y + periods * (y - x), n, events)


def _slots(inp: PipelineInput, orders: Sequence[Sequence[Action]]) -> dict[tuple[str, int, int], int]:
    """A row for every time each microbatch passes: each action's start (0) and end (1) by (kind, stage), and the
    arrival (2) of each message it sends to another rank, by (kind, the stage it feeds)."""
    slots: dict[tuple[str, int, int], int] = {}
    ranks = inp.stage_rank
    for order in orders:
        for a in order:
            if a.microbatch:
                continue
            slots.setdefault((a.kind, a.stage, 0), len(slots))
            slots.setdefault((a.kind, a.stage, 1), len(slots))
            target = receiver(a, len(ranks))
            if target is not None and ranks[target] != ranks[a.stage]:
                slots.setdefault((a.kind, target, 2), len(slots))
    return slots


def reach(inp: PipelineInput, orders: Sequence[Sequence[Action]]) -> int:
    """The most microbatches apart two events are where one directly follows the other: consecutive actions of a
    rank, or consecutive messages on one link. An event depends on nothing further back, so a window this wide
    (plus a period) that repeats holds everything the rest of the step follows from."""
    return max(_rank_reach(order, inp.stage_rank) for order in orders)


_REACHES: Kept[tuple[object, tuple[int, ...], tuple[int, ...]]] = Kept(entries=16)


def rank_reaches(inp: PipelineInput, orders: tuple[tuple[Action, ...], ...]) -> tuple[int, ...]:
    """Each rank's `reach`, kept by the orders' identity as pipeline_steps keeps a schedule's steps (the orders
    come from schedules.build's cache): at pp 16 working them out cost 20 ms a prediction."""
    hit = _REACHES.get(id(orders))
    if hit is not None and hit[0] is orders and hit[1] == inp.stage_rank:
        return hit[2]
    reaches = tuple(_rank_reach(order, inp.stage_rank) for order in orders)
    _REACHES.put(id(orders), (orders, inp.stage_rank, reaches))
    return reaches


def _rank_reach(order: Sequence[Action], stage_rank: Sequence[int]) -> int:
    reach = max((abs(x.microbatch - y.microbatch) for x, y in pairwise(order)), default=0)
    links: dict[int, list[int]] = {}
    for a in order:
        target = receiver(a, len(stage_rank))
        if target is not None:
            links.setdefault(stage_rank[target], []).append(a.microbatch)
    for sent in links.values():
        reach = max(reach, max((abs(x - y) for x, y in pairwise(sent)), default=0))
    return reach


def _floor_per_microbatch_s(inp: PipelineInput, orders: Sequence[Sequence[Action]]) -> float:
    """Seconds one microbatch takes at least on the busiest rank: the simulated time between looks."""
    busiest = max(sum(inp.cost(a).total for a in order if a.microbatch == 0) for order in orders)
    return max(busiest, 1e-9)


def _fill(
    table: np.ndarray,
    slots: Mapping[tuple[str, int, int], int],
    actions: Columns,
    arrivals: Columns,
    complete: int = 0,
) -> int:
    """Write new events into `table` (the actions' starts and ends, the messages' arrivals, as columns); returns
    how many leading microbatches have all their events (the first `complete` had them already)."""
    latest = -1
    for (pairs, codes, microbatches, starts, ends), edges in ((actions, (0, 1)), (arrivals, (2,))):
        for edge, times in zip(edges, (starts, ends), strict=False):
            rows = np.array([slots[(kind, stage, edge)] for kind, stage in pairs], dtype=np.int64)
            table[rows[codes], microbatches] = times
        latest = max(latest, int(microbatches.max(initial=-1)))
    # columns past the latest microbatch written now are taken as incomplete: a floor, found without scanning them
    end = min(table.shape[1], max(latest + 1, complete))
    missing = np.isnan(table[:, complete:end]).any(axis=0)
    return complete + int(missing.argmax()) if missing.any() else end


def _table(slots: Mapping[tuple[str, int, int], int], result: PipelineResult, n: int) -> np.ndarray:
    table = np.full((len(slots), n), np.nan)
    _fill(table, slots, result.slices.actions(), result.arrived())
    return table


def _repeats(window: np.ndarray, tol: float) -> bool:
    """Every event of each microbatch of `window` but the first is the previous microbatch's, one same time later."""
    shift = np.diff(window, axis=1)
    return bool(np.all(np.abs(shift - shift[0, 0]) <= tol))


def _same(x: np.ndarray, y: np.ndarray, tol: float) -> bool:
    return x.shape == y.shape and bool(np.all(np.abs(x - y) <= tol))


def _tolerance(table: np.ndarray, done: int) -> float:
    """REL_TOL of the latest time in the first `done` microbatches."""
    return REL_TOL * max(float(np.nanmax(table[:, :done])), 1e-9)
