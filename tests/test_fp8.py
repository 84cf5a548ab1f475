"""fp8 training as Transformer Engine 1.x runs it, and the MoE layer's own kernels, against closed forms: the head
and router in bf16, the casts around every fp8 GEMM, the widths of the tensor-parallel traffic, the amax
all-reduce, block-scaled GEMMs at their own fraction; current scaling (Transformer Engine 2.x); the weight
gradients added apart from their GEMMs where a stack does not fuse the accumulation."""

from __future__ import annotations

import json

import pytest

from plan import loader
from plan.schema import Plan
from plan.stack import GEMMS
from twin.step.casts import cast_bytes
from twin.step.compute import DTENSOR_OPS_FORWARD, Device
from twin.step.context import StepContext, shape_of, step_context
from twin.step.costs import amax_reduction_s, current_amax_s, stage_costs
from twin.step.ends import head_cost
from twin.step.kernels import (
    ROUTER,
    kernel_bytes,
    layer_cost,
    routed_load,
    tensor_sizes,
    weight_gemms,
)
from twin.step.predict import PredictOptions

H100_TP4 = ["cluster=dgx-h100-superpod", "layout.tp=4", "layout.pp=2", "layout.dp=4", "layout.ep=1",
            "layout.sequence_parallel=true", "layout.fused_projections=true"]  # fmt: skip


def _ctx(stack: str, dtype: str, *extra: str, preset: str = "cpu-tiny") -> tuple[Plan, StepContext]:
    plan = loader.load(preset, [*H100_TP4, f"stack={stack}", f"training.dtype={dtype}", *extra])
    return plan, step_context(plan, loader.plan_cluster(plan), PredictOptions(stragglers=False))


def _layer(plan: Plan, ctx: StepContext, moe: bool = False):
    return layer_cost(plan.model, shape_of(ctx), ctx.device, ctx.stack, moe, plan.layout.recompute)


def test_the_output_head_runs_in_bf16_under_an_fp8_plan() -> None:
    """Megatron-Core's output layer is a plain ColumnParallelLinear outside fp8_autocast: its GEMMs take the bf16
    time whatever the plan's dtype, while the layers' GEMMs speed up."""
    plan8, ctx8 = _ctx("nemo-24.12", "fp8")
    plan16, ctx16 = _ctx("nemo-24.12", "bf16")
    shape = shape_of(ctx8)
    fp8, bf16 = (
        head_cost(plan8.model, shape, ctx8.device, ctx8.stack),
        head_cost(plan16.model, shape, ctx16.device, ctx16.stack),
    )
    assert (fp8.forward_s, fp8.backward_input_s, fp8.backward_weight_s) == pytest.approx(
        (bf16.forward_s, bf16.backward_input_s, bf16.backward_weight_s), rel=1e-12
    )
    assert _layer(plan8, ctx8).gemm_s[1] < _layer(plan16, ctx16).gemm_s[1]


def test_an_fp8_moe_layer_routes_with_a_bf16_gemm() -> None:
    """The router's gating GEMM runs in bf16 (a plain linear outside fp8_autocast); every other weight GEMM in fp8,
    the experts' as the stack issues them (one call per local expert): the layer's forward GEMM time is exactly
    that sum."""
    plan, ctx = _ctx("nemo-24.12", "fp8", "layout.ep=2", preset="cpu-tiny-moe")
    gemms = weight_gemms(plan.model, shape_of(ctx), True)
    dev, ops = ctx.device, DTENSOR_OPS_FORWARD * ctx.device.sharded_s

    def forward(device: Device, names: tuple[str, ...]) -> float:
        return sum(device.gemm_s(m, n, k, b) + ops for name in names for m, n, k, b in gemms[name])

    experts = dev.grouped(ctx.stack.grouped_gemm_streams)
    expected = forward(dev.sixteen_bit(), (ROUTER,)) + forward(dev, ("qkv", "proj")) + forward(experts, ("fc1", "fc2"))
    assert _layer(plan, ctx, moe=True).forward_gemm_s == pytest.approx(expected, rel=1e-12)
    assert forward(dev.sixteen_bit(), (ROUTER,)) > forward(dev, (ROUTER,))


def test_a_norm_that_writes_fp8_saves_its_gemm_the_input_cast_but_not_the_transpose() -> None:
    """TE's LayerNormLinear hands qkv and fc1 an fp8 input. Under sequence parallelism each rank casts its own shard
    of that input (read 2, write 1) before the fp8 gather, and the gathered whole is transposed for the weight
    gradient (read 1, write 1): a norm writing fp8 leaves only the transpose, so unfusing the two norms adds 3 bytes
    per element of a rank's shard (hidden · tokens / tp) and one kernel each. In bf16 nothing is cast."""
    plan, fused = _ctx("nemo-24.12", "fp8")
    layer = json.dumps([{**k.model_dump(exclude_none=True), "fp8_output": False} for k in fused.stack.layer])
    _, unfused = _ctx("nemo-24.12", "fp8", f"stack.overrides.layer={layer}")
    tokens, tp = shape_of(fused).tokens, plan.layout.tp
    extra = fused.device.elementwise_s(2 * tokens * plan.model.hidden * 3 / tp, 2)
    assert _layer(plan, unfused).forward_s - _layer(plan, fused).forward_s == pytest.approx(extra, rel=1e-9)
    plan16, unfused16 = _ctx("nemo-24.12", "bf16", f"stack.overrides.layer={layer}")
    _, fused16 = _ctx("nemo-24.12", "bf16")
    assert _layer(plan16, unfused16).forward_s == pytest.approx(_layer(plan16, fused16).forward_s, rel=1e-12)


def test_every_fp8_gemm_casts_its_output_gradient_in_backward() -> None:
    """Backward, each fp8 GEMM's bf16 output gradient is cast to fp8 with its transpose: a column-parallel GEMM's
    (qkv, fc1) whole on the rank, one cast-transpose (4 bytes per element, one kernel); a row-parallel GEMM's (proj,
    fc2) is sequence-parallel, so each rank casts its shard (3 bytes per element of it) and the gathered fp8 is
    transposed (2 per element of the whole: two kernels; TE 1.13 grad_output_preprocess). Beside the GEMMs, an fp8
    layer's input-gradient pass is a bf16 one's plus exactly those casts."""
    plan8, ctx8 = _ctx("nemo-24.12", "fp8")
    plan16, ctx16 = _ctx("nemo-24.12", "bf16")
    fp8, bf16 = _layer(plan8, ctx8), _layer(plan16, ctx16)
    gemms, tp, dev = weight_gemms(plan8.model, shape_of(ctx8), False), plan8.layout.tp, ctx8.device
    column = sum(dev.elementwise_s(m * n * b * 4, b) for name in ("qkv", "fc1") for m, n, _, b in gemms[name])
    row = sum(
        dev.elementwise_s(m * n * b * (3 / tp + 2), 2 * b) for name in ("proj", "fc2") for m, n, _, b in gemms[name]
    )
    beside = (fp8.backward_input_s - fp8.gemm_s[0]) - (bf16.backward_input_s - bf16.gemm_s[0])
    assert beside == pytest.approx(column + row, rel=1e-9)


@pytest.mark.parametrize(
    ("stack", "extra", "widths"),
    [
        ("nemo-24.12", [], (1, 2, 2)),  # TE gathers the cast input; reductions, sends and K/V stay bf16
        ("nemo-24.12", ["stack.overrides.fp8_reduce_scatter=true"], (1, 1, 2)),  # userbuffers' fp8_buf
        ("deepseek-v3", [], (1, 1, 1)),  # §3.3.3: activations cached and sent in FP8
    ],
)
def test_fp8_traffic_widths_follow_what_the_stack_casts(stack: str, extra: list[str], widths: tuple) -> None:
    _, ctx = _ctx(stack, "fp8", *extra)
    assert (ctx.gather_bytes, ctx.reduce_bytes, ctx.comm_bytes) == widths
    _, bf16 = _ctx(stack, "bf16", *extra)
    assert (bf16.gather_bytes, bf16.reduce_bytes, bf16.comm_bytes) == (2, 2, 2)


def test_each_chunk_all_reduces_its_amaxes_each_way_under_delayed_scaling_only() -> None:
    """One latency-bound all-reduce over the replica's tp, cp and dp ranks per stage, forward and backward, where
    the stack scales fp8 by amax history; nothing in bf16 or without the flag."""
    plan, ctx = _ctx("nemo-24.12", "fp8")
    _, off = _ctx("nemo-24.12", "fp8", "stack.overrides.fp8_amax_reduction=false")
    costs, bare = stage_costs(ctx, {False: _layer(plan, ctx)}), stage_costs(off, {False: _layer(plan, off)})
    layers = plan.model.layers // plan.layout.pp
    amax = ctx.time("all_reduce", 4 * 3 * 4 * layers, ctx.span("tp", "cp", "dp"))  # 4 GEMMs x 3 fp32 amaxes
    assert amax > 0
    for key in costs:
        assert costs[key].dp - bare[key].dp == pytest.approx(amax if key[0] in "FB" else 0.0, rel=1e-12)
    _, bf16 = _ctx("nemo-24.12", "bf16")
    assert amax_reduction_s(bf16, layers) == 0.0


CURRENT = ["stack.overrides.fp8_scaling=current", "stack.overrides.fp8_amax_reduction=false"]


def test_current_scaling_reads_every_cast_input_once_more_for_its_amax() -> None:
    """Transformer Engine 2.x's current scaling computes each operand's amax before it casts it, and a scale kernel
    more. After a norm, which now writes bf16 with the amax beside it, qkv's and fc1's sequence-parallel shard is
    cast (3 bytes per element of the shard) where delayed scaling's norm wrote it in fp8; proj's and fc2's inputs
    and qkv's and fc1's output gradients (whole on the rank) are read once more (2 bytes); proj's and fc2's
    gradient shards likewise (2 per element of the shard). Two kernels more each; the GEMMs are the same."""
    plan, delayed = _ctx("nemo-24.12", "fp8", "stack.overrides.fp8_amax_reduction=false")
    _, current = _ctx("nemo-24.12", "fp8", *CURRENT)
    gemms, dev, tp = weight_gemms(plan.model, shape_of(delayed), False), delayed.device, plan.layout.tp

    def extra(names: tuple[str, ...], nbytes: float, fwd: bool) -> float:
        return sum(
            dev.elementwise_s((m * k if fwd else m * n) * b * nbytes, 2 * b)
            for name in names
            for m, n, k, b in gemms[name]
        )

    column, row = ("qkv", "fc1"), ("proj", "fc2")
    forward = extra(column, 3 / tp, True) + extra(row, 2, True)
    backward = extra(column, 2, False) + extra(row, 2 / tp, False)
    a, b = _layer(plan, current), _layer(plan, delayed)
    assert a.forward_s - b.forward_s == pytest.approx(forward, rel=1e-9)
    assert a.backward_input_s - b.backward_input_s == pytest.approx(backward, rel=1e-9)
    assert a.gemm_s == pytest.approx(b.gemm_s, rel=1e-12)  # the GEMMs themselves are per-tensor scaled either way


@pytest.mark.parametrize(
    ("current", "gathered", "fused", "expected"),
    [
        (False, False, False, (4, 1)),  # cast-transpose
        (False, False, True, (2, 1)),  # the norm wrote fp8: the transpose
        (False, True, False, (3 / 4 + 2, 2)),  # cast the shard, transpose the gathered whole
        (False, True, True, (2, 1)),
        (True, False, False, (6, 3)),  # amax, scale, cast-transpose
        (True, False, True, (4, 2)),  # the norm gave the amax: scale, cast-transpose
        (True, True, False, (5 / 4 + 2, 4)),
        (True, True, True, (3 / 4 + 2, 3)),
    ],
)
def test_cast_bytes_per_element_of_the_whole_operand(current: bool, gathered: bool, fused: bool, expected) -> None:
    assert cast_bytes(current, 4 if gathered else 1, fused) == pytest.approx(expected)


def test_current_scaling_all_reduces_a_sequence_parallel_casts_amax_over_tp() -> None:
    """Under sequence parallelism each dense layer waits for two tp all-reduces of one fp32 amax each way (the qkv
    and fc1 inputs forward, the proj and fc2 output gradients backward); none without sequence parallelism, at
    tp 1, in bf16, or under delayed scaling (whose own reduction is per chunk)."""
    plan, ctx = _ctx("nemo-24.12", "fp8", *CURRENT)
    _, bare = _ctx("nemo-24.12", "fp8", *CURRENT, "layout.sequence_parallel=false")
    layers = plan.model.layers // plan.layout.pp
    expected = 2 * layers * ctx.time("all_reduce", 4, ctx.span("tp"))
    assert current_amax_s(ctx, layers) == pytest.approx(expected, rel=1e-12) and expected > 0
    costs = stage_costs(ctx, {False: _layer(plan, ctx)})
    assert costs[("F", 0)].dp == pytest.approx(expected, rel=1e-12)
    assert current_amax_s(ctx, layers, moe_layers=layers) == pytest.approx(expected / 2, rel=1e-12)
    assert current_amax_s(bare, layers) == 0.0
    for extra in (["training.dtype=bf16"], ["stack.overrides.fp8_scaling=tensor"]):
        _, other = _ctx("nemo-24.12", "fp8", *CURRENT, *extra)
        assert current_amax_s(other, layers) == 0.0


def test_an_moe_layer_pays_its_router_and_permutations_a_dense_layer_does_not() -> None:
    plan, ctx = _ctx("nemo-24.12", "bf16", "layout.ep=2", preset="cpu-tiny-moe")
    _, bare = _ctx("nemo-24.12", "bf16", "layout.ep=2", "stack.overrides.moe_kernels=[]", preset="cpu-tiny-moe")
    shape = shape_of(ctx)
    sizes = tensor_sizes(plan.model, shape, True)
    # each tp rank routes its own sequence shard: top_k copies of h/tp per token of the microbatch
    assert sizes["routed"] == pytest.approx(plan.model.top_k * plan.model.hidden / 4 * routed_load(plan.model))
    expected = sum(
        ctx.device.elementwise_s(kernel_bytes(k, sizes, shape, ctx.stack), k.kernels) for k in ctx.stack.moe_kernels
    )
    assert _layer(plan, ctx, moe=True).forward_s - _layer(plan, bare, moe=True).forward_s == pytest.approx(expected)
    assert _layer(plan, ctx).forward_s == pytest.approx(_layer(plan, bare).forward_s, rel=1e-12)


def test_a_rank_with_several_experts_sorts_their_tokens_and_concatenates_their_outputs() -> None:
    """Megatron-Core core_v0.10.0 sorts the tokens it gathered by local expert and back (two split-and-cat copies),
    and SequentialMLP concatenates its experts' outputs (a third); each backward is one copy more. The rows are
    the routed copies gathered over tp (top_k · hidden a token at the busiest rank's load). One expert per rank
    (ep = experts) copies nothing."""
    several = [k.name for k in loader.load_stack("nemo-24.12").moe_kernels if k.several_local_experts]
    assert several == ["sort_by_local_expert", "sequential_mlp_concat"]
    for ep, experts_local in ((2, 4), (8, 1)):
        plan, ctx = _ctx("nemo-24.12", "bf16", f"layout.ep={ep}", "layout.dp=8", preset="cpu-tiny-moe")
        kept = [k.model_dump() for k in ctx.stack.moe_kernels if not k.several_local_experts]
        _, bare = _ctx("nemo-24.12", "bf16", f"layout.ep={ep}", "layout.dp=8",
                       f"stack.overrides.moe_kernels={json.dumps(kept)}", preset="cpu-tiny-moe")  # fmt: skip
        shape = shape_of(ctx)
        assert shape.experts_local == experts_local
        m = plan.model
        rows = shape.tokens * m.top_k * routed_load(m) * m.hidden * 2  # bytes of the experts' input, gathered
        copies = ctx.device.elementwise_s(2 * 2 * rows, 2) + ctx.device.elementwise_s(2 * rows, 1)
        expected = copies if experts_local > 1 else 0.0
        cost, without = _layer(plan, ctx, moe=True), _layer(plan, bare, moe=True)
        assert cost.forward_s - without.forward_s == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert cost.backward_input_s - without.backward_input_s == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_an_fp8_gemm_reads_one_byte_operands_and_writes_a_16_bit_product() -> None:
    """The roofline of a skinny (memory-bound) fp8 GEMM: fp8 operands, the product written in bf16 (Transformer
    Engine 1.x), plus the fixed cost per GEMM — at the H100's fitted GEMM bandwidth and fixed cost, and on an A100
    (no fitted table) at the memory-bound kernels' bandwidth plus the per-kernel cost."""
    cluster = loader.load_cluster("dgx-h100-superpod")
    fp8, bf16 = Device.of(cluster, "fp8", 8), Device.of(cluster, "bf16", 8)
    m, n, k = 16, 8192, 8192
    assert fp8.gemm_Bps == cluster.compute.gemm_bandwidth_GBps * 1e9 and fp8.gemm_fixed_s > 0
    assert fp8.gemm_s(m, n, k) == pytest.approx((m * k + k * n + 2 * m * n) / fp8.gemm_Bps + fp8.gemm_fixed_s)
    assert bf16.gemm_s(m, n, k) == pytest.approx(2 * (m * k + k * n + m * n) / bf16.gemm_Bps + bf16.gemm_fixed_s)
    a100 = Device.of(loader.load_cluster("dgx-a100-superpod"), "bf16", 8)
    assert a100.gemm_fixed_s == 0
    assert a100.gemm_s(m, n, k) == pytest.approx(2 * (m * k + k * n + m * n) / a100.memory_Bps + a100.kernel_s)


def test_block_scaled_fp8_gemms_run_at_their_own_fraction() -> None:
    cluster = loader.load_cluster("dgx-h100-superpod")
    tensor = Device.of(cluster, "fp8", 8)
    block = Device.of(cluster, "fp8", 8, fp8_scaling="block")
    assert tensor.gemm_fraction == cluster.compute.gemm_peak_fraction["fp8"]
    assert block.gemm_fraction == cluster.compute.fp8_block_gemm_fraction < tensor.gemm_fraction
    assert (
        Device.of(cluster, "bf16", 8, fp8_scaling="block").gemm_fraction == cluster.compute.gemm_peak_fraction["bf16"]
    )
    assert tensor.sixteen_bit().gemm_s(4096, 4096, 4096) == pytest.approx(
        Device.of(cluster, "bf16", 8).gemm_s(4096, 4096, 4096)
    )


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_without_wgrad_fusion_each_microbatch_adds_every_weight_gradient_to_its_buffer(dtype: str) -> None:
    """Stack.wgrad_accumulation_fusion false: beside its GEMMs, a layer's weight-gradient pass adds each weight's
    fresh 16-bit gradient to the buffer (read 2 and the buffer's bytes, write the buffer's), one streaming kernel
    per weight tensor; nothing else moves."""
    plan, fused = _ctx("nemo-24.12", dtype)
    _, apart = _ctx("nemo-24.12", dtype, "stack.overrides.wgrad_accumulation_fusion=false")
    gemms = weight_gemms(plan.model, shape_of(fused), False)
    weights = sum(n * k * b for name in GEMMS for _, n, k, b in gemms[name])
    gb = fused.grad_bytes
    expected = fused.device.memory_s(weights * (2 + 2 * gb), len(GEMMS))
    a, b = _layer(plan, apart), _layer(plan, fused)
    assert a.backward_weight_s - b.backward_weight_s == pytest.approx(expected, rel=1e-9)
    assert (a.forward_s, a.backward_input_s) == pytest.approx((b.forward_s, b.backward_input_s), rel=1e-12)
    # DeepSpeed's BF16_Optimizer upcasts each gradient into a temporary of the buffer's dtype before the add: a
    # second kernel per tensor, and the buffer's bytes written and read once more
    _, upcast = _ctx(
        "nemo-24.12",
        dtype,
        "stack.overrides.wgrad_accumulation_fusion=false",
        "stack.overrides.grad_accumulation_upcast=true",
    )
    c = _layer(plan, upcast)
    assert c.backward_weight_s - a.backward_weight_s == pytest.approx(
        fused.device.memory_s(weights * 2 * gb, len(GEMMS)), rel=1e-9
    )
