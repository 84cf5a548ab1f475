"""NVIDIA's NeMo performance summary on DGX-H100 in fp8: two validation tables from releases before the DGX Cloud
recipes (NeMo 24.12) that `compute.in_training_fraction` was fitted on.

Sources, NVIDIA/NeMo docs/source/performance/performance_summary.md:

- at 8e3d65dcfe3504689bfc5b6e67d502780aacad41 (main, 2024-09-09, "24.07 perf numbers"; the page's last revision
  before it moved to docs.nvidia.com): "Container: NeMo24.07, System: DGX-H100", pre-training at FP8, tokens per
  second per GPU. The two revisions on main before it for the same container (4c73f77, 2024-08-14; 3a8081f,
  2024-08-22, "24.07 vboost numbers": runs with the boost slider raised, which moves power toward the SMs) move rows
  by up to 6% (GPT3-175B on 512 GPUs 782, 832, 825; LLAMA3-8B 12,036, 11,883, 12,273): what one of these figures
  can be predicted to is bounded so, and the clocks they ran at are not all the same.
- at 35029a0c84e7c9f2c56e2b2256746654a5084432 (2024-10-07), the same page with its "Long Input Sequences" table:
  LLAMA2-7B in fp8 from 4k to 1M tokens (container NeMo24.03.01.framework), context parallelism up to 32.

Settings. Each row runs the layout the page prints (GBS, MBS, TP, PP, CP, VP) with the recipe NeMo-Framework-
Launcher held at the container's release (tags 24.07 and 24.03.01, launcher_scripts/conf/training/):

- GPT-3 5B, 20B and 175B (gpt3/*.yaml): hidden and attention dropout 0.1, LayerNorm, bias-GeLU, tied embeddings, the
  GPT-2 vocabulary; megatron-core-0.8's kernel list, as the DGX Cloud GPT-3 recipe. 20B runs userbuffers with its
  ub cfg (ub_cfg_h100_h6144_tp2_mbs2_seqlen2048); 175B names a cfg but sets ub_tp_comm_overlap False, so its tensor-
  parallel collectives overlap as Transformer Engine does without userbuffers (`backward`: the input's re-gather
  under the input-gradient GEMM, the gradient's reduce-scatter under the weight-gradient GEMM, v1.7
  module/linear.py async_op).
- Llama 2 (llama/llama2_*.yaml): fused RoPE, no dropout, no `cross_entropy_loss_fusion` (added at 24.09), so the
  unfused cross-entropy; 70B with userbuffers and its cfg (the stack's margins and bulk SMs).
- Llama 3 8B and 70B (llama/llama3_*.yaml): the fused cross-entropy; 70B with userbuffers and its cfg
  (ub_cfg_h100_h8192_tp4_mbs1_seqlen8192, the 24.12 recipe's values).
- Nemotron 8B and 22B (nemotron/nemotron_{8b,22b}.yaml) as NeMo 24.12's Nemotron-4 recipes run them: LayerNorm1p,
  squared ReLU, the fused cross-entropy, userbuffers with Transformer Engine's defaults. Nemotron-4 340B runs the
  24.12 recipe whole (benchmarks/published_nemotron.py; its layout is this row's).
- Long sequences (llama/llama2_7b.yaml at 24.03.01): no sequence parallelism and no userbuffers, the unfused
  cross-entropy.
- Every row: FlashAttention-2, because the launcher exports NVTE_FUSED_ATTN=0 to every run at both tags ("Disable
  cudnn FA until we've tested it more", launcher_scripts/conf/config.yaml), not cuDNN's fused attention as the 24.12
  Llama and GPT-3 recipes run; vocabularies padded to a multiple of 128 · tp, as Megatron pads them.

Left out: GPT3-175B on 512 GPUs, whose TFLOP/s cell links to MLCommons: NVIDIA's MLPerf Training submission, a stack
of its own.

Run as part of benchmarks/published_figures.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from benchmarks.published import (
    _MCORE,
    DGXC_H100,
    DGXC_STACK_OVERRIDES,
    TE_DEFAULT_TP_OVERLAP,
    UNFUSED_CROSS_ENTROPY,
    _cluster,
    _gpt,
    _layout,
    dgxc_plan,
)
from benchmarks.published_nemotron import NEMOTRON_H100, NemotronRow, _layer, nemotron_plan
from plan import loader
from plan.schema import Plan
from twin import api
from twin.step.predict import predict

SOURCE = "NVIDIA/NeMo docs/source/performance/performance_summary.md at 8e3d65d (NeMo 24.07, DGX-H100, fp8)"
LONG_SOURCE = "NVIDIA/NeMo docs/source/performance/performance_summary.md at 35029a0 (NeMo 24.03.01, DGX-H100, fp8)"


def _llama2(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int) -> dict[str, Any]:
    """Llama 2 (Touvron et al. 2023, Table 1 and its released configs; launcher llama/llama2_*.yaml): RMSNorm,
    SwiGLU, RoPE, no biases, its 32,000-token vocabulary."""
    return {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "ffn_hidden": ffn,
            "vocab": 32000, "seq_len": 4096, "glu": True}  # fmt: skip


def _nemotron(layers: int, hidden: int, heads: int) -> dict[str, Any]:
    """Nemotron 8B and 22B (launcher nemotron/nemotron_{8b,22b}.yaml): multi-head attention, squared ReLU of 4x
    width, no biases, untied embeddings, Nemotron-4's 256,000-token vocabulary, context 4,096."""
    return {"layers": layers, "hidden": hidden, "heads": heads, "ffn_hidden": 4 * hidden, "vocab": 256000,
            "seq_len": 4096, "glu": False}  # fmt: skip


def _padded(vocab: int, tp: int) -> int:
    """Megatron's vocabulary padding: up to a multiple of make_vocab_size_divisible_by (128) times tp."""
    step = 128 * tp
    return -(-vocab // step) * step


@dataclass(frozen=True)
class NemoRow:
    """One pre-training row of the page: its layout and published tokens per second per GPU."""

    model: str
    gpus: int
    batch: int
    microbatch: int
    seq: int
    tp: int
    pp: int
    cp: int
    virtual: int
    tokens_per_gpu: float


NEMO_2407_H100 = (
    NemoRow("gpt3-5b", 64, 2048, 4, 2048, 1, 1, 1, 1, 23406),
    NemoRow("gpt3-20b", 64, 256, 2, 2048, 2, 1, 1, 1, 5851),
    NemoRow("gpt3-175b", 128, 256, 1, 2048, 4, 8, 1, 6, 716),
    NemoRow("llama2-7b", 8, 128, 1, 4096, 1, 1, 1, 1, 16934),
    NemoRow("llama2-13b", 16, 128, 1, 4096, 1, 4, 1, 10, 8715),
    NemoRow("llama2-70b", 64, 128, 1, 4096, 4, 4, 1, 20, 1728),
    NemoRow("nemotron-8b", 64, 256, 4, 4096, 2, 1, 1, 1, 12507),
    NemoRow("nemotron-22b", 64, 256, 2, 4096, 2, 4, 1, 10, 4312),
    NemoRow("nemotron4-340b", 128, 32, 1, 4096, 8, 8, 1, 12, 326),
    NemoRow("llama3-8b", 8, 128, 1, 8192, 1, 1, 2, 1, 12273),
    NemoRow("llama3-70b", 64, 128, 1, 8192, 4, 4, 2, 5, 1524),
)

NEMO_LONG_H100 = tuple(
    NemoRow("llama2-7b", gpus, batch, 1, k * 1024, tp, pp, cp, 1, tokens)
    for k, gpus, batch, tp, pp, cp, tokens in (
        (4, 4, 1024, 1, 1, 1, 16671),
        (8, 8, 512, 1, 2, 1, 13907),
        (16, 16, 256, 2, 1, 1, 10082),
        (32, 32, 128, 2, 1, 2, 6687),
        (64, 64, 64, 4, 1, 2, 4021),
        (128, 128, 32, 4, 1, 4, 2260),
        (256, 256, 16, 4, 1, 8, 1214),
        (512, 512, 8, 8, 1, 16, 635),
        (1024, 1024, 4, 8, 1, 32, 318),
    )
)
"""The Long Input Sequences table: LLAMA2-7B, micro-batch 1, data parallel over what TP · PP · CP leave."""

_GPT = {"layer": [k.model_dump() for k in _MCORE.layer], "head_kernels": UNFUSED_CROSS_ENTROPY}
_NEMOTRON = {"layer": _layer(), **TE_DEFAULT_TP_OVERLAP}
RECIPES: dict[str, tuple[dict[str, Any] | str, dict[str, Any]]] = {
    # model: (architecture, its vocabulary unpadded, or preset; stack overrides beyond FlashAttention-2)
    "gpt3-5b": (_gpt(24, 4096, 32, 50257, 2048, tied=True), _GPT),
    # gpt3/20b.yaml's ub cfg (ub_cfg_h100_h6144_tp2_mbs2_seqlen2048): proj and fc2 forward with 16 and 24 SMs
    # withheld, the bulk overlaps 8, 16, 4, 16 SMs (mean 11)
    "gpt3-20b": (
        _gpt(44, 6144, 48, 50257, 2048, tied=True),
        {**_GPT, "tp_overlap_sm_margin": {"proj": 16, "fc2": 24}, "tp_overlap_sms": 11},
    ),
    "gpt3-175b": ("gpt3-175b", {**_GPT, "tp_overlap": "backward"}),
    "llama2-7b": (_llama2(32, 4096, 32, 32, 11008), {"head_kernels": UNFUSED_CROSS_ENTROPY}),
    "llama2-13b": (_llama2(40, 5120, 40, 40, 13824), {"head_kernels": UNFUSED_CROSS_ENTROPY}),
    # llama2_70b.yaml's ub cfg: proj and fc2 forward with 24 and 16 SMs withheld, bulk 8, 16, 2, 4 (the stack's)
    "llama2-70b": (_llama2(80, 8192, 64, 8, 28672), {"head_kernels": UNFUSED_CROSS_ENTROPY}),
    "nemotron-8b": (_nemotron(32, 4096, 32), _NEMOTRON),
    "nemotron-22b": (_nemotron(40, 6144, 48), _NEMOTRON),
    "llama3-8b": ("llama3-8b", {}),
    "llama3-70b": ("llama3-70b", DGXC_STACK_OVERRIDES["llama3-70b"]),
}
LONG_SEQUENCE = {"head_kernels": UNFUSED_CROSS_ENTROPY, "tp_overlap": "backward"}
"""llama2_7b.yaml at 24.03.01: no userbuffers (Transformer Engine's own backward overlap), no fused cross-entropy."""


def nemo_plan(row: NemoRow, long_sequence: bool = False) -> Plan:
    """The row's layout under its release's recipe, FlashAttention-2 (NVTE_FUSED_ATTN=0). Nemotron-4 340B runs NeMo
    24.12's recipe (benchmarks/published_nemotron.py), whose layout is this row's and which runs FlashAttention-2
    too."""
    if row.model == "nemotron4-340b":
        plan = nemotron_plan(NemotronRow(row.model, row.gpus, "fp8", 0.0))
        assert layout_of(row.model, plan) == layout_of(row), "the 24.12 Nemotron-4 340B recipe left this row's layout"
        return plan
    model, overrides = RECIPES[row.model]
    if isinstance(model, str):
        model = loader.expand_model({"model": model}, model)["model"]
    else:
        model = {**model, "vocab": _padded(model["vocab"], row.tp)}
    overrides = {**(LONG_SEQUENCE if long_sequence else overrides), "attention_kernel": "fa2"}
    dp = row.gpus // (row.tp * row.pp * row.cp)
    return api.load_plan(
        {
            "name": f"nemo-{row.model}-{row.gpus}-{row.seq}",
            "model": {**model, "seq_len": row.seq},
            "cluster": _cluster("dgx-h100-superpod", row.gpus, 16384),
            "stack": {"name": "nemo-24.12", "overrides": overrides},
            "layout": _layout(
                row.tp,
                row.pp,
                dp,
                row.microbatch,
                row.virtual,
                cp=row.cp,
                zero=1,
                sequence_parallel=row.tp > 1 and not long_sequence,
            ),
            "training": {"global_batch": row.batch, "tokens": 1e12, "dtype": "fp8"},
        }
    )


def release_gains() -> list[tuple[str, float, float]]:
    """(row, published, predicted): NeMo 24.12's tokens per GPU over 24.07's, less one, for the rows both releases
    ran with one layout, batch and sequence. 24.12 runs cuDNN's fused attention where 24.07 ran FlashAttention-2,
    except for Nemotron-4 340B, which runs FlashAttention-2 in both; the twin is given each release's recipe."""
    newer = {layout_of(model, plan): (plan, step) for model, plan, step in _recipes_of_24_12()}
    out = []
    for row in NEMO_2407_H100:
        if (recipe := newer.get(layout_of(row))) is None:
            continue
        plan, step = recipe
        published = row.seq * row.batch / row.gpus / step / row.tokens_per_gpu - 1
        predicted = predict(nemo_plan(row)).step_time_s / predict(plan).step_time_s - 1
        out.append((f"{row.model}, {row.gpus} H100", published, predicted))
    return out


def layout_of(row_or_model: NemoRow | str, plan: Plan | None = None) -> NemoRow:
    """What two runs must share to compare releases: a row of this page without its figure, or the same read off a
    plan of `model`."""
    if isinstance(row_or_model, NemoRow):
        return replace(row_or_model, tokens_per_gpu=0.0)
    assert plan is not None
    lay = plan.layout
    batch, seq = plan.training.global_batch, plan.model.seq_len
    return NemoRow(row_or_model, lay.world_size, batch, lay.microbatch_size, seq, lay.tp, lay.pp, lay.cp,
                   lay.virtual_stages, 0.0)  # fmt: skip


def _recipes_of_24_12() -> list[tuple[str, Plan, float]]:
    """NeMo 24.12's fp8 recipe rows (DGX Cloud v25.02): model, plan, published step seconds."""
    dgxc = [(r.model, dgxc_plan(r), r.step_s) for r in DGXC_H100 if r.dtype == "fp8"]
    nemotron = [(r.model, nemotron_plan(r), r.step_s) for r in NEMOTRON_H100 if r.dtype == "fp8"]
    return dgxc + nemotron
