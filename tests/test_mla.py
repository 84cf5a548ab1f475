"""Multi-head latent attention (DeepSeek-V2/V3): parameters, GEMMs, attention FLOPs and what recompute keeps,
against closed forms from DeepSeek-V3's widths."""

from __future__ import annotations

import pytest

from executor.parallel import LayoutError, check_supported
from plan import loader
from plan.model_math import attention_params, latent_down_params, model_flops_per_token, param_count
from plan.schema import ModelSpec
from twin.step.compute import Device
from twin.step.context import PredictOptions, step_context
from twin.step.kernels import PassCost, Shape, attention_flops, latent_gemms, layer_cost, weight_gemms
from twin.step.memory import activation_bytes, layer_params

H, HEADS, Q_LORA, KV_LORA, ROPE, D, V = 7168, 128, 1536, 512, 64, 128, 128


def _deepseek() -> ModelSpec:
    return ModelSpec.model_validate(loader.expand_model({"model": "deepseek-v3"}, "deepseek-v3")["model"])


def test_latent_attention_weights_are_deepseek_v3s() -> None:
    m = _deepseek()
    down = H * (Q_LORA + KV_LORA + ROPE) + Q_LORA + KV_LORA  # projections to the latents, and the latents' norms
    up = Q_LORA * HEADS * (D + ROPE) + KV_LORA * HEADS * (D + V)
    assert latent_down_params(m) == down
    assert attention_params(m) == down + up + HEADS * V * H
    assert attention_params(m) == pytest.approx(187.1e6, rel=1e-3)  # per layer, a third less than MHA's 4·h²
    assert param_count(m).active == pytest.approx(37.5e9, rel=0.01)  # the report's 37B activated


def test_down_projections_stay_whole_on_each_tensor_parallel_rank() -> None:
    plans = {tp: loader.load("deepseek-v3-2k", [f"layout.tp={tp}", "layout.dp=64"]) for tp in (1, 2)}
    m = plans[1].model
    split = layer_params(plans[2], 0).dense - layer_params(plans[1], 0).dense / 2
    assert split == pytest.approx(latent_down_params(m) / 2)  # the duplicated half that tp does not divide


def test_latent_gemms_run_the_down_projection_on_the_shard_and_split_the_up_projections() -> None:
    m, tokens, tp = _deepseek(), 4096, 2
    down, up = latent_gemms(m, Shape(tokens, tp, True))
    assert down == [(tokens / tp, Q_LORA + KV_LORA + ROPE, H, 1.0)]
    assert up == [(tokens, HEADS * (D + ROPE) / tp, Q_LORA, 1.0), (tokens, HEADS * (D + V) / tp, KV_LORA, 1.0)]
    assert weight_gemms(m, Shape(tokens, tp, True), moe=True)["proj"] == [(tokens, H, HEADS * V / tp, 1.0)]


def test_attention_core_flops_use_the_query_key_and_value_widths() -> None:
    m, s = _deepseek(), 4096
    causal = 0.5 * 2 * HEADS * s * s * ((D + ROPE) + V)  # Q·Kᵀ over 192, P·V over 128, half of s x s
    assert attention_flops(m, 1, s, 1) == pytest.approx(causal)
    main = m.model_copy(update={"mtp_layers": 0})  # the model alone (tests/test_mtp.py adds its MTP module)
    flops = model_flops_per_token(main)
    assert flops == pytest.approx(6 * param_count(m).matmul_active + 12 * m.layers * HEADS * (192 + 128) / 2 * s)


def test_recomputed_up_projections_keep_the_latents_instead_of_the_heads() -> None:
    plan = loader.load("deepseek-v3-2k", ["training.dtype=bf16"])
    stack = loader.plan_stack(plan)
    assert stack.mla_up_recompute
    kept, _ = activation_bytes(plan, stack, moe=True)
    kept_heads, _ = activation_bytes(plan, stack.model_copy(update={"mla_up_recompute": False}), moe=True)
    tokens = plan.model.seq_len  # microbatch 1, tp 1, cp 1
    heads = HEADS * (D + ROPE) * 2 + HEADS * V - (HEADS * ROPE + ROPE)  # Q, K, V less what RoPE rewrites
    latents = Q_LORA + KV_LORA + ROPE
    assert kept_heads - kept == pytest.approx((heads - latents) * tokens * 2)
    # and the backward reruns the two up-projections: their forward FLOPs, on top of selective recompute's
    shape = Shape(tokens, 1, False, seq_kv=tokens)
    device = step_context(plan, loader.plan_cluster(plan), PredictOptions()).device
    rerun, once = (layer_cost(plan.model, shape, device, s, True, "selective") for s in
                   (stack, stack.model_copy(update={"mla_up_recompute": False})))  # fmt: skip
    up_flops = 2 * tokens * (Q_LORA * HEADS * (D + ROPE) + KV_LORA * HEADS * (D + V))
    assert rerun.recompute_flops - once.recompute_flops == pytest.approx(up_flops)
    assert rerun.recompute_s > once.recompute_s


def _stack_layer_cost(
    stack_name: str, model: ModelSpec, keep: set[str], recompute_up: bool = False
) -> tuple[PassCost, Device]:
    """One layer's cost on a DGX H100 rank (TP2, sequence parallel, 4,096 tokens) under `stack_name` cut down to the
    kernels named in `keep`: what those kernels add, and nothing of the GEMMs'."""
    stack = loader.load_stack(stack_name)
    layer = tuple(k for k in stack.layer if k.name in keep)
    stack = stack.model_copy(update={"layer": layer, "moe_kernels": (), "mla_up_recompute": recompute_up})
    device = Device.of(loader.load_cluster("dgx-h100-superpod"), "bf16", 8)
    return layer_cost(model, Shape(4096, 2, True, seq_kv=4096), device, stack, False, "none"), device


def test_latent_kernels_run_only_under_latent_attention() -> None:
    deepseek, llama = _deepseek(), ModelSpec.model_validate(loader.expand_model({"model": "llama3-8b"}, "x")["model"])
    names = {"fused_rope", "mla_rope_q", "mla_rope_k", "mla_query_cat", "mla_key_cat", "mla_value_copy"}
    (latent, _), (standard, _) = (_stack_layer_cost("nemo-24.12", m, names) for m in (deepseek, llama))
    assert latent.kernels == (13 + 13 + 3, 8 + 8 + 1 + 2)  # the MLA list, not the fused RoPE
    assert standard.kernels == (1, 1)  # the fused RoPE alone


def test_fused_latent_rope_moves_the_up_projection_out_and_the_key_and_value_in() -> None:
    m, n, tokens = _deepseek(), HEADS / 2, 4096  # TP2: 64 heads a rank
    cost, device = _stack_layer_cost("nemo-25.11", m, {"fused_mla_rope_kv"})
    nbytes = 2 * tokens * (n * (D + V) + ROPE + n * (D + ROPE) + n * V)  # kv_up and k_pe in, key and value out
    assert cost.forward_s - device.layer_s == pytest.approx(device.elementwise_s(nbytes, 1))
    assert cost.backward_input_s == pytest.approx(device.elementwise_s(nbytes, 1))


def test_recomputed_up_projections_rerun_the_latent_kernels() -> None:
    names = {"mla_rope_q", "mla_rope_k", "mla_query_cat", "mla_key_cat", "mla_value_copy"}
    (kept, _), (rerun, _) = (_stack_layer_cost("nemo-24.12", _deepseek(), names, up) for up in (False, True))
    assert kept.recompute_s == 0.0
    bare, _ = _stack_layer_cost("nemo-24.12", _deepseek(), set())
    assert rerun.recompute_s == pytest.approx(rerun.forward_s - bare.forward_s)
    assert rerun.recompute_s > 0


@pytest.mark.parametrize(
    ("fields", "match"),
    [({"q_lora_rank": 1536}, "needs kv_lora_rank"), ({"kv_lora_rank": 512, "kv_heads": 4}, "set kv_heads to heads")],
)
def test_latent_attention_fields_that_cannot_go_together(fields: dict, match: str) -> None:
    base = {"layers": 2, "hidden": 1024, "heads": 16, "ffn_hidden": 4096, "vocab": 1000, "seq_len": 512}
    with pytest.raises(ValueError, match=match):
        ModelSpec.model_validate({**base, **fields})


def test_the_executor_refuses_latent_attention() -> None:
    with pytest.raises(LayoutError, match="latent attention is a twin-only model"):
        check_supported(loader.load("deepseek-v3-2k", ["model.mtp_layers=0"]))
