"""Fault injection into the executor's own run, and the bookkeeping of each fault's detection and recovery.

A fault (`plan.reliability.faults`, or `--inject KIND@STEP[:RANK]`) strikes once per run, even across restarts:
the striking rank writes `<run>/faults/<kind>@<step>:<rank>.json` and a `fault` event first, and a fault with a
marker is spent. What each kind does to its rank:

- crash: exits at the start of the step (no goodbye; its gloo peers see the connection drop);
- hang: stops its heartbeat and sleeps forever (its peers block in a collective until the watchdog names it);
- slow: computes `slowdown`x slower for `duration_steps` steps (a forward hook sleeps (k-1)·3 x each forward,
  backward costing about twice the forward), which rank 0's straggler check flags;
- bitflip: flips the top mantissa bit of one weight after the optimizer step (a silent corruption no loss would
  show soon), which the cross-replica checksum finds in the same step;
- ckpt-crash / disk-full: the first checkpoint at or after the step is written by a writer that dies after this
  rank's shards, or fails with ENOSPC.

Rank 0 updates the markers as it detects (stragglers, checksums, failed writes; the watchdog records crashes and
hangs itself) and records `recovered` with the time since the fault and the steps lost: restart kinds after the
first step of the next attempt, bitflip after the first step after the rollback, slow once it ends, disk-full at
the next committed checkpoint.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from executor.engine import Trainer
from executor.health import Health
from executor.parallel import LayoutError
from plan.reliability import FaultSpec
from plan.schema import Plan

EXIT_INJECTED = 17
RESTART_KINDS = ("crash", "hang", "ckpt-crash")
WRITE_KINDS = ("ckpt-crash", "disk-full")
MANTISSA_TOP_BIT = 1 << 22  # of a float32: changes the value by up to half, keeps it finite


class FaultInjector:
    """Strikes this rank's faults at their steps; on rank 0, records every fault's detection and recovery."""

    def __init__(self, plan: Plan, rank: int, run_dir: Path, event: Callable[..., None], health: Health) -> None:
        self.faults, self.rank, self.event, self.health = plan.reliability.faults, rank, event, health
        self.dir = run_dir / "faults"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.attempt = health.attempt
        self.resumed_from = 0
        self.hooks: list[Any] = []

    def _marker(self, fault: FaultSpec) -> Path:
        return self.dir / f"{fault.label()}.json"

    def _read(self, fault: FaultSpec) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = json.loads(self._marker(fault).read_text())
            return result
        except (OSError, ValueError):
            return None

    def _write(self, fault: FaultSpec, facts: dict[str, Any]) -> None:
        tmp = self._marker(fault).with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(facts))
        tmp.replace(self._marker(fault))

    def _mine(self, kind: str, step: int) -> FaultSpec | None:
        for f in self.faults:
            if f.kind == kind and f.rank == self.rank and f.step == step and not self._marker(f).exists():
                return f
        return None

    def _strike(self, fault: FaultSpec, step: int) -> None:
        facts = {"time_unix": time.time(), "attempt": self.attempt, "step": step, "detected_unix": None}
        self._write(fault, facts)
        self.event("fault", step, {"kind": fault.kind, "label": fault.label()}, rank=self.rank)

    def before_step(self, step: int, trainer: Trainer) -> None:
        if fault := self._mine("crash", step):
            self._strike(fault, step)
            self.crash()
        if fault := self._mine("hang", step):
            self._strike(fault, step)
            self.health.pause()
            while True:
                time.sleep(3600)
        if fault := self._mine("slow", step):
            self._strike(fault, step)
            self.hooks = [h for part in trainer.parts for h in _slow_down(part, fault.slowdown)]
        for fault in self.faults:
            if fault.kind == "slow" and fault.rank == self.rank and step == fault.step + fault.duration_steps:
                for handle in self.hooks:
                    handle.remove()
                self.hooks = []

    def after_step(self, step: int, trainer: Trainer) -> None:
        if fault := self._mine("bitflip", step):
            self._strike(fault, step)
            flip_bit(trainer.params)

    def writer_fault(self, step: int) -> str | None:
        """The write fault, if any, that strikes this rank's checkpoint of `step`."""
        for f in self.faults:
            if f.kind in WRITE_KINDS and f.rank == self.rank and f.step <= step and not self._marker(f).exists():
                self._strike(f, step)
                return f.kind
        return None

    def crash(self) -> NoReturn:
        os._exit(EXIT_INJECTED)

    # Rank 0's bookkeeping: detection and recovery of every rank's faults.

    def _struck(self, kind: str) -> list[tuple[FaultSpec, dict[str, Any]]]:
        out = []
        for f in self.faults:
            facts = self._read(f) if f.kind == kind else None
            if facts is not None and not facts.get("recovered"):
                out.append((f, facts))
        return out

    def detected(self, kind: str, step: int, detail: dict[str, Any], ranks: tuple[int, ...] | None = None) -> None:
        """Rank 0 found a fault of `kind` (on one of `ranks`, if given); record its detection time."""
        for f, facts in self._struck(kind):
            if facts["detected_unix"] is None and (ranks is None or f.rank in ranks):
                facts["detected_unix"] = time.time()
                self._write(f, facts)
                detect_s = facts["detected_unix"] - facts["time_unix"]
                self.event("detected", step, {"kind": kind, "label": f.label(), **detail}, f.rank, duration_s=detect_s)

    def _recover(self, f: FaultSpec, facts: dict[str, Any], step: int, steps_lost: int) -> None:
        facts["recovered"] = True
        self._write(f, facts)
        detail = {"kind": f.kind, "label": f.label(), "steps_lost": steps_lost}
        self.event("recovered", step, detail, f.rank, duration_s=time.time() - facts["time_unix"])

    def settle(self, step: int) -> None:
        """After step `step` completes on rank 0: record the faults it has recovered from."""
        for kind in RESTART_KINDS:
            for f, facts in self._struck(kind):
                if facts["attempt"] < self.attempt:
                    done = facts["step"] + (kind == "ckpt-crash")  # a write fault strikes after its step completed
                    self._recover(f, facts, step, done - self.resumed_from)
        for f, facts in self._struck("bitflip"):
            if facts.get("rolled_back"):
                self._recover(f, facts, step, facts["step"] + 1 - self.resumed_from)
        for f, facts in self._struck("slow"):
            if facts["detected_unix"] is not None and step + 1 >= f.step + f.duration_steps:
                self._recover(f, facts, step, 0)

    def rolled_back(self, to_step: int) -> None:
        self.resumed_from = to_step
        for f, facts in self._struck("bitflip"):
            facts["rolled_back"] = True
            self._write(f, facts)

    def checkpoint_failed(self, step: int, reason: str) -> None:
        self.detected("disk-full", step, {"reason": reason})

    def checkpoint_committed(self, step: int) -> None:
        for f, facts in self._struck("disk-full"):
            if facts["detected_unix"] is not None:
                self._recover(f, facts, step, 0)


def _slow_down(module: nn.Module, slowdown: float) -> list[Any]:
    """Hooks that make `module`'s forward (and so, roughly, its backward) `slowdown` times slower."""
    start: list[float] = [0.0]

    def before(*_: Any) -> None:
        start[0] = time.perf_counter()

    def after(*_: Any) -> None:
        time.sleep((slowdown - 1) * 3 * (time.perf_counter() - start[0]))

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def flip_bit(params: list[nn.Parameter]) -> None:
    """Flip one bit of the first element of the first matrix this rank holds."""
    target = _local(next(p for p in params if p.ndim >= 2)).view(-1)
    bits = target[:1].view(torch.int32)  # a view of the parameter's own storage
    bits ^= MANTISSA_TOP_BIT


@torch.no_grad()
def weight_checksum(params: list[nn.Parameter]) -> int:
    """Sum of the bytes of this rank's weights: any single flipped bit changes it."""
    return sum(int(_local(p).detach().contiguous().view(torch.uint8).sum(dtype=torch.int64)) for p in params)


def replicas_disagree(params: list[nn.Parameter], replicas: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether any replica group of the job holds weights that differ from its other copies (a collective)."""
    flag = torch.zeros(1, dtype=torch.int64, device=device)
    if replicas is not None:
        mine = torch.tensor([weight_checksum(params)], dtype=torch.int64, device=device)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(replicas))]
        dist.all_gather(every, mine, group=replicas)
        flag[0] = int(len({int(t.item()) for t in every}) > 1)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every stage and tp rank rolls back together
    return bool(flag.item())


def with_injected(plan: Plan, inject: list[str]) -> Plan:
    """The plan with `--inject` faults added to its reliability section (validated like the plan's own)."""
    if not inject:
        return plan
    faults = (*plan.reliability.faults, *(FaultSpec.parse(text) for text in inject))
    data = plan.model_dump()
    data["reliability"]["faults"] = [f.model_dump() for f in faults]
    return Plan.model_validate(data)


def check_faults(plan: Plan) -> None:
    """Reject fault injections this layout cannot detect, before any process group exists."""
    lay = plan.layout
    if any(f.kind == "bitflip" for f in plan.reliability.faults) and (lay.dp * lay.cp == 1 or lay.zero > 0):
        raise LayoutError(
            f"reliability.faults: bitflip is found by cross-replica weight checksums, which need whole replicas: "
            f"dp·cp > 1 (has {lay.dp * lay.cp}) and zero 0 (has {lay.zero}); change the layout or drop the bitflip"
        )
