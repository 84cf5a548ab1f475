"""One rank's training state and its step: the model parts it holds, the optimizer, and the pipeline schedule.

A step reads this dp rank's share of the global batch, runs forward and backward over its microbatches (through
the pipeline schedule when pp > 1, else a plain accumulation loop), averages gradients over the replicas, takes
the global gradient norm and the job's mean loss in one all-reduce, stops on a non-finite value, clips, and steps
the optimizer. It measures each phase as it goes, and moves the collectives the step's `CommTimer` saw inside
forward, backward and the pipeline schedule out of those phases into comm_<axis> (see executor.commtime).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from executor.commtime import AXES, ping_link
from executor.context_parallel import shard_sequence
from executor.contract import mixed_precision, optimizer_kernels
from executor.data import Sampler
from executor.gradients import all_reduce_gradients, clip_gradients, global_grad_norm, reduce_partial_gradients
from executor.layer_stats import activation_probe, gradient_norms
from executor.model import GPT, build_stage_model, cross_entropy, set_recompute
from executor.moe import MoE
from executor.parallel import (
    Topology,
    apply_context_parallel,
    apply_fsdp,
    apply_tensor_parallel,
    reshard_after_forward,
)
from executor.pipeline import StageClock, build_schedule, instrument, stage_layer_ids, stages_of_rank
from executor.sanity import NonFiniteError
from plan.schema import Plan

REDUCE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class StepResult:
    """What one rank saw of one step."""

    step: int
    loss: float | None
    """This rank's replica's mean loss, on ranks that hold the last stage."""
    job_loss: float
    """Mean loss over the whole global batch."""
    grad_norm: float
    lr: float
    phases: dict[str, float]
    step_s: float
    activation_norm: dict[str, float] = field(default_factory=dict)
    param_grad_norm: dict[str, float] = field(default_factory=dict)
    expert_load: dict[str, list[int]] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)


def learning_rate(plan: Plan, step: int) -> float:
    """Linear warm-up to the peak, then cosine decay to a tenth of it at the run's last step."""
    tr = plan.training
    if step < tr.warmup_steps:
        return tr.lr * (step + 1) / tr.warmup_steps
    span = max(1, plan.total_steps - tr.warmup_steps)
    progress = min(1.0, (step - tr.warmup_steps) / span)
    return tr.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


class Trainer:
    """The model parts, optimizer and schedule of one rank."""

    def __init__(
        self,
        plan: Plan,
        topo: Topology,
        sampler: Sampler,
        device: torch.device,
        compile: bool = False,
        asked_mixed: bool | None = None,
    ):
        self.plan, self.topo, self.sampler, self.device = plan, topo, sampler, device
        lay = plan.layout
        self.mixed = mixed_precision(plan, device.type, asked_mixed)
        self.reduce_dtype = REDUCE_DTYPES[plan.training.reduce_dtype] if self.mixed else torch.float32
        self.fsdp_mesh = topo.replica_mesh if lay.zero > 0 else None  # what FSDP2 shards the weights over
        if plan.model.is_moe:  # built on every rank in one order (new_group is collective), stages without MoE too
            _ = (topo.ep_group, topo.sequence_share)
        self.stage_ids = stages_of_rank(plan, topo.coords.pp) if lay.pp > 1 else [0]
        self.parts = [self._build_part(s, compile) for s in self.stage_ids]
        self.params = list({id(p): p for m in self.parts for p in m.parameters()}.values())
        # with ep > 1 the routed experts differ between dp ranks: reduced over their own replicas, normed over ep
        experts = [p for m in self.parts for moe in m.moe_layers() for p in moe.experts.parameters()]
        self.spread = {id(p) for p in experts} if topo.expert_parallel else set()
        sharded = lay.sequence_parallel and lay.tp > 1  # each tp rank's MoE sees only its sequence shard
        self.tp_summed = [p for m in self.parts for moe in m.moe_layers() for p in moe.parameters()] if sharded else []
        self.optimizer = self._build_optimizer()
        self.clock = StageClock()
        self.schedule = self._build_schedule() if lay.pp > 1 else None
        self.holds_last = plan.layout.num_stages - 1 in self.stage_ids

    def _build_part(self, stage: int, compile: bool) -> GPT:
        plan, topo, lay = self.plan, self.topo, self.plan.layout
        layers = stage_layer_ids(plan, stage) if lay.pp > 1 else range(plan.model.layers)
        last = stage == lay.num_stages - 1
        experts = topo.expert_ids() if topo.expert_parallel else None
        model = build_stage_model(plan.model, layers, stage == 0, last, plan.training.seed, self.device, experts)
        for moe in model.moe_layers():
            moe.group, moe.comm = topo.ep_group, topo.comm
            moe.share = topo.sequence_share
            moe.aux_scale = 1.0 if lay.pp > 1 else 1.0 / plan.num_microbatches  # the schedule scales by itself
        set_recompute(model, lay.recompute)
        if lay.cp > 1:
            apply_context_parallel(model, topo)
        if lay.tp > 1:
            apply_tensor_parallel(model, topo.mesh["tp"], lay.sequence_parallel)
        if compile:
            for block in model.blocks():
                block.compile()
        if self.fsdp_mesh is not None:
            apply_fsdp(model, self.fsdp_mesh, reshard_after_forward(plan), self._policy(), topo)
        return model

    def _policy(self) -> MixedPrecisionPolicy:
        """FSDP2's precision: bf16 parameters gathered, gradients reduced in the plan's dtype (torchtitan's)."""
        if not self.mixed:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=self.reduce_dtype)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        tr = self.plan.training
        decay = [p for p in self.params if p.ndim >= 2]  # no decay on norm gains (AdamW paper practice)
        rest = [p for p in self.params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": tr.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        fast = optimizer_kernels(self.plan, self.device.type)
        if tr.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=tr.lr, momentum=0.9)
        betas = (0.9, 0.95)  # GPT-3 / Llama pre-training betas
        if tr.optimizer == "adam":
            return torch.optim.Adam(groups, lr=tr.lr, betas=betas, **fast)
        return torch.optim.AdamW(groups, lr=tr.lr, betas=betas, **fast)

    def _build_schedule(self) -> _PipelineSchedule:
        pp_group = self.topo.group("pp")
        stages = [
            PipelineStage(part, s, self.plan.layout.num_stages, self.device, group=pp_group)
            for part, s in zip(self.parts, self.stage_ids, strict=True)
        ]
        for stage in stages:
            instrument(stage, self.clock, self._sync, self.topo.comm)
        self.topo.comm.link = ping_link(pp_group, self._boundary_bytes(), self.device, self._sync)
        return build_schedule(self.plan, stages, cross_entropy)

    def _boundary_bytes(self) -> int:
        """Bytes of one microbatch's activations at a stage boundary, in fp32 (an upper bound under bf16)."""
        lay, m = self.plan.layout, self.plan.model
        tokens = lay.microbatch_size * m.seq_len // lay.cp // (lay.tp if lay.sequence_parallel else 1)
        return tokens * m.hidden * 4

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def _numerics(self, autocast: bool = True) -> Iterator[None]:
        """The step's numerics: bf16 autocast where mixed precision is not FSDP2's policy already (the forward;
        the pipeline schedule's backward runs inside it too), and the loss on vocab-sharded logits under tp
        (loss parallel, forward and backward)."""
        with contextlib.ExitStack() as stack:
            if autocast and self.mixed and self.fsdp_mesh is None:
                stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
            if self.plan.layout.tp > 1:
                stack.enter_context(loss_parallel())
            yield

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.topo.coords
        inputs, targets = self.sampler.batch(step, c.dp, self.plan.layout.dp)
        cp = self.plan.layout.cp
        inputs, targets = shard_sequence(inputs, c.cp, cp), shard_sequence(targets, c.cp, cp)
        return inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

    def _run_pipeline(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[float]:
        assert self.schedule is not None
        losses: list[torch.Tensor] = []
        args = (inputs,) if 0 in self.stage_ids else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if self.holds_last else {}
        with self._numerics():
            self.schedule.step(*args, **kwargs)
        return [_scalar(x) for x in losses]

    def _run_microbatches(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[float]:
        model, n = self.parts[0], self.plan.num_microbatches
        comm, losses = self.topo.comm, []
        for x, y, m in zip(inputs.chunk(n), targets.chunk(n), range(n), strict=True):
            if isinstance(model, FSDPModule):  # reduce-scatter once, after the last microbatch
                model.set_requires_gradient_sync(m == n - 1)
            comm.phase = "forward"
            start = time.perf_counter()
            with self._numerics():
                loss = cross_entropy(model(x), y)
            self._sync()
            mid = time.perf_counter()
            comm.phase = "backward"
            with self._numerics(autocast=False):
                (loss / n).backward()
            self._sync()
            self.clock.forward += mid - start
            self.clock.backward += time.perf_counter() - mid
            losses.append(_scalar(loss))
        return losses

    def _reduce_metrics(self, step: int, losses: list[float]) -> tuple[torch.Tensor, float, float]:
        """(global grad norm, job mean loss, seconds the loss all-reduce waited for the slowest rank); raises
        NonFiniteError naming the first bad rank."""
        lay = self.plan.layout
        holders = lay.dp * lay.cp * lay.tp
        local_loss = sum(losses) / len(losses) if losses else 0.0
        bad_loss = bool(losses) and not math.isfinite(local_loss)
        contrib = local_loss / holders if losses and not bad_loss else 0.0
        packed = torch.tensor([contrib, float(bad_loss)], dtype=torch.float64, device=self.device)
        start = time.perf_counter()
        dist.all_reduce(packed)  # every rank of the job: a barrier behind the slowest rank's backward
        barrier_s = time.perf_counter() - start
        if float(packed[1]):
            self._raise_first_bad(step, "loss", local_loss, bad_loss)
        pp_group = self.topo.group("pp") if lay.pp > 1 else None
        norm = global_grad_norm(self.params, self.spread, self.topo.ep_group, pp_group, self.device)
        if not math.isfinite(float(norm)):
            grads = [p.grad for p in self.params if p.grad is not None]
            local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
            self._raise_first_bad(step, "gradient norm", float(norm), not all(bool(g.isfinite().all()) for g in local))
        return norm, float(packed[0]), barrier_s

    def _raise_first_bad(self, step: int, what: str, value: float, local_bad: bool) -> None:
        first = torch.tensor([self.topo.rank if local_bad else dist.get_world_size()], device=self.device)
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        raise NonFiniteError(what, step, min(int(first), dist.get_world_size() - 1), value)

    def step(self, step: int, stats: bool = False) -> StepResult:
        """Run one optimizer step; phases in seconds. With `stats`, also take per-layer norms."""
        with self.topo.comm.measuring():
            return self._step(step, stats)

    def _step(self, step: int, stats: bool) -> StepResult:
        comm = self.topo.comm
        self._sync()
        start = time.perf_counter()
        inputs, targets = self._batch(step)
        data_wait = time.perf_counter() - start
        run = self._run_pipeline if self.schedule is not None else self._run_microbatches
        comm.phase = "schedule"
        with activation_probe(self.parts, enabled=stats) as activations:
            losses = run(inputs, targets)
        compute_end = time.perf_counter()
        comm.phase = "post"
        reduce_partial_gradients(self.params)
        lay = self.plan.layout
        if self.tp_summed:
            all_reduce_gradients(self.tp_summed, self.topo.group("tp"), comm, 1, self.reduce_dtype, axis="tp")
        dense, experts = self.dense_and_experts()
        if (
            self.fsdp_mesh is not None and self.topo.expert_parallel
        ):  # FSDP averaged over the expert's edp·cp replicas (apply_fsdp)
            for p in experts:
                if p.grad is not None:
                    p.grad.div_(lay.ep)
        if lay.zero == 0 and self.topo.replica_mesh is not None:
            all_reduce_gradients(dense, self.topo.replica_mesh.get_group(), comm, dtype=self.reduce_dtype)
            if self.topo.expert_parallel:
                over = lay.dp * lay.cp
                all_reduce_gradients(experts, self.topo.expert_replica_group, comm, over, self.reduce_dtype)
        grads = gradient_norms(self.parts) if stats else {}
        routing = self._routing(stats)
        norm, job_loss, barrier_s = self._reduce_metrics(step, losses)
        lr = learning_rate(self.plan, step)
        clip_gradients(self.params, norm, self.plan.training.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        end = time.perf_counter()
        phases = self._phases(data_wait, compute_end - start - data_wait, end - start, barrier_s)
        local = sum(losses) / len(losses) if losses else None
        result = StepResult(step, local, job_loss, float(norm), lr, phases, end - start, dict(activations), grads)
        if stats:
            result.expert_load, result.dropped = routing
        return result

    def dense_and_experts(self) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        """This rank's parameters held like dense weights, and its routed experts spread over ep ranks."""
        return [p for p in self.params if id(p) not in self.spread], [p for p in self.params if id(p) in self.spread]

    def _routing(self, stats: bool) -> tuple[dict[str, list[int]], dict[str, int]]:
        """Each MoE layer's token choices per expert and dropped choices in this step, read from the device only
        on a stats step; the counters restart every step."""
        load, dropped = {}, {}
        for part in self.parts:
            for name, module in part.named_modules():
                if isinstance(module, MoE) and stats:
                    load[name], dropped[name] = module.take_stats()
                elif isinstance(module, MoE):
                    module.reset_stats()
        return load, dropped

    def _phases(self, data_wait: float, compute_wall: float, step_s: float, barrier_s: float) -> dict[str, float]:
        """Split the step's time: each stretch (compute chunks, the schedule between them, after them) less the
        collectives measured inside it, the collectives by axis, then what is left."""
        forward, backward = self.clock.reset()
        comm = self.topo.comm.reset()
        phases = {
            "data_wait": data_wait,
            "forward": max(0.0, forward - comm.during("forward")),
            "backward": max(0.0, backward - comm.during("backward")),
            **{f"comm_{axis}": comm.axis(axis) for axis in AXES},
            # A schedule's wall time beyond this rank's chunks and the transfers it counted is waiting for peers.
            "bubble": max(0.0, compute_wall - forward - backward - comm.during("schedule"))
            if self.schedule is not None
            else 0.0,
        }
        # The job-wide norm all-reduce before the optimizer waits for the slowest rank: waiting for peers, as the
        # twin's step-end barrier counts it (plan.records: bubble), not optimizer work.
        phases["bubble"] += barrier_s
        phases["optimizer"] = max(0.0, step_s - data_wait - compute_wall - comm.during("post") - barrier_s)
        phases["other"] = max(0.0, step_s - sum(phases.values()))
        return phases


def _scalar(loss: torch.Tensor) -> float:
    """A loss as a float; under loss parallel it is a replicated DTensor."""
    loss = loss.detach()
    return float(loss.full_tensor() if isinstance(loss, DTensor) else loss)
