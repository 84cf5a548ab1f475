"""The run-record schema: what the executor writes and the twin reads back.

A run directory holds `manifest.json` (one `RunManifest`) and `records.jsonl` (one JSON object per line, each a
`StepRecord`, `EventRecord` or `LayerStatsRecord`, told apart by `kind`). The phases of a step use the twin's
breakdown names, so predicted and measured can be compared line by line. The reader rejects a malformed line
with its line number instead of skipping it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, TypeVar

from pydantic import BaseModel, Field, NonNegativeFloat, NonNegativeInt, TypeAdapter, ValidationError

from plan.schema import Plan
from plan.section import Section

if TYPE_CHECKING:
    import pandas as pd

RECORD_SCHEMA_VERSION: Final = 1
M = TypeVar("M", bound=BaseModel)

# The phases of one step, shared with the twin's StepBreakdown (seconds each, per rank).
PHASES = (
    "data_wait",  # waiting for the next batch
    "forward",  # forward compute
    "backward",  # backward compute (input and weight gradients)
    "optimizer",  # optimizer step, gradient clipping
    "comm_tp",  # exposed tensor/sequence-parallel collectives
    "comm_cp",  # exposed context-parallel exchanges
    "comm_ep",  # exposed expert-parallel all-to-all
    "comm_pp",  # exposed pipeline sends and receives
    "comm_dp",  # exposed data-parallel gradient reduction / parameter gathering
    "bubble",  # idle waiting for peers: pipeline fill and drain, the step-end barrier of the norm all-reduce
    "checkpoint",  # training stall while a checkpoint is taken
    "other",  # what the rest does not explain
)


class RecordError(ValueError):
    """A run file that cannot be read, naming the file, the line and the problem."""


class Phases(Section):
    """Seconds of one step spent in each phase on one rank; absent phases are zero."""

    data_wait: NonNegativeFloat = 0.0
    forward: NonNegativeFloat = 0.0
    backward: NonNegativeFloat = 0.0
    optimizer: NonNegativeFloat = 0.0
    comm_tp: NonNegativeFloat = 0.0
    comm_cp: NonNegativeFloat = 0.0
    comm_ep: NonNegativeFloat = 0.0
    comm_pp: NonNegativeFloat = 0.0
    comm_dp: NonNegativeFloat = 0.0
    bubble: NonNegativeFloat = 0.0
    checkpoint: NonNegativeFloat = 0.0
    other: NonNegativeFloat = 0.0


class RankCoords(Section):
    """A rank's place in the rank grid."""

    dp: NonNegativeInt
    pp: NonNegativeInt
    cp: NonNegativeInt
    ep: NonNegativeInt
    tp: NonNegativeInt


class StepRecord(Section):
    """One optimizer step as one rank saw it."""

    schema_version: Literal[1] = RECORD_SCHEMA_VERSION
    kind: Literal["step"] = "step"
    step: NonNegativeInt
    """Optimizer step index, from 0 (steps)."""
    rank: NonNegativeInt
    """Global rank."""
    coords: RankCoords
    """Grid coordinates of the rank."""
    time_unix: float
    """Wall-clock time at the end of the step (seconds since the epoch)."""
    step_s: NonNegativeFloat
    """Wall time of the whole step on this rank (seconds)."""
    phases: Phases = Phases()
    """Where the step's time went (seconds per phase)."""
    tokens: NonNegativeInt
    """Tokens this rank's replica consumed in the step (tokens)."""
    loss: float | None = None
    """Mean training loss of the step, on ranks that compute it (the last pipeline stage)."""
    grad_norm: float | None = None
    """Global gradient norm before clipping."""
    lr: float | None = None
    """Learning rate used in the step."""
    peak_memory_MB: NonNegativeFloat = 0.0
    """Peak device (or process resident) memory during the step (1e6 bytes)."""
    tokens_per_s: float | None = None
    """Job-wide throughput of the step (tokens/s); rank 0 only."""
    mfu: float | None = None
    """Model FLOPs utilisation of the step, as the twin defines it (0-1); rank 0 only."""
    step_spread_s: float | None = None
    """Slowest minus fastest rank's step time (seconds); rank 0 only."""
    stragglers: tuple[int, ...] = ()
    """Ranks slower than the cohort by the straggler threshold; rank 0 only."""


class EventRecord(Section):
    """Something that happened to the run: a checkpoint, an injected fault, its detection, a restart."""

    schema_version: Literal[1] = RECORD_SCHEMA_VERSION
    kind: Literal["event"] = "event"
    event: str
    """What happened, e.g. 'checkpoint', 'fault', 'detected', 'restart', 'resume', 'spike'."""
    step: NonNegativeInt
    """Step at which it happened."""
    rank: int = -1
    """The rank it concerns, or -1 for the whole job."""
    time_unix: float
    """When it happened (seconds since the epoch)."""
    duration_s: NonNegativeFloat = 0.0
    """How long it took, where that applies (seconds)."""
    detail: dict[str, Any] = Field(default_factory=dict)
    """Free-form facts about the event (fault kind, checkpoint path, ...)."""


class LayerStatsRecord(Section):
    """Per-layer gradient and activation norms, taken every k steps."""

    schema_version: Literal[1] = RECORD_SCHEMA_VERSION
    kind: Literal["layers"] = "layers"
    step: NonNegativeInt
    rank: NonNegativeInt
    grad_norm: dict[str, NonNegativeFloat]
    """Parameter name -> gradient norm of this rank's shard."""
    activation_norm: dict[str, NonNegativeFloat] = Field(default_factory=dict)
    """Module name -> RMS of its output activation."""
    expert_load: dict[str, list[NonNegativeInt]] = Field(default_factory=dict)
    """MoE layer name -> its routed experts' token choices from this rank's tokens in this step (count), before
    any is dropped: load imbalance is their spread."""
    dropped: dict[str, NonNegativeInt] = Field(default_factory=dict)
    """MoE layer name -> token choices dropped over an expert's capacity in this step (count)."""


Record = Annotated[StepRecord | EventRecord | LayerStatsRecord, Field(discriminator="kind")]
_RECORD = TypeAdapter(Record)


class DataVersion(Section):
    """The training data a run read: enough to tell whether two runs saw the same tokens."""

    path: str
    """Where the token shards live."""
    fingerprint: str
    """Content hash of the shards' index (hex)."""
    tokens: NonNegativeInt
    """Tokens in the corpus (tokens)."""
    vocab: NonNegativeInt
    """Vocabulary size of the tokenizer that made it."""


class Ran(Section):
    """What the executor ran, where it is more specific than the plan or differs from it. The plan stays as the
    user wrote it; the twin prices a run by the plan with these applied (`plan_as_ran`)."""

    dtype: Literal["fp32", "bf16", "fp8"]
    """Dtype the matmuls ran in: bf16 under mixed precision (on GPUs by default), else fp32."""
    fused_projections: bool
    """Whether Q/K/V (and gate/up) ran as one GEMM; the executor's layers keep them apart."""
    grad_reduce_dtype: Literal["fp16", "bf16", "fp32"]
    """Dtype of the data-parallel gradient reduction: the plan's under mixed precision, else fp32."""
    cp_algorithm: Literal["ring", "all-gather"]
    """How context-parallel attention exchanged keys and values."""
    stack: str = "executor"
    """The software stack that ran (plan/presets/stacks/): the executor's own layers, whatever the plan names."""
    schedule: str
    """The torch.distributed.pipelining class that ran the plan's schedule ('none' without pipelining)."""
    optimizer: str
    """The optimizer as built, e.g. 'torch.optim.AdamW(foreach=False)' (single-tensor)."""
    checkpoint: Literal["sync", "async", "none"]
    """How checkpoints were written: sync, async (a background write after staging), or none."""
    checkpoint_every_steps: NonNegativeInt
    """Steps between checkpoints (0: not by steps)."""
    checkpoint_interval_min: NonNegativeFloat | None
    """Minutes between checkpoints (None: not by time)."""
    mismatches: tuple[str, ...] = ()
    """The plan's fields that ran otherwise, one line each, as warned at start."""


class RunManifest(Section):
    """What a run was: the resolved plan, the code, the software and the hosts (experiment tracking)."""

    schema_version: Literal[1] = RECORD_SCHEMA_VERSION
    run_id: str
    """Name of the run directory."""
    created_unix: float
    """Start of the run (seconds since the epoch)."""
    plan: Plan
    """The plan as the user gave it, overrides applied."""
    ran: Ran | None = None
    """What the executor ran where it differs from the plan (absent in runs from before it was recorded, whose
    `plan` already held what ran)."""
    plan_sha256: str
    """Hash of the plan's canonical JSON."""
    git_commit: str | None = None
    """Commit of the code that ran, if it ran from a git checkout."""
    git_dirty: bool = False
    """The checkout had uncommitted changes."""
    torch_version: str
    python_version: str
    device: Literal["cpu", "cuda"]
    backend: Literal["gloo", "nccl"]
    world_size: NonNegativeInt
    hosts: tuple[str, ...]
    """Host names of the ranks, by rank."""
    data: DataVersion | None = None
    command: tuple[str, ...] = ()
    """The command line that started the run."""


class ProfiledRank(Section):
    """One rank's trace of the profiled step."""

    rank: NonNegativeInt
    """Global rank."""
    coords: RankCoords
    """Grid coordinates of the rank."""
    trace: str
    """File name of its Chrome / Perfetto trace, beside the index."""


class ProfileIndex(Section):
    """`<run>/profile/ranks.json`: the step `--profile-step` recorded and where each traced rank sits in the grid,
    so that a reader picks ranks by coordinates without the executor."""

    schema_version: Literal[1] = RECORD_SCHEMA_VERSION
    step: NonNegativeInt
    """The step profiled, from 0, as the step records number it."""
    device: Literal["cpu", "cuda"]
    ranks: tuple[ProfiledRank, ...]


def profile_step_refusal(step: int | None, steps: int) -> str | None:
    """Why `--profile-step step` cannot run in a run of `steps` steps (steps count from 0), or None."""
    if step is None or 0 <= step < steps:
        return None
    return f"--profile-step {step}: choose a step from 0 to {steps - 1} (--steps {steps})"


def parse_record(line: str, where: str = "record") -> StepRecord | EventRecord | LayerStatsRecord:
    """Parse one JSONL line; a malformed one raises RecordError naming `where`."""
    try:
        return _RECORD.validate_json(line)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise RecordError(f"{where}: {loc or 'record'}: {first['msg']}") from None


def iter_records(path: Path) -> Iterator[StepRecord | EventRecord | LayerStatsRecord]:
    """Yield each record of a records.jsonl file; a malformed line raises RecordError with its line number.

    A final line without its newline is a write that a crash cut short: it is skipped, since the writer flushes
    whole lines only and everything before it is intact.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecordError(f"{path}: cannot read ({exc})") from None
    lines = text.split("\n")
    torn = lines[-1] != ""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if torn and number == len(lines):
            try:
                json.loads(line)
            except json.JSONDecodeError:
                return
        yield parse_record(line, f"{path}:{number}")


def read_json_file(path: Path, model: type[M], fix: str) -> M:
    """Read and validate one JSON file as `model`; an unreadable or invalid one raises RecordError naming the
    file and the field, with `fix` for an unreadable one."""
    try:
        return model.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise RecordError(f"{path}: cannot read ({exc}); {fix}") from None
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise RecordError(f"{path}: {loc}: {first['msg']}") from None


def plan_as_ran(manifest: RunManifest) -> Plan:
    """The run's plan with what the executor actually ran applied: the plan the twin should price for it."""
    ran = manifest.ran
    if ran is None:
        return manifest.plan
    plan = manifest.plan
    layout = plan.layout.model_copy(
        update={"fused_projections": ran.fused_projections, "cp_algorithm": ran.cp_algorithm}
    )
    training = plan.training.model_copy(update={"dtype": ran.dtype, "grad_reduce_dtype": ran.grad_reduce_dtype})
    checkpoint = plan.reliability.checkpoint if ran.checkpoint == "none" else ran.checkpoint
    reliability = plan.reliability.model_copy(update={"checkpoint": checkpoint})
    stack = plan.stack.model_copy(update={"name": ran.stack, "overrides": {}})
    return plan.model_copy(update={"layout": layout, "training": training, "reliability": reliability, "stack": stack})


def expert_imbalance(path: Path, plan: Plan) -> float | None:
    """The measured `model.expert_imbalance` of an MoE run: per step, MoE layer and expert-parallel group, the
    busiest rank's routed tokens (the choices of the group's tokens for the experts it holds) over the group's mean,
    averaged; None without expert parallelism or expert-load records (taken every --stats-every steps)."""
    lay = plan.layout
    if lay.ep < 2 or not plan.model.is_moe:
        return None
    from plan.rank_grid import RankGrid  # numpy: kept off the records' import path

    group_of = {int(r): g for g, row in enumerate(RankGrid.from_layout(lay).groups("ep")) for r in row}
    per_rank = plan.model.experts // lay.ep
    totals: dict[tuple[int, str, int], list[int]] = {}
    for rec in iter_records(path):
        if isinstance(rec, LayerStatsRecord):
            for layer, load in rec.expert_load.items():
                key = (rec.step, layer, group_of[rec.rank])
                have = totals.setdefault(key, [0] * len(load))
                totals[key] = [a + b for a, b in zip(have, load, strict=True)]
    ratios = []
    for load in totals.values():
        ranks = [sum(load[e * per_rank : (e + 1) * per_rank]) for e in range(lay.ep)]
        if sum(ranks):
            ratios.append(max(ranks) * lay.ep / sum(ranks))
    return sum(ratios) / len(ratios) if ratios else None


def read_manifest(run_dir: Path) -> RunManifest:
    """Read and validate `run_dir/manifest.json`."""
    return read_json_file(run_dir / "manifest.json", RunManifest, f"is {run_dir} a run directory?")


def steps_frame(path: Path) -> pd.DataFrame:
    """The step records of a records.jsonl file as a table, one row per (step, rank), phases as columns."""
    import pandas as pd  # imported here: it costs a quarter second that `twin predict` need not pay

    rows = []
    for rec in iter_records(path):
        if isinstance(rec, StepRecord):
            row = rec.model_dump(exclude={"phases", "coords", "stragglers"})
            row.update({f"coord_{k}": v for k, v in rec.coords.model_dump().items()})
            row.update(rec.phases.model_dump())
            rows.append(row)
    columns = ["step", "rank", "step_s", "tokens", "loss", "grad_norm", *PHASES]
    return pd.DataFrame(rows) if rows else pd.DataFrame(columns=columns)
