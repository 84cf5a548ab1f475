"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it runs in one step.

An action is F (forward), B (backward; input gradients only when the schedule splits off W) or W (weight
gradients) of one microbatch on one model stage. Model stages number 0..S-1 with S = pp · virtual_stages;
`stage_rank` says which pipeline rank holds each: round-robin for interleaved 1F1B (Narayanan et al. 2021),
a "V" for ZBV and DualPipe-V (stage s and 2p-1-s on rank s; Qi et al. 2024; DeepSeek-V3 report §3.2.1).

GPipe, 1F1B and interleaved 1F1B are written out by their published rules. ZB-H1, ZBV and DualPipe-V are built
by the zero-bubble papers' own method: a greedy list schedule under unit costs (F = B = W), preferring backward
work and capping in-flight microbatches at 1F1B's activation memory (Qi et al. 2024, §3 and appendix). Hand-written
because torch.distributed.pipelining derives its orders from live PipelineStage objects and a process group, and
importing torch would cost more than a whole 100k-GPU prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

Kind = Literal["F", "B", "W"]


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work."""

    kind: Kind
    microbatch: int
    stage: int


W_HOLDS = 0.5
"""Share of a microbatch's activations a pending W still holds (the weight-GEMM inputs; about half of a layer's
stored tensors, see twin/step/memory.py) when the greedy builder counts memory against its limit."""

SPLIT_W = frozenset({"zb-h1", "zbv", "dualpipe-v"})
V_SHAPED = frozenset({"zbv", "dualpipe-v"})


def splits_weight_grad(schedule: str) -> bool:
    """True when backward is split into B (input gradients) and W (weight gradients)."""
    return schedule in SPLIT_W


def stage_rank(schedule: str, pp: int, stage: int) -> int:
    """The pipeline rank that holds model stage `stage`."""
    if schedule in V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def build(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Per-rank action lists for one step."""
    return _build(schedule, pp, virtual_stages, microbatches)


@lru_cache(maxsize=128)
def _build(schedule: str, pp: int, v: int, m: int) -> tuple[tuple[Action, ...], ...]:
    if schedule == "gpipe":
        orders = [_gpipe(r, m) for r in range(pp)]
    elif schedule == "1f1b":
        orders = [_one_f_one_b(r, pp, m) for r in range(pp)]
    elif schedule == "zb-h1":  # 1F1B's placement and memory; W fills what would idle (Qi et al. 2024, §3.1)
        orders = _greedy(pp, m, [(r,) for r in range(pp)], [pp - r for r in range(pp)])
    elif schedule == "interleaved-1f1b":
        orders = [_interleaved(r, pp, v, m) for r in range(pp)]
    elif schedule in V_SHAPED:  # stage s and 2p-1-s on rank s; a chunk is half a rank, so 2p is 1F1B's memory
        orders = _greedy(pp, m, [(r, 2 * pp - 1 - r) for r in range(pp)], [2 * pp] * pp)
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    return tuple(tuple(o) for o in orders)


def _gpipe(r: int, m: int) -> list[Action]:
    """All forwards, then all backwards (Huang et al. 2019; torch's ScheduleGPipe runs B in microbatch order)."""
    return [Action("F", j, r) for j in range(m)] + [Action("B", j, r) for j in range(m)]


def _one_f_one_b(r: int, p: int, m: int) -> list[Action]:
    """PipeDream-Flush 1F1B: p-1-r warm-up forwards, then one forward and one backward in turn, then the rest."""
    warmup = min(p - 1 - r, m)
    order = [Action("F", j, r) for j in range(warmup)]
    for i in range(m - warmup):
        order += [Action("F", warmup + i, r), Action("B", i, r)]
    return order + [Action("B", j, r) for j in range(m - warmup, m)]


def _interleaved(r: int, p: int, v: int, m: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B: virtual microbatch k runs chunk (k // p) % v; warm-up of
    2(p-1-r) + (v-1)p forwards (megatron/core/pipeline_parallel/schedules.py)."""
    total = m * v

    def mb(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def fwd(k: int) -> Action:
        return Action("F", mb(k), ((k // p) % v) * p + r)

    def bwd(k: int) -> Action:
        return Action("B", mb(k), (v - 1 - (k // p) % v) * p + r)

    warmup = min(2 * (p - 1 - r) + (v - 1) * p, total)
    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [fwd(warmup + k), bwd(k)]
    return order + [bwd(k) for k in range(total - warmup, total)]


def _greedy(p: int, m: int, stages: list[tuple[int, ...]], limits: list[int]) -> list[list[Action]]:
    """Zero-bubble order by greedy list scheduling under unit costs (F = B = W = 1).

    Each time step every rank runs one ready action: the backward of its deepest stage first; else a forward
    (deepest stage first) while the microbatches it holds activations for — forwards awaiting their backward, and
    backwards awaiting their W, weighed at W_HOLDS — stay under `limits[r]`; else its oldest pending W. A result
    reaches the next stage one step later.
    """
    n_stages = sum(len(s) for s in stages)
    done: dict[tuple[Kind, int, int], int] = {}
    orders: list[list[Action]] = [[] for _ in range(p)]
    pending_w: list[list[Action]] = [[] for _ in range(p)]
    inflight = [0] * p
    next_f = {s: 0 for group in stages for s in group}
    next_b = dict(next_f)
    total, t = 3 * n_stages * m, 0
    while sum(len(o) for o in orders) < total:
        ran: list[tuple[Kind, int, int]] = []
        for r in range(p):
            room = inflight[r] + W_HOLDS * len(pending_w[r]) < limits[r]
            action = _pick(t, m, n_stages, sorted(stages[r], reverse=True), done, next_f, next_b, room, pending_w[r])
            if action is None:
                continue
            orders[r].append(action)
            ran.append((action.kind, action.microbatch, action.stage))
            if action.kind == "F":
                next_f[action.stage] += 1
                inflight[r] += 1
            elif action.kind == "B":
                next_b[action.stage] += 1
                inflight[r] -= 1
                pending_w[r].append(Action("W", action.microbatch, action.stage))
            else:
                pending_w[r].pop(0)
        for key in ran:
            done[key] = t
        t += 1
        if t > 10 * total:
            raise RuntimeError(f"zero-bubble schedule construction stalled for pp={p}, microbatches={m}")
    return orders


def _pick(
    t: int,
    m: int,
    n_stages: int,
    deepest_first: list[int],
    done: dict[tuple[Kind, int, int], int],
    next_f: dict[int, int],
    next_b: dict[int, int],
    may_forward: bool,
    pending_w: list[Action],
) -> Action | None:
    """The action a rank runs at time t in the greedy schedule (see _greedy)."""

    def ready(key: tuple[Kind, int, int]) -> bool:
        return key in done and done[key] < t

    for s in deepest_first:
        j = next_b[s]
        upstream: tuple[Kind, int, int] = ("F", j, s) if s == n_stages - 1 else ("B", j, s + 1)
        if j < m and j < next_f[s] and ready(upstream) and ready(("F", j, s)):
            return Action("B", j, s)
    if pending_w and not may_forward:
        return pending_w[0]
    if may_forward:
        for s in deepest_first:
            j = next_f[s]
            if j < m and (s == 0 or ready(("F", j, s - 1))):
                return Action("F", j, s)
    return pending_w[0] if pending_w else None


def peak_live(order: tuple[Action, ...], weight: dict[int, float], kept_for_w: float = 0.0) -> float:
    """Peak over the step of the activations a rank holds.

    Each forward adds its stage's `weight`; its backward frees it, except the fraction `kept_for_w` (the inputs
    of the weight GEMMs) that a split-off W still needs, which its W frees.
    """
    live = peak = 0.0
    for a in order:
        if a.kind == "F":
            live += weight[a.stage]
            peak = max(peak, live)
        elif a.kind == "B":
            live -= weight[a.stage] * (1.0 - kept_for_w)
        else:
            live -= weight[a.stage] * kept_for_w
    return peak
