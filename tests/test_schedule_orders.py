"""The twin's pipeline orders are the orders torch runs, action by action, for every schedule.

torch.distributed.pipelining builds each multi-stage schedule's per-rank action list (`pipeline_order`) in its
constructor, from the stages' indices and group sizes alone; stand-in stages carrying those facts let it list
them without a process group. The executor runs exactly these lists (executor/pipeline.py), so a torch upgrade
that reorders a schedule fails here rather than silently parting the twin from the executor.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from executor.pipeline import MULTI_STAGE, SINGLE_STAGE
from twin.step.schedules import build, splits_weight_grad, stage_rank

KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
Step = tuple[str, int, int, bool]


class StandInStage:
    """What a schedule's constructor reads of a PipelineStage: its place in the pipeline and its module."""

    def __init__(self, index: int, num_stages: int, pp: int, rank: int) -> None:
        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = pp, rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = torch.nn.Identity()


def torch_order(schedule: str, pp: int, v: int, m: int) -> dict[int, list[Any]]:
    """torch's per-rank list of actions for the schedule the executor maps the plan's name to."""
    if schedule in SINGLE_STAGE:
        return SINGLE_STAGE[schedule](StandInStage(0, pp, pp, 0), m, loss_fn=_loss)._get_pipeline_order()
    ranks = [(r, 2 * pp - 1 - r) if schedule in ("zbv", "dualpipe-v") else tuple(r + i * pp for i in range(v))
             for r in range(pp)]  # fmt: skip
    stages = [StandInStage(i, pp * v, pp, 0) for i in ranks[0]]
    return MULTI_STAGE[schedule](stages, m, loss_fn=_loss).pipeline_order


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output


def flatten(actions: list[Any], split: bool) -> list[Step]:
    """torch's compute actions as the twin writes them: a full backward in a split-W schedule is B then W; an
    overlapped forward-backward pair is its sub-actions, marked as overlapped. Communication and idle slots go."""
    out: list[Step] = []
    for action in actions:
        if action is None:
            continue
        kind = action.computation_type.name
        if kind == "OVERLAP_F_B":
            out += [step for sub in action.sub_actions for step in _steps(sub, split, overlap=True)]
        elif kind in KINDS:
            out += _steps(action, split, overlap=False)
    return out


def _steps(action: Any, split: bool, overlap: bool) -> list[Step]:
    kind, mb, stage = action.computation_type.name, action.microbatch_index, action.stage_index
    if kind == "FULL_BACKWARD" and split:
        return [("B", mb, stage, overlap), ("W", mb, stage, overlap)]
    return [(KINDS[kind], mb, stage, overlap)]


def twin_order(schedule: str, pp: int, v: int, m: int) -> list[list[Step]]:
    return [[(a.kind, a.microbatch, a.stage, a.overlap) for a in order] for order in build(schedule, pp, v, m)]


CASES = [
    ("gpipe", 1, [(2, 4), (4, 7), (8, 8)]),
    ("interleaved-1f1b", 2, [(2, 4), (4, 8), (4, 16), (8, 16)]),
    ("interleaved-1f1b", 3, [(2, 6), (4, 12)]),
    ("zb-h1", 1, [(2, 4), (4, 8), (4, 12), (8, 8), (8, 24)]),
    ("zbv", 2, [(2, 3), (2, 4), (4, 8), (4, 13), (8, 20)]),
    ("dualpipe-v", 2, [(2, 4), (3, 9), (4, 8), (5, 23), (8, 16), (8, 33)]),
]


@pytest.mark.parametrize(
    ("schedule", "v", "pp", "m"), [(name, v, pp, m) for name, v, sizes in CASES for pp, m in sizes]
)
def test_twin_runs_torchs_order(schedule: str, v: int, pp: int, m: int) -> None:
    expected = torch_order(schedule, pp, v, m)
    actual = twin_order(schedule, pp, v, m)
    for rank in range(pp):
        assert actual[rank] == flatten(expected[rank], splits_weight_grad(schedule)), f"{schedule} rank {rank}"
        assert all(stage_rank(schedule, pp, stage) == rank for _, _, stage, _ in actual[rank])


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 5), (8, 16)])
def test_1f1b_is_torchs_order(pp: int, m: int) -> None:
    """Schedule1F1B's listing (`_get_pipeline_order`, for visualisation) matches on every rank but the last, where
    torch 2.13's listing numbers the forwards from 1 (an off-by-one: it names microbatch m, which does not exist).
    Its runtime, `_step_microbatches`, runs pp - r warm-up forwards and then alternates backward and forward:
    the same sequence as the twin's p-1-r warm-up forwards and forward-backward pairs."""
    listing = torch_order("1f1b", pp, 1, m)
    actual = twin_order("1f1b", pp, 1, m)
    for rank in range(pp - 1):
        assert actual[rank] == flatten(listing[rank], split=False)
    last = flatten(listing[pp - 1], split=False)
    assert [k for k, *_ in actual[-1]] == [k for k, *_ in last]
    assert max(mb for kind, mb, *_ in last if kind == "F") == m  # the listing's off-by-one, not a real microbatch
    warmup = [a for a in actual[0][: pp - 0] if a[0] == "F"]
    assert len(warmup) == min(pp, m)  # rank 0: pp warm-up forwards before its first backward, as the runtime does
