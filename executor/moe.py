"""Mixture-of-experts MLP with expert parallelism: a top-k router, experts and optional shared experts (the MLP of
executor/mlp.py), a sequence-wise load-balancing loss, dropless routing or a per-sequence capacity.

Experts sit in a ModuleDict keyed by their global index, like the decoder's layers, so an expert's weights are named
(`layers.3.feed_forward.experts.5.w1.weight`) and seeded the same on whichever expert-parallel rank holds it: any
layout starts from the same weights, and a checkpoint reshards over a different `ep` by name.

Expert parallelism (`ep` > 1): rank e of an expert-parallel group holds experts [e·E/ep, (e+1)·E/ep). A forward
sorts its tokens' choices by expert, swaps per-expert counts with the group, sends each rank the tokens for its
experts with `all_to_all_single`, runs its experts on what arrived (from every rank), and sends the results back
the same way; the gates weight and sum them at their tokens. Gradients take the reverse trips.

Routing is defined per sequence — the balance loss's load and score shares and the capacity's count — so that it
does not depend on how the batch is split into replicas and microbatches: the sharded run and one process training
the same batch route identically and compute the same loss. Where a sequence is spread over ranks — context
parallelism, and under sequence parallelism the tp ranks, each of which routes its own shard (Megatron-Core's
all-to-all dispatcher does the same) — those ranks (`SequenceShare`) sum their parts of each sequence's load and
scores before the balance loss, and a capacity is counted in token order along the whole sequence: they swap
their choices and the positions they hold.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from executor.commtime import CommTimer
from executor.mlp import FeedForward
from plan.schema import ModelSpec


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` over a group, whose backward is the reverse exchange.

    Hand-written rather than funcol's autograd all-to-all: its backward's exchange must be timed as comm_ep, and
    funcol's autograd variant issues it where the step's CommTimer cannot see it."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any, comm: CommTimer
    ) -> torch.Tensor:
        ctx.trip = (in_splits, out_splits, group, comm)
        return _exchange(x, out_splits, in_splits, group, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        in_splits, out_splits, group, comm = ctx.trip
        return _exchange(grad, in_splits, out_splits, group, comm), None, None, None, None


def _exchange(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any, comm: CommTimer
) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with comm.span("ep"):
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _SequenceSum(torch.autograd.Function):
    """Sum a tensor over the ranks that share the sequences. Each of them computes the same whole-sequence loss
    from the sum, so the backward sums their gradients the same way and divides by `summed`, the ranks among them
    whose weight gradients are later summed rather than averaged (the tp ranks under sequence parallelism; the cp
    ranks' are averaged with dp's). Hand-written for the reason _AllToAll is: timed as the axis that splits the
    sequence."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, comm: CommTimer, axis: str, summed: int) -> torch.Tensor:
        ctx.trip = (group, comm, axis, summed)
        return _sum_over(x.clone(), group, comm, axis)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        group, comm, axis, summed = ctx.trip
        return _sum_over(grad.clone(), group, comm, axis) / summed, None, None, None, None


def _sum_over(x: torch.Tensor, group: Any, comm: CommTimer, axis: str) -> torch.Tensor:
    with comm.span(axis):
        dist.all_reduce(x, group=group)
    return x


@dataclass(frozen=True)
class SequenceShare:
    """The ranks holding parts of the same sequences at an MoE layer (cp, and tp under sequence parallelism),
    built by Topology.sequence_share."""

    group: Any
    """Their process group."""
    axis: str
    """The axis the step's timer books their exchanges under (cp, or tp where only tp splits the sequence)."""
    summed: int
    """How many of them have their gradients of this layer's weights summed rather than averaged (tp under
    sequence parallelism: the Trainer sums the MoE weights' gradients over tp; cp's are averaged with dp's)."""
    positions: Callable[[int], torch.Tensor]
    """Positions along the whole sequence of the tokens this rank holds, given how many it holds per sequence."""


class _AuxLoss(torch.autograd.Function):
    """Pass `out` through unchanged and send `scale` back into `aux` in backward: the balance loss joins the
    gradient at the layer that computes it, whichever pipeline stage that is, without travelling to the loss
    function (Megatron-Core's MoEAuxLossAutoScaler does the same)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class MoE(nn.Module):
    """The MLP of an MoE layer, holding the routed experts `expert_ids` (all of them without expert parallelism)."""

    def __init__(self, spec: ModelSpec, expert_ids: Sequence[int]) -> None:
        super().__init__()
        assert spec.moe_ffn_hidden is not None
        self.n_experts, self.top_k = spec.experts, spec.top_k
        self.score, self.capacity_factor, self.aux_coef = spec.router, spec.capacity_factor, spec.aux_loss_coef
        self.groups = spec.routing_groups
        self.router = nn.Linear(spec.hidden, spec.experts, bias=False)
        width, glu = spec.moe_ffn_hidden, spec.glu  # experts gate as the dense MLP does (the twin prices them so)
        self.experts = nn.ModuleDict({str(e): FeedForward(spec.hidden, width, glu) for e in expert_ids})
        self.shared = FeedForward(spec.hidden, width * spec.shared_experts, glu) if spec.shared_experts else None
        self.group: Any = None
        """The expert-parallel process group (None: every expert is here)."""
        self.share: SequenceShare | None = None
        """The ranks sharing this rank's sequences (None: whole sequences here): they pool their routing
        statistics, so the balance loss and the capacity are the whole sequence's."""
        self.comm = CommTimer()
        self.aux_scale = 1.0
        """Gradient of the step's objective per unit of this microbatch's balance loss (1/microbatches unless
        the pipeline schedule scales the gradients itself)."""
        self.load: torch.Tensor | None = None
        """Token choices per expert since the last `take_stats`, before any is dropped (on the device, so counting
        costs no host sync; made at the first forward: the module is built on the meta device, this is not)."""
        self.dropped: torch.Tensor | None = None
        """Token choices dropped over capacity since the last `take_stats`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        logits = self.router(tokens).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        chosen = self._limited(scores).topk(self.top_k, dim=-1).indices  # [tokens, k]
        top = scores.gather(-1, chosen)
        gates = top / top.sum(-1, keepdim=True)
        keep = self._within_capacity(chosen, batch, seq).reshape(-1)  # per choice, token-major then slot
        with torch.no_grad():
            choices = torch.bincount(chosen.reshape(-1), minlength=self.n_experts)
            dropped = (~keep).sum()
            self.load = choices if self.load is None else self.load + choices
            self.dropped = dropped if self.dropped is None else self.dropped + dropped
        token = torch.arange(tokens.shape[0], device=x.device).repeat_interleave(self.top_k)[keep]
        expert, gate = chosen.reshape(-1)[keep], gates.reshape(-1)[keep]
        order = torch.argsort(expert, stable=True)  # choices by expert; a token's slots in slot order
        expert, token, gate = expert[order], token[order], gate[order]
        counts = torch.bincount(expert, minlength=self.n_experts)
        routed = tokens[token]
        done = self._experts(routed, counts) if self.group is None else self._dispatched(routed, counts)
        weighted = done.float() * gate[:, None]
        out = torch.zeros(tokens.shape, dtype=torch.float32, device=x.device).index_add(0, token, weighted)
        if self.shared is not None:
            out = out + self.shared(tokens).float()
        out = out.type_as(x).view(batch, seq, hidden)
        if self.aux_coef and self.training and torch.is_grad_enabled():
            out = _AuxLoss.apply(out, self._balance_loss(scores, chosen, batch, seq), self.aux_scale)
        return out

    def _limited(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores a token may choose from: all of them, or under group-limited routing (ModelSpec.expert_groups)
        only its best `group_top_k` groups', each group scored by the sum of its top_k / group_top_k best scores
        (Megatron-Core's group_limited_topk; DeepSeek-V3 sums each group's best 2 of top-8 over 4 groups), the
        rest set below any score."""
        if self.groups is None:
            return scores
        total, chosen = self.groups
        per_group = scores.view(scores.shape[0], total, -1)
        best = per_group.topk(max(1, self.top_k // chosen), dim=-1).values.sum(-1)  # [tokens, groups]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter(1, best.topk(chosen, dim=-1).indices, True)
        return per_group.masked_fill(~keep[..., None], -1.0).view_as(scores)

    def _within_capacity(self, chosen: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        """Which choices an expert takes: all (dropless), or per sequence the first `capacity` in token order."""
        if self.capacity_factor is None:
            return torch.ones_like(chosen, dtype=torch.bool)
        queue, mine = chosen.view(batch, seq, self.top_k), None
        if self.share is not None:
            queue, mine = self._whole_sequence(queue, self.share)
        whole = queue.shape[1]
        capacity = math.ceil(self.capacity_factor * self.top_k * whole / self.n_experts)
        onehot = F.one_hot(queue.reshape(batch, whole * self.top_k), self.n_experts)
        position = ((onehot.cumsum(1) - 1) * onehot).sum(-1).view(batch, whole, self.top_k)  # place in the queue
        if mine is not None:
            position = position[:, mine]
        return (position < capacity).view_as(chosen)

    def _whole_sequence(self, queue: torch.Tensor, share: SequenceShare) -> tuple[torch.Tensor, torch.Tensor]:
        """The choices [batch, seq, k] of every rank sharing the sequences, placed at their positions along the
        whole sequence, and the positions of this rank's own."""
        size, seq = dist.get_world_size(share.group), queue.shape[1]
        mine = share.positions(seq).to(queue.device)
        parts, places = [torch.empty_like(queue) for _ in range(size)], [torch.empty_like(mine) for _ in range(size)]
        with self.comm.span(share.axis):
            dist.all_gather(parts, queue.contiguous(), group=share.group)
            dist.all_gather(places, mine, group=share.group)
        whole = queue.new_empty((queue.shape[0], seq * size, self.top_k))
        for part, place in zip(parts, places, strict=True):
            whole[:, place] = part
        return whole, mine

    def _balance_loss(self, scores: torch.Tensor, chosen: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        """α · Σ_e f_e · P_e per sequence, averaged: f_e = E/(k·T) · choices of e, P_e = mean normalised score."""
        load = F.one_hot(chosen, self.n_experts).sum(1).view(batch, seq, -1).sum(1).float()
        normalised = (scores / scores.sum(-1, keepdim=True)).view(batch, seq, -1)
        pooled = self.share
        if pooled is None:
            prob = normalised.mean(1)
        else:  # this rank holds seq of the sequence's size·seq tokens: sum the parts, then average
            _sum_over(load, pooled.group, self.comm, pooled.axis)
            seq *= dist.get_world_size(pooled.group)
            prob = _SequenceSum.apply(normalised.sum(1), pooled.group, self.comm, pooled.axis, pooled.summed) / seq
        share = load * self.n_experts / (self.top_k * seq)
        return self.aux_coef * (share * prob).sum(-1).mean()

    def _experts(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each local expert on its consecutive slice of `routed` (every expert runs, on no tokens if need be, so
        every expert weight has a gradient to reduce)."""
        chunks = routed.split(counts.tolist())
        return torch.cat([expert(chunk) for chunk, expert in zip(chunks, self.experts.values(), strict=True)])

    def _dispatched(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send each expert's tokens to the rank that holds it, run the local experts, send the results back."""
        ep = dist.get_world_size(self.group)
        local = self.n_experts // ep
        sent = counts.view(ep, local)
        got = torch.empty_like(sent)
        with self.comm.span("ep"):
            dist.all_to_all_single(got, sent, group=self.group)  # [source rank, my expert]: tokens coming
        send_splits, recv_splits = sent.sum(1).tolist(), got.sum(1).tolist()
        arrived = _AllToAll.apply(routed, recv_splits, send_splits, self.group, self.comm)
        # arrived is by source rank, then expert: regroup by expert, run, restore the order, send back
        label = torch.arange(local, device=routed.device).repeat(ep).repeat_interleave(got.reshape(-1))
        by_expert = torch.argsort(label, stable=True)
        done = self._experts(arrived[by_expert], got.sum(0))
        restored = done[torch.argsort(by_expert)]
        back: torch.Tensor = _AllToAll.apply(restored, send_splits, recv_splits, self.group, self.comm)
        return back

    def take_stats(self) -> tuple[list[int], int]:
        """Token choices per expert and dropped choices since the last call; resets both."""
        load = self.load.tolist() if self.load is not None else [0] * self.n_experts
        dropped = int(self.dropped) if self.dropped is not None else 0
        self.reset_stats()
        return load, dropped

    def reset_stats(self) -> None:
        """Restart the counters without reading them (no host sync)."""
        self.load = self.dropped = None
