"""Parameter counts and model FLOPs per token: the one MFU definition the twin and the executor share.

Model FLOPs follow PaLM (Chowdhery et al. 2022, appendix B): 6 FLOPs per active matmul parameter per token
(2 forward, 4 backward) plus 12 · layers · heads · head_dim · seq_len for the attention scores and their weighting
(head_dim the mean of the query-key and value widths where they differ, as under latent attention; a sliding-window
layer's queries counted against its window, not the sequence),
counted without causal masking and without recompute — the convention of Megatron-LM's reported MFU, so figures
compare across tools. Embedding lookups are not matmuls and count no FLOPs; the output head does, and so do
multi-token-prediction modules (their layer, projection and second pass through the head), which are trained.
"""

from __future__ import annotations

from dataclasses import dataclass

from plan.schema import ModelSpec


@dataclass(frozen=True)
class ParamCount:
    """Parameters of a model (count)."""

    total: int
    """Every weight, experts included."""
    active: int
    """Weights one token passes through (top-k and shared experts only); embedding lookup included."""
    embedding: int
    """Input embedding, plus the output head when it is not tied."""
    matmul_active: int
    """Active weights that take part in a matmul: `active` less the input embedding and the norms."""


def attention_params(m: ModelSpec) -> int:
    """Q, K, V and output projections of one layer (no biases, as Llama); under multi-head latent attention the
    down- and up-projections and the two latent norms (DeepSeek-V3 §2.1.1)."""
    if m.is_mla:
        return latent_down_params(m) + latent_up_params(m) + m.heads * m.v_dim * m.hidden
    q = m.heads * m.d_head
    kv = m.n_kv_heads * m.d_head
    return m.hidden * (q + 2 * kv) + q * m.hidden


def latent_down_params(m: ModelSpec) -> int:
    """Multi-head latent attention's down-projections (to the query and key-value latents and the shared RoPE key)
    and the latents' norms: what Megatron-Core keeps whole on every tensor-parallel rank (multi_latent_attention.py
    builds linear_q_down_proj and linear_kv_down_proj with parallel_mode "duplicated"); 0 without MLA."""
    if not m.is_mla:
        return 0
    assert m.kv_lora_rank is not None
    q_lora = m.q_lora_rank or 0
    return m.hidden * (q_lora + m.kv_lora_rank + m.rope_head_dim) + q_lora + m.kv_lora_rank


def latent_up_params(m: ModelSpec) -> int:
    """Multi-head latent attention's up-projections, split over tp as column-parallel layers: the query heads (from
    the query latent, or from the hidden state without one) and each head's key and value from the key-value
    latent."""
    assert m.kv_lora_rank is not None
    q_in = m.q_lora_rank or m.hidden
    return q_in * m.heads * m.qk_head_dim + m.kv_lora_rank * m.heads * (m.d_head + m.v_dim)


def mlp_params(m: ModelSpec, width: int) -> int:
    """One MLP of inner width `width`: three matrices for a gated MLP, two otherwise."""
    return (3 if m.glu else 2) * m.hidden * width


def layer_params(m: ModelSpec, moe: bool) -> tuple[int, int]:
    """(total, active) parameters of one layer, dense or MoE, with its two RMSNorm weights."""
    norms = 2 * m.hidden
    attn = attention_params(m)
    if not moe:
        dense = mlp_params(m, m.ffn_hidden)
        return attn + dense + norms, attn + dense + norms
    assert m.moe_ffn_hidden is not None
    expert = mlp_params(m, m.moe_ffn_hidden)
    router = m.hidden * m.experts
    total = attn + norms + router + (m.experts + m.shared_experts) * expert
    active = attn + norms + router + (m.top_k + m.shared_experts) * expert
    return total, active


def mtp_params(m: ModelSpec) -> tuple[int, int]:
    """(total, active) weights of the multi-token-prediction modules: per module a layer of the model's last kind,
    the 2h → h projection and its two input norms and a final norm; the embedding and the output head are the
    model's own, shared (DeepSeek-V3 §2.2). Kept apart from `param_count`, as the report counts them apart."""
    total, active = layer_params(m, moe=m.is_moe)
    own = 2 * m.hidden * m.hidden + 3 * m.hidden
    return m.mtp_layers * (total + own), m.mtp_layers * (active + own)


def param_count(m: ModelSpec) -> ParamCount:
    """Count the parameters of `m`."""
    dense_total, dense_active = layer_params(m, moe=False)
    n_dense = m.layers - m.moe_layers
    total = n_dense * dense_total
    active = n_dense * dense_active
    if m.is_moe:
        moe_total, moe_active = layer_params(m, moe=True)
        total += m.moe_layers * moe_total
        active += m.moe_layers * moe_active
    head = 0 if m.tied_embeddings else m.vocab * m.hidden
    embedding = m.vocab * m.hidden + head
    final_norm = m.hidden
    norms = 2 * m.hidden * m.layers + final_norm
    return ParamCount(
        total=total + embedding + final_norm,
        active=active + embedding + final_norm,
        embedding=embedding,
        matmul_active=active - norms + final_norm + m.vocab * m.hidden,
    )


def model_flops_per_token(m: ModelSpec) -> float:
    """Training FLOPs per token, forward and backward, by the PaLM convention above (FLOP/token)."""
    attention_scores = 12 * m.layers * m.heads * m.attention_width * m.seq_len * m.unmasked_window_factor
    mtp = 0.0
    if m.mtp_layers:  # each module: its layer's and projection's matmuls, and the head once more
        matmuls = mtp_params(m)[1] - m.mtp_layers * (2 * m.hidden + 3 * m.hidden)  # less the norms
        mtp = 6.0 * (matmuls + m.mtp_layers * m.vocab * m.hidden) + attention_scores * m.mtp_layers / m.layers
    return 6.0 * param_count(m).matmul_active + attention_scores + mtp


def recompute_flops_per_token(m: ModelSpec, recompute: str) -> float:
    """FLOPs per token that recompute adds, counted as model FLOPs are (Korthikanti et al. 2022's hardware FLOPs
    utilisation): full recompute reruns each layer's forward (a third of its 6N share, attention included);
    selective reruns the attention scores and weighting (4 · layers · heads · head_dim · seq_len)."""
    attention = 4 * m.layers * m.heads * m.attention_width * m.seq_len * m.unmasked_window_factor
    if recompute == "full":
        layer_params = param_count(m).matmul_active - m.vocab * m.hidden
        return 2.0 * layer_params + attention
    return float(attention) if recompute == "selective" else 0.0


def mfu(tokens_per_s: float, m: ModelSpec, n_devices: int, peak_flops_per_device: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak FLOP/s (0-1)."""
    return tokens_per_s * model_flops_per_token(m) / (n_devices * peak_flops_per_device)
