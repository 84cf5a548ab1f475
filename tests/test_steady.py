"""A long step extended past its steady state gives the figures of the full simulation (twin/step/steady.py)."""

from __future__ import annotations

import math

import pytest

from plan import loader
from twin import api
from twin.step.predict import PredictOptions, StepPrediction
from twin.step.schedules import build, peak_live, peak_live_per_rank
from twin.step.steady import EXTENDED, sample_counts

EVERY = PredictOptions(every_microbatch=True)

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipe-v", 2)]


def _same(extended: StepPrediction, full: StepPrediction) -> None:
    assert full.microbatches_simulated == full.num_microbatches
    assert extended.events == full.events
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
    shorter = extended.microbatches_simulated < plan.num_microbatches
    assert shorter == (schedule in EXTENDED)  # the zero-bubble schedules are simulated whole (see EXTENDED)


def test_extension_costs_the_same_whatever_the_batch() -> None:
    small = loader.load("gpt3-175b-1k", ["layout.recompute=selective", "training.global_batch=3072"])
    large = loader.load("gpt3-175b-1k", ["layout.recompute=selective", "training.global_batch=49152"])  # 16x
    assert api.predict(large).microbatches_simulated == api.predict(small).microbatches_simulated == 32


def test_short_steps_are_simulated_whole() -> None:
    assert sample_counts("1f1b", 8, 60) is None  # 16 + 24 + 32 simulated would cost more than 60
    assert sample_counts("1f1b", 8, 90) == (18, 26, 34)  # congruent to 90 modulo the spacing
    assert sample_counts("interleaved-1f1b", 4, 44) == (8, 12, 16)
    assert sample_counts("zbv", 4, 400) is None
    plan = loader.load("cpu-tiny")
    assert api.predict(plan).microbatches_simulated == plan.num_microbatches


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
@pytest.mark.parametrize(("pp", "v"), [(2, 2), (4, 3), (8, 2)])
def test_peak_activations_from_a_short_order_are_the_full_orders(schedule: str, pp: int, v: int) -> None:
    v = v if schedule == "interleaved-1f1b" else 1
    weight = {s: 1.0 + 0.1 * s for s in range(pp * v)}  # unequal stages
    for m in (4 * pp + pp, 7 * pp, 16 * pp):
        full = [peak_live(order, weight) for order in build(schedule, pp, v, m)]
        assert peak_live_per_rank(schedule, pp, v, m, weight) == pytest.approx(full, rel=1e-12)
