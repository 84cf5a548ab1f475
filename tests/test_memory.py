"""Memory per GPU: 16 bytes/param sharded as each ZeRO stage shards, activations by recompute policy, fits."""

from __future__ import annotations

import pytest

from plan import loader
from plan.model_math import param_count
from twin.step.memory import activation_bytes, rank_state_bytes
from twin.step.predict import predict


@pytest.mark.parametrize("model", ["llama3-8b", "gpt3-175b", "tiny"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_model_state_is_16_bytes_per_param_sharded_by_stage(model: str, zero: int) -> None:
    dp = 8
    plan = loader.load(
        "cpu-tiny",
        [
            f"model={model}",
            "layout.tp=1",
            "layout.pp=1",
            f"layout.dp={dp}",
            f"layout.zero={zero}",
            "training.global_batch=16",
            "cluster=dgx-h100-superpod",
        ],
    )
    n = param_count(plan.model).total
    weights, grads, optimizer = rank_state_bytes(plan, [0])
    assert weights == pytest.approx(2 * n / (dp if zero >= 3 else 1))
    assert grads == pytest.approx(2 * n / (dp if zero >= 2 else 1))
    assert optimizer == pytest.approx(12 * n / (dp if zero >= 1 else 1))
    if zero == 0:
        assert weights + grads + optimizer == pytest.approx(16 * n)  # Rajbhandari et al. 2020


def test_tensor_and_pipeline_parallelism_split_the_weights() -> None:
    base = loader.load("llama3-405b-16k", ["layout.zero=0"])
    total = sum(rank_state_bytes(base, [s])[0] for s in range(base.layout.num_stages))
    assert total * base.layout.tp == pytest.approx(2 * param_count(base.model).total, rel=0.01)


def test_recompute_and_sequence_parallelism_shrink_activations() -> None:
    sizes = {}
    for policy in ("none", "selective", "full"):
        plan = loader.load("llama3-405b-16k", [f"layout.recompute={policy}"])
        sizes[policy] = activation_bytes(plan, moe=False)[0]
    assert sizes["full"] < sizes["selective"] < sizes["none"]
    no_sp = loader.load("llama3-405b-16k", ["layout.recompute=full", "layout.sequence_parallel=false"])
    assert activation_bytes(no_sp, moe=False)[0] == pytest.approx(8 * sizes["full"])  # tp=8 shards the stream


def test_full_recompute_keeps_one_layer_input() -> None:
    plan = loader.load("llama3-405b-16k", ["layout.recompute=full"])
    m = plan.model
    assert activation_bytes(plan, moe=False)[0] == m.seq_len * m.hidden / plan.layout.tp * 2


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "layout.tp=1",
            "layout.pp=1",
            "layout.schedule=1f1b",
            "layout.virtual_stages=1",
            "layout.dp=16384",
            "training.global_batch=16384",
        ],  # 405B replicated on every GPU
        ["layout.recompute=none", "layout.microbatch_size=16", "training.global_batch=32768"],
    ],
)
def test_impossible_layout_reports_fits_false_with_reason(overrides: list[str]) -> None:
    result = predict(loader.load("llama3-405b-16k", overrides))
    assert not result.fits
    assert "over by" in result.memory.reason and "GiB" in result.memory.reason
    assert result.memory.peak > result.memory.capacity
