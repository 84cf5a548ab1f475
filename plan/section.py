"""The base of every plan and cluster section: immutable, unknown keys rejected, field docstrings as descriptions."""

from __future__ import annotations

import functools
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class Section(BaseModel):
    """Base of every plan section: immutable, unknown keys rejected, field docstrings become descriptions."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False, strict=False
    )


class UserSection(Section):
    """A section of a file users write (plans and clusters): values are taken as written, as the JSON Schema that
    `twin schema` prints takes them — a number must be a number (not `"4"`, not `true`), a boolean a boolean (not
    `yes`, not `1`) — so that the loader and an editor checking the file against the schema agree. A YAML list is
    accepted where a tuple is declared."""

    model_config = ConfigDict(strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _as_written(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        if isinstance(value, bool) and bool not in _field_kinds(cls, info.field_name or ""):
            raise ValueError(f"got the boolean {str(value).lower()}, but this field is not true/false")
        if isinstance(value, list | dict):
            return _lists_as_tuples(value, field.annotation)
        return value


@functools.cache
def _field_kinds(cls: type[BaseModel], name: str) -> frozenset[type]:
    """The Python types a section's field admits, worked out once per field: a search validates thousands of
    plans, and walking each annotation again was a tenth of its time."""
    return frozenset(_kinds(cls.model_fields[name].annotation))


def _lists_as_tuples(value: Any, annotation: Any) -> Any:
    """`value` with each YAML list turned into a tuple where `annotation` declares one, also as a mapping's values
    (e.g. `dict[str, tuple[...]]`); strict pydantic takes no list for a tuple."""
    if isinstance(value, list) and tuple in _kinds(annotation):
        return tuple(value)
    if isinstance(value, dict):
        for arg in _dict_value_types(annotation):
            return {key: _lists_as_tuples(item, arg) for key, item in value.items()}
    return value


def _dict_value_types(annotation: Any) -> list[Any]:
    """The value types of the `dict[K, V]` members of an annotation (unions and Annotated looked through)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _dict_value_types(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [v for arg in get_args(annotation) for v in _dict_value_types(arg)]
    if origin is dict:
        return [get_args(annotation)[1]]
    return []


def _kinds(annotation: Any) -> set[type]:
    """The Python types an annotation admits: union members, Annotated's base, Literal values' types, generics'
    origins."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _kinds(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return set().union(*(_kinds(arg) for arg in get_args(annotation)))
    if origin is Literal:
        return {type(arg) for arg in get_args(annotation)}
    if origin is not None:
        return {origin} if isinstance(origin, type) else set()
    return {annotation} if isinstance(annotation, type) else set()
