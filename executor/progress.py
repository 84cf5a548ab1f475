"""The live progress line rank 0 shows while a run trains (rich; plain final line when not on a terminal)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


class Progress:
    """`step 3/10 ━━━━ loss 5.41 · 1,234 tok/s · MFU 1.2%`, updated every step."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled, self.total = enabled, total
        self.console = Console(stderr=True)
        self.bar = RichProgress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
            disable=not enabled,
        )
        self.task = self.bar.add_task("", total=total)
        self.last, self.done = "", 0
        if enabled:
            self.bar.start()

    def update(self, step: int, loss: float, tokens_per_s: float, mfu: float) -> None:
        self.done = step + 1
        self.last = f"loss {loss:.4f} · {tokens_per_s:,.0f} tok/s · MFU {100 * mfu:.2f}%"
        self.bar.update(self.task, completed=step + 1, description=self.last)

    def close(self) -> None:
        if self.enabled:
            self.bar.stop()
            if not self.console.is_terminal and self.last:
                self.console.print(f"done: {self.done} of {self.total} steps, last {self.last}", highlight=False)
