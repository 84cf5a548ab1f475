"""The software stack: what a framework runs for each transformer layer, and what it overlaps.

A published run is reproduced by naming the stack that ran it (a file in plan/presets/stacks/), not by bending
hardware numbers: Megatron-LM in 2021 materialised the s×s attention scores, ran dropout on them and exposed every
tensor-parallel all-reduce; Megatron-Core with Transformer Engine in 2024 runs one fused attention kernel and
overlaps its tensor- and data-parallel communication. A stack never holds a hardware number (those are the
cluster's) nor a parallel degree (the layout's).

A layer's forward is a list of kernels. GEMMs and the attention core are named (`gemm`, `attention`) and priced by
the twin from the model's shapes; every other kernel is memory-bound and lists the tensors it reads and writes, in
units of one token's slice of a named tensor on one rank (the vocabulary is TENSORS), so its bytes follow from the
model and the layout. Its backward moves `backward` times its forward's bytes (a gradient in and the saved input
read, a gradient out written: 2 by default).
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from plan.section import UserSection

STACK_SCHEMA_VERSION: Final = 1

TENSORS: Final = {
    "h": "hidden state, whole on every tensor-parallel rank (hidden elements per token)",
    "h_sp": "hidden state in the norm/dropout/residual region: split over tp under sequence parallelism",
    "qkv": "Q, K and V projection outputs ((heads + 2·kv_heads)·head_dim / tp)",
    "qk": "Q and K only, what rotary embeddings rotate ((heads + kv_heads)·head_dim / tp)",
    "ctx": "attention output, the projection's input (heads·head_dim / tp)",
    "ffn_in": (
        "the first MLP GEMM's output, the activation's input (ffn_hidden / tp, twice that for a gated MLP; for an "
        "MoE layer an expert's width times the experts a token visits)"
    ),
    "ffn": "the activation's output, the last MLP GEMM's input (ffn_hidden / tp; per visited expert for MoE)",
    "scores": "attention scores or probabilities, materialised (heads / tp · key length per query token)",
    "logits": "the output head's logits (vocab / tp)",
    "routed": (
        "an MoE layer's routed copies of the hidden state (top_k · hidden at the busiest rank's load; over tp where "
        "each tp rank routes its own sequence shard)"
    ),
    "router": "an MoE layer's router logits or probabilities (experts; over tp as `routed`)",
    "query": "the attention core's query heads, keys the same size (heads·qk_head_dim / tp; MLA: 128 + 64 RoPE)",
    "kv_up": "multi-head latent attention's key-value up-projection output (heads·(head_dim + v_dim) / tp)",
    "q_pe": "the RoPE part of the query heads under latent attention (heads·rope_head_dim / tp)",
    "k_pe": "latent attention's one RoPE key head, shared by every head and whole on each rank (rope_head_dim)",
    "experts_in": (
        "an MoE layer's routed copies as its experts take them (top_k · hidden at the busiest rank's load: gathered "
        "over tp where the experts are split over tp, else over tp as `routed`)"
    ),
}
"""What a memory-bound kernel's reads and writes are counted in: one token's slice of each tensor on one rank, in
the activation dtype (2 bytes); a dropout mask is one byte per element, so it counts 0.5."""

GEMMS: Final = ("qkv", "proj", "fc1", "fc2")
"""The weight GEMMs of a layer the twin prices from the model's shapes (fc1 is gate and up for a gated MLP)."""

TpOverlap = Literal["none", "backward", "userbuffers"]
DpOverlap = Literal["none", "grad", "grad+param"]


class Kernel(UserSection):
    """One kernel of a layer's forward."""

    name: str
    """What it is, as the source names it (e.g. fused_layer_norm, bias_gelu)."""
    gemm: Literal["qkv", "proj", "fc1", "fc2"] | None = None
    """A weight GEMM (priced from the model's shapes on the accelerator's GEMM model)."""
    attention: Literal["flash", "scores", "context"] | None = None
    """The attention core: one fused flash-style kernel, or the unfused QKᵀ (`scores`) and probabilities·V
    (`context`) batched GEMMs."""
    reads: dict[str, NonNegativeFloat] = Field(default_factory=dict)
    """Tensors read, counted per token (see TENSORS)."""
    writes: dict[str, NonNegativeFloat] = Field(default_factory=dict)
    """Tensors written, counted per token."""
    traffic: dict[str, NonNegativeFloat] = Field(default_factory=dict)
    """All the bytes its forward moves, per token, where that is more than its reads and writes: a composite of
    eager ops also writes and reads back its intermediates (measured with a TorchDispatchMode). Empty: reads +
    writes. `reads` and `writes` still say what it takes in and what it leaves for the backward (memory)."""
    kernels: PositiveInt = 1
    """Kernels (ops) its forward dispatches: one for a fused kernel, several for an eager composite."""
    backward: NonNegativeFloat = 2.0
    """Backward bytes as a multiple of forward bytes (memory-bound kernels only)."""
    backward_kernels: NonNegativeInt = 1
    """Kernels its backward runs (memory-bound kernels only)."""
    recomputed: bool = True
    """Rerun by selective recompute (the attention core's kernels); full recompute reruns every kernel."""
    saves_output: bool = True
    """Its output is kept for the backward; false: the stack frees it and reruns the (cheap, memory-bound) kernel
    in the backward from its saved input, whatever the recompute policy."""
    several_local_experts: bool = False
    """It runs only where a rank holds more than one routed expert (sorting the received tokens by local expert, and
    back; an expert-by-expert MLP's concatenations): an MoE kernel."""
    attention_form: Literal["any", "standard", "latent"] = "any"
    """The layers it runs in: every layer (any); only where attention has whole Q, K, V heads (standard: a RoPE over
    them); only under multi-head latent attention (latent: the RoPE over the heads' positional parts and the splits
    and concatenations that join them to the rest, which Stack.mla_up_recompute reruns with the up-projections)."""
    fp8_output: bool = False
    """Under an fp8 plan it writes its output in fp8 for the GEMM after it, so that GEMM's input needs no cast of
    its own, only the transpose its weight gradient reads (Transformer Engine's LayerNormLinear, LayerNormMLP)."""

    def runs_in(self, latent: bool, experts_local: int) -> bool:
        """Whether it runs in a layer with (or without) latent attention on a rank holding `experts_local`."""
        if self.several_local_experts and experts_local <= 1:
            return False
        return self.attention_form == "any" or (self.attention_form == "latent") == latent

    @model_validator(mode="after")
    def _one_kind(self) -> Kernel:
        kinds = sum(x is not None for x in (self.gemm, self.attention)) + bool(self.reads or self.writes)
        if kinds != 1:
            raise ValueError(f"{self.name}: give exactly one of gemm, attention, or reads/writes")
        unknown = sorted((set(self.reads) | set(self.writes) | set(self.traffic)) - set(TENSORS))
        if unknown:
            raise ValueError(f"{self.name}: unknown tensor(s) {unknown}; use {', '.join(TENSORS)}")
        return self


class Stack(UserSection):
    """A training framework as it ran: its kernels per layer, what it overlaps, its numerics."""

    schema_version: Literal[1] = STACK_SCHEMA_VERSION
    """Version of this file format."""
    name: str
    """Short name; matches the file name in plan/presets/stacks/."""
    description: str
    """Which framework, version and settings this is."""
    source: str = Field(min_length=8)
    """Where the kernel list and settings come from (repository and commit, paper and section)."""
    layer: tuple[Kernel, ...]
    """A transformer layer's forward, kernel by kernel."""
    attention_kernel: str = "none"
    """The fused attention kernel family a `flash` step runs (fa2, fa3, cudnn): the cluster gives its speed."""
    head_kernels: tuple[Kernel, ...] = ()
    """The output head's memory-bound kernels beside its GEMM (the loss over the logits)."""
    moe_kernels: tuple[Kernel, ...] = ()
    """The memory-bound kernels an MoE layer runs beside the layer's: the router's softmax and top-k, the
    permutation of the routed copies before the dispatch and its inverse after the combine."""
    ep_dispatch: Literal["all-to-all", "node-forwarding"] = "all-to-all"
    """How an MoE layer's tokens reach their experts across nodes: all-to-all, every routed copy sent to its expert's
    rank (NCCL's all-to-all: Megatron-Core's alltoall dispatcher); node-forwarding, a token sent once to each
    remote node that holds any of its experts and fanned out over NVLink there (DeepEP's normal kernels, whose
    internode dispatch carries each token once per RDMA rank with a bit per NVLink peer: csrc/kernels/
    internode.cu SourceMeta; Megatron-Core's HybridEP; DeepSeek-V3 §3.2.2)."""
    ep_dispatch_sms: PositiveInt | None = None
    """SMs a node-forwarding dispatcher's kernels run on (Megatron-Core's moe_flex_dispatcher_num_sms, formerly
    moe_deepep_num_sms / moe_hybridep_num_sms): its NVLink stage moves tokens at the accelerator's measured rate
    (ComputeEfficiency.ep_dispatch) scaled by these over the SMs it was measured on, up to NCCL's NVLink bandwidth,
    and while it runs under overlapped compute it holds them. Unset: the measurement's own. On an accelerator
    without measured dispatcher rates it is not read: the forwarding moves at NCCL's bandwidths and holds no SMs."""
    grouped_gemm_streams: NonNegativeInt = 0
    """How a rank's local experts run their GEMMs: 0, one batched kernel for all of them (a grouped GEMM); n, one
    cuBLAS call per expert, issued round-robin on n streams (Transformer Engine's GroupedLinear, whose
    multi_stream_cublas_gemm takes 4 compute streams: v1.13 common/include/transformer_engine/gemm.h num_streams,
    v2.9 common/util/multi_stream.cpp num_compute_streams; Megatron-Core's SequentialMLP, an expert at a time on
    one stream: 1). Each call is a launch, and each wave of concurrent calls pays a GEMM's fixed cost."""
    tp_overlap: TpOverlap = "none"
    """Tensor-parallel communication: none (every collective exposed), backward (the backward's all-gather and
    reduce-scatter overlap its GEMMs, Megatron 2022), userbuffers (Transformer Engine overlaps forward and
    backward collectives with their GEMMs in chunks)."""
    sp_regather_input: bool = True
    """Under sequence parallelism the column-parallel GEMMs keep their input sharded and all-gather it again for
    the weight gradient (Megatron, Transformer Engine); false: the gathered input is kept (DTensor)."""
    moe_tensor_parallel: bool = True
    """An MoE layer's experts (routed and shared) are split over the tp ranks as a dense MLP is, with the same
    collectives around them (Megatron-Core's expert tensor parallelism, equal to tp by default); false: every tp rank
    runs the MoE MLP whole on the whole sequence, holding whole experts and needing no collective around it (the
    executor's layers)."""
    mla_up_recompute: bool = False
    """Under multi-head latent attention the query, key and value up-projections rerun in the backward from the kept
    latents, so their wide outputs are not kept (DeepSeek-V3 §3.3.3, "we recompute all RMSNorm operations and MLA
    up-projections during back-propagation"; Megatron-Core's recompute_modules "mla_up_proj")."""
    ep_overlap: bool = False
    """Megatron-Core's expert-parallel all-to-all overlap (overlap_moe_expert_parallel_comm, Megatron-Bridge's
    moe_a2a_overlap; core 0.14 on): the combined 1F1B co-schedules one microbatch's forward with another's backward
    layer by layer, each one's dispatch and combine hidden behind the other's attention and MLP compute
    (megatron/core/pipeline_parallel/combined_1f1b.py). It pairs interleaved 1F1B's steady phase, or every forward
    with the previous backward without pipelining; warm-up and cool-down run alone. False: every all-to-all is
    exposed (DualPipe's own pairs aside)."""
    ep_overlap_hidden: float = Field(default=1.0, gt=0.0, le=1.0)
    """Under `ep_overlap`, the share of the all-to-all time the combined 1F1B could hide behind the paired
    microbatch's compute (all of it where that compute is longer) that it does hide, as a profile of the stack
    measured it; the rest stays exposed, and the hidden part still costs the compute the SMs its dispatcher holds.
    1: all of it (the ideal; DualPipe's pairs are always priced so)."""
    fp8_dispatch: bool = False
    """An fp8 plan's expert-parallel dispatch all-to-all moves fp8 tokens (DeepSeek-V3 §3.3.2 quantizes them before
    dispatch; the combine stays BF16); false: dispatch and combine move 16-bit tokens (Megatron-Core 0.10's
    all-to-all dispatcher permutes the layer's bf16 hidden states; Transformer Engine casts to fp8 in the GEMM)."""
    fp8_scaling: Literal["tensor", "current", "block"] = "tensor"
    """How an fp8 plan scales its GEMM operands: one factor per tensor from the amax history ("tensor": Transformer
    Engine 1.x's delayed scaling on cuBLAS), one factor per tensor from the tensor itself ("current": Transformer
    Engine 2.x's Float8CurrentScaling, NeMo's default from 25.04: an amax pass before every cast, and under sequence
    parallelism a tensor-parallel all-reduce of it, priced by twin/step/kernels.py and costs.py), or per 1x128 /
    128x128 block (DeepSeek-V3 §3.3.2, DeepGEMM), which the cluster prices apart."""
    fp8_amax_reduction: bool = False
    """Under an fp8 plan the stack all-reduces (max) its fp8 tensors' amax history over the replica's tensor-,
    context- and data-parallel ranks at the end of each model chunk's forward and backward, on the compute stream:
    Transformer Engine 1.x delayed scaling (FP8GlobalStateManager.reduce_and_update_fp8_tensors over the
    fp8_group Megatron-Core core_v0.10.0 transformer_block.py passes: the amax reduction group)."""
    fp8_params: bool = False
    """An fp8 plan keeps its working weights in fp8 (Transformer Engine's fp8_model_init, NeMo's `fp8_params`): one
    byte per weight on every rank, and the distributed optimizer's parameter all-gather moves fp8; the fp32 master
    copy stays in the optimizer state."""
    fp8_activations: bool = False
    """An fp8 plan keeps its activations in fp8 between the GEMMs too, so pipeline sends, context-parallel K and V
    and the tensor-parallel reduce-scatters move fp8 (DeepSeek-V3 §3.3.3 caches and sends activations in FP8);
    false: only what Transformer Engine casts for a GEMM moves fp8 (the tensor-parallel all-gathers of a GEMM's
    input and output gradient), everything else the layer's bf16 (Transformer Engine 1.x; NVIDIA/TransformerEngine
    v1.13 pytorch/module/linear.py gathers the cast input, reduces the bf16 output)."""
    fp8_reduce_scatter: bool = False
    """An fp8 plan's forward reduce-scatters of the row-parallel outputs (proj, fc2) move fp8: userbuffers'
    `fp8_buf` (NeMo's ub_tp_comm_overlap_cfg.{proj,fc2}_fprop.fp8_buf, a per-recipe setting)."""
    tp_overlap_chunks: PositiveFloat = 1.0
    """With userbuffers: chunks each overlapped collective is cut into; the first (or last) chunk stays exposed."""
    tp_overlap_sms: NonNegativeFloat = 0.0
    """With userbuffers: SMs the SM-driven overlapped collectives take from the GEMMs they run beside, while they
    run (count; a recipe's mean over its collectives). Transformer Engine drives the forward reduce-scatters
    (`pipeline`) and the backward's re-gather of the input and reduce-scatter of the input gradient (`bulk`) with
    `num_sm` SMs each (16 unless a recipe says otherwise) and its all-gathers under GEMMs (`ring_exchange`) with the
    copy engines, which take none (TransformerEngine v1.7 pytorch/csrc/comm_gemm_overlap.h use_ce 0 and 1; v1.13
    common/comm_gemm_overlap/comm_gemm_overlap.cpp use_ce false, pytorch/module/base.py initialize_ub defaults)."""
    tp_overlap_sm_margin: dict[str, NonNegativeInt] = Field(default_factory=dict)
    """With userbuffers: SMs withheld for the whole of a row-parallel GEMM's forward (proj, fc2) for its pipelined
    reduce-scatter (Transformer Engine's `set_sm_margin`, a recipe setting; the margin is that overlap's own
    `num_sm`): the GEMM runs on the rest and its collective takes none of them while it runs."""
    dp_overlap: DpOverlap = "grad"
    """Data-parallel communication: none (one reduction after the pipeline flush), grad (gradient buckets under the
    last backward), grad+param (also the parameter all-gather under the next forward)."""
    fsdp_backward_prefetch: Literal["pre", "post"] = "pre"
    """ZeRO-3 without pipelining (FSDP): when a layer's backward all-gather is issued. pre: before the layer after it
    computes its gradients, so it hides behind them (torch FSDP's BACKWARD_PRE, FSDP2's prefetch); post: only once
    they are done, so the backward waits for every layer's gather (FSDP's BACKWARD_POST, Composer 0.16's
    default)."""
    dp_overlap_pipelined: DpOverlap | None = None
    """The same when pp > 1, where it differs (Megatron 2021: torch DDP without pipelining, its own after)."""
    pp_overlap: bool = False
    """Pipeline sends and receives run asynchronously under compute (interleaved schedules)."""
    pp_scatter_gather: bool = False
    """Each tp rank sends 1/tp of a stage boundary's activation, all-gathered on the receiving node (Narayanan et
    al. 2021, §4.1)."""
    grad_reduce_dtype: Literal["fp16", "bf16", "fp32"] | None = None
    """The gradient reduction's dtype when the plan does not set one; unset: the compute dtype."""
    dispatch_us: NonNegativeFloat = 0.0
    """Host time to issue one kernel (microseconds): an action takes at least its kernels times this, whatever
    the device does (eager PyTorch; 0 where CUDA graphs replay)."""
    wgrad_accumulation_fusion: bool = True
    """Each weight-gradient GEMM adds its product into the buffer gradients accumulate in (Megatron-Core's
    gradient_accumulation_fusion: Transformer Engine's fuse_wgrad_accumulation, or APEX's fused_weight_gradient_mlp_
    cuda); false: the GEMM writes a fresh 16-bit gradient and the data-parallel wrapper adds it to the buffer each
    microbatch (megatron/core/distributed param hooks `main_grad.add_(grad)`): read 2 bytes and the buffer's, write
    the buffer's, per weight."""
    grad_accumulation_upcast: bool = False
    """Without wgrad accumulation fusion, the fresh 16-bit gradient is first upcast into a temporary of the buffer's
    dtype, which the add then reads: one more kernel and the buffer's bytes written and read again, per weight
    (DeepSpeed's BF16_Optimizer.update_hp_grads, `hp_grad.add_(lp.grad.to(hp_grad.dtype))`, after every
    microbatch's backward: deepspeed/runtime/bf16_optimizer.py at microsoft/DeepSpeed 9b70ce56e). The 16-bit
    gradients it adds stay allocated until the next backward begins (the pipeline engine's clear_lp_grads), so
    memory holds them beside the buffer, and the largest tensor's temporary as a transient."""
    grad_wire_dtype: Literal["fp16", "bf16", "fp32"] | None = None
    """The dtype the data-parallel gradient reduction moves where it is not the buffer's (grad_reduce_dtype):
    DeepSpeed's engine casts each flattened bucket of its fp32 buffer to its communication_data_type, bf16 under bf16
    at ZeRO stage 0, before the all-reduce and back after (runtime/engine.py communication_data_type,
    allreduce_bucket). Unset: the buffer's dtype."""
    zero_grad_reduce: Literal["reduce-scatter", "all-reduce"] = "reduce-scatter"
    """How a ZeRO-1 plan reduces its gradients over the data-parallel ranks before each updates its shard:
    reduce-scatter (Megatron's distributed optimizer, DeepSpeed's ZeRO stage 1), or all-reduce of the whole buffer
    (DeepSpeed's BF16_Optimizer under the pipeline engine, its own stage-1 equivalent: PipelineEngine._bf16_reduce_grads
    all-reduces the fp32 gradients, then each rank steps its partition and all-gathers the bf16 weights)."""
    grad_buffer_passes: NonNegativeFloat = 0.0
    """Memory-bound passes each step over the rank's whole gradient buffer (every parameter it holds, unsharded, in
    the buffer's dtype) beside the optimizer's: Megatron-Core's data-parallel wrapper zeroes it at the start of the
    step (zero_grad_buffer: grad_data.zero_()), takes each bucket's norm to check for NaN before its reduction
    (check_for_nan_in_grad) and scales each bucket by 1/dp before it (gradient_scaling_factor, unless
    average_in_collective): a write, a read, a read and a write (core_v0.8.0 distributed/param_and_grad_buffer.py)."""
    fused_optimizer: bool = True
    """The optimizer updates every tensor in a few multi-tensor kernels (apex/TE fused Adam, distributed
    optimizer) rather than several kernels per tensor."""
    fp32_traffic: PositiveFloat = 2.0
    """Multiple of the memory-bound kernels' bytes when the plan trains in fp32 rather than 16 bits: 2 where they
    work in the activation dtype; nearer 1 where they upcast to fp32 under bf16 already (the executor)."""

    @field_validator("layer")
    @classmethod
    def _has_core(cls, layer: tuple[Kernel, ...]) -> tuple[Kernel, ...]:
        gemms = {k.gemm for k in layer if k.gemm}
        if gemms != set(GEMMS):
            raise ValueError(f"a layer needs each weight GEMM once ({', '.join(GEMMS)}), got {sorted(gemms)}")
        cores = {k.attention for k in layer if k.attention}
        if cores not in ({"flash"}, {"scores", "context"}):
            raise ValueError("a layer's attention is one `flash` kernel or the `scores` and `context` GEMMs")
        return layer

    @field_validator("tp_overlap_sm_margin")
    @classmethod
    def _margins_of_row_parallel_gemms(cls, margins: dict[str, int]) -> dict[str, int]:
        if bad := sorted(set(margins) - {"proj", "fc2"}):
            raise ValueError(f"an SM margin is set for the pipelined reduce-scatters of proj and fc2, not {bad}")
        return margins

    @model_validator(mode="after")
    def _upcast_needs_an_add(self) -> Stack:
        if self.grad_accumulation_upcast and self.wgrad_accumulation_fusion:
            raise ValueError(
                "grad_accumulation_upcast prices the add that follows each weight-gradient GEMM, which "
                "wgrad_accumulation_fusion says does not happen; set wgrad_accumulation_fusion false, or drop the "
                "upcast"
            )
        return self

    @property
    def flash(self) -> bool:
        return any(k.attention == "flash" for k in self.layer)

    def dp_overlap_for(self, pp: int) -> DpOverlap:
        """The data-parallel overlap of a layout with `pp` pipeline stages."""
        return self.dp_overlap_pipelined if pp > 1 and self.dp_overlap_pipelined else self.dp_overlap
