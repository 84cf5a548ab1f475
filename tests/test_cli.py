"""The `twin` command's front door: exit codes, one-line errors, exactly one JSON object, the JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from plan import loader
from twin.cli.app import app

runner = CliRunner()
BROKEN = sorted((Path(__file__).parent / "data" / "broken").glob("*.yaml"))


@pytest.mark.parametrize("name", loader.plan_presets())
def test_validate_exits_zero_for_every_preset(name: str) -> None:
    result = runner.invoke(app, ["validate", name])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("ok:")


@pytest.mark.parametrize("path", BROKEN, ids=[p.stem for p in BROKEN])
def test_validate_broken_plan_one_line_no_traceback(path: Path) -> None:
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.output
    field = path.read_text().splitlines()[0].removeprefix("# expect: ") if path.read_text() else "mapping"
    assert field in lines[0]


@pytest.mark.parametrize("command", ["validate", "show"])
def test_json_flag_prints_exactly_one_object(command: str) -> None:
    result = runner.invoke(app, [command, "reference-100k", "--json", "--set", "training.tokens=1e12"])
    assert result.exit_code == 0, result.output
    obj = json.loads(result.stdout)  # raises if there is anything but one JSON document
    assert isinstance(obj, dict)
    plan = obj.get("plan")
    if isinstance(plan, dict):
        assert plan["training"]["tokens"] == 1e12


def test_json_error_is_one_object_and_nonzero() -> None:
    result = runner.invoke(app, ["validate", "cpu-tiny", "--json", "--set", "layout.tp=3"])
    assert result.exit_code == 2
    obj = json.loads(result.stdout)
    assert obj["ok"] is False and "layout.tp" in obj["error"]


def test_show_table_lists_sections_and_derived_sizes() -> None:
    result = runner.invoke(app, ["show", "llama3-405b-16k"])
    assert result.exit_code == 0, result.output
    for needle in ("layout.tp", "training.global_batch", "world_size", "16,384"):
        assert needle in result.stdout


def test_presets_lists_every_kind() -> None:
    obj = json.loads(runner.invoke(app, ["presets", "--json"]).stdout)
    assert "reference-100k" in obj["plans"] and "tiny" in obj["models"] and "localhost-cpu" in obj["clusters"]


def plan_schema() -> dict:
    result = runner.invoke(app, ["schema"])
    assert result.exit_code == 0
    return json.loads(result.stdout)


@pytest.mark.parametrize("name", loader.plan_presets())
def test_schema_validates_every_preset_plan_file(name: str) -> None:
    data = yaml.safe_load((loader.PRESET_DIR / "plans" / f"{name}.yaml").read_text())
    jsonschema.validate(data, plan_schema())


@pytest.mark.parametrize(
    "stem",
    [
        "unknown-key-top",
        "unknown-key-layout",
        "wrong-type-tokens",
        "bad-schedule",
        "bad-dtype",
        "negative-dp",
    ],
)
def test_schema_rejects_what_the_loader_rejects_structurally(stem: str) -> None:
    data = yaml.safe_load((Path(__file__).parent / "data" / "broken" / f"{stem}.yaml").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, plan_schema())


@pytest.mark.parametrize("kind", ["cluster", "record", "manifest"])
def test_other_schemas_are_valid_json_schema(kind: str) -> None:
    result = runner.invoke(app, ["schema", kind])
    assert result.exit_code == 0
    jsonschema.Draft202012Validator.check_schema(json.loads(result.stdout))


def test_cluster_schema_validates_catalogue() -> None:
    schema = json.loads(runner.invoke(app, ["schema", "cluster"]).stdout)
    for path in loader.TOPOLOGY_DIR.glob("*.yaml"):
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)


def test_unknown_schema_kind_exits_two() -> None:
    assert runner.invoke(app, ["schema", "nonsense"]).exit_code == 2
