"""The simulated step as a Chrome / Perfetto trace: one lane per pipeline rank, one slice per microbatch action."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from twin.step.predict import StepPrediction

NAMES = {"F": "forward", "B": "backward", "W": "weight-grad"}


def chrome_trace(pred: StepPrediction) -> dict[str, Any]:
    """Trace Event Format (the JSON that chrome://tracing and ui.perfetto.dev open): complete events in µs."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"{pred.plan} on {pred.cluster}"}}
    ]
    for rank in sorted({s["rank"] for s in pred.timeline}):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"pp rank {rank}"}})
    for s in pred.timeline:
        events.append(
            {
                "name": f"{s['kind']}{s['microbatch']}",
                "cat": NAMES[s["kind"]],
                "ph": "X",
                "pid": 0,
                "tid": s["rank"],
                "ts": s["start_s"] * 1e6,
                "dur": (s["end_s"] - s["start_s"]) * 1e6,
                "args": {"stage": s["stage"], "microbatch": s["microbatch"]},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(pred: StepPrediction, path: Path) -> None:
    path.write_text(json.dumps(chrome_trace(pred)))
