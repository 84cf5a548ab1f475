"""NVIDIA's DGX Cloud recipes for Nemotron-4 15B and 340B on H100 (NVIDIA/dgxc-benchmarking v25.02, NeMo 24.12):
a validation table the twin was not built or fitted on, in bf16 and fp8, from 16 to 2,048 GPUs at a fixed batch
per replica (weak scaling). The same release and container as benchmarks/published.py's DGXC_H100 rows, so the
same stack, nemo-24.12, with what these two recipes set differently.

Settings, all from the release (nemotron/nemotron4-{15b,340b}-synth.yaml, with nemotron/configure.sh's overrides):

- 15B: TP4, PP1, CP1, micro-batch 4, global batch 4 per GPU; cuDNN fused attention (NVTE_FUSED_ATTN=1); no
  recompute; userbuffers TP overlap; Megatron-Core's distributed optimizer (`mcore_distributed_optim`) with no
  `grad_sync_dtype`, which NeMo 24.12 reads as fp32 (`grad_reduce_in_fp32=(optim.get('grad_sync_dtype', 'fp32') ==
  'fp32')`, megatron_gpt_model.setup_mcore_distributed_parallel).
- 340B: TP8, PP8, VP12, micro-batch 1, global batch 2 per node; CP2 in bf16 and CP1 in fp8 (configure.sh: "if
  DTYPE = bf16 then CP=2"); FlashAttention-2 (NVTE_FUSED_ATTN=0 leaves Transformer Engine the flash-attn backend);
  selective recompute; userbuffers TP overlap (configure.sh sets ub_tp_comm_overlap=True over the yaml);
  distributed_fused_adam with grad_sync_dtype bf16 (the stack's).
- Both: LayerNorm (layernorm1p) and squared ReLU with no biases or dropout; Megatron-Core's jit_fuser (torch.compile
  on PyTorch >= 2.2) fuses squared_relu = pow(relu(x), 2) into one kernel each way, as bias_gelu is fused in the
  stack's list; fused RoPE (on half the head dims, the fused kernel copying the rest); the fused cross-entropy;
  fp8 working weights under fp8 (configure.sh passes +model.fp8_params, as the stack's fp8_params says).
- Not modelled: 340B's `optim.dtype: bf16` (distributed_fused_adam keeping its moments in bf16, about 6 bytes of
  optimizer state per parameter where the twin counts Adam's 12) and `NCCL_NVLS_ENABLE=0` (every DGX Cloud recipe
  sets it; the twin may pick NVLS for a node's small all-reduces). Both only lower the predicted memory or move
  microseconds; the 340B rows fit either way.

Run as part of benchmarks/published_figures.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.published import TE_DEFAULT_TP_OVERLAP, _cluster, _layout
from plan import loader
from plan.schema import Plan
from twin import api

SOURCE = "NVIDIA/dgxc-benchmarking v25.02 (NeMo 24.12), nemotron/README_{15b,340b}.md"

_NEMO = loader.load_stack("nemo-24.12")


def _layer() -> list[dict[str, Any]]:
    """nemo-24.12's layer with Nemotron-4's LayerNorm (the same bytes as RMSNorm) and squared ReLU for SwiGLU: one
    fused kernel reading the fc1 output and writing the activation; its backward reads the gradient and the input
    and writes one gradient (1.5x the forward's bytes, as bias_gelu's)."""
    out = []
    for kernel in _NEMO.layer:
        k = kernel.model_dump()
        if k["name"] == "te_rms_norm":
            k["name"] = "te_layer_norm"
        elif k["name"] == "fused_swiglu":
            k.update(name="squared_relu", backward=1.5)
        out.append(k)
    return out


@dataclass(frozen=True)
class NemotronRow:
    """One published step time (seconds per step) of the recipe at a GPU count and dtype."""

    model: str
    """nemotron4-15b or nemotron4-340b."""
    gpus: int
    dtype: str
    step_s: float

    @property
    def tp(self) -> int:
        return 4 if self.model == "nemotron4-15b" else 8

    @property
    def pp(self) -> int:
        return 1 if self.model == "nemotron4-15b" else 8

    @property
    def cp(self) -> int:
        return 2 if self.model == "nemotron4-340b" and self.dtype == "bf16" else 1

    @property
    def batch(self) -> int:
        """Global batch: 4 sequences per GPU (15B), 2 per node (340B), as configure.sh sets GBS."""
        return 4 * self.gpus if self.model == "nemotron4-15b" else self.gpus // 4


def _rows(model: str, gpus: tuple[int, ...], bf16: tuple[float, ...], fp8: tuple[float, ...]) -> list[NemotronRow]:
    return [
        NemotronRow(model, g, dtype, s)
        for dtype, times in (("bf16", bf16), ("fp8", fp8))
        for g, s in zip(gpus, times, strict=True)
    ]


NEMOTRON_H100 = tuple(
    _rows(
        "nemotron4-15b",
        (16, 32, 64, 128, 256, 512, 1024, 2048),
        (2.812, 2.824, 2.845, 2.859, 2.852, 2.875, 2.895, 2.887),
        (2.039, 2.046, 2.048, 2.059, 2.075, 2.12, 2.094, 2.12),
    )
    + _rows(
        "nemotron4-340b",
        (128, 256, 512, 1024, 2048),
        (4.61, 4.67, 4.7, 4.73, 4.84),
        (3.16, 3.21, 3.26, 3.34, 3.49),
    )
)


def nemotron_plan(row: NemotronRow) -> Plan:
    """The recipe on DGX H100 SuperPOD nodes, ZeRO-1 (the distributed optimizer), sequence parallel."""
    big = row.model == "nemotron4-340b"
    dp = row.gpus // (row.tp * row.pp * row.cp)
    overrides: dict[str, Any] = {"layer": _layer(), **TE_DEFAULT_TP_OVERLAP}
    if big:
        overrides["attention_kernel"] = "fa2"
    extra: dict[str, Any] = {"cp": row.cp, "zero": 1, "sequence_parallel": True}
    if big:
        extra["recompute"] = "selective"
    training: dict[str, Any] = {"global_batch": row.batch, "tokens": 1e12, "dtype": row.dtype}
    if not big:
        training["grad_reduce_dtype"] = "fp32"
    return api.load_plan(
        {
            "name": f"dgxc-{row.model}-{row.gpus}-{row.dtype}",
            "model": row.model,
            "cluster": _cluster("dgx-h100-superpod", row.gpus, 16384),
            "stack": {"name": "nemo-24.12", "overrides": overrides},
            "layout": _layout(row.tp, row.pp, dp, 1 if big else 4, 12 if big else 1, **extra),
            "training": training,
        }
    )
