"""Load plans and clusters from YAML files or preset names, with `--set` overrides and errors a user can act on.

Every failure here raises `PlanError`: one line that names the file, the field path and the fix. Nothing below
this module is allowed to surface a traceback for bad input.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from plan.cluster import FAILURE_COMPONENTS, Cluster
from plan.schema import Plan

PRESET_DIR = Path(__file__).parent / "presets"
TOPOLOGY_DIR = Path(__file__).resolve().parent.parent / "topologies"


class PlanError(ValueError):
    """A plan or cluster that cannot be used, with a message naming the file, the field and the fix.

    The message is always one line: a newline that came in with user data is shown escaped.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"))


def _loc_part(part: object) -> str:
    """A field-path element as written in messages: plain names bare, anything odd JSON-quoted."""
    text = str(part)
    return text if re.fullmatch(r"[\w\-]+", text) else json.dumps(text)


def _preset_names(kind: str) -> list[str]:
    return sorted(p.stem for p in (PRESET_DIR / kind).glob("*.yaml"))


def model_presets() -> list[str]:
    """Names of the built-in model architectures."""
    return _preset_names("models")


def plan_presets() -> list[str]:
    """Names of the built-in plans."""
    return _preset_names("plans")


def cluster_names() -> list[str]:
    """Names of the clusters in topologies/ (calibrated profiles as calibrated/NAME)."""
    names = sorted(p.stem for p in TOPOLOGY_DIR.glob("*.yaml"))
    return names + sorted(f"calibrated/{p.stem}" for p in (TOPOLOGY_DIR / "calibrated").glob("*.yaml"))


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping with `safe_load`; a missing, unreadable or malformed file is a PlanError."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlanError(f"{path}: no such file; check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"{path}: cannot read ({exc}); give a UTF-8 text file") from None
    try:
        data = yaml.safe_load(text)
        json.dumps(data, default=str)  # rejects self-referencing aliases before anything walks them
    except (ValueError, RecursionError):
        raise PlanError(f"{path}: YAML refers to itself (a recursive alias); write the values out") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise PlanError(f"{path}: malformed YAML{where}: {problem}; fix the syntax") from None
    if not isinstance(data, dict):
        raise PlanError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    return data


def format_validation_error(exc: ValidationError, model: type[BaseModel], origin: str) -> str:
    """One line for all of a pydantic error's entries, each as `field.path: problem (fix)`."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(_loc_part(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        kind = err["type"]
        if kind == "extra_forbidden":
            known = _known_keys(model, err["loc"][:-1])
            msg = f"unknown key; known keys here: {', '.join(known)}" if known else "unknown key"
        elif kind == "missing":
            msg = "required, but missing"
        elif "input" in err and kind not in ("value_error", "assertion_error") and not isinstance(err["input"], dict):
            msg = f"{msg} (got {json.dumps(err['input'], default=str)[:60]})"
        # Section validators raise 'field: ...' relative to their section; join with the section's path.
        if kind == "value_error" and ":" in msg and not msg.startswith(loc):
            first = msg.split(":", 1)[0]
            if " " not in first:
                loc = f"{loc}.{first}" if loc else first
                msg = msg.split(":", 1)[1].strip()
        parts.append(f"{loc}: {msg}" if loc else msg)
    return f"{origin}: " + "; ".join(parts)


def _known_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names of the section at `loc` inside `model`, for 'unknown key' messages."""
    current: Any = model
    for part in loc:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        current = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if current is None:
            return []
    return list(getattr(current, "model_fields", {}))


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split `section.field=value` into its path and a YAML-parsed value (`4` is an int, `true` a bool)."""
    key, sep, raw = item.partition("=")
    path = [p for p in key.strip().split(".") if p]
    if not sep or not path:
        raise PlanError(f"--set {item!r}: expected section.field=value, e.g. --set layout.tp=4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of `data` with each `section.field=value` set; intermediate sections are created."""
    out = json.loads(json.dumps(data, default=str))
    for item in overrides:
        path, value = parse_override(item)
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


def resolve_cluster_path(name: str, relative_to: Path | None = None) -> Path:
    """The file of a cluster name (topologies/NAME.yaml) or path (absolute, or relative to the plan file)."""
    catalogue = TOPOLOGY_DIR / f"{name}.yaml"
    if catalogue.is_file():
        return catalogue
    path = Path(name)
    candidates = [path] if path.is_absolute() else [Path.cwd() / path]
    if relative_to is not None and not path.is_absolute():
        candidates.insert(0, relative_to.parent / path)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise PlanError(
        f"cluster: unknown cluster {name!r}; name a file in topologies/ ({', '.join(cluster_names())}) "
        "or give a path to a cluster YAML"
    )


@lru_cache(maxsize=64)
def _load_cluster_cached(path: Path, mtime_ns: int) -> Cluster:
    data = read_yaml(path)
    try:
        return Cluster.model_validate(data)
    except ValidationError as exc:
        raise PlanError(format_validation_error(exc, Cluster, str(path))) from None


def load_cluster(name: str, relative_to: Path | None = None) -> Cluster:
    """Load and validate a cluster by catalogue name or path (cached per file and modification time)."""
    path = resolve_cluster_path(name, relative_to).resolve()
    return _load_cluster_cached(path, path.stat().st_mtime_ns)


def plan_data(source: str | Path, overrides: Iterable[str] = ()) -> tuple[dict[str, Any], Path]:
    """The raw plan mapping with its model preset expanded and overrides applied, and the file it came from."""
    path = resolve_plan_source(source)
    data = read_yaml(path)
    rest = []
    for item in overrides:  # `--set model=llama3-8b` swaps the whole architecture for a preset
        parts, value = parse_override(item)
        if parts == ["model"] and isinstance(value, str):
            data["model"] = value
        else:
            rest.append(item)
    return apply_overrides(expand_model(data, describe_origin(path)), rest), path


def expand_model(data: dict[str, Any], origin: str) -> dict[str, Any]:
    """`data` with a model given by preset name replaced by that preset's architecture."""
    if isinstance(data.get("model"), str):
        try:
            return {**data, "model": _model_preset(data["model"])}
        except PlanError as exc:
            raise PlanError(f"{origin}: {exc}") from None
    return data


def validate_plan(data: Mapping[str, Any], origin: str = "plan", relative_to: Path | None = None) -> Plan:
    """Validate a plan mapping: its own rules, then that it fits the cluster it names."""
    try:
        plan = Plan.model_validate(data)
    except ValidationError as exc:
        raise PlanError(format_validation_error(exc, Plan, origin)) from None
    try:
        cluster_path = resolve_cluster_path(plan.cluster, relative_to)
    except PlanError as exc:
        raise PlanError(f"{origin}: {exc}") from None
    if not cluster_path.resolve().is_relative_to(TOPOLOGY_DIR.resolve()):  # keep a path valid from any cwd
        plan = plan.model_copy(update={"cluster": str(cluster_path.resolve())})
    cluster = load_cluster(plan.cluster)
    check_fits_cluster(plan, cluster, origin)
    return plan


def load(source: str | Path, overrides: Iterable[str] = ()) -> Plan:
    """Load a plan from a YAML path or preset name, apply `section.field=value` overrides, and validate it."""
    data, path = plan_data(source, overrides)
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


def plan_cluster(plan: Plan) -> Cluster:
    """The cluster a validated plan names."""
    return load_cluster(plan.cluster)
