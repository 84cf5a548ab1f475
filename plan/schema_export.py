"""JSON Schemas of the plan, cluster and run-record files, for editors and external validators."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

from plan.cluster import Cluster
from plan.clusters import accelerator_names
from plan.loader import model_presets
from plan.records import Record, RunManifest
from plan.schema import Plan
from plan.stack import Stack


def plan_schema() -> dict[str, Any]:
    """The plan's schema, where `model` may also be a model preset's name and `cluster` and `stack` a name or a
    path, as plan files allow."""
    schema = Plan.model_json_schema()
    _or_string(schema, "model", {"type": "string", "enum": model_presets(), "description": "a model preset name"})
    _or_string(schema, "cluster", {"type": "string", "description": "a cluster name in topologies/ or a file path"})
    _or_string(schema, "stack", {"type": "string", "description": "a stack name in plan/presets/stacks/ or a path"})
    return schema


def cluster_schema() -> dict[str, Any]:
    """The cluster file's schema, where `accelerator` may also name one of topologies/accelerators/ (which then
    brings its `compute` section too)."""
    schema = Cluster.model_json_schema()
    _or_string(
        schema, "accelerator", {"type": "string", "enum": accelerator_names(), "description": "a catalogue accelerator"}
    )
    schema["required"] = [r for r in schema.get("required", []) if r != "compute"]
    return schema


def _or_string(schema: dict[str, Any], field: str, alternative: dict[str, Any]) -> None:
    """Let a section-valued property also be written as a string."""
    prop = schema["properties"][field]
    ref = {k: v for k, v in prop.items() if k == "$ref"} or {"allOf": prop.get("allOf", [])}
    schema["properties"][field] = {"description": prop.get("description", ""), "anyOf": [ref, alternative]}


def json_schema(kind: str) -> dict[str, Any]:
    """The JSON Schema for `plan`, `cluster`, `record` (one records.jsonl line) or `manifest`."""
    builders = {
        "plan": plan_schema,
        "cluster": cluster_schema,
        "stack": Stack.model_json_schema,
        "record": lambda: TypeAdapter(Record).json_schema(),
        "manifest": RunManifest.model_json_schema,
    }
    if kind not in builders:
        raise ValueError(f"unknown schema {kind!r}; choose one of {', '.join(builders)}")
    return builders[kind]()
