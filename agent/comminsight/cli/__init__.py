"""The ``comminsight`` command line: one Typer app, one module per command group.

Each group lives in its own module and owns its commands; this module only mounts them.
"""

from __future__ import annotations

import typer

from comminsight.cli import agent, analyze, export, importer, inject, logs, simulate
from comminsight.cli.errors import OneLineErrors

app = typer.Typer(
    name="comminsight",
    cls=OneLineErrors,  # every error one line on stderr, whatever the terminal width
    help="Diagnose hangs, stragglers and failures in distributed GPU training.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
app.add_typer(logs.app, name="logs")
app.add_typer(simulate.app, name="simulate")
app.add_typer(analyze.app, name="analyze")
app.add_typer(agent.app, name="agent")
app.add_typer(export.app, name="export")
app.add_typer(inject.app, name="inject")
app.command("import")(importer.import_command)


def main() -> None:
    """Entry point of the ``comminsight`` console script."""
    app()


def agent_main() -> None:
    """Entry point of ``comminsight-agent`` (what the profiler autostarts): ``comminsight agent run``."""
    agent.app(["run"])
