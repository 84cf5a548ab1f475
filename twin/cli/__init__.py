"""The `twin` command: thin front doors over the Python API (`twin.api`), one module per command group.

`twin.cli.app` assembles the Typer application; `options` holds what every command shares (option types, the
one error path); `launch` is the only place the executor is started. This package's own import is light, so
`twin.api` can use the launcher without pulling in every command.
"""
