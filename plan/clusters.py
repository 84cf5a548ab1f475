"""The cluster catalogue (`topologies/`) and cluster what-ifs: a catalogue cluster plus overrides of its fields.

A what-if is a mapping of dotted field paths of the cluster file to new values — `nodes: 560`,
`fabric.tiers.1.bandwidth_GBps: 100`, `failures.rate_scale: 0.5` — applied to the file's contents before they
are validated, so an override is checked exactly as the file is and its errors name the field. A list element is
named by its index or, for the fabric tiers, by its `name` (`fabric.tiers.leaf.latency_us`); `*` sets every
element (`fabric.tiers.*.bandwidth_GBps: 100`: 800G NICs on every tier). Growing `nodes` grows the outermost
fabric tier with it, unless the same what-if sets that tier's `span_nodes` itself.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from plan.accelerator import AcceleratorFile
from plan.cluster import Cluster
from plan.files import PlanError, format_validation_error, read_yaml, resolve_file

TOPOLOGY_DIR = Path(__file__).resolve().parent.parent / "topologies"
ALL = "*"


def cluster_names() -> list[str]:
    """Names of the clusters in topologies/ (calibrated profiles as calibrated/NAME)."""
    names = sorted(p.stem for p in TOPOLOGY_DIR.glob("*.yaml"))
    return names + sorted(f"calibrated/{p.stem}" for p in (TOPOLOGY_DIR / "calibrated").glob("*.yaml"))


def resolve_cluster_path(name: str, relative_to: Path | None = None) -> Path:
    """The file of a cluster name (topologies/NAME.yaml) or path (absolute, or relative to the plan file)."""

    def unknown() -> str:
        return (
            f"cluster: unknown cluster {name!r}; name a file in topologies/ ({', '.join(cluster_names())}) "
            "or give a path to a cluster YAML"
        )

    return resolve_file(name, TOPOLOGY_DIR, relative_to, unknown)


@dataclass(frozen=True)
class WhatIf:
    """What a set of overrides did to a cluster file: every concrete field it set, and what followed."""

    set_paths: tuple[str, ...]
    """Concrete dotted paths the overrides set (a `*` or a tier name expanded to indices)."""
    derived: dict[str, str]
    """Fields changed as a consequence, with why (e.g. the outermost tier grown with `nodes`)."""


def apply_what_if(data: dict[str, Any], overrides: Mapping[str, Any], origin: str) -> tuple[dict[str, Any], WhatIf]:
    """A copy of a cluster file's contents with `overrides` applied; PlanError names a path that does not exist."""
    out = copy.deepcopy(data)
    base = data  # the chip as loaded, or as a later `accelerator: NAME` swapped it in
    paths: list[str] = []
    derived: dict[str, str] = {}
    for path, value in overrides.items():
        parts = [p for p in str(path).split(".") if p]
        if not parts:
            raise PlanError(f"{origin}: overrides: an empty field path; write e.g. nodes: 560")
        if parts == ["accelerator"] and isinstance(value, str):
            earlier = [p for p in paths if p.split(".")[0] in ("accelerator", "compute")]
            if earlier:  # the named chip replaces the whole section: those would be silently lost
                raise PlanError(
                    f"{origin}: overrides.accelerator: {value!r} replaces the chip after {', '.join(earlier)} "
                    "changed it; name the chip first, then the fields to change on it"
                )
            # another chip by catalogue name: its kernel-level efficiencies come with it (the file's belong to its
            # own chip); later compute.* overrides still apply on top
            out = expand_accelerator({k: v for k, v in out.items() if k != "compute"} | {"accelerator": value}, origin)
            base = copy.deepcopy(out)
            paths.append("accelerator")
            derived["compute"] = f"the {value} catalogue entry's kernel-level efficiencies, with the chip"
            continue
        paths += _set(out, parts, value, [], origin, str(path))
    tiers = (out.get("fabric") or {}).get("tiers") or []
    if "nodes" in paths and tiers and isinstance(tiers[-1], dict):
        last = len(tiers) - 1
        key = f"fabric.tiers.{last}.span_nodes"
        nodes = out.get("nodes")
        if key not in paths and isinstance(nodes, int) and nodes > int(tiers[last].get("span_nodes", 0)):
            tiers[last]["span_nodes"] = nodes
            derived[key] = f"grown with nodes to {nodes}"
    _scale_device_memory(base, out, paths, derived)
    return out, WhatIf(tuple(dict.fromkeys(paths)), derived)


def _scale_device_memory(
    before: dict[str, Any], out: dict[str, Any], paths: list[str], derived: dict[str, str]
) -> None:
    """A what-if on the datasheet's memory (`accelerator.hbm_GB`) moves what CUDA reports by the same ratio, unless
    the same what-if sets `device_memory_GiB` itself: the memory model fits into the latter."""
    key = "accelerator.device_memory_GiB"
    old, new = (before.get("accelerator"), out.get("accelerator"))
    if "accelerator.hbm_GB" not in paths or key in paths or not isinstance(old, dict) or not isinstance(new, dict):
        return
    reported, was, now = new.get("device_memory_GiB"), old.get("hbm_GB"), new.get("hbm_GB")
    numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in (reported, was, now))
    if numbers and was and reported and was != now:
        new["device_memory_GiB"] = reported * now / was
        derived[key] = f"scaled with hbm_GB {was} -> {now} to {new['device_memory_GiB']:.2f}"


def _set(node: Any, parts: list[str], value: Any, done: list[str], origin: str, written: str) -> list[str]:
    """Set `value` at `parts` below `node`; the concrete paths set (several where a `*` fans out)."""
    head, rest = parts[0], parts[1:]
    where = ".".join(done) or "the file"
    if isinstance(node, list):
        out: list[str] = []
        for i in _indices(node, head, where, origin, written):
            if rest:
                out += _set(node[i], rest, value, [*done, str(i)], origin, written)
            else:
                node[i] = copy.deepcopy(value)
                out.append(".".join([*done, str(i)]))
        return out
    if not isinstance(node, dict):
        raise PlanError(f"{origin}: overrides.{written}: {where} is a value, not a section; set {where}")
    if not rest:
        node[head] = copy.deepcopy(value)
        return [".".join([*done, head])]
    if head not in node or not isinstance(node[head], dict | list):
        known = ", ".join(k for k, v in node.items() if isinstance(v, dict | list)) or "none"
        raise PlanError(f"{origin}: overrides.{written}: {where} has no section {head!r}; its sections are {known}")
    return _set(node[head], rest, value, [*done, head], origin, written)


def _indices(items: list[Any], key: str, where: str, origin: str, written: str) -> list[int]:
    """List elements named by an index, a `name` field or `*`."""
    if key == ALL:
        return list(range(len(items)))
    if key.lstrip("-").isdigit() and -len(items) <= int(key) < len(items):
        return [int(key) % len(items)]
    named = [i for i, item in enumerate(items) if isinstance(item, dict) and item.get("name") == key]
    if named:
        return named
    names = [str(item.get("name")) for item in items if isinstance(item, dict) and "name" in item]
    choices = f"0-{len(items) - 1}" + (f", or a name: {', '.join(names)}" if names else "") + ", or *"
    raise PlanError(f"{origin}: overrides.{written}: {where} has no element {key!r}; use an index {choices}")


M = TypeVar("M", bound=BaseModel)


ACCELERATOR_DIR = TOPOLOGY_DIR / "accelerators"


def accelerator_names() -> list[str]:
    """Names of the accelerators in topologies/accelerators/."""
    return sorted(p.stem for p in ACCELERATOR_DIR.glob("*.yaml"))


def expand_accelerator(data: dict[str, Any], origin: str) -> dict[str, Any]:
    """A cluster file's contents with an accelerator given by name replaced by the catalogue's chip and its
    kernel-level efficiencies (a `compute` section in the cluster file itself wins)."""
    name = data.get("accelerator")
    if not isinstance(name, str):
        return data
    path = ACCELERATOR_DIR / f"{name}.yaml"
    if not path.is_file():
        raise PlanError(f"{origin}: accelerator: unknown accelerator {name!r}; one of {', '.join(accelerator_names())}")
    try:
        entry = AcceleratorFile.model_validate(read_yaml(path))
    except ValidationError as exc:
        raise PlanError(format_validation_error(exc, AcceleratorFile, str(path))) from None
    out = {**data, "accelerator": entry.accelerator.model_dump(mode="json", exclude_none=True)}
    out.setdefault("compute", entry.compute.model_dump(mode="json", exclude_none=True))
    return out


@lru_cache(maxsize=256)
def _load_cached(model: type[M], path: Path, mtime_ns: int, overrides_json: str) -> tuple[M, WhatIf]:
    data = read_yaml(path)
    if model is Cluster:
        data = expand_accelerator(data, str(path))
    overrides = json.loads(overrides_json)
    origin = str(path) if not overrides else f"{path} with what-if overrides"
    resolved, what_if = apply_what_if(data, overrides, origin) if overrides else (data, WhatIf((), {}))
    try:
        return model.model_validate(resolved), what_if
    except ValidationError as exc:
        raise PlanError(format_validation_error(exc, model, origin)) from None


def load_what_if(model: type[M], path: Path, overrides: Mapping[str, Any] | None) -> tuple[M, WhatIf]:
    """A file validated as `model` with what-if overrides applied, and what they did (cached per file,
    modification time and overrides, in the order given: a later override wins)."""
    path = path if path.is_absolute() else path.resolve()  # catalogue paths are absolute: no system calls
    return _load_cached(model, path, path.stat().st_mtime_ns, json.dumps(dict(overrides or {}), default=str))


def load_cluster_what_if(
    name: str, overrides: Mapping[str, Any] | None = None, relative_to: Path | None = None
) -> tuple[Cluster, WhatIf]:
    """A cluster by catalogue name or path with what-if overrides applied, and what they did."""
    return load_what_if(Cluster, resolve_cluster_path(name, relative_to), overrides)


def load_cluster(name: str, relative_to: Path | None = None, overrides: Mapping[str, Any] | None = None) -> Cluster:
    """Load and validate a cluster by catalogue name or path, with optional what-if overrides."""
    return load_cluster_what_if(name, overrides, relative_to)[0]
