"""``comminsight export``: write evidence in other tools' formats."""

from __future__ import annotations

from pathlib import Path

import typer

from comminsight.cli.errors import fail

app = typer.Typer(help="Export evidence to other tools (Perfetto).", no_args_is_help=True)


@app.command("perfetto")
def export_perfetto(
    path: Path = typer.Argument(..., help="Evidence file or directory (any importable format)"),
    output: Path = typer.Option(..., "-o", "--output", help="Trace file to write (.json)"),
    fmt: str | None = typer.Option(None, "--format", help="Force an importer by name instead of detecting it"),
) -> None:
    """Write a Chrome JSON trace (open it in ui.perfetto.dev): a track per rank and stream, flows for P2P."""
    from rich.console import Console

    from comminsight import importers
    from comminsight.export import perfetto

    try:
        table = importers.load(path, fmt)
    except importers.EvidenceError as exc:
        fail(exc)
    events = perfetto.write_trace(table, output)
    Console(stderr=True).print(f"wrote {events} trace events for {table.num_rows} operations to {output}")
