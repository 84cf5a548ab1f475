"""Memory per GPU: 16 bytes/param sharded as each ZeRO stage shards, activations by recompute policy, fits."""

from __future__ import annotations

import pytest

from plan import loader
from plan.errors import PlanError
from plan.model_math import param_count
from plan.stacks import load_stack
from twin.step.comm_costs import dp_costs
from twin.step.context import step_context
from twin.step.memory import (
    activation_bytes,
    layer_params,
    logits_bytes,
    rank_state_bytes,
    stage_params,
    transient_bytes,
)
from twin.step.predict import DEFAULT_OPTIONS, predict, rank_memories


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


def test_an_upcasting_optimizer_keeps_its_16_bit_gradients_and_a_temporary() -> None:
    """Stack.grad_accumulation_upcast (DeepSpeed's BF16_Optimizer): every parameter's bf16 gradient stays allocated
    beside the fp32 buffer, 2 bytes each, and the upcast's fp32 temporary of the largest tensor (the first stage's
    vocabulary shard) is a transient. A stack that upcasts without an add is refused."""
    over = ["stack=megatron-deepspeed-2022", "layout.zero=1", "layout.recompute=selective"]  # no layer rebuilt whole
    no_upcast = ["stack.overrides.grad_accumulation_upcast=false"]
    plan, plain = (loader.load("gpt3-175b-1k", [*over, *extra]) for extra in ([], no_upcast))
    first, bare = (rank_memories(p, loader.plan_cluster(p), loader.plan_stack(p))[0] for p in (plan, plain))
    m, lay = plan.model, plan.layout
    held = sum(p.dense + p.expert for p in (stage_params(plan, s) for s in (0, lay.pp)))  # rank 0's two chunks
    assert (first.grads - bare.grads) * 2**30 == pytest.approx(2 * held, rel=1e-9)
    temporary = 4 * m.vocab / lay.tp * m.hidden  # fp32, the vocabulary shard: larger than the bf16 dense gradient
    assert bare.transient * 2**30 < temporary and first.transient * 2**30 == pytest.approx(temporary, rel=1e-9)
    with pytest.raises(PlanError, match="grad_accumulation_upcast"):
        loader.load("gpt3-175b-1k", [*over, "stack.overrides.wgrad_accumulation_fusion=true"])


def test_zero2_gradients_build_up_whole_over_a_steps_microbatches() -> None:
    """ZeRO-2 reduce-scatters a step's gradients once (comm_costs.dp_costs), so over several microbatches they
    accumulate whole on every rank (FSDP's no_sync; Llama 3's fp32 accumulation) and are sharded only after; with
    one microbatch a step they are sharded as they are made. ZeRO-3's stay sharded either way."""
    common = ["model=llama3-8b", "layout.tp=1", "layout.pp=1", "layout.dp=8", "cluster=dgx-h100-superpod"]
    n = param_count(loader.load("cpu-tiny", common).model).total
    for zero, batch, held in ((2, 16, n / 8), (2, 32, n), (3, 32, n / 8)):
        plan = loader.load("cpu-tiny", [*common, f"layout.zero={zero}", f"training.global_batch={batch}"])
        assert (plan.num_microbatches > 1) == (batch == 32)
        assert rank_state_bytes(plan, [0])[1] == pytest.approx(2 * held), (zero, batch)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_context_parallel_ranks_share_the_zero_shards(zero: int) -> None:
    """Context-parallel ranks hold the same weights, so ZeRO shards over dp · cp (Megatron-Core's data-parallel
    group with context parallelism, the executor's dp·cp replica mesh): dp 2 · cp 4 holds what dp 8 holds."""
    common = ["model=llama3-8b", "layout.tp=1", "layout.pp=1", f"layout.zero={zero}", "cluster=dgx-h100-superpod"]
    flat = loader.load("cpu-tiny", [*common, "layout.dp=8", "training.global_batch=16"])
    with_cp = loader.load("cpu-tiny", [*common, "layout.dp=2", "layout.cp=4", "training.global_batch=4"])
    assert rank_state_bytes(with_cp, [0]) == pytest.approx(rank_state_bytes(flat, [0]))
    n = param_count(with_cp.model).total
    assert rank_state_bytes(with_cp, [0])[2] == pytest.approx(12 * n / 8)


def test_gradients_are_reduced_over_context_parallel_ranks_too() -> None:
    """dp 1 · cp 2: no data parallelism, yet the two context-parallel halves of each sequence produce partial
    gradients of the same weights, which must be reduced before the step."""
    args = ["model=llama3-8b", "layout.tp=1", "layout.pp=1", "layout.zero=1", "cluster=dgx-h100-superpod"]
    with_cp_plan = loader.load("cpu-tiny", [*args, "layout.dp=1", "layout.cp=2", "training.global_batch=4"])
    alone_plan = loader.load("cpu-tiny", [*args, "layout.dp=1", "layout.cp=1", "training.global_batch=4"])
    with_cp, alone = predict(with_cp_plan), predict(alone_plan)
    assert "dp" not in alone.collectives
    assert with_cp.collectives["dp"]["ranks"] == 2
    for plan, priced in ((with_cp_plan, True), (alone_plan, False)):
        ctx = step_context(plan, loader.plan_cluster(plan), DEFAULT_OPTIONS)
        reduce_s, _, gather_s = dp_costs(ctx)
        assert (sum(reduce_s.values()) > 0 and gather_s > 0) is priced


def test_fp8_params_keep_one_byte_weights() -> None:
    """A stack that keeps fp8 working weights (Stack.fp8_params, NeMo's recipes) holds one byte per weight under
    an fp8 plan, and two under bf16; the fp32 master copy stays in the optimizer's 12 bytes."""
    args = ["model=llama3-8b", "layout.tp=1", "layout.pp=1", "layout.dp=8", "layout.zero=1", "stack=nemo-24.12"]
    mems = {}
    for dtype in ("bf16", "fp8"):
        for keep in ("false", "true"):
            plan = loader.load(
                "cpu-tiny",
                [
                    *args,
                    "training.global_batch=16",
                    "cluster=dgx-h100-superpod",
                    f"training.dtype={dtype}",
                    f"stack.fp8_params={keep}",
                ],
            )
            mems[dtype, keep] = predict(plan).memory
    gib = param_count(plan.model).total / 2**30
    assert mems["fp8", "true"].params == pytest.approx(gib)
    assert mems["fp8", "false"].params == mems["bf16", "true"].params == pytest.approx(2 * gib)
    assert mems["fp8", "true"].optimizer == mems["fp8", "false"].optimizer


def test_tensor_and_pipeline_parallelism_split_the_weights() -> None:
    base = loader.load("llama3-405b-16k", ["layout.zero=0"])
    total = sum(rank_state_bytes(base, [s])[0] for s in range(base.layout.num_stages))
    assert total * base.layout.tp == pytest.approx(2 * param_count(base.model).total, rel=0.01)


KORTHIKANTI = {  # Korthikanti et al. 2022, Table 2: one GPT layer's activation bytes over s·b·h (fp16, dropout)
    ("none", False): lambda t, a, s, h: 10 + 24 / t + 5 * a * s / (h * t),
    ("none", True): lambda t, a, s, h: (34 + 5 * a * s / h) / t,
    ("selective", True): lambda t, a, s, h: 34 / t,
    ("full", False): lambda t, a, s, h: 2,
}


@pytest.mark.parametrize(("recompute", "sp"), list(KORTHIKANTI))
@pytest.mark.parametrize("tp", [1, 8])
def test_activation_bytes_match_korthikanti_table_2(recompute: str, sp: bool, tp: int) -> None:
    """Read off megatron-lm-2022's kernels (what each writes and keeps), a GPT-3 layer's activations are the
    paper's closed forms — the same accounting, not a fitted constant."""
    plan = loader.load(
        "gpt3-175b-1k",
        [f"layout.tp={tp}", f"layout.sequence_parallel={str(sp).lower()}", f"layout.recompute={recompute}"],
    )
    m = plan.model
    sbh = m.seq_len * plan.layout.microbatch_size * m.hidden
    expected = KORTHIKANTI[recompute, sp](tp, m.heads, m.seq_len, m.hidden) * sbh
    kept, _ = activation_bytes(plan, load_stack("megatron-lm-2022"), moe=False)
    assert kept == pytest.approx(expected, rel=1e-9)


def test_flash_attention_drops_the_score_matrices() -> None:
    """A fused attention kernel keeps its output and the fp32 log-sum-exp instead of the s x s scores, so
    without recompute a FlashAttention stack keeps less than Korthikanti's unfused 34 + 5as/h."""
    plan = loader.load("gpt3-175b-1k", ["layout.recompute=none", "layout.sequence_parallel=true"])
    unfused, _ = activation_bytes(plan, load_stack("megatron-lm-2022"), moe=False)
    fused, _ = activation_bytes(plan, load_stack("megatron-core-0.8"), moe=False)
    m, t = plan.model, plan.layout.tp
    sbh = m.seq_len * m.hidden
    assert unfused - fused == pytest.approx(5 * m.heads * m.seq_len / (m.hidden * t) * sbh, rel=0.05)


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


def test_experts_are_split_over_tp_only_where_the_stack_splits_them() -> None:
    layout = ["layout.tp=2", "layout.pp=1", "layout.dp=2", "layout.ep=2"]
    whole = loader.load("cpu-tiny-moe", layout)  # the executor: every tp rank runs the MoE MLP whole
    split = loader.load("cpu-tiny-moe", [*layout, "stack=megatron-core-0.8"])  # Megatron: experts split by tp
    assert not load_stack(whole.stack.name).moe_tensor_parallel
    moe_layer = whole.model.dense_layers  # the first MoE layer
    held, halved = layer_params(whole, moe_layer), layer_params(split, moe_layer)
    assert held.expert == pytest.approx(2 * halved.expert)  # tp = 2
    assert whole.model.dense_layers == 1
    assert layer_params(whole, 0) == layer_params(split, 0)  # the dense first layer is split the same under both
    e = whole.model
    assert e.moe_ffn_hidden is not None
    expert = 3 * e.hidden * e.moe_ffn_hidden  # SwiGLU: gate, up, down
    assert held.expert == pytest.approx(e.experts * expert / whole.layout.ep)


def test_alternating_moe_layers_hold_experts_only_where_they_route() -> None:
    """With `moe_layer_step` 2 after one dense layer, only layer 2 of four is MoE: stage 0 (layers 0-1) holds no
    expert weights, stage 1 (layers 2-3) one MoE layer's beside a dense layer's; and the step's all-to-all time is a
    third of every-layer routing's (one MoE layer of three)."""
    plan = loader.load("cpu-tiny-moe", ["model.moe_layer_step=2"])
    assert [plan.model.is_moe_layer(i) for i in range(4)] == [False, False, True, False]
    first, second = stage_params(plan, 0), stage_params(plan, 1)
    assert first.expert == 0
    assert second.expert == layer_params(plan, 2).expert > 0
    head = second.dense - layer_params(plan, 2).dense - layer_params(plan, 3).dense
    every = loader.load("cpu-tiny-moe")  # layers 1-3 MoE: its stage 1 holds two MoE layers and the same head
    assert stage_params(every, 1).dense - 2 * layer_params(every, 2).dense == pytest.approx(head)
    one = ["layout.pp=1", "layout.dp=4"]
    routed = {step: predict(loader.load("cpu-tiny-moe", [f"model.moe_layer_step={step}", *one])) for step in (1, 2)}
    assert routed[2].breakdown_s["ep_comm"] == pytest.approx(routed[1].breakdown_s["ep_comm"] / 3, rel=1e-9)


@pytest.mark.parametrize("stack,width", [("megatron-core-0.8", 4), ("nemo-24.12", 4), ("llm-foundry-0.3", 2)])
def test_the_last_stage_holds_its_logits_as_wide_as_its_loss_keeps_them(stack: str, width: int) -> None:
    """The logits and their gradient are the last stage's largest short-lived allocation: in fp32 where the stack's
    loss upcasts them (Megatron's vocab-parallel cross-entropy), in 16 bits under a fused cross-entropy that reads
    the bf16 logits (flash-attn's xentropy, llm-foundry)."""
    plan = loader.load("gpt-1b-h100", [f"stack={stack}", "layout.pp=1", "layout.zero=1", "layout.recompute=none"])
    st = loader.plan_stack(plan)
    assert logits_bytes(st) == width
    m, lay = plan.model, plan.layout
    logits = 2 * lay.microbatch_size * m.seq_len * m.vocab / lay.tp * width
    assert transient_bytes(plan, st, [0], last=True) == max(logits, transient_bytes(plan, st, [0], last=False))
