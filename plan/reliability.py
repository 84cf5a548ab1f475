"""The plan's reliability section: the recovery policy the twin simulates (checkpoints, spares, detection, restart)
and the faults the executor injects into its own runs."""

from __future__ import annotations

from typing import Any, Final, Literal, get_args

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, field_validator, model_validator

from plan.section import UserSection

CheckpointKind = Literal["sync", "async", "in-memory"]
FaultKind = Literal["crash", "hang", "slow", "bitflip", "ckpt-crash", "disk-full"]
FAULT_KINDS: Final = get_args(FaultKind)


class FaultSpec(UserSection):
    """A fault the executor injects into its own run, once (written `KIND@STEP[:RANK]`)."""

    kind: FaultKind
    """crash (the rank exits), hang (it stops answering), slow (it computes `slowdown`x slower), bitflip (a bit
    of one of its weights flips), ckpt-crash (it dies while writing a checkpoint), disk-full (its write fails)."""
    step: NonNegativeInt
    """Optimizer step at which it strikes (steps); ckpt-crash and disk-full strike the first checkpoint taken
    at or after it."""
    rank: NonNegativeInt = 0
    """Global rank it strikes."""
    slowdown: float = Field(default=4.0, gt=1)
    """For slow: how many times slower the rank computes (ratio)."""
    duration_steps: PositiveInt = 3
    """For slow: how many steps the slowdown lasts (steps)."""

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """`KIND@STEP[:RANK]`, e.g. `crash@5:3`; a malformed one raises ValueError with the expected form."""
        kind, at, rest = text.strip().partition("@")
        step, _, rank = rest.partition(":")
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault {text!r}: unknown kind {kind!r}; use one of {', '.join(FAULT_KINDS)}")
        if not at or not step.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"fault {text!r}: write KIND@STEP[:RANK] with whole numbers, e.g. {kind}@5:1")
        return cls.model_validate({"kind": kind, "step": int(step), "rank": int(rank or 0)})

    def label(self) -> str:
        return f"{self.kind}@{self.step}:{self.rank}"


class Reliability(UserSection):
    """The recovery policy: checkpoints, spares, restart; optional overrides of the cluster's failure rates."""

    checkpoint: CheckpointKind = "async"
    """Checkpoint kind: sync (stall for the write), async (stall for the device-to-host copy), in-memory."""
    checkpoint_interval_min: PositiveFloat | Literal["auto"] = "auto"
    """Minutes between checkpoints, or auto (Young/Daly from the failure rate and the write cost)."""
    hot_spares: NonNegativeInt = 0
    """Spare nodes kept warm to swap in for failed ones (nodes)."""
    restart_min: PositiveFloat = 10.0
    """Minutes to restart the gang once a failure is found, before the checkpoint load: reschedule, start processes,
    initialise communicators (Kokolis et al. 2024: 5-20 min; MegaScale, NSDI'24: under 30 s of init when tuned)."""
    keep_checkpoints: PositiveInt = 3
    """Checkpoints kept on storage; older ones are deleted after a newer one commits (count)."""
    in_memory_flush_min: PositiveFloat = 60.0
    """With in-memory checkpoints, minutes between flushes of the in-memory copy to storage."""
    heartbeat_timeout_s: PositiveFloat = 60.0
    """Seconds without a heartbeat before a rank is declared dead (crashes are found this fast)."""
    watchdog_timeout_s: PositiveFloat = 600.0
    """Collective watchdog timeout: a hung rank is found only this late (PyTorch's NCCL default is 10 minutes)."""
    provision_min: PositiveFloat = 15.0
    """Minutes to bring a cold node from the cluster's free pool into the job (allocate, health-check); a hot
    spare skips this."""
    sdc_check_interval_min: float = Field(default=0.0, ge=0)
    """Minutes between silent-data-corruption checks (cross-replica checksums); 0 = none, found by loss spikes."""
    sdc_check_s: float = Field(default=30.0, ge=0)
    """Training stall of one SDC check (seconds)."""
    elastic: bool = False
    """When no replacement node is left, shrink data parallelism and go on, instead of waiting for repairs."""
    fence_after: PositiveInt = 3
    """A node's own failures after which it is fenced off instead of returning after repair (count, per
    8-accelerator server's worth of the node: an NVL72 rack takes 9 times as many); new hardware takes its place
    after `rma_days`."""
    rma_days: PositiveFloat | None = 20.0
    """Days until new hardware replaces a fenced node (the vendor's RMA: "next business day" with advance
    replacement, 3-14 business days without, then a 2-4 h swap; amcompute.com, "When a GPU Dies in Production",
    2026; the slow end, as calendar days); null: never, the cluster shrinks for good."""
    failure_rates: dict[str, float] | None = None
    """Overrides of the cluster's failure rates: component -> failures per node-day."""
    checkpoint_every_steps: NonNegativeInt = 0
    """Executor: optimizer steps between checkpoints (steps); 0 = by `checkpoint_interval_min` alone (which the
    executor ignores when auto)."""
    sdc_check_every_steps: NonNegativeInt = 0
    """Executor: optimizer steps between cross-replica weight checksums (steps); 0 = none, unless a bitflip is
    injected, which turns them on every step."""
    faults: tuple[FaultSpec, ...] = ()
    """Executor: faults to inject, as `KIND@STEP[:RANK]` strings or mappings (see FaultSpec)."""

    @field_validator("faults", mode="before")
    @classmethod
    def _parse_faults(cls, value: Any) -> Any:
        if isinstance(value, str | list | tuple):
            items = [value] if isinstance(value, str) else value
            return tuple(FaultSpec.parse(v) if isinstance(v, str) else v for v in items)
        return value

    @model_validator(mode="after")
    def _check(self) -> Reliability:
        for component, rate in (self.failure_rates or {}).items():
            if rate < 0:
                raise ValueError(f"failure_rates.{component}: {rate} is negative; give failures per node-day >= 0")
        return self
