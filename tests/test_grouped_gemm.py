"""A rank's local experts as the stack issues their GEMMs, against closed forms: one batched kernel, one cuBLAS call
per expert on Transformer Engine's 4 streams (GroupedLinear), or an expert at a time (SequentialMLP); and how the
dispatch reaches them across nodes (NCCL's all-to-all, or DeepEP's forwarding); and Megatron-Core's passes over the
whole gradient buffer each step."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from plan import loader
from plan.schema import Plan
from twin.step.collectives import all_to_all_time, node_forwarded_share, node_forwarded_time, routed_reach
from twin.step.comm_costs import layer_comm
from twin.step.context import StepContext, shape_of, step_context
from twin.step.costs import optimizer_s
from twin.step.kernels import layer_cost, routed_load, weight_gemms
from twin.step.memory import stage_params
from twin.step.predict import PredictOptions

H100 = ["cluster=dgx-h100-superpod", "layout.tp=1", "layout.pp=2", "layout.dp=4", "layout.ep=2",
        "layout.fused_projections=true", "training.dtype=bf16"]  # fmt: skip
EXPERTS_LOCAL = 4  # cpu-tiny-moe: 8 experts over ep 2


def _ctx(streams: int) -> tuple[Plan, StepContext]:
    plan = loader.load("cpu-tiny-moe", [*H100, "stack=nemo-25.11", f"stack.grouped_gemm_streams={streams}"])
    return plan, step_context(plan, loader.plan_cluster(plan), PredictOptions(stragglers=False))


def _moe_layer(plan: Plan, ctx: StepContext):
    return layer_cost(plan.model, shape_of(ctx), ctx.device, ctx.stack, True, plan.layout.recompute)


def test_a_batch_issued_per_product_pays_a_fixed_cost_per_wave_of_streams() -> None:
    """The products' FLOPs and bytes run at the batched rate; each wave of concurrent calls adds one GEMM's fixed
    cost: e products on s streams pay ceil(e / s) of them where one batched kernel pays one."""
    _, ctx = _ctx(0)
    dev = ctx.device
    assert dev.gemm_fixed_s > 0
    m, n, k = 256.0, 1536.0, 2048.0
    for experts, streams in ((4, 4), (8, 4), (16, 4), (16, 1), (3, 4)):
        extra = dev.grouped(streams).gemm_s(m, n, k, experts) - dev.gemm_s(m, n, k, experts)
        waves = math.ceil(experts / streams)
        assert extra == pytest.approx((waves - 1) * dev.gemm_fixed_s, rel=1e-9, abs=1e-15)
        assert dev.grouped(streams).gemm_launches(experts) == experts
    assert dev.gemm_launches(16) == 1


def test_an_moe_layer_launches_one_gemm_per_local_expert_and_sequential_experts_wait_for_each() -> None:
    """Each expert GEMM (fc1 and fc2 forward; their input and weight gradients backward) becomes one launch per local
    expert; an expert at a time (SequentialMLP, 1 stream) is slower than 4 streams by the fixed costs the streams
    overlap, and 4 streams over 4 experts cost what one batched kernel costs."""
    layers = {s: _moe_layer(*_ctx(s)) for s in (0, 1, 4)}
    extra = EXPERTS_LOCAL - 1
    assert layers[4].kernels[0] - layers[0].kernels[0] == 2 * extra
    assert layers[4].kernels[1] - layers[0].kernels[1] == 4 * extra
    plan, ctx = _ctx(1)
    gemms = weight_gemms(plan.model, shape_of(ctx), True)
    assert [g[3] for g in gemms["fc1"]] == [EXPERTS_LOCAL, 1]  # the routed experts, and a shared one (one call)
    fixed = ctx.device.gemm_fixed_s
    assert layers[1].forward_s - layers[4].forward_s == pytest.approx(2 * extra * fixed, rel=1e-9)
    backward = (layers[1].backward_input_s + layers[1].backward_weight_s) - (
        layers[4].backward_input_s + layers[4].backward_weight_s
    )
    assert backward == pytest.approx(4 * extra * fixed, rel=1e-9)
    assert layers[4].forward_s == pytest.approx(layers[0].forward_s, rel=1e-12)


def _node_forwarding_comms(extra: list[str]) -> tuple[Plan, StepContext, dict[str, float]]:
    """One MoE layer's forward all-to-all exposure at EP16 over two DGX H100 nodes, by dispatcher."""
    overrides = [*H100[:-3], "layout.dp=16", "layout.ep=16", "layout.pp=1", "model.experts=16",
                 "training.global_batch=64", "stack=nemo-25.11", *extra]  # fmt: skip
    comms = {}
    for dispatch in ("all-to-all", "node-forwarding"):
        plan = loader.load("cpu-tiny-moe", [*overrides, f"stack.ep_dispatch={dispatch}"])
        ctx = step_context(plan, loader.plan_cluster(plan), PredictOptions(stragglers=False))
        comms[dispatch] = layer_comm(ctx, _moe_layer(plan, ctx), moe=True)["ep"][0]
    return plan, ctx, comms


def test_a_node_forwarding_dispatch_sends_a_token_once_to_each_remote_node() -> None:
    """DeepEP's and HybridEP's dispatch: a token crosses to each remote node holding any of its experts once, so of
    the top_k copies the share (N - 1)(1 - (1 - 1/N)^k) / k crosses N nodes: all of a one-expert token's remote
    copies (NCCL's own (N - 1)/N), a quarter of NCCL's at top-8 over two nodes, nothing inside one node. On an
    accelerator without measured dispatcher rates its NVLink stage moves at NCCL's bandwidth."""
    assert node_forwarded_share(1, 4) == pytest.approx(3 / 4, rel=1e-12)
    assert node_forwarded_share(8, 2) == pytest.approx((1 - 0.5**8) / 8, rel=1e-12)
    assert node_forwarded_share(8, 2) / (1 / 2) == pytest.approx(0.249, abs=1e-3)
    assert node_forwarded_share(8, 1) == 0.0
    plan, ctx, comms = _node_forwarding_comms(["cluster.compute.ep_dispatch=null"])
    span = ctx.span("ep")
    assert (span.size, span.nodes) == (16, 2)
    m = plan.model
    moved = plan.layout.microbatch_size * m.seq_len * m.top_k * m.hidden * routed_load(m)
    share = node_forwarded_share(m.top_k, span.nodes, m.experts)
    assert comms["node-forwarding"] == pytest.approx(2 * all_to_all_time(moved * 2, span, share), rel=1e-12)
    assert comms["all-to-all"] == pytest.approx(2 * all_to_all_time(moved * 2, span), rel=1e-12)
    assert comms["node-forwarding"] < comms["all-to-all"]


def _simulated_reach(
    ranks: int, nodes: int, experts: int, top_k: int, groups: tuple[int, int] | None
) -> tuple[float, float]:
    """Mean distinct ranks and nodes of 20,000 tokens' top_k experts under seeded random scores, group-limited as
    Megatron-Core's group_limited_topk does it (each group scored by the sum of its top_k / group_top_k best, the
    best group_top_k kept)."""
    rng = np.random.default_rng(0)
    scores = rng.random((20_000, experts))
    if groups is not None:
        total, chosen = groups
        best = np.sort(scores.reshape(len(scores), total, -1), -1)[..., -(top_k // chosen) :].sum(-1)
        kept = np.zeros_like(best, dtype=bool)
        np.put_along_axis(kept, np.argsort(best, -1)[:, -chosen:], True, 1)
        scores = np.where(np.repeat(kept, experts // total, 1), scores, -1.0)
    rank = np.argsort(scores, -1)[:, -top_k:] // (experts // ranks)

    def distinct(a: np.ndarray) -> float:
        return float(((np.diff(np.sort(a, 1), axis=1) != 0).sum(1) + 1).mean())

    return distinct(rank), distinct(rank // (ranks // nodes))


@pytest.mark.parametrize(
    ("ranks", "nodes", "experts", "groups"),
    [(16, 2, 128, None), (16, 2, 256, (2, 2)), (64, 8, 256, (8, 4)), (32, 4, 256, (8, 4))],
)
def test_routed_reach_agrees_with_simulated_routing(
    ranks: int, nodes: int, experts: int, groups: tuple[int, int] | None
) -> None:
    """routed_reach (distinct experts; under group-limited routing at least one pick in each chosen group, the rest
    spread evenly over them) against a seeded simulation of top-8 routing, within 1.5%: Qwen3 30B-A3B at EP16,
    DeepEP's EP16 test (both groups kept: no limit), DeepSeek-V3's 4 of 8 groups at a group a node (at most 4 nodes)
    and at two groups a node. The limit lowers the remote share a node-forwarding dispatch sends."""
    want = _simulated_reach(ranks, nodes, experts, 8, groups)
    got = routed_reach(ranks, nodes, 8, experts, groups)
    assert got == (pytest.approx(want[0], rel=0.015), pytest.approx(want[1], rel=0.015))
    if groups is not None and groups[1] < groups[0]:
        assert node_forwarded_share(8, nodes, experts, groups) < node_forwarded_share(8, nodes, experts)


def test_a_dispatcher_on_more_sms_forwards_faster_and_holds_them_under_overlapped_compute() -> None:
    """The NVLink stage's rate scales with the SMs the stack gives it (Stack.ep_dispatch_sms) up to NCCL's NVLink
    bandwidth; under Megatron-Core's combined 1F1B an all-to-all hidden behind the paired compute still slows that
    compute by the SMs it holds meanwhile: a2a · sms / sm_count where it hides all of it (ep_overlap_hidden 1), and
    of the measured share it hides, the rest exposed (the nemo-25.11 stack's 0.3655)."""
    top8 = ["model.experts=128", "model.top_k=8"]  # 8 experts a rank, as Qwen3 30B-A3B at EP16
    plan, ctx, comms = _node_forwarding_comms(top8)
    kernel = ctx.cluster.compute.ep_dispatch
    assert kernel is not None and kernel.sms == 24
    _, _, comms48 = _node_forwarding_comms([*top8, "stack.ep_dispatch_sms=48"])
    span = ctx.span("ep")
    m = plan.model
    moved = plan.layout.microbatch_size * m.seq_len * m.top_k * m.hidden * routed_load(m)
    one = node_forwarded_time(moved * 2, span, m.top_k, kernel, 24, m.experts)
    assert comms["node-forwarding"] == pytest.approx(2 * one, rel=1e-12)  # dispatch and combine
    latency = (span.nodes - 1) * span.latency_s + (span.per_node - 1) * span.intra_latency_s
    ranks = span.size * (1 - math.comb(120, 8) / math.comb(128, 8))  # 8 distinct experts of 128, 8 a rank
    forward = ranks * moved * 2 / m.top_k
    assert one - latency == pytest.approx(forward / (kernel.nvlink_GBps * 1e9), rel=1e-12)  # the NVLink stage binds
    assert comms48["node-forwarding"] - 2 * latency == pytest.approx(one - latency, rel=1e-12)  # twice the rate
    cost = _moe_layer(plan, ctx)
    a2a = comms["node-forwarding"]
    assert a2a < cost.forward_s  # the paired compute could hide all of it
    ideal = replace(ctx, stack=ctx.stack.model_copy(update={"ep_overlap_hidden": 1.0}))
    paired = layer_comm(ideal, cost, moe=True, paired=True)["ep"][0]
    assert paired == pytest.approx(a2a * 24 / 132, rel=1e-12)  # all hidden, the compute on 108 of 132 SMs meanwhile
    share = ctx.stack.ep_overlap_hidden
    assert share == pytest.approx(0.3655)  # Megatron-Bridge's Nsight profile of the combined 1F1B (nemo-25.11)
    measured = layer_comm(ctx, cost, moe=True, paired=True)["ep"][0]
    assert measured == pytest.approx(a2a - share * a2a + share * a2a * 24 / 132, rel=1e-12)


def test_a_dispatcher_inside_one_node_runs_its_intranode_kernels() -> None:
    """At EP8 inside one DGX H100 node a node-forwarding dispatcher (DeepEP's and HybridEP's intranode kernels) still
    sends a token once to each rank holding any of its experts, with no RDMA stage, at the intranode rate its SMs
    reach (DeepEP #16: 337 GB/s on 24 SMs where NVLink 4 allows it; the internode kernels' NVLink stage, sharing its
    SMs with RDMA, 143); without that figure, at the internode NVLink stage's."""
    top8 = ["model.experts=128", "model.top_k=8", "layout.dp=8", "layout.ep=8"]
    plan, ctx, comms = _node_forwarding_comms(top8)
    span = ctx.span("ep")
    assert (span.size, span.nodes) == (8, 1)
    kernel = ctx.cluster.compute.ep_dispatch
    assert kernel is not None and kernel.intranode_GBps == 337
    m = plan.model
    moved = plan.layout.microbatch_size * m.seq_len * m.top_k * m.hidden * routed_load(m)
    latency = (span.per_node - 1) * span.intra_latency_s
    ranks = span.size * (1 - math.comb(112, 8) / math.comb(128, 8))  # 8 distinct experts of 128, 16 a rank
    forward = ranks * moved * 2 / m.top_k
    assert comms["node-forwarding"] == pytest.approx(2 * (latency + forward / 337e9), rel=1e-12)
    assert comms["all-to-all"] == pytest.approx(2 * ctx.time("all_to_all", moved * 2, span), rel=1e-12)
    _, _, internode_rate = _node_forwarding_comms([*top8, "cluster.compute.ep_dispatch.intranode_GBps=null"])
    assert internode_rate["node-forwarding"] == pytest.approx(2 * (latency + forward / 143e9), rel=1e-12)


def test_megatron_cores_passes_over_the_whole_gradient_buffer_cost_their_bytes_each_step() -> None:
    """core_v0.8.0's data-parallel wrapper zeroes the whole fp32 gradient buffer each step, takes each bucket's norm
    for the NaN check and scales it by 1/dp before the reduce-scatter: four passes over every parameter a rank
    holds, sharded or not, beside the optimizer's own step over its ZeRO shard."""
    base = ["cluster=dgx-h100-superpod", "stack=megatron-core-0.8", "layout.tp=1", "layout.pp=1", "layout.dp=8",
            "layout.ep=1", "layout.zero=1", "training.global_batch=16", "training.dtype=bf16"]  # fmt: skip
    steps = {}
    for passes in (0, 4):
        plan = loader.load("cpu-tiny", [*base, f"stack.grad_buffer_passes={passes}"])
        ctx = step_context(plan, loader.plan_cluster(plan), PredictOptions(stragglers=False))
        steps[passes] = optimizer_s(ctx)[0]
    assert ctx.grad_bytes == 4  # the buffer accumulates and reduces in fp32 under bf16 (Megatron-LM forces it)
    held = stage_params(plan, 0)
    expected = ctx.device.memory_s(4 * 4 * (held.dense + held.expert), 4)
    assert steps[4] - steps[0] == pytest.approx(expected, rel=1e-9)
    assert loader.load_stack("megatron-core-0.8").grad_buffer_passes == 4
