"""MosaicML's MPT throughput table on A100 80GB (mosaicml/llm-foundry scripts/train/benchmarking/README.md, the
"A100 80GB with 1600 Gbps node-node interconnect (RoCE)" table as re-run in b2a43a1, 2023-10-19): a validation table
the twin was not built or fitted on. Eight GPUs of one node, FSDP FULL_SHARD over all eight, models from 125M to 30B
parameters, sequences from 512 to 65,536 tokens, bf16, with and without activation checkpointing. The A100 has no
fitted constant, so every row is a prediction from kernel-level figures alone.

Settings, from the release (the stack llm-foundry-0.3 says where each comes from):

- The published micro-batch size, gradient accumulation and activation checkpointing of each row; global batch =
  8 x micro-batch x accumulation (submit_benchmarks.py; the GradAccum column).
- MPT (llm-foundry v0.3.0 scripts/train/yamls/pretrain/mpt-*.yaml): expansion ratio 4, vocabulary 50,368, tied
  embeddings, biases, learned positional embeddings; head width 128 from 760M up, 64 below.
- The Triton FlashAttention the tables ran (attn_impl triton) is priced from the FlashAttention-2 paper's figure of
  it on A100 (topologies/accelerators/a100-sxm4-80gb.yaml, `triton`), held at its 16k value beyond.
- Published: tokens per second per GPU (the T/s/GPU column).

Left out: the two 70B rows (bf16 PURE, from the April 2023 runs on another stack: the commit says they were kept,
not re-run) and the H100 tables (no published figure of this Triton kernel on H100). Not modelled: FSDP's cast of
each block's bf16 gradients to fp32 before its reduce-scatter and of its fp32 shard to bf16 before its all-gather
(per-parameter copies, about 1-2% of a step), Composer's BACKWARD_POST prefetch (a block's backward all-gather
starts when the block after it is done; the twin prefetches one block ahead), and the learned positional
embedding's gather and add.

Run as part of benchmarks/published_figures.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.published import _cluster, _gpt, _layout
from plan.schema import Plan
from twin import api

SOURCE = "mosaicml/llm-foundry b2a43a1, scripts/train/benchmarking/README.md (A100 80GB table)"

MPT_SIZES = {  # d_model, n_layers, n_heads (llm-foundry v0.3.0 scripts/train/yamls/pretrain/mpt-*.yaml)
    "125m": (768, 12, 12),
    "350m": (1024, 24, 16),
    "760m": (1536, 24, 12),
    "1b": (2048, 24, 16),
    "3b": (2560, 32, 20),
    "7b": (4096, 32, 32),
    "13b": (5120, 40, 40),
    "30b": (7168, 48, 56),
}
MPT_VOCAB = 50368


@dataclass(frozen=True)
class MptRow:
    """One row of the table: a model at a sequence length on 8 GPUs."""

    model: str
    seq: int
    microbatch: int
    accumulation: int
    checkpointing: bool
    tokens_per_gpu: float
    """Published tokens per second per GPU."""

    @property
    def gpus(self) -> int:
        return 8

    @property
    def batch(self) -> int:
        return self.gpus * self.microbatch * self.accumulation


def _rows(model: str, *rows: tuple[int, int, int, bool, float]) -> tuple[MptRow, ...]:
    return tuple(MptRow(model, seq, mb, ga, ckpt, tps) for seq, mb, ga, ckpt, tps in rows)


# (sequence, micro-batch, accumulation, activation checkpointing, tokens/s/GPU), as the table prints them
MPT_A100 = (
    _rows("30b", (8192, 1, 21, True, 574), (4096, 1, 21, True, 814), (2048, 3, 21, True, 916),
          (1024, 6, 21, True, 946), (512, 12, 21, True, 967))
    + _rows("13b", (32768, 1, 3, True, 1016), (16384, 3, 3, True, 1431), (8192, 5, 3, True, 1795),
            (4096, 10, 3, True, 2060), (2048, 2, 3, False, 2262), (1024, 40, 3, True, 2330))
    + _rows("7b", (65536, 1, 2, True, 1013), (32768, 2, 2, True, 1672), (16384, 4, 2, True, 2453),
            (8192, 8, 2, True, 3206), (4096, 16, 2, True, 3684), (2048, 6, 2, False, 4641),
            (1024, 64, 2, True, 4357))
    + _rows("3b", (65536, 1, 2, True, 1767), (32768, 3, 6, True, 3029), (16384, 1, 6, False, 5529),
            (8192, 3, 6, False, 7695), (4096, 5, 6, False, 9457), (2048, 10, 2, False, 10811),
            (1024, 20, 6, False, 11580), (512, 40, 6, False, 12127))
    + _rows("1b", (65536, 1, 2, True, 3044), (32768, 1, 4, False, 6275), (16384, 2, 4, False, 9956),
            (8192, 3, 4, False, 13814), (4096, 7, 4, False, 17807), (2048, 14, 4, False, 20513),
            (1024, 18, 4, False, 22112), (512, 56, 4, False, 23148))
    + _rows("760m", (65536, 1, 2, True, 4143), (32768, 1, 2, False, 8802), (16384, 3, 2, False, 14274),
            (8192, 6, 2, False, 20933), (4096, 12, 2, False, 27351), (2048, 24, 2, False, 32434),
            (1024, 48, 2, False, 29765), (512, 96, 2, False, 29446))
    + _rows("350m", (65536, 1, 2, False, 7524), (32768, 2, 2, False, 13652), (16384, 4, 2, False, 23559),
            (8192, 8, 2, False, 36569), (4096, 16, 2, False, 49555), (2048, 32, 2, False, 58782),
            (1024, 64, 2, False, 64813), (512, 128, 2, False, 69330))
    + _rows("125m", (65536, 1, 2, False, 20368), (32768, 2, 2, False, 36407), (16384, 4, 2, False, 60040),
            (8192, 8, 2, False, 90392), (4096, 16, 2, False, 118396), (2048, 40, 2, False, 142830),
            (2048, 32, 2, False, 141737), (1024, 64, 2, False, 156468), (512, 128, 2, False, 165681))
)  # fmt: skip


def mpt_plan(row: MptRow) -> Plan:
    """The row on one DGX A100 node's eight GPUs: FSDP FULL_SHARD over them (ZeRO-3), no tensor or pipeline
    parallelism, full recompute where the row checkpoints activations."""
    d, layers, heads = MPT_SIZES[row.model]
    recompute = "full" if row.checkpointing else "none"
    return api.load_plan(
        {
            "name": f"mpt-{row.model}-{row.seq}",
            "model": _gpt(layers, d, heads, MPT_VOCAB, row.seq, tied=True),
            "cluster": _cluster("dgx-a100-superpod", row.gpus, 8),
            "stack": "llm-foundry-0.3",
            "layout": _layout(1, 1, row.gpus, row.microbatch, 1, zero=3, recompute=recompute),
            "training": {"global_batch": row.batch, "tokens": 1e11, "dtype": "bf16"},
        }
    )


def mpt_tokens_per_gpu(row: MptRow, step_s: float) -> float:
    return row.batch * row.seq / step_s / row.gpus
