"""Load plans and clusters from YAML files or preset names, with `--set` overrides and errors a user can act on.

Every failure here raises `PlanError`: one line that names the file, the field path and the fix. Nothing below
this module is allowed to surface a traceback for bad input.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from plan.cluster import FAILURE_COMPONENTS, Cluster
from plan.clusters import TOPOLOGY_DIR, cluster_names, load_cluster, load_what_if, resolve_cluster_path
from plan.files import PlanError, format_validation_error, parse_override, read_yaml
from plan.limits import DEFAULT_LIMITS, Limits
from plan.refs import StackRef
from plan.schema import Plan
from plan.stack import Stack
from plan.stacks import STACK_DIR, load_stack, resolve_stack_path, stack_names

__all__ = [  # what the rest of the project reaches through the loader
    "TOPOLOGY_DIR",
    "PlanError",
    "cluster_names",
    "format_validation_error",
    "load",
    "load_cluster",
    "parse_override",
    "plan_cluster",
    "read_yaml",
    "resolve_cluster_path",
    "stack_names",
    "validate_plan",
]

PRESET_DIR = Path(__file__).parent / "presets"


def _preset_names(kind: str) -> list[str]:
    return sorted(p.stem for p in (PRESET_DIR / kind).glob("*.yaml"))


def model_presets() -> list[str]:
    """Names of the built-in model architectures."""
    return _preset_names("models")


def plan_presets() -> list[str]:
    """Names of the built-in plans."""
    return _preset_names("plans")


def apply_overrides(data: dict[str, Any], overrides: Iterable[str], limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Return a copy of `data` with each `section.field=value` set; intermediate sections are created.

    `cluster.FIELD.PATH=value` (anything under `cluster` but its `name`) is a what-if on the cluster: it joins
    `cluster.overrides` under the dotted path (plan/clusters.py); `cluster=NAME` names another cluster. The same
    for `stack`."""
    out = json.loads(json.dumps(data, default=str))
    for item in overrides:
        path, value = parse_override(item, limits)
        if path[0] in ("cluster", "stack"):
            out[path[0]] = _ref_override(out.get(path[0]), path[1:], value)
            continue
        node = out
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise PlanError(f"--set {item!r}: {part} is a {type(child).__name__}, not a section")
            node = child
        node[path[-1]] = value
    return out


def _ref_override(current: Any, path: list[str], value: Any) -> Any:
    """The plan's `cluster` (or `stack`) entry after one `--set cluster...=value`."""
    if not path:
        if isinstance(value, str) and isinstance(current, dict):
            return {**current, "name": value}
        return value
    ref = dict(current) if isinstance(current, dict) else {"name": current}
    if path == ["name"]:
        return {**ref, "name": value}
    field = ".".join(path[1:] if path[0] == "overrides" and len(path) > 1 else path)
    return {**ref, "overrides": {**(ref.get("overrides") or {}), field: value}}


def _model_preset(name: str) -> dict[str, Any]:
    path = PRESET_DIR / "models" / f"{name}.yaml"
    if not path.is_file():
        raise PlanError(f"model: unknown model preset {name!r}; choose one of {', '.join(model_presets())}")
    return read_yaml(path)


def resolve_plan_source(source: str | Path) -> Path:
    """A plan path, or the file of a preset name."""
    path = Path(source)
    if path.suffix in (".yaml", ".yml") or path.exists() or "/" in str(source):
        return path
    preset = PRESET_DIR / "plans" / f"{source}.yaml"
    if preset.is_file():
        return preset
    raise PlanError(f"{source}: neither a plan file nor a preset; presets are {', '.join(plan_presets())}")


def plan_data(
    source: str | Path, overrides: Iterable[str] = (), limits: Limits = DEFAULT_LIMITS
) -> tuple[dict[str, Any], Path]:
    """The raw plan mapping with its model preset expanded and overrides applied, and the file it came from."""
    path = resolve_plan_source(source)
    data = read_yaml(path, limits)
    rest = []
    for item in overrides:  # `--set model=llama3-8b` swaps the whole architecture for a preset
        parts, value = parse_override(item, limits)
        if parts == ["model"] and isinstance(value, str):
            data["model"] = value
        else:
            rest.append(item)
    return apply_overrides(expand_model(data, describe_origin(path)), rest, limits), path


def expand_model(data: dict[str, Any], origin: str) -> dict[str, Any]:
    """`data` with a model given by preset name replaced by that preset's architecture."""
    if isinstance(data.get("model"), str):
        try:
            return {**data, "model": _model_preset(data["model"])}
        except PlanError as exc:
            raise PlanError(f"{origin}: {exc}") from None
    return data


def _real(path: Path) -> Path:
    """`path` with its links followed, remembered where it is absolute (a relative one follows the working
    directory): a search validates thousands of plans naming the same files."""
    return _real_absolute(path) if path.is_absolute() else path.resolve()


@lru_cache(maxsize=512)
def _real_absolute(path: Path) -> Path:
    return path.resolve()


def validate_plan(data: Mapping[str, Any], origin: str = "plan", relative_to: Path | None = None) -> Plan:
    """Validate a plan mapping: its own rules, then that it fits the cluster it names."""
    try:
        plan = Plan.model_validate(data)
    except ValidationError as exc:
        raise PlanError(format_validation_error(exc, Plan, origin)) from None
    try:
        cluster_path = _real(resolve_cluster_path(plan.cluster.name, relative_to))
        if not cluster_path.is_relative_to(_real(TOPOLOGY_DIR)):  # keep a path valid from any cwd
            ref = plan.cluster.model_copy(update={"name": str(cluster_path)})
            plan = plan.model_copy(update={"cluster": ref})
        # the paths just resolved are loaded as they are (a search validates thousands of plans: resolving each
        # name again in plan_cluster and plan_stack cost a third of validation's file-system calls)
        cluster = load_what_if(Cluster, cluster_path, plan.cluster.overrides)[0]
        if "stack" not in plan.model_fields_set and cluster.stack:  # the fleet's own software, as its runs use
            plan = plan.model_copy(update={"stack": StackRef(name=cluster.stack)})
        stack_path = _real(resolve_stack_path(plan.stack.name, relative_to))
        if stack_path.parent != _real(STACK_DIR):
            plan = plan.model_copy(update={"stack": plan.stack.model_copy(update={"name": str(stack_path)})})
        load_what_if(Stack, stack_path, plan.stack.overrides)
    except PlanError as exc:
        raise PlanError(f"{origin}: {exc}") from None
    check_fits_cluster(plan, cluster, origin)
    return plan


def load(source: str | Path, overrides: Iterable[str] = (), limits: Limits = DEFAULT_LIMITS) -> Plan:
    """Load a plan from a YAML path or preset name, apply `section.field=value` overrides, and validate it; the
    file and the override values are read within `limits`."""
    data, path = plan_data(source, overrides, limits)
    return validate_plan(data, describe_origin(path), path)


def describe_origin(path: Path) -> str:
    """How messages name a plan file: `preset NAME` for a built-in one, else its path."""
    if path.resolve().parent == (PRESET_DIR / "plans").resolve():
        return f"preset {path.stem}"
    return str(path)


def check_fits_cluster(plan: Plan, cluster: Cluster, origin: str = "plan") -> None:
    """The job's ranks, and its spares, must fit in the cluster; overridden failure components must exist."""
    world, gpn = plan.layout.world_size, cluster.node.gpus
    nodes_needed = -(-world // gpn) + plan.reliability.hot_spares
    if world > cluster.gpus:
        raise PlanError(
            f"{origin}: layout: world size dp·tp·pp·cp = {world} exceeds cluster {cluster.name!r} "
            f"with {cluster.gpus} accelerators; lower a parallel degree or choose a larger cluster"
        )
    if nodes_needed > cluster.nodes:
        raise PlanError(
            f"{origin}: reliability.hot_spares: {plan.reliability.hot_spares} spare nodes plus the job's "
            f"{nodes_needed - plan.reliability.hot_spares} nodes exceed the cluster's {cluster.nodes}; lower it"
        )
    unknown = sorted(set(plan.reliability.failure_rates or {}) - set(FAILURE_COMPONENTS))
    if unknown:
        raise PlanError(
            f"{origin}: reliability.failure_rates: unknown component(s) {unknown}; use {', '.join(FAILURE_COMPONENTS)}"
        )


def plan_stack(plan: Plan) -> Stack:
    """The software stack a validated plan names, its what-if overrides applied."""
    return load_stack(plan.stack.name, plan.stack.overrides)


def plan_cluster(plan: Plan) -> Cluster:
    """The cluster a validated plan names, its what-if overrides applied."""
    return load_cluster(plan.cluster.name, overrides=plan.cluster.overrides)
