"""One optimizer step of one pipeline replica, simulated in SimPy.

Each pipeline rank is a process that runs its schedule's actions in order, waiting for the activation (or the
gradient) its action needs. A cross-rank send holds the link between the two ranks in that direction for the
message's time, so sends queue when they contend. Data-parallel gradient buckets become ready as each stage's
final backward runs and queue on the rank's data-parallel link, overlapping the backward; what is left after the
rank's last computation is exposed. Time a rank spends waiting is pipeline communication while the message it
waits for is on the wire (or queued for it), and bubble otherwise. Every rank then joins the job-wide
gradient-norm all-reduce, a barrier: a rank done early waits there for the slowest (bubble) before its optimizer
step. (SimPy's "machine shop" pattern: processes for workers, resources for shared links; records collected in
lists, tables built after `env.run()`.)

Nothing but its own actions shares a GPU rank or the links it sends on, so a GPU rank's actions are timed by
arithmetic on its own clock, in an order where every message is sent before it is waited for (worked out once per
schedule, twin/step/pipeline_steps.py), a deep pipeline's a level of the dependency graph at a time with numpy
(pipeline_levels.py); SimPy then runs what contends: the gradient buckets on each rank's DP link, the barrier, the
optimizer (twin/step/pipeline_sim.py). A 1T model's PP32 step of 15k actions is a few hundred events. A CPU host's
ranks share its cores, so theirs run event by event (twin/step/pipeline_host.py); a rank woken from a wait there
may find every core busy and wait for one. tests/test_pipeline.py holds the GPU timing equal to the event-by-event
one on a host whose cores are never shared.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

from twin.step.pipeline_data import Columns, PipelineInput, PipelineResult
from twin.step.pipeline_host import HostPipelineSim
from twin.step.pipeline_levels import LevelTimer
from twin.step.pipeline_sim import PipelineSim


def _sim(inp: PipelineInput) -> PipelineSim:
    """The step's simulation: event by event on a CPU host, whose ranks share cores."""
    return PipelineSim(inp) if inp.host is None else HostPipelineSim(inp)


@contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Python's cycle collector paused while a step is simulated: the simulation allocates a few objects per event
    (hundreds of thousands at pp 128), which set the collector off again and again to walk them all for nothing —
    30% of a large step's time. What it would have found is collected once it resumes."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def simulate(inp: PipelineInput, resume: LevelTimer | None = None) -> PipelineResult:
    """Run one step of the pipeline and return its time, per-rank breakdown and timeline. `resume`: a longer
    step's level timer (`Watched.timer`) whose levels timed so far this step begins with, where it does."""
    with no_cycle_collection():
        sim = _sim(inp)
        sim.resume_from = resume
        sim.start()
        sim.run()
        return sim.result()


class Watched:
    """One step simulated a stretch of simulated time at a time, so that its caller can look at what has happened
    so far (`news`) and stop early (twin/step/steady.py stops a long step once it repeats)."""

    def __init__(self, inp: PipelineInput) -> None:
        self._sim = _sim(inp)
        self._sim.start()
        self._seen = (0, 0)

    def news(self) -> tuple[Columns, Columns]:
        """The actions and the message arrivals timed since the last call, as columns."""
        columns, arrivals, self._seen = self._sim.progress(self._seen)
        return columns, arrivals

    @property
    def timer(self) -> LevelTimer | None:
        """The step's level timer, where it is timed a level at a time."""
        return self._sim.timer

    @property
    def events(self) -> int:
        """Events scheduled so far."""
        return self._sim.events

    def advance(self, seconds: float) -> bool:
        """Simulate `seconds` more; False once there is nothing more to look at."""
        with no_cycle_collection():
            return self._sim.advance(seconds)

    def finish(self) -> PipelineResult:
        """Simulate the rest of the step and return it."""
        with no_cycle_collection():
            self._sim.run()
            return self._sim.result()
