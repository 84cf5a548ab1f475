"""A validation table nothing was built or fitted on: Megatron-Bridge's DGX-H100 MoE pre-training rows, Qwen3
30B-A3B and 235B-A22B in fp8 with current scaling and gpt-oss-120b in bf16, NeMo 25.11 to 26.06.

Source: NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md at 067f987 (tokens per second per GPU;
"In MoE training benchmarks, we force-balance the token distribution among experts and all benchmarks are
token-dropless"). Each row's recipe is read from the Megatron-Bridge tag that shipped in that container (25.11 =
v0.2.0, 26.02 = v0.3.0, 26.02.01 = v0.3.1, 26.04 = v0.4.0, 26.04.01 = v0.4.2, 26.06 = v0.5.0):
scripts/performance/configs/qwen*/ (the H100 FP8_CS workload configs, V2 where the tag's --config_variant default
finds one, else V1), the qwen3 pretrain functions beside them, scripts/performance/utils/, and
src/megatron/bridge/recipes/qwen/qwen3_moe.py.

What every row runs, as the twin holds it: the `qwen3-30b-a3b` / `qwen3-235b-a22b` model presets (sequence 4,096,
micro-batch 1); the `nemo-25.11` stack (Transformer Engine 2.x fp8 current scaling with fp8 parameter gathers, TE's
cross-entropy, the fused router and permutations, the experts' GEMMs a cuBLAS call per local expert on 4 streams),
its weight-gradient accumulation fusion from 26.04 as benchmarks/published_mbridge.py finds it; routing balanced
and dropless (the twin's defaults); experts whole (expert tensor parallelism 1).

- Qwen3 235B-A22B, 256 GPUs, TP2 PP8 VP4 EP32 over 16 dp replicas (so the experts fold over tp and dp:
  `layout.expert_tp` 1), account_for_embedding/loss_in_pipeline_split (96 / 32 = 3 layers a virtual stage, the edge
  stages giving one back: `edge_stage_trim` 1), no recompute, tp_comm_overlap False (Transformer Engine's own
  backward overlap), moe_a2a_overlap True (`Stack.ep_overlap`: Megatron-Core's combined 1F1B, with
  delay_wgrad_compute), the all-to-all dispatcher; 2,048 sequences a step in 25.11, 8,192 from 26.02 (the V2
  configs).
- Qwen3 30B-A3B, 16 GPUs, 1,024 sequences a step: in 26.02 PP2 VP12 EP8 with DeepEP and moe_a2a_overlap; from
  26.04 PP1 EP16 with HybridEP and no overlap. Both send a token once to each remote node holding any of its
  experts and fan it out over NVLink there (`Stack.ep_dispatch` node-forwarding: at EP16 over two nodes, top-8,
  a quarter of the bytes NCCL's all-to-all would send across).
- gpt-oss-120b, 64 GPUs, bf16, PP4 EP8 over 16 dp replicas, 1,280 sequences a step (the V2 config from 26.02), the
  all-to-all dispatcher, no overlap; the `gpt-oss-120b` preset (128-token sliding windows on alternate layers; its
  attention sinks and projection biases not modelled), with the recipe's kernels beyond the stack
  (`GPT_OSS_OVERRIDES`: the clamped activation's eager clamps and concatenation, fc2's bias added expert by expert,
  the norms and the experts' activation rerun in the backward: recompute_modules layernorm, moe_act).

Left out, with reasons: every 25.09 row (its table states no precision); 30B in 25.11 (the table prints MBS 2 and
VP 24 where that tag's config runs MBS 1 and VP 12) and in 26.02.01 (the table prints 26.02's PP2 VP12 EP8 where
v0.3.1's config runs 26.04's PP1 EP16); DeepSeek-V3 (25.09 only); gpt-oss-120b in 25.11 (the table prints MBS 4
where that tag's config runs 1); Nemotron 3 Nano (Mamba layers).

Run as part of benchmarks/published_figures.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.published import _cluster, _layout
from benchmarks.published_mbridge import release_at_least, release_overrides
from plan import loader
from plan.schema import Plan
from twin import api

SOURCE = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md at 067f987 (DGX-H100, fp8-cs, MoE)"
SEQ = 4096


@dataclass(frozen=True)
class MoeRow:
    release: str
    model: str
    gpus: int
    batch: int
    tp: int
    pp: int
    virtual: int
    ep: int
    a2a_overlap: bool
    tokens_per_gpu: float
    """Published tokens per second per GPU."""
    dtype: str = "fp8"
    """The table's precision: FP8 (current scaling, fp8_cs) or BF16."""


MBRIDGE_MOE_H100 = (
    MoeRow("25.11", "qwen3-235b-a22b", 256, 2048, 2, 8, 4, 32, True, 1575),
    MoeRow("26.02", "qwen3-235b-a22b", 256, 8192, 2, 8, 4, 32, True, 1633),
    MoeRow("26.02.01", "qwen3-235b-a22b", 256, 8192, 2, 8, 4, 32, True, 1611),
    MoeRow("26.04", "qwen3-235b-a22b", 256, 8192, 2, 8, 4, 32, True, 1686),
    MoeRow("26.04.01", "qwen3-235b-a22b", 256, 8192, 2, 8, 4, 32, True, 1712),
    MoeRow("26.02", "qwen3-30b-a3b", 16, 1024, 1, 2, 12, 8, True, 5113),
    MoeRow("26.04", "qwen3-30b-a3b", 16, 1024, 1, 1, 1, 16, False, 8901),
    MoeRow("26.04.01", "qwen3-30b-a3b", 16, 1024, 1, 1, 1, 16, False, 8960),
    MoeRow("26.06", "qwen3-30b-a3b", 16, 1024, 1, 1, 1, 16, False, 8826),
    MoeRow("26.02", "gpt-oss-120b", 64, 1280, 1, 4, 1, 8, False, 5993, "bf16"),
    MoeRow("26.02.01", "gpt-oss-120b", 64, 1280, 1, 4, 1, 8, False, 5984, "bf16"),
    MoeRow("26.04", "gpt-oss-120b", 64, 1280, 1, 4, 1, 8, False, 5810, "bf16"),
    MoeRow("26.04.01", "gpt-oss-120b", 64, 1280, 1, 4, 1, 8, False, 5824, "bf16"),
)

EDGE_TRIM = {"qwen3-235b-a22b": 1, "qwen3-30b-a3b": 0, "gpt-oss-120b": 0}
"""account_for_embedding/loss_in_pipeline_split: set by the 235B recipe only (qwen3_moe.py)."""

_STACK = loader.load_stack("nemo-25.11")


def _gpt_oss_layer() -> list[dict[str, object]]:
    """The nemo-25.11 layer as the gpt-oss recipe runs it (Megatron-Bridge v0.4.0 gpt_oss_bridge.py: bias_activation_
    fusion, activation_func_clamp_value 7, glu_linear_offset 1; gpt_oss_workload_base_configs.py H100:
    recompute_modules layernorm, moe_act). Megatron-Core core_v0.16.0 fusions/fused_bias_geglu.py
    weighted_bias_quick_geglu_impl clamps the two halves of fc1's output and concatenates them in eager ops before its
    compiled quick-GEGLU (jit_fuser is torch.compile); the norms' and the activation's outputs are not kept but rerun
    in the backward (`saves_output` false)."""
    layer: list[dict[str, object]] = []
    for kernel in _STACK.layer:
        k = kernel.model_dump()
        if k["name"] == "te_rms_norm":
            k["saves_output"] = False
        if k["name"] == "fused_swiglu":
            # clamp(x_glu), clamp(x_linear), cat: half of the input each, then the whole, each read and written;
            # backward: the clamps' masked gradients (the cat's is a split: views)
            clamps = {"reads": {"ffn_in": 2}, "writes": {"ffn_in": 2}, "kernels": 3, "backward": 0.75}
            reruns = {"backward_kernels": 2, "recomputed": False, "saves_output": False}
            layer.append({"name": "clamp_and_cat", **clamps, **reruns})
            k.update(name="weighted_bias_quick_geglu", saves_output=False)
        layer.append(k)
    return layer


GPT_OSS_EXPERT_BIAS = {
    "name": "expert_bias_loop",
    "reads": {"experts_in": 3},
    "writes": {"experts_in": 3},
    "kernels": 33,
    "backward": 1.0,
    "backward_kernels": 64,
    "several_local_experts": True,
}
"""TEGroupedMLP._apply_bias (core_v0.16.0 moe/experts.py): fc2's bias added expert by expert in Python, `t + b * p`
over each expert's rows, then one torch.cat of them all (16 local experts at EP8: 2 kernels each and the cat; the
product is written at the rows' full width); backward, each expert's bias and probability gradients, a product and
a sum each (4 kernels an expert)."""

GPT_OSS_OVERRIDES = {
    "layer": _gpt_oss_layer(),
    "moe_kernels": [k.model_dump() for k in _STACK.moe_kernels] + [GPT_OSS_EXPERT_BIAS],
}
"""What the gpt-oss recipe runs beyond the nemo-25.11 stack. Not priced: the host synchronisation of the
activation's `torch.tensor(linear_offset, device=...)` (a blocking copy, once a forward and once a recompute), the
attention sinks (softmax_type learnable) and the projections' biases."""

FLEX_DISPATCH = {"qwen3-30b-a3b"}
"""The H100 configs that run moe_token_dispatcher_type "flex" (DeepEP, then HybridEP: `Stack.ep_dispatch`
node-forwarding; qwen3_llm_pretrain.py qwen3_30b_a3b_pretrain_config_h100); 235B and gpt-oss run "alltoall"."""


HYBRIDEP_FROM, HYBRIDEP_SMS = "26.04", 32
"""The release from which the flex configs run HybridEP, and its SMs: Megatron-Bridge v0.4.0 scripts/performance/
utils/overrides.py sets moe_hybridep_num_sms = 32 (`Stack.ep_dispatch_sms`); 26.02's DeepEP runs inside one node."""


def mbridge_moe_plan(row: MoeRow, dispatch: str | None = None, extra: dict[str, object] | None = None) -> Plan:
    """The row as its release's recipe runs it; `dispatch` and `extra` stack overrides where a controlled comparison
    changes the dispatcher or its kernels (QWEN3_30B_CONTROLLED)."""
    dp = row.gpus // (row.tp * row.pp)
    model = loader.expand_model({"model": row.model}, row.model)["model"]
    folded = {"expert_tp": 1} if row.ep > dp else {}
    layout = _layout(row.tp, row.pp, dp, 1, row.virtual, ep=row.ep, zero=1, sequence_parallel=row.tp > 1,
                     edge_stage_trim=EDGE_TRIM[row.model], **folded)  # fmt: skip
    dispatch = dispatch or ("node-forwarding" if row.model in FLEX_DISPATCH else "all-to-all")
    overrides: dict[str, object] = {"tp_overlap": "backward", "ep_overlap": row.a2a_overlap, "ep_dispatch": dispatch}
    if dispatch == "node-forwarding" and release_at_least(row.release, HYBRIDEP_FROM):
        overrides["ep_dispatch_sms"] = HYBRIDEP_SMS
    overrides |= release_overrides(row.release) | (GPT_OSS_OVERRIDES if row.model == "gpt-oss-120b" else {})
    return api.load_plan(
        {
            "name": f"mbridge-{row.release}-{row.model}-{row.gpus}",
            "model": {**model, "seq_len": SEQ},
            "cluster": _cluster("dgx-h100-superpod", row.gpus, 16384),
            "stack": {"name": "nemo-25.11", "overrides": overrides | (extra or {})},
            "layout": layout,
            "training": {"global_batch": row.batch, "tokens": 1e12, "dtype": row.dtype},
        }
    )


# --- Qwen3 30B-A3B on 16 H100, bf16: Megatron-Bridge's controlled dispatcher and overlap comparisons ----------------

CONTROLLED_SOURCE = (
    "NVIDIA-NeMo/Megatron-Bridge at 067f987: skills/nemo-mbridge-perf-moe-comm-overlap/SKILL.md and card.yaml "
    "(HybridEP, 2026-07-25), docs/training/communication-overlap.md (alltoall, 2026-05-18)"
)


@dataclass(frozen=True)
class ControlledRow:
    """One run of Megatron-Bridge's controlled Qwen3 30B-A3B comparisons on 16 H100: bf16, sequence 4,096, TP1 PP1
    CP1 EP16, micro-batch 1, 1,024 sequences a step, routing force-balanced; each pair differs in the EP overlap
    alone (overlap_moe_expert_parallel_comm, delayed wgrad off)."""

    what: str
    dispatch: str
    """`Stack.ep_dispatch`: HybridEP (32 SMs, Transformer Engine CUDA graphs over moe_router and moe_preprocess) or
    the alltoall dispatcher (CUDA graphs off, moe_permute_fusion off)."""
    overlap: bool
    step_s: float
    """Published seconds per step."""


QWEN3_30B_CONTROLLED = (
    ControlledRow("HybridEP, EP overlap off (iterations 5-20)", "node-forwarding", False, 24.7138),
    ControlledRow("HybridEP, EP overlap on (iterations 41-50)", "node-forwarding", True, 20.9920),
    ControlledRow("alltoall, unfused permute, EP overlap off (iterations 3-8)", "all-to-all", False, 41.25),
    ControlledRow("alltoall, unfused permute, EP overlap on (iterations 3-8)", "all-to-all", True, 31.31),
)
"""The HybridEP pair is the skill's "production-shape validation" (its Nsight comparison: communication 0.11% and
36.55% hidden, GPU-active 22.82 s and 21.22 s); the alltoall pair its "directional rather than release-grade" smoke.
CUDA graphs are not priced (the twin launches eagerly): in the same container scoped graphs over the alltoall
shape ran 42.00 s against 41.36 s eager (skills/nemo-mbridge-perf-cuda-graphs/SKILL.md)."""

UNFUSED = ("permute", "unpermute", "sort_by_local_expert")
UNFUSED_PERMUTE = [k.model_dump() for k in _STACK.moe_kernels if k.name == "fused_router"] + [
    k.model_dump() for k in loader.load_stack("nemo-24.12").moe_kernels if k.name in UNFUSED
]
"""moe_permute_fusion off: Megatron-Core's unfused permute, unpermute and sort by local expert in eager torch ops
(moe_utils.permute / unpermute / sort_chunks_by_idxs without fusion: the nemo-24.12 stack's kernels, core 0.10's
same ops), beside the fused router, which moe_router_fusion keeps; the experts stay grouped (TEGroupedMLP)."""


def controlled_plan(row: ControlledRow) -> Plan:
    base = MoeRow("26.06", "qwen3-30b-a3b", 16, 1024, 1, 1, 1, 16, row.overlap, 0.0, "bf16")
    extra = {"moe_kernels": UNFUSED_PERMUTE} if row.dispatch == "all-to-all" else {}
    return mbridge_moe_plan(base, row.dispatch, extra)
