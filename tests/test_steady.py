"""A long step extended past its steady state gives the figures of the full simulation (twin/step/steady.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from benchmarks.published import NARAYANAN_TABLE_1, narayanan_plan
from plan import loader
from plan.limits import DEFAULT_LIMITS
from twin import api
from twin.step import schedules
from twin.step.kept import Kept
from twin.step.pipeline_data import PipelineInput
from twin.step.predict import PredictOptions, StepPrediction
from twin.step.schedules import SPLIT_W, V_SHAPED, build, peak_live, peak_live_per_rank, stage_rank
from twin.step.steady import EXTENDED, REACH_SPAN, reach, sample_counts

EVERY = PredictOptions(every_microbatch=True)

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipe-v", 2)]


def _same(extended: StepPrediction, full: StepPrediction) -> None:
    assert full.microbatches_simulated == full.num_microbatches
    assert math.isclose(extended.step_time_s, full.step_time_s, rel_tol=1e-9)
    for key, value in full.breakdown_s.items():
        assert math.isclose(extended.breakdown_s[key], value, rel_tol=1e-9, abs_tol=1e-12), key
    for ext, ref in zip(extended.stage_phases_s, full.stage_phases_s, strict=True):
        for key, value in ref.items():
            assert math.isclose(ext[key], value, rel_tol=1e-9, abs_tol=1e-12), key
    assert extended.memory == full.memory


@pytest.mark.parametrize(("schedule", "v"), SCHEDULES)
@pytest.mark.parametrize("variant", [[], ["layout.zero=3"], ["layout.pp=4", "layout.dp=32"]])
def test_every_schedule_extended_equals_the_full_simulation(schedule: str, v: int, variant: list[str]) -> None:
    plan = loader.load(
        "gpt3-175b-1k",
        [f"layout.schedule={schedule}", f"layout.virtual_stages={v}", "layout.recompute=selective",
         "training.global_batch=6144", *variant],
    )  # fmt: skip
    extended = api.predict(plan)
    _same(extended, api.predict(plan, EVERY))
    if schedule in EXTENDED:  # the zero-bubble ones repeat only after 80-134 microbatches here: see below
        assert extended.microbatches_simulated < plan.num_microbatches


@pytest.mark.parametrize(("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
@pytest.mark.parametrize(("pp", "microbatches"), [(2, 11), (3, 16), (6, 33), (12, 61)])
@pytest.mark.parametrize("variant", [[], ["model.vocab=256000"], ["layout.recompute=full"]])
def test_shallow_and_deep_pipelines_extend_from_their_first_depth_exactly(
    schedule: str, v: int, pp: int, microbatches: int, variant: list[str]
) -> None:
    """Counts from one pipeline depth, a microbatch apart (from two rounds of pp, a round apart, for interleaved
    1F1B, given ten rounds): at pipeline depths from 2 to 12, a last stage made slower by a 256k vocabulary's head,
    and full recompute, the extended step is the simulated one."""
    if schedule == "interleaved-1f1b":
        microbatches = 10 * pp
    plan = loader.load(
        "gpt3-175b-1k",
        [f"layout.schedule={schedule}", f"layout.virtual_stages={v}", f"layout.pp={pp}", "layout.tp=8",
         "layout.dp=8", f"training.global_batch={8 * microbatches}", *variant],
    )  # fmt: skip
    extended = api.predict(plan)
    assert extended.microbatches_simulated < plan.num_microbatches
    _same(extended, api.predict(plan, EVERY))


@pytest.mark.parametrize(("schedule", "simulated"), [("zb-h1", 103), ("zbv", 134), ("dualpipe-v", 133)])
def test_a_zero_bubble_step_is_extended_once_its_events_repeat(schedule: str, simulated: int) -> None:
    plan = loader.load(
        "gpt3-175b-1k",
        [f"layout.schedule={schedule}", f"layout.virtual_stages={1 if schedule == 'zb-h1' else 2}", "layout.pp=4",
         "layout.dp=32", "layout.recompute=selective", "training.global_batch=24576"],
    )  # fmt: skip
    extended = api.predict(plan)
    _same(extended, api.predict(plan, EVERY))
    assert plan.num_microbatches == 768 and extended.microbatches_simulated == simulated  # where the repeat was seen


def test_extension_costs_the_same_whatever_the_batch() -> None:
    small = loader.load("gpt3-175b-1k", ["layout.recompute=selective", "training.global_batch=3072"])
    large = loader.load("gpt3-175b-1k", ["layout.recompute=selective", "training.global_batch=49152"])  # 16x
    assert api.predict(large).microbatches_simulated == api.predict(small).microbatches_simulated == 32


def test_short_steps_are_simulated_whole() -> None:
    assert sample_counts("1f1b", 8, 27) is None  # 8 + 9 + 10 simulated would cost as much as 27
    assert sample_counts("1f1b", 8, 90) == (8, 9, 10)  # from a depth, a microbatch apart
    assert sample_counts("interleaved-1f1b", 4, 44) == (8, 12, 16)  # from two rounds of pp, a round apart
    assert sample_counts("interleaved-1f1b", 4, 46) == (10, 14, 18)  # congruent to 46 modulo 4
    assert sample_counts("zbv", 4, 400) is None  # watched instead (below)
    assert sample_counts("1f1b", 8, 90, host=True) == (18, 26, 34)  # a CPU host: a depth apart from two depths
    plan = loader.load("cpu-tiny")
    assert api.predict(plan).microbatches_simulated == plan.num_microbatches


def test_a_cpu_host_step_extends_from_two_depths_with_the_same_step_figures() -> None:
    """A CPU host's core sharing keeps its counts a depth apart from two depths (4, 6, 8 here); its step and
    per-stage figures equal the whole step's, for the events of three short steps (158 against 2,245); the same
    step on GPUs extends from one depth."""
    shape = ["layout.pp=2", "layout.schedule=gpipe", "layout.dp=1", "layout.tp=1", "layout.microbatch_size=1"]
    cpu = loader.load("cpu-tiny", [*shape, "training.global_batch=256"])
    extended, full = api.predict(cpu), api.predict(cpu, EVERY)
    assert extended.microbatches_simulated == 8 and full.microbatches_simulated == 256
    assert math.isclose(extended.step_time_s, full.step_time_s, rel_tol=1e-9)
    for ext, ref in zip(extended.stage_phases_s, full.stage_phases_s, strict=True):
        assert all(math.isclose(ext[k], v, rel_tol=1e-9, abs_tol=1e-12) for k, v in ref.items())
    assert extended.events < full.events / 10
    gpu = loader.load("cpu-tiny", [*shape, "training.global_batch=256", "cluster=dgx-h100-superpod"])
    extended = api.predict(gpu)
    assert extended.microbatches_simulated == 4  # counts 2, 3, 4
    _same(extended, api.predict(gpu, EVERY))


@pytest.mark.slow  # its full simulation of 65,536 actions takes 3-6 s; the shallow and deep cases above run by default
def test_a_deep_pipeline_is_extended_from_three_short_steps() -> None:
    """Narayanan et al.'s 1T row as its script ran it (pp 64, 512 microbatches per replica, 1F1B): steps of 64, 65
    and 66 microbatches give every figure of the full simulation."""
    plan = narayanan_plan(NARAYANAN_TABLE_1[-1])
    assert (plan.layout.pp, plan.num_microbatches, plan.layout.schedule) == (64, 512, "1f1b")
    limits = replace(DEFAULT_LIMITS, step_actions=70_000)  # the full simulation, for the comparison
    extended = api.predict(plan, limits=limits)
    assert extended.microbatches_simulated == 66
    _same(extended, api.predict(plan, EVERY, limits=limits))


@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
@pytest.mark.parametrize(("pp", "v"), [(2, 2), (4, 3), (8, 2)])
def test_peak_activations_from_a_short_order_are_the_full_orders(schedule: str, pp: int, v: int) -> None:
    v = 2 if schedule in V_SHAPED else v if schedule == "interleaved-1f1b" else 1
    kept = 0.3 if schedule in SPLIT_W else 0.0  # the weight GEMMs' inputs a held-back W keeps
    weight = {s: 1.0 + 0.1 * s for s in range(pp * v)}  # unequal stages
    for m in (4 * pp + pp, 7 * pp, 16 * pp):
        full = [peak_live(order, weight, kept) for order in build(schedule, pp, v, m)]
        assert peak_live_per_rank(schedule, pp, v, m, weight, kept) == pytest.approx(full, rel=1e-12)


@pytest.mark.parametrize("schedule", sorted(SPLIT_W))
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_the_reach_of_a_short_order_is_the_long_orders(schedule: str, pp: int) -> None:
    v = 2 if schedule in V_SHAPED else 1
    inp = PipelineInput((), tuple(stage_rank(schedule, pp, s) for s in range(pp * v)), {}, {}, split_w=True)
    short = reach(inp, build(schedule, pp, v, REACH_SPAN * pp))
    assert short >= pp  # a V's turn or a held-back W reaches a pipeline depth back at least
    for m in (REACH_SPAN * pp + 1, 13 * pp + 5, 40 * pp):
        assert reach(inp, build(schedule, pp, v, m)) == short


def test_built_orders_are_kept_by_the_actions_they_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same orders object comes back while kept (pipeline_steps keeps its answers by it); the least recently
    asked for go first once the actions kept pass the cap."""
    monkeypatch.setattr(schedules, "_BUILT", Kept(entries=128, weight=1000))
    small = schedules.build("1f1b", 4, 1, 8)  # 64 actions
    schedules.build("gpipe", 4, 1, 100)  # 800
    assert schedules.build("1f1b", 4, 1, 8) is small  # asked again: now the most recent
    schedules.build("gpipe", 4, 1, 110)  # 880: 1,744 in all, so the 100-microbatch GPipe goes
    assert ("gpipe", 4, 1, 100) not in schedules._BUILT
    assert schedules.build("1f1b", 4, 1, 8) is small
    assert schedules._BUILT.held == 64 + 880
