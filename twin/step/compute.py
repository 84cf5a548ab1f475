"""Compute cost of a transformer layer on one rank: FLOPs and bytes, split into forward, backward-input and
backward-weight, timed on the accelerator's efficiency curve.

Counting follows Narayanan et al. 2021 (§3.1) and Korthikanti et al. 2022: every GEMM costs 2·M·N·K FLOPs forward
and the same again for each of its two backward GEMMs (input and weight gradients); attention scores and their
weighting cost 2·2·b·heads·s·s_kv·d_head forward, halved by causal masking in what the hardware runs, and a fused
(flash) attention backward runs 2.5x its forward (Dao 2023, FlashAttention-2 §3.1: five matmuls against two). The
element-wise work (norms, residual adds, RoPE, the MLP activation) is memory-bound: bytes over achieved HBM
bandwidth. Every kernel also pays the cluster's fixed per-kernel overhead.
"""

from __future__ import annotations

from dataclasses import dataclass

from plan.cluster import Cluster
from plan.schema import ModelSpec

DTENSOR_OPS_FORWARD = 4
"""Ops a tensor-parallel linear dispatches on DTensors in its forward, each paying the sharded per-op cost: aten.t,
view, mm and _unsafe_view (a 3-D input is flattened around the matmul). Counted with a TorchDispatchMode around
the executor's TP layers (apply_tensor_parallel, torch 2.13): 116 such ops for cpu-tiny's 29 TP linears;
tests/test_dtensor_op_counts.py counts them again on every run."""

DTENSOR_OPS_BACKWARD = 9
"""The same linear's DTensor ops in backward, its input- and weight-gradient GEMMs together: 4 t, 2 view, 2 mm and
a detach (263 for the 29 linears, the embedding's one included), split evenly between the two GEMMs."""

ACT_BYTES = 2
"""Activations and element-wise work stay in bf16 under fp8 training (fp8 applies to GEMM inputs; Micikevicius et
al. 2022, "FP8 Formats for Deep Learning"; DeepSeek-V3 report §3.3)."""


@dataclass(frozen=True)
class Device:
    """One rank's compute in SI units."""

    peak_flops: float
    """Dense peak for the plan's matmul dtype (FLOP/s)."""
    gemm_fraction: float
    """Highest fraction of that peak a large GEMM reaches."""
    half_flops: float
    """GEMM size reaching half of `gemm_fraction` (FLOP)."""
    kernel_s: float
    """Fixed cost of one kernel launch and dispatch (s)."""
    memory_Bps: float
    """Achieved memory bandwidth of memory-bound kernels (bytes/s)."""
    sharded_s: float = 0.0
    """Extra host cost of one op on a tensor-parallel DTensor (s); 0 without tensor parallelism."""
    layer_s: float = 0.0
    """Fixed host cost of one layer for one microbatch, each way (s)."""

    @classmethod
    def of(
        cls, cluster: Cluster, dtype: str, ranks_per_node: int, *, share_cores: bool = True, sharded: bool = False
    ) -> Device:
        """The device a rank sees. A `cpu` accelerator's figures are per core: with `share_cores` the node's cores
        are split evenly among its ranks; without, the rank runs alone (the pipeline simulation then shares the
        cores among the ranks busy at each moment, twin/step/host.py). `sharded` ops (tensor-parallel DTensors) pay
        the extra per-op dispatch cost."""
        acc, eff = cluster.accelerator, cluster.compute
        key = dtype if dtype in acc.peak_tflops else "bf16"
        cpu_share = acc.kind == "cpu" and share_cores
        share = min(1.0, cluster.node.cpu_cores / max(1, ranks_per_node)) if cpu_share else 1.0
        memory = acc.hbm_bandwidth_GBps * 1e9 * eff.memory_bandwidth_fraction
        if cpu_share:
            memory /= max(1, ranks_per_node)
        return cls(
            peak_flops=acc.peak_tflops[key] * 1e12 * share,
            gemm_fraction=eff.gemm_peak_fraction.get(key, eff.gemm_peak_fraction["bf16"]),
            half_flops=eff.gemm_half_gflop * 1e9,
            kernel_s=eff.kernel_overhead_us * 1e-6 / share,
            sharded_s=eff.sharded_kernel_overhead_us * 1e-6 / share if sharded else 0.0,
            layer_s=eff.layer_overhead_us * 1e-6 / share,
            memory_Bps=memory,
        )

    def gemm_s(self, flops: float) -> float:
        """One GEMM: efficiency fraction · f / (f + f_half) of peak, i.e. (f + f_half) / (fraction · peak)."""
        if flops <= 0:
            return 0.0
        return (flops + self.half_flops) / (self.gemm_fraction * self.peak_flops) + self.kernel_s

    def linear_s(self, flops: float, dtensor_ops: float) -> float:
        """A weight GEMM and, on a tensor-parallel layer, the DTensor ops around it (attention's GEMMs run on local
        tensors and pay none)."""
        return self.gemm_s(flops) + (dtensor_ops * self.sharded_s if flops > 0 else 0.0)

    def memory_s(self, nbytes: float, kernels: int) -> float:
        """Memory-bound kernels moving `nbytes` in all."""
        return nbytes / self.memory_Bps + kernels * self.kernel_s


@dataclass(frozen=True)
class Shape:
    """The tensor sizes of one microbatch of one layer on one rank."""

    tokens: int
    """Tokens of the microbatch on this rank: microbatch_size · seq_len / cp."""
    tp: int
    sequence_parallel: bool
    fused_projections: bool = True
    """Q, K and V as one GEMM (Megatron) or three (the executor's layers)."""


@dataclass(frozen=True)
class PassCost:
    """Seconds and hardware FLOPs of one layer for one microbatch on one rank, before communication."""

    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    recompute_s: float
    forward_flops: float
    backward_flops: float
    recompute_flops: float
    attention_s: float = 0.0
    """Forward time of the attention core alone (what context-parallel exchanges can hide behind)."""


def _gemms(m: ModelSpec, tokens: int, tp: int, moe: bool, fused: bool = True) -> list[float]:
    """Forward FLOPs of each weight GEMM of one layer on one TP rank."""
    h, t = m.hidden, tp
    hq, hkv = m.heads * m.d_head, m.n_kv_heads * m.d_head
    qkv = [2.0 * tokens * h * (hq + 2 * hkv) / t] if fused else [2.0 * tokens * h * n / t for n in (hq, hkv, hkv)]
    gemms = [*qkv, 2.0 * tokens * hq * h / t]
    mlp_mats = 3 if m.glu else 2
    if not moe:
        return gemms + [2.0 * tokens * h * m.ffn_hidden / t] * mlp_mats
    assert m.moe_ffn_hidden is not None
    routed = tokens * m.top_k  # balanced routing: each rank's experts see top_k tokens per local token
    gemms.append(2.0 * tokens * h * m.experts)  # router
    gemms += [2.0 * routed * h * m.moe_ffn_hidden / t] * mlp_mats
    gemms += [2.0 * tokens * h * m.moe_ffn_hidden * m.shared_experts / t] * (mlp_mats if m.shared_experts else 0)
    return gemms


def attention_flops(m: ModelSpec, microbatch: int, seq_local: int, tp: int) -> float:
    """Forward FLOPs of scores and weighting on one rank, causal (half of the full s x s_kv)."""
    return 0.5 * 2 * 2 * microbatch * (m.heads / tp) * seq_local * m.seq_len * m.d_head


def _elementwise_bytes(m: ModelSpec, shape: Shape, moe: bool) -> tuple[float, int]:
    """Bytes the forward's memory-bound kernels move, and how many kernels they are."""
    b, t = ACT_BYTES, shape.tp
    sp_tokens = shape.tokens / t if shape.sequence_parallel else shape.tokens
    hq, hkv = m.heads * m.d_head, m.n_kv_heads * m.d_head
    width = (m.moe_ffn_hidden or 0) * (m.top_k + m.shared_experts) if moe else m.ffn_hidden
    norms_and_adds = 2 * 2 * sp_tokens * m.hidden * b + 2 * 3 * sp_tokens * m.hidden * b  # 2 norms, 2 adds
    rope = 2 * shape.tokens * (hq + hkv) / t * b
    act = (3 if m.glu else 2) * shape.tokens * width / t * b
    return norms_and_adds + rope + act, 6


def layer_cost(
    m: ModelSpec, shape: Shape, device: Device, moe: bool, recompute: str, microbatch: int, seq_local: int
) -> PassCost:
    """One layer's compute for one microbatch on one rank under a recompute policy."""
    gemms = _gemms(m, shape.tokens, shape.tp, moe, shape.fused_projections)
    attn = attention_flops(m, microbatch, seq_local, shape.tp)
    elem_bytes, elem_kernels = _elementwise_bytes(m, shape, moe)
    gemm_fwd = sum(device.linear_s(f, DTENSOR_OPS_FORWARD) for f in gemms)
    gemm_bwd = sum(device.linear_s(f, DTENSOR_OPS_BACKWARD / 2) for f in gemms)  # input and weight gradients each
    attn_fwd = device.gemm_s(attn)
    elem_fwd = device.memory_s(elem_bytes, elem_kernels)
    forward = gemm_fwd + attn_fwd + elem_fwd + device.layer_s
    # backward: input-gradient GEMMs, the fused attention backward (2.5x its forward) and element-wise work
    # twice; weight-gradient GEMMs as many again as forward
    backward_input = gemm_bwd + device.gemm_s(2.5 * attn) + device.memory_s(2 * elem_bytes, 2 * elem_kernels)
    backward_weight = gemm_bwd
    if recompute == "full":
        recompute_s, recompute_flops = forward, sum(gemms) + attn
    elif recompute == "selective":  # attention core, norms, MLP activation (see twin/step/memory.py)
        recompute_s, recompute_flops = attn_fwd + elem_fwd, attn
    else:
        recompute_s, recompute_flops = 0.0, 0.0
    return PassCost(
        forward_s=forward,
        backward_input_s=backward_input,
        backward_weight_s=backward_weight,
        recompute_s=recompute_s,
        forward_flops=sum(gemms) + attn,
        backward_flops=2 * sum(gemms) + 2.5 * attn,
        recompute_flops=recompute_flops,
        attention_s=attn_fwd,
    )


def head_cost(m: ModelSpec, shape: Shape, device: Device) -> PassCost:
    """The output head and loss on the last stage: a vocab-parallel GEMM and a memory-bound cross-entropy."""
    gemm = 2.0 * shape.tokens * m.hidden * m.vocab / shape.tp
    logits_bytes = 3 * shape.tokens * m.vocab / shape.tp * 4  # fp32 softmax: read logits, write probs, read back
    fwd = device.linear_s(gemm, DTENSOR_OPS_FORWARD) + device.memory_s(logits_bytes, 3)
    grad = device.linear_s(gemm, DTENSOR_OPS_BACKWARD / 2)
    return PassCost(fwd, grad + device.memory_s(logits_bytes, 2), grad, 0.0, gemm, 2 * gemm, 0.0)


def embedding_cost(m: ModelSpec, shape: Shape, device: Device) -> PassCost:
    """The input embedding on the first stage: a gather forward, a scatter-add of gradients backward."""
    nbytes = shape.tokens * m.hidden * ACT_BYTES
    return PassCost(device.memory_s(2 * nbytes, 1), 0.0, device.memory_s(3 * nbytes, 1), 0.0, 0.0, 0.0, 0.0)
