"""What the step model keeps between predictions, bounded by what it holds: a schedule's orders and the steps worked
out from them (twin/step/schedules.py, twin/step/pipeline_steps.py) weigh up to hundreds of thousands of actions,
and every full collection of Python's cycle collector walks whatever is kept.

Hand-written: functools.lru_cache bounds entries, not their weight, and no dependency the project has does both.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class Kept(Generic[V]):
    """At most `entries` values weighing at most `weight` in all (by default only `entries` bounds them: each
    weighs 1; a single value heavier than `weight` is kept until the next arrives), the least recently asked for
    going first. Thread-safe: the dashboard predicts from several sessions' threads."""

    def __init__(self, entries: int, weight: float = math.inf) -> None:
        self.entries, self.weight = entries, weight
        self._values: dict[Hashable, tuple[V, int]] = {}
        self._held = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        """The value kept for `key`, now the most recently asked for, or None."""
        with self._lock:
            entry = self._values.pop(key, None)
            if entry is None:
                return None
            self._values[key] = entry
            return entry[0]

    def put(self, key: Hashable, value: V, weight: int = 1) -> V:
        """Keep `value`, then let the least recently asked for go while past either bound; returns `value`."""
        with self._lock:
            old = self._values.pop(key, None)
            self._held += weight - (old[1] if old else 0)
            self._values[key] = (value, weight)
            while len(self._values) > 1 and (len(self._values) > self.entries or self._held > self.weight):
                self._held -= self._values.pop(next(iter(self._values)))[1]
        return value

    def get_or_make(self, key: Hashable, make: Callable[[], V], weigh: Callable[[V], int]) -> V:
        """The value kept for `key`, else `make()`, kept at `weigh` of it."""
        value = self.get(key)
        if value is None:
            value = make()
            self.put(key, value, weigh(value))
        return value

    def __contains__(self, key: Hashable) -> bool:
        return key in self._values

    @property
    def held(self) -> int:
        """The weight kept in all."""
        return self._held
