"""JSON Schemas of the plan, cluster and run-record files, for editors and external validators."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

from plan.cluster import Cluster
from plan.loader import model_presets
from plan.records import Record, RunManifest
from plan.schema import Plan


def plan_schema() -> dict[str, Any]:
    """The plan's schema, where `model` may also be a model preset's name and `cluster` a cluster's name or path,
    as plan files allow."""
    schema = Plan.model_json_schema()
    _or_string(schema, "model", {"type": "string", "enum": model_presets(), "description": "a model preset name"})
    _or_string(schema, "cluster", {"type": "string", "description": "a cluster name in topologies/ or a file path"})
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
        "cluster": Cluster.model_json_schema,
        "record": lambda: TypeAdapter(Record).json_schema(),
        "manifest": RunManifest.model_json_schema,
    }
    if kind not in builders:
        raise ValueError(f"unknown schema {kind!r}; choose one of {', '.join(builders)}")
    return builders[kind]()
