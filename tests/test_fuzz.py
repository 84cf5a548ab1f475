"""Fuzz the plan loader: whatever the input, it returns a valid Plan or raises PlanError — never anything else."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plan import loader
from plan.loader import PlanError
from plan.schema import Plan

BASE = yaml.safe_load((loader.PRESET_DIR / "plans" / "cpu-tiny.yaml").read_text())
FIELDS = {
    "model": [
        "layers",
        "hidden",
        "heads",
        "kv_heads",
        "ffn_hidden",
        "vocab",
        "seq_len",
        "glu",
        "experts",
        "top_k",
        "moe_ffn_hidden",
        "dense_layers",
        "head_dim",
    ],
    "layout": [
        "dp",
        "tp",
        "pp",
        "cp",
        "ep",
        "zero",
        "microbatch_size",
        "schedule",
        "virtual_stages",
        "recompute",
        "stage_layers",
        "edge_stage_trim",
        "rank_order",
        "sequence_parallel",
    ],
    "training": ["global_batch", "tokens", "dtype", "optimizer", "lr", "seed"],
    "reliability": ["checkpoint", "checkpoint_interval_min", "hot_spares", "restart_min", "failure_rates"],
}
values = st.one_of(
    st.integers(-4, 300),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
    st.sampled_from(["1f1b", "zbv", "auto", "bf16", "fp4", "tp-cp-dp-pp"]),
    st.lists(st.integers(0, 9), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def load_text(text: str) -> Plan | None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            return loader.load(path)
        except PlanError as exc:
            assert "\n" not in str(exc)
            return None


@SETTINGS
@given(st.text(max_size=300))
def test_arbitrary_text(text: str) -> None:
    load_text(text)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(sorted(FIELDS)), st.data()), min_size=1, max_size=4))
def test_mutated_fields(mutations: list[tuple[str, Any]]) -> None:
    data = yaml.safe_load(yaml.safe_dump(BASE))
    data["model"] = yaml.safe_load((loader.PRESET_DIR / "models" / "tiny.yaml").read_text())
    for section, draw in mutations:
        field = draw.draw(st.sampled_from(FIELDS[section] + ["bogus_key"]))
        data.setdefault(section, {})[field] = draw.draw(values)
    plan = load_text(yaml.safe_dump(data))
    if plan is not None:  # whatever passes must satisfy the invariants the twin and executor rely on
        lay = plan.layout
        assert plan.training.global_batch % (lay.dp * lay.microbatch_size) == 0
        assert plan.model.heads % lay.tp == 0 and lay.dp % lay.ep == 0
        assert sum(plan.stage_layer_counts) == plan.model.layers


@SETTINGS
@given(st.lists(st.text(max_size=30), max_size=3))
def test_arbitrary_overrides(overrides: list[str]) -> None:
    with contextlib.suppress(PlanError):
        loader.load("cpu-tiny", overrides)


@SETTINGS
@given(
    st.recursive(
        st.one_of(st.integers(), st.text(max_size=5), st.none()),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
        max_leaves=20,
    )
)
def test_arbitrary_structures(obj: Any) -> None:
    load_text(yaml.safe_dump(obj))


def test_recursive_alias_is_a_plan_error() -> None:
    assert load_text("a: &x [*x]\n") is None
