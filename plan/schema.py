"""The plan: model, layout, training and reliability — the one language the twin and the executor share.

Every section is an immutable pydantic model whose unknown keys are errors. Each field's docstring is its
one-line doc (with its unit) and becomes its description in `twin schema`. Checks that need one section live on
that section; checks that tie sections together live on `Plan`. A plan never holds a hardware number: those
come from the cluster file it names (`plan.cluster`, see `plan/cluster.py`).

How expert parallelism folds into data parallelism (as Megatron-Core does): the world size is
dp · tp · pp · cp; `ep` does not multiply it. The `dp` replicas of the dense weights are split into
`dp / ep` expert-data-parallel groups of `ep` ranks each, and the experts of each MoE layer are spread over
the `ep` ranks of a group. So `ep` must divide `dp`; the dense weights are reduced over `dp` ranks and the expert
weights over `dp / ep` ranks — times `cp` for both, since context-parallel ranks hold the same weights
(`Layout.weight_replicas`, `Layout.expert_replicas`).

Where `layout.expert_tp` is set, the experts get a grid of their own over the same ranks instead (Megatron-Core's
MoE parallel folding, `expert_tensor_parallel_size`, from core 0.10): a pipeline stage's tp · cp · dp ranks, in
rank order, split into expert-tensor-parallel groups of `expert_tp` (innermost), then `ep`, then the replicas of
each expert shard. So `ep` may span tensor- and context-parallel ranks: DeepSeek-V3 on 1,024 H100 ran TP2 EP64
over 32 dp replicas with expert_tp 1 (NVIDIA/dgxc-benchmarking v25.05 deepseek_v3).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Final, Literal

from pydantic import (
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from plan.model_spec import ModelSpec
from plan.refs import ClusterRef, StackRef
from plan.reliability import Reliability
from plan.section import UserSection

SCHEMA_VERSION: Final = 1

Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipe-v"]
Recompute = Literal["none", "selective", "full"]
Dtype = Literal["fp32", "bf16", "fp16", "fp8"]

# Schedules whose stages each hold several model chunks, and how many chunks they need.
# Interleaved 1F1B: any v >= 2 (Narayanan et al. 2021, §2.2.2). ZBV and DualPipe-V place exactly two chunks per
# rank in a "V" (Qi et al. 2024, zero-bubble pipeline parallelism §4; DeepSeek-V3 report §3.2.1).
VIRTUAL_STAGE_RULES: dict[str, str] = {
    "gpipe": "1",
    "1f1b": "1",
    "zb-h1": "1",
    "interleaved-1f1b": ">=2",
    "zbv": "2",
    "dualpipe-v": "2",
}

# The rank-grid axes that `layout.rank_order` permutes (innermost first). Expert parallelism subdivides `dp`.
RANK_AXES = ("tp", "cp", "dp", "pp")


class Layout(UserSection):
    """How the model is laid out over ranks, and the pipeline schedule it runs."""

    dp: PositiveInt = 1
    """Data-parallel degree (replicas)."""
    tp: PositiveInt = 1
    """Tensor-parallel degree (ranks per layer shard group)."""
    pp: PositiveInt = 1
    """Pipeline-parallel degree (stages)."""
    cp: PositiveInt = 1
    """Context-parallel degree (ranks splitting one sequence)."""
    ep: PositiveInt = 1
    """Expert-parallel degree (ranks sharing one MoE layer's experts); folds into dp, must divide it (or, with
    `expert_tp` set, tp · cp · dp / expert_tp)."""
    expert_tp: PositiveInt | None = None
    """Ranks each routed expert is split over, with the experts on a grid of their own (Megatron-Core's
    expert_tensor_parallel_size): 1 (whole experts, each tp rank dispatching its sequence-parallel shard) or tp.
    Unset: the stack's split (Stack.moe_tensor_parallel) with `ep` inside dp."""
    zero: Literal[0, 1, 2, 3] = 0
    """ZeRO stage over the dp · cp ranks that hold the same weights: 0 none, 1 optimizer state, 2 + gradients, 3 +
    parameters (FSDP)."""
    microbatch_size: PositiveInt = 1
    """Sequences per microbatch on one dp rank (sequences)."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule."""
    virtual_stages: PositiveInt = 1
    """Model chunks per pipeline rank (count): 1 for gpipe/1f1b/zb-h1, >=2 for interleaved, 2 for zbv/dualpipe-v."""
    schedule_runs: PositiveInt = 1
    """Times one optimizer step runs the pipeline schedule, each run over num_microbatches / schedule_runs
    microbatches with its own fill and drain and its own gradient reduction (count): gradient accumulation outside
    the schedule, as PyTorch-native trainers accumulate (torch.distributed.pipelining's schedule.step once per local
    batch, reducing at its last backward: NeMo AutoModel's local batches, torchtitan's accumulation steps). 1: every
    microbatch in one schedule and one reduction (Megatron). Without pipelining a run is that share of the
    accumulation loop, the gradients reduced at its end (a trainer that does not skip the reduction of its
    non-final microbatches: schedule_runs = num_microbatches). Twin-only: the executor runs one schedule a step."""
    stage_layers: tuple[NonNegativeInt, ...] | None = None
    """Layers of each of the pp·virtual_stages stages, in model order; default splits as `stage_layer_counts`. A
    stage may hold none (Llama 3 §3.3.2: the first chunk only the embedding, the last only the output head)."""
    edge_stage_trim: NonNegativeInt = 0
    """Layers taken from the first and from the last stage to make room for the embedding and the output head
    (layers): the split gives layers + 2·trim evenly over the stages and the two edge stages hand `trim` back.
    Llama 3 §3.3.2 uses 1 ("we reduce one Transformer layer each from the first and the last stages"); unlike
    `stage_layers` it follows a change of pp or virtual_stages. Ignored where `stage_layers` is given."""
    recompute: Recompute = "none"
    """Activation recompute: none, selective (attention core, Korthikanti et al. 2022) or full (whole layer)."""
    sequence_parallel: bool = False
    """Shard layer-norm and dropout activations along the sequence over the tp group (Megatron SP)."""
    fused_projections: bool = True
    """Q/K/V, and the MLP's gate and up projections, run as one GEMM each (Megatron). False: one GEMM per
    projection, as the executor's DTensor layers run them — under tp each then needs its own input-gradient
    all-reduce in the backward (5 per layer instead of 2)."""
    cp_algorithm: Literal["ring", "all-gather"] = "ring"
    """How context-parallel attention gets the other ranks' keys and values: ring (Megatron-Core's p2p ring,
    overlapped with the attention blocks) or all-gather (Llama 3 §3.3.2, and the executor; exposed)."""
    rank_order: str = "tp-cp-dp-pp"
    """Axes of the rank grid from innermost (fastest-varying rank) to outermost; ep subdivides dp."""

    @model_validator(mode="after")
    def _check(self) -> Layout:
        etp = self.expert_tp
        if etp is not None and etp not in (1, self.tp):
            raise ValueError(f"expert_tp: {etp} must be 1 (whole experts) or tp={self.tp} (experts split as the MLP)")
        if etp is not None and (self.tp * self.cp * self.dp) % (etp * self.ep):
            raise ValueError(
                f"ep: {self.ep} · expert_tp {etp} does not divide tp·cp·dp={self.tp * self.cp * self.dp}, the ranks "
                "of a pipeline stage the experts fold over; choose ep dividing them"
            )
        if etp is None and self.dp % self.ep:
            raise ValueError(
                f"ep: {self.ep} does not divide dp={self.dp}; expert parallelism folds into dp (set expert_tp to "
                "fold it over tp·cp·dp as Megatron-Core's expert_tensor_parallel_size does)"
            )
        rule = VIRTUAL_STAGE_RULES[self.schedule]
        v = self.virtual_stages
        if (rule == "1" and v != 1) or (rule == "2" and v != 2) or (rule == ">=2" and v < 2):
            raise ValueError(
                f"virtual_stages: {v} is not valid for schedule {self.schedule!r}, which needs virtual_stages {rule}"
            )
        if self.pp == 1 and self.schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"schedule: {self.schedule!r} needs pp > 1; use 1f1b (or gpipe) with pp=1")
        axes = tuple(self.rank_order.split("-"))
        if sorted(axes) != sorted(RANK_AXES):
            raise ValueError(
                f"rank_order: {self.rank_order!r} must order each of {', '.join(RANK_AXES)} once, e.g. 'tp-cp-dp-pp'"
            )
        if self.stage_layers is not None and len(self.stage_layers) != self.num_stages:
            raise ValueError(
                f"stage_layers: {len(self.stage_layers)} entries, but pp·virtual_stages = {self.num_stages} stages"
            )
        return self

    @property
    def world_size(self) -> int:
        """Ranks in the job: dp · tp · pp · cp (ep folds into dp)."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def num_stages(self) -> int:
        """Pipeline stages counting virtual chunks: pp · virtual_stages."""
        return self.pp * self.virtual_stages

    @property
    def weight_replicas(self) -> int:
        """Ranks that hold the same dense weights: dp · cp. Context-parallel ranks see different tokens of the same
        sequences with the same weights, so their gradients are reduced, and ZeRO shards, over dp and cp together
        (Megatron-Core's data-parallel group `with_context_parallel=True`; the executor's dp·cp replica mesh)."""
        return self.dp * self.cp

    @property
    def expert_replicas(self) -> int:
        """Ranks that hold the same routed experts: (dp / ep) · cp, or tp · cp · dp / (expert_tp · ep) folded."""
        if self.expert_tp is not None:
            return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)
        return self.dp // self.ep * self.cp

    @property
    def axes(self) -> tuple[str, ...]:
        """The rank grid's axes, innermost first."""
        return tuple(self.rank_order.split("-"))


class Training(UserSection):
    """The optimisation: batch, length of the run, numerics and optimizer."""

    global_batch: PositiveInt
    """Sequences per optimizer step, over all replicas (sequences)."""
    tokens: float = Field(ge=1)
    """Tokens to train in the whole run (tokens; at least 1)."""
    dtype: Dtype = "bf16"
    """Compute dtype of matmuls and collectives: bf16, fp8 with bf16 master weights, or fp32 (no mixed precision:
    what the executor runs on CPUs)."""
    grad_reduce_dtype: Literal["fp16", "bf16", "fp32"] | None = None
    """Dtype of the data-parallel gradient reduction; unset: the stack's, else the compute dtype's (bf16 for fp8).
    Megatron-Core with bf16 and Llama 3 reduce in fp32 (Dubey et al. 2024 §3.3.2)."""
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"
    """Optimizer; adam/adamw keep fp32 master weights and two fp32 moments (16 bytes/param with bf16 grads)."""
    lr: PositiveFloat = 3e-4
    """Peak learning rate."""
    warmup_steps: NonNegativeInt = 0
    """Linear warm-up steps before the cosine decay (steps)."""
    weight_decay: float = Field(default=0.1, ge=0)
    """Decoupled weight decay (AdamW)."""
    grad_clip: float = Field(default=1.0, ge=0)
    """Global gradient-norm clip; 0 disables it."""
    seed: NonNegativeInt = 1234
    """Seed of weight init and data order; the same seed gives the same weights under any layout."""

    @property
    def reduce_dtype(self) -> str:
        """The data-parallel gradient reduction's dtype, defaults applied."""
        return self.grad_reduce_dtype or ("fp32" if self.dtype == "fp32" else "bf16")


class Plan(UserSection):
    """A whole plan: what model, on which cluster, laid out how, trained how long, recovered how."""

    schema_version: Literal[1] = SCHEMA_VERSION
    """Version of this file format."""
    name: str = "plan"
    """Short name of the plan."""
    description: str = ""
    """Why this plan exists and where its numbers come from."""
    model: ModelSpec
    """The architecture (a model preset name may stand for the whole section)."""
    cluster: ClusterRef
    """The cluster: a name in topologies/ (without .yaml), a path to a cluster file, or a mapping of `name` and
    what-if `overrides`."""
    stack: StackRef = StackRef()
    """The software stack: a name in plan/presets/stacks/, a path, or a mapping of `name` and `overrides`."""
    layout: Layout
    """Parallel layout and pipeline schedule (required: without it a plan would silently run on one GPU)."""
    training: Training
    """Batch, tokens, dtype and optimizer."""
    reliability: Reliability = Reliability()
    """Checkpoint and recovery policy (optional: every field has a default, e.g. async checkpoints at the
    Young/Daly interval, no spares)."""

    @field_validator("cluster", "stack", mode="before")
    @classmethod
    def _ref_by_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> Plan:
        m, lay, tr = self.model, self.layout, self.training
        if m.heads % lay.tp:
            raise ValueError(f"layout.tp: {lay.tp} does not divide model.heads={m.heads}; choose a divisor")
        if m.n_kv_heads % lay.tp and lay.tp % m.n_kv_heads:
            raise ValueError(
                f"layout.tp: {lay.tp} and model.kv_heads={m.n_kv_heads} must divide one another "
                "(kv heads are split, or replicated, over the tp group)"
            )
        for name, width in (("ffn_hidden", m.ffn_hidden), ("moe_ffn_hidden", m.moe_ffn_hidden or lay.tp)):
            if width % lay.tp:
                raise ValueError(f"layout.tp: {lay.tp} does not divide model.{name}={width}; choose a divisor")
        if m.vocab % lay.tp:
            raise ValueError(f"layout.tp: {lay.tp} does not divide model.vocab={m.vocab}; pad the vocab or change tp")
        if lay.ep > 1 and not m.is_moe:
            raise ValueError(f"layout.ep: {lay.ep} > 1 but the model is dense (experts=0); set ep: 1")
        if m.is_moe and m.experts % lay.ep:
            raise ValueError(f"layout.ep: {lay.ep} does not divide model.experts={m.experts}; choose a divisor")
        if m.seq_len % (2 * lay.cp) and lay.cp > 1:
            raise ValueError(
                f"layout.cp: model.seq_len={m.seq_len} must split into 2·cp={2 * lay.cp} equal chunks "
                "(load-balanced context parallelism); change cp or seq_len"
            )
        for fault in self.reliability.faults:
            if fault.rank >= lay.world_size:
                raise ValueError(
                    f"reliability.faults: {fault.label()} names rank {fault.rank}, but the layout has "
                    f"{lay.world_size} ranks (0-{lay.world_size - 1}); pick one of those"
                )
        if lay.stage_layers is not None and sum(lay.stage_layers) != m.layers:
            raise ValueError(f"layout.stage_layers: sums to {sum(lay.stage_layers)}, but model.layers={m.layers}")
        if lay.stage_layers is None and m.layers + 2 * lay.edge_stage_trim < lay.num_stages:
            raise ValueError(
                f"layout.pp: model.layers={m.layers} cannot fill pp·virtual_stages={lay.num_stages} stages; "
                "lower pp or virtual_stages"
            )
        if lay.stage_layers is None and lay.edge_stage_trim and lay.num_stages > 1:
            edges = split_layers(m.layers + 2 * lay.edge_stage_trim, lay.num_stages)
            if min(edges[0], edges[-1]) < lay.edge_stage_trim:
                raise ValueError(
                    f"layout.edge_stage_trim: {lay.edge_stage_trim} is more than the "
                    f"{min(edges[0], edges[-1])} layers an edge stage gets from {m.layers} layers over "
                    f"{lay.num_stages} stages; lower it"
                )
        per_step = lay.dp * lay.microbatch_size
        if tr.global_batch % per_step:
            raise ValueError(
                f"training.global_batch: {tr.global_batch} is not a multiple of dp·microbatch_size={per_step}; "
                f"use e.g. {max(1, round(tr.global_batch / per_step)) * per_step}"
            )
        if self.num_microbatches % lay.schedule_runs:
            raise ValueError(
                f"layout.schedule_runs: {lay.schedule_runs} does not divide the {self.num_microbatches} microbatches "
                "per replica; use a divisor of them, or change global_batch or microbatch_size"
            )
        per_run = self.schedule_microbatches
        if lay.schedule == "interleaved-1f1b" and per_run % lay.pp:
            raise ValueError(
                f"training.global_batch: interleaved-1f1b needs microbatches per schedule run ({per_run}) to be a "
                f"multiple of pp={lay.pp} (Narayanan et al. 2021); change global_batch, microbatch_size or "
                "schedule_runs"
            )
        rounds = max(1, per_run // lay.pp)
        if lay.schedule == "zb-h1" and per_run % rounds:
            raise ValueError(
                f"training.global_batch: zb-h1 runs as torch's ScheduleInterleavedZeroBubble, which needs the "
                f"{per_run} microbatches per schedule run to split into {rounds} equal rounds; use a multiple of "
                f"pp={lay.pp}"
            )
        if lay.schedule in ("zbv", "dualpipe-v") and per_run < 2 * lay.pp:
            raise ValueError(
                f"training.global_batch: {lay.schedule} needs at least 2·pp={2 * lay.pp} microbatches per schedule "
                f"run, has {per_run}; raise global_batch, lower microbatch_size or schedule_runs"
            )
        return self

    @property
    def num_microbatches(self) -> int:
        """Microbatches each replica runs per step: global_batch / (dp · microbatch_size)."""
        return self.training.global_batch // (self.layout.dp * self.layout.microbatch_size)

    @property
    def schedule_microbatches(self) -> int:
        """Microbatches each run of the pipeline schedule takes: num_microbatches / layout.schedule_runs."""
        return self.num_microbatches // self.layout.schedule_runs

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step (tokens)."""
        return self.training.global_batch * self.model.seq_len

    @property
    def total_steps(self) -> int:
        """Optimizer steps to train `training.tokens` (steps, rounded up)."""
        return -(-int(self.training.tokens) // self.tokens_per_step)

    @cached_property
    def stage_layer_counts(self) -> tuple[int, ...]:
        """Layers per stage (pp·virtual_stages of them, in model order).

        Explicit `layout.stage_layers` wins. Otherwise every stage gets ceil(L'/S) layers of L' = L + 2·trim
        (`layout.edge_stage_trim`) and the deficit S·ceil(L'/S) − L' is taken one layer at a time from the
        outermost stages inwards, alternating first and last — they also carry the embedding and the output head;
        then the first and the last stage each hand `trim` layers back. For Llama 3 405B's 126 layers on 16 stages
        this gives 7 layers on the first and last stage and 8 elsewhere, and with trim 1 on 16 x 8 chunks an
        embedding-only first chunk, 126 one-layer chunks and a head-only last chunk, as §3.3.2 describes.
        """
        lay = self.layout
        if lay.stage_layers is not None:
            return tuple(lay.stage_layers)
        trim = lay.edge_stage_trim if lay.num_stages > 1 else 0
        counts = list(split_layers(self.model.layers + 2 * trim, lay.num_stages))
        counts[0] -= trim
        counts[-1] -= trim
        return tuple(counts)

    @cached_property
    def stage_layer_ranges(self) -> tuple[range, ...]:
        """The model layers of each stage, in model order (indices into the model's layers)."""
        ranges, start = [], 0
        for count in self.stage_layer_counts:
            ranges.append(range(start, start + count))
            start += count
        return tuple(ranges)


def split_layers(layers: int, stages: int) -> tuple[int, ...]:
    """Split `layers` over `stages`, trimming the outermost stages first (see Plan.stage_layer_counts)."""
    if stages < 1 or layers < stages:
        raise ValueError(f"cannot split {layers} layers over {stages} stages")
    base = -(-layers // stages)
    counts = [base] * stages
    deficit = base * stages - layers
    order = [i for pair in zip(range(stages), range(stages - 1, -1, -1), strict=True) for i in pair]
    seen: set[int] = set()
    for i in order:
        if deficit == 0:
            break
        if i in seen:
            continue
        seen.add(i)
        counts[i] -= 1
        deficit -= 1
    return tuple(counts)
