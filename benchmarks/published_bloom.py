"""A validation row nothing was built or fitted on: BLOOM-176B's pre-training step on 384 A100 80GB, as its own log
printed it (BigScience, 2022), on the stack and cluster it ran on.

Source: bigscience-workshop/bigscience, train/tr11-176B-ml/README.md, "Important checkpoints": the end of the first
epoch, "iteration 85376/ 115311 | ... | elapsed time per iteration (s): 104.70 | ... | global batch size: 2048 |
... | samples per second: 19.561 | TFLOPs: 149.77" (TFLOP/s per GPU by Megatron-DeepSpeed's count with the
recompute factor 4, a hardware-FLOPs figure). The layout is the README's and train/tr11-176B-ml/tr11-176B-ml.slurm's:
TP4 PP12 DP8 (48 nodes of 8), micro-batch 2, 2,048 sequences of 2,048 tokens a step, full activation checkpointing,
bf16, the pipeline split "pp rank 0: [embed | 5 transformer blocks], pp ranks 1-10: 6 blocks, pp rank 11: [5
transformer blocks | embed]" (--pp-partition-method 'type:transformer|embedding', the tied embedding counted as a
block), 70 layers of hidden 14,336 and 112 heads, the vocabulary padded to 250,880, ALiBi, GeLU, LayerNorm, biases.

What the row runs, as the twin holds it: the `megatron-deepspeed-2022` stack and the `jean-zay-a100` cluster (IDRIS
Jean Zay's gpu_p5 partition: four Omni-Path 100 Gb/s links for eight GPUs a node). Published: tokens per second per
GPU, 2,048 x 2,048 / 384 / 104.70 s.

Not modelled: BF16_Optimizer all-reduces the fp32 gradients where the twin's ZeRO-1 reduce-scatters them (about
1 s more a step over this fabric, 1%); the tied embedding's gradient all-reduce between the first and last stage
after the flush (0.9B fp32 gradients a tensor-parallel rank, about 0.7 s over Omni-Path); Omni-Path's NCCL
efficiency, which is an estimate (jean-zay-a100.yaml). Each of these leans the twin fast. The README puts memory at
"60 GB of memory on each GPU" (what nvidia-smi shows, the caching allocator's reserve included); the twin's peak is
37 GiB on the first stage, the unsharded fp32 gradient buffer (14.8 GiB) counted.

Run as part of benchmarks/published_figures.py.
"""

from __future__ import annotations

from benchmarks.published import _gpt, _layout
from plan.schema import Plan
from twin import api

SOURCE = "bigscience-workshop/bigscience train/tr11-176B-ml/README.md and tr11-176B-ml.slurm (BLOOM-176B, 2022)"
STEP_S = 104.70
"""Seconds an iteration at global batch 2,048 (iteration 85,376, the end of the first epoch)."""
TFLOPS = 149.77
"""TFLOP/s per GPU the same log line prints (Megatron-DeepSpeed's count, recompute included)."""
GPUS, BATCH, SEQ = 384, 2048, 2048
STAGE_LAYERS = (5,) + (6,) * 10 + (5,)
"""The README's split: the tied embedding weighs as a block on the first and last stage."""


def bloom_plan() -> Plan:
    return api.load_plan(
        {
            "name": "bloom-176b",
            "model": _gpt(70, 14336, 112, 250880, SEQ, tied=True),
            "cluster": "jean-zay-a100",
            "stack": "megatron-deepspeed-2022",
            "layout": _layout(4, 12, 8, 2, 1, zero=1, recompute="full", stage_layers=STAGE_LAYERS),
            "training": {"global_batch": BATCH, "tokens": 366e9, "dtype": "bf16"},
        }
    )


def megatron_deepspeed_tflops(step_s: float) -> float:
    """Megatron-DeepSpeed's TFLOP/s per GPU (its training log): 24·4·B·s·l·h²·(1 + s/6h + V/16lh) FLOPs a step with
    activation checkpointing (factor 4 where 3 would count no recompute), over the GPUs and the step."""
    b, s, layers, h, v = BATCH, SEQ, 70, 14336, 250880
    flops = 24 * 4 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    return flops / (step_s * GPUS) / 1e12
