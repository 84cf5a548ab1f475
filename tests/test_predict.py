"""The step prediction end to end: its contract, closed forms through the whole model, published runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from plan import loader
from plan.schema import Plan
from twin import api
from twin.cli.app import app
from twin.step.comm_costs import (
    dp_costs,
    dp_reduction,
    layer_comm,
    overlapped,
    tied_embedding_s,
    tp_comm,
    zero3_layer_exposed,
)
from twin.step.context import StepContext, shape_of, step_context
from twin.step.ends import embedding_cost, head_cost
from twin.step.kernels import PassCost, layer_cost, sm_margin
from twin.step.memory import layer_params
from twin.step.predict import PredictOptions, predict, straggler_factor

BREAKDOWN = {
    "compute",
    "recompute",
    "tp_comm",
    "cp_comm",
    "ep_comm",
    "pp_comm",
    "dp_comm_exposed",
    "bubble",
    "optimizer",
}
MEMORY = {"params", "grads", "optimizer", "activations", "peak"}


@pytest.fixture(scope="module")
def reference() -> dict:
    return predict(loader.load("reference-100k")).to_json()


@pytest.mark.parametrize("name", loader.plan_presets())
def test_every_preset_predicts_and_accounts_for_its_step(name: str) -> None:
    result = predict(loader.load(name))
    assert result.step_time_s > 0 and 0 < result.mfu < 1 and 0 <= result.bubble_fraction < 1
    assert sum(result.breakdown_s.values()) == pytest.approx(result.step_time_s, rel=1e-9)
    assert result.tokens_per_s * result.step_time_s == pytest.approx(loader.load(name).tokens_per_step)


def test_json_carries_the_contract(reference: dict) -> None:
    for key in (
        "step_time_s",
        "tokens_per_s",
        "mfu",
        "hfu",
        "tflops_per_gpu",
        "bubble_fraction",
        "memory",
        "fits",
        "breakdown_s",
        "days_to_train",
        "gpu_hours",
    ):
        assert key in reference
    assert set(reference["breakdown_s"]) >= BREAKDOWN and set(reference["memory"]) >= MEMORY


def test_reference_sits_in_the_seeds_mfu_band_and_fits(reference: dict) -> None:
    assert 0.35 <= reference["mfu"] <= 0.55  # the seeds' 35-55% band for 10k-100k GPUs
    assert reference["fits"]


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16), (8, 32)])
def test_free_comm_bubble_through_the_whole_model(p: int, m: int) -> None:
    plan = loader.load(
        "llama3-405b-16k",
        [
            "model=llama3-8b",
            "model.vocab=1024",
            "layout.tp=1",
            f"layout.pp={p}",
            "layout.dp=1",
            "layout.schedule=1f1b",
            "layout.virtual_stages=1",
            "layout.zero=0",
            "layout.edge_stage_trim=0",
            f"training.global_batch={m}",
            "reliability.hot_spares=0",
        ],
    )
    result = predict(plan, options=PredictOptions(free_comm=True, stragglers=False))
    # the embedding and a 1k-vocab head barely unbalance the stages
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=0.03)


def test_straggler_factor_is_the_median_of_the_slowest_of_n() -> None:
    cluster = loader.load_cluster("dgx-h100-superpod")
    sigma, n = cluster.stragglers.jitter_cv, 1000
    rng = np.random.default_rng(7)
    slowest = np.exp(sigma * rng.standard_normal((4000, n))).max(axis=1)
    assert straggler_factor(cluster, n) == pytest.approx(float(np.median(slowest)), rel=0.002)
    assert straggler_factor(cluster, 1) == 1.0
    assert straggler_factor(cluster, 100_000) > straggler_factor(cluster, 1000) > 1.0


def test_predict_cli_json_and_trace(tmp_path: Path) -> None:
    trace = tmp_path / "step.json"
    out = CliRunner().invoke(app, ["predict", "cpu-tiny", "--json", "--trace", str(trace)])
    assert out.exit_code == 0, out.output
    obj = json.loads(out.stdout)
    assert obj["plan"] == "cpu-tiny" and "timeline" not in obj
    events = json.loads(trace.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    plan = loader.load("cpu-tiny")
    actions = [e for e in slices if e["cat"] in ("forward", "backward")]
    assert len(actions) == 2 * plan.num_microbatches * plan.layout.num_stages
    assert {e["tid"] for e in actions} == {2 * r for r in range(plan.layout.pp)}  # each rank's action lane
    assert {e["tid"] for e in slices} == set(range(2 * plan.layout.pp))  # and its communication lane


@pytest.mark.parametrize("preset", ["deepseek-v3-2k", "llama3-405b-16k", "reference-100k"])
def test_the_timeline_holds_the_whole_step_and_its_communication(preset: str) -> None:
    """The trace ends where the step does (the DeepSeek preset's stopped at 6.08 of 6.60 s), with each rank's
    exposed communication, barrier and optimizer, and interleaved chunks told apart."""
    pred = api.predict(preset, PredictOptions(every_microbatch=True))
    assert max(s["end_s"] for s in pred.timeline) == pytest.approx(pred.step_time_s, rel=1e-12)
    kinds = {s["kind"] for s in pred.timeline}
    assert {"barrier", "optimizer", "DP"} <= kinds
    plan = api.load_plan(preset)
    assert ("EP" in kinds) == (plan.layout.ep > 1) and ("TP" in kinds) == (plan.layout.tp > 1)
    chunks = {s["chunk"] for s in pred.timeline if s["kind"] == "F"}
    assert chunks == set(range(plan.layout.virtual_stages))
    comm = {k: sum(s["end_s"] - s["start_s"] for s in pred.timeline if s["kind"] == k and s["rank"] == 0)
            for k in ("TP", "EP")}  # fmt: skip
    ranks = pred.stage_phases_s[0]
    assert comm["TP"] == pytest.approx(ranks["comm_tp"], rel=1e-9, abs=1e-12)
    assert comm["EP"] == pytest.approx(ranks["comm_ep"], rel=1e-9, abs=1e-12)


def test_predict_cli_rejects_a_bad_layout_in_one_line() -> None:
    out = CliRunner().invoke(app, ["predict", "cpu-tiny", "--set", "layout.pp=3"])
    assert out.exit_code == 2 and "Traceback" not in out.output
    assert len([line for line in out.stderr.splitlines() if line.strip()]) == 1


@pytest.mark.parametrize("fused,extra", [(True, 0), (False, 3)])
def test_tp_collectives_per_microbatch_are_counted(fused: bool, extra: int) -> None:
    """Without pipelining, exposed TP time is microbatches x (two all-reduces per layer each way, the unfused
    projections' extra backward ones, and one each way at the model's edges: the embedding's partial sums forward,
    the head input's gradient backward) x one all-reduce of the activation stream."""
    plan = loader.load(
        "gpt-1b-h100",
        ["cluster=dgx-h100-superpod", "layout.tp=8", "layout.pp=1", "layout.dp=1", "layout.zero=0",
         "layout.sequence_parallel=false",
         f"layout.fused_projections={str(fused).lower()}", "layout.recompute=none"],
    )  # fmt: skip
    result = predict(plan, options=PredictOptions(stragglers=False))
    one = result.collectives["tp"]["seconds"]
    per_microbatch = plan.model.layers * (2 + 2 + extra) + 1 + 1
    assert result.breakdown_s["tp_comm"] == pytest.approx(plan.num_microbatches * per_microbatch * one, rel=1e-9)


@pytest.mark.parametrize("stack,moe_blocks", [("executor", 1), ("megatron-core-0.8", 2)])
def test_an_moe_layer_run_whole_on_each_tp_rank_has_only_its_attention_collectives(stack: str, moe_blocks: int) -> None:
    """The executor runs an MoE MLP whole on every tp rank (Stack.moe_tensor_parallel false): its layers all-reduce
    around attention only, and of the unfused projections only Q, K and V add backward all-reduces; Megatron splits
    the experts over tp and pays for the MLP block as a dense layer does."""
    plan = loader.load(
        "cpu-tiny-moe",
        ["cluster=dgx-h100-superpod", f"stack={stack}", "layout.tp=2", "layout.pp=1", "layout.dp=2", "layout.ep=2",
         "layout.sequence_parallel=false", "layout.fused_projections=false", "stack.overrides.tp_overlap=none"],
    )  # fmt: skip
    result = predict(plan, options=PredictOptions(stragglers=False))
    one = result.collectives["tp"]["seconds"]
    m = plan.model
    moe_layers = m.layers - m.dense_layers
    per_microbatch = m.dense_layers * (2 + 2 + 3) + moe_layers * (2 * moe_blocks + 2 + moe_blocks - 1) + 1 + 1
    assert result.breakdown_s["tp_comm"] == pytest.approx(plan.num_microbatches * per_microbatch * one, rel=1e-9)


@pytest.mark.parametrize("dtype,stack,widths", [("bf16", "nemo-24.12", (2, 2)), ("fp8", "nemo-24.12", (2, 2)),
                                                ("fp8", "deepseek-v3", (1, 2))])  # fmt: skip
def test_an_sp_split_moe_layer_routes_its_own_shard_and_gathers_the_routed_copies_over_tp(
    dtype: str, stack: str, widths: tuple[int, int]
) -> None:
    """Megatron-Core's all-to-all dispatcher under sequence parallelism: each tp rank dispatches and combines its
    own s/tp tokens' top_k copies over ep (16-bit under fp8 unless the stack dispatches fp8, DeepSeek-V3 §3.3.2),
    then all-gathers the copies it received over tp before the experts and reduce-scatters them after, exposed; the
    attention block keeps its own gather and scatter."""
    overrides = ["cluster=dgx-h100-superpod", f"stack={stack}", "layout.tp=4", "layout.pp=1", "layout.dp=8",
                 "layout.ep=8", "layout.sequence_parallel=true", "layout.fused_projections=true",
                 "stack.overrides.tp_overlap=none", "stack.overrides.sp_regather_input=false",
                 "stack.overrides.ep_dispatch=all-to-all", f"training.dtype={dtype}"]  # fmt: skip
    plan = loader.load("cpu-tiny-moe", overrides)
    ctx = step_context(plan, loader.plan_cluster(plan), PredictOptions(stragglers=False))
    cost = layer_cost(plan.model, shape_of(ctx), ctx.device, ctx.stack, True, plan.layout.recompute)
    m, tokens = plan.model, plan.layout.microbatch_size * plan.model.seq_len
    a2a = sum(ctx.time("all_to_all", tokens / 4 * m.top_k * m.hidden * w, ctx.span("ep")) for w in widths)
    assert layer_comm(ctx, cost, moe=True)["ep"] == pytest.approx((a2a, a2a), rel=1e-12)
    gathered, reduced = tokens * m.hidden * ctx.gather_bytes, tokens * m.hidden * ctx.comm_bytes
    copies = tokens * m.top_k * m.hidden * 2
    blocks = 1 + m.shared_experts  # the attention block's and the shared expert's own gather and scatter
    tp = ctx.span("tp")
    own = blocks * (ctx.time("all_gather", gathered, tp) + ctx.time("reduce_scatter", reduced, tp))
    routed = ctx.time("all_gather", copies, ctx.span("tp")) + ctx.time("reduce_scatter", copies, ctx.span("tp"))
    assert tp_comm(ctx, cost, moe=True) == pytest.approx((own + routed, own + routed), rel=1e-12)


def test_the_executor_routes_its_own_sp_shard_to_whole_experts_and_gathers_nothing_over_tp() -> None:
    """The executor under sequence parallelism: each tp rank routes its own s/tp tokens (executor/moe.py
    SequenceShare) to experts that run whole on it, so the all-to-all moves a tp-th of the tokens and the MoE layer
    has no tensor-parallel collective; the attention block keeps its gather and its scatter."""
    base = ["cluster=localhost-cpu", "layout.tp=2", "layout.pp=1", "layout.dp=2", "layout.ep=2"]
    whole, shard = (loader.load("cpu-tiny-moe", [*base, f"layout.sequence_parallel={sp}"]) for sp in ("false", "true"))
    m, tokens = shard.model, shard.layout.microbatch_size * shard.model.seq_len
    for plan, routed in ((whole, tokens), (shard, tokens / 2)):
        ctx = step_context(plan, loader.plan_cluster(plan), PredictOptions(stragglers=False))
        cost = layer_cost(plan.model, shape_of(ctx), ctx.device, ctx.stack, True, plan.layout.recompute)
        a2a = sum(ctx.time("all_to_all", routed * m.top_k * m.hidden * w, ctx.span("ep")) for w in ctx.ep_bytes)
        assert layer_comm(ctx, cost, moe=True)["ep"] == pytest.approx((a2a, a2a), rel=1e-12)
    ctx = step_context(shard, loader.plan_cluster(shard), PredictOptions(stragglers=False))
    cost = layer_cost(m, shape_of(ctx), ctx.device, ctx.stack, True, shard.layout.recompute)
    tp = ctx.span("tp")
    own = ctx.time("all_gather", tokens * m.hidden * ctx.gather_bytes, tp)
    own += ctx.time("reduce_scatter", tokens * m.hidden * ctx.comm_bytes, tp)
    fwd, _ = tp_comm(ctx, cost, moe=True)
    assert fwd == pytest.approx(own, rel=1e-12)  # one block's pair, no routed copies gathered


@pytest.mark.parametrize("stack,grad_bytes", [("megatron-core-0.8", 4), ("nemo-24.12", 2)])
def test_the_embeddings_backward_moves_its_whole_vocabulary_shards_dense_gradient(stack: str, grad_bytes: int) -> None:
    """PyTorch's embedding backward writes a dense gradient of the rank's whole vocabulary shard (zero-filled, then
    the tokens' rows scattered in), which is then added to the buffer gradients accumulate in: fp32 under
    Megatron-Core's defaults, bf16 where NeMo's recipes reduce in bf16. Closed form, on the first stage's W."""
    plan = loader.load("gpt3-175b-1k", [f"stack={stack}"])
    ctx = step_context(plan, loader.plan_cluster(plan), PredictOptions())
    shape, m, dev = shape_of(ctx), plan.model, ctx.device
    assert ctx.grad_bytes == grad_bytes
    cost = embedding_cost(m, shape, dev, ctx.grad_bytes, upcast=False)
    rows = 3 * shape.tokens * m.hidden * 2  # the tokens' gradient rows: read, read, write
    dense = m.vocab / plan.layout.tp * m.hidden * (2 + 2 + 2 * grad_bytes)  # zero-fill; read it; read-add-write
    assert cost.backward_weight_s == pytest.approx((rows + dense) / dev.elementwise_Bps + 3 * dev.kernel_s)
    wider = plan.model.model_copy(update={"vocab": 2 * m.vocab})
    grown = embedding_cost(wider, shape, dev, ctx.grad_bytes, upcast=False).backward_weight_s - cost.backward_weight_s
    assert grown == pytest.approx(dense / dev.elementwise_Bps)


def test_without_wgrad_fusion_the_heads_and_embeddings_gradients_are_added_like_a_layers() -> None:
    """Stack.wgrad_accumulation_fusion false: the output head's fresh weight gradient (vocab shard x hidden) is added
    to the buffer each microbatch, 2 + 2 x grad_bytes bytes a weight in one kernel, and with
    Stack.grad_accumulation_upcast (DeepSpeed's BF16_Optimizer) its temporary adds 2 x grad_bytes and a kernel; the
    embedding's dense gradient pays the same temporary."""
    over = ["stack=megatron-deepspeed-2022", "training.dtype=bf16"]
    fused, apart, upcast = (
        loader.load("gpt3-175b-1k", [*over, *extra])
        for extra in (
            ["stack.overrides.wgrad_accumulation_fusion=true", "stack.overrides.grad_accumulation_upcast=false"],
            ["stack.overrides.grad_accumulation_upcast=false"],
            [],
        )
    )
    heads, embeddings = [], []
    for plan in (fused, apart, upcast):
        ctx = step_context(plan, loader.plan_cluster(plan), PredictOptions())
        shape = shape_of(ctx)
        heads.append(head_cost(plan.model, shape, ctx.device, ctx.stack))
        embeddings.append(
            embedding_cost(plan.model, shape, ctx.device, ctx.grad_bytes, ctx.stack.grad_accumulation_upcast)
        )
    m, dev, gb = fused.model, ctx.device, ctx.grad_bytes
    weights = m.vocab / fused.layout.tp * m.hidden
    assert gb == 4 and not ctx.stack.wgrad_accumulation_fusion
    assert heads[1].backward_weight_s - heads[0].backward_weight_s == pytest.approx(
        dev.memory_s(weights * (2 + 2 * gb), 1), rel=1e-9
    )
    assert heads[2].backward_weight_s - heads[1].backward_weight_s == pytest.approx(
        dev.memory_s(weights * 2 * gb, 1), rel=1e-9
    )
    assert heads[2].forward_s == heads[0].forward_s and heads[2].backward_input_s == heads[0].backward_input_s
    assert embeddings[1].backward_weight_s == embeddings[0].backward_weight_s
    assert embeddings[2].backward_weight_s - embeddings[1].backward_weight_s == pytest.approx(
        weights * 2 * gb / dev.elementwise_Bps + dev.kernel_s, rel=1e-9
    )


def _userbuffers_ctx(overrides: list[str]) -> tuple[StepContext, PassCost]:
    plan = loader.load(
        "gpt-1b-h100",
        ["cluster=dgx-h100-superpod", "stack=nemo-24.12", "layout.tp=8", "layout.pp=1", "layout.dp=1",
         "layout.zero=0", "layout.sequence_parallel=true", "layout.recompute=none", *overrides],
    )  # fmt: skip
    ctx = step_context(plan, loader.plan_cluster(plan), PredictOptions(stragglers=False))
    return ctx, layer_cost(plan.model, shape_of(ctx), ctx.device, ctx.stack, False, plan.layout.recompute)


def test_an_sm_margin_runs_the_row_parallel_forward_gemms_on_the_other_sms() -> None:
    """Transformer Engine's set_sm_margin keeps SMs from proj's and fc2's forward GEMMs for the whole GEMM: with a
    margin of 24 on fc2 alone, the layer's forward grows by exactly fc2's GEMM on 132 - 24 SMs at their share of
    the peak less fc2's GEMM on all 132; the gradient GEMMs keep every SM."""
    none, with_margin = (
        _userbuffers_ctx([f"stack.overrides.tp_overlap_sm_margin={margin}"]) for margin in ("{}", "{fc2: 24}")
    )
    ctx, base = none
    m, tokens = ctx.plan.model, ctx.plan.layout.microbatch_size * ctx.plan.model.seq_len
    mm, nn, kk = tokens, m.hidden, m.ffn_hidden // 8  # fc2 on one of 8 tp ranks
    d = ctx.device
    fewer = d.without_sms(24)
    assert fewer.sm_count == d.sm_count - 24
    assert fewer.peak_flops == pytest.approx(d.peak_flops * (d.sm_count - 24) / d.sm_count, rel=1e-12)
    grown = with_margin[1].forward_s - base.forward_s
    assert grown == pytest.approx(fewer.gemm_s(mm, nn, kk) - d.gemm_s(mm, nn, kk), rel=1e-9)
    assert grown > 0
    assert with_margin[1].gemm_s == base.gemm_s  # input- and weight-gradient GEMMs unchanged
    # without tensor parallelism there is no pipelined reduce-scatter to keep SMs for
    solo = []
    for margin in ("{}", "{fc2: 24}"):
        plan = loader.load("gpt-1b-h100", ["cluster=dgx-h100-superpod", "stack=nemo-24.12", "layout.tp=1",
                                           f"stack.overrides.tp_overlap_sm_margin={margin}"])  # fmt: skip
        c = step_context(plan, loader.plan_cluster(plan), PredictOptions(stragglers=False))
        solo.append(layer_cost(plan.model, shape_of(c), c.device, c.stack, False, "none").forward_s)
    assert solo[0] == solo[1]


def test_only_sm_driven_tp_collectives_take_sms_from_the_gemms_beside_them() -> None:
    """Under userbuffers the all-gathers under a GEMM go over the copy engines (ring_exchange) and the forward
    reduce-scatters of margined GEMMs run on SMs withheld for them: what the collectives take from the GEMMs beside
    them is, forward, the hidden time's reduce-scatter share (none where both row-parallel GEMMs are margined) and,
    backward, its re-gather and reduce-scatter share, each at tp_overlap_sms of the SMs."""
    for margin in ("{proj: 24, fc2: 16}", "{}"):
        base, taken = (
            _userbuffers_ctx([f"stack.overrides.tp_overlap_sm_margin={margin}", f"stack.overrides.tp_overlap_sms={n}"])
            for n in (0, 16)
        )
        ctx, cost = base
        m, tp = ctx.plan.model, ctx.span("tp")
        elements = ctx.plan.layout.microbatch_size * m.seq_len * m.hidden
        ag = 2 * ctx.time("all_gather", elements * ctx.gather_bytes, tp)
        rs_out = 2 * ctx.time("reduce_scatter", elements * ctx.reduce_bytes, tp)
        rs = 2 * ctx.time("reduce_scatter", elements * ctx.comm_bytes, tp)
        chunks, sms = ctx.stack.tp_overlap_chunks, ctx.cluster.accelerator.sm_count
        fwd_hidden = ag + rs_out - overlapped(ag + rs_out, cost.forward_gemm_s, chunks)
        dgrad, wgrad = cost.gemm_s
        bwd_hidden = 2 * ag + rs - overlapped(2 * ag, dgrad, chunks) - overlapped(rs, wgrad, chunks)
        (f0, b0), (f16, b16) = tp_comm(*base), tp_comm(*taken)
        forward_share = 0.0 if margin != "{}" else rs_out / (ag + rs_out)
        assert f16 - f0 == pytest.approx(fwd_hidden * forward_share * 16 / sms, rel=1e-9, abs=1e-15)
        assert b16 - b0 == pytest.approx(bwd_hidden * (ag + rs) / (2 * ag + rs) * 16 / sms, rel=1e-9)
        assert b16 > b0
    # without sequence parallelism there is nothing pipelined to keep SMs for
    plain, margined = (
        _userbuffers_ctx(["layout.sequence_parallel=false", f"stack.overrides.tp_overlap_sm_margin={margin}"])
        for margin in ("{}", "{fc2: 24}")
    )
    assert plain[1].forward_s == margined[1].forward_s


def test_an_sm_margin_is_for_the_row_parallel_gemms_only() -> None:
    """A margin names proj or fc2 and leaves the GEMM some SMs; an MoE layer's expert GEMMs (outside userbuffers)
    keep them all."""
    with pytest.raises(loader.PlanError, match="proj and fc2"):
        loader.load("gpt-1b-h100", ["stack=nemo-24.12", "stack.overrides.tp_overlap_sm_margin={qkv: 8}"])
    ctx, _ = _userbuffers_ctx([])
    with pytest.raises(loader.PlanError, match="tp_overlap_sm_margin withholds 132 of the accelerator's 132"):
        ctx.device.without_sms(132)
    moe = loader.load(
        "cpu-tiny-moe",
        [
            "cluster=dgx-h100-superpod",
            "stack=nemo-24.12",
            "layout.tp=2",
            "layout.pp=1",
            "layout.dp=4",
            "layout.ep=2",
            "layout.sequence_parallel=true",
        ],
    )
    c = step_context(moe, loader.plan_cluster(moe), PredictOptions(stragglers=False))
    shape = shape_of(c)
    assert sm_margin(c.stack, shape, "fc2", moe=False) == 16 and sm_margin(c.stack, shape, "proj", moe=True) == 24
    assert sm_margin(c.stack, shape, "fc2", moe=True) == 0


def test_a_post_backward_prefetch_waits_for_every_layers_gather() -> None:
    """FSDP's BACKWARD_POST issues a layer's backward all-gather only once the layer after it has its gradients, so
    the backward waits for the whole gather (and for what of the reduce-scatter outlasts the layer's backward);
    BACKWARD_PRE hides the gather behind that backward too. The forward is the same."""
    exposed = {}
    for prefetch in ("pre", "post"):
        plan = loader.load(
            "gpt-1b-h100",
            ["cluster=dgx-h100-superpod", "layout.tp=1", "layout.pp=1", "layout.dp=8", "layout.zero=3",
             "layout.microbatch_size=1", "training.global_batch=8",
             f"stack.overrides.fsdp_backward_prefetch={prefetch}"],
        )  # fmt: skip
        ctx = step_context(plan, loader.plan_cluster(plan), PredictOptions(stragglers=False))
        cost = layer_cost(plan.model, shape_of(ctx), ctx.device, ctx.stack, False, plan.layout.recompute)
        exposed[prefetch] = zero3_layer_exposed(ctx, 0, cost)
    params = layer_params(plan, 0).dense
    dp = ctx.span("dp", "cp")
    gather = ctx.time("all_gather", ctx.param_bytes * params, dp)
    scatter = ctx.time("reduce_scatter", ctx.grad_bytes * params, dp)
    backward = cost.backward_input_s + cost.backward_weight_s
    assert exposed["post"][1] == pytest.approx(gather + max(0.0, scatter - backward), rel=1e-12)
    assert exposed["pre"][1] == pytest.approx(max(0.0, gather + scatter - backward), rel=1e-12)
    assert exposed["post"][1] > exposed["pre"][1]
    assert exposed["post"][0] == exposed["pre"][0]


def _runs_plan(runs: int, batch: int) -> Plan:
    """GPT-3 175B on 256 H100 at TP8 PP4 (1F1B), gradients all-reduced (no ZeRO, so no parameter gather after the
    optimizer), its embeddings untied (so no all-reduce between the first and last stage, which runs once a step),
    `batch` sequences a step."""
    return loader.load(
        "gpt3-175b-1k",
        [f"layout.schedule_runs={runs}", f"training.global_batch={batch}", "layout.schedule=1f1b",
         "layout.virtual_stages=1", "layout.pp=4", "layout.dp=8", "layout.zero=0", "model.tied_embeddings=false"],
    )  # fmt: skip


def test_schedule_runs_pay_each_runs_fill_drain_and_reduction_and_step_the_optimizer_once() -> None:
    from twin.step.costs import NORM_REDUCTION_BYTES

    options = PredictOptions(stragglers=False)
    one, two, half = (predict(_runs_plan(r, b), options=options) for r, b in ((1, 256), (2, 256), (1, 128)))
    plan = _runs_plan(1, 128)
    ctx = step_context(plan, loader.plan_cluster(plan), options)
    barrier = ctx.time("all_reduce", NORM_REDUCTION_BYTES, ctx.span("dp", "pp", "cp", "tp"))
    # the same work as one schedule over every microbatch
    assert two.num_microbatches == one.num_microbatches == 2 * half.num_microbatches
    assert two.breakdown_s["compute"] == pytest.approx(one.breakdown_s["compute"], rel=1e-9)
    # two half-batch schedules back to back: each one's fill, drain and exposed reduction, one optimizer step
    assert two.step_time_s == pytest.approx(2 * half.step_time_s - half.breakdown_s["optimizer"] - barrier, rel=1e-9)
    assert two.breakdown_s["dp_comm_exposed"] == pytest.approx(2 * half.breakdown_s["dp_comm_exposed"], rel=1e-9)
    assert two.breakdown_s["bubble"] == pytest.approx(2 * half.breakdown_s["bubble"] - barrier, rel=1e-9)
    assert two.breakdown_s["optimizer"] == pytest.approx(one.breakdown_s["optimizer"], rel=1e-9)
    assert sum(two.breakdown_s.values()) == pytest.approx(two.step_time_s, rel=1e-9)
    # so a step loses one more pipeline fill and drain than a single schedule does
    assert two.breakdown_s["bubble"] > one.breakdown_s["bubble"] and two.step_time_s > one.step_time_s
    # every rank's phases add up to the step (each waits once for the slowest optimizer, not once a run)
    assert all(sum(p.values()) == pytest.approx(two.step_time_s, rel=1e-9) for p in two.stage_phases_s)
    # and the timeline, one run and the step's end, says so
    assert any("first of the step's 2 schedule runs" in n for n in two.notes) and not one.notes


def test_a_schedule_runs_timeline_ends_with_the_step_and_the_search_bound_stays_below_it() -> None:
    from twin.search.evaluate import Bounds
    from twin.search.space import neutral

    plan = _runs_plan(2, 256)
    pred = predict(plan, options=PredictOptions(stragglers=False, every_microbatch=True))
    assert pred.microbatches_simulated == plan.schedule_microbatches == 16
    ends = {s["rank"]: 0.0 for s in pred.timeline}
    for s in pred.timeline:
        ends[s["rank"]] = max(ends[s["rank"]], s["end_s"])
    assert max(ends.values()) == pytest.approx(pred.step_time_s, rel=1e-9)
    runs = [s for s in pred.timeline if s["kind"] == "runs"]  # the second run, one span a rank, before the step end
    assert sorted(s["rank"] for s in runs) == list(range(plan.layout.pp))
    assert all(s["end_s"] <= next(t["start_s"] for t in pred.timeline if t["rank"] == s["rank"] and t["kind"] ==
               "optimizer") for s in runs)  # fmt: skip
    data = plan.model_dump(mode="json")
    probe = loader.validate_plan(neutral(data))
    bound = Bounds(data, loader.plan_cluster(probe), loader.plan_stack(probe)).pipeline_s(plan)
    single = Bounds(data, loader.plan_cluster(probe), loader.plan_stack(probe)).pipeline_s(_runs_plan(1, 256))
    assert single < bound <= predict(plan).step_time_s * (1 + 1e-9)  # both with the straggler term


def test_schedule_runs_must_divide_the_microbatches_and_the_executor_rejects_them() -> None:
    from executor.parallel import LayoutError, check_supported

    with pytest.raises(ValueError, match="schedule_runs: 3 does not divide the 32 microbatches"):
        _runs_plan(3, 256)
    with pytest.raises(LayoutError, match="schedule_runs: 2: running the pipeline schedule several times"):
        check_supported(_runs_plan(2, 256))


def test_a_tied_embeddings_gradient_is_all_reduced_between_the_first_and_last_stage_after_the_flush() -> None:
    """Megatron's _allreduce_embedding_grads and DeepSpeed's ReduceTiedGrads: the ranks holding the first stage
    (input embedding) and the last (the output layer sharing it) all-reduce their vocabulary shard's gradient, in the
    gradient buffer's dtype, after the data-parallel reduction; no other rank does, and the two-rank all-reduce is
    the ring's 2(n-1)/n of the bytes over the pair's bus bandwidth. An untied model, or one stage, has none."""
    options = PredictOptions(stragglers=False)
    over = ["layout.dp=1", "layout.zero=0", "layout.pp=4", "layout.virtual_stages=1", "layout.schedule=1f1b"]
    tied, untied = (loader.load("gpt3-175b-1k", [*over, f"model.tied_embeddings={t}"]) for t in ("true", "false"))
    ctx = step_context(tied, loader.plan_cluster(tied), options)
    m, lay = tied.model, tied.layout
    seconds = tied_embedding_s(ctx)
    assert set(seconds) == {0, lay.num_stages - 1} and seconds[0] == seconds[lay.num_stages - 1] > 0
    ranks = ctx.grid.group_of(0, "pp")
    pair = ctx.fabric.span([ranks[0], ranks[lay.pp - 1]])
    nbytes = ctx.grad_bytes * m.vocab * m.hidden / lay.tp
    assert seconds[0] == pytest.approx(nbytes / pair.busbw_Bps, rel=0.02)  # 2(n-1)/n = 1, latency aside
    a, b = (predict(p, options=options).stage_phases_s for p in (tied, untied))
    grown = [x["comm_pp"] - y["comm_pp"] for x, y in zip(a, b, strict=True)]
    assert grown == pytest.approx([seconds[0], 0.0, 0.0, seconds[0]], rel=1e-9, abs=1e-12)
    assert tied_embedding_s(step_context(untied, loader.plan_cluster(untied), options)) == {}
    one = loader.load("gpt3-175b-1k", [*over, "layout.pp=1", "layout.tp=8", "layout.dp=8"])
    assert tied_embedding_s(step_context(one, loader.plan_cluster(one), options)) == {}
    # a V-shaped schedule holds the first and the last stage on one rank: nothing to all-reduce between them
    v_shaped = [*over, "layout.schedule=zbv", "layout.virtual_stages=2", "training.global_batch=64"]
    vee, vee_untied = (
        loader.load("gpt3-175b-1k", [*v_shaped, f"model.tied_embeddings={t}"]) for t in ("true", "false")
    )
    assert tied_embedding_s(step_context(vee, loader.plan_cluster(vee), options)) == {}
    a, b = (predict(p, options=options).stage_phases_s for p in (vee, vee_untied))
    assert [x["comm_pp"] for x in a] == pytest.approx([x["comm_pp"] for x in b], rel=1e-12, abs=1e-12)


def test_zero1s_gradients_reduce_as_the_stack_says() -> None:
    """Stack.zero_grad_reduce: DeepSpeed's BF16_Optimizer all-reduces the whole fp32 buffer where Megatron's
    distributed optimizer reduce-scatters it, twice the ring's bytes (2(n-1)/n against (n-1)/n); ZeRO-2
    reduce-scatters either way. Stack.grad_wire_dtype bf16 halves what the all-reduce moves."""

    def reduction(zero: int, *extra: str) -> tuple[float, str, int]:
        plan = loader.load("gpt3-175b-1k", ["stack=megatron-core-0.8", f"layout.zero={zero}", *extra])
        ctx = step_context(plan, loader.plan_cluster(plan), PredictOptions(stragglers=False))
        return (dp_costs(ctx)[0][0], *dp_reduction(ctx))

    scatter, op, wire = reduction(1)
    assert (op, wire) == ("reduce_scatter", 4)
    whole, op, _ = reduction(1, "stack.overrides.zero_grad_reduce=all-reduce")
    assert op == "all_reduce" and 1.8 < whole / scatter <= 2.0
    assert reduction(2, "stack.overrides.zero_grad_reduce=all-reduce")[:2] == (scatter, "reduce_scatter")
    bf16 = ("stack.overrides.zero_grad_reduce=all-reduce", "stack.overrides.grad_wire_dtype=bf16")
    half, op, wire = reduction(1, *bf16)
    assert (op, wire) == ("all_reduce", 2) and 1.8 < whole / half <= 2.0
