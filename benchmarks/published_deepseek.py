"""A validation table nothing was built or fitted on: DeepSeek-V3 671B pre-training in bf16 on DGX H100, NVIDIA's
DGX Cloud recipes of May 2025, the one published MoE run with expert parallelism wider than data parallelism.

Source: NVIDIA/dgxc-benchmarking, tag v25.05.05 (container nvcr.io/nvidia/nemo:25.04.01, Megatron-Core 0.12),
deepseek_v3/pretraining/README.md ("H100 Performance": training step time in seconds per step, the mean of
iterations 11-44) with launch.sh and NeMo v2.3.1's scripts/performance/llm/pretrain_deepseek_v3.py, the script
launch.sh runs. 512 H100 at TP2 PP8 EP64 (32 dp replicas, 4,096 sequences a step) and 1,024 at TP2 PP16 EP64 (32
replicas, 8,192 sequences), sequence 4,096, micro-batch 1, no virtual stages, ETP 1.

What each row runs, as the twin holds it:
- the `deepseek-v3` model preset (61 layers, the first three dense, 256 routed experts of width 2,048 and one
  shared, top-8, vocabulary 129,280, multi-head latent attention: query latent 1,536, key-value latent 512, heads
  of 128 + 64 RoPE, values of 128), its down-projections whole on each tp rank and the up-projections split, as
  Megatron-Core's multi_latent_attention.py builds them;
- MoE parallel folding: `layout.expert_tp` 1, the 64 expert-parallel ranks of a stage over its tp pairs of 32
  replicas, whole experts, each tp rank dispatching its own sequence-parallel shard (Megatron-Core's all-to-all
  dispatcher, DeepSeekV3Config moe_token_dispatcher_type);
- MegatronTokenDropCallback: capacity factor 1.0, every expert's input padded to capacity (USE_TOKEN_DROP);
- the recipe's pipeline split, num_layers_in_first/last_pipeline_stage = 64 / pp − 1 and − 2 (`stage_layers`);
- the `nemo-24.12` stack with what the script sets beyond it: Transformer Engine's cross-entropy
  (cross_entropy_fusion_impl "te", the nemo-25.11 stack's head kernels), no userbuffers
  (MegatronCommOverlapCallback tp_comm_overlap=False: Transformer Engine's own backward overlap);
- the experts as DeepSeekV3Config runs them (moe_grouped_gemm: Transformer Engine's GroupedLinear, a cuBLAS call
  per local expert on 4 streams) and the script's moe_permute_fusion (Transformer Engine's Triton permutations);
- no recompute of the attention core: the recipe recomputes only MLA's up-projections (recompute_modules
  mla_up_proj: `Stack.mla_up_recompute`, the latents kept instead of the heads);
- the multi-token-prediction module the pre-training recipe keeps (use_mtp True: the preset's `mtp_layers` 1, one
  more MoE layer, projection and output head on the last stage, which its two fewer layers make room for).

MLA's own memory-bound kernels are the nemo-24.12 stack's `attention_form: latent` list (DeepSeekV3Config leaves
apply_rope_fusion off: the eager RoPE of the positional parts, the query's and key's concatenations, the value's
copy), rerun with the recomputed up-projections. Not modelled: the latent norms (inside Transformer Engine's
LayerNormLinear up-projections in core_v0.12.0's spec; small beside the heads), Megatron-Core 0.12's column-parallel
down-projections with their gathers (the twin keeps them whole on each rank, as later releases do), the shared
expert's overlap with the all-to-all (moe_shared_expert_overlap), and PerfEnvPlugin's vboost.

Run as part of benchmarks/published_figures.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.published import _cluster, _layout
from plan import loader
from plan.schema import Plan
from twin import api

SOURCE = "NVIDIA/dgxc-benchmarking v25.05.05 (NeMo 25.04.01), deepseek_v3/pretraining/README.md"
SEQ = 4096

TE_CROSS_ENTROPY = [k.model_dump() for k in loader.load_stack("nemo-25.11").head_kernels]
"""Transformer Engine's cross-entropy on the bf16 logits (cross_entropy_fusion_impl "te")."""


_UNFUSED_ROUTER = [k.model_dump() for k in loader.load_stack("nemo-24.12").moe_kernels if k.name.startswith("router")]
_FUSED_PERMUTATIONS = [k.model_dump() for k in loader.load_stack("nemo-25.11").moe_kernels if k.name != "fused_router"]

RECIPE_OVERRIDES = {
    "head_kernels": TE_CROSS_ENTROPY,
    "tp_overlap": "backward",
    "mla_up_recompute": True,
    "moe_kernels": _UNFUSED_ROUTER + _FUSED_PERMUTATIONS,
    "grouped_gemm_streams": loader.load_stack("nemo-25.11").grouped_gemm_streams,
}
"""What pretrain_deepseek_v3.py and launch.sh set beyond the stack: Transformer Engine's cross-entropy, no
userbuffers (Transformer Engine's own backward overlap), recompute_modules mla_up_proj; moe_permute_fusion
(Transformer Engine's Triton permutations, the nemo-25.11 stack's, under the router core_v0.12.0 runs unfused) and
DeepSeekV3Config's moe_grouped_gemm (TEGroupedMLP: a cuBLAS call per local expert on 4 streams, where the
nemo-24.12 stack's SequentialMLP runs them one at a time and concatenates their outputs)."""


@dataclass(frozen=True)
class DeepseekRow:
    gpus: int
    tp: int
    pp: int
    ep: int
    batch: int
    step_s: float
    """Published training step time (seconds per step)."""


DGXC_DEEPSEEK_H100 = (
    DeepseekRow(512, 2, 8, 64, 4096, 48.948),
    DeepseekRow(1024, 2, 16, 64, 8192, 52.04),
)


def stage_layers(pp: int, layers: int = 61) -> tuple[int, ...]:
    """The recipe's split: 64 / pp layers a middle stage, one fewer on the first and two fewer on the last."""
    middle = 64 // pp
    split = (middle - 1, *([middle] * (pp - 2)), middle - 2)
    assert sum(split) == layers, split
    return split


def deepseek_plan(row: DeepseekRow) -> Plan:
    dp = row.gpus // (row.tp * row.pp)
    model = loader.expand_model({"model": "deepseek-v3"}, "deepseek-v3")["model"]
    folded = {"ep": row.ep, "expert_tp": 1, "zero": 1, "sequence_parallel": True}
    layout = _layout(row.tp, row.pp, dp, 1, 1, stage_layers=stage_layers(row.pp), **folded)
    return api.load_plan(
        {
            "name": f"dgxc-deepseek-v3-{row.gpus}-bf16",
            "model": {**model, "seq_len": SEQ, "capacity_factor": 1.0},
            "cluster": _cluster("dgx-h100-superpod", row.gpus, 16384),
            "stack": {"name": "nemo-24.12", "overrides": RECIPE_OVERRIDES},
            "layout": layout,
            "training": {"global_batch": row.batch, "tokens": 1e12, "dtype": "bf16"},
        }
    )
