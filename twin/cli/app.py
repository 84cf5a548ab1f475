"""The `twin` application: every command registered once, each wrapped in the one error path."""

from __future__ import annotations

import typer

from twin.cli.calibrate_cmds import bench, calibrate_command, loop
from twin.cli.execute_cmd import execute
from twin.cli.fidelity_cmd import fidelity
from twin.cli.fleet_cmd import fleet_command
from twin.cli.options import user_errors
from twin.cli.plan_cmds import presets, schema, show, validate
from twin.cli.predict_cmd import predict
from twin.cli.run_cmd import run_command
from twin.cli.search_cmd import search_command
from twin.cli.trace_cmd import trace

app = typer.Typer(
    name="twin",
    help="ClusterTwin: predict, simulate and execute training plans on clusters up to 100k GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command()(user_errors(validate))
app.command()(user_errors(show))
app.command()(user_errors(predict))
app.command()(user_errors(trace))
app.command("run")(user_errors(run_command))
app.command("search")(user_errors(search_command))
app.command("fleet")(user_errors(fleet_command))
app.command()(user_errors(fidelity))
app.command()(schema)
app.command()(presets)
app.command()(user_errors(execute))
app.command()(user_errors(bench))
app.command("calibrate")(user_errors(calibrate_command))
app.command()(user_errors(loop))


def main() -> None:
    app()
