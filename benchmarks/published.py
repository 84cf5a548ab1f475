"""Published training runs the twin is checked against, as plans: Narayanan et al. 2021 Table 1 (Megatron-LM's
A100 weak-scaling table) and Llama 3 405B's Table 4. Used by tests and benchmarks/published_figures.py."""

from __future__ import annotations

from dataclasses import dataclass

from plan.schema import Plan


@dataclass(frozen=True)
class MegatronRow:
    """One row of Narayanan et al. 2021, Table 1: GPT models with vocab 51,200 and sequence 2,048 on A100."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float
    """Achieved TFLOP/s per GPU by the paper's formula F = 96·B·s·l·h²·(1 + s/6h + V/16lh), recompute included."""


NARAYANAN_TABLE_1 = (
    MegatronRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    MegatronRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    MegatronRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    MegatronRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    MegatronRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    MegatronRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    MegatronRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    MegatronRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    MegatronRow(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    MegatronRow(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def megatron_plan(row: MegatronRow) -> Plan:
    """The row as the paper ran it: interleaved schedule (two chunks) where pp > 1, full recompute, mbs 1."""
    dp = row.gpus // (row.tp * row.pp)
    pipelined = row.pp > 1
    nodes = -(-row.gpus // 8)  # the SuperPOD file holds 140 nodes; the paper's Selene had more: a what-if
    return Plan.model_validate(
        {
            "name": f"megatron-{row.params_b:g}b",
            "model": {
                "layers": row.layers,
                "hidden": row.hidden,
                "heads": row.heads,
                "ffn_hidden": 4 * row.hidden,
                "vocab": 51200,
                "seq_len": 2048,
                "glu": False,
                "tied_embeddings": True,
            },
            "cluster": {"name": "dgx-a100-superpod", "overrides": {"nodes": nodes} if nodes > 140 else {}},
            "layout": {
                "dp": dp,
                "tp": row.tp,
                "pp": row.pp,
                "microbatch_size": 1,
                "recompute": "full",
                "schedule": "interleaved-1f1b" if pipelined else "1f1b",
                "virtual_stages": 2 if pipelined else 1,
            },
            "training": {"global_batch": row.batch, "tokens": 300e9, "dtype": "bf16"},
        }
    )


def megatron_tflops(row: MegatronRow, step_s: float) -> float:
    """The paper's per-GPU TFLOP/s for a step of `step_s` seconds (its F formula, which counts recompute)."""
    s, h, lay, v = 2048, row.hidden, row.layers, 51200
    flops = 96 * row.batch * s * lay * h**2 * (1 + s / (6 * h) + v / (16 * lay * h))
    return flops / step_s / row.gpus / 1e12


@dataclass(frozen=True)
class LlamaRow:
    """Llama 3 405B pre-training, Dubey et al. 2024, Table 4 (BF16 MFU)."""

    gpus: int
    dp: int
    batch_per_dp: int
    tflops: float
    mfu: float


LLAMA3_TABLE_4 = (LlamaRow(8192, 64, 32, 430, 0.43), LlamaRow(16384, 128, 16, 400, 0.41))


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
