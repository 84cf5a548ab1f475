"""A validation table nothing was built or fitted on: NeMo AutoModel's DGX-H100 bf16 pre-training benchmarks, the
PyTorch-native stack (FSDP2, DeepEP expert parallelism, torch context parallelism) on the same hardware as the
Megatron tables.

Source: NVIDIA-NeMo/Automodel docs/performance-summary.md ("System: DGX-H100, Precision: BF16"; "Time per Global
Step (s)"), each row's configuration read from the commit that published it:

- Qwen3 MoE 30B, 8 GPUs: 21.773 s a step (12,040 tokens/s/GPU) at 8d9bfb90e (2025-10-08, which re-ran it after
  89e3a9fdd's 22.14 s), examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml: global batch 512, local batch 4
  (micro-batch 4, 16 accumulation steps), sequence 4,096, EP8 over the node, FSDP over the same 8 ranks for
  everything but the experts, TE attention / linear / RMSNorm, DeepEP, the fake balanced gate, activation
  checkpointing on. The yaml spells one backend key `enable_fsdp_optimization` where BackendConfig's field is
  `enable_fsdp_optimizations` (fixed later in a6d88dd39), so the published run did not use the file verbatim and
  whether it skipped the gradient sync of 15 of 16 microbatches is not known; the twin syncs every microbatch, which
  inside one node hides under the backward either way (about 1.5B FSDP-held parameters).
- Llama 3.1 70B, 64 GPUs: 18.90 s (866.77 tokens/s/GPU) at 2013a4dd6 (2026-04-10), examples/llm_pretrain/
  custom_llama3_1_70b_pretrain_benchmark_8nodes.yaml: global batch 128, local batch 1 (4 accumulation steps),
  sequence 8,192, CP2 x FSDP32, Automodel's own Llama (separate q, k, v projections), attn_implementation sdpa,
  rms_norm torch_fp32, per-layer torch.compile with activation checkpointing inside each layer, FSDP2 prefetch,
  defer_fsdp_grad_sync False (every microbatch reduce-scattered), Transformer Engine's FusedAdam, the loss with its
  default fp32 upcast.
- DeepSeek V3 671B, 256 and 1,024 GPUs: 8.18 s (1,002 tokens/s/GPU) and 37.87 s (865) at 89e3a9fdd
  (2025-10-06), examples/benchmark/configs/deepseek_v3_te_deepep.yaml: PP4 over interleaved 1F1B
  (torch.distributed.pipelining, stages of 2 layers: ceil(61 / 2) + 1 = 32 stages, VP8, 29 of two layers and 3 of
  one: `automodel_stages`), micro-batch 1, local batch 8, EP64, FSDP over the 64 (256) data-parallel ranks of a
  stage, the same backend and fake gate (a token's 8 experts on 2 ranks of one node), no multi-token prediction.
  The table gives 8,192 global sequences at 1,024 GPUs (4 accumulation steps of the local batch) and VP8 for both
  rows; the 1,024-GPU config committed later (8d9bfb90e) cuts stages of 4 layers (VP4).

How the rows run, as the twin holds them: the `automodel` stack (plan/presets/stacks/automodel.yaml) for the MoE
rows; for the Llama row the same stack with what its config changes (`LLAMA_OVERRIDES`); FSDP as ZeRO-3, the
checkpointing as full recompute, the cluster `dgx-h100-superpod`.

The fake balanced gate (nemo_automodel/components/moe/layers.py FakeBalancedGate, "to simulate ideal expert
routing") sends token t to experts top_k·t ... top_k·t + top_k - 1 (mod experts): every token's experts are one run
of top_k consecutive experts, so they sit on one rank where a rank holds at least top_k of them (Qwen3 at EP8: 16
a rank). That is group-limited routing with groups of top_k experts and one group a token (`fake_gate`), which the
twin's dispatch already prices (routed_reach): one copy of a token leaves its rank, where a router picking top_k of
128 experts at random reaches 5.3 of the 8 ranks.

At 1,024 GPUs the 4 accumulation steps are 4 runs of the pipeline schedule (recipes/llm/train_ft.py loops over
local batches; torch.distributed.pipelining reduces the gradients at each run's last backward), each with its own
fill and drain over 8 microbatches: `Layout.schedule_runs` 4. Both DeepSeek rows are 15% and more optimistic, as
NVIDIA's own DeepSeek-V3 recipe rows are on the same preset (dgxc-h100-deepseek, +17% and +22%), while DeepSeek's
own pre-training reads -1.4% on it (deepseek-v3-report): what these stacks lose on this model is not priced yet,
more likely in how they run it than in its shapes. The published 1,024-GPU row runs 14% slower a GPU than the
256-GPU one, where the twin runs it as fast (it read 4% faster, +39.2%, while the 32 microbatches ran as one
schedule): what else costs more at 256 data-parallel ranks than at 64 (FSDP over 4x the ranks, the experts sharded
over 4 ranks at 1,024 GPUs and not at 256) is not found.

Left out, with reasons: Kimi K2 (no preset), GPT-OSS 20B and 120B (FlexAttention with attention sinks over
alternating sliding windows: no kernel-level figure for it on H100), the Nemotron V3 rows (Mamba layers).

Run as part of benchmarks/published_figures.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.published import _cluster, _layout
from plan import loader
from plan.schema import Plan
from twin import api

SOURCE = "NVIDIA-NeMo/Automodel docs/performance-summary.md at 89e3a9fdd, 8d9bfb90e and 2013a4dd6 (DGX-H100, BF16)"


@dataclass(frozen=True)
class AutomodelRow:
    model: str
    gpus: int
    seq: int
    batch: int
    """Global batch (sequences a step)."""
    microbatch: int
    cp: int
    ep: int
    step_s: float
    """Published seconds per global step."""
    pp: int = 1
    virtual: int = 1
    """Model chunks a pipeline rank holds (the table's VP)."""
    accumulation: int = 1
    """The table's GA under pipelining: schedule runs a step, each over a local batch (`Layout.schedule_runs`)."""


AUTOMODEL_H100 = (
    AutomodelRow("qwen3-30b-a3b", 8, 4096, 512, 4, 1, 8, 21.773),
    AutomodelRow("llama3-70b", 64, 8192, 128, 1, 2, 1, 18.90),
    AutomodelRow("deepseek-v3", 256, 4096, 512, 1, 1, 64, 8.18, pp=4, virtual=8),
    AutomodelRow("deepseek-v3", 1024, 4096, 8192, 1, 1, 64, 37.87, pp=4, virtual=8, accumulation=4),
)


def automodel_stages(layers: int, stages: int) -> tuple[int, ...]:
    """torch.distributed.pipelining stages as Automodel cuts a model (components/distributed/pipelining/
    functional.py generate_hf_model_fqn_per_model_part): layers // stages each, the first layers % stages one more;
    the embedding rides with the first stage, the norm and output head with the last."""
    base, extra = divmod(layers, stages)
    return tuple(base + (i < extra) for i in range(stages))


def fake_gate(model: dict[str, Any]) -> dict[str, Any]:
    """FakeBalancedGate as group-limited routing: groups of top_k consecutive experts, one group a token (exact where
    top_k divides the experts, so every token's run of experts starts on a group boundary)."""
    experts, top_k = model["experts"], model["top_k"]
    if experts % top_k:
        raise ValueError(f"fake_gate: top_k={top_k} does not divide experts={experts}; runs would straddle groups")
    return {"expert_groups": experts // top_k, "group_top_k": 1}


LLAMA_OVERRIDES: dict[str, Any] = {
    "layer": [
        # rms_norm torch_fp32 and the rest of the decoder layer under per-layer torch.compile: Inductor fuses each
        # norm (fp32 inside, bf16 out), the rotary embedding of q and k, and the SwiGLU product into one kernel each
        {"name": "compiled_rms_norm", "reads": {"h_sp": 1}, "writes": {"h_sp": 1}, "backward": 1.5,
         "recomputed": False},
        {"name": "q_k_v_linear", "gemm": "qkv"},
        {"name": "compiled_rope", "reads": {"qk": 1}, "writes": {"qk": 1}, "backward": 1.0, "recomputed": False},
        {"name": "sdpa_flash", "attention": "flash"},
        {"name": "o_proj_linear", "gemm": "proj"},
        {"name": "residual_add", "reads": {"h_sp": 2}, "writes": {"h_sp": 1}, "backward": 1.0, "recomputed": False},
        {"name": "compiled_rms_norm", "reads": {"h_sp": 1}, "writes": {"h_sp": 1}, "backward": 1.5,
         "recomputed": False},
        {"name": "gate_up_linear", "gemm": "fc1"},
        {"name": "compiled_swiglu", "reads": {"ffn_in": 1}, "writes": {"ffn": 1}, "backward": 1.67,
         "recomputed": False},
        {"name": "down_linear", "gemm": "fc2"},
        {"name": "residual_add", "reads": {"h_sp": 2}, "writes": {"h_sp": 1}, "backward": 1.0, "recomputed": False},
    ],
    # scaled_dot_product_attention's flash backend (FlashAttention-2), under torch's context_parallel
    "attention_kernel": "fa2",
    "head_kernels": [
        # MaskedCrossEntropy's default fp32_upcast: logits.float(), then F.cross_entropy's log_softmax and nll_loss
        # in fp32; backward, nll's scatter, log_softmax's backward and the cast back (logits in 2-byte units)
        {"name": "logits_float", "reads": {"logits": 1}, "writes": {"logits": 2}, "backward": 1.0},
        {"name": "log_softmax_nll", "reads": {"logits": 2}, "writes": {"logits": 2}, "kernels": 2, "backward": 2.0,
         "backward_kernels": 2},
    ],
    "grad_reduce_dtype": "bf16",  # FSDP2Config's default MixedPrecisionPolicy (reduce_dtype bf16)
    "fused_optimizer": True,  # transformer_engine.pytorch.optimizers.FusedAdam
    "wgrad_accumulation_fusion": True,  # every microbatch's gradient is reduce-scattered, not added to a held one
}  # fmt: skip
"""What the Llama 3.1 70B configuration runs beyond the `automodel` stack (2013a4dd6: components/models/llama/
model.py, components/distributed/config.py FSDP2Config, loss/masked_ce.py, the yaml)."""


def automodel_plan(row: AutomodelRow) -> Plan:
    """The row as its configuration runs it: FSDP over every data- and context-parallel rank (ZeRO-3), whole-layer
    activation checkpointing, no tensor parallelism; the DeepSeek rows pipelined over interleaved stages of two
    layers, each accumulation step one run of the schedule."""
    model = loader.expand_model({"model": row.model}, row.model)["model"]
    model = {**model, "seq_len": row.seq} | (fake_gate(model) if model.get("experts") else {})
    if model.get("mtp_layers"):
        model["mtp_layers"] = 0  # Automodel's DeepseekV3ForCausalLM trains no multi-token-prediction module
    dp = row.gpus // (row.cp * row.pp)
    stages: dict[str, Any] = {}
    if row.pp > 1:  # the recipe's loop runs schedule.step once per local batch, reducing at its last backward
        stages = {"stage_layers": automodel_stages(model["layers"], row.pp * row.virtual),
                  "schedule_runs": row.accumulation}  # fmt: skip
    layout = _layout(1, row.pp, dp, row.microbatch, row.virtual, cp=row.cp, ep=row.ep, zero=3, recompute="full",
                     fused_projections=False, cp_algorithm="all-gather", **stages)  # fmt: skip
    overrides = {} if model.get("experts") else LLAMA_OVERRIDES
    return api.load_plan(
        {
            "name": f"automodel-{row.model}-{row.gpus}",
            "model": model,
            "cluster": _cluster("dgx-h100-superpod", row.gpus, 16384),
            "stack": {"name": "automodel", "overrides": overrides},
            "layout": layout,
            "training": {"global_batch": row.batch, "tokens": 1e12, "dtype": "bf16"},
        }
    )
