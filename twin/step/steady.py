"""A long pipeline step without simulating every microbatch: the steady state extended exactly.

A pipeline schedule with m microbatches per replica runs a warm-up, a steady state that repeats every `period`
microbatches (one for GPipe and 1F1B; pp for interleaved 1F1B, whose order goes in rounds of pp), and a
cool-down. Adding one period to m adds one more repetition of the steady state and changes
nothing else, so every figure of the step (its time, each rank's compute, communication and bubble, the events
simulated) grows by the same amount per period: it is affine in m past the warm-up.

`simulate_extended` simulates counts a period apart past the warm-up until the last three agree (the two
differences equal on every figure: the steady state has been reached and repeats) and extends the last difference
to the plan's own count. Where they do not agree before the short simulations together would cost more than the
full one, it simulates the full step.
tests/test_steady.py holds the extended result equal to the full simulation for every schedule.

Hand-written: SimPy simulates what it is given; recognising that a simulated process repeats is outside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace

from twin.step.pipeline import PipelineInput, PipelineResult, RankTimes, simulate
from twin.step.schedules import Action

EXTENDED = frozenset({"gpipe", "1f1b", "interleaved-1f1b"})
"""Schedules whose warm-up ends within two pipeline depths. Not the zero-bubble ones, simulated whole: on GPT-3
175B over pp 8, DualPipe-V's time per microbatch still changes past 64 microbatches (its phases' lengths follow m)
and ZBV's past 32, so three short simulations can agree on a rate the full step does not keep; ZB-H1's time is
affine early but how its waiting splits into transfer and bubble alternates for ten rounds and more."""

REL_TOL = 1e-9
"""How closely the two differences must agree, relative to the figure, for the steady state to count as reached."""


def period(schedule: str, pp: int) -> int:
    """Microbatches after which the schedule's steady state repeats: pp for interleaved 1F1B (rounds of pp)."""
    return pp if schedule == "interleaved-1f1b" else 1


def sample_counts(schedule: str, pp: int, m: int) -> tuple[int, int, int] | None:
    """The first three microbatch counts to simulate for a step of `m`: past the warm-up (two pipeline depths), a
    pipeline depth apart (a whole number of periods), congruent to m modulo that spacing; None where the schedule
    is simulated whole or simulating them costs more than simulating m."""
    if schedule not in EXTENDED:
        return None
    p = max(period(schedule, pp), pp)  # a pipeline depth apart: a shorter spacing can look affine mid-transient
    first = 2 * pp + (m - 2 * pp) % p
    counts = (first, first + p, first + 2 * p)
    return counts if sum(counts) < m else None


def simulate_extended(
    inp: PipelineInput, orders_for: Callable[[int], tuple[tuple[Action, ...], ...]], schedule: str, pp: int, m: int
) -> PipelineResult:
    """The step of `m` microbatches from short simulations extended past their steady state where that is exact,
    else the full simulation (`inp` with the orders of m; its own orders are not used).

    Simulates counts a period apart from `sample_counts`' first until the last three agree (the two differences
    equal on every figure), one more count at a time while all of them together cost less than m microbatches.
    The timeline (`slices`) of an extended result is the last simulation's; `extended_from` says its count."""
    counts = sample_counts(schedule, pp, m)
    if counts is None:
        return simulate(replace(inp, orders=orders_for(m)))
    step = counts[1] - counts[0]
    done = [simulate(replace(inp, orders=orders_for(n))) for n in counts]
    n, spent = counts[-1], sum(counts)
    while True:
        extended = _extend(done[-3], done[-2], done[-1], (m - n) / step, n)
        if extended is not None:
            return extended
        n += step
        spent += n
        if spent >= m:
            return simulate(replace(inp, orders=orders_for(m)))
        done.append(simulate(replace(inp, orders=orders_for(n))))


def _extend(a: PipelineResult, b: PipelineResult, c: PipelineResult, steps: float, n: int) -> PipelineResult | None:
    """`c` (of `n` microbatches) plus `steps` periods, if b - a and c - b agree on every figure; else None."""

    def grow(x: float, y: float, z: float) -> float | None:
        if abs((z - y) - (y - x)) > REL_TOL * max(abs(z), 1e-9):
            return None
        return z + steps * (z - x) / 2

    step = grow(a.step_s, b.step_s, c.step_s)
    events = grow(a.events, b.events, c.events)
    if step is None or events is None:
        return None
    ranks = []
    for ra, rb, rc in zip(a.ranks, b.ranks, c.ranks, strict=True):
        values = {}
        for f in fields(RankTimes):
            value = grow(getattr(ra, f.name), getattr(rb, f.name), getattr(rc, f.name))
            if value is None:
                return None
            values[f.name] = value
        ranks.append(RankTimes(**values))
    return PipelineResult(step, tuple(ranks), c.slices, round(events), extended_from=n)
