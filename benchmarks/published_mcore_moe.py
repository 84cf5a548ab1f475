"""A validation row nothing was built or fitted on: Mixtral 8x7B pre-training in bf16 on 64 H100 with Megatron-Core
0.9, the figure Megatron-Core's MoE documentation headlines (468 TFLOP/s per GPU, 47% MFU).

Source: NVIDIA/Megatron-LM at c230e0d7c2 (2024-11-21, "Update MoE Doc"): megatron/core/transformer/moe/README.md
("This boosts Mixtral 8X7B bf16 training to achieve **468 TFLOPS** as of MCore v0.9"; its "Reference Best Parallel
Mapping" table: Mixtral 8x7B dropless, all-to-all dispatcher, BF16, 64 GPUs, sequence 4,096, TP1 EP8 PP4 VP8,
micro-batch 1, global batch 256; DGX H100 with 8x400 Gbit/s InfiniBand, the PyTorch 24.09 container with Transformer
Engine 1.11) and README.md ("47% MFU during BF16 training for 8x7B on H100"). TFLOP/s by core_v0.9.0
training.py num_floating_point_operations (`benchmarks.published.megatron_tflops`).

VP 8 is read as eight virtual stages of one layer each (NeMo v2.1.0's mixtral_8x7b recipe, the same team's mapping:
TP1 PP4 virtual_pipeline_parallelism 8 EP8), not as 8 layers per virtual stage: at 32 layers over PP4 that would be
one stage a rank, a 19% bubble at 16 microbatches a pipeline, and the twin then reads 429 TFLOP/s (-8%).

What the row runs, as the twin holds it:
- the `mixtral-8x7b` preset (32 layers, hidden 4,096, GQA 32/8 heads, 8 SwiGLU experts of 14,336, top-2), the
  Llama 2 tokenizer's 32,000 tokens (the README's example script: Llama2Tokenizer);
- core_v0.9.0's pretrain_gpt defaults as the example script leaves them, on the `nemo-24.12` stack's Llama-style
  layer (Megatron-Core 0.10 with Transformer Engine: cuDNN fused attention, fused RoPE and bias-SwiGLU, no
  dropout; the script sets --attention-dropout 0.0 --hidden-dropout 0.0 --disable-bias-linear --swiglu --normalization
  RMSNorm) and its unfused router and permutations (core 0.10's, the same eager ops as 0.9's), with what Megatron-LM's
  own launcher sets beyond NeMo's recipe (`MEGATRON_LM_OVERRIDES`);
- the distributed optimizer with --overlap-grad-reduce --overlap-param-gather (ZeRO-1), the expert-parallel group
  of eight inside one node (TP1, so a stage's 16 dp ranks are consecutive), interleaved 1F1B.

Not modelled: the routing imbalance of a dropless run balanced by its auxiliary loss alone (the README measures
"after at least 500 iterations"; the twin routes evenly, so it leans optimistic), Transformer Engine 1.11's kernels
where they differ from NeMo 24.12's 1.13, and the one local expert's GroupedLinear wrapper (--moe-grouped-gemm with
EP8 leaves a rank one expert: one GEMM).

Run as part of benchmarks/published_figures.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.published import UNFUSED_CROSS_ENTROPY, _cluster, _layout
from plan import loader
from plan.schema import Plan
from twin import api

SOURCE = "NVIDIA/Megatron-LM c230e0d7c2, megatron/core/transformer/moe/README.md (MCore v0.9, DGX H100)"
SEQ = 4096
VOCAB = 32000
"""Llama2Tokenizer's vocabulary, already a multiple of 128 (no padding at TP1)."""

MEGATRON_LM_OVERRIDES: dict[str, Any] = {
    "grad_reduce_dtype": "fp32",
    "head_kernels": UNFUSED_CROSS_ENTROPY,
    "grad_buffer_passes": 4,
}
"""core_v0.9.0 megatron/training/arguments.py beyond the nemo-24.12 stack: --bf16 forces
accumulate_allreduce_grads_in_fp32 (fp32 gradient reduce-scatters); --cross-entropy-loss-fusion is off by default
(the unfused vocab-parallel cross-entropy); --check-for-nan-in-loss-and-grad is on by default (the gradient buffer's
zero, NaN-check norm and scaling passes, as the megatron-core-0.8 stack counts them)."""


@dataclass(frozen=True)
class McoreMoeRow:
    model: str
    gpus: int
    tp: int
    ep: int
    pp: int
    virtual: int
    batch: int
    tflops: float
    """Published TFLOP/s per GPU (Megatron-Core's count)."""


MCORE_MOE_H100 = (McoreMoeRow("mixtral-8x7b", 64, 1, 8, 4, 8, 256, 468.0),)


def mcore_moe_plan(row: McoreMoeRow) -> Plan:
    dp = row.gpus // (row.tp * row.pp)
    model = loader.expand_model({"model": row.model}, row.model)["model"]
    return api.load_plan(
        {
            "name": f"mcore-{row.model}-{row.gpus}",
            "model": {**model, "seq_len": SEQ, "vocab": VOCAB},
            "cluster": _cluster("dgx-h100-superpod", row.gpus, 16384),
            "stack": {"name": "nemo-24.12", "overrides": MEGATRON_LM_OVERRIDES},
            "layout": _layout(row.tp, row.pp, dp, 1, row.virtual, ep=row.ep, zero=1, sequence_parallel=row.tp > 1),
            "training": {"global_batch": row.batch, "tokens": 1e12, "dtype": "bf16"},
        }
    )
