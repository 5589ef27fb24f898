"""``comminsight logs``: read the profiler's raw logs and rings back."""

import typer

app = typer.Typer(help="Read the profiler's raw logs and shared-memory rings.", no_args_is_help=True)
