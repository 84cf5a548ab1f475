"""Sharded checkpoints of a rank's training state with torch.distributed.checkpoint (DCP), and resume from them.

What is saved: the model parts and the optimizer (DCP, each rank its shards; replicated tensors once), each
rank's RNG state, the data cursor and the step. The LR schedule is a pure function of the step
(`engine.learning_rate`), so the step restores it. Names are the model's own fully qualified names, whose layer
indices are global, so a checkpoint loads under another dp degree, tp degree or pipeline split: DCP reshards
DTensor shards on load.

`sync` stalls training for the whole write. `async` (and `in-memory`, which the executor treats as async writes
to storage) stalls only while DCP stages the state into host memory (its default stager copies on CPU as well as
GPU), then writes from a background thread over a process group of its own, so its collectives never interleave
with training's; rank 0 commits the checkpoint once the write has finished (see `ckpt_store`). One write is in
flight at a time.
"""

from __future__ import annotations

import errno
import os
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from executor.ckpt_store import (
    CheckpointError,
    CheckpointInfo,
    clean_staging,
    commit,
    committed,
    final_dir,
    latest_good,
    prune,
    read_info,
    staging_dir,
)
from executor.data import DataError, Sampler, load_cursor, save_cursor
from executor.engine import Trainer
from plan.schema import Plan

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # FQN-keyed optimizer state: reshardable


class CheckpointListener(Protocol):
    """Who hears of a checkpoint's fate (the fault injector, to time disk-full's detection and recovery)."""

    def checkpoint_failed(self, step: int, reason: str) -> None: ...
    def checkpoint_committed(self, step: int) -> None: ...


class FaultyWriter(FileSystemWriter):
    """DCP's file-system writer, which can fail as a full disk does or die halfway, as a crashing rank does."""

    def __init__(self, path: Path, fault: str | None, crash: Callable[[], None]) -> None:
        super().__init__(path)
        self.fault, self.crash, self.where = fault, crash, path

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.fault == "disk-full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.where))
        written = super().write_data(plan, planner)
        if self.fault == "ckpt-crash":
            written.wait()  # this rank's shards are on disk, the checkpoint's metadata and manifest are not
            self.crash()
        return written


class TrainState:
    """The model parts' and optimizer's DCP state dict under the model's own names, whatever the rank holds."""

    def __init__(self, trainer: Trainer) -> None:
        self.optimizer = trainer.optimizer
        # Several parts (virtual pipeline stages) go into one ModuleList, whose names gain a part-index prefix;
        # the layers' own names are global and unique, so the prefix is dropped on the way out and put back in.
        self.module: nn.Module = trainer.parts[0] if len(trainer.parts) == 1 else nn.ModuleList(trainer.parts)
        self.multi = len(trainer.parts) > 1
        model_sd, _ = get_state_dict(self.module, self.optimizer, options=OPTIONS)
        self.full_name = {_strip(k): k for k in model_sd}

    def get(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=OPTIONS)
        if self.multi:
            model_sd = {_strip(k): v for k, v in model_sd.items()}
            optim_sd = {_strip_optim(k): v for k, v in optim_sd.items()}
        return {"model": model_sd, "optim": optim_sd}

    def set(self, state: dict[str, Any]) -> None:
        model_sd, optim_sd = state["model"], state["optim"]
        if self.multi:
            model_sd = {self.full_name[k]: v for k, v in model_sd.items()}
            optim_sd = {self._unstrip_optim(k): v for k, v in optim_sd.items()}
        set_state_dict(
            self.module, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=OPTIONS
        )

    def _unstrip_optim(self, key: str) -> str:
        head, rest = key.split(".", 1)  # state.<fqn>.<leaf> or param_groups.<fqn>.<leaf>
        fqn, leaf = rest.rsplit(".", 1)
        return f"{head}.{self.full_name[fqn]}.{leaf}"


def _strip(key: str) -> str:
    return re.sub(r"^\d+\.", "", key)


def _strip_optim(key: str) -> str:
    return re.sub(r"^(state|param_groups)\.\d+\.", r"\1.", key)


def _reason(exc: BaseException) -> str:
    """The first underlying cause of a DCP failure, in one line."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, failure = sorted(exc.failures.items())[0]
        inner = failure[0] if isinstance(failure, tuple) else failure  # DCP wraps (exception, traceback)
        return f"rank {rank}: {_reason(inner) if isinstance(inner, BaseException) else inner}"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}{f' ({exc.filename})' if exc.filename else ''}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


@dataclass
class _Pending:
    future: Future[Any]
    staging: Path
    step: int
    stall_s: float
    started: float


class Checkpointer:
    """Takes checkpoints when the plan's reliability section says, and loads them."""

    def __init__(
        self,
        plan: Plan,
        trainer: Trainer,
        sampler: Sampler,
        root: Path,
        event: Callable[..., None],
        writer_fault: Callable[[int], str | None],
        crash: Callable[[], None],
        listener: CheckpointListener,
    ) -> None:
        rel = plan.reliability
        self.plan, self.trainer, self.sampler, self.root, self.event = plan, trainer, sampler, root, event
        self.writer_fault, self.crash, self.listener = writer_fault, crash, listener
        self.rank, self.device = dist.get_rank(), trainer.device
        self.kind = "sync" if rel.checkpoint == "sync" else "async"
        self.every_steps = rel.checkpoint_every_steps
        interval = rel.checkpoint_interval_min
        self.every_s = None if interval == "auto" else float(interval) * 60  # auto is the twin's Young/Daly choice
        self.enabled = bool(self.every_steps or self.every_s)
        self.group = dist.new_group(backend="gloo") if self.kind == "async" else None
        self.state = TrainState(trainer)
        self.pending: _Pending | None = None
        self.last_save = time.monotonic()

    def due(self, step: int, last: bool) -> bool:
        """Whether to checkpoint after `step`: every N steps, every M minutes (rank 0's clock), and at the end."""
        if not self.enabled:
            return False
        if last or (self.every_steps and (step + 1) % self.every_steps == 0):
            return True
        if self.every_s is None:
            return False
        flag = torch.tensor([time.monotonic() - self.last_save >= self.every_s], dtype=torch.int32, device=self.device)
        dist.broadcast(flag, 0)  # every rank must agree, and clocks differ
        return bool(flag.item())

    def save(self, next_step: int) -> float:
        """Checkpoint the state after step `next_step - 1`; returns the training stall (seconds)."""
        start = time.perf_counter()
        self.wait()
        staging = staging_dir(self.root, next_step)
        staging.mkdir(parents=True, exist_ok=True)
        self._write_side_files(staging, next_step)
        writer = FaultyWriter(staging, self.writer_fault(next_step - 1), self.crash)
        try:
            if self.kind == "sync":
                dcp.save(self.state.get(), storage_writer=writer)
                self._finish(staging, next_step, time.perf_counter() - start, start)
            else:
                response = dcp.async_save(self.state.get(), storage_writer=writer, process_group=self.group)
                future = cast("Future[Any]", getattr(response, "upload_completion", response))
                self.pending = _Pending(future, staging, next_step, time.perf_counter() - start, start)
        except (CheckpointException, OSError) as exc:
            self._failed(staging, next_step, exc)
        self.last_save = time.monotonic()
        return time.perf_counter() - start

    def poll(self) -> None:
        """Commit a finished background write."""
        if self.pending is not None and self.pending.future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the background write, if any, has finished, and commit it."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        exc = pending.future.exception()
        if exc is not None:
            self._failed(pending.staging, pending.step, exc)
        else:
            self._finish(pending.staging, pending.step, pending.stall_s, pending.started)

    def _write_side_files(self, staging: Path, next_step: int) -> None:
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        (staging / "rng").mkdir(exist_ok=True)
        torch.save(rng, staging / "rng" / f"rank_{self.rank:05d}.pt")
        if self.rank == 0:
            save_cursor(self.sampler.cursor(next_step), staging / "data_cursor.json")

    def _finish(self, staging: Path, step: int, stall_s: float, started: float) -> None:
        if self.rank != 0:
            return
        lay = self.plan.layout
        layout = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "zero": lay.zero}
        facts = {"step": step, "kind": self.kind, "layout": layout, "world_size": dist.get_world_size()}
        path = commit(staging, final_dir(self.root, step), facts)
        prune(self.root, self.plan.reliability.keep_checkpoints)
        detail = {"path": str(path), "kind": self.kind, "write_s": time.perf_counter() - started}
        self.event("checkpoint", step, detail, duration_s=stall_s)
        self.listener.checkpoint_committed(step)

    def _failed(self, staging: Path, step: int, exc: BaseException) -> None:
        if self.rank != 0:
            return
        reason = _reason(exc)
        clean_staging(self.root)
        last = next((str(p) for p in committed(self.root)[:1]), "none")
        print(
            f"error: checkpoint of step {step} failed ({reason}); nothing of it was committed and the last "
            f"checkpoint ({last}) is intact; free space under {self.root} or pass --checkpoint-dir elsewhere",
            file=sys.stderr,
            flush=True,
        )
        self.event("checkpoint-failed", step, {"reason": reason, "last_good": last})
        self.listener.checkpoint_failed(step, reason)

    def resume(self, explicit: Path | None = None) -> CheckpointInfo | None:
        """Load `explicit`, or else the latest good checkpoint under the root (none: start afresh)."""
        self.wait()
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                clean_staging(self.root)
                box[0] = read_info(explicit) if explicit else latest_good(self.root)
            except CheckpointError as exc:
                box[0] = exc
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], CheckpointError):
            raise box[0]
        if box[0] is not None:
            self.load(box[0])
        return box[0]

    def load(self, info: CheckpointInfo) -> None:
        """Load a checkpoint into this rank's model parts, optimizer and RNG; check the data cursor's corpus."""
        state = self.state.get()
        dcp.load(state, checkpoint_id=info.path)
        self.state.set(state)
        rng = info.path / "rng" / f"rank_{self.rank:05d}.pt"
        if info.manifest.get("world_size") == dist.get_world_size() and rng.exists():
            saved = torch.load(rng, weights_only=True)
            torch.set_rng_state(saved["cpu"])
            if "cuda" in saved and self.device.type == "cuda":
                torch.cuda.set_rng_state(saved["cuda"], self.device)
        cursor = load_cursor(info.path / "data_cursor.json")
        if cursor.fingerprint != self.sampler.corpus.fingerprint():
            raise DataError(
                f"checkpoint {info.path} was trained on corpus {cursor.fingerprint}, but the data given is "
                f"{self.sampler.corpus.fingerprint()}; pass the same --data as the run that wrote it"
            )
