"""Issue 14's hostile inputs, each through the `twin` command in-process: every one ends within 5 s with exit 0 and
the answer, or exit 2 and one line naming the problem and the fix (one JSON object with --json), no traceback.

The corpus is tests/data/hostile/: plan files whose `# run: EXIT | TEXT | ARGS` header lines say what to run on them,
and commands.txt for hostile command lines.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from typer.testing import CliRunner

from plan.cache import CACHE_ENV, default_corpus
from plan.files import read_yaml
from twin.cli import calibrate_cmds
from twin.cli.app import app

HOSTILE = Path(__file__).parent / "data" / "hostile"
BUDGET_S = 5.0
"""Each case's budget, in CPU seconds of this process; wall time may take twice that on a shared machine."""
runner = CliRunner()
T = TypeVar("T")


def timed(call: Callable[[], T]) -> tuple[T, float, float]:
    """`call()`'s result, and the CPU and wall seconds it took."""
    cpu, wall = time.process_time(), time.monotonic()
    result = call()
    return result, time.process_time() - cpu, time.monotonic() - wall


def file_cases() -> list[Any]:
    cases = []
    for path in sorted(HOSTILE.glob("*.yaml")):
        for line in path.read_text().splitlines():
            if line.startswith("# run: "):
                code, text, args = (part.strip() for part in line.removeprefix("# run: ").split("|", 2))
                cases.append(pytest.param(int(code), text, args.replace("{file}", str(path)), id=f"{path.stem}:{args}"))
    return cases


def command_cases() -> list[Any]:
    cases = []
    for line in (HOSTILE / "commands.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            code, text, args = (part.strip() for part in line.split("|", 2))
            cases.append(pytest.param(int(code), text, args, id=args[:60]))
    return cases


def check(args: list[str], code: int, text: str) -> None:
    """Run `twin ARGS` in-process; it ends within the budget with `code`, its output holds `text`, and a failure
    is one line (one JSON object with --json), never a traceback."""
    result, cpu, wall = timed(lambda: runner.invoke(app, args))
    assert cpu < BUDGET_S and wall < 2 * BUDGET_S, f"twin {shlex.join(args)} took {cpu:.1f} s CPU, {wall:.1f} s wall"
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert result.exit_code == code, result.output
    if code == 2:
        if "--json" in args:
            obj = json.loads(result.stdout)  # exactly one JSON document
            assert obj["ok"] is False and text in obj["error"], obj
        else:
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
            assert text in lines[0]
    else:
        assert text in result.output


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize(("code", "text", "args"), file_cases())
def test_hostile_plan_file(code: int, text: str, args: str) -> None:
    check(shlex.split(args), code, text)


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize(("code", "text", "args"), command_cases())
def test_hostile_command(code: int, text: str, args: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    check(shlex.split(args.replace("{tmp}", str(tmp_path))), code, text)
    assert not (tmp_path / "runs").exists(), "a refused command left a run directory behind"


@pytest.mark.timeout(60, method="thread")
def test_a_50_mb_plan_is_refused_at_once(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    with big.open("w") as f:
        f.write("schema_version: 1\nmodel: tiny\ncluster: localhost-cpu\nlayout: {dp: 1}\n")
        f.write("training: {global_batch: 16, tokens: 1e6}\ndescription: '" + "x" * (50 << 20) + "'\n")
    check(["validate", str(big)], 2, "--limit file_kib")


@pytest.mark.timeout(60, method="thread")
def test_a_device_file_is_refused_at_once() -> None:
    check(["validate", "/dev/zero"], 2, "/dev/zero")


def test_a_readme_plan_passes_the_schema_as_it_passes_the_loader() -> None:
    import jsonschema
    import yaml

    schema = json.loads(runner.invoke(app, ["schema"]).stdout)
    text = (HOSTILE / "readme-example.yaml").read_text()
    jsonschema.validate(yaml.safe_load(text.replace("2.0e12", "2.0e+12")), schema)  # YAML 1.1 needs the sign
    data = read_yaml(HOSTILE / "readme-example.yaml")  # the loader reads 2.0e12 as the number an editor sees
    assert data["training"]["tokens"] == 2.0e12
    jsonschema.validate(data, schema)
    for bad in (HOSTILE / "dp-true.yaml", HOSTILE / "yes-is-text.yaml", HOSTILE / "number-as-text.yaml"):
        with pytest.raises(jsonschema.ValidationError):  # what the loader refuses, the schema refuses
            jsonschema.validate(read_yaml(bad), schema)


def test_bench_out_resolves_against_the_users_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`twin bench --out relbench` run outside the repo writes to ./relbench, not into the repo, and a benchmark that
    exits 0 without its bench.json says so (it used to say "failed (exit 0)")."""
    seen: dict[str, Any] = {}

    def fake_run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        seen["out"] = cmd[cmd.index("--out") + 1]
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(calibrate_cmds.subprocess, "run", fake_run)
    result = runner.invoke(app, ["bench", "--out", "relbench"])
    assert Path(seen["out"]) == tmp_path / "relbench"
    assert result.exit_code == 2 and "wrote no" in result.stderr and "exit 0" not in result.stderr


def test_the_corpus_lives_in_the_cache_not_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "my-cache"))
    assert default_corpus() == tmp_path / "my-cache" / "corpus" / "synthetic-bytes-v1"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_corpus().is_relative_to(tmp_path / "xdg" / "clustertwin")
    monkeypatch.setenv(CACHE_ENV, "/sys/no-cache-here")  # an unwritable cache is refused before any rank starts
    check(["execute", "cpu-tiny", "--out", str(tmp_path / "run")], 2, CACHE_ENV)
    assert list(tmp_path.iterdir()) == [tmp_path / "xdg"] or not (tmp_path / "corpus").exists()
