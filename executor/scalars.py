"""Rank 0's step figures as TensorBoard scalars in `<run>/tensorboard/`, when the `tensorboard` package is
installed (`pip install -e '.[tensorboard]'`; `--no-tensorboard` turns it off): the job's loss, gradient norm,
learning rate, tokens/s, MFU, peak memory, step time and each phase's seconds, from the step record rank 0 writes.
Without the package nothing is written. Each step is flushed, as its record is: a crash loses nothing written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plan.records import StepRecord


class Scalars:
    """A TensorBoard SummaryWriter in `log_dir`, or nothing when not `enabled` or tensorboard is not installed."""

    def __init__(self, log_dir: Path, enabled: bool) -> None:
        self.writer: Any = None
        if not enabled:
            return
        try:  # imported here: tensorboard is an optional extra
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def add(self, record: StepRecord) -> None:
        """Write one step record's figures, tagged by field name (units as the record's fields have them)."""
        if self.writer is None:
            return
        figures = {f: getattr(record, f) for f in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "step_s")}
        figures["peak_memory_MB"] = record.peak_memory_MB
        figures |= {f"phase_s/{name}": s for name, s in record.phases.model_dump().items()}
        for tag, value in figures.items():
            if value is not None:
                self.writer.add_scalar(tag, value, record.step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
