"""Megatron-Core's MoE parallel folding (layout.expert_tp): experts on a grid of their own over each pipeline
stage's tp · cp · dp ranks, and what whole experts under sequence parallelism compute."""

from __future__ import annotations

import pytest

from executor.parallel import LayoutError, check_supported
from plan import loader
from twin.step.context import shape_of, step_context
from twin.step.kernels import weight_gemms
from twin.step.memory import layer_params
from twin.step.predict import PredictOptions, predict
from twin.step.schedules import build

H100 = ["cluster=dgx-h100-superpod", "stack=nemo-24.12", "layout.sequence_parallel=true", "layout.pp=1"]


def _plan(extra: list[str]):
    return loader.load("cpu-tiny-moe", [*H100, *extra])


@pytest.mark.parametrize("layout", [["stack=executor"], ["layout.expert_tp=1", "layout.ep=4"]])
def test_whole_experts_under_sequence_parallelism_take_their_own_shard_of_the_routed_copies(layout: list[str]) -> None:
    """A tp rank that routes its own s/tp tokens to whole experts (the executor; folded experts at expert_tp 1)
    runs top_k · s/tp rows over its experts, and its shared expert the s/tp rows; experts split over tp gather the
    tp group's copies and run top_k · s rows at a tp-th of the width: the same FLOPs either way."""
    whole = _plan(["layout.tp=2", "layout.dp=4", "layout.ep=2", *layout])
    split = _plan(["layout.tp=2", "layout.dp=4", "layout.ep=2"])
    m = whole.model
    assert m.moe_ffn_hidden is not None
    tokens = whole.layout.microbatch_size * m.seq_len
    shapes = {}
    for name, plan in (("whole", whole), ("split", split)):
        ctx = step_context(plan, loader.plan_cluster(plan), PredictOptions(stragglers=False))
        shapes[name] = weight_gemms(m, shape_of(ctx), moe=True)["fc1"]
    local = m.experts // whole.layout.ep
    (rows, n, _, count), (shared_rows, shared_n, _, _) = shapes["whole"]
    assert (rows, n, count) == (tokens / 2 * m.top_k / local, 2 * m.moe_ffn_hidden, local)
    assert (shared_rows, shared_n) == (tokens / 2, 2 * m.moe_ffn_hidden * m.shared_experts)
    flops = {k: sum(r * n * k_ * c for r, n, k_, c in g) for k, g in shapes.items()}
    assert flops["whole"] == pytest.approx(flops["split"], rel=1e-12)  # whatever the ep: a rank gets its share


def test_folding_with_experts_split_as_the_mlp_predicts_the_unfolded_layout() -> None:
    base = ["layout.tp=2", "layout.dp=4", "layout.ep=2", "stack=megatron-core-0.8"]
    plain, folded = _plan(base), _plan([*base, "layout.expert_tp=2"])
    a, b = (predict(p, options=PredictOptions(stragglers=False)) for p in (plain, folded))
    assert b.step_time_s == pytest.approx(a.step_time_s, rel=1e-12)
    assert b.memory.peak == pytest.approx(a.memory.peak, rel=1e-12)


def test_folded_whole_experts_span_the_tensor_parallel_ranks() -> None:
    """TP2 with EP8 over 4 dp replicas (ep > dp, as DeepSeek-V3 on 1,024 H100 ran TP2 EP64 over 32): each rank
    holds experts / ep whole experts, one copy of each per stage, and its all-to-all spans the 8 ranks of a node."""
    plan = _plan(["layout.tp=2", "layout.dp=4", "layout.ep=8", "layout.expert_tp=1"])
    m, lay = plan.model, plan.layout
    assert m.moe_ffn_hidden is not None
    assert lay.expert_replicas == 1
    expert = 3 * m.hidden * m.moe_ffn_hidden  # SwiGLU: gate, up, down
    assert layer_params(plan, m.dense_layers).expert == pytest.approx(m.experts * expert / lay.ep)
    result = predict(plan, options=PredictOptions(stragglers=False))
    assert (result.collectives["ep"]["ranks"], result.collectives["ep"]["per_node"]) == (8, 8)
    assert result.breakdown_s["ep_comm"] > 0


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["layout.tp=2", "layout.dp=4", "layout.ep=8"], r"ep: 8 does not divide dp=4.*set expert_tp"),
        (["layout.tp=4", "layout.dp=2", "layout.ep=2", "layout.expert_tp=2"], r"expert_tp: 2 must be 1 .* or tp=4"),
        (["layout.tp=2", "layout.dp=2", "layout.ep=8", "layout.expert_tp=1"], r"does not divide tp·cp·dp=4"),
    ],
)
def test_impossible_folds_name_the_fix(extra: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _plan(extra)


def test_the_executor_refuses_folded_experts() -> None:
    plan = loader.load("cpu-tiny-moe", ["layout.tp=2", "layout.dp=2", "layout.ep=4", "layout.expert_tp=1"])
    with pytest.raises(LayoutError, match="twin-only layout; unset expert_tp"):
        check_supported(plan)


def test_the_combined_1f1b_pairs_the_steady_phase_only() -> None:
    """Megatron-Core's combined 1F1B: interleaved 1F1B's steady forward-backward pairs are co-scheduled, warm-up
    and cool-down run alone; without pipelining each backward runs with the next forward."""
    pp, v, m = 4, 2, 8
    for r, order in enumerate(build("interleaved-1f1b", pp, v, m, paired=True)):
        plain = build("interleaved-1f1b", pp, v, m)[r]
        assert [(a.kind, a.microbatch, a.stage) for a in order] == [(a.kind, a.microbatch, a.stage) for a in plain]
        warmup = min(2 * (pp - 1 - r) + (v - 1) * pp, m * v)
        flags = [a.overlap for a in order]
        steady = 2 * (m * v - warmup)
        assert flags == [False] * warmup + [True] * steady + [False] * warmup
    alone = build("1f1b", 1, 1, 4, paired=True)[0]
    assert [(a.kind, a.microbatch, a.overlap) for a in alone] == [
        ("F", 0, False), ("B", 0, True), ("F", 1, True), ("B", 1, True), ("F", 2, True), ("B", 2, True),
        ("F", 3, True), ("B", 3, False),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="no combined 1F1B"):
        build("1f1b", 4, 1, 8, paired=True)


def _overlap_plan(ep_overlap: bool, schedule: list[str]):
    return _plan(["layout.tp=1", "layout.dp=8", "layout.ep=8", "stack=megatron-core-0.8", "training.global_batch=64",
                  f"stack.overrides.ep_overlap={str(ep_overlap).lower()}", *schedule])  # fmt: skip


@pytest.mark.parametrize(
    ("schedule", "hidden"),
    [
        (["layout.pp=2", "layout.schedule=interleaved-1f1b", "layout.virtual_stages=2"], True),
        (["layout.pp=1"], True),
        (["layout.pp=2", "layout.schedule=1f1b"], False),  # Megatron-Core asks for virtual stages where pp > 1
    ],
)
def test_the_expert_parallel_overlap_hides_paired_all_to_alls(schedule: list[str], hidden: bool) -> None:
    """Stack.ep_overlap: each paired action's all-to-all hides behind compute, so the exposed EP time falls and the
    rest of the step's compute is unchanged; a schedule Megatron-Core cannot pair keeps every all-to-all."""
    alone, paired = (
        predict(_overlap_plan(flag, schedule), options=PredictOptions(stragglers=False)) for flag in (False, True)
    )
    assert paired.breakdown_s["compute"] == pytest.approx(alone.breakdown_s["compute"], rel=1e-12)
    if hidden:
        assert paired.breakdown_s["ep_comm"] < 0.9 * alone.breakdown_s["ep_comm"]
        assert paired.step_time_s < alone.step_time_s
    else:
        assert paired.step_time_s == pytest.approx(alone.step_time_s, rel=1e-12)
