"""The first and last pipeline stage's extras beside their layers, for one microbatch on one rank: the input
embedding's gather and its dense gradient, and the output head's vocab-parallel GEMM with the stack's loss kernels
(twin/step/kernels.py prices the layers)."""

from __future__ import annotations

from plan.schema import ModelSpec
from plan.stack import Stack
from twin.step.casts import grad_accumulation_s
from twin.step.compute import DTENSOR_OPS_BACKWARD, DTENSOR_OPS_FORWARD, LOSS_PARALLEL_DTENSOR_OPS, Device
from twin.step.kernels import PassCost, Shape, kernel_bytes, tensor_sizes


def head_cost(m: ModelSpec, shape: Shape, device: Device, stack: Stack) -> PassCost:
    """The output head and loss on the last stage: a vocab-parallel GEMM, in bf16 under an fp8 plan
    (Device.sixteen_bit), and the stack's loss kernels; without wgrad accumulation fusion its weight gradient is
    added to the buffer each microbatch as a layer's are (casts.grad_accumulation_s)."""
    tokens, h, v = float(shape.tokens), float(m.hidden), m.vocab / shape.tp
    loss_ops = LOSS_PARALLEL_DTENSOR_OPS  # priced at the sharded per-op cost, zero where nothing is a DTensor
    wide = device.sixteen_bit()
    fwd = wide.linear_s(tokens, v, h, DTENSOR_OPS_FORWARD + loss_ops[0])
    dgrad = wide.linear_s(tokens, h, v, DTENSOR_OPS_BACKWARD / 2 + loss_ops[1])
    wgrad = wide.linear_s(h, v, tokens, DTENSOR_OPS_BACKWARD / 2)
    accumulated = 0
    if not stack.wgrad_accumulation_fusion:
        seconds, _, accumulated = grad_accumulation_s(
            device, {"head": [(tokens, v, h, 1.0)]}, shape.grad_bytes, stack.grad_accumulation_upcast
        )
        wgrad += seconds
    sizes = tensor_sizes(m, shape, moe=False)
    loss_fwd = loss_bwd = 0.0
    kernels = [1, 2]
    for k in stack.head_kernels:
        nbytes = kernel_bytes(k, sizes, shape, stack)
        loss_fwd += device.elementwise_s(nbytes, k.kernels)
        loss_bwd += device.elementwise_s(k.backward * nbytes, k.backward_kernels)
        kernels = [kernels[0] + k.kernels, kernels[1] + k.backward_kernels]
    gemm = 2.0 * tokens * h * v
    return PassCost(
        forward_s=fwd + loss_fwd,
        backward_input_s=dgrad + loss_bwd,
        backward_weight_s=wgrad,
        recompute_s=0.0,
        forward_flops=gemm,
        backward_flops=2 * gemm,
        recompute_flops=0.0,
        gemm_s=(dgrad, wgrad),
        forward_gemm_s=fwd,
        kernels=(kernels[0], kernels[1] + accumulated),
    )


def embedding_cost(m: ModelSpec, shape: Shape, device: Device, grad_bytes: int, upcast: bool) -> PassCost:
    """The input embedding on the first stage: a gather forward; backward, a scatter-add of the tokens' gradients
    into a dense gradient of the rank's whole vocabulary shard, zero-filled first, which is then added to the
    buffer gradients accumulate in over the microbatches (`grad_bytes` per element). PyTorch's embedding backward
    is dense unless the embedding is sparse (aten embedding_dense_backward), and Megatron's data-parallel wrapper
    adds each microbatch's `grad` to `main_grad` (megatron/core/distributed param hooks); FSDP2 accumulates `grad`
    likewise. At a 131k vocabulary that is a gigabyte or more moved per microbatch, whatever its tokens. With
    `upcast` (Stack.grad_accumulation_upcast) the gradient is cast into a temporary of the buffer's dtype first."""
    nbytes = shape.tokens * m.hidden * shape.act_bytes
    dense = m.vocab / shape.tp * m.hidden  # the gradient of the rank's vocabulary shard, every row
    accumulate = dense * (2 * shape.act_bytes + 2 * grad_bytes)  # zero-fill and read it; read-add-write the buffer
    adds = 2 + int(upcast)
    if upcast:
        accumulate += dense * 2 * grad_bytes  # the temporary, written and read
    return PassCost(
        device.elementwise_s(2 * nbytes, 1),
        0.0,
        device.elementwise_s(3 * nbytes, 1) + device.elementwise_s(accumulate, adds),
        0.0,
        0.0,
        0.0,
        0.0,
        kernels=(1, 1 + adds),
    )
