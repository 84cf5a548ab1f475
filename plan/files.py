"""Reading what users write: YAML files and `--set` values, bounded, and validation errors as one line.

YAML is read as the YAML 1.2 core schema that editors and JSON Schema validators use (`2.0e12` is a number,
`yes` a string), with libyaml's C parser where it is installed. A file is bounded before anything is built from
it: its size, its nesting depth and its values counted with aliases expanded (`Limits`), so a "billion laughs"
stops after a few thousand parser events instead of filling memory. Every failure raises `PlanError`: one line
that names the file, the field path and the fix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from plan.errors import PlanError
from plan.limits import DEFAULT_LIMITS, Limits

__all__ = ["PlanError", "format_validation_error", "parse_override", "read_yaml", "yaml_value"]


def _loc_part(part: object) -> str:
    """A field-path element as written in messages: plain names bare, anything odd JSON-quoted."""
    text = str(part)
    return text if re.fullmatch(r"[\w\-]+", text) else json.dumps(text)


def read_yaml(path: Path, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Read a YAML mapping within `limits`; a missing, unreadable, oversized or malformed file is a PlanError."""
    cap = limits.file_kib * 1024
    try:
        with path.open("rb") as f:  # at most cap + 1 bytes: /dev/zero or a 50 MB file stops here
            raw = f.read(cap + 1)
    except FileNotFoundError:
        raise PlanError(f"{path}: no such file; check the path") from None
    except OSError as exc:
        raise PlanError(f"{path}: cannot read ({exc.strerror or exc}); give a readable plan file") from None
    if len(raw) > cap:
        raise PlanError(
            f"{path}: over {limits.file_kib:,} KiB, the limit on a plan or cluster file (plans are a few KiB); check "
            f"the file, or raise the limit with --limit file_kib=N"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PlanError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); give a UTF-8 text file") from None
    data = yaml_value(text, str(path), limits)
    if not isinstance(data, dict):
        raise PlanError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    return data


_BaseLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's C parser where installed


class _Loader(_BaseLoader):
    """Safe loading with the YAML 1.2 core schema's scalars: `true`/`false` only, `2.0e12` and `1e-7` floats,
    decimal, 0o and 0x integers — what JSON Schema and editors see — instead of YAML 1.1's `yes`, `0755`, `1:30`."""

    yaml_implicit_resolvers: dict[Any, Any] = {}  # noqa: RUF012 — PyYAML's class-level registry, filled below


_CORE_SCALARS = (
    ("tag:yaml.org,2002:bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
    ("tag:yaml.org,2002:null", r"~|null|Null|NULL|", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:int", r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", "-+0123456789"),
    (
        "tag:yaml.org,2002:float",
        r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
        "-+.0123456789",
    ),
    ("tag:yaml.org,2002:merge", r"<<", "<"),  # YAML 1.1's merge key, which plans may use with anchors
)
for _tag, _pattern, _first in _CORE_SCALARS:
    _Loader.add_implicit_resolver(_tag, re.compile(f"^(?:{_pattern})$"), list(_first))


def _core_int(loader: Any, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    return int(text, 0) if text[:2] in ("0o", "0x") else int(text, 10)


def _core_float(loader: Any, node: yaml.ScalarNode) -> float:
    text = str(loader.construct_scalar(node)).lower()
    return float(text.replace(".inf", "inf").replace(".nan", "nan"))


_Loader.add_constructor("tag:yaml.org,2002:int", _core_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _core_float)

LIBYAML_DEPTH = 1000
"""Nesting libyaml's scanner reads, as PyYAML 6.0.4 bundles it ("exceeded maximum nesting depth"; measured: a flow
list 1,000 deep is read, one deeper is refused). Earlier wheels have no cap; the event walk's own limit is lower."""

_OPENS = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSES = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


def yaml_value(text: str, origin: str, limits: Limits = DEFAULT_LIMITS) -> Any:
    """The value a YAML text holds, read safely within `limits`: PlanError (naming `origin`) for malformed YAML,
    nesting past `limits.yaml_depth`, more than `limits.yaml_nodes` values once aliases are expanded, or an alias
    that refers to itself. The bounds are checked on the parser's events, before anything is built."""
    try:
        return _load(text, origin, limits)
    except yaml.YAMLError as exc:
        if "nesting depth" in str(getattr(exc, "problem", "")):  # libyaml's cap: its scanner reads ahead of the
            if limits.yaml_depth < LIBYAML_DEPTH:  # events the walk counts, so it can refuse first
                raise PlanError(_too_deep(origin, limits)) from None
            raise PlanError(
                f"{origin}: YAML nested deeper than libyaml reads ({LIBYAML_DEPTH:,} levels); flatten it"
            ) from None
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise PlanError(f"{origin}: malformed YAML{where}: {problem}; fix the syntax") from None
    except (RecursionError, MemoryError):
        raise PlanError(f"{origin}: YAML too deeply nested or too large to read; write it out plainly") from None


def _load(text: str, origin: str, limits: Limits) -> Any:
    """The value of `text`: yaml.YAMLError if it is malformed, PlanError past a limit."""
    _check_events(text, origin, limits)
    loader = _Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _too_deep(origin: str, limits: Limits) -> str:
    return (
        f"{origin}: YAML nested deeper than {limits.yaml_depth} levels (a plan needs 4); "
        f"flatten it, or raise the limit with --limit yaml_depth=N"
    )


def _check_events(text: str, origin: str, limits: Limits) -> None:
    """Walk the parser's events (no nodes built): depth, values with aliases expanded, self-referring aliases."""
    loader = _Loader(text)
    sizes: dict[str, int] = {}  # expanded values under each anchor seen so far
    stack: list[tuple[str | None, int]] = []  # open collections: their anchor, the count when they opened
    count = 0
    try:
        while loader.check_event():
            event = loader.get_event()
            if isinstance(event, yaml.AliasEvent):
                if event.anchor in {a for a, _ in stack}:
                    raise PlanError(f"{origin}: YAML alias *{event.anchor} refers to itself; write the values out")
                count += sizes.get(str(event.anchor), 1)  # an unknown alias is the composer's error below
            elif isinstance(event, _OPENS):
                count += 1
                stack.append((event.anchor, count))
                if len(stack) > limits.yaml_depth:
                    raise PlanError(_too_deep(origin, limits))
            elif isinstance(event, _CLOSES):
                anchor, opened = stack.pop()
                if anchor is not None:
                    sizes[anchor] = count - opened + 1
            elif isinstance(event, yaml.ScalarEvent):
                count += 1
                if event.anchor is not None:
                    sizes[event.anchor] = 1
            if count > limits.yaml_nodes:
                raise PlanError(
                    f"{origin}: YAML holds more than {limits.yaml_nodes:,} values once its aliases are expanded (a "
                    f"plan holds about 50); write it out plainly, or raise the limit with --limit yaml_nodes=N"
                )
    finally:
        loader.dispose()


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


def parse_override(item: str, limits: Limits = DEFAULT_LIMITS) -> tuple[list[str], Any]:
    """Split `section.field=value` into its path and a YAML-parsed value (`4` is an int, `true` a bool)."""
    key, sep, raw = item.partition("=")
    path = [p for p in key.strip().split(".") if p]
    if not sep or not path:
        raise PlanError(f"--set {item!r}: expected section.field=value, e.g. --set layout.tp=4")
    if not raw.strip():
        return path, ""
    try:
        return path, _load(raw, f"--set {key.strip()}", limits)
    except yaml.YAMLError:
        return path, raw  # not YAML: the text as written (a name, a path)
    except RecursionError:
        raise PlanError(f"--set {key.strip()}: value nested too deeply; write it out plainly") from None


def resolve_file(name: str, catalogue: Path, relative_to: Path | None, unknown: Callable[[], str]) -> Path:
    """The file a plan names: `catalogue`/NAME.yaml, else a YAML path (absolute, or relative to the plan file
    `relative_to`, then to the working directory); PlanError with the message `unknown()` otherwise (written only
    then: it lists the catalogue, which a search resolving thousands of plans should not read each time)."""
    entry = catalogue / f"{name}.yaml"
    if entry.is_file():
        return entry
    path = Path(name)
    candidates = [path] if path.is_absolute() else [Path.cwd() / path]
    if relative_to is not None and not path.is_absolute():
        candidates.insert(0, relative_to.parent / path)
    for candidate in candidates:
        if candidate.suffix in (".yaml", ".yml") and candidate.is_file():
            return candidate
    raise PlanError(unknown())
