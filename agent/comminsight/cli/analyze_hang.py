"""``comminsight analyze hang``."""

import typer


def register(app: typer.Typer) -> None:
    """Mount the hang/failure analysis commands on ``app``."""
