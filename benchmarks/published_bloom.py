"""A validation table nothing was built or fitted on: BLOOM-176B's pre-training steps on 192 to 384 A100 80GB under
seven layouts, as its own logs printed them (BigScience, 2022), on the stack and cluster it ran on.

Source: bigscience-workshop/bigscience, train/tr11-176B-ml/README.md, "Important checkpoints": the end of the first
epoch, "iteration 85376/ 115311 | ... | elapsed time per iteration (s): 104.70 | ... | global batch size: 2048 |
... | samples per second: 19.561 | TFLOPs: 149.77" (TFLOP/s per GPU by Megatron-DeepSpeed's count with the
recompute factor 4, a hardware-FLOPs figure). The layout is the README's and train/tr11-176B-ml/tr11-176B-ml.slurm's:
TP4 PP12 DP8 (48 nodes of 8), micro-batch 2, 2,048 sequences of 2,048 tokens a step, full activation checkpointing,
bf16, the pipeline split "pp rank 0: [embed | 5 transformer blocks], pp ranks 1-10: 6 blocks, pp rank 11: [5
transformer blocks | embed]" (--pp-partition-method 'type:transformer|embedding', the tied embedding counted as a
block), 70 layers of hidden 14,336 and 112 heads, the vocabulary padded to 250,880, ALiBi, GeLU, LayerNorm, biases.

Six more layouts of the same model, stack, cluster and global batch come from train/tr11-176B-ml/reshaping-log.md
(BigScience resuming global_step94767 on 24 and 36 nodes to test checkpoint reshaping): TP4 PP12 micro-batch 2 on
24 nodes, and micro-batch 1 at TP4 PP24 and TP2 PP24 on 24 nodes, TP4 PP36, TP2 PP36 and TP1 PP72 on 36 nodes. Each
row takes the last iteration the log prints for its layout: the first after a resume runs slow (TP4 PP24 261.08 s,
then 220.73 and 220.30); the TP4 PP12 micro-batch-1 layout, logged only at that first iteration, is left out. The
split of 70 layers and the tied embedding counted twice as a block ("type:transformer|embedding": 72 items evenly
over the stages, the embedding on the first and the last) is `edge_stage_trim` 1: 5 + 10 x 6 + 5 at PP12, one
layer each and an embedding-only first and last stage at PP72.

What the rows run, as the twin holds them: the `megatron-deepspeed-2022` stack and the `jean-zay-a100` cluster (IDRIS
Jean Zay's gpu_p5 partition: four Omni-Path 100 Gb/s links for eight GPUs a node). Published: tokens per second per
GPU, 2,048 x 2,048 tokens / GPUs / the logged seconds.

Every TP2 and TP4 row comes out optimistic (10.2% mean): TP1 −3%, TP2 +5-6%, TP4 +10-20%, the 384-GPU training layout
+9.7%. What DeepSpeed's engine and BF16_Optimizer do is priced from their source (the stack's citations): the activation
and its gradient split over the tensor-parallel ranks between stages and gathered on arrival; every microbatch's bf16
gradients, the output head's and the embedding's too, upcast and added into the fp32 buffer (about 18 bytes a weight,
5-15% of a step); that buffer cast to bf16 and all-reduced after the flush where ZeRO-1 would reduce-scatter it; the
tied embedding's fp32 gradient all-reduced between the first and last stage (14.4 GB at TP1 over Omni-Path: 2.9 s, which
the other stages wait out at the barrier). Until they were (15.0% mean, every row 11-21%), the twin sent whole
activations from every rank, a cost that happened to grow with TP as the remaining error does. Still open: what makes
the TP4 layouts slower than the twin sees (the 24-node TP4 PP12 log line is 3% slower per GPU than the 48-node one,
where the twin makes it 6% faster); the reshaping rows are each the second or third iteration after a resume.
Omni-Path's NCCL efficiency is an estimate (jean-zay-a100.yaml); whether the node's eight GPUs share an NVSwitch is not
published. The README puts memory at "60 GB of memory on each GPU" (what nvidia-smi shows, the caching allocator's
reserve included); the twin's peak is 46 GiB on the first stage of the 384-GPU layout, the unsharded fp32 gradient
buffer (14.8 GiB) and the bf16 gradients BF16_Optimizer keeps beside it (7.4 GiB) counted, not the flattened copy of the
buffer that allreduce_bucket makes after the backward.

Run as part of benchmarks/published_figures.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.published import _gpt, _layout
from plan.schema import Plan
from twin import api

SOURCE = (
    "bigscience-workshop/bigscience train/tr11-176B-ml/README.md, reshaping-log.md and tr11-176B-ml.slurm "
    "(BLOOM-176B, 2022)"
)
BATCH, SEQ = 2048, 2048
TFLOPS = 149.77
"""TFLOP/s per GPU the 384-GPU log line prints with its 104.70 s (Megatron-DeepSpeed's count, recompute included)."""


@dataclass(frozen=True)
class BloomRow:
    nodes: int
    tp: int
    pp: int
    microbatch: int
    step_s: float
    """Seconds an iteration at global batch 2,048, as the log prints it."""

    @property
    def gpus(self) -> int:
        return 8 * self.nodes

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


BLOOM_A100 = (
    BloomRow(48, 4, 12, 2, 104.70),  # README "Important checkpoints": iteration 85376, the end of the first epoch
    BloomRow(24, 4, 12, 2, 215.99),  # reshaping-log.md, iteration 94769
    BloomRow(24, 4, 24, 1, 220.30),  # iteration 94770
    BloomRow(24, 2, 24, 1, 199.82),  # iteration 94769
    BloomRow(36, 4, 36, 1, 155.71),  # iteration 94769
    BloomRow(36, 2, 36, 1, 141.22),  # iteration 94770
    BloomRow(36, 1, 72, 1, 141.69),  # iteration 94770
)


def bloom_plan(row: BloomRow) -> Plan:
    return api.load_plan(
        {
            "name": f"bloom-176b-{row.gpus}",
            "model": _gpt(70, 14336, 112, 250880, SEQ, tied=True),
            "cluster": "jean-zay-a100",
            "stack": "megatron-deepspeed-2022",
            "layout": _layout(
                row.tp,
                row.pp,
                row.dp,
                row.microbatch,
                1,
                zero=1,
                recompute="full",
                edge_stage_trim=1,
            ),
            "training": {"global_batch": BATCH, "tokens": 366e9, "dtype": "bf16"},
        }
    )


def megatron_deepspeed_tflops(step_s: float, gpus: int) -> float:
    """Megatron-DeepSpeed's TFLOP/s per GPU (its training log): 24·4·B·s·l·h²·(1 + s/6h + V/16lh) FLOPs a step with
    activation checkpointing (factor 4 where 3 would count no recompute), over the GPUs and the step."""
    b, s, layers, h, v = BATCH, SEQ, 70, 14336, 250880
    flops = 24 * 4 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    return flops / (step_s * gpus) / 1e12
