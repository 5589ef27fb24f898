"""``comminsight import PATH -o OUT.parquet``: normalise any supported evidence into the operations table."""

from pathlib import Path

import typer


def import_command(
    path: Path = typer.Argument(..., help="Evidence file or directory"),
    output: Path = typer.Option(..., "-o", "--output", help="Parquet file to write"),
) -> None:
    """Import evidence into the normalised operations table (Parquet)."""
    raise typer.Exit(2)
