"""A GPT-style decoder sized from the plan's `model`: RMSNorm, RoPE, grouped-query attention, SwiGLU or GELU MLP.

Module names follow torchtitan's Llama (`tok_embeddings`, `layers.<i>.attention.wq`, ...), with the layers in a
ModuleDict keyed by their global index so that a pipeline stage that holds layers 4-7 still names them
`layers.4` ... `layers.7`. Weights are initialised per parameter from a generator seeded by (seed, name) — not
from one global stream — so any subset of the model, built on any rank, gets exactly the weights the whole model
would have: the same weights whatever the layout.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from executor.mlp import FeedForward
from executor.moe import MoE
from plan.schema import ModelSpec, Recompute

ROPE_THETA = 10_000.0  # RoFormer's base (Su et al. 2021), also Llama 2's
INIT_STD = 0.02  # GPT-2 / Megatron default
NORM_EPS = 1e-5

# Attention over (q, k, v, positions) -> output; context parallelism swaps in a sharded implementation.
AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unsharded causal attention, [batch, heads, seq, head_dim]; kv heads are shared by groups of q heads."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def rope_cos_sin(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables of rotary embeddings for `positions`: each [seq, head_dim / 2] (fp32)."""
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [batch, seq, heads, head_dim] by each position's angles."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return rotated.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in fp32."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return normed.type_as(x) * _summed_grad(self.weight)


def _summed_grad(weight: torch.Tensor) -> torch.Tensor:
    """The weight, re-wrapped so that its gradient arrives summed over the ranks that replicate it.

    Under sequence parallelism a replicated norm weight meets a sequence shard, so DTensor leaves its gradient
    as a Partial sum per tp rank; FSDP2 then reduces those partial local tensors over dp only and the weight
    learns from a fraction of the sequence (caught by the FSDP x TP x SP reference test). Going through
    `from_local`, whose backward redistributes the gradient to the placement given here (Replicate), sums it.
    """
    if isinstance(weight, DTensor) and all(p.is_replicate() for p in weight.placements):
        return DTensor.from_local(weight.to_local(), weight.device_mesh, weight.placements, run_check=False)
    return weight


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions.

    Head counts are read from the projections' output widths at run time, so after tensor parallelism has
    split the projections column-wise each rank simply runs its own heads.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.head_dim = spec.d_head
        self.wq = nn.Linear(spec.hidden, spec.heads * spec.d_head, bias=False)
        self.wk = nn.Linear(spec.hidden, spec.n_kv_heads * spec.d_head, bias=False)
        self.wv = nn.Linear(spec.hidden, spec.n_kv_heads * spec.d_head, bias=False)
        self.wo = nn.Linear(spec.heads * spec.d_head, spec.hidden, bias=False)
        self.core: AttentionCore = causal_attention
        self.positions: Callable[[int, torch.device], torch.Tensor] = _arange_positions
        self.recompute_core = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        cos, sin = rope_cos_sin(self.positions(seq, x.device), self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # Selective recompute keeps the projections and recomputes only the attention core (Korthikanti 2022).
        core = partial(checkpoint, self.core, use_reentrant=False) if self.recompute_core else self.core
        out = core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def _arange_positions(seq: int, device: torch.device) -> torch.Tensor:
    return torch.arange(seq, device=device)


class Block(nn.Module):
    """One pre-norm transformer layer; its MLP a mixture of experts (those of `expert_ids`) where `moe`."""

    def __init__(self, spec: ModelSpec, moe: bool = False, expert_ids: Sequence[int] = ()) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(spec.hidden)
        self.attention = Attention(spec)
        self.ffn_norm = RMSNorm(spec.hidden)
        self.feed_forward: nn.Module = (
            MoE(spec, expert_ids) if moe else FeedForward(spec.hidden, spec.ffn_hidden, spec.glu)
        )
        self.recompute_all = False

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_all:  # full recompute: keep only the layer's input (Chen et al. 2016)
            out: torch.Tensor = checkpoint(self._layer, x, use_reentrant=False)
            return out
        return self._layer(x)


class GPT(nn.Module):
    """The decoder, or the part of it one pipeline stage holds.

    A stage with `first` embeds token ids; one with `last` applies the final norm and the output head and returns
    logits; the others map hidden states to hidden states. `layer_ids` are global layer indices.
    """

    def __init__(
        self,
        spec: ModelSpec,
        layer_ids: Sequence[int],
        first: bool = True,
        last: bool = True,
        expert_ids: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if spec.tied_embeddings and not (first and last):
            raise ValueError("tied embeddings need the embedding and the output head on one stage (pp=1)")
        self.spec = spec
        self.tok_embeddings = nn.Embedding(spec.vocab, spec.hidden) if first else None
        experts = range(spec.experts) if expert_ids is None else expert_ids
        self.layers = nn.ModuleDict({str(i): Block(spec, spec.is_moe_layer(i), experts) for i in layer_ids})
        self.norm = RMSNorm(spec.hidden) if last else None
        self.output = nn.Linear(spec.hidden, spec.vocab, bias=False) if last else None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output head when the model ties them (again after `to_empty`)."""
        if self.spec.tied_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None and self.output is not None:
            h = self.output(self.norm(h))
        return h

    def blocks(self) -> list[Block]:
        return [b for b in self.layers.values() if isinstance(b, Block)]

    def moe_layers(self) -> list[MoE]:
        return [b.feed_forward for b in self.blocks() if isinstance(b.feed_forward, MoE)]


def param_seed(seed: int, name: str) -> int:
    """A stable 32-bit seed for one parameter: the same on every rank, layout and run.

    32 bits, with the seed hashed in, because the CPU generator (mt19937) keeps only a seed's low 32 bits.
    """
    return zlib.crc32(f"{seed}:{name}".encode())


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """Initialise every parameter from its own generator seeded by (seed, name).

    Norm weights are ones; matrices are N(0, 0.02), and the residual-branch output projections (wo, w2) are
    scaled by 1/sqrt(2·layers) as in GPT-2 (Radford et al. 2019, §2.3) so the residual stream does not grow
    with depth.
    """
    residual_std = INIT_STD / math.sqrt(2 * model.spec.layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        gen = torch.Generator(device=param.device).manual_seed(param_seed(seed, name))
        std = residual_std if name.endswith(("wo.weight", "w2.weight")) else INIT_STD
        param.normal_(0.0, std, generator=gen)


def build_stage_model(
    spec: ModelSpec,
    layer_ids: Sequence[int],
    first: bool,
    last: bool,
    seed: int,
    device: torch.device,
    expert_ids: Sequence[int] | None = None,
) -> GPT:
    """Build a (part of the) model without ever materialising the rest, then initialise it on `device`."""
    with torch.device("meta"):
        model = GPT(spec, layer_ids, first, last, expert_ids)
    model.to_empty(device=device)
    model.tie_weights()
    init_weights(model, seed)
    return model


def set_recompute(model: GPT, mode: Recompute) -> None:
    """Activation recompute as the plan says: none, selective (attention core only) or full (whole layer)."""
    for block in model.blocks():
        block.recompute_all = mode == "full"
        block.attention.recompute_core = mode == "selective"


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over every position of the (micro)batch, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
