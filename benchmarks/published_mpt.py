"""MosaicML's MPT throughput tables on A100 and H100 (mosaicml/llm-foundry scripts/train/benchmarking/README.md):
validation tables the twin was not built or fitted on; the A100 has no fitted constant, so every A100 row is a
prediction from kernel-level figures alone. FSDP over every GPU, no tensor or pipeline parallelism, models from 125M
to 70B parameters, sequences from 512 to 65,536 tokens, bf16 (and fp8 on H100), with and without activation
checkpointing.

- `MPT_A100`: "A100 80GB with 1600 Gbps node-node interconnect (RoCE)" as re-run in b2a43a1 (2023-10-19): eight
  GPUs of one node, Composer 0.16's DEFAULT mixed precision (fp32 gradient reduce-scatters).
- `MPT_A100_40GB`: "A100 40GB with 1600 Gbps ..." (9fa3ceb9a, 2023-04-04): 8 to 128 GPUs, torch 1.13.1, PURE
  mixed precision (bf16 reduce-scatters), flash-attn 0.2.8's Triton kernel. The Composer pin (0.13.3) landed the
  same day as the table, and the table's precision `bf16` is not a valid value in 0.12-0.13.3, so which Composer
  ran is not certain.
- `MPT_H100`, `MPT_H100_FP8`: "H100 80GB BF16" and "H100 80GB FP8" from the same commit as MPT_A100 (8 to 64 GPUs;
  fp8 through Transformer Engine v0.10's Linears).
- `MPT_H100_LARGE`: "H100 80GB BF16 (Large Scale, >= 128 GPUs)" (5e85bd62d, 2024-01-06), every setting in sweep.py.

Settings, from the releases (the stack llm-foundry-0.3 says where each comes from; the April runs differ from it in
the gradient dtype and the library versions, not in the kernels):

- The published micro-batch size, gradient accumulation and activation checkpointing of each row; global batch =
  GPUs x micro-batch x accumulation (submit_benchmarks.py; the GradAccum column).
- MPT (llm-foundry v0.3.0 scripts/train/yamls/pretrain/mpt-*.yaml): expansion ratio 4, vocabulary 50,368, tied
  embeddings, biases, learned positional embeddings; head width 128 from 760M up, 64 below.
- The Triton FlashAttention they ran (attn_impl triton: Tri Dao's flash_attn_triton.py) is priced at the
  FlashAttention-2 paper's FlashAttention (1) bars, its docstring putting it "slightly slower than CUDA" (`triton` in
  the A100 and H100 files), held at the 16k value beyond; attn_impl flash (January 2024) at FlashAttention-2's.
- Published: tokens per second per GPU (the T/s/GPU column).

Left out: the October A100 table's two 70B rows (kept from April on another stack, the commit says). Not modelled:
FSDP's per-parameter casts (each block's bf16 gradients to fp32 before an fp32 reduce-scatter, its fp32 shard to bf16
before the gather; about 1-2% of a step), the learned positional embedding's gather and add, and the host syncs of
the January runs' unpadding around FlashAttention-2 (its gathers and scatters are priced: UNPADDING).

Run as part of benchmarks/published_figures.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.published import _gpt, _layout
from plan import loader
from plan.schema import Plan
from twin import api

SOURCE = "mosaicml/llm-foundry b2a43a1, scripts/train/benchmarking/README.md (A100 80GB table)"
SOURCE_40GB = "mosaicml/llm-foundry 9fa3ceb9a, scripts/train/benchmarking/README.md (A100 40GB table)"

MPT_SIZES = {  # d_model, n_layers, n_heads (llm-foundry v0.3.0 scripts/train/yamls/pretrain/mpt-*.yaml)
    "125m": (768, 12, 12),
    "350m": (1024, 24, 16),
    "760m": (1536, 24, 12),
    "1b": (2048, 24, 16),
    "3b": (2560, 32, 20),
    "7b": (4096, 32, 32),
    "13b": (5120, 40, 40),
    "30b": (7168, 48, 56),
    "70b": (8192, 80, 64),
}
MPT_VOCAB = 50368


@dataclass(frozen=True)
class MptRow:
    """One row of a table: a model at a sequence length on some A100s or H100s."""

    model: str
    seq: int
    microbatch: int
    accumulation: int
    checkpointing: bool
    tokens_per_gpu: float
    """Published tokens per second per GPU."""
    gpus: int = 8
    accelerator: str = "a100-sxm4-80gb"
    grad_reduce_dtype: str = "fp32"
    """Composer's DEFAULT reduces gradients in fp32 (0.16); PURE, which the April 2023 runs used, in bf16."""
    dtype: str = "bf16"
    """The table's precision: amp_bf16, or amp_fp8 (Transformer Engine's fp8 Linears, fc_type te)."""
    zero: int = 3
    """FSDP's sharding: FULL_SHARD (3) or SHARD_GRAD_OP (2)."""
    stack: tuple[tuple[str, object], ...] = ()
    """Where the run's settings differ from the llm-foundry-0.3 stack: (field, value) overrides."""

    @property
    def batch(self) -> int:
        return self.gpus * self.microbatch * self.accumulation


def _rows(model: str, *rows: tuple[int, int, int, bool, float]) -> tuple[MptRow, ...]:
    return tuple(MptRow(model, seq, mb, ga, ckpt, tps) for seq, mb, ga, ckpt, tps in rows)


def _rows_40gb(model: str, *rows: tuple[int, int, int, int, bool, float]) -> tuple[MptRow, ...]:
    return tuple(
        MptRow(model, seq, mb, ga, ckpt, tps, gpus, "a100-sxm4-40gb", "bf16") for seq, gpus, mb, ga, ckpt, tps in rows
    )


def _rows_h100(model: str, *rows: tuple[int, int, int, int, bool, float], dtype: str = "bf16") -> tuple[MptRow, ...]:
    return tuple(
        MptRow(model, seq, mb, ga, ckpt, tps, gpus, "h100-sxm5-80gb", dtype=dtype)
        for seq, gpus, mb, ga, ckpt, tps in rows
    )


def _rows_h100_fp8(model: str, *rows: tuple[int, int, int, int, bool, float]) -> tuple[MptRow, ...]:
    return _rows_h100(model, *rows, dtype="fp8")


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


# The April 2023 "A100 40GB with 1600 Gbps node-node interconnect (RoCE)" table (llm-foundry 9fa3ceb9a, 2023-04-04;
# torch 1.13.1, flash-attn 0.2.8's Triton kernel, precision bf16 with PURE mixed precision: bf16 gathers and bf16
# reduce-scatters): (sequence, GPUs, micro-batch, accumulation, checkpointing, tokens/s/GPU)
MPT_A100_40GB = (
    _rows_40gb("70b", (2048, 128, 4, 1, True, 376), (2048, 64, 2, 1, True, 276))
    + _rows_40gb("30b", (2048, 128, 6, 1, True, 865), (2048, 32, 4, 1, True, 857))
    + _rows_40gb("13b", (8192, 8, 1, 16, True, 1407), (4096, 8, 2, 16, True, 1603), (2048, 128, 16, 1, True, 1972),
                 (2048, 64, 16, 1, True, 1976), (2048, 32, 14, 1, True, 1998), (2048, 16, 10, 1, True, 1993),
                 (2048, 8, 4, 16, True, 1668), (1024, 8, 8, 16, True, 1727), (512, 8, 16, 16, True, 1763))
    + _rows_40gb("7b", (16384, 8, 1, 4, True, 2249), (8192, 8, 3, 4, True, 2887), (4096, 8, 6, 4, True, 3366),
                 (2048, 128, 18, 1, True, 3623), (2048, 64, 18, 1, True, 3665), (2048, 32, 18, 1, True, 3725),
                 (2048, 16, 16, 1, True, 3645), (2048, 8, 12, 4, True, 3679), (1024, 8, 24, 4, True, 3854),
                 (512, 8, 48, 4, True, 3895))
    + _rows_40gb("3b", (32768, 8, 1, 4, True, 2955), (16384, 8, 2, 8, True, 4465), (8192, 8, 1, 8, False, 7149),
                 (4096, 8, 2, 8, False, 8777), (2048, 128, 6, 1, False, 9538), (2048, 64, 6, 1, False, 9736),
                 (2048, 32, 6, 1, False, 9914), (2048, 16, 5, 1, False, 9750), (2048, 8, 5, 8, False, 10065),
                 (1024, 8, 10, 8, False, 10731), (512, 8, 20, 8, False, 11324))
    + _rows_40gb("1b", (32768, 8, 1, 4, True, 5095), (16384, 8, 1, 8, False, 9715), (8192, 8, 2, 8, False, 13474),
                 (4096, 8, 4, 8, False, 16856), (2048, 128, 10, 1, False, 18647), (2048, 64, 10, 1, False, 19001),
                 (2048, 32, 10, 1, False, 15555), (2048, 16, 8, 1, False, 19085), (2048, 8, 8, 8, False, 19271),
                 (1024, 8, 16, 8, False, 20959), (512, 8, 32, 8, False, 21782))
    + _rows_40gb("760m", (32768, 8, 1, 4, True, 7183), (16384, 8, 1, 4, False, 13914), (8192, 8, 3, 4, False, 20106),
                 (4096, 8, 6, 4, False, 25863), (2048, 128, 12, 1, False, 28940), (2048, 64, 12, 1, False, 29344),
                 (2048, 32, 12, 1, False, 29648), (2048, 16, 12, 1, False, 29607), (2048, 8, 12, 4, False, 30173),
                 (1024, 8, 24, 4, False, 33422), (512, 8, 48, 4, False, 34938))
    + _rows_40gb("350m", (32768, 8, 1, 4, False, 13416), (16384, 8, 2, 4, False, 22896), (8192, 8, 4, 4, False, 34933),
                 (4096, 8, 8, 4, False, 46833), (2048, 128, 18, 1, False, 51934), (2048, 64, 18, 1, False, 52689),
                 (2048, 32, 18, 1, False, 53811), (2048, 16, 18, 1, False, 55413), (2048, 8, 16, 4, False, 55995),
                 (1024, 8, 32, 4, False, 62523), (512, 8, 64, 4, False, 66284))
    + _rows_40gb("125m", (32768, 8, 1, 4, False, 32651), (16384, 8, 2, 3, False, 55484), (8192, 8, 5, 3, False, 86858),
                 (4096, 8, 13, 3, False, 115162), (2048, 128, 26, 1, False, 123936), (2048, 64, 26, 1, False, 125234),
                 (2048, 32, 26, 1, False, 127122), (2048, 16, 26, 1, False, 130535), (2048, 8, 26, 3, False, 136334),
                 (1024, 8, 52, 3, False, 148289), (512, 8, 104, 3, False, 156735))
)  # fmt: skip


SOURCE_H100 = "mosaicml/llm-foundry b2a43a1, scripts/train/benchmarking/README.md (H100 80GB BF16 and FP8 tables)"

# The October 2023 "H100 80GB BF16" and "H100 80GB FP8" tables (b2a43a1, the same commit and stack as MPT_A100;
# scripts/train/benchmarking/sweep.sh submits them on mosaicml/pytorch:2.1.0_cu121, attn_impl triton by default,
# and under amp_fp8 Transformer Engine v0.10's Linears, fc_type te): (sequence, GPUs, micro-batch, accumulation,
# checkpointing, tokens/s/GPU)
MPT_H100 = (
    _rows_h100("70b", (2048, 64, 8, 4, True, 1039), (2048, 32, 2, 16, True, 882))
    + _rows_h100("30b", (8192, 8, 1, 21, True, 1384), (4096, 8, 1, 21, True, 1802), (2048, 32, 14, 3, True, 2308),
                        (2048, 16, 10, 3, True, 2263), (2048, 8, 3, 21, True, 2002), (1024, 8, 6, 21, True, 2084))
    + _rows_h100("13b", (32768, 8, 1, 3, True, 1976), (16384, 8, 3, 3, True, 2985), (4096, 8, 10, 3, True, 4717),
                        (2048, 64, 2, 1, False, 4800), (2048, 32, 2, 1, False, 4811), (2048, 16, 2, 1, False, 4767),
                        (2048, 8, 2, 1, False, 4792), (1024, 8, 40, 3, True, 5502))
    + _rows_h100("7b", (65536, 8, 1, 2, True, 1956), (32768, 8, 2, 2, True, 3318), (8192, 8, 8, 2, True, 6935),
                       (4096, 8, 16, 2, True, 8611), (2048, 8, 6, 1, False, 10643), (1024, 8, 64, 2, True, 10203))
    + _rows_h100("3b", (65536, 8, 1, 2, True, 3262), (32768, 8, 3, 6, True, 5873), (16384, 8, 1, 6, False, 11152),
                       (8192, 8, 3, 6, False, 16578), (4096, 8, 5, 6, False, 20964), (2048, 64, 6, 3, False, 22525),
                       (2048, 32, 6, 3, False, 23021), (2048, 16, 10, 3, False, 24142), (1024, 8, 20, 6, False, 27046),
                       (512, 8, 40, 6, False, 27965))
    + _rows_h100("1b", (65536, 8, 1, 2, True, 5506), (32768, 8, 1, 4, False, 12025), (16384, 8, 2, 4, False, 19649),
                       (8192, 8, 3, 4, False, 29157), (4096, 8, 7, 4, False, 38535), (2048, 64, 20, 1, False, 44402),
                       (2048, 32, 20, 1, False, 45130), (2048, 16, 20, 1, False, 46037), (2048, 8, 14, 1, False, 45455),
                       (1024, 8, 18, 4, False, 48910), (512, 8, 56, 4, False, 52275))
    + _rows_h100("760m", (32768, 8, 1, 2, False, 16291), (16384, 8, 3, 2, False, 27815), (8192, 8, 6, 2, False, 41825),
                         (4096, 8, 12, 2, False, 55459), (2048, 32, 24, 1, False, 67971),
                         (2048, 16, 24, 1, False, 68551), (2048, 8, 24, 2, False, 63147),
                         (1024, 8, 48, 2, False, 78581), (512, 8, 96, 2, False, 83749))
)  # fmt: skip
MPT_H100_FP8 = (
    _rows_h100_fp8("3b", (32768, 8, 3, 6, True, 5856), (8192, 8, 3, 6, False, 19146), (2048, 8, 10, 6, False, 30586),
                         (512, 8, 40, 6, False, 36527))
    + _rows_h100_fp8("1b", (32768, 8, 1, 4, False, 12580), (8192, 8, 2, 4, False, 32010), (512, 8, 56, 4, False, 70315))
)  # fmt: skip

SOURCE_H100_LARGE = (
    "mosaicml/llm-foundry 5e85bd62d, scripts/train/benchmarking/README.md (H100 80GB BF16, Large Scale) and sweep.py"
)

JANUARY_2024 = (("fsdp_backward_prefetch", "pre"),)
"""What the January 2024 runs set beside the stack (sweep.py: backward_prefetch BACKWARD_PRE, forward_prefetch and
limit_all_gathers true; PURE mixed precision, so bf16 reduce-scatters, on the row)."""
UNPADDING = (
    # unpad_input for q, k and v: each a sum, nonzero, max (.item()), cumsum and pad over the mask, then
    # IndexFirstAxis' torch.gather of the rows (read and write); backward torch.zeros and scatter_ (write, read, write).
    # Kernels an estimate: 8 a tensor, counting torch.nonzero as three (its count, scan and select)
    {
        "name": "unpad_qkv",
        "reads": {"h": 3},
        "traffic": {"h": 6},
        "kernels": 24,
        "backward": 1.5,
        "backward_kernels": 6,
    },
    # pad_input of the output: IndexPutFirstAxis' torch.zeros and index_put (write, read, write; index_put an
    # estimated three kernels); backward a gather
    {
        "name": "pad_output",
        "reads": {"h": 1},
        "traffic": {"h": 3},
        "kernels": 4,
        "backward": 0.667,
        "backward_kernels": 1,
    },
)
"""flash_attn_fn in llm-foundry 5e85bd62d (llmfoundry/models/layers/attention.py) runs flash-attn 2.4.2's
flash_attn_varlen_func between flash_attn.bert_padding's unpad_input of the query, key and value and pad_input of
its output, every layer, though the benchmark's sequences are whole (an all-ones mask). Bytes in units of the
layer's h (tokens x hidden, 16-bit); `traffic` only, since the unpadded copies stand in for what the attention saves
anyway. The six host syncs a layer's forward takes (nonzero, .item()) are not priced."""


def _with_unpadding() -> tuple[dict[str, object], ...]:
    """The llm-foundry-0.3 layer with the unpadding around its attention core."""
    layer = [k.model_dump(exclude_defaults=True) for k in loader.load_stack("llm-foundry-0.3").layer]
    core = next(i for i, k in enumerate(layer) if "attention" in k)
    return (*layer[:core], UNPADDING[0], layer[core], UNPADDING[1], *layer[core + 1 :])


FLASH2 = (*JANUARY_2024, ("attention_kernel", "fa2"), ("layer", _with_unpadding()))
"""attn_impl flash on the `.[gpu-flash2]` install: flash-attn 2's kernel (FlashAttention-2), inside llm-foundry's
unpadding (UNPADDING)."""


def _rows_h100_large(
    model: str, zero: int, stack: tuple[tuple[str, object], ...], microbatch: int, ckpt: bool, *rows: tuple[int, float]
) -> tuple[MptRow, ...]:
    return tuple(
        MptRow(model, 2048, microbatch, 1, ckpt, tps, gpus, "h100-sxm5-80gb", "bf16", "bf16", zero, stack)
        for gpus, tps in rows
    )


# The January 2024 "H100 80GB BF16 (Large Scale, >= 128 GPUs)" table (5e85bd62d): sweep.py gives every setting —
# 2,048 tokens, no accumulation, PURE mixed precision, BACKWARD_PRE; per model the sharding, micro-batch, checkpointing
# and attn_impl (flash: FlashAttention-2; triton for 13B and 30B): (GPUs, tokens/s/GPU)
MPT_H100_LARGE = (
    _rows_h100_large("70b", 3, FLASH2, 8, True, (512, 1007), (256, 1035), (128, 1058))
    + _rows_h100_large("30b", 3, JANUARY_2024, 8, True, (512, 2115), (256, 2148), (128, 2199))
    + _rows_h100_large("13b", 3, JANUARY_2024, 16, True, (512, 4952), (256, 4989), (128, 5080))
    + _rows_h100_large("7b", 3, FLASH2, 6, False, (512, 9670), (256, 10119), (128, 10475))
    + _rows_h100_large("3b", 2, FLASH2, 8, False, (512, 21664), (256, 22772), (128, 23422))
    + _rows_h100_large("1b", 2, FLASH2, 12, False, (512, 39837), (256, 42555), (128, 44123))
)  # fmt: skip


CLUSTERS = {
    "a100-sxm4-80gb": "dgx-a100-superpod",
    "a100-sxm4-40gb": "dgx-a100-superpod",
    "h100-sxm5-80gb": "dgx-h100-superpod",
}
"""The DGX nodes of eight each row's accelerator sits in (neither table states its fabric beyond the A100's RoCE)."""


def mpt_plan(row: MptRow) -> Plan:
    """The row on DGX A100 nodes of eight GPUs (the 40GB part where the row ran on it): FSDP FULL_SHARD over every
    GPU (ZeRO-3), no tensor or pipeline parallelism, full recompute where the row checkpoints activations."""
    d, layers, heads = MPT_SIZES[row.model]
    recompute = "full" if row.checkpointing else "none"
    return api.load_plan(
        {
            "name": f"mpt-{row.model}-{row.seq}",
            "model": _gpt(layers, d, heads, MPT_VOCAB, row.seq, tied=True),
            "cluster": {
                "name": CLUSTERS[row.accelerator],
                "overrides": {"nodes": -(-row.gpus // 8), "accelerator": row.accelerator},
            },
            "stack": {"name": "llm-foundry-0.3", "overrides": dict(row.stack)},
            "layout": _layout(1, 1, row.gpus, row.microbatch, 1, zero=row.zero, recompute=recompute),
            "training": {
                "global_batch": row.batch,
                "tokens": 1e11,
                "dtype": row.dtype,
                "grad_reduce_dtype": row.grad_reduce_dtype,
            },
        }
    )


def mpt_tokens_per_gpu(row: MptRow, step_s: float) -> float:
    return row.batch * row.seq / step_s / row.gpus
