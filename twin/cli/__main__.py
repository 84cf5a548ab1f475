"""`python -m twin.cli` is the `twin` command."""

from twin.cli.app import main

main()
