"""Elastic membership: run the plan on whatever world size the rendezvous gives, and time each restart.

Under `torchrun --nnodes MIN:MAX` a gang may come back from a failure with fewer (or more) nodes than the plan's
layout names. The model-parallel part of the layout (tp, pp, cp) is what a rank's shards are cut for, so it stays;
data parallelism absorbs the change: dp = world / (tp·pp·cp). The global batch stays fixed, because the data
order (`executor.data`: sample g of step s is a function of s·B + g) and the loss per step are defined over it:
each replica takes global_batch / dp sequences, cut into more (or fewer) microbatches. The microbatch size is the
largest one, up to the plan's (which the plan sized memory for), that divides a replica's share and gives the
pipeline schedule the microbatches it needs.
The checkpoint reloads resharded under the new dp (DCP, `executor.checkpoint`).

A restart is timed from the failure the watchdog recorded (`executor.health`: the dead rank's last heartbeat, so
within one heartbeat period of the death) to the end of the new gang's first step: rank 0 records a `restart`
event naming the failed and the new gang's world size and dp.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from executor.health import FAILURE_FILE
from executor.parallel import LayoutError
from plan.schema import Plan


def fit_world(plan: Plan, world: int) -> Plan:
    """The plan re-laid out for a gang of `world` ranks: dp re-derived, the global batch kept.

    LayoutError, naming the sizes and the fix, when `world` cannot carry the plan's model-parallel layout or
    its global batch.
    """
    lay, batch = plan.layout, plan.training.global_batch
    model_ranks = lay.tp * lay.pp * lay.cp
    if world == lay.world_size:
        return plan
    if world % model_ranks:
        raise LayoutError(
            f"elastic: the rendezvous gave {world} ranks, not a multiple of tp·pp·cp = {model_ranks} "
            f"(tp={lay.tp}, pp={lay.pp}, cp={lay.cp}); start nodes whose ranks add up to a multiple of {model_ranks}"
        )
    dp = world // model_ranks
    if batch % dp:
        raise LayoutError(
            f"elastic: the rendezvous gave {world} ranks, so dp = {world}/{model_ranks} = {dp}, which does not divide "
            f"training.global_batch={batch}; the global batch is kept fixed so that the data order and the loss "
            f"carry over, so run with a node count whose dp divides {batch}"
        )
    if dp % lay.ep:
        raise LayoutError(
            f"elastic: the rendezvous gave {world} ranks, so dp = {world}/{model_ranks} = {dp}, which is not a "
            f"multiple of layout.ep={lay.ep}: the experts of a layer split over ep ranks of dp; run with a node "
            f"count whose dp is a multiple of {lay.ep}"
        )
    share = batch // dp
    data = plan.model_dump()
    # A fault aimed at a rank the gang no longer has cannot strike.
    data["reliability"]["faults"] = [f for f in data["reliability"]["faults"] if f["rank"] < world]
    first_error = ""
    for microbatch in (m for m in range(min(share, lay.microbatch_size), 0, -1) if share % m == 0):
        data["layout"].update(dp=dp, microbatch_size=microbatch)
        try:
            return Plan.model_validate(data)
        except ValidationError as exc:
            first_error = first_error or f"with microbatch_size={microbatch}: {one_line(exc)}"
    raise LayoutError(f"elastic: the rendezvous gave {world} ranks, so dp={dp}, and {first_error}")


def one_line(exc: Exception) -> str:
    """A pydantic ValidationError's first error as `field: message`; other errors as they are."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first["loc"])
    return f"{where + ': ' if where else ''}{first['msg'].removeprefix('Value error, ')}"


def gang_facts(plan: Plan) -> dict[str, int]:
    """What a `start`, a failure and a `restart` record say about a gang's shape."""
    lay = plan.layout
    return {
        "world_size": lay.world_size,
        "dp": lay.dp,
        "microbatch_size": lay.microbatch_size,
        "num_microbatches": plan.num_microbatches,
    }


class RestartTimer:
    """Rank 0's clock of a restart: from the recorded failure to the end of the new gang's first step."""

    def __init__(self, run_dir: Path, gang: dict[str, int], event: Callable[..., None]) -> None:
        self.path = run_dir / "health" / FAILURE_FILE
        self.gang, self.event = gang, event
        self.failure = self._read()

    def _read(self) -> dict[str, Any] | None:
        try:
            failure: dict[str, Any] = json.loads(self.path.read_text())
            return failure
        except (OSError, ValueError):
            return None

    def stepped(self, step: int, started_unix: float, attempt: int, resumed_from: int) -> None:
        """Step `step` of this gang has completed; the first one after a failure records `restart`."""
        if self.failure is None:
            return
        failure, self.failure = self.failure, None
        now, failed_at = time.time(), float(failure["time_unix"])
        old = failure.get("gang", {})
        detail = {
            "cause": failure["cause"],
            "failed_rank": failure["rank"],
            "failed_step": failure["step"],
            "resumed_step": resumed_from,
            "from_world_size": old.get("world_size"),
            "to_world_size": self.gang["world_size"],
            "from_dp": old.get("dp"),
            "to_dp": self.gang["dp"],
            "from_attempt": failure["attempt"],
            "to_attempt": attempt,
            "detect_s": float(failure["detected_unix"]) - failed_at,
            "first_step_start_s": started_unix - failed_at,
            "first_step_s": now - started_unix,
        }
        self.event("restart", step, detail, duration_s=max(0.0, now - failed_at))
        self.path.unlink(missing_ok=True)  # this failure is accounted for; the next one starts a new clock
