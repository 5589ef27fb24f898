"""The ``comminsight`` command line: one Typer app, one module per command group.

Each group lives in its own module and owns its commands; this module only mounts them. The group
modules import Typer and the standard library only; each command imports what it uses (Arrow,
polars, the importers, rich) when it runs, so a command pays only for its own libraries.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import ModuleSpec
from typing import NoReturn

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


class _WithoutPandas:
    """An import finder that answers "not installed" for pandas.

    pyarrow imports pandas, when it is installed, on its first conversion of Python or numpy values
    (to recognise pandas inputs): about 0.25 s of CPU, a third of a small analysis. The report commands
    (``_REPORT_GROUPS``) never give pyarrow a pandas object and pandas is not one of their dependencies, so
    they run as where pandas is absent. Only those commands of the ``comminsight`` process do: other commands
    may run code of the user's that imports pandas, and importing this package changes nothing.
    """

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"No module named {name!r} (the comminsight command runs without it)", name=name)
        return None


# Command groups that print a report and hold nothing else when they return: no threads, child
# processes, temporary files or buffered logs. They run without pandas and end without the interpreter's teardown.
_REPORT_GROUPS = frozenset({"analyze"})


def _exit_now(code: int) -> NoReturn:
    """End the process once stdout and stderr are flushed, without the interpreter's teardown.

    With Arrow, polars and numpy loaded, freeing every module's objects at exit costs about 0.06 s of
    CPU, an eighth of a small analysis, and a report command has nothing to clean up (mypy ends the
    same way). A failed flush exits 120, as the interpreter does when it cannot flush stdout.
    """
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        code = code or 120
    os._exit(code)


def main() -> None:
    """Entry point of the ``comminsight`` console script."""
    report = bool(sys.argv[1:2]) and sys.argv[1] in _REPORT_GROUPS
    if report and "pandas" not in sys.modules:
        sys.meta_path.insert(0, _WithoutPandas())
    try:
        app()
    except SystemExit as done:
        if report and (done.code is None or isinstance(done.code, int)):
            _exit_now(done.code or 0)
        raise


def agent_main() -> None:
    """Entry point of ``comminsight-agent`` (what the profiler autostarts): ``comminsight agent run``."""
    agent.app(["run"])
