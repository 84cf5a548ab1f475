"""The twin's predicted step and a run's measured one in one Chrome / Perfetto trace (`twin trace`).

Process 0 is the prediction (`chrome_trace`, its events unchanged), process 1 the step the executor profiled
(`--profile-step N`), on the same tracks with the same names: for pipeline rank p, tid 2p (compute) and tid 2p+1
(communication). Pipeline rank p's measured track is the global rank at pp=p, dp=cp=tp=0, found by its coordinates
in `<run>/profile/ranks.json`. Both start at 0: each rank's measured events are shifted by the start of the
earliest one kept (the executor's `step N` span), as the prediction starts at the step's start.

What is kept of a rank's measured trace (a cpu-tiny step records 16,000-34,000 events a rank, 1,000-2,000 stay):

- complete events of CPU ops and user annotations (`record_function` spans) only; device kernels, flow arrows and
  the profiler's own markers are left out;
- communication, a name containing one of COMM_WORDS, goes to the comm track, each run of overlapping such events
  as one slice named after its longest member, from the first start to the last end: gloo and NCCL record a
  collective as a short c10d op plus an asynchronous span that outlives it, and the two do not nest;
- any other event goes to the compute track if it is at depth 0 or 1 on its own thread (the `step N` span and what
  runs directly inside it; depth counts the enclosing events that are not communication) and lasts at least
  MIN_EVENT_US; one that would cross the end of an event it starts in (ops of another thread) is left out, so that
  the track nests.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from plan.records import ProfileIndex, RecordError, read_json_file
from twin.step.trace import lane_names

Event = dict[str, Any]

COMM_WORDS = (
    *("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "all_to_all", "alltoall", "broadcast"),
    *("send", "recv", "nccl", "gloo", "c10d", "record_param_comms"),
)
MIN_EVENT_US = 10.0  # on cpu-tiny, ops under 10 µs are 2/3 of a step's top-level ops and 4-9% of its time
MAX_DEPTH = 1
MEASURED_CATEGORIES = ("cpu_op", "user_annotation")
PROFILE_FIX = "profile a step of the run first: `twin execute PLAN --profile-step N`"


def is_comm(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in COMM_WORDS)


def _by_start(events: Iterable[Event]) -> list[Event]:
    """Events by start, the longer first where two start together (an enclosing event before what it holds)."""
    return sorted(events, key=lambda e: (e["ts"], -e["dur"]))


def _depths(events: list[Event]) -> list[tuple[Event, int]]:
    """Each event of one thread with the number of events open at its start."""
    out: list[tuple[Event, int]] = []
    ends: list[float] = []  # ends of the open events, innermost last
    for ev in _by_start(events):
        while ends and ends[-1] <= ev["ts"]:
            ends.pop()
        out.append((ev, len(ends)))
        ends.append(ev["ts"] + ev["dur"])
    return out


def _nested(events: list[Event]) -> list[Event]:
    """The events that nest, leaving out each that would end after an event it starts in."""
    kept: list[Event] = []
    ends: list[float] = []
    for ev in _by_start(events):
        while ends and ends[-1] <= ev["ts"]:
            ends.pop()
        end = ev["ts"] + ev["dur"]
        if ends and end > ends[-1] + 1e-3:  # past the enclosing end by more than the trace's ns resolution
            continue
        kept.append(ev)
        ends.append(end)
    return kept


def _comm_runs(events: list[Event]) -> list[Event]:
    """Overlapping communication events as one slice each, named after the longest, with how many it holds."""
    runs: list[list[Event]] = []
    end = float("-inf")
    for ev in _by_start(events):
        if ev["ts"] >= end:
            runs.append([])
        runs[-1].append(ev)
        end = max(end, ev["ts"] + ev["dur"])
    out = []
    for run in runs:
        start, stop = run[0]["ts"], max(e["ts"] + e["dur"] for e in run)
        name = max(run, key=lambda e: e["dur"])["name"]
        out.append({"name": name, "cat": "communication", "ts": start, "dur": stop - start, "args": {"of": len(run)}})
    return out


def measured_events(trace: dict[str, Any], pp_rank: int) -> list[Event]:
    """One rank's measured step on pipeline rank `pp_rank`'s two tracks of process 1, starting at 0 (see above)."""
    raw = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in MEASURED_CATEGORIES]
    if not raw:
        return []
    base = min(float(e["ts"]) for e in raw)  # times from here on keep float64's ns resolution (µs since boot do not)
    threads: dict[tuple[Any, Any], list[Event]] = {}
    comm: list[Event] = []
    for e in raw:
        ev = {"name": e["name"], "cat": e["cat"], "ts": float(e["ts"]) - base, "dur": float(e.get("dur", 0.0))}
        if is_comm(ev["name"]):
            comm.append(ev)
        else:
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(ev)
    compute = [
        ev
        for events in threads.values()
        for ev, depth in _depths(events)
        if depth <= MAX_DEPTH and ev["dur"] >= MIN_EVENT_US
    ]
    lanes = [(e, 2 * pp_rank) for e in _nested(compute)] + [(e, 2 * pp_rank + 1) for e in _comm_runs(comm)]
    if not lanes:
        return []
    origin = min(e["ts"] for e, _ in lanes)
    return [{**e, "ph": "X", "pid": 1, "tid": tid, "ts": round(e["ts"] - origin, 3)} for e, tid in lanes]


def merge_traces(predicted: dict[str, Any], measured: dict[int, dict[str, Any]], step: int) -> dict[str, Any]:
    """One trace of the predicted step (process 0, events unchanged) and the measured traces of step `step`, one per
    pipeline rank (`measured[p]`), as process 1 on the same tracks."""
    renamed = []
    for ev in predicted["traceEvents"]:
        if ev.get("ph") == "M" and ev.get("name") == "process_name" and ev.get("pid") == 0:
            renamed.append({**ev, "args": {"name": "twin (predicted)"}})
            renamed.append({"name": "process_labels", "ph": "M", "pid": 0, "args": {"labels": ev["args"]["name"]}})
        else:
            renamed.append(ev)
    events = [*renamed, {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"measured (step {step})"}}]
    for rank in sorted(measured):
        events += lane_names(1, rank)
        events += measured_events(measured[rank], rank)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def read_profile(run_dir: Path, pp: int) -> tuple[int, dict[int, dict[str, Any]]]:
    """The profiled step of a run directory and, per pipeline rank p < `pp`, the trace of its rank at pp=p,
    dp=cp=tp=0; RecordError naming the file and the fix when one is missing or unreadable."""
    index = read_json_file(run_dir / "profile" / "ranks.json", ProfileIndex, PROFILE_FIX)
    firsts = {r.coords.pp: r for r in index.ranks if r.coords.dp == r.coords.cp == r.coords.tp == 0}
    if sorted(firsts) != list(range(pp)):
        raise RecordError(
            f"{run_dir / 'profile' / 'ranks.json'}: the run has {len(firsts)} pipeline ranks, the plan {pp}; "
            "give the plan the run used, or leave PLAN out to use the run's own"
        )
    traces = {}
    for p, entry in firsts.items():
        path = run_dir / "profile" / Path(entry.trace).name  # the run's own directory, whatever the index says
        try:
            traces[p] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise RecordError(f"{path}: cannot read it as a Chrome trace ({exc}); {PROFILE_FIX}") from None
    return index.step, traces
