"""``comminsight logs``: read the profiler's raw logs and rings back.

``comminsight logs show PATH`` prints one line per operation (JSON Lines by default, or a table)
from a segment file, a ring file, or a directory of them. The records become an Arrow table with
one vectorised read; the output columns are derived with Arrow compute, not per record in Python.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path

import typer

from comminsight.cli.errors import fail

app = typer.Typer(help="Read the profiler's raw logs and shared-memory rings.", no_args_is_help=True)


class OutputFormat(str, Enum):
    """How ``logs show`` prints."""

    jsonl = "jsonl"
    table = "table"


@app.command("show")
def show(
    path: Path = typer.Argument(..., help="A segment (.cilog/.cilog.sealed), a ring file, or a directory of them."),
    output: OutputFormat = typer.Option(
        OutputFormat.jsonl, "--format", "-f", help="jsonl (one object a line) or table."
    ),
    limit: int = typer.Option(0, "--limit", "-n", min=0, help="Print at most this many operations (0: all)."),
) -> None:
    """Print every operation recorded under PATH."""
    import polars as pl
    import pyarrow as pa
    from rich.console import Console
    from rich.table import Table

    from comminsight.formats import rawlog

    err = Console(stderr=True)
    try:
        files = rawlog.segment_files(path)
        segments = [rawlog.read_any(f) for f in files]
    except (rawlog.RawLogError, OSError) as exc:
        fail(exc)
    tables = [s.table for s in segments if s.table.num_rows]
    records = pa.concat_tables(tables, promote_options="default") if tables else pa.table({})
    view = rawlog.operations_view(records)
    if limit:
        view = view.slice(0, limit)
    skipped = sum(s.invalid_records for s in segments)
    torn = sum(1 for s in segments if s.torn_bytes)
    if skipped or torn:
        err.print(f"[yellow]note:[/yellow] skipped {skipped} corrupt record(s); {torn} segment(s) end in a torn record")
    if output is OutputFormat.jsonl:
        if view.num_rows:
            sys.stdout.write(pl.DataFrame(view).write_ndjson())
        return
    table = Table(show_lines=False)
    shown = ["comm_hash", "rank", "nranks", "func", "seq", "bytes", "dtype", "peer", "root", "state"]
    shown += ["enqueue_ns", "gpu_start_ns", "gpu_end_ns"]
    for name in shown:
        table.add_column(name, no_wrap=True)
    for row in zip(*(view[name].to_pylist() for name in shown), strict=True):
        cells = ["" if v is None else str(v) for v in row]
        cells[0] = f"{row[0]:016x}"  # commHash reads best in hex
        table.add_row(*cells)
    console = Console()
    # wide enough for nanosecond timestamps whatever the terminal
    Console(width=max(console.width, 200)).print(table)
