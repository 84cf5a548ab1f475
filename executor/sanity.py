"""Sanity checks on the training signal: non-finite values stop the run, spikes are flagged.

A spike is a value far above the recent past: more than `z` standard deviations above the mean of the last
`window` steps, and at least `min_ratio` times that mean (the ratio guards a flat window whose tiny deviation
would make any wobble look like a spike). PaLM (Chowdhery et al. 2022, §5.1) saw loss spikes ~20 times in a run;
OPT's logbook tracked gradient-norm spikes the same way, by eye against a running window.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field


class NonFiniteError(RuntimeError):
    """A NaN or infinite loss or gradient norm, naming the step and the first rank that saw it."""

    def __init__(self, what: str, step: int, rank: int, value: float) -> None:
        super().__init__(f"non-finite {what} ({value}) at step {step} on rank {rank}; the run stops here")
        self.what, self.step, self.rank, self.value = what, step, rank, value


@dataclass
class SpikeDetector:
    """Flags values that jump far above a running window of the previous ones."""

    window: int = 20
    z: float = 4.0
    min_ratio: float = 1.5
    min_history: int = 5
    history: deque[float] = field(default_factory=deque)

    def observe(self, value: float) -> dict[str, float] | None:
        """Add a value; return the spike's facts if it is one (then it is kept out of the window)."""
        if not math.isfinite(value):
            return None
        spike = None
        if len(self.history) >= self.min_history:
            mean = statistics.fmean(self.history)
            std = statistics.pstdev(self.history)
            if value > mean + self.z * std and value > self.min_ratio * mean:
                spike = {"value": value, "window_mean": mean, "window_std": std, "window": len(self.history)}
        if spike is None:
            self.history.append(value)
            if len(self.history) > self.window:
                self.history.popleft()
        return spike
