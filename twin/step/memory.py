"""Memory per GPU: weights, gradients and optimizer state under ZeRO 0-3, activations under each recompute
policy, the microbatches the schedule keeps in flight, and whether it all fits.

Model state follows the mixed-precision Adam accounting of Rajbhandari et al. 2020 (ZeRO, §3): bf16 weights (2 B),
bf16 gradients (2 B) and fp32 master weights, momentum and variance (12 B) — 16 bytes per parameter — with ZeRO-1
sharding the 12 B over the data-parallel group (dp · cp: context-parallel ranks hold the same weights), ZeRO-2 the
gradients too (once a step's microbatches are accumulated) and ZeRO-3 the weights as well. Expert weights are
sharded over their own expert-data-parallel group (dp / ep · cp). A plan that trains in fp32 has no separate master
copy (16 B in all).

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4),
counted tensor by tensor from the stack's kernels (see `activation_bytes`): unfused attention keeps its s x s
scores, a fused one its output and log-sum-exp; dropout keeps its masks; grouped-query K/V, SwiGLU or GELU MLP, MoE
expert buffers. Tensor parallelism splits what is tensor-parallel; sequence parallelism also splits the norm and
residual tensors; full recompute keeps only each layer's input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plan import loader
from plan.cluster import Cluster
from plan.model_math import attention_params, latent_down_params, mlp_params
from plan.schema import Plan
from plan.stack import Stack
from twin.step.compute import ACT_BYTES, act_bytes
from twin.step.kernels import Shape, expert_split, tensor_sizes
from twin.step.schedules import rank_stages

GiB = 2**30
RESERVED_BYTES = 1.0 * GiB
"""CUDA context and NCCL buffers per process: PyTorch's CUDA context takes 300-500 MB (PyTorch docs, "CUDA
semantics: memory management"), NCCL's default 4 MiB buffer per channel and peer adds a few hundred MB at scale
(NCCL docs, NCCL_BUFFSIZE)."""

OPTIMIZER_BYTES = {"adamw": 12, "adam": 12, "sgd": 8}
"""fp32 master weights plus Adam's two moments (12 B), or SGD's momentum (8 B), per parameter."""


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank holds for one model stage, split by the group that reduces their gradients."""

    dense: float
    """Reduced over the whole dp · cp group: attention, dense MLPs, shared experts, router, embeddings."""
    expert: float
    """Routed-expert weights, reduced over the expert-data-parallel group (dp / ep · cp)."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """Memory of the fullest rank (GiB)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    transient: float
    """Short-lived peaks: logits, a recomputed layer, gathered ZeRO-3 weights."""
    reserved: float
    """CUDA context and communication buffers."""
    peak: float
    capacity: float
    fits: bool
    reason: str
    pipeline_rank: int
    """The rank these figures belong to (the one with the highest peak)."""


def layer_params(plan: Plan, layer: int) -> StageParams:
    """Parameters of one layer on one rank (sharded by tp, experts also by ep; an MoE MLP by tp only where the
    stack splits it, Stack.moe_tensor_parallel)."""
    m, lay = plan.model, plan.layout
    duplicated = latent_down_params(m)  # MLA's down-projections, whole on every tp rank
    dense = (attention_params(m) - duplicated + 2 * m.hidden) / lay.tp + duplicated
    if m.is_moe_layer(layer):
        assert m.moe_ffn_hidden is not None
        expert = mlp_params(m, m.moe_ffn_hidden)
        split = expert_tp(plan)
        dense += m.hidden * m.experts + m.shared_experts * expert / split
        return StageParams(dense, m.experts * expert / (split * lay.ep))
    return StageParams(dense + mlp_params(m, m.ffn_hidden) / lay.tp, 0.0)


def expert_tp(plan: Plan) -> int:
    """Ranks an MoE MLP is split over (kernels.expert_split under the plan's stack)."""
    return expert_split(plan.layout, loader.plan_stack(plan)) if plan.layout.tp > 1 else 1


def stage_layer_ranges(plan: Plan) -> tuple[range, ...]:
    """The model layers of each stage, in model order (computed once per plan)."""
    return plan.stage_layer_ranges


def stage_params(plan: Plan, stage: int) -> StageParams:
    """Parameters one rank holds for one model stage, embedding and head included where they live."""
    m, tp = plan.model, plan.layout.tp
    dense = expert = 0.0
    layers = stage_layer_ranges(plan)[stage]
    moe = [m.is_moe_layer(i) for i in layers]
    for kind in (False, True):  # every dense layer holds the same, as does every MoE layer
        if count := moe.count(kind):
            p = layer_params(plan, layers[moe.index(kind)])
            dense, expert = dense + count * p.dense, expert + count * p.expert
    last = plan.layout.num_stages - 1
    if stage == 0:
        dense += m.vocab * m.hidden / tp
    if stage == last:  # a tied head keeps its own copy only on a different stage (Megatron's shared embedding)
        dense += m.hidden + (m.vocab * m.hidden / tp if not (m.tied_embeddings and last == 0) else 0.0)
    if stage == last and m.mtp_layers:  # each module: a layer, its 2h → h projection and norms; and the embedding
        # its next tokens are looked up in, kept on this stage too unless it is the first (Megatron-Core's MTP)
        module = layer_params(plan, m.layers)
        dense += m.mtp_layers * (module.dense + 2 * m.hidden * m.hidden / tp + 3 * m.hidden)
        expert += m.mtp_layers * module.expert
        dense += m.vocab * m.hidden / tp if last != 0 else 0.0
    return StageParams(dense, expert)


def activation_bytes(plan: Plan, stack: Stack, moe: bool) -> tuple[float, float]:
    """Bytes one layer keeps for one microbatch until its backward, and the fraction of them that a split-off
    weight-gradient pass (W) still needs (the inputs of the weight GEMMs).

    Korthikanti et al. 2022 (§4) count a layer tensor by tensor (34·s·b·h + 5·a·s²·b bytes for a GPT layer with
    dropout and unfused attention). Read off the stack's kernels, that is: what every memory-bound kernel writes
    (norm outputs, residual sums and dropout masks, activation outputs, softmax and dropout over the scores), the
    Q, K, V a GEMM hands the attention core (less what RoPE rewrites), the first MLP GEMM's output the activation
    needs, and a fused attention's output and log-sum-exp. Selective recompute drops what the recomputed kernels
    wrote (the attention core's); full recompute keeps only the layer's input."""
    m, lay = plan.model, plan.layout
    split = expert_split(lay, stack)
    shape = Shape(
        lay.microbatch_size * m.seq_len // lay.cp, lay.tp, lay.sequence_parallel, seq_kv=m.seq_len, expert_tp=split
    )
    sizes = tensor_sizes(m, shape, moe)
    if lay.recompute == "full":
        return shape.tokens * sizes["h_sp"] * act_bytes(plan.training.dtype), 1.0
    selective = lay.recompute == "selective"
    kernels = [k for k in stack.layer if k.runs_in(m.is_mla, experts_local=1)]
    kept = sum(
        n * sizes[t]
        for k in kernels
        if not k.gemm and not k.attention and k.saves_output and not (selective and k.recomputed)
        for t, n in k.writes.items()
    )
    rope = any("qk" in k.writes for k in kernels)
    if m.is_mla and stack.mla_up_recompute:  # the gathered latents, not the heads the up-projections make of them
        kept += (m.q_lora_rank or 0) + (m.kv_lora_rank or 0) + m.rope_head_dim + sizes["ffn_in"]
    else:
        kept += sizes["qkv"] - (sizes["qk"] if rope else 0.0) + sizes["ffn_in"]
    if stack.flash:
        kept += sizes["ctx"] + (0.0 if selective else 2 * m.heads / lay.tp)  # output; fp32 log-sum-exp
    if not stack.sp_regather_input:  # the column-parallel GEMMs keep their gathered input
        kept += 2 * (sizes["h"] - sizes["h_sp"])
    if moe:  # the experts' dispatched inputs (as their GEMMs take them: gathered over tp where split) and the
        # router's probabilities
        kept += sizes["experts_in"] + 2 * m.experts
    weight_inputs = 2 * sizes["h_sp"] + sizes["ctx"] + sizes["ffn"]
    share = min(1.0, weight_inputs / kept) if kept else 0.0
    # fp8 training caches the inputs of its fp8 GEMMs in fp8 (DeepSeek-V3 report §3.3.3)
    per_element = ACT_BYTES * (1 - share / 2) if plan.training.dtype == "fp8" else act_bytes(plan.training.dtype)
    return kept * shape.tokens * per_element, share


def weight_bytes(plan: Plan, stack: Stack) -> int:
    """Bytes per working weight: 4 where the plan trains in fp32, 1 under fp8 where the stack keeps its weights in
    fp8 (Stack.fp8_params), else 2."""
    dtype = plan.training.dtype
    if dtype == "fp8" and stack.fp8_params:
        return 1
    return 4 if dtype == "fp32" else 2


def rank_state_bytes(
    plan: Plan, stages: Sequence[int], grad_bytes: int = 2, param_bytes: int = 2
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of one rank holding `stages`, sharded as its ZeRO stage says; gradients
    of `grad_bytes` each (2: bf16, 16 bytes per parameter in all with Adam; 4: Megatron's fp32 main_grad), weights
    of `param_bytes` each (weight_bytes)."""
    lay = plan.layout
    params = [stage_params(plan, s) for s in stages]
    dense, expert = sum(p.dense for p in params), sum(p.expert for p in params)

    def shard(stage_from: int) -> float:
        if lay.zero < stage_from:
            return dense + expert
        return dense / lay.weight_replicas + expert / lay.expert_replicas

    # a plan that trains in fp32 keeps no separate master copy: its fp32 weights are it (16 B with Adam in all)
    opt = OPTIMIZER_BYTES[plan.training.optimizer] - (4 if plan.training.dtype == "fp32" else 0)
    # ZeRO-2 gradients of a step that accumulates several microbatches build up whole and are reduce-scattered once,
    # as the step prices the reduction (comm_costs.dp_costs; FSDP's no_sync, Llama 3's fp32 accumulation, §3.3.2):
    # sharded only after it
    grads = shard(3) if lay.zero == 2 and plan.num_microbatches > 1 else shard(2)
    return param_bytes * shard(3), grad_bytes * grads, opt * shard(1)


def logits_bytes(stack: Stack) -> int:
    """Bytes per logit the stack's loss holds at once: 2 where every loss kernel works on the 16-bit logits
    themselves (a fused cross-entropy: one unit, plan.stack.TENSORS), else 4 (fp32, two units; also where the stack
    lists no loss kernel)."""
    units = [n for k in stack.head_kernels for n in (k.reads.get("logits", 0), k.writes.get("logits", 0)) if n]
    return 2 if units and max(units) < 2 else 4


def transient_bytes(plan: Plan, stack: Stack, stages: Sequence[int], last: bool) -> float:
    """The largest short-lived allocation on this rank."""
    m, lay = plan.model, plan.layout
    tokens = lay.microbatch_size * m.seq_len // lay.cp
    candidates = [0.0]
    if last:  # the logits and their gradient for one microbatch, as wide as the stack's loss keeps them
        candidates.append(2 * tokens * m.vocab / lay.tp * logits_bytes(stack))
    if 0 in stages:  # the embedding's dense gradient of the rank's vocabulary shard (kernels.embedding_cost)
        candidates.append(m.vocab / lay.tp * m.hidden * act_bytes(plan.training.dtype))
    if lay.recompute == "full":  # one layer rebuilt in full during its backward
        rebuilt = plan.model_copy(update={"layout": lay.model_copy(update={"recompute": "none"})})
        candidates.append(activation_bytes(rebuilt, stack, m.is_moe)[0])
    if lay.zero == 3:
        ranges = [stage_layer_ranges(plan)[s] for s in stages]
        # a stage's dense layers come first and its MoE layers last: its first and last layer are of both kinds
        kinds = [layer_params(plan, i) for r in ranges if len(r) for i in {r.start, r.stop - 1}]
        biggest = max((p.dense + p.expert for p in kinds), default=0.0)
        gathered = sum(p.dense + p.expert for p in (stage_params(plan, s) for s in stages))
        # pipelined FSDP keeps the stage gathered for the whole step (reshard_after_forward=False);
        # otherwise the current and the prefetched layer are gathered at once
        candidates.append(weight_bytes(plan, stack) * (gathered if lay.pp > 1 else 2 * biggest))
    return max(candidates)


def upcast_bytes(plan: Plan, stages: Sequence[int], grad_bytes: int) -> tuple[float, float]:
    """Under Stack.grad_accumulation_upcast (DeepSpeed's BF16_Optimizer): the 16-bit gradients of every parameter the
    rank holds, which stay allocated beside the buffer until the next backward clears them (pipe/engine.py calls
    clear_lp_grads at a backward's start and update_hp_grads with clear_lp_grads=False after it), and the largest
    tensor's temporary in the buffer's dtype that the upcast allocates (the vocabulary shard where the rank holds an
    embedding, else a layer's widest weight)."""
    m, lay = plan.model, plan.layout
    held = sum(p.dense + p.expert for p in (stage_params(plan, s) for s in stages))
    vocab = m.vocab / lay.tp * m.hidden if 0 in stages or lay.num_stages - 1 in stages else 0.0
    widest = max(m.hidden * m.ffn_hidden * (2 if m.glu else 1), 3 * m.hidden * m.hidden) / lay.tp
    return 2 * held, grad_bytes * max(vocab, widest)


def rank_breakdowns(
    plan: Plan, cluster: Cluster, stack: Stack, peak_live_layers: list[float], grad_bytes: int = 2
) -> list[MemoryBreakdown]:
    """Memory of every pipeline rank. `peak_live_layers[r]` is the schedule's peak of in-flight activations on
    rank r, in units of one layer's activations for one microbatch (a dense layer; MoE layers are weighed by the
    caller)."""
    lay = plan.layout
    dense_act, _ = activation_bytes(plan, stack, moe=False)
    capacity = cluster.accelerator.memory_bytes
    out = []
    for rank, stages in enumerate(rank_stages(lay.schedule, lay.pp, lay.num_stages)):
        weights, grads, optim = rank_state_bytes(plan, stages, grad_bytes, weight_bytes(plan, stack))
        acts = peak_live_layers[rank] * dense_act
        transient = transient_bytes(plan, stack, stages, last=lay.num_stages - 1 in stages)
        if stack.grad_accumulation_upcast:
            kept, largest = upcast_bytes(plan, stages, grad_bytes)
            grads, transient = grads + kept, max(transient, largest)
        peak = weights + grads + optim + acts + transient + RESERVED_BYTES
        fits = peak <= capacity
        reason = f"peak {peak / GiB:.1f} GiB of {capacity / GiB:.1f} GiB on pipeline rank {rank}" + (
            ""
            if fits
            else f": over by {(peak - capacity) / GiB:.1f} GiB; raise tp/pp, zero or "
            "recompute, or lower microbatch_size"
        )
        candidate = MemoryBreakdown(
            weights / GiB,
            grads / GiB,
            optim / GiB,
            acts / GiB,
            transient / GiB,
            RESERVED_BYTES / GiB,
            peak / GiB,
            capacity / GiB,
            fits,
            reason,
            rank,
        )
        out.append(candidate)
    return out
