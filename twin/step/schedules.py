"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it runs in one step.

An action is F (forward), B (backward; input gradients only when the schedule splits off W) or W (weight
gradients) of one microbatch on one model stage. Model stages number 0..S-1 with S = pp · virtual_stages;
`stage_rank` says which pipeline rank holds each: round-robin for interleaved 1F1B (Narayanan et al. 2021),
a "V" for ZBV and DualPipe-V (stage s and 2p-1-s on rank s; Qi et al. 2024; DeepSeek-V3 report §3.2.1).

Every order is the one the executor runs: PyTorch 2.13's `torch.distributed.pipelining` schedule of the same
name (tests/test_schedule_orders.py lists torch's per-rank actions and compares them action by action). Each is
written here from the schedule's published rule — torch's ordering of it where the papers leave a choice — since
importing torch to ask it would cost more than a whole 100k-GPU prediction:

- GPipe (Huang et al. 2019): all forwards, then all backwards in microbatch order.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021): p-1-r warm-up forwards, then one forward and one backward in
  turn, then the remaining backwards.
- Interleaved 1F1B (Narayanan et al. 2021, §2.2.2; Megatron-LM's and torch's order).
- ZB-H1 (Qi et al. 2024, §3.1; torch's ScheduleInterleavedZeroBubble with one stage per rank): 1F1B's order with
  the backward split into B and W; rank r holds back the W of its first r backwards and afterwards runs the
  oldest pending W after each backward, the rest at the end.
- ZBV (Qi et al. 2024, §4, the handcrafted ZB-V; torch's ScheduleZBVZeroBubble).
- DualPipe-V (DeepSeek-V3 report §3.2.1, DualPipe's "V" variant; torch's ScheduleDualPipeV): its main phase runs
  forward-backward pairs of two microbatches on the two chunks as one overlapped unit (`overlap`), where the
  expert-parallel all-to-all of one hides behind the other's compute. A full backward (B and W together, which
  DualPipe runs outside its zero-bubble phases) is B immediately followed by its W.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from twin.step.kept import Kept

Kind = Literal["F", "B", "W"]


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work."""

    kind: Kind
    microbatch: int
    stage: int
    overlap: bool = False
    """Part of an overlapped forward-backward pair (DualPipe, or Megatron-Core's combined 1F1B): its all-to-all
    hides behind the pair's compute."""


SPLIT_W = frozenset({"zb-h1", "zbv", "dualpipe-v"})
V_SHAPED = frozenset({"zbv", "dualpipe-v"})


def splits_weight_grad(schedule: str) -> bool:
    """True when backward is split into B (input gradients) and W (weight gradients)."""
    return schedule in SPLIT_W


def receiver(a: Action, stages: int) -> int | None:
    """The stage that takes what `a` produces: a forward's activation goes to the next stage, a backward's input
    gradient to the previous one; None for a weight-gradient pass and at the model's two ends."""
    if a.kind == "F" and a.stage < stages - 1:
        return a.stage + 1
    if a.kind == "B" and a.stage > 0:
        return a.stage - 1
    return None


def stage_rank(schedule: str, pp: int, stage: int) -> int:
    """The pipeline rank that holds model stage `stage`."""
    if schedule in V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


@lru_cache(maxsize=256)
def stage_ranks(schedule: str, pp: int, stages: int) -> tuple[int, ...]:
    """The pipeline rank of each of the `stages` model stages (`stage_rank` of each)."""
    return tuple(stage_rank(schedule, pp, stage) for stage in range(stages))


@lru_cache(maxsize=256)
def rank_stages(schedule: str, pp: int, stages: int) -> tuple[tuple[int, ...], ...]:
    """The model stages each pipeline rank holds, in model order (`stage_ranks` inverted)."""
    held: list[list[int]] = [[] for _ in range(pp)]
    for stage, rank in enumerate(stage_ranks(schedule, pp, stages)):
        held[rank].append(stage)
    return tuple(tuple(h) for h in held)


Orders = tuple[tuple[Action, ...], ...]

_BUILT: Kept[Orders] = Kept(entries=128, weight=600_000)
"""Orders built, by (schedule, pp, virtual stages, microbatches), weighed by their actions. 600k is a choice: a
step simulated whole at 3,072 microbatches over pp 16 holds 295k, and after three such steps were kept (by count,
as lru_cache kept them) a full collection took 0.6 s."""


def build(schedule: str, pp: int, virtual_stages: int, microbatches: int, paired: bool = False) -> Orders:
    """Per-rank action lists for one step, the same object for the same arguments while it is kept (which
    twin/step/pipeline_steps.py keeps its own answers by). `paired`: Megatron-Core's combined 1F1B
    (`pairs_forward_backward`), whose co-scheduled forward and backward are marked `overlap`."""
    return _BUILT.get_or_make(
        (schedule, pp, virtual_stages, microbatches, paired),
        lambda: _build(schedule, pp, virtual_stages, microbatches, paired),
        lambda orders: sum(len(order) for order in orders),
    )


def pairs_forward_backward(schedule: str, pp: int) -> bool:
    """Whether Megatron-Core's combined 1F1B (overlap_moe_expert_parallel_comm) can pair this schedule's forwards
    and backwards: interleaved 1F1B, or 1F1B without pipelining (megatron/core/transformer/transformer_config.py
    asserts virtual_pipeline_model_parallel_size where pp > 1; pipeline_parallel/combined_1f1b.py)."""
    return schedule == "interleaved-1f1b" or (schedule == "1f1b" and pp == 1)


def _build(schedule: str, pp: int, v: int, m: int, paired: bool = False) -> Orders:
    if paired and not pairs_forward_backward(schedule, pp):
        raise ValueError(f"schedule {schedule!r} at pp={pp} has no combined 1F1B: use interleaved-1f1b or pp=1")
    rules = {
        "gpipe": lambda r: _gpipe(r, m),
        "1f1b": lambda r: _one_f_one_b(r, pp, m, paired),
        "interleaved-1f1b": lambda r: _interleaved(r, pp, v, m, paired),
        "zb-h1": lambda r: _zb_h1(r, pp, m),
        "zbv": lambda r: _zbv(r, pp, m),
        "dualpipe-v": lambda r: _DualPipeV(r, pp, m).actions(),
    }
    if schedule not in rules:
        raise ValueError(f"unknown schedule {schedule!r}")
    return tuple(tuple(rules[schedule](r)) for r in range(pp))


def _gpipe(r: int, m: int) -> list[Action]:
    """All forwards, then all backwards (Huang et al. 2019; torch's ScheduleGPipe runs B in microbatch order)."""
    return [Action("F", j, r) for j in range(m)] + [Action("B", j, r) for j in range(m)]


def _one_f_one_b(r: int, p: int, m: int, paired: bool = False) -> list[Action]:
    """PipeDream-Flush 1F1B: p-1-r warm-up forwards, then one forward and one backward in turn, then the rest.
    `paired` (pp 1 only): Megatron-Core's combined 1F1B without pipelining runs each backward with the next
    microbatch's forward (combined_1f1b_schedule_for_no_pipelining); the first forward and the last backward run
    alone."""
    warmup = min(p - 1 - r, m)
    order = [Action("F", j, r) for j in range(warmup)]
    for i in range(m - warmup):
        j = warmup + i
        order += [Action("F", j, r, paired and j > 0), Action("B", i, r, paired and i < m - 1)]
    return order + [Action("B", j, r) for j in range(m - warmup, m)]


def _interleaved(r: int, p: int, v: int, m: int, paired: bool = False) -> list[Action]:
    """Megatron-LM's interleaved 1F1B: virtual microbatch k runs chunk (k // p) % v; warm-up of
    2(p-1-r) + (v-1)p forwards (megatron/core/pipeline_parallel/schedules.py). `paired`: the steady phase's
    forward and backward run as one co-scheduled unit (Megatron-Core's combined 1F1B)."""
    total = m * v

    def mb(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def fwd(k: int, overlap: bool = False) -> Action:
        return Action("F", mb(k), ((k // p) % v) * p + r, overlap)

    def bwd(k: int, overlap: bool = False) -> Action:
        return Action("B", mb(k), (v - 1 - (k // p) % v) * p + r, overlap)

    warmup = min(2 * (p - 1 - r) + (v - 1) * p, total)
    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [fwd(warmup + k, paired), bwd(k, paired)]
    return order + [bwd(k) for k in range(total - warmup, total)]


def _zb_h1(r: int, p: int, m: int) -> list[Action]:
    """ZB-H1: 1F1B's order with B split from W; rank r defers the W of its first r backwards, then runs the
    oldest pending W after each backward; what is still pending runs at the end."""
    order: list[Action] = []
    pending: list[Action] = []
    for a in _one_f_one_b(r, p, m):
        order.append(a)
        if a.kind == "B":
            pending.append(Action("W", a.microbatch, r))
            if a.microbatch >= r:
                order.append(pending.pop(0))
    return order + pending


def _zbv(r: int, p: int, m: int) -> list[Action]:
    """ZB-V on ranks holding chunk 0 (stage r) and chunk 1 (stage 2p-1-r): warm-up of 2(p-r)-1 forwards of chunk
    0, r pairs of chunk-1 and chunk-0 forwards, then p-r rounds of a chunk-1 forward with its B and W; a steady
    phase of (F0, B0, W0, F1, B1, W1) until every forward has run; a cool-down of r (B0, B1) pairs and p-r
    (B0, W0) pairs; the Ws of chunk 1, then chunk 0, left over. The pattern is laid out for at least 2p-1
    microbatches; with fewer, the actions of microbatches that do not exist are dropped (as torch does)."""
    n = max(2 * p - 1, m)
    c0, c1 = r, 2 * p - 1 - r
    count = {(k, c): 0 for k in "FBW" for c in (c0, c1)}
    order: list[Action] = []

    def run(kind: Kind, stage: int) -> None:
        order.append(Action(kind, count[(kind, stage)], stage))
        count[(kind, stage)] += 1

    for _ in range(2 * (p - r) - 1):
        run("F", c0)
    for _ in range(r):
        run("F", c1)
        run("F", c0)
    for _ in range(p - r):
        run("F", c1)
        run("B", c1)
        run("W", c1)
    while count[("F", c1)] < count[("F", c0)] or count[("F", c0)] < n:
        if count[("F", c0)] < n:
            run("F", c0)
        run("B", c0)
        run("W", c0)
        run("F", c1)
        run("B", c1)
        run("W", c1)
    for _ in range(r):
        run("B", c0)
        run("B", c1)
    for _ in range(p - r):
        run("B", c0)
        run("W", c0)
    while count[("W", c1)] < count[("B", c1)]:
        run("W", c1)
    while count[("W", c0)] < count[("B", c0)]:
        run("W", c0)
    return [a for a in order if a.microbatch < m]


class _DualPipeV:
    """DualPipe-V on one rank (chunk 0 = stage r, chunk 1 = stage 2p-1-r), in DualPipe's eight phases:
    1 forwards of chunk 0; 2 forward pairs of both chunks; 3 chunk-1 B, a pending W, a chunk-1 F (zero bubble);
    4 the main phase of overlapped pairs (F0 with a full B1, F1 with a full B0); 5 a full B1 and an overlapped
    F1/B0; 6 full backwards of both chunks, the second half split into B and a deferred W (from the middle on,
    chunk 1 first on odd ranks); 7 a pending W and a chunk-0 backward; 8 the pending Ws."""

    def __init__(self, r: int, p: int, m: int) -> None:
        self.r, self.p, self.m = r, p, m
        self.c0, self.c1 = r, 2 * p - 1 - r
        self.next: dict[tuple[str, int], int] = {}
        self.pending_w: list[Action] = []
        self.order: list[Action] = []

    def _take(self, kind: str, stage: int) -> int:
        j = self.next.get((kind, stage), 0)
        self.next[(kind, stage)] = j + 1
        return j

    def forward(self, stage: int, overlap: bool = False) -> None:
        self.order.append(Action("F", self._take("F", stage), stage, overlap))

    def backward(self, stage: int, full: bool, overlap: bool = False) -> None:
        j = self._take("B", stage)
        self.order.append(Action("B", j, stage, overlap))
        if full:
            self.order.append(Action("W", j, stage, overlap))
        else:
            self.pending_w.append(Action("W", j, stage))

    def weight(self) -> None:
        if self.pending_w:
            self.order.append(self.pending_w.pop(0))

    def pair(self, forward: int, backward: int) -> None:
        self.forward(forward, overlap=True)
        self.backward(backward, full=True, overlap=True)

    def actions(self) -> list[Action]:
        r, p, m, c0, c1 = self.r, self.p, self.m, self.c0, self.c1
        for _ in range(2 * (p - r - 1)):
            self.forward(c0)
        for _ in range(r + 1):
            self.forward(c0)
            self.forward(c1)
        for _ in range(p - r - 1):
            self.backward(c1, full=False)
            self.weight()
            self.forward(c1)
        for i in range(m - 2 * p + r + 1):
            if i == 0 and r == p - 1:  # the last rank does not overlap its first pair: a smaller bubble
                self.forward(c0)
                self.backward(c1, full=True)
            else:
                self.pair(c0, c1)
            self.pair(c1, c0)
        for _ in range(p - r - 1):
            self.backward(c1, full=True)
            self.pair(c1, c0)
        split = False
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            self.backward(c1, full=not split)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            self.backward(c0, full=not split)
        for _ in range(p - r - 1):
            self.weight()
            self.backward(c0, full=not split)
        for _ in range(r + 1):
            self.weight()
        return self.order


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


GROWING = frozenset({"gpipe"})
"""Schedules whose in-flight activations grow with the microbatches (all forwards before any backward)."""


def peak_live_per_rank(
    schedule: str, pp: int, v: int, m: int, weight: dict[int, float], kept_for_w: float = 0.0
) -> list[float]:
    """`peak_live` of every pipeline rank's order for m microbatches, without building an order of m where a
    shorter one tells: the other schedules hold at most what their warm-up (and, for the zero-bubble ones, the
    weight gradients they hold back) leaves in flight, which four pipeline depths of microbatches reach, and GPipe
    holds all m, a multiple of what it holds for fewer (tests/test_steady.py holds both equal to the full
    order's)."""
    short = 4 * pp
    scale = m / short if m > short and schedule in GROWING else 1.0
    peaks = _peaks(schedule, pp, v, min(m, short), tuple(weight.items()), kept_for_w)
    return [peak * scale for peak in peaks]


@lru_cache(maxsize=256)
def _peaks(
    schedule: str, pp: int, v: int, m: int, weight: tuple[tuple[int, float], ...], kept_for_w: float
) -> tuple[float, ...]:
    """`peak_live` of each rank's order, kept: a search asks it of the same schedule and stages again and again,
    and at pp 64 walking the orders costs 20 ms."""
    return tuple(peak_live(order, dict(weight), kept_for_w) for order in build(schedule, pp, v, m))
