"""Megatron-Bridge's DGX-H100 Llama 3 pre-training rows, NeMo 25.11 to 26.06, fp8 with current scaling: a
validation table from releases after the DGX Cloud recipes (NeMo 24.12) that `compute.in_training_fraction` was
fitted on, run by a newer stack (Transformer Engine 2.x, per-tensor current scaling).

Source: NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md at 067f987 (sections "25.11 NeMo Container"
to "26.06 NeMo Container", System DGX-H100; tokens per second per GPU). Which release ran which code: the repo's
docs/versions1.json and docs/releases/software-versions.md (25.11 = v0.2.0, 26.02 = v0.3.0, 26.02.01 = v0.3.1, 26.04
= v0.4.0, 26.04.01 = v0.4.2, 26.06 = v0.5.0). Every row's settings are that tag's scripts/performance recipe for
H100 FP8_CS (the `nemo-25.11` stack says which), with the layout the table prints:

- Llama 3 70B: TP4 PP8 VP5 CP1, micro-batch 1, batch 128 (25.11) or 256 (26.02 on); 80 layers as 40 chunks of 2,
  the embedding and the output layer on the first and last (account_for_* unset); userbuffers cfg
  userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192 (bulk SMs 4, 24, 2, 4: a mean of 8.5).
- Llama 3.1 405B: TP8 PP8 CP2 VP8, micro-batch 1, batch 512 (25.11) or 1,536; account_for_embedding_in_pipeline_
  split and account_for_loss_in_pipeline_split, so 126 layers and the two ends as 64 chunks of 2 (the twin's
  edge_stage_trim 1); context parallelism by Transformer Engine's p2p ring; cfg userbuffers_fp8_h100_h16384_tp8_cp2_
  mbs1_seqlen8192 (bulk SMs 2, 24, 2, 2: 7.5, the stack's).

The same settings give 1,602 to 1,664 tokens/s for 70B over five releases and 311 to 328 for 405B at batch 1,536
over three: what one of these rows can be predicted to is bounded by that spread (the NCCL p2p chunk size the
launcher sets, lost in three releases to a duplicated assignment, moves between them and is not priced). What is
priced: gradient-accumulation fusion, off in 25.11 to 26.02.01, where Megatron-Bridge asked for APEX's extension
that NVIDIA's containers do not install, and on from 26.04 (`WGRAD_FUSION_FROM`).

Left out: 25.09 (its table states no precision, and its recipe ran Megatron-Bridge 0.1's delayed-or-current choice
we cannot tell apart), the Llama 3 8B rows (25.09 ran Megatron FSDP; 25.11's table says FSDP where its code runs DDP
with five layers of full recompute), and the MoE rows (DeepSeek-V3, Qwen3, GPT-OSS: models and dispatchers the twin
does not hold yet).

Run as part of benchmarks/published_figures.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.published import _cluster, _layout
from plan import loader
from plan.schema import Plan
from twin import api

SOURCE = (
    "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md at 067f987 (NeMo 25.11-26.06, DGX-H100, FP8 "
    "current scaling); recipes scripts/performance at v0.2.0-v0.5.0"
)


@dataclass(frozen=True)
class MbridgeRow:
    """One DGX-H100 pre-training row of Megatron-Bridge's performance summary (FP8-CS, sequence 8,192, micro-batch
    1), tokens per second per GPU."""

    release: str
    model: str
    gpus: int
    batch: int
    tp: int
    pp: int
    cp: int
    virtual: int
    tokens_per_gpu: float


MBRIDGE_H100 = (
    MbridgeRow("25.11", "llama3-70b", 64, 128, 4, 8, 1, 5, 1602),
    MbridgeRow("26.02", "llama3-70b", 64, 256, 4, 8, 1, 5, 1621),
    MbridgeRow("26.02.01", "llama3-70b", 64, 256, 4, 8, 1, 5, 1639),
    MbridgeRow("26.04", "llama3-70b", 64, 256, 4, 8, 1, 5, 1633),
    MbridgeRow("26.04.01", "llama3-70b", 64, 256, 4, 8, 1, 5, 1664),
    MbridgeRow("25.11", "llama3-405b", 1024, 512, 8, 8, 2, 8, 292),
    MbridgeRow("26.02", "llama3-405b", 1024, 1536, 8, 8, 2, 8, 311),
    MbridgeRow("26.04.01", "llama3-405b", 1024, 1536, 8, 8, 2, 8, 328),
    MbridgeRow("26.06", "llama3-405b", 1024, 1536, 8, 8, 2, 8, 326),
)

SEQ = 8192

RECIPE_OVERRIDES = {
    "llama3-70b": {"tp_overlap_sms": 8.5},
    "llama3-405b": {"tp_overlap_chunks": 8},
}
"""What each recipe's userbuffers cfg sets beyond the stack: the bulk overlaps' mean SMs (70B: 4, 24, 2, 4; 405B's
7.5 is the stack's) and ring exchange's tp pieces (405B's 8; 70B's 4 is the stack's)."""

WGRAD_FUSION_FROM = "26.04"
"""The first release whose gradient-accumulation fusion resolves on: Megatron-Bridge 0.4.0's fusions.py accepts
Transformer Engine's fuse_wgrad_accumulation, where 0.2-0.3.1 asked for APEX's extension, which NVIDIA's TE-based
containers do not install (the docstring of that fix, #2958). The stack (nemo-25.11) leaves it off."""

EDGE_TRIM = {"llama3-70b": 0, "llama3-405b": 1}
"""Layers the recipe takes off the first and last pipeline chunk for the embedding and the loss (405B's
account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split; 70B sets neither)."""


def mbridge_plan(row: MbridgeRow) -> Plan:
    """The row on DGX H100 SuperPOD nodes: the distributed optimizer (ZeRO-1), sequence parallel, interleaved."""
    dp = row.gpus // (row.tp * row.pp * row.cp)
    return api.load_plan(
        {
            "name": f"mbridge-{row.release}-{row.model}-{row.gpus}",
            "model": {**loader.expand_model({"model": row.model}, row.model)["model"], "seq_len": SEQ},
            "cluster": _cluster("dgx-h100-superpod", row.gpus, 16384),
            "stack": {"name": "nemo-25.11", "overrides": RECIPE_OVERRIDES[row.model] | release_overrides(row.release)},
            "layout": _layout(
                row.tp,
                row.pp,
                dp,
                1,
                row.virtual,
                cp=row.cp,
                zero=1,
                sequence_parallel=True,
                edge_stage_trim=EDGE_TRIM[row.model],
            ),
            "training": {"global_batch": row.batch, "tokens": 1e12, "dtype": "fp8"},
        }
    )


def release_at_least(release: str, since: str) -> bool:
    """Whether NeMo container `release` (e.g. "26.04.01") is `since` or later."""
    return tuple(int(x) for x in release.split(".")) >= tuple(int(x) for x in since.split("."))


def release_overrides(release: str) -> dict[str, bool]:
    """What a release sets beyond the stack: gradient-accumulation fusion from 26.04 on."""
    return {"wgrad_accumulation_fusion": True} if release_at_least(release, WGRAD_FUSION_FROM) else {}
