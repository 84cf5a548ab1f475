"""What the `twin search` command and `api.search` share: a model or plan turned into the search's base, the space
from the user's ranges, results as rows, and `--sweep` (a table of given variants, not a search)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from plan import loader
from plan.errors import PlanError
from plan.limits import DEFAULT_LIMITS, Limits
from plan.model_math import param_count
from plan.schema import Plan
from twin.search.distributed import ray_executor
from twin.search.engine import Candidate, SearchResult, Tally, search, why_better
from twin.search.space import Space, neutral

CHINCHILLA_TOKENS_PER_PARAM = 20
"""Training tokens per parameter when a model (not a plan) is searched: the compute-optimal ratio of Hoffmann et al.
2022 ("Training Compute-Optimal Large Language Models", Table 3: ~20 tokens per parameter)."""
DEFAULT_BATCH_TOKENS = 4 * 2**20
"""Global batch when a model is searched and no batch is given: 4M tokens (GPT-3 175B's 3.2M and Llama 2's 4M)."""

Range = int | float | tuple[float, float]


@dataclass(frozen=True)
class Base:
    data: dict[str, Any]
    """The plan data candidates are built from."""
    given: Plan | str | None
    """The plan as given, or why the loader refuses it (None when a model was searched)."""
    notes: tuple[str, ...]
    """What the search assumed, in a line each."""


def base_of(
    source: str | Mapping[str, Any], cluster: str | None, overrides: Iterable[str], limits: Limits = DEFAULT_LIMITS
) -> Base:
    """A model preset (with `cluster`) or a plan (preset, path or plan data; `cluster` replaces its own) as the
    search's base."""
    overrides = list(overrides)
    as_plan = overrides + ([f"cluster={cluster}"] if cluster else [])
    if isinstance(source, Mapping):
        data = loader.apply_overrides(loader.expand_model(dict(source), "plan"), as_plan, limits)
        return Base(data, _given(data, "plan"), ())
    if source in loader.plan_presets() or source.endswith((".yaml", ".yml")):
        data, _ = loader.plan_data(source, as_plan, limits)
        return Base(data, _given(data, source), ())
    if source not in loader.model_presets():
        raise PlanError(
            f"{source}: neither a plan (a preset or a .yaml path) nor a model preset; models: "
            f"{', '.join(loader.model_presets())}"
        )
    if not cluster:
        raise PlanError(f"{source}: a model needs a fleet to be laid out on; name one with --cluster (twin presets)")
    data = {
        "schema_version": 1, "name": f"{source}-search", "model": source, "cluster": cluster,
        "layout": {"dp": 1}, "training": {"global_batch": 1, "tokens": 1.0},
    }  # fmt: skip
    data = loader.apply_overrides(loader.expand_model(data, source), overrides, limits)
    probe = loader.validate_plan(data, source)
    if not any(item.startswith("training.tokens=") for item in overrides):
        data["training"]["tokens"] = float(CHINCHILLA_TOKENS_PER_PARAM * param_count(probe.model).total)
    note = f"training tokens: {data['training']['tokens']:.3g} (20 per parameter, Hoffmann et al. 2022)"
    return Base(data, None, (note,))


def _given(data: Mapping[str, Any], origin: str) -> Plan | str:
    """The plan as given, or why the loader refuses it (the search may still find layouts for its model, fleet and
    batch)."""
    try:
        return loader.validate_plan(data, origin)
    except PlanError as exc:
        return str(exc)


def space_of(
    base: Base, gpus: Range | None, batch_tokens: Range | None, fixes: Iterable[str], limits: Limits = DEFAULT_LIMITS
) -> tuple[Space, tuple[str, ...]]:
    """The space from the user's ranges: `gpus` a count (at most that many) or a (fewest, most) range, default the
    plan's world size or the whole cluster; `batch_tokens` a count or a range, default the plan's batch or 4M
    tokens; `fixes` as `section.field=value` (layout fields pin an axis, others are set on every candidate)."""
    probe = loader.validate_plan(neutral(base.data), "search base")
    cluster = loader.plan_cluster(probe)
    lay, seq = base.data["layout"], probe.model.seq_len
    notes = []
    if gpus is None:
        world = lay.get("dp", 1) * lay.get("tp", 1) * lay.get("pp", 1) * lay.get("cp", 1)
        most = min(world, cluster.gpus) if base.given is not None else cluster.gpus
        lo_g, hi_g, explore = 1, most, False
        notes.append(f"GPUs: up to {most:,} ({'the plan' if base.given is not None else 'the whole cluster'})")
    elif isinstance(gpus, tuple):
        lo_g, hi_g, explore = int(gpus[0]), int(gpus[1]), True
    else:
        lo_g, hi_g, explore = 1, int(gpus), False
    if hi_g > cluster.gpus:
        raise PlanError(f"--gpus: {hi_g:,} is more than {cluster.name}'s {cluster.gpus:,} GPUs; grow it with "
                        f"--set cluster.nodes=N or ask for fewer")  # fmt: skip
    if lo_g < 1 or lo_g > hi_g:
        raise PlanError(f"--gpus-range: {lo_g}:{hi_g} is empty; give FEWEST:MOST with 1 <= FEWEST <= MOST")
    if batch_tokens is None:
        tokens = base.data["training"]["global_batch"] * seq if base.given is not None else DEFAULT_BATCH_TOKENS
        lo_b = hi_b = max(1, round(tokens / seq))
        notes.append(f"global batch: {lo_b:,} sequences of {seq:,} tokens")
    elif isinstance(batch_tokens, tuple):
        lo_b, hi_b = max(1, int(-(-batch_tokens[0] // seq))), int(batch_tokens[1] // seq)
    else:
        lo_b = hi_b = max(1, round(batch_tokens / seq))
        if lo_b % 8:  # a choice of when to say it: 8.4e6 tokens are 1,025 sequences, so dp must divide 5² x 41
            notes.append(f"global batch: {lo_b:,} sequences of {seq:,} tokens, which few dp divide; "
                         f"--batch-range LOW:HIGH lets the batch vary")  # fmt: skip
    if lo_b > hi_b:
        raise PlanError(f"--batch-range: no whole number of {seq:,}-token sequences lies in it; widen it")
    fixed = {}
    for item in fixes:
        path, value = loader.parse_override(item, limits)
        fixed[".".join(path)] = value
    return Space(gpus=(lo_g, hi_g), batch_sequences=(lo_b, hi_b), fixed=fixed, gpu_counts=explore), tuple(notes)


def run(
    source: str | Mapping[str, Any],
    cluster: str | None = None,
    overrides: Iterable[str] = (),
    gpus: Range | None = None,
    batch_tokens: Range | None = None,
    objective: str = "time",
    top: int = 5,
    fixes: Iterable[str] = (),
    workers: int | None = None,
    progress: Callable[[Tally], None] | None = None,
    seeds: int = 3,
    limits: Limits = DEFAULT_LIMITS,
    ray: str | None = None,
) -> tuple[SearchResult, tuple[str, ...]]:
    """The search, from what a user types; the result and what it assumed. `ray`: simulate on a Ray cluster
    ("local" starts one here; twin/search/distributed.py) instead of this machine's process pool."""
    if top < 1:
        raise PlanError(f"--top {top}: ask for at least one layout")
    base = base_of(source, cluster, overrides, limits)
    space, notes = space_of(base, gpus, batch_tokens, fixes, limits)
    executor = ray_executor(ray, workers) if ray else None
    try:
        result = search(base.data, space, objective, top, workers, executor, progress, given=base.given, seeds=seeds)
    finally:
        if executor is not None:
            executor.shutdown()
    return result, base.notes + notes


def row(c: Candidate, seq_len: int) -> dict[str, Any]:
    """One candidate as a flat row (CSV, JSON, tables)."""
    s, k, o = c.shape, c.knobs, c.outcome
    return {
        "layout": c.label, "gpus": s.gpus, "dp": s.dp, "tp": s.tp, "pp": s.pp, "cp": s.cp, "ep": s.ep,
        "expert_tp": s.expert_tp or None,
        "schedule": s.schedule, "virtual_stages": s.virtual_stages, "microbatch_size": s.microbatch_size,
        "global_batch": s.global_batch, "batch_tokens": s.global_batch * seq_len, "zero": k.zero,
        "recompute": k.recompute, "sequence_parallel": k.sequence_parallel, "step_time_s": o.step_time_s,
        "mfu": o.mfu, "memory_peak_GiB": o.memory_peak_GiB, "headroom_GiB": c.headroom_GiB,
        "days_to_train": o.days_to_train, "cost_usd": c.cost_usd, "run_wall_days": c.run_wall_days,
        "objective": c.objective,
    }  # fmt: skip


def top_rows(result: SearchResult) -> list[dict[str, Any]]:
    """The top K as rows, each saying why it beats the next."""
    rows = []
    for i, c in enumerate(result.top):
        r = row(c, c.plan.model.seq_len)
        r["beats_next_by"] = why_better(c, result.top[i + 1]) if i + 1 < len(result.top) else ""
        rows.append(r)
    return rows


def sweep(source: str, fields: Sequence[str], overrides: Iterable[str] = ()) -> pd.DataFrame:
    """Every combination of `fields` (each `section.field=a,b,c`), predicted: a row per variant, with the reason
    where a variant is not a valid plan or does not fit."""
    from twin import api

    axes = []
    for item in fields:
        name, sep, values = item.partition("=")
        if not sep or not values:
            raise PlanError(f"--sweep {item!r}: write section.field=a,b,c (e.g. layout.tp=4,8)")
        axes.append([f"{name}={v.strip()}" for v in values.split(",")])
    rows = []
    for combo in itertools.product(*axes):
        entry: dict[str, Any] = {item.split("=")[0]: item.split("=", 1)[1] for item in combo}
        check = api.validate(source, [*overrides, *combo])
        if not check.ok:
            rows.append({**entry, "ok": False, "reason": check.reasons[0]})
            continue
        pred = api.predict(check.plan)  # type: ignore[arg-type]
        rows.append({
            **entry, "ok": True, "gpus": pred.world_size, "step_time_s": pred.step_time_s, "mfu": pred.mfu,
            "memory_peak_GiB": pred.memory.peak, "days_to_train": pred.days_to_train, "gpu_hours": pred.gpu_hours,
            "reason": "",
        })  # fmt: skip
    return pd.DataFrame(rows)


SCALE = {"k": 2.0**10, "m": 2.0**20, "g": 2.0**30}
"""Suffixes in powers of two, as training papers count: Llama 3's "4M tokens" are 512 sequences of 8,192 tokens
(4,194,304) and its "16K H100s" are 16,384 (Dubey et al. 2024, §3.3-3.4)."""


def coerce_range(text: str | None, name: str) -> Range | None:
    """`A:B` as a (low, high) range, `N` as a number (`8M`, `16k`: suffixes in powers of two, `SCALE`); a clear
    error otherwise."""
    if text is None:
        return None
    try:
        if ":" in text:
            lo, hi = text.split(":", 1)
            return (_number(lo), _number(hi))
        return _number(text)
    except ValueError:
        raise PlanError(
            f"{name} {text!r}: give a number (e.g. 2048, 4.2e6 or 8M; suffixes k, M, G are powers of two) "
            "or a range LOW:HIGH"
        ) from None


def _number(text: str) -> float:
    text = text.strip().replace(",", "").replace("_", "")
    scale = SCALE.get(text[-1:].lower(), 1.0)
    return float(text[:-1] if scale != 1.0 else text) * scale


def as_mapping(result: SearchResult, notes: Sequence[str]) -> Mapping[str, Any]:
    """The whole result as JSON-ready data."""
    given: Any = result.given
    if isinstance(given, Candidate):
        given = row(given, given.plan.model.seq_len)
    return {
        "objective": result.objective,
        "assumed": list(notes),
        "top": top_rows(result),
        "pareto": [row(c, c.plan.model.seq_len) for c in result.pareto],
        "given": given,
        "tally": result.tally.__dict__,
    }
