"""The plan's `model` section: a decoder-only transformer, dense or mixture-of-experts (re-exported by
plan.schema, where the rest of the plan lives)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from plan.section import UserSection


class ModelSpec(UserSection):
    """A decoder-only transformer, dense or mixture-of-experts."""

    name: str = "custom"
    """Display name of the architecture."""
    layers: PositiveInt
    """Transformer blocks (count)."""
    hidden: PositiveInt
    """Model width d_model (elements)."""
    heads: PositiveInt
    """Query attention heads (count)."""
    kv_heads: PositiveInt | None = None
    """Key/value heads for grouped-query attention (count); defaults to `heads` (multi-head attention)."""
    head_dim: PositiveInt | None = None
    """Width of one attention head (elements); defaults to hidden / heads. Under multi-head latent attention, the
    query and key width each head has besides its RoPE part (DeepSeek-V3's qk_nope_head_dim, 128)."""
    kv_lora_rank: PositiveInt | None = None
    """Multi-head latent attention (DeepSeek-V2 §2.1, DeepSeek-V3 §2.1.1): keys and values are projected down to this
    rank, plus a shared RoPE key of `rope_head_dim`, and up again per head (elements; 512 in DeepSeek-V3). Unset:
    keys and values are projected from the hidden state (multi-head or grouped-query attention)."""
    q_lora_rank: PositiveInt | None = None
    """Multi-head latent attention's query compression rank (elements; 1,536 in DeepSeek-V3); unset: queries are
    projected from the hidden state directly."""
    rope_head_dim: NonNegativeInt = 0
    """Multi-head latent attention's decoupled RoPE width, added to each head's query and key (elements; 64)."""
    sliding_window: PositiveInt | None = None
    """Keys each query attends back over in the windowed layers (tokens; Mistral 7B 4,096, GPT-OSS 128); unset: every
    layer attends over the whole sequence."""
    full_attention_every: PositiveInt | None = None
    """Where `sliding_window` is set, every n-th layer attends over the whole sequence (GPT-OSS 2: windowed and full
    layers alternate; Gemma 3 6); unset: every layer is windowed."""
    v_head_dim: PositiveInt | None = None
    """Width of one value head (elements); defaults to head_dim (DeepSeek-V3: 128 against a 192-wide query)."""
    ffn_hidden: PositiveInt
    """Inner width of a dense MLP (elements)."""
    vocab: PositiveInt
    """Vocabulary size (tokens)."""
    seq_len: PositiveInt
    """Training sequence length (tokens)."""
    glu: bool = True
    """True: gated MLP with three matrices (SwiGLU); false: two-matrix GELU MLP."""
    experts: NonNegativeInt = 0
    """Routed experts per MoE layer (count); 0 means a dense model."""
    top_k: NonNegativeInt = 0
    """Routed experts each token visits (count); 0 for a dense model."""
    moe_ffn_hidden: PositiveInt | None = None
    """Inner width of one expert's MLP (elements); required when experts > 0."""
    shared_experts: NonNegativeInt = 0
    """Always-active shared experts per MoE layer, each of width moe_ffn_hidden (count)."""
    dense_layers: NonNegativeInt = 0
    """Leading layers that keep a dense MLP in an MoE model, as DeepSeek-V3's first three (count)."""
    moe_layer_step: PositiveInt = 1
    """After the leading dense layers, every this-many-th layer is a mixture of experts and the others keep a dense
    MLP of width ffn_hidden (count): 1, every layer (Mixtral, DeepSeek-V3); 2, dense and MoE layers alternating,
    the MoE one second, as Llama 4 Maverick's interleave_moe_layer_step 2 (Hugging Face Llama4TextConfig: layer i is
    MoE where (i + 1) % step == 0) and Megatron-Core's moe_layer_freq [0, 1] * 24 (NeMo Llama4Experts128Config)."""
    expert_groups: PositiveInt | None = None
    """Groups the routed experts are cut into, in order, for group-limited routing (Megatron-Core's
    moe_router_num_groups; DeepSeek-V3's n_group 8 with its experts spread one group a node): a token's experts come
    from its `group_top_k` best groups only, which caps the nodes a dispatch reaches (§2.1.2 "node-limited routing").
    Unset: any expert."""
    group_top_k: PositiveInt | None = None
    """Groups a token's experts are drawn from (moe_router_group_topk; DeepSeek-V3's topk_group 4, "at most M = 4"
    nodes); with `expert_groups`. Each group is scored by the sum of its top_k // group_top_k best router scores, as
    the executor's router computes them (probabilities; Megatron-Core ranks a softmax router's groups on its raw
    logits unless moe_router_pre_softmax, the same for a sigmoid router)."""
    router: Literal["softmax", "sigmoid"] = "softmax"
    """How an MoE router scores experts: a softmax over them (Switch, Mixtral) or a sigmoid each (DeepSeek-V3); the
    top-k scores are renormalised to sum to one as the token's gates."""
    capacity_factor: PositiveFloat | None = None
    """Tokens one expert takes from one sequence, as a multiple of an even share (top_k · seq_len / experts); a
    token's choice past it is dropped and counted (GShard, Lepikhin et al. 2020). Unset: dropless."""
    expert_imbalance: float = Field(default=1.0, ge=1)
    """Routed tokens the busiest expert-parallel rank of a group computes, over the even share (max / mean of the
    ranks' loads; 1 = balanced). The twin slows expert GEMMs and the all-to-all by it, at most by capacity_factor;
    `twin calibrate` reads it from an MoE run's expert-load records."""
    mtp_layers: NonNegativeInt = 0
    """Multi-token-prediction modules trained beside the model (DeepSeek-V3 §2.2, D = 1): each joins the next token's
    embedding to the last hidden state through a 2h → h projection, runs one more layer (an MoE layer where the
    model's are) and the shared output head and loss, on the last pipeline stage (Megatron-Core's
    mtp_num_layers)."""
    aux_loss_coef: NonNegativeFloat = 0.01
    """Weight of the load-balancing loss, taken per sequence (DeepSeek-V3 §2.1.2's sequence-wise form of Switch's
    f·P loss, Fedus et al. 2022 §2.2, whose α = 0.01 is the default)."""
    tied_embeddings: bool = False
    """True: the output head reuses the input embedding matrix."""

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        kv = self.kv_heads or self.heads
        if self.heads % kv:
            raise ValueError(f"kv_heads: {kv} does not divide heads={self.heads}; use a divisor of {self.heads}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"heads: {self.heads} does not divide hidden={self.hidden}; set head_dim or change heads")
        if self.experts:
            if not 1 <= self.top_k <= self.experts:
                raise ValueError(f"top_k: {self.top_k} must be between 1 and experts={self.experts}")
            if self.moe_ffn_hidden is None:
                raise ValueError("moe_ffn_hidden: required when experts > 0 (the width of one expert's MLP)")
            if self.dense_layers >= self.layers:
                raise ValueError(f"dense_layers: {self.dense_layers} leaves no MoE layer of layers={self.layers}")
            if not self.moe_layers:
                raise ValueError(f"moe_layer_step: {self.moe_layer_step} leaves no MoE layer among the "
                                 f"{self.layers - self.dense_layers} after dense_layers; use a step of at most "
                                 f"{self.layers - self.dense_layers}")  # fmt: skip
            if (self.expert_groups is None) != (self.group_top_k is None):
                raise ValueError("expert_groups and group_top_k: group-limited routing needs both; set both or neither")
            if self.expert_groups is not None and self.group_top_k is not None:
                if self.experts % self.expert_groups:
                    raise ValueError(f"expert_groups: {self.expert_groups} does not divide experts={self.experts}")
                if self.group_top_k > self.expert_groups:
                    raise ValueError(f"group_top_k: {self.group_top_k} is more than expert_groups={self.expert_groups}")
                per_group = self.experts // self.expert_groups
                if self.group_top_k * per_group < self.top_k:
                    least = -(-self.top_k // per_group)
                    raise ValueError(f"group_top_k: {self.group_top_k} groups of {per_group} experts hold fewer "
                                     f"than top_k={self.top_k}; keep at least {least} groups")  # fmt: skip
                if self.top_k // self.group_top_k > per_group:
                    best = self.top_k // self.group_top_k
                    raise ValueError(f"group_top_k: each group is scored by its best top_k // group_top_k = "
                                     f"{best} experts, more than its {per_group}")  # fmt: skip
        elif self.top_k or self.shared_experts or self.expert_groups or self.moe_layer_step > 1:
            raise ValueError("experts: 0 (dense) but top_k, shared_experts, expert_groups or moe_layer_step is set; "
                             "set experts or drop them")  # fmt: skip
        if self.full_attention_every is not None and self.sliding_window is None:
            raise ValueError("full_attention_every: only layers with a sliding window alternate; set sliding_window")
        if self.kv_lora_rank is None and (self.q_lora_rank or self.rope_head_dim):
            raise ValueError("q_lora_rank / rope_head_dim: multi-head latent attention needs kv_lora_rank; set it")
        if self.kv_lora_rank is not None and self.n_kv_heads != self.heads:
            raise ValueError(f"kv_heads: {self.n_kv_heads}; latent attention gives every head its own key and value, "
                             f"so set kv_heads to heads={self.heads} or drop it")  # fmt: skip
        return self

    @property
    def routing_groups(self) -> tuple[int, int] | None:
        """Group-limited routing as (expert_groups, group_top_k), or None where any expert may be picked."""
        if self.expert_groups is None or self.group_top_k is None:
            return None
        return self.expert_groups, self.group_top_k

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads after defaulting (count)."""
        return self.kv_heads or self.heads

    @property
    def d_head(self) -> int:
        """Width of one attention head after defaulting (elements)."""
        return self.head_dim or self.hidden // self.heads

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (kv_lora_rank set)."""
        return self.kv_lora_rank is not None

    @property
    def qk_head_dim(self) -> int:
        """Width of one query (and key) head the attention core multiplies: head_dim plus the RoPE part (elements)."""
        return self.d_head + self.rope_head_dim

    @property
    def v_dim(self) -> int:
        """Width of one value head (elements)."""
        return self.v_head_dim or self.d_head

    @property
    def attention_width(self) -> float:
        """Mean of the query-key and value head widths: what the attention core's two products scale with (d_head
        where they are equal)."""
        return (self.qk_head_dim + self.v_dim) / 2

    @property
    def windowed_share(self) -> float:
        """Share of the layers that attend over a sliding window (0 without one)."""
        if self.sliding_window is None or self.sliding_window >= self.seq_len:
            return 0.0
        every = self.full_attention_every
        return 1.0 if every is None else (self.layers - self.layers // every) / self.layers

    @property
    def causal_window_factor(self) -> float:
        """Query-key pairs a causal layer computes, averaged over the layers, over a full causal layer's s²/2: a
        windowed layer's s·w − w²/2 (each query attends its w most recent keys) where a full one has s²/2."""
        share = self.windowed_share
        if not share:
            return 1.0
        s, w = float(self.seq_len), float(self.sliding_window or self.seq_len)
        return 1.0 - share + share * (s * w - w * w / 2) / (s * s / 2)

    @property
    def unmasked_window_factor(self) -> float:
        """Keys a query is counted against by the unmasked model-FLOPs convention, averaged over the layers, over the
        whole sequence: w / s for a windowed layer."""
        share = self.windowed_share
        return 1.0 - share + share * (self.sliding_window or self.seq_len) / self.seq_len

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (count)."""
        return (self.layers - self.dense_layers) // self.moe_layer_step if self.is_moe else 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether model layer `layer` (0-based) routes its MLP to experts: past the leading dense layers, the last
        of every `moe_layer_step`; `layers` and beyond are multi-token-prediction modules, MoE in an MoE model."""
        if not self.is_moe or layer < self.dense_layers:
            return False
        return layer >= self.layers or (layer - self.dense_layers + 1) % self.moe_layer_step == 0
