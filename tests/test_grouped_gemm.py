"""A rank's local experts as the stack issues their GEMMs, against closed forms: one batched kernel, one cuBLAS call
per expert on Transformer Engine's 4 streams (GroupedLinear), or an expert at a time (SequentialMLP); and how the
dispatch reaches them across nodes (NCCL's all-to-all, or DeepEP's forwarding); and Megatron-Core's passes over the
whole gradient buffer each step."""

from __future__ import annotations

import math

import pytest

from plan import loader
from plan.schema import Plan
from twin.step.collectives import all_to_all_time, node_forwarded_share
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


def test_a_node_forwarding_dispatch_sends_a_token_once_to_each_remote_node() -> None:
    """DeepEP's and HybridEP's dispatch: a token crosses to each remote node holding any of its experts once, so of
    the top_k copies the share (N - 1)(1 - (1 - 1/N)^k) / k crosses N nodes: all of a one-expert token's remote
    copies (NCCL's own (N - 1)/N), a quarter of NCCL's at top-8 over two nodes, nothing inside one node."""
    assert node_forwarded_share(1, 4) == pytest.approx(3 / 4, rel=1e-12)
    assert node_forwarded_share(8, 2) == pytest.approx((1 - 0.5**8) / 8, rel=1e-12)
    assert node_forwarded_share(8, 2) / (1 / 2) == pytest.approx(0.249, abs=1e-3)
    assert node_forwarded_share(8, 1) == 0.0
    overrides = [*H100[:-3], "layout.dp=16", "layout.ep=16", "layout.pp=1", "model.experts=16",
                 "training.global_batch=64", "stack=nemo-25.11"]  # fmt: skip
    comms = {}
    for dispatch in ("all-to-all", "node-forwarding"):
        plan = loader.load("cpu-tiny-moe", [*overrides, f"stack.ep_dispatch={dispatch}"])
        ctx = step_context(plan, loader.plan_cluster(plan), PredictOptions(stragglers=False))
        comms[dispatch] = layer_comm(ctx, _moe_layer(plan, ctx), moe=True)["ep"][0]
    span = ctx.span("ep")
    assert (span.size, span.nodes) == (16, 2)
    m = plan.model
    moved = plan.layout.microbatch_size * m.seq_len * m.top_k * m.hidden * routed_load(m)
    share = node_forwarded_share(m.top_k, span.nodes)
    assert comms["node-forwarding"] == pytest.approx(2 * all_to_all_time(moved * 2, span, share), rel=1e-12)
    assert comms["all-to-all"] == pytest.approx(2 * all_to_all_time(moved * 2, span), rel=1e-12)
    assert comms["node-forwarding"] < comms["all-to-all"]


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
