"""Pipeline parallelism with `torch.distributed.pipelining`: which stages a rank holds, its layers, the schedule.

Stages are numbered in model order, pp·virtual_stages of them, with the layer counts of
`plan.stage_layer_counts`. Looped schedules place stage s on pp rank s mod pp (Narayanan et al. 2021); the V
schedules (ZBV, DualPipe-V) place stages r and 2·pp−1−r on rank r, so the first and last stage share a rank
(Qi et al. 2024). The plan's schedule names map onto PyTorch's classes one to one, except `zb-h1`, which runs as
`ScheduleInterleavedZeroBubble` with one stage per rank: PyTorch's ZB1P, the zero-bubble schedule of the same
memory as 1F1B that ZB-H1 names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule

from executor.commtime import CommTimer
from plan.schema import Plan

SINGLE_STAGE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MULTI_STAGE = {
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zb-h1": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipe-v": ScheduleDualPipeV,
}
V_SHAPED = ("zbv", "dualpipe-v")


def stages_of_rank(plan: Plan, pp_rank: int) -> list[int]:
    """The stage indices pp rank `pp_rank` holds, in model order."""
    pp, v = plan.layout.pp, plan.layout.virtual_stages
    if plan.layout.schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(v)]


def stage_layer_ids(plan: Plan, stage: int) -> range:
    """Global indices of the layers of one stage."""
    counts = plan.stage_layer_counts
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


@dataclass
class StageClock:
    """Wall seconds of a rank's forward and backward chunks in one step, collectives inside them included (the
    rest of the schedule's wall time is point-to-point transfer and waiting: comm_pp and bubble)."""

    forward: float = 0.0
    backward: float = 0.0

    def reset(self) -> tuple[float, float]:
        out = (self.forward, self.backward)
        self.forward = self.backward = 0.0
        return out


def _timed(
    method: Callable[..., Any], clock: StageClock, phase: str, sync: Callable[[], None], comm: CommTimer
) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        comm.phase = phase  # collectives inside this chunk come out of its compute time
        sync()
        start = time.perf_counter()
        try:
            result = method(*args, **kwargs)
            sync()
        finally:
            comm.phase = "schedule"  # p2p waits and FSDP actions between chunks come out of the bubble
        setattr(clock, phase, getattr(clock, phase) + time.perf_counter() - start)
        return result

    return wrapper


def instrument(stage: PipelineStage, clock: StageClock, sync: Callable[[], None], comm: CommTimer) -> None:
    """Time a stage's forward, backward (input) and backward (weight) chunks on `clock`."""
    timed = {
        "forward_one_chunk": "forward",
        "backward_one_chunk": "backward",
        "backward_weight_one_chunk": "backward",
    }
    for name, phase in timed.items():
        setattr(stage, name, _timed(getattr(stage, name), clock, phase, sync, comm))


def build_schedule(
    plan: Plan, stages: Sequence[PipelineStage], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> _PipelineSchedule:
    """The plan's schedule over this rank's stages; gradients are averaged over microbatches (scale_grads)."""
    name, n = plan.layout.schedule, plan.num_microbatches
    if name in SINGLE_STAGE:
        return SINGLE_STAGE[name](stages[0], n_microbatches=n, loss_fn=loss_fn, scale_grads=True)
    return MULTI_STAGE[name](list(stages), n_microbatches=n, loss_fn=loss_fn, scale_grads=True)
