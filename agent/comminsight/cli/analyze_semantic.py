"""``comminsight analyze steps|stragglers|perf``."""

import typer


def register(app: typer.Typer) -> None:
    """Mount the step, straggler and performance commands on ``app``."""
