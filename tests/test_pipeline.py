"""Pipeline schedules and the SimPy step: closed-form bubbles, valid orders, memory in flight."""

from __future__ import annotations

from collections import Counter
from dataclasses import fields, replace

import pytest

from twin.step import pipeline_sim
from twin.step.host import HostSharing
from twin.step.pipeline import Watched, simulate
from twin.step.pipeline_data import ActionCost, PipelineInput, PipelineResult, RankTimes
from twin.step.pipeline_levels import LevelTimer
from twin.step.pipeline_steps import schedule_steps
from twin.step.schedules import Action, build, peak_live, splits_weight_grad, stage_rank

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipe-v", 2)]


def uniform(
    name: str, p: int, v: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0, p2p: float = 0.0
) -> float:
    """Step time with every stage costing the same, total work f + b + w per microbatch per rank."""
    orders = build(name, p, v, m)
    stages = p * v
    split = splits_weight_grad(name)
    costs = {}
    for s in range(stages):
        costs[("F", s)] = ActionCost(compute=f / v)
        costs[("B", s)] = ActionCost(compute=(b if split else b + w) / v)
        if split:
            costs[("W", s)] = ActionCost(compute=w / v)
    sends = {(a, c): p2p for a in range(stages) for c in (a - 1, a + 1)}
    ranks = tuple(stage_rank(name, p, s) for s in range(stages))
    return simulate(PipelineInput(orders, ranks, costs, sends, split)).step_s


@pytest.mark.parametrize("name,v", SCHEDULES)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (8, 16)])
def test_every_action_runs_once(name: str, v: int, p: int, m: int) -> None:
    orders = build(name, p, v, m)
    kinds = "FBW" if splits_weight_grad(name) else "FB"
    counts = Counter((a.kind, a.microbatch, a.stage) for order in orders for a in order)
    assert set(counts.values()) == {1}
    assert len(counts) == len(kinds) * m * p * v
    for r, order in enumerate(orders):
        assert all(stage_rank(name, p, a.stage) == r for a in order)


@pytest.mark.parametrize("p", [2, 4, 8, 16])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_1f1b_bubble_is_closed_form(name: str, p: int, m: int) -> None:
    step = uniform(name, p, 1, m, f=1.0, b=2.0, w=0.0)
    ideal = 3.0 * m
    assert (step - ideal) / step == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("v", [2, 4])
@pytest.mark.parametrize("mult", [1, 2, 4])
def test_interleaving_divides_the_bubble_by_about_v(p: int, v: int, mult: int) -> None:
    m = p * mult  # Megatron's interleaved schedule needs microbatches in multiples of pp
    plain = (uniform("1f1b", p, 1, m, 1, 2, 0) - 3 * m) / (3 * m)  # bubble relative to ideal: (p-1)/m
    inter = (uniform("interleaved-1f1b", p, v, m, 1, 2, 0) - 3 * m) / (3 * m)
    assert inter == pytest.approx((p - 1) / (v * m), rel=1e-9)  # Narayanan et al. 2021, §2.2.2
    assert plain / inter == pytest.approx(v, rel=1e-9)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32), (16, 32)])
def test_zero_bubble_schedules_beat_1f1b(p: int, m: int) -> None:
    one_f_one_b = uniform("1f1b", p, 1, m)
    assert uniform("zb-h1", p, 1, m) < one_f_one_b
    assert uniform("zbv", p, 2, m) < uniform("zb-h1", p, 1, m) <= one_f_one_b


def test_zb_h1_reaches_the_paper_bubble_when_w_is_free() -> None:
    # with W costing nothing, ZB-H1's (p-1)(F+B-W) bubble equals 1F1B's (p-1)(F+B): no worse
    assert uniform("zb-h1", 4, 1, 8, 1, 1, 0) == pytest.approx(uniform("1f1b", 4, 1, 8, 1, 1, 0))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 32), (8, 16)])
def test_p2p_time_lengthens_the_step_between_its_bounds(p: int, m: int) -> None:
    delta = 0.1
    extra = uniform("1f1b", p, 1, m, p2p=delta) - uniform("1f1b", p, 1, m)
    # at least the fill and drain chains (p-1 sends each way); at most a round trip in every one of the
    # m + p - 1 slots, since 1F1B's warm-up of p-1-r forwards leaves no slack for the wire
    assert 2 * (p - 1) * delta - 1e-9 <= extra <= 2 * (m + p - 1) * delta + 1e-9


@pytest.mark.parametrize("p,m", [(4, 8), (8, 16)])
def test_activations_in_flight(p: int, m: int) -> None:
    ones = {s: 1.0 for s in range(p)}
    one_f_one_b = [peak_live(o, ones) for o in build("1f1b", p, 1, m)]
    assert one_f_one_b == [float(p - r) for r in range(p)]  # stage r holds p - r microbatches
    assert [peak_live(o, ones) for o in build("gpipe", p, 1, m)] == [float(m)] * p
    halves = {s: 0.5 for s in range(2 * p)}  # two chunks per rank, each half its layers
    interleaved = peak_live(build("interleaved-1f1b", p, 2, m)[0], halves)
    assert interleaved == pytest.approx(p * (1 + (p - 1) / (2 * p)))  # Narayanan et al. 2021, §2.2.2
    zbv = [peak_live(o, halves, kept_for_w=0.0) for o in build("zbv", p, 2, m)]
    assert max(zbv) <= p + 0.5  # ZB-V keeps 1F1B's activation memory (Qi et al. 2024)


def test_dp_reduction_overlaps_the_last_backward() -> None:
    orders = build("1f1b", 1, 1, 4)
    costs = {("F", 0): ActionCost(compute=1.0), ("B", 0): ActionCost(compute=2.0)}
    base = PipelineInput(orders, (0,), costs, {}, False, optimizer_s={0: 0.5})
    hidden = simulate(PipelineInput(orders, (0,), costs, {}, False, dp_stage_s={0: 1.0}, optimizer_s={0: 0.5}))
    exposed = simulate(PipelineInput(orders, (0,), costs, {}, False, dp_stage_s={0: 8.0}, optimizer_s={0: 0.5}))
    free = simulate(base)
    # four buckets ready every 0.5 s of the last 2 s backward: 1 s of reduction leaves one bucket (0.25 s) exposed
    assert hidden.step_s == pytest.approx(free.step_s + 0.25)
    assert exposed.ranks[0].dp == pytest.approx(8.0 - 1.5)


@pytest.mark.parametrize("name,v", SCHEDULES)
@pytest.mark.parametrize("blocking", [False, True])
@pytest.mark.parametrize("levels", [False, True])
def test_a_gpu_rank_running_ahead_of_the_clock_times_the_step_as_event_by_event(
    name: str, v: int, blocking: bool, levels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU rank's actions are timed by arithmetic on its own clock, action by action in the schedule's
    dependency order or, for a deep pipeline, a level of the dependency graph at a time with numpy
    (twin/step/pipeline_sim.py, pipeline_levels.py); a CPU host's run every action as a SimPy event
    (pipeline_host.py). On a host that never shares a core (a core per process, no wake-up latency) they model
    the same step: uneven stages, exposed TP inside actions, slow point-to-point sends that queue on their link,
    bucketed DP reduction, a ZeRO-3 gather and an optimizer per rank."""
    monkeypatch.setattr(pipeline_sim, "LEVELS_FROM_RANKS", 1 if levels else 10**9)
    inp = _uneven(name, 4, v, 11, blocking)
    never_shared = HostSharing(cores=1e9, weight=1.0, ranks_per_pool=1, physical_cores=1e9)
    ahead, each = simulate(inp), simulate(replace(inp, host=never_shared))
    assert ahead.step_s == pytest.approx(each.step_s, rel=1e-12)
    for mine, ref in zip(ahead.ranks, each.ranks, strict=True):
        for f in fields(RankTimes):
            assert getattr(mine, f.name) == pytest.approx(getattr(ref, f.name), rel=1e-9, abs=1e-12), f.name
    assert _spans(ahead) == _spans(each)
    assert ahead.arrivals == pytest.approx(dict(each.arrivals), rel=1e-12)
    assert ahead.events < each.events / 2
    assert ahead.slices.first(0, "F") == each.slices.first(0, "F")


def _uneven(name: str, p: int, v: int, m: int, blocking: bool) -> PipelineInput:
    """A step whose stages cost unevenly (the last has the head), with exposed TP inside actions, slow
    point-to-point sends that queue on their link, bucketed DP reduction, a tied embedding's all-reduce between the
    first and last stage, a ZeRO-3 gather and an optimizer."""
    orders = build(name, p, v, m)
    stages, split = p * v, splits_weight_grad(name)
    costs = {}
    for s in range(stages):
        scale = 1.0 + 0.37 * (s % 3) + (0.5 if s == stages - 1 else 0.0)
        costs[("F", s)] = ActionCost(compute=scale, tp=0.11)
        costs[("B", s)] = ActionCost(compute=1.3 * scale, recompute=0.2, tp=0.07)
        costs[("W", s)] = ActionCost(compute=0.9 * scale)
    sends = {(a, c): 1.2 + 0.05 * a for a in range(stages) for c in (a - 1, a + 1)}  # longer than some actions
    ranks = tuple(stage_rank(name, p, s) for s in range(stages))
    return PipelineInput(
        orders, ranks, costs, sends, split, dp_stage_s={s: 2.5 for s in range(stages)},
        tied_stage_s={0: 0.4, stages - 1: 0.4},
        gather_stage_s={s: 0.3 for s in range(stages)}, optimizer_s={r: 0.2 for r in range(p)}, barrier_s=0.05,
        dp_overlap=0.8, blocking_sends=blocking,
    )  # fmt: skip


@pytest.mark.parametrize("name,v", [("zb-h1", 1), ("zbv", 2), ("dualpipe-v", 2), ("1f1b", 1)])
@pytest.mark.parametrize("blocking", [False, True])
def test_a_short_step_takes_the_levels_a_longer_one_timed_and_times_the_same(
    name: str, v: int, blocking: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short zero-bubble step begins as the longer step watched before it (twin/step/steady.py): it takes the
    levels the longer one has timed (LevelTimer.resume) and times only the rest, to the same result, bit for
    bit, as timing all of it. A step whose first levels are priced otherwise takes nothing."""
    taken: list[bool] = []
    resume = LevelTimer.resume
    monkeypatch.setattr(LevelTimer, "resume", lambda self, other: taken.append(resume(self, other)) or taken[-1])
    long = _uneven(name, 4, v, 40, blocking)
    watched = Watched(long)
    watched.advance(40.0)  # about a quarter of the long step
    assert watched.timer is not None and 0 < watched.timer.level < len(watched.timer.graph.levels)
    short = replace(long, orders=build(name, 4, v, 24))
    resumed, whole = simulate(short, resume=watched.timer), simulate(short)
    assert taken == [True]
    assert resumed.step_s == whole.step_s and resumed.ranks == whole.ranks
    assert _spans(resumed) == _spans(whole) and dict(resumed.arrivals) == dict(whole.arrivals)
    dearer = dict(long.costs)
    dearer[("F", 1)] = ActionCost(compute=1.5, tp=0.11)
    other = replace(short, costs=dearer)
    assert simulate(other, resume=watched.timer).ranks == simulate(other).ranks
    assert taken == [True, False]


def _spans(result: PipelineResult) -> list[tuple[int, int, str, int, float, float, str]]:
    """Every span of the timeline longer than 1e-9 s (a wait that rounding leaves a hair long is none), times
    rounded to 1e-9 s, in one order."""
    spans = ((*s[:4], round(s.start, 9), round(s.end, 9), s.track) for s in result.slices if s.end - s.start > 1e-9)
    return sorted(spans)


def test_orders_that_wait_in_a_circle_are_refused_naming_the_wait() -> None:
    """pipeline_steps.dependency_order walks the ranks as they would run; orders where each rank first waits for a
    message the other sends only later can never run, and the walk says which wait is stuck."""
    circle = ((Action("B", 0, 0), Action("F", 0, 0)), (Action("F", 0, 1), Action("B", 0, 1)))
    with pytest.raises(RuntimeError, match=r"rank 0 waits for \('B', 0, 0\)"):
        schedule_steps(circle, (0, 1), False)
    runnable = (circle[0][::-1], circle[1])
    order = schedule_steps(runnable, (0, 1), False).order
    assert sorted((r, i) for r, first, stop in order for i in range(first, stop)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
