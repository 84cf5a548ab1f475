"""One transformer layer's compute on one rank for one microbatch, kernel by kernel as the stack runs it.

The stack (plan/stack.py) lists a layer's forward kernels: the weight GEMMs and the attention core are priced from
the model's shapes (twin/step/compute.py), every other kernel from the bytes it moves. Backward: each GEMM's two
gradient GEMMs (input, weight — B and W when a schedule splits them), the attention core's backward, each
memory-bound kernel's `backward` multiple of its forward bytes. Recompute reruns the forward (full) or the kernels
the stack marks as recomputed (selective: the attention core).

FLOPs follow Narayanan et al. 2021 (§3.1): 2·m·n·k per GEMM forward and the same for each gradient GEMM; a fused
causal attention executes half of the s x s work (FlashAttention-2 §3.1: backward 2.5x forward), an unfused one
the whole of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plan.schema import Layout, ModelSpec
from plan.stack import Kernel, Stack
from twin.step.casts import COLUMN_PARALLEL, Casts, fp8_cast_costs, grad_accumulation_s
from twin.step.compute import ACT_BYTES, DTENSOR_OPS_BACKWARD, DTENSOR_OPS_FORWARD, Device

Gemm = tuple[float, float, float, float]
"""(m, n, k, batch): a batch of m x k by k x n products."""


@dataclass(frozen=True)
class Shape:
    """The tensor sizes of one microbatch of one layer on one rank."""

    tokens: int
    """Tokens of the microbatch on this rank: microbatch_size · seq_len / cp."""
    tp: int
    sequence_parallel: bool
    fused_projections: bool = True
    """Q, K and V (and gate, up) as one GEMM (Megatron) or one each (the executor's layers)."""
    microbatch: int = 1
    """Sequences in the microbatch."""
    seq_kv: int = 0
    """Keys each query attends over: the whole sequence (context parallelism gathers or rings it)."""
    experts_local: int = 1
    """Routed experts a rank holds: experts / ep."""
    expert_tp: int | None = None
    """Ranks an MoE MLP is split over (kernels.expert_split): tp where None, 1 where each tp rank runs it whole."""
    act_bytes: int = ACT_BYTES
    """Bytes per activation element (4 for fp32 training, twin.step.compute.act_bytes)."""
    grad_bytes: int = 2
    """Bytes per element of the buffer weight gradients accumulate in (memory.grad_reduce_bytes)."""


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
    gemm_s: tuple[float, float] = (0.0, 0.0)
    """Seconds of the weight GEMMs' input- and weight-gradient halves (what backward TP collectives overlap)."""
    forward_gemm_s: float = 0.0
    """Seconds of the forward weight GEMMs (what forward TP collectives overlap under userbuffers)."""
    attention_gemm_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Forward, input-gradient and weight-gradient seconds of the attention block's GEMMs (qkv, proj): what its
    own TP collectives can overlap in an MoE layer, whose expert GEMMs sit behind the dispatcher's collectives."""
    kernels: tuple[int, int] = (0, 0)
    """Kernels issued forward and backward (the host must dispatch each)."""


def tensor_sizes(m: ModelSpec, shape: Shape, moe: bool) -> dict[str, float]:
    """Elements of each named tensor (plan.stack.TENSORS) per token of the microbatch on this rank."""
    t = shape.tp
    # the attention core's inputs: Q and K heads (with MLA's RoPE part) and V heads; RoPE rewrites its part of Q, K
    q_in, v_in = m.heads * m.qk_head_dim, m.n_kv_heads * m.v_dim
    roped = m.heads * m.rope_head_dim + m.rope_head_dim if m.is_mla else (m.heads + m.n_kv_heads) * m.d_head
    width = (m.moe_ffn_hidden or 0) * (m.top_k + m.shared_experts) if moe else m.ffn_hidden
    mlp_t, shard = mlp_tp(shape, moe), routing_shard(shape)
    return {
        "h": float(m.hidden),
        "h_sp": m.hidden / t if shape.sequence_parallel else float(m.hidden),
        "qkv": (q_in + m.n_kv_heads * m.qk_head_dim + v_in) / t,
        "qk": roped / t,
        "ctx": m.heads * m.v_dim / t,
        "ffn_in": width * (2 if m.glu else 1) / mlp_t,
        "ffn": width / mlp_t,
        "scores": m.heads / t * (shape.seq_kv or shape.tokens),
        "logits": m.vocab / t,
        "routed": m.top_k * routed_load(m) * m.hidden / shard if moe else 0.0,
        "router": m.experts / shard if moe else 0.0,
        "query": q_in / t,
        "kv_up": m.heads * (m.d_head + m.v_dim) / t,
        "q_pe": m.heads * m.rope_head_dim / t,
        "k_pe": float(m.rope_head_dim),
        "experts_in": m.top_k * routed_load(m) * m.hidden / expert_rows_shard(shape) if moe else 0.0,
    }


def weight_gemms(m: ModelSpec, shape: Shape, moe: bool) -> dict[str, list[Gemm]]:
    """The weight GEMMs of one layer on one TP rank, by the stack's GEMM names."""
    t, tokens, h = shape.tp, float(shape.tokens), float(m.hidden)
    hq, hkv = m.heads * m.d_head, m.n_kv_heads * m.d_head
    fused = shape.fused_projections
    qkv: list[Gemm] = (
        [(tokens, (hq + 2 * hkv) / t, h, 1.0)] if fused else [(tokens, n / t, h, 1.0) for n in (hq, hkv, hkv)]
    )
    if m.is_mla:
        qkv = [g for part in latent_gemms(m, shape) for g in part]
    gemms: dict[str, list[Gemm]] = {"qkv": qkv, "proj": [(tokens, h, m.heads * m.v_dim / t, 1.0)]}
    ups = 2 if m.glu else 1
    if not moe:
        width = m.ffn_hidden / t
        up: list[Gemm] = [(tokens, ups * width, h, 1.0)] if fused else [(tokens, width, h, 1.0)] * ups
        return {**gemms, "fc1": up, "fc2": [(tokens, h, width, 1.0)]}
    assert m.moe_ffn_hidden is not None
    width = m.moe_ffn_hidden / mlp_tp(shape, moe)
    routed = tokens / expert_rows_shard(shape)
    per_expert = routed * m.top_k / shape.experts_local * routed_load(m)  # each local expert's rows
    e = float(shape.experts_local)
    fc1: list[Gemm] = [(per_expert, ups * width, h, e)]
    fc2: list[Gemm] = [(per_expert, h, width, e)]
    if m.shared_experts:
        fc1.append((routed, ups * width * m.shared_experts, h, 1.0))
        fc2.append((routed, h, width * m.shared_experts, 1.0))
    return {**gemms, ROUTER: [(tokens, float(m.experts), h, 1.0)], "fc1": fc1, "fc2": fc2}


def latent_gemms(m: ModelSpec, shape: Shape) -> tuple[list[Gemm], list[Gemm]]:
    """Multi-head latent attention's projections on one tp rank, as Megatron-Core runs them
    (transformer/multi_latent_attention.py): the down-projections whole on every rank, on its sequence-parallel shard
    of tokens (parallel_mode "duplicated"); the latents gathered over tp, then the up-projections column-parallel
    over the heads: queries from the query latent (or from the hidden state), keys and values from the key-value
    latent. Returns (down-projections, up-projections): the up-projections are what Stack.mla_up_recompute reruns."""
    assert m.kv_lora_rank is not None
    t, tokens, h = shape.tp, float(shape.tokens), float(m.hidden)
    shard = tokens / (t if shape.sequence_parallel else 1)
    q_lora = m.q_lora_rank
    down: list[Gemm] = [(shard, float(m.kv_lora_rank + m.rope_head_dim + (q_lora or 0)), h, 1.0)]
    q_up: Gemm = (tokens, m.heads * m.qk_head_dim / t, float(q_lora or m.hidden), 1.0)
    kv_up: Gemm = (tokens, m.heads * (m.d_head + m.v_dim) / t, float(m.kv_lora_rank), 1.0)
    return down, [q_up, kv_up]


ROUTER = "router"
"""An MoE layer's gating GEMM, run with its fc1 (in bf16 under fp8: Device.sixteen_bit)."""


def expert_split(lay: Layout, stack: Stack) -> int:
    """Ranks an MoE MLP is split over: the layout's expert_tp where set (Megatron-Core's expert tensor parallelism
    over folded experts), else under `stack` tp where it splits experts as dense MLPs, else 1."""
    if lay.expert_tp is not None:
        return lay.expert_tp
    return lay.tp if stack.moe_tensor_parallel else 1


def mlp_tp(shape: Shape, moe: bool) -> int:
    """Ranks a layer's MLP is split over: tp, or the stack's expert split for an MoE layer."""
    return (shape.expert_tp or shape.tp) if moe else shape.tp


def expert_rows_shard(shape: Shape) -> int:
    """Ranks whose routed tokens an expert's GEMMs leave apart: 1 where experts split over tp gather their tp group's
    copies (or nothing is sharded), else the routing shard: whole experts on a tp rank take only its own shard's
    copies (the executor; Megatron-Core's folded experts at expert_tp 1), and a whole shared expert its shard."""
    return 1 if mlp_tp(shape, moe=True) == shape.tp else routing_shard(shape)


def routing_shard(shape: Shape) -> int:
    """Ranks that split an MoE layer's tokens between them before routing: tp under sequence parallelism, where
    each tp rank routes its own shard (Megatron-Core's all-to-all dispatcher, and the executor, whose experts run
    whole on each tp rank), else 1 (every tp rank routes all of them)."""
    return shape.tp if shape.sequence_parallel else 1


def routed_load(m: ModelSpec) -> float:
    """The busiest expert-parallel rank's routed tokens over the even share: the imbalance the plan gives, which a
    capacity caps (tokens over it are dropped, not computed)."""
    return min(m.expert_imbalance, m.capacity_factor or math.inf)


def attention_flops(m: ModelSpec, microbatch: int, seq_local: int, tp: int) -> float:
    """Forward FLOPs of scores and weighting on one rank, causal (half of the full s x s_kv; a sliding window's layers
    only their window's, as the mean over the layers: ModelSpec.causal_window_factor)."""
    pairs = 0.5 * seq_local * m.seq_len * m.causal_window_factor
    return 2 * 2 * microbatch * (m.heads / tp) * pairs * m.attention_width


@dataclass
class _Tally:
    """Seconds, FLOPs and kernels of a pass, added up kernel by kernel."""

    seconds: float = 0.0
    flops: float = 0.0
    kernels: int = 0

    def add(self, seconds: float, flops: float = 0.0, kernels: int = 1) -> None:
        self.seconds, self.flops, self.kernels = self.seconds + seconds, self.flops + flops, self.kernels + kernels


ATTENTION_GEMMS = ("qkv", "proj")
"""The attention block's weight GEMMs (plan.stack.GEMMS); fc1 and fc2 are the MLP's."""


def layer_cost(m: ModelSpec, shape: Shape, device: Device, stack: Stack, moe: bool, recompute: str) -> PassCost:
    """One layer's compute for one microbatch on one rank under a recompute policy, as the stack runs it."""
    sizes = tensor_sizes(m, shape, moe)
    gemms = weight_gemms(m, shape, moe)
    fwd, dgrad, wgrad, other, again = _Tally(), _Tally(), _Tally(), _Tally(), _Tally()
    attention_fwd = fwd_gemm = 0.0
    block = (_Tally(), _Tally(), _Tally())  # the attention block's GEMMs: forward, input and weight gradients
    cast_in = False  # the kernel before wrote its output in fp8 (Kernel.fp8_output)
    for kernel in stack.layer + (stack.moe_kernels if moe else ()):
        if not kernel.runs_in(m.is_mla, shape.experts_local):
            continue
        before = fwd.seconds
        if kernel.gemm:
            routed = moe and kernel.gemm == "fc1"  # the router runs first; the experts' input arrives permuted
            attention_block = block if kernel.gemm in ATTENTION_GEMMS else ()
            for gemm in gemms[ROUTER] if routed else ():
                _add_gemm(device.sixteen_bit(), gemm, (fwd, dgrad, wgrad), attention_block)
            streams = stack.grouped_gemm_streams if moe and kernel.gemm not in ATTENTION_GEMMS else 0  # the experts'
            forward_device = device.without_sms(sm_margin(stack, shape, kernel.gemm, moe)).grouped(streams)
            for gemm in gemms[kernel.gemm]:
                _add_gemm(device.grouped(streams), gemm, (fwd, dgrad, wgrad), attention_block, forward_device)
            fwd_gemm += fwd.seconds - before
            if kernel.gemm == "qkv" and m.is_mla and stack.mla_up_recompute:  # rerun from the latents
                for mm, nn, kk, b in latent_gemms(m, shape)[1]:
                    again.add(_batched(device, mm, nn, kk, b, DTENSOR_OPS_FORWARD), 2 * mm * nn * kk * b, 0)
            if device.operand_bytes == 1:
                experts = moe and kernel.gemm not in ATTENTION_GEMMS  # behind the dispatcher, not a tp gather
                casts = Casts(
                    fused=cast_in and not routed,
                    current=stack.fp8_scaling == "current",
                    gather=shape.tp if shape.sequence_parallel and not experts else 1,
                    column=kernel.gemm in COLUMN_PARALLEL,
                )
                (cast_s, cast_kernels), (grad_s, grad_kernels) = fp8_cast_costs(device, gemms[kernel.gemm], casts)
                fwd.add(cast_s, 0.0, cast_kernels)
                other.add(grad_s, 0.0, grad_kernels)
        elif kernel.attention:
            attention_fwd += _attention(m, shape, device, kernel, fwd, other)
        else:
            nbytes = kernel_bytes(kernel, sizes, shape, stack)
            fwd.add(device.elementwise_s(nbytes, kernel.kernels), 0.0, kernel.kernels)
            other.add(
                device.elementwise_s(kernel.backward * nbytes, kernel.backward_kernels), 0.0, kernel.backward_kernels
            )
        cast_in = kernel.fp8_output
        rerun = recompute == "selective" and kernel.recomputed and not kernel.gemm
        rerun = rerun or (kernel.attention_form == "latent" and stack.mla_up_recompute)  # with the up-projections
        if recompute == "full" or rerun or not kernel.saves_output:
            again.add(fwd.seconds - before, 0.0, 0)
    if not stack.wgrad_accumulation_fusion:
        wgrad.add(*grad_accumulation_s(device, gemms, shape.grad_bytes, stack.grad_accumulation_upcast))
    forward = fwd.seconds + device.layer_s
    recompute_flops = {"full": fwd.flops, "selective": _core_flops(m, shape, stack)}.get(recompute, 0.0)
    recompute_flops += again.flops if recompute != "full" else 0.0  # the latent up-projections, where rerun
    return PassCost(
        forward_s=forward,
        backward_input_s=dgrad.seconds + other.seconds,
        backward_weight_s=wgrad.seconds,
        recompute_s=(forward if recompute == "full" else again.seconds),
        forward_flops=fwd.flops,
        backward_flops=dgrad.flops + wgrad.flops + other.flops,
        recompute_flops=recompute_flops,
        attention_s=attention_fwd,
        gemm_s=(dgrad.seconds, wgrad.seconds),
        forward_gemm_s=fwd_gemm,
        attention_gemm_s=(block[0].seconds, block[1].seconds, block[2].seconds),
        kernels=(fwd.kernels, dgrad.kernels + wgrad.kernels + other.kernels),
    )


def kernel_bytes(kernel: Kernel, sizes: dict[str, float], shape: Shape, stack: Stack) -> float:
    """Bytes a memory-bound kernel's forward moves for one microbatch: its traffic (or reads and writes) in the
    16-bit activation dtype, times the stack's fp32 multiple when the plan trains in fp32."""
    moved = [kernel.traffic] if kernel.traffic else [kernel.reads, kernel.writes]
    units = sum(n * sizes[name] for tensors in moved for name, n in tensors.items())
    return units * shape.tokens * ACT_BYTES * (stack.fp32_traffic if shape.act_bytes == 4 else 1.0)


def sm_margin(stack: Stack, shape: Shape, gemm: str, moe: bool = False) -> int:
    """SMs withheld from a row-parallel GEMM's forward for its pipelined reduce-scatter (Stack.tp_overlap_sm_margin):
    only where userbuffers overlap a sequence-parallel layer's collectives, and not for an MoE layer's expert GEMMs,
    which run outside Transformer Engine's userbuffers."""
    overlapped = stack.tp_overlap == "userbuffers" and shape.tp > 1 and shape.sequence_parallel
    if not overlapped or (moe and gemm == "fc2"):
        return 0
    return stack.tp_overlap_sm_margin.get(gemm, 0)


def _add_gemm(
    device: Device, gemm: Gemm, tallies: tuple[_Tally, ...], block: tuple[_Tally, ...], forward: Device | None = None
) -> None:
    """One weight GEMM's forward (on `forward` where its SMs differ), input- and weight-gradient products into
    `tallies` (and the attention block's)."""
    mm, nn, kk, b = gemm
    times = (
        _batched(forward or device, mm, nn, kk, b, DTENSOR_OPS_FORWARD),
        _batched(device, mm, kk, nn, b, DTENSOR_OPS_BACKWARD / 2),
        _batched(device, kk, nn, mm, b, DTENSOR_OPS_BACKWARD / 2),
    )
    for tally, seconds in zip(tallies, times, strict=True):
        tally.add(seconds, 2 * mm * nn * kk * b, device.gemm_launches(b))
    for tally, seconds in zip(block, times, strict=False):  # block: the attention block's three, or none
        tally.add(seconds)


def _batched(device: Device, m: float, n: float, k: float, batch: float, dtensor_ops: float) -> float:
    return device.gemm_s(m, n, k, batch) + (dtensor_ops * device.sharded_s if m > 0 and n > 0 and k > 0 else 0.0)


def _attention(m: ModelSpec, shape: Shape, device: Device, kernel: Kernel, fwd: _Tally, bwd: _Tally) -> float:
    """Add the attention core's forward and backward; return its forward seconds."""
    heads, d = m.heads / shape.tp, m.qk_head_dim
    seq_q = shape.tokens // shape.microbatch
    seq_kv = shape.seq_kv or seq_q
    b = shape.microbatch * heads
    if kernel.attention == "flash":
        flops = attention_flops(m, shape.microbatch, seq_q, shape.tp)
        f, back = device.attention_s(flops, seq_kv, d)
        fwd.add(f, flops)
        bwd.add(back, 2.5 * flops)
        return f
    if kernel.attention == "scores":  # Q·Kᵀ over the whole s x s_kv, no causal skipping; gradients for Q and K
        mm, nn, kk = seq_q, seq_kv, d
    else:  # probabilities · V; gradients for the probabilities and V
        mm, nn, kk = seq_q, m.v_dim, seq_kv
    flops = 2.0 * mm * nn * kk * b
    f = device.gemm_s(mm, nn, kk, b)
    fwd.add(f, flops)
    bwd.add(device.gemm_s(mm, kk, nn, b) + device.gemm_s(kk, nn, mm, b), 2 * flops, 2)
    return f


def _core_flops(m: ModelSpec, shape: Shape, stack: Stack) -> float:
    """FLOPs selective recompute reruns: the attention core (causal when fused, the whole s x s_kv unfused)."""
    seq_q = shape.tokens // shape.microbatch
    if stack.flash:
        return attention_flops(m, shape.microbatch, seq_q, shape.tp)
    return 2 * 2.0 * shape.microbatch * m.heads / shape.tp * seq_q * (shape.seq_kv or seq_q) * m.attention_width
