"""What a layer's weights cost beside their GEMMs: the fp8 casts around each GEMM (delayed or current scaling, on a
rank's shard where sequence parallelism gathers the operand) and, without wgrad accumulation fusion, each
microbatch's addition of the weight gradients into their buffer. Pure functions of the GEMM shapes and the device;
twin/step/kernels.py adds them to a layer's passes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twin.step.compute import Device
    from twin.step.kernels import Gemm


COLUMN_PARALLEL = ("qkv", "fc1")
"""The column-parallel weight GEMMs (Megatron's split of plan.stack.GEMMS): under sequence parallelism their input is
gathered over tp; the row-parallel ones' (proj, fc2) output gradient is."""


@dataclass(frozen=True)
class Casts:
    """How an fp8 GEMM's operands are cast (cast_bytes)."""

    fused: bool
    """The kernel before wrote this GEMM's input in fp8 (delayed scaling) or with its amax (current scaling)."""
    current: bool
    """Current scaling (Stack.fp8_scaling "current"); else delayed."""
    gather: int
    """Ranks a sequence-parallel operand is gathered over (tp), 1 where nothing is gathered."""
    column: bool
    """Column-parallel (COLUMN_PARALLEL): its input is the gathered operand; row-parallel: its output gradient is."""


def cast_bytes(current: bool, shards: int, fused: bool) -> tuple[float, int]:
    """Bytes per element of the GEMM's full operand, and kernels, of casting one bf16 operand to fp8 with the
    transpose the other gradient GEMM reads. Where the operand is gathered from `shards` tp ranks (sequence
    parallelism), each rank casts its own shard (read 2, write 1) and the fp8 shards are gathered, then transposed
    whole (read 1, write 1: Transformer Engine 1.13 module/base.py grad_output_preprocess `cast_to_fp8`,
    `gather_along_first_dim`, `fp8_transpose`; 2.x gathers the rowwise data and makes the columnwise copy after);
    with `shards` 1, one cast-transpose (read 2, write 1 + 1). A norm that wrote fp8 (delayed, `fused`) leaves only
    the transpose. Current scaling first reads the operand for its amax (2) unless the kernel before computed it,
    and adds the scale kernel."""
    amax = 2 if current and not fused else 0
    extra_kernels = (1 if amax else 0) + (1 if current else 0)
    if shards > 1:
        local = 0 if fused and not current else 3
        return (amax + local) / shards + 2, extra_kernels + (1 if local else 0) + 1
    cast = 2 if fused and not current else 4
    return amax + cast, extra_kernels + 1


def fp8_cast_costs(device: Device, gemms: list[Gemm], casts: Casts) -> tuple[tuple[float, int], tuple[float, int]]:
    """(seconds, kernels) of the casts around fp8 GEMMs (cast_bytes), forward the bf16 input and backward the
    output gradient, each with the transpose the weight-gradient GEMM reads; one set of kernels per GEMM of a batch.
    Current scaling (Transformer Engine 2.x Float8CurrentScalingQuantizer::quantize_impl) takes each scale from the
    tensor itself: after a norm or an activation the amax comes with the kernel's bf16 output (normalization.cpp
    FUSED_NORM_AMAX_FP8, activation.cpp FUSED_ACTIVATION_AMAX_FP8), so the cast is whole where delayed scaling's
    norm wrote fp8."""
    forward = cast_bytes(casts.current, casts.gather if casts.column else 1, casts.fused)
    backward = cast_bytes(casts.current, 1 if casts.column else casts.gather, False)
    inputs = [(mm * kk * b, b) for mm, _, kk, b in gemms]  # a GEMM's input is m x k, its output gradient m x n
    gradients = [(mm * nn * b, b) for mm, nn, _, b in gemms]
    return _casts(device, inputs, *forward), _casts(device, gradients, *backward)


def _casts(device: Device, operands: list[tuple[float, float]], nbytes: float, kernels: int) -> tuple[float, int]:
    """(seconds, kernels) of casting each (elements, batch) operand at `nbytes` an element, `kernels` a batch."""
    seconds = sum(device.elementwise_s(elements * nbytes, kernels * b) for elements, b in operands)
    return seconds, sum(round(kernels * b) for _, b in operands)


def grad_accumulation_s(
    device: Device, gemms: dict[str, list[Gemm]], grad_bytes: int, upcast: bool
) -> tuple[float, float, int]:
    """(seconds, FLOPs, kernels) without wgrad accumulation fusion (Stack.wgrad_accumulation_fusion): each weight's
    fresh 16-bit gradient is added to its accumulation buffer every microbatch, reading 2 bytes and `grad_bytes`
    and writing `grad_bytes` per weight, one streaming kernel per weight tensor (at the tuned-kernel bandwidth: a
    contiguous add, not a framework reduction); with `upcast` (Stack.grad_accumulation_upcast) the gradient is first
    cast into a temporary of `grad_bytes` that the add reads, a second kernel per tensor. The GEMM's own output,
    fresh or accumulated, is written under its compute either way."""
    batches = [gemm for batch in gemms.values() for gemm in batch]
    weights = sum(nn * kk * b for _, nn, kk, b in batches)
    per_weight = 2 + 2 * grad_bytes + (2 * grad_bytes if upcast else 0)
    kernels = len(batches) * (2 if upcast else 1)
    return device.memory_s(weights * per_weight, kernels), 0.0, kernels
