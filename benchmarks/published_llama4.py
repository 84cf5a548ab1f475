"""A validation table nothing was built or fitted on: Llama 4 Maverick (400B, 17B active) pre-training on 512 DGX
H100 in bf16 and fp8, NVIDIA's DGX Cloud recipe of May 2025, the one published H100 run of a model whose dense and
MoE layers alternate.

Source: NVIDIA/dgxc-benchmarking, tag v25.05.05 (container nvcr.io/nvidia/nemo:25.04.01, the same as
published_deepseek.py's), llama4/README.md ("H100": training step time in seconds per step, the mean of iterations
11-44; "The FP8 Precision Run on H100 was run with CUDA Graphs enabled") with llama4/launch.sh and NeMo v2.3.1's
scripts/performance/llm/pretrain_llama4_e128.py, the script launch.sh runs. 512 H100 at TP4 PP1 CP1, EP128 with
expert tensor parallelism 4 (the experts folded over every rank, one expert a group of four), 128 dp replicas of the
attention and dense layers, 1,024 sequences of 8,192 a step, micro-batch 1. The README's H100 table also prints
VP 12, which launch.sh's h100 branch sets to 1 (a pipeline of one stage has no virtual stages).

What each row runs, as the twin holds it:
- the `llama4-maverick` model preset (dense and MoE layers alternating: `moe_layer_step` 2; 128 experts, top-1 and
  one shared expert, all 8,192 wide; dense MLPs 16,384);
- `layout.expert_tp` 4: Megatron-Core's parallel folding, whole tp groups splitting each expert, the all-to-all over
  the 128 groups;
- pretrain_recipe(performance_mode=True) of nemo/collections/llm/recipes/llama4_e128.py: userbuffers tensor-parallel
  overlap (MegatronCommOverlapCallback tp_comm_overlap True, the nemo-24.12 stack's), MegatronTokenDropCallback
  (capacity factor 1.0, every expert's input padded to capacity), gradients reduced in bf16;
- the script's own settings: Transformer Engine's cross-entropy (cross_entropy_fusion_impl "te", the nemo-25.11
  stack's head kernels), fused RoPE (the nemo-24.12 stack's), moe_permute_fusion (Transformer Engine's Triton
  permutations, the nemo-25.11 stack's, under core_v0.12.0's unfused router) and Llama4Config's moe_grouped_gemm
  (TEGroupedMLP: a cuBLAS call per local expert on 4 streams), the all-to-all dispatcher;
- fp8: bf16_with_fp8_mixed (delayed scaling, fp8 parameter gathers: the nemo-24.12 stack's fp8 defaults).

Not modelled: the shared expert's overlap with the all-to-all (Llama4Config moe_shared_expert_overlap), the fp8 row's
CUDA graphs (enable_cuda_graph: Megatron-Core's per-layer graphs, which spare the host its kernel launches; the twin
prices eager launches at the stack's dispatch_us, binding only where a pass's kernels outlast its GPU time), the
sigmoid router's own kernels (priced as the stack's softmax router) and PerfEnvPlugin's vboost.

Run as part of benchmarks/published_figures.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.published import _cluster, _layout
from benchmarks.published_deepseek import RECIPE_OVERRIDES as DEEPSEEK_OVERRIDES
from plan import loader
from plan.schema import Plan
from twin import api

SOURCE = "NVIDIA/dgxc-benchmarking v25.05.05 (NeMo 25.04.01), llama4/README.md (H100)"
SEQ = 8192

RECIPE_OVERRIDES = {key: DEEPSEEK_OVERRIDES[key] for key in ("head_kernels", "moe_kernels", "grouped_gemm_streams")}
"""What pretrain_llama4_e128.py sets beyond the nemo-24.12 stack, the same as the DeepSeek-V3 script of that release
sets (published_deepseek.RECIPE_OVERRIDES) less its two DeepSeek-only changes: Llama 4 keeps userbuffers
(MegatronCommOverlapCallback tp_comm_overlap True) and has no latent attention to recompute."""


@dataclass(frozen=True)
class Llama4Row:
    dtype: str
    step_s: float
    """Published training step time (seconds per step)."""
    gpus: int = 512
    tp: int = 4
    ep: int = 128
    expert_tp: int = 4
    batch: int = 1024


DGXC_LLAMA4_H100 = (
    Llama4Row("bf16", 4.426),
    Llama4Row("fp8", 3.855),
)


def llama4_plan(row: Llama4Row) -> Plan:
    dp = row.gpus // row.tp
    model = loader.expand_model({"model": "llama4-maverick"}, "llama4-maverick")["model"]
    folded = {"ep": row.ep, "expert_tp": row.expert_tp, "zero": 1, "sequence_parallel": True}
    return api.load_plan(
        {
            "name": f"dgxc-llama4-maverick-{row.gpus}-{row.dtype}",
            "model": {**model, "seq_len": SEQ, "capacity_factor": 1.0},
            "cluster": _cluster("dgx-h100-superpod", row.gpus, 16384),
            "stack": {"name": "nemo-24.12", "overrides": RECIPE_OVERRIDES},
            "layout": _layout(row.tp, 1, dp, 1, 1, **folded),
            "training": {"global_batch": row.batch, "tokens": 1e12, "dtype": row.dtype},
        }
    )
