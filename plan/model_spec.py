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
    """Width of one attention head (elements); defaults to hidden / heads."""
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
        elif self.top_k or self.shared_experts:
            raise ValueError("experts: 0 (dense) but top_k or shared_experts is set; set experts or drop them")
        return self

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads after defaulting (count)."""
        return self.kv_heads or self.heads

    @property
    def d_head(self) -> int:
        """Width of one attention head after defaulting (elements)."""
        return self.head_dim or self.hidden // self.heads

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (count)."""
        return self.layers - self.dense_layers if self.is_moe else 0
