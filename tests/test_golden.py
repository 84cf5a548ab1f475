"""Golden summaries: `twin predict` and a seeded `twin run` of every preset, pinned field by field.

A change that moves any of these figures must update `tests/golden/*.json` in the same commit and say why in its
message; a change that should not move them (a refactor, a file move) proves it by leaving them untouched.
Tolerance: 1e-9 relative (the models are deterministic; this only absorbs float re-association).

Regenerate with `python tests/test_golden.py` (writes every golden file from the current code).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from plan import loader
from twin.api import predict, simulate_run

GOLDEN = Path(__file__).parent / "golden"
REL_TOL = 1e-9
RUN_SEED = 0


def predict_summary(name: str) -> dict[str, Any]:
    out = predict(loader.load(name)).to_json()
    out.pop("collectives")  # a display table; its seconds are inside breakdown_s
    return out


def run_summary(name: str) -> dict[str, Any]:
    return simulate_run(loader.load(name), seed=RUN_SEED).to_json()


def compare(actual: Any, expected: Any, path: str = "") -> list[str]:
    """Field-by-field differences beyond REL_TOL, as 'path: actual != expected'."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        diffs = [f"{path}: missing key {k}" for k in expected if k not in actual]
        diffs += [f"{path}: new key {k}" for k in actual if k not in expected]
        for key in expected.keys() & actual.keys():
            diffs += compare(actual[key], expected[key], f"{path}.{key}" if path else key)
        return diffs
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{path}: {len(actual)} entries != {len(expected)}"]
        return [d for i, (a, e) in enumerate(zip(actual, expected, strict=True)) for d in compare(a, e, f"{path}[{i}]")]
    if isinstance(expected, float) or isinstance(actual, float):
        numbers = isinstance(expected, (int, float)) and isinstance(actual, (int, float))
        if numbers and (actual == expected or math.isclose(actual, expected, rel_tol=REL_TOL, abs_tol=1e-12)):
            return []
        return [f"{path}: {actual!r} != {expected!r}"]
    return [] if actual == expected else [f"{path}: {actual!r} != {expected!r}"]


def golden_file(kind: str, name: str) -> Path:
    return GOLDEN / kind / f"{name}.json"


def check(kind: str, name: str, actual: dict[str, Any]) -> None:
    path = golden_file(kind, name)
    assert path.is_file(), f"{path} is missing; run `python tests/test_golden.py` and commit it"
    expected = json.loads(path.read_text())
    actual = json.loads(json.dumps(actual, default=float))  # the same JSON round trip the file went through
    diffs = compare(actual, expected)
    assert not diffs, f"{kind} of {name} moved from its golden summary:\n" + "\n".join(diffs[:20])


@pytest.mark.parametrize("name", loader.plan_presets())
def test_prediction_matches_golden(name: str) -> None:
    check("predict", name, predict_summary(name))


@pytest.mark.parametrize("name", loader.plan_presets())
def test_seeded_run_matches_golden(name: str) -> None:
    check("run", name, run_summary(name))


def test_compare_reports_what_moved() -> None:
    assert compare({"a": 1.0, "b": [1, 2]}, {"a": 1.0, "b": [1, 2]}) == []
    assert compare({"a": 1.0 + 1e-12}, {"a": 1.0}) == []
    assert compare({"a": 1.001}, {"a": 1.0}) == ["a: 1.001 != 1.0"]
    assert compare({"a": {"b": 2}}, {"a": {"b": 3}}) == ["a.b: 2 != 3"]
    assert compare({"a": [1]}, {"a": [1, 2]}) == ["a: 1 entries != 2"]
    assert compare({}, {"x": 1}) == [": missing key x"]


def write_all() -> None:
    for name in loader.plan_presets():
        for kind, summary in (("predict", predict_summary), ("run", run_summary)):
            path = golden_file(kind, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(summary(name), indent=1, sort_keys=True, default=float) + "\n")
            print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(write_all())
