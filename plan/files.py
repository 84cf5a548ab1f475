"""Reading what users write: YAML files with `safe_load`, `--set` overrides, and validation errors as one line.

Every failure here raises `PlanError`: one line that names the file, the field path and the fix.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError


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
