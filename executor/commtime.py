"""Exposed communication per mesh axis: the seconds a step's thread spends blocked in collectives, charged to the
axis whose process group carried them, and to the compute phase that was running.

What is timed, and where:
- Our own collectives (context-parallel attention, the ZeRO-0 gradient all-reduce) open a `span(axis)` around
  their blocking call: they know their axis, which matters where the replica group is the cp group (dp = 1).
- Tensor parallelism: DTensor's redistributes call `torch.distributed._functional_collectives` (`funcol`)
  `all_reduce` / `all_gather_single` / `reduce_scatter_single`, which issue the collective and return an
  `AsyncCollectiveTensor` that blocks in `funcol.wait_tensor` at first use — or at once, in `redistribute`. Both
  the issue and the wait are timed; a wait finds its axis through the storage of the tensor it waits on.
- FSDP2 (ZeRO 1-3) calls `dist.all_gather_single` and `dist.reduce_scatter_single` (`all_gather_into_tensor` /
  `reduce_scatter_tensor` in older releases, `all_reduce` for HSDP); they block unless `async_op`, in which case
  the returned `Work` is waited later (the pipeline runtime's UNSHARD), and that `Work.wait()` is timed.
- Pipeline parallelism: the schedules post point-to-point transfers in `schedules._batch_p2p` and wait on the
  returned works (`_wait_batch_p2p`, `Work.wait()`).

None of these has a public hook: c10d's flight recorder and the profiler record collectives but do not hand the
running step a blocked interval, and a TorchDispatchMode would sit on every aten op. So, for the duration of a step
only (`measuring()`), the module attributes those callers look up at call time are swapped for timing wrappers,
and `Work.wait` on the c10d class. The wrappers call the originals with the same arguments and return their
results untouched, so the numerics cannot change. A wrapper that runs inside another (a sync collective's own
wait) does not time again. Inside `torch.compile`d regions the wrappers step aside; that traffic stays in compute.

Pipeline transfers versus bubble. A blocked receive is transfer only after the peer has posted its send, which this
rank cannot observe. The rule: at start-up each rank ping-pongs its pipeline neighbours at two message sizes and
fits a one-way time t(n) = latency + n · s_per_byte (`ping_link`). Each batch of sends and receives a schedule posts
gets the budget t(bytes of the batch); the time spent posting it and waiting on its works counts as comm_pp up to
that budget, and the rest is waiting for a peer that had not yet produced — bubble. Sends get the same cap, since
gloo and NCCL sends may also block until the receiver is ready. This is the twin's rule (twin/step/pipeline.py: waiting
is pipeline communication while the message is on the wire, bubble otherwise) with the wire time estimated. It
undercounts transfers slowed by contention beyond what the start-up ping saw, and counts a wait that is really
for the peer as transfer up to one message time.

On CUDA the host does not block in these calls (NCCL runs on its own streams), so what this measures there is
launch cost and the comm stays in forward/backward; GPU-side attribution would need CUDA events on the
collective streams.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.pipelining.schedules as schedules
from torch.distributed.device_mesh import DeviceMesh

AXES = ("tp", "cp", "ep", "pp", "dp")
# Positional index of `group` in each wrapped function's signature (torch 2.13), counting the tensor arguments.
FUNCOL_GROUP_ARG = {"all_reduce": 2, "all_gather_single": 2, "reduce_scatter_single": 3}
DIST_GROUP_ARG = {
    "all_gather_single": 2,
    "reduce_scatter_single": 3,
    "all_gather_into_tensor": 2,
    "reduce_scatter_tensor": 3,
    "all_reduce": 2,
}
Budget = list[float]  # seconds of a p2p batch still countable as transfer; a list so the batch's works share it


@dataclass(frozen=True)
class LinkModel:
    """One-way point-to-point time t(n) = latency_s + n · s_per_byte; the default counts any wait as transfer."""

    latency_s: float = math.inf
    s_per_byte: float = 0.0

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes * self.s_per_byte


@dataclass(frozen=True)
class CommTime:
    """One step's exposed communication in seconds, keyed by (axis, phase)."""

    seconds: Mapping[tuple[str, str], float]

    def axis(self, axis: str) -> float:
        return sum(s for (a, _), s in self.seconds.items() if a == axis)

    def during(self, phase: str) -> float:
        return sum(s for (_, p), s in self.seconds.items() if p == phase)


def group_name(group: Any) -> str | None:
    """The process-group name behind any form funcol and c10d accept; None for the default group or rank lists."""
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    if isinstance(group, str):
        return group
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return group[0].get_group(group[1]).group_name
    if isinstance(group, DeviceMesh) and group.ndim == 1:
        return group.get_group().group_name
    return None


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return kwargs.get(name, args[index] if len(args) > index else None)


class CommTimer:
    """Seconds of blocked communication since the last `reset()`, by axis and by the `phase` the caller sets:
    `forward` and `backward` (inside a compute chunk), `schedule` (between a pipeline schedule's chunks) or `post`
    (after the microbatches)."""

    def __init__(
        self, axes: Mapping[str, str] | None = None, replica: str | None = None, link: LinkModel | None = None
    ) -> None:
        self.axes = dict(axes or {})
        """Process-group name -> the mesh axis it spans."""
        self.replica = replica
        """Name of the group FSDP shards over and ZeRO 0 reduces on (dp, or dp·cp flattened); its traffic is dp."""
        self.link = link or LinkModel()
        self.phase = "forward"
        self._seconds: dict[tuple[str, str], float] = {}
        self._pending: dict[int, str] = {}  # storage address of an in-flight funcol result -> axis
        self._works: dict[int, tuple[dist.Work, str, Budget | None]] = {}  # id -> (work kept alive, axis, budget)
        self._depth = 0
        self._thread = threading.get_ident()

    def reset(self) -> CommTime:
        spent, self._seconds = CommTime(self._seconds), {}
        self._pending.clear()
        self._works.clear()
        return spent

    @contextlib.contextmanager
    def span(self, axis: str) -> Iterator[None]:
        """Time the blocking collective inside as `axis`."""
        if self._depth:
            yield
            return
        self._depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            self._add(axis, time.perf_counter() - start)

    def _add(self, axis: str, spent: float, budget: Budget | None = None) -> None:
        if budget is not None:
            spent = min(spent, max(0.0, budget[0]))
            budget[0] -= spent
        key = (axis, self.phase)
        self._seconds[key] = self._seconds.get(key, 0.0) + spent

    def _axis(self, group: Any, replica_first: bool) -> str | None:
        name = group_name(group)
        if name is None:
            return None
        if replica_first and name == self.replica:
            return "dp"
        return self.axes.get(name, "dp" if name == self.replica else None)

    def _off(self) -> bool:
        return bool(self._depth) or torch.compiler.is_compiling() or threading.get_ident() != self._thread

    def _timed(self, axis: str, call: Callable[[], Any], budget: Budget | None = None) -> Any:
        self._depth += 1
        start = time.perf_counter()
        try:
            return call()
        finally:
            self._depth -= 1
            self._add(axis, time.perf_counter() - start, budget)

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Swap the timing wrappers in for the duration of a step (see the module docstring); always restored."""
        if not self.axes and self.replica is None:  # one rank per axis: nothing to time, nothing to patch
            yield
            return
        patches: list[tuple[Any, str, Callable[..., Any]]] = [
            (funcol, name, self._funcol_issue(getattr(funcol, name), i)) for name, i in FUNCOL_GROUP_ARG.items()
        ]
        patches.append((funcol, "wait_tensor", self._funcol_wait(funcol.wait_tensor)))
        patches += [(dist, name, self._dist_call(getattr(dist, name), i)) for name, i in DIST_GROUP_ARG.items()]
        patches.append((schedules, "_batch_p2p", self._p2p_issue(schedules._batch_p2p)))
        work = dist.distributed_c10d.Work
        patches.append((work, "wait", self._work_wait(vars(work)["wait"])))
        originals = [(owner, name, vars(owner)[name]) for owner, name, _ in patches]
        try:
            for owner, name, wrapper in patches:
                setattr(owner, name, wrapper)
            yield
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)

    def _funcol_issue(self, fn: Callable[..., torch.Tensor], group_arg: int) -> Callable[..., torch.Tensor]:
        def issue(*args: Any, **kwargs: Any) -> torch.Tensor:
            axis = None if self._off() else self._axis(_arg(args, kwargs, group_arg, "group"), replica_first=False)
            if axis is None:
                return fn(*args, **kwargs)
            out = self._timed(axis, lambda: fn(*args, **kwargs))
            if isinstance(out, funcol.AsyncCollectiveTensor):  # waited later: remember whose it is
                self._pending[out.elem.untyped_storage().data_ptr()] = axis
            return out

        return issue

    def _funcol_wait(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        def wait(tensor: torch.Tensor) -> torch.Tensor:
            # Views of one result share its storage; the first wait blocks, later ones return at once.
            axis = None if self._off() else self._pending.pop(tensor.untyped_storage().data_ptr(), None)
            return fn(tensor) if axis is None else self._timed(axis, lambda: fn(tensor))

        return wait

    def _dist_call(self, fn: Callable[..., Any], group_arg: int) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            axis = None if self._off() else self._axis(_arg(args, kwargs, group_arg, "group"), replica_first=True)
            if axis is None:
                return fn(*args, **kwargs)
            out = self._timed(axis, lambda: fn(*args, **kwargs))
            if isinstance(out, dist.Work):  # async_op: the wait is where it blocks
                self._works[id(out)] = (out, axis, None)
            return out

        return call

    def _p2p_issue(self, fn: Callable[..., list[dist.Work]]) -> Callable[..., list[dist.Work]]:
        def issue(p2p_ops: list[dist.P2POp], desc: str | None = None) -> list[dist.Work]:
            axis = None if self._off() or not p2p_ops else self._axis(p2p_ops[0].group, replica_first=False)
            if axis is None:
                return fn(p2p_ops, desc)
            budget = [self.link.seconds(sum(op.tensor.nbytes for op in p2p_ops))]
            works: list[dist.Work] = self._timed(axis, lambda: fn(p2p_ops, desc), budget)
            for w in works:
                self._works[id(w)] = (w, axis, budget)
            return works

        return issue

    def _work_wait(self, fn: Callable[..., bool]) -> Callable[..., bool]:
        def wait(work: dist.Work, *args: Any, **kwargs: Any) -> bool:
            entry = None if self._off() else self._works.pop(id(work), None)
            if entry is None:
                return fn(work, *args, **kwargs)
            _, axis, budget = entry
            result: bool = self._timed(axis, lambda: fn(work, *args, **kwargs), budget)
            return result

        return wait


def ping_link(
    group: dist.ProcessGroup, nbytes: int, device: torch.device, sync: Callable[[], None], reps: int = 5
) -> LinkModel:
    """Fit this rank's one-way p2p time on `group` from ping-pongs with its chain neighbours (ranks r and r+1).

    Pairs (0,1), (2,3), ... then (1,2), (3,4), ... exchange `reps` round trips (after one to warm up) of 256 bytes
    and of `nbytes`; a one-way time is half the median round trip. Every pipeline group pings at once, much as they
    send during a step. Links are assumed alike, so the wrap-around link of looped schedules uses the same fit.
    """
    me, size = dist.get_rank(group), dist.get_world_size(group)
    sizes = (256, max(nbytes, 4096))
    one_way: dict[int, list[float]] = {n: [] for n in sizes}
    for parity in (0, 1):
        first = (me - parity) % 2 == 0
        peer = me + 1 if first else me - 1
        if not parity <= peer < size:
            continue
        for n in sizes:
            buf = torch.zeros(n // 4, dtype=torch.float32, device=device)
            trips = []
            for _ in range(reps + 1):
                start = time.perf_counter()
                for send in (first, not first):
                    if send:
                        dist.send(buf, group=group, group_dst=peer)
                    else:
                        dist.recv(buf, group=group, group_src=peer)
                sync()  # NCCL returns before the transfer is done
                trips.append(time.perf_counter() - start)
            one_way[n].append(statistics.median(trips[1:]) / 2)
    if not one_way[sizes[0]]:
        return LinkModel()
    small, large = (statistics.median(one_way[n]) for n in sizes)
    slope = max(0.0, (large - small) / (sizes[1] - sizes[0]))
    return LinkModel(latency_s=max(0.0, small - sizes[0] * slope), s_per_byte=slope)
