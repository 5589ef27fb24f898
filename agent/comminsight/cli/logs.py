"""``comminsight logs``: read the profiler's raw logs and rings back.

``comminsight logs show PATH`` prints one line per operation (JSON Lines by default, or a table)
from a segment file, a ring file, or a directory of them. The records become an Arrow table with
one vectorised read; the output columns are derived with Arrow compute, not per record in Python.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import typer
from rich.console import Console
from rich.table import Table

from comminsight.cli.errors import fail

app = typer.Typer(help="Read the profiler's raw logs and shared-memory rings.", no_args_is_help=True)

#: the columns printed per operation, in order
SHOW_COLUMNS = [
    "comm_hash",
    "comm_name",
    "rank",
    "nranks",
    "nnodes",
    "kind",
    "func",
    "seq",
    "count",
    "bytes",
    "dtype",
    "peer",
    "root",
    "algo",
    "proto",
    "n_channels",
    "stream",
    "enqueue_ns",
    "enqueue_end_ns",
    "complete_ns",
    "gpu_start_ns",
    "gpu_end_ns",
    "state",
    "host",
    "pid",
    "tid",
    "cuda_device",
    "record_seq",
]


class OutputFormat(str, Enum):
    """How ``logs show`` prints."""

    jsonl = "jsonl"
    table = "table"


def _names(column: pa.Array, names: dict[int, str]) -> pa.Array:
    keys = pa.array(list(names), pa.uint8())
    values = pa.array(list(names.values()), pa.string())
    return pc.fill_null(pc.take(values, pc.index_in(column, value_set=keys)), "unknown")


def _zero_as_null(column: pa.Array) -> pa.Array:
    return pc.if_else(pc.equal(column, 0), pa.scalar(None, column.type), column)


def operations_view(records: pa.Table) -> pa.Table:
    """The per-operation view of a records table: named states and kinds, peer/root split, 0 times as null."""
    from comminsight.formats import rawlog

    if records.num_rows == 0:
        return pa.table({name: pa.array([], pa.null()) for name in SHOW_COLUMNS})
    records = records.combine_chunks()
    kind = records["kind"]
    is_p2p = pc.equal(kind, 2)
    peer = records["peer"]
    none = pa.scalar(None, peer.type)
    columns = {
        "comm_hash": records["comm_hash"],
        "comm_name": pc.if_else(pc.equal(records["comm_name"], ""), pa.scalar(None, pa.string()), records["comm_name"]),
        "rank": records["rank"],
        "nranks": records["nranks"],
        "nnodes": records["nnodes"],
        "kind": _names(kind, rawlog.KIND_NAMES),
        "func": records["func"],
        "seq": records["seq"],
        "count": records["count"],
        "bytes": records["bytes"],
        "dtype": records["dtype"],
        "peer": pc.if_else(is_p2p, peer, none),
        "root": pc.if_else(pc.and_(pc.invert(is_p2p), pc.greater_equal(peer, 0)), peer, none),
        "algo": records["algo"],
        "proto": records["proto"],
        "n_channels": records["n_channels"],
        "stream": records["stream"],
        "enqueue_ns": records["enqueue_start_ns"],
        "enqueue_end_ns": _zero_as_null(records["enqueue_end_ns"]),
        "complete_ns": _zero_as_null(records["complete_ns"]),
        "gpu_start_ns": _zero_as_null(records["gpu_start_ns"]),
        "gpu_end_ns": _zero_as_null(records["gpu_end_ns"]),
        "state": _names(records["state"], rawlog.STATE_NAMES),
        "host": records["host"],
        "pid": records["pid"],
        "tid": records["tid"],
        "cuda_device": records["cuda_device"],
        "record_seq": records["record_seq"],
    }
    view = pa.table(columns)
    return view.sort_by([("host", "ascending"), ("pid", "ascending"), ("record_seq", "ascending")])


@app.command("show")
def show(
    path: Path = typer.Argument(..., help="A segment (.cilog/.cilog.sealed), a ring file, or a directory of them."),
    output: OutputFormat = typer.Option(
        OutputFormat.jsonl, "--format", "-f", help="jsonl (one object a line) or table."
    ),
    limit: int = typer.Option(0, "--limit", "-n", min=0, help="Print at most this many operations (0: all)."),
) -> None:
    """Print every operation recorded under PATH."""
    from comminsight.formats import rawlog

    err = Console(stderr=True)
    try:
        files = rawlog.segment_files(path)
        segments = [rawlog.read_any(f) for f in files]
    except (rawlog.RawLogError, OSError) as exc:
        fail(exc)
    tables = [s.table for s in segments if s.table.num_rows]
    records = pa.concat_tables(tables, promote_options="default") if tables else pa.table({})
    view = operations_view(records)
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
