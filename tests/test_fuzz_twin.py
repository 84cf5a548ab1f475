"""Fuzz the twin, not only the loader: random overrides of preset plans — layouts, batches, model sizes, failure
rates, checkpoint intervals, cluster what-ifs — through `twin validate`, `twin predict` and `twin run` and through
the Python API. Every case ends within 5 s with exit 0 (an answer) or 2 (one line naming the problem), and the API
returns or raises PlanError, nothing else.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from plan.errors import PlanError
from twin import api
from twin.cli.app import app

BUDGET_S = 5.0
"""Each case's budget, in CPU seconds of this process; wall time may take twice that on a shared machine."""
runner = CliRunner()
T = TypeVar("T")


def timed(call: Callable[[], T]) -> tuple[T, float, float]:
    """`call()`'s result, and the CPU and wall seconds it took."""
    cpu, wall = time.process_time(), time.monotonic()
    result = call()
    return result, time.process_time() - cpu, time.monotonic() - wall


small = st.integers(1, 16)
count = st.one_of(small, st.integers(0, 4096), st.sampled_from([-1, 10**6, 10**9, 2**63]))
positive = st.one_of(
    st.floats(1e-9, 1e6), st.sampled_from([0.0, -1.0, 1e-300, 1e300, float("inf"), float("nan")]), st.integers(1, 100)
)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "layout.dp": count,
    "layout.tp": st.sampled_from([1, 2, 4, 8, 3]),
    "layout.pp": st.one_of(small, st.sampled_from([64, 1000])),
    "layout.cp": st.sampled_from([1, 2, 4]),
    "layout.ep": st.sampled_from([1, 2, 8, 64]),
    "layout.zero": st.sampled_from([0, 1, 2, 3, 4, True]),
    "layout.microbatch_size": count,
    "layout.schedule": st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipe-v"]),
    "layout.virtual_stages": st.integers(1, 5),
    "layout.recompute": st.sampled_from(["none", "selective", "full"]),
    "layout.sequence_parallel": st.booleans(),
    "layout.stage_layers": st.none(),
    "training.global_batch": count,
    "training.tokens": positive,
    "training.dtype": st.sampled_from(["bf16", "fp8", "fp32"]),
    "model.layers": count,
    "model.hidden": st.sampled_from([64, 4096, 16384, 10**7]),
    "model.seq_len": st.sampled_from([128, 8192, 131072, 10**8]),
    "model.experts": st.sampled_from([0, 8, 256]),
    "reliability.checkpoint": st.sampled_from(["sync", "async", "in-memory"]),
    "reliability.checkpoint_interval_min": st.one_of(positive, st.just("auto")),
    "reliability.hot_spares": st.integers(0, 64),
    "reliability.restart_min": positive,
    "reliability.elastic": st.booleans(),
    "reliability.failure_rates": st.dictionaries(st.sampled_from(["gpu", "host", "software"]), positive, max_size=2),
    "cluster.nodes": st.one_of(st.integers(1, 40000), st.sampled_from([10**8])),
    "cluster.failures.rate_scale": positive,
    "cluster.failures.repair_hours": positive,
    "cluster.fabric.tiers.*.bandwidth_GBps": positive,
}
PRESETS = ["cpu-tiny", "gpt3-175b-1k", "llama3-405b-16k", "deepseek-v3-2k"]


def as_override(field: str, value: Any) -> str:
    return f"{field}={json.dumps(value) if not isinstance(value, str) else value}"


overrides = st.lists(
    st.sampled_from(sorted(FIELDS)).flatmap(lambda f: FIELDS[f].map(lambda v: as_override(f, v))),
    min_size=1,
    max_size=4,
)
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60)  # 5-min default run


def invoke(args: list[str]) -> None:
    """`twin ARGS` ends within the budget with exit 0, or 2 and one error line (one JSON object with --json)."""
    result, cpu, wall = timed(lambda: runner.invoke(app, args))
    assert cpu < BUDGET_S and wall < 2 * BUDGET_S, f"twin {' '.join(args)} took {cpu:.1f} s CPU, {wall:.1f} s wall"
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, repr(result.exception))
    assert result.exit_code in (0, 2), (args, result.output)
    if result.exit_code == 2:
        if "--json" in args:
            assert json.loads(result.stdout)["ok"] is False
        else:
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)


def with_sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


@pytest.mark.timeout(120, method="thread")
@SETTINGS
@given(st.sampled_from(PRESETS), overrides, st.booleans())
def test_validate_any_overrides(preset: str, items: list[str], as_json: bool) -> None:
    invoke(["validate", preset, *with_sets(items), *(["--json"] if as_json else [])])


@pytest.mark.timeout(120, method="thread")
@SETTINGS
@given(st.sampled_from(PRESETS), overrides, st.booleans())
def test_predict_any_overrides(preset: str, items: list[str], allow_oom: bool) -> None:
    invoke(["predict", preset, *with_sets(items), *(["--allow-oom"] if allow_oom else [])])


@pytest.mark.timeout(120, method="thread")
@SETTINGS
@given(st.sampled_from(PRESETS), overrides, st.integers(-2, 2**70))
def test_run_any_overrides(preset: str, items: list[str], seed: int) -> None:
    invoke(["run", preset, *with_sets(items), "--seed", str(seed), "--json"])


@pytest.mark.timeout(120, method="thread")
@SETTINGS
@given(st.sampled_from(PRESETS), overrides, st.sampled_from(["validate", "predict", "run"]))
def test_python_api_returns_or_raises_plan_error(preset: str, items: list[str], call: str) -> None:

    def use() -> None:
        try:
            if call == "validate":
                result = api.validate(preset, items)
                assert result.ok or len(result.reasons) == 1
            elif call == "predict":
                api.predict(api.load_plan(preset, items))
            else:
                api.simulate_run(api.load_plan(preset, items), seed=1)
        except PlanError as exc:
            assert "\n" not in str(exc)

    _, cpu, wall = timed(use)
    assert cpu < BUDGET_S and wall < 2 * BUDGET_S, (preset, items, call, cpu, wall)
