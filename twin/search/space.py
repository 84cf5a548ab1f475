"""The layouts a search considers: every way to lay a model out on a fleet within the user's GPU and batch ranges.

A *shape* fixes the parallel degrees, the micro-batch size, the schedule and its virtual stages, and the global
batch; a *candidate* adds what trades memory for time on that shape (sequence parallelism, recompute, ZeRO stage).
Shapes are enumerated with integer arithmetic only (the divisibility rules of plan/schema.py, restated so that
thousands of shapes cost milliseconds); every candidate is then built into a Plan by the loader, so what is
searched is exactly what `twin validate` accepts.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe", "zb-h1", "zbv", "dualpipe-v")
VIRTUAL_STAGES = (2, 3, 4, 6, 8)
"""Virtual stages tried for interleaved 1F1B (Megatron's usual choices); zbv and dualpipe-v take exactly 2."""
POWERS = (1, 2, 4, 8, 16, 32, 64, 128)
RECOMPUTE = ("none", "selective", "full")
"""In order of time: each recomputes more of the forward than the one before."""
ZERO = (0, 1, 2, 3)
"""In order of memory: each shards more of the training state than the one before."""


@dataclass(frozen=True)
class Space:
    """What the search may choose. Each tuple is the values allowed; `fixed` holds `section.field` values the user
    pinned (--fix), which replace the field's values here and are set on every candidate."""

    gpus: tuple[int, int]
    """Fewest and most GPUs a layout may use."""
    batch_sequences: tuple[int, int]
    """Fewest and most sequences per global batch."""
    tp: tuple[int, ...] = (1, 2, 4, 8)
    cp: tuple[int, ...] = (1, 2, 4, 8)
    pp: tuple[int, ...] = POWERS
    ep: tuple[int, ...] = POWERS
    expert_tp: tuple[int, ...] = (0, 1)
    """Expert tensor parallelism for MoE layouts with tp > 1: 0 leaves layout.expert_tp unset (ep inside dp, experts
    split as the stack splits them), 1 folds ep over tp · cp · dp with whole experts (Megatron-Core's
    expert_tensor_parallel_size 1)."""
    microbatch_size: tuple[int, ...] = (1, 2, 4)
    schedule: tuple[str, ...] = SCHEDULES
    virtual_stages: tuple[int, ...] = VIRTUAL_STAGES
    zero: tuple[int, ...] = ZERO
    recompute: tuple[str, ...] = RECOMPUTE
    sequence_parallel: tuple[bool, ...] = (True, False)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    gpu_counts: bool = False
    """Explore the GPU count: besides the most data-parallel replicas the range allows, halve them while the layout
    stays in the range (a range was given); otherwise only the most."""


@dataclass(frozen=True, order=True)
class Shape:
    """The parallel degrees, schedule and batch of one layout; what trades memory for time comes later."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    microbatch_size: int
    schedule: str
    virtual_stages: int
    global_batch: int
    expert_tp: int = 0
    """layout.expert_tp, 0 where unset (an int, so that shapes sort)."""

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def layout(self) -> dict[str, Any]:
        return {
            "dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep,
            "microbatch_size": self.microbatch_size, "schedule": self.schedule, "virtual_stages": self.virtual_stages,
        } | ({"expert_tp": self.expert_tp} if self.expert_tp else {})  # fmt: skip

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.microbatch_size)


@dataclass(frozen=True)
class Knobs:
    """What a candidate adds to its shape: the memory-for-time trades."""

    sequence_parallel: bool
    recompute: str
    zero: int

    def layout(self) -> dict[str, Any]:
        return {"sequence_parallel": self.sequence_parallel, "recompute": self.recompute, "zero": self.zero}


def restrict(space: Space) -> Space:
    """The space with each pinned `layout.FIELD` value as the only value of that axis."""
    pinned = {k.split(".", 1)[1]: v for k, v in space.fixed.items() if k.startswith("layout.")}
    axes = {name: (value,) for name, value in pinned.items() if name in Space.__dataclass_fields__}
    return Space(**{**space.__dict__, **axes}) if axes else space


def shapes(space: Space, model: Mapping[str, Any], edge_trim: int = 0) -> Iterator[Shape]:
    """Every shape of `space` that the plan rules allow for `model` (a plan's model section): tp divides the heads,
    the FFN widths and the vocabulary; cp splits the sequence into 2·cp chunks; the stages hold at least one layer
    each; ep divides the experts and dp (or, folded at expert_tp 1 where tp > 1, tp · cp · dp); the batch is a whole
    number of microbatches per replica, which the
    schedule accepts (`edge_trim` layers off the first and last stage allow two more stages: layout.edge_stage_trim).
    Per (tp, pp, cp, ep, micro-batch size, schedule): the most data-parallel replicas the GPU
    range allows with a batch in range, and the batch at both ends of the range it allows them."""
    heads, kv = model["heads"], model.get("kv_heads") or model["heads"]
    widths = [model["ffn_hidden"], model["vocab"]] + ([model["moe_ffn_hidden"]] if model.get("moe_ffn_hidden") else [])
    experts, layers, seq = model.get("experts") or 0, model["layers"] + 2 * edge_trim, model["seq_len"]
    lo_gpus, hi_gpus = space.gpus
    for tp, cp, pp in itertools.product(space.tp, space.cp, space.pp):
        if heads % tp or (kv % tp and tp % kv) or any(w % tp for w in widths) or seq % (2 * cp) or pp > layers:
            continue
        model_parallel = tp * cp * pp
        if model_parallel > hi_gpus:
            continue
        folds = [etp for etp in space.expert_tp if etp in (0, 1, tp)] if experts and tp > 1 else [0]
        for ep, etp in itertools.product(space.ep if experts else (1,), folds):
            if experts and experts % ep:
                continue
            for mbs, (schedule, v) in itertools.product(space.microbatch_size, _schedules(space, pp, layers)):
                yield from _batches(space, tp, pp, cp, ep, mbs, schedule, v, lo_gpus, hi_gpus, etp)


def _schedules(space: Space, pp: int, layers: int) -> Iterator[tuple[str, int]]:
    for schedule in space.schedule:
        if pp == 1 and schedule != "1f1b":
            continue  # one stage: every schedule runs the same forwards and backwards
        if schedule == "interleaved-1f1b":
            yield from ((schedule, v) for v in space.virtual_stages if v > 1 and pp * v <= layers)
        elif schedule in ("zbv", "dualpipe-v"):
            if 2 * pp <= layers:  # exactly two chunks per rank
                yield schedule, 2
        else:
            yield schedule, 1


def _batches(
    space: Space, tp: int, pp: int, cp: int, ep: int, mbs: int, schedule: str, v: int, lo: int, hi: int, etp: int = 0
) -> Iterator[Shape]:
    """The shapes of one (tp, pp, cp, ep, mbs, schedule): the largest dp in the GPU range that some batch in range
    fits, and the smallest and largest such batch."""
    lo_b, hi_b = space.batch_sequences
    step = pp if schedule == "interleaved-1f1b" else 1  # microbatches per replica a multiple of pp
    least = 2 * pp if schedule in ("zbv", "dualpipe-v") else 1
    model_parallel = tp * cp * pp
    folds_over = tp * cp // etp if etp else 1  # the ranks of a replica that ep spreads over besides dp

    def splits(dp: int) -> bool:
        return (dp * folds_over) % ep == 0

    # past hi_b // (mbs·step) replicas even one microbatch each is over the largest batch: start below that
    for dp in range(min(hi // model_parallel, hi_b // (mbs * step)), 0, -1):
        if dp * model_parallel < lo:
            return
        if not splits(dp):
            continue
        unit = dp * mbs * step  # the batch grows in these
        first = max(-(-lo_b // unit), -(-least // step)) * unit
        last = hi_b // unit * unit
        if first > last:
            continue
        batches = {first, last}
        if schedule == "zb-h1":  # its rounds of pp must be equal
            batches = {b for b in batches if (b // (dp * mbs)) % max(1, (b // (dp * mbs)) // pp) == 0}
        yield from (Shape(dp, tp, pp, cp, ep, mbs, schedule, v, b, etp) for b in sorted(batches))
        if not space.gpu_counts:
            return
        fewer = dp // 2
        while fewer > 0 and (not splits(fewer) or fewer * model_parallel > dp * model_parallel // 2):
            fewer -= 1
        if fewer < 1 or fewer * model_parallel < lo:
            return
        yield from _batches(space, tp, pp, cp, ep, mbs, schedule, v, lo, fewer * model_parallel, etp)
        return


def knobs(space: Space, tp: int) -> list[Knobs]:
    """The memory-for-time trades of a shape, fastest first within each recompute level."""
    sp_values = space.sequence_parallel if tp > 1 else (False,)
    return [Knobs(sp, r, z) for r in space.recompute for sp in sp_values for z in space.zero]


def plan_data(base: Mapping[str, Any], shape: Shape, knob: Knobs) -> dict[str, Any]:
    """The base plan's data with the shape and knobs set (stage splits follow the new pp; each candidate runs its
    microbatches as one schedule a step, since a base plan's Layout.schedule_runs divides its own batch, not theirs)."""
    dropped = ("stage_layers", "expert_tp", "schedule_runs")  # the shape says
    kept = {k: v for k, v in base["layout"].items() if k not in dropped}
    layout = kept | shape.layout() | knob.layout()
    return {**base, "layout": layout, "training": {**base["training"], "global_batch": shape.global_batch}}


def neutral(data: Mapping[str, Any]) -> dict[str, Any]:
    """The plan data on one GPU with one sequence: valid whatever layout and batch were given, for what does not
    depend on them (the model, the cluster, the stack)."""
    return {**data, "layout": {"dp": 1}, "training": {**data["training"], "global_batch": 1}}
