"""How much one command may read and simulate: every `twin` command ends in bounded time, and past a limit it stops
with one line naming the limit and how to raise it.

Each default keeps one command within a few seconds on a 2-core machine (measured there: the step model runs about
15,000 pipeline actions a second, the run model 7,000-50,000 interruptions a second (the fewer, the more repairs
and RMA replacements in flight: Llama 3 405B at 19x its failure rates) and 1.5 million checkpoints a second)
and sits far above any plan the presets hold. A user raises one explicitly: `--limit NAME=VALUE` on the command
line (`twin predict my-plan --limit step_actions=200000`), `Limits(step_actions=200_000)` in the Python API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from plan.errors import PlanError


@dataclass(frozen=True)
class Limits:
    """Ceilings on what one command reads and simulates (all counts)."""

    file_kib: int = 1024
    """Size of a plan or cluster file (KiB); plans are a few KiB."""
    yaml_nodes: int = 100_000
    """Values in one YAML file or `--set` value, counted after aliases are expanded (a "billion laughs" stops here)."""
    yaml_depth: int = 64
    """Nesting depth of one YAML file (sections in sections; a plan needs 4)."""
    layers: int = 10_000
    """Model layers the step model walks (the largest published models have about 130)."""
    step_actions: int = 200_000
    """Pipeline actions one command simulates: pp · virtual_stages · microbatches · passes (F, B and, for the
    zero-bubble schedules, W) per simulated step; the presets need at most 11,520, the whole 385k-GPU fleet's
    pp-128 layout 63,744. A GPU step times 0.6-1 million actions a second at pp 128 (twin/step/pipeline_levels.py,
    benchmarks/predict_speed.py); a CPU host's event-by-event step about 14,000 (cpu-tiny under ZB-H1: 3,072
    actions in 0.22 s on one core), so the limit's worst step there takes some 15 s."""
    run_interruptions: int = 20_000
    """Failures, slow nodes and maintenance one simulated run may draw (reference-100k draws about 4,300; the
    1T model's ~950-day run on tpu-v4-pods about 5,500)."""
    run_checkpoints: int = 2_000_000
    """Checkpoints one simulated run may take (the presets take at most about 55,000)."""
    runs: int = 1_000
    """Whole runs one command simulates (`--seeds`, and 13 intervals per seed for `--sweep-checkpoint`)."""
    bisection_nodes: int = 200_000
    """Cluster nodes up to which `twin show` computes the fabric's bisection bandwidth (a max-flow over its switch
    domains, about 0.8 s at this size); past it the figure is left out, not the plan."""

    @classmethod
    def parse(cls, items: Iterable[str], base: Limits | None = None) -> Limits:
        """`NAME=VALUE` items (as `--limit` takes them) applied to `base` (default: the defaults)."""
        names = [f.name for f in dataclasses.fields(cls)]
        changes: dict[str, int] = {}
        for item in items:
            name, sep, raw = item.partition("=")
            name = name.strip()
            if not sep or name not in names:
                raise PlanError(f"--limit {item!r}: write NAME=VALUE with NAME one of {', '.join(names)}")
            try:
                value = int(float(raw.replace("_", "")))
            except (ValueError, OverflowError):
                value = 0
            if value < 1:
                raise PlanError(f"--limit {item!r}: give a whole number >= 1, e.g. {name}={getattr(cls(), name) * 4}")
            changes[name] = value
        return dataclasses.replace(base or cls(), **changes)


DEFAULT_LIMITS = Limits()


def over(what: str, count: float, limit_name: str, limits: Limits, fix: str) -> PlanError:
    """The one-line error for a count past a limit: what, how many, the limit, the fix and how to raise it (where
    raising it is a plausible way out: not for a count a million times past it)."""
    limit = getattr(limits, limit_name)
    shown = f"{count:,.0f}" if count < 1e15 else f"{count:.3g}"
    raise_it = (
        f", or raise the limit with --limit {limit_name}={_round_up(count)}"
        if count <= 1e6 * limit
        else f" (over a million times the limit: raising it with --limit {limit_name}=N would not help)"
    )
    name = limit_name.replace("_", " ")
    return PlanError(f"{what}: {shown} is past the limit of {limit:,} {name}; {fix}{raise_it}")


def _round_up(count: float) -> int:
    """A limit that admits `count`: two significant figures, rounded up."""
    n = int(min(count, 1e18))
    if n < 100:
        return n + 1
    scale = 10 ** (len(str(n)) - 2)
    return -(-n // scale) * scale
