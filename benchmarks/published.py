"""Published training runs the twin is checked against, as plans built the way each paper ran them, and each
paper's own throughput convention. Data for tests and benchmarks/published_figures.py; the twin never reads it.

Four development tables (every figure public; see ../shared/published and the sources in each row's docstring):

- Narayanan et al. 2021 (SC21), Table 1: GPT 1.7B-1T on A100, Megatron-LM of 2021.
- Megatron-Core r0.8.0's H100 weak-scaling table (NVIDIA/Megatron-LM README image, commit f2e5db402c, 2024-07).
- Megatron-LM's A100 README table of 2022-05 to 2024-07 (Korthikanti et al. 2022's runs at DP = 1).
- Llama 3 405B, Dubey et al. 2024, Table 4.

And NVIDIA's DGX Cloud benchmark recipes (NVIDIA/dgxc-benchmarking v25.02, NeMo 24.12), whose settings are
published whole: the bf16 rows are the table the H100's in-training fraction is fitted on (benchmarks/
fit_in_training.py); the fp8 rows are left out of that fit. The same release's Grok-1 314B recipe (an MoE of 8
experts, top-2, over EP8) is the MoE table; no fit touches it.

Where a paper is silent, the choice below was fixed before any prediction was compared, and is said.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plan import loader
from plan.schema import Plan
from twin import api

A100_NODE_GPUS = 8


MEGATRON_DEFAULT_VIRTUAL_STAGES = 1
"""Where a Megatron run's interleaving is not published: Megatron's default, none
(--num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size default None; megatron/training/
arguments.py), as ../shared/published/megatron-core-h100.md asks (its published defaults, not a choice per row)."""


def _layout(tp: int, pp: int, dp: int, mbs: int, virtual: int, **extra: Any) -> dict[str, Any]:
    interleaved = pp > 1 and virtual > 1
    return {
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "microbatch_size": mbs,
        "schedule": "interleaved-1f1b" if interleaved else "1f1b",
        "virtual_stages": virtual if interleaved else 1,
        **extra,
    }


def _cluster(name: str, gpus: int, catalogue_gpus: int) -> dict[str, Any]:
    """The catalogue cluster, grown by a what-if where the run used more GPUs than the catalogue file holds."""
    nodes = -(-gpus // A100_NODE_GPUS)
    return {"name": name, "overrides": {"nodes": nodes} if gpus > catalogue_gpus else {}}


def vp_label(virtual: int) -> str:
    """A layout label's interleaving suffix: " VP4", or nothing where the schedule is not interleaved."""
    return f" VP{virtual}" if virtual > 1 else ""


def _gpt(layers: int, hidden: int, heads: int, vocab: int, seq: int, tied: bool) -> dict[str, Any]:
    """A GPT of the Megatron papers: 4h GeLU MLP, multi-head attention, LayerNorm, biases."""
    return {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "ffn_hidden": 4 * hidden,
        "vocab": vocab,
        "seq_len": seq,
        "glu": False,
        "tied_embeddings": tied,
    }


# --- Narayanan et al. 2021, Table 1 ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NarayananRow:
    """One row of Narayanan et al. 2021, Table 1: GPT with vocab 51,200 and sequence 2,048 on A100 (Selene), fp16,
    full recompute. Micro-batch size and interleaving as the paper's own script sets them (Megatron-LM
    examples/sc21/run_table_1.sh, commit 6985e58938)."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    mbs: int
    virtual: int
    tflops: float
    """Achieved TFLOP/s per GPU by the paper's formula F = 96·B·s·l·h²·(1 + s/6h + V/16lh), recompute included."""


NARAYANAN_TABLE_1 = (
    NarayananRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    NarayananRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138),
    NarayananRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142),
    NarayananRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135),
    NarayananRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138),
    NarayananRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    NarayananRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
    NarayananRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155),
    NarayananRow(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163),
    NarayananRow(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163),
)


def narayanan_plan(row: NarayananRow) -> Plan:
    dp = row.gpus // (row.tp * row.pp)
    return api.load_plan(
        {
            "name": f"narayanan-{row.params_b:g}b",
            "model": _gpt(row.layers, row.hidden, row.heads, 51200, 2048, tied=True),
            "cluster": _cluster("dgx-a100-superpod", row.gpus, 1120),
            "stack": "megatron-lm-2021",
            "layout": _layout(row.tp, row.pp, dp, row.mbs, row.virtual, recompute="full"),
            "training": {"global_batch": row.batch, "tokens": 300e9, "dtype": "fp16"},
        }
    )


def narayanan_tflops(row: NarayananRow, step_s: float) -> float:
    """The paper's per-GPU TFLOP/s for a step of `step_s` seconds (its F formula, which counts recompute)."""
    s, h, lay, v = 2048, row.hidden, row.layers, 51200
    flops = 96 * row.batch * s * lay * h**2 * (1 + s / (6 * h) + v / (16 * lay * h))
    return flops / step_s / row.gpus / 1e12


# --- Megatron-Core r0.8.0 on H100 -----------------------------------------------------------------------------


@dataclass(frozen=True)
class McoreRow:
    """One row of Megatron-Core r0.8.0's H100 weak-scaling table (../shared/published/megatron-core-h100.md): GPT
    with vocab 131,072 and sequence 4,096, DP 48, bf16, and where the README is silent Megatron-Core's defaults:
    no recompute (the 462B row fits without it), micro-batch 1; interleaved where the row is pipelined
    (`mcore_virtual_stages`)."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    dp: int
    batch: int
    tflops: float
    """TFLOP/s per GPU by Megatron-Core's num_floating_point_operations (no recompute)."""


MCORE_H100 = (
    McoreRow("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    McoreRow("7.1B", 32, 4096, 30, 2, 1, 48, 192, 465.9),
    McoreRow("16B", 48, 6144, 32, 4, 1, 48, 192, 489.1),
    McoreRow("32B", 56, 7168, 48, 8, 1, 48, 192, 459.6),
    McoreRow("70B", 64, 8192, 84, 8, 2, 48, 384, 419.7),
    McoreRow("119B", 80, 10240, 92, 8, 4, 48, 768, 420.5),
    McoreRow("177B", 96, 12288, 96, 8, 6, 48, 1152, 432.8),
    McoreRow("314B", 128, 16384, 96, 8, 8, 48, 1536, 474.4),
    McoreRow("462B", 144, 18432, 112, 8, 16, 48, 3072, 459.9),
)


MCORE_VIRTUAL_CHOICES = (6, 4, 3, 2)
"""Virtual stages per pipeline rank, largest first, that issue 13 fixed before predicting where a run's
interleaving is not published."""


def mcore_virtual_stages(row: McoreRow) -> int:
    """Virtual stages of a pipelined row: the largest of 6, 4, 3, 2 that divides its layers per pipeline rank, and
    where none does (119B's 23 layers a rank, 462B's 7) one layer per virtual stage, the only interleaving those
    counts allow. Every pipelined row is interleaved because the README lists pipeline-parallel communication among
    the overlaps the runs used ("enabled by default"), and Megatron-LM overlaps it only under the interleaved
    schedule: --no-overlap-p2p-communication defaults the overlap on and validate_args turns it off otherwise
    ("Overlap P2P communication is disabled if not using the interleaved schedule", megatron/training/arguments.py).
    The figures agree (benchmarks/mcore_budget.py): the strong-scaling point of 42% at 4,608 GPUs (12 microbatches a
    pipeline) is out of reach of the non-interleaved 1F1B's 5/12 bubble, and so is the 462B row, whose compute, TP
    and 15/64 bubble alone already outlast its published step. One layer per virtual stage is the smallest bubble
    119B and 462B allow: of the interleavings they could have run, the most optimistic."""
    per_rank = row.layers // row.pp
    if row.pp == 1:
        return 1
    return next((v for v in MCORE_VIRTUAL_CHOICES if per_rank % v == 0), per_rank)


def mcore_plan(row: McoreRow, virtual: int | None = None) -> Plan:
    """The row as a plan; `virtual` stages per pipeline rank where a what-if asks (benchmarks/mcore_budget.py),
    else `mcore_virtual_stages`."""
    virtual = mcore_virtual_stages(row) if virtual is None else virtual
    return api.load_plan(
        {
            "name": f"mcore-h100-{row.name.lower()}",
            "model": _gpt(row.layers, row.hidden, row.heads, 131072, 4096, tied=False),
            "cluster": _cluster("dgx-h100-superpod", row.tp * row.pp * row.dp, 16384),
            "stack": "megatron-core-0.8",
            "layout": _layout(
                row.tp,
                row.pp,
                row.dp,
                1,
                virtual,
                zero=1,
                sequence_parallel=row.tp > 1,
            ),
            "training": {"global_batch": row.batch, "tokens": 300e9, "dtype": "bf16"},
        }
    )


def megatron_tflops(plan: Plan, step_s: float) -> float:
    """Per-GPU TFLOP/s by Megatron-Core's own count (core_v0.9.0 training.py num_floating_point_operations, the same
    as r0.8.0's for dense GPTs): 12·B·s·l·h²·[(1 + g/a + s/h)·q/h + (f/h)·k·glu + V/(2·l·h)], f the MLP's width (an
    expert's, where the model routes) and k the experts a token is routed to (1 for a dense model), full (uncausal)
    attention, no recompute."""
    m, tr = plan.model, plan.training
    s, h, layers = m.seq_len, m.hidden, m.layers
    q = m.heads * m.d_head
    ffn, routed = (m.moe_ffn_hidden or m.ffn_hidden, m.top_k) if m.experts else (m.ffn_hidden, 1)
    glu = 1.5 if m.glu else 1.0
    per_layer = (1 + m.n_kv_heads / m.heads + s / h) * q / h + ffn / h * routed * glu + m.vocab / (2 * layers * h)
    flops = 12 * tr.global_batch * s * layers * h * h * per_layer
    return flops / step_s / plan.layout.world_size / 1e12


def mcore_tflops(row: McoreRow, step_s: float) -> float:
    """Megatron-Core's per-GPU TFLOP/s for a row of its r0.8.0 H100 table (`megatron_tflops` of the row's plan)."""
    return megatron_tflops(mcore_plan(row), step_s)


# --- Megatron-LM A100 README table (Korthikanti et al. 2022), DP = 1 -------------------------------------------


@dataclass(frozen=True)
class KorthikantiRow:
    """One row of Megatron-LM's A100 README table (2022-05 to 2024-07), measured at DP = 1 with sequence
    parallelism and selective recompute: GPT, vocab 51,200, sequence 2,048, on Selene. Layouts from Korthikanti et
    al. 2022 (Table 3); fp16 and interleaving are not stated — fp16 as the 2021 script, no interleaving (Megatron's
    default)."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    batch: int
    mbs: int
    mfu: float
    hfu: float


KORTHIKANTI_A100 = (
    KorthikantiRow("22B", 64, 6144, 48, 8, 1, 4, 4, 0.415, 0.437),
    KorthikantiRow("175B", 96, 12288, 96, 8, 8, 64, 1, 0.514, 0.528),
    KorthikantiRow("530B", 128, 20480, 105, 8, 35, 280, 1, 0.560, 0.570),
    KorthikantiRow("1T", 160, 25600, 128, 8, 64, 512, 1, 0.563, 0.570),
)


def korthikanti_plan(row: KorthikantiRow) -> Plan:
    return api.load_plan(
        {
            "name": f"megatron-a100-{row.name.lower()}",
            "model": _gpt(row.layers, row.hidden, row.heads, 51200, 2048, tied=True),
            "cluster": _cluster("dgx-a100-superpod", row.tp * row.pp, 1120),
            "stack": "megatron-lm-2022",
            "layout": _layout(
                row.tp,
                row.pp,
                1,
                row.mbs,
                MEGATRON_DEFAULT_VIRTUAL_STAGES,
                recompute="selective",
                sequence_parallel=True,
            ),
            "training": {"global_batch": row.batch, "tokens": 300e9, "dtype": "fp16"},
        }
    )


def korthikanti_mfu(row: KorthikantiRow, step_s: float) -> float:
    """The README's MFU (Korthikanti et al. 2022): 72·B·s·l·h²·(1 + s/6h + V/12lh) FLOPs per step over the A100's
    312 TFLOP/s."""
    s, h, lay, v = 2048, row.hidden, row.layers, 51200
    flops = 72 * row.batch * s * lay * h**2 * (1 + s / (6 * h) + v / (12 * lay * h))
    return flops / step_s / (row.tp * row.pp) / 312e12


# --- Llama 3 405B, Table 4 ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaRow:
    """Llama 3 405B pre-training, Dubey et al. 2024, Table 4 (BF16 MFU by Chowdhery et al.'s convention): TP8,
    PP16, no activation recompute at 8k tokens (§3.3.2), 16M tokens per step. The 131k row reads DP 8 (the table
    prints 4 in one version; only 8 gives 16,384 GPUs and 16M tokens)."""

    gpus: int
    cp: int
    dp: int
    seq: int
    batch_per_dp: int
    tflops: float
    mfu: float


LLAMA3_TABLE_4 = (
    LlamaRow(8192, 1, 64, 8192, 32, 430, 0.43),
    LlamaRow(16384, 1, 128, 8192, 16, 400, 0.41),
    LlamaRow(16384, 16, 8, 131072, 16, 380, 0.38),
)


LLAMA3_EDGE_STAGE_TRIM = 1
"""Llama 3 §3.3.2: "we reduce one Transformer layer each from the first and the last stages ... the first model
chunk on the first stage has only the embedding, and the last model chunk on the last stage has only output
projection and loss calculation" — so a chunk is one layer: 126 layers and two empty chunks over PP16 x V8."""


def llama_plan(row: LlamaRow) -> Plan:
    """The row as §3.3.2 describes it: interleaved 1F1B with one layer per chunk (V = 8), no recompute, FSDP
    sharding optimizer state and gradients (ZeRO-2), CP by all-gather, on the llama3-405b-16k preset's cluster."""
    return api.load_plan(
        {
            "name": f"llama3-405b-{row.gpus}-cp{row.cp}",
            "model": {**loader.expand_model({"model": "llama3-405b"}, "llama3")["model"], "seq_len": row.seq},
            "cluster": "meta-24k-h100-roce",
            "stack": "llama3",
            "layout": _layout(
                8,
                16,
                row.dp,
                1,
                8,
                cp=row.cp,
                cp_algorithm="all-gather",
                zero=2,
                sequence_parallel=True,
                rank_order="tp-cp-pp-dp",
                edge_stage_trim=LLAMA3_EDGE_STAGE_TRIM,
            ),
            "training": {"global_batch": row.dp * row.batch_per_dp, "tokens": 15.6e12, "dtype": "bf16"},
        }
    )


# --- NVIDIA DGX Cloud benchmark recipes (NeMo 24.12), H100 ------------------------------------------------------


@dataclass(frozen=True)
class DgxcRow:
    """One published step time of NVIDIA/dgxc-benchmarking at 8f5cbb3 (v25.02, nvcr.io/nvidia/nemo:24.12), with
    the recipe's own layout (llama3.1/README_{8b,70b,405b}.md, nemo_megatron/README_175b.md and the yaml files beside
    them): micro-batch 1, no recompute, the stack nemo-24.12."""

    model: str
    """Model preset (Llama 3.1 shares Llama 3's architecture; GPT-3 175B as Brown et al.)."""
    seq: int
    gpus: int
    tp: int
    pp: int
    cp: int
    virtual: int
    batch: int
    dtype: str
    step_s: float
    """Published training step time (seconds per step)."""


DGXC_H100 = (
    DgxcRow("llama3-8b", 8192, 8, 1, 1, 2, 1, 128, "bf16", 12.78),
    DgxcRow("llama3-8b", 8192, 128, 1, 1, 2, 1, 2048, "bf16", 13.16),
    DgxcRow("llama3-70b", 8192, 64, 4, 4, 2, 5, 128, "bf16", 14.61),
    DgxcRow("llama3-70b", 8192, 2048, 4, 4, 2, 5, 4096, "bf16", 14.84),
    DgxcRow("llama3-405b", 8192, 576, 8, 9, 2, 7, 252, "bf16", 17.50),
    DgxcRow("llama3-405b", 8192, 2304, 8, 9, 2, 7, 1008, "bf16", 17.70),
    DgxcRow("gpt3-175b", 2048, 128, 4, 8, 1, 12, 256, "bf16", 8.309),
    DgxcRow("gpt3-175b", 2048, 2048, 4, 8, 1, 12, 4096, "bf16", 8.49),
    DgxcRow("llama3-8b", 8192, 8, 1, 1, 2, 1, 128, "fp8", 9.44),
    DgxcRow("llama3-8b", 8192, 128, 1, 1, 2, 1, 2048, "fp8", 9.73),
    DgxcRow("llama3-70b", 8192, 64, 4, 4, 2, 5, 128, "fp8", 10.46),
    DgxcRow("llama3-70b", 8192, 2048, 4, 4, 2, 5, 4096, "fp8", 10.99),
    DgxcRow("llama3-405b", 8192, 576, 8, 9, 2, 7, 252, "fp8", 11.00),
    DgxcRow("llama3-405b", 8192, 2304, 8, 9, 2, 7, 1008, "fp8", 11.20),
    DgxcRow("gpt3-175b", 2048, 128, 4, 8, 1, 12, 256, "fp8", 5.626),
    DgxcRow("gpt3-175b", 2048, 2048, 4, 8, 1, 12, 4096, "fp8", 5.96),
)


_MCORE = loader.load_stack("megatron-core-0.8")
UNFUSED_CROSS_ENTROPY = [k.model_dump() for k in _MCORE.head_kernels]
"""Megatron-Core's vocab-parallel cross-entropy over fp32 logits, as megatron-core-0.8 lists it: NeMo 24.12's
default where a recipe leaves cross_entropy_loss_fusion unset (the Llama 3.1 recipes set it on)."""

DGXC_STACK_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama3-405b": {"fp8_reduce_scatter": True, "tp_overlap_sm_margin": {"proj": 24, "fc2": 8}},
    "llama3-70b": {"tp_overlap_sms": 8.5},
    "gpt3-175b": {
        "layer": [k.model_dump() for k in _MCORE.layer],
        "head_kernels": UNFUSED_CROSS_ENTROPY,
        "tp_overlap_sm_margin": {"proj": 24, "fc2": 20},
        "tp_overlap_sms": 4.5,
    },
}
"""What a recipe sets beyond the stack. Each TP-overlapped recipe's ub_tp_comm_overlap_cfg (llama3.1/llama3.1_
{70b,405b}.yaml, nemo_megatron/gpt3_175b_hydra.yaml) withholds SMs from the proj and fc2 forward GEMMs for their
reduce-scatters (set_sm_margin: 70B 24 and 16, the stack's, 405B 24 and 8, GPT-3 24 and 20) and gives its bulk
collectives their own SMs (qkv_dgrad, qkv_wgrad, fc1_dgrad, fc1_wgrad: 70B 4, 24, 2, 4; 405B 2, 24, 2, 2, the
stack's mean; GPT-3 4, 8, 2, 4; `tp_overlap_sms` is their mean). llama3.1/configure.sh gives 405B fp8 userbuffers
for the proj and fc2 forward reduce-scatters (ub_tp_comm_overlap_cfg.{proj,fc2}_fprop.fp8_buf=$FP8_ENABLED).
nemo_megatron/gpt3_175b_hydra.yaml runs NeMo's GPT defaults: LayerNorm, learned positions (no RoPE), bias-GeLU,
hidden and attention dropout 0.1 (bias_dropout_add_fusion) and the unfused cross-entropy: megatron-core-0.8's kernel
list (its fp8_params: true, line 221, is the stack's)."""


def dgxc_plan(row: DgxcRow, overrides: list[str] | None = None) -> Plan:
    """The recipe on DGX H100 SuperPOD nodes (DGX Cloud), ZeRO-1 (the distributed optimizer), sequence parallel
    where tp > 1, interleaved where the recipe sets VP."""
    dp = row.gpus // (row.tp * row.pp * row.cp)
    return api.load_plan(
        {
            "name": f"dgxc-{row.model}-{row.gpus}-{row.dtype}",
            "model": {**loader.expand_model({"model": row.model}, row.model)["model"], "seq_len": row.seq},
            "cluster": _cluster("dgx-h100-superpod", row.gpus, 16384),
            "stack": {"name": "nemo-24.12", "overrides": DGXC_STACK_OVERRIDES.get(row.model, {})},
            "layout": _layout(row.tp, row.pp, dp, 1, row.virtual, cp=row.cp, zero=1, sequence_parallel=row.tp > 1),
            "training": {"global_batch": row.batch, "tokens": 1e12, "dtype": row.dtype},
        },
        overrides or [],
    )


@dataclass(frozen=True)
class GrokRow:
    """One published step time of NVIDIA/dgxc-benchmarking at 8f5cbb3 (v25.02, nvcr.io/nvidia/nemo:24.12),
    grok1/README_314b.md, with grok1/grok1_314b.yaml's settings: Grok-1 with the Llama 3 tokenizer (vocabulary
    128,256), micro-batch 1, no recompute, sequence parallel, the all-to-all dispatcher padding every expert to
    capacity factor 1.0, userbuffers TP overlap (grok1/configure.sh sets model.ub_tp_comm_overlap=true over the yaml's
    false), the unfused cross-entropy. Below 512 GPUs the recipe runs
    proxies with fewer layers (and the first three at sequence 4,096), as the README says."""

    gpus: int
    seq: int
    layers: int
    tp: int
    pp: int
    cp: int
    ep: int
    virtual: int
    batch: int
    bf16_s: float
    fp8_s: float
    """Published training step times (seconds per step)."""


DGXC_GROK_H100 = (
    GrokRow(8, 4096, 2, 4, 1, 1, 2, 1, 1024, 24.00, 19.71),
    GrokRow(16, 4096, 4, 4, 1, 1, 4, 1, 1024, 21.71, 17.80),
    GrokRow(32, 4096, 4, 4, 1, 1, 8, 1, 1024, 10.70, 8.70),
    GrokRow(64, 8192, 8, 4, 1, 2, 8, 1, 1024, 21.42, 17.53),
    GrokRow(128, 8192, 16, 4, 2, 2, 8, 8, 1024, 20.73, 16.70),
    GrokRow(256, 8192, 32, 4, 4, 2, 8, 8, 1024, 20.83, 16.75),
    GrokRow(512, 8192, 64, 4, 8, 2, 8, 8, 1024, 21.01, 16.90),
    GrokRow(1024, 8192, 64, 4, 8, 2, 8, 8, 2048, 21.20, 17.01),
    GrokRow(2048, 8192, 64, 4, 8, 2, 8, 8, 4096, 21.29, 17.30),
)


TE_DEFAULT_TP_OVERLAP: dict[str, Any] = {"tp_overlap_sm_margin": {}, "tp_overlap_sms": 16}
"""A recipe that turns userbuffers on without a cfg (grok1_314b.yaml ub_tp_comm_overlap_cfg: null,
nemotron4-*-synth.yaml none): Transformer Engine 1.13's defaults, 16 SMs for each SM-driven collective, no margin."""

GROK_STACK_OVERRIDES: dict[str, Any] = {
    "head_kernels": UNFUSED_CROSS_ENTROPY,
    "attention_kernel": "fa2",
    **TE_DEFAULT_TP_OVERLAP,
}
"""What the Grok-1 recipe runs beyond the stack: the unfused cross-entropy, and FlashAttention-2 rather than cuDNN's
fused attention (grok1/configure.sh exports NVTE_FUSED_ATTN=0, which turns Transformer Engine's cuDNN backend off,
leaving the flash-attn package; the Llama 3.1 and GPT-3 recipes export NVTE_FUSED_ATTN=1)."""


def grok_plan(row: GrokRow, dtype: str) -> Plan:
    """The Grok-1 recipe on DGX H100 SuperPOD nodes: ZeRO-1 (the distributed optimizer), the experts over ep
    inside dp (the README's DP column counts replicas of the whole ep group), interleaved where it sets VP."""
    model = loader.expand_model({"model": "grok-1"}, "grok-1")["model"]
    model = {**model, "seq_len": row.seq, "layers": row.layers, "vocab": 128256, "capacity_factor": 1.0}
    dp = row.gpus // (row.tp * row.pp * row.cp)
    return api.load_plan(
        {
            "name": f"dgxc-grok1-{row.gpus}-{dtype}",
            "model": model,
            "cluster": _cluster("dgx-h100-superpod", row.gpus, 16384),
            "stack": {"name": "nemo-24.12", "overrides": GROK_STACK_OVERRIDES},
            "layout": _layout(row.tp, row.pp, dp, 1, row.virtual, cp=row.cp, ep=row.ep, zero=1, sequence_parallel=True),
            "training": {"global_batch": row.batch, "tokens": 1e12, "dtype": dtype},
        }
    )


LLAMA3_TABLE_5 = {
    "gpu": 165,
    "hbm": 72,
    "sram": 19,
    "nic": 7,
    "switch": 35,
    "host": 46,
    "software": 63,
    "sdc": 6,
    "thermal": 6,
    "planned": 47,
}
"""Llama 3 405B's 54-day interruptions (Dubey et al. 2024, Table 5 and §3.3.4: 419 unexpected + 47 planned on
2,048 nodes), grouped into the twin's failure causes as topologies/*.yaml group them."""
