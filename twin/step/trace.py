"""The simulated step as a Chrome / Perfetto trace: two lanes per pipeline rank — its actions (forward, backward,
weight gradient, each named by microbatch and chunk), then the step-end barrier and optimizer; and the exposed
communication (TP, CP, EP inside actions, DP buckets and tails, PP transfers waited on)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from twin.step.predict import StepPrediction

NAMES = {
    "F": "forward",
    "B": "backward",
    "W": "weight-grad",
    "barrier": "step end",
    "optimizer": "step end",
    "runs": "other schedule runs",
}
LANES = ("compute", "comm")


def chrome_trace(pred: StepPrediction) -> dict[str, Any]:
    """Trace Event Format (the JSON that chrome://tracing and ui.perfetto.dev open): complete events in µs."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"{pred.plan} on {pred.cluster}"}}
    ]
    for rank in sorted({s["rank"] for s in pred.timeline}):
        events.extend(lane_names(0, rank))
    for s in pred.timeline:
        action = s["kind"] in ("F", "B", "W")
        events.append(
            {
                "name": f"{s['kind']}{s['microbatch']}" + (f".c{s['chunk']}" if action else ""),
                "cat": NAMES.get(s["kind"], "communication"),
                "ph": "X",
                "pid": 0,
                "tid": 2 * s["rank"] + LANES.index(s["track"]),
                "ts": s["start_s"] * 1e6,
                "dur": (s["end_s"] - s["start_s"]) * 1e6,
                "args": {"stage": s["stage"], "chunk": s["chunk"], "microbatch": s["microbatch"]},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def lane_names(pid: int, rank: int) -> list[dict[str, Any]]:
    """Metadata naming pipeline rank `rank`'s two tracks in process `pid`: `pp rank R` and `pp rank R comm`."""
    names = [f"pp rank {rank}" + (" comm" if lane == "comm" else "") for lane in LANES]
    return [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": 2 * rank + i, "args": {"name": name}}
        for i, name in enumerate(names)
    ]


def write_trace(pred: StepPrediction, path: Path) -> None:
    path.write_text(json.dumps(chrome_trace(pred)))
