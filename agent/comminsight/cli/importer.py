"""``comminsight import PATH -o OUT.parquet``: normalise any supported evidence into the operations table.

The output is written to a temporary file next to OUT and renamed into place only once complete,
so a failed import never leaves a partial file behind. ``load_evidence`` is also what every
``comminsight analyze ...`` command uses to read its PATH: any importer's input, or a Parquet
file this command wrote.

Arrow, the importers and rich are imported by the functions that use them: the command line mounts
this module at start, and a command that reads no evidence should not pay for them.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from comminsight.cli.errors import fail

if TYPE_CHECKING:
    import pyarrow as pa

_PARQUET_MAGIC = b"PAR1"
_SCHEMA_KEY = b"comminsight.schema_version"


def _conformed_parquet(path: Path) -> bool:
    """True for a Parquet file carrying this project's schema-version key (what ``import`` writes)."""
    if not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            if f.read(4) != _PARQUET_MAGIC:
                return False
    except OSError:
        return False
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowException):
        return False
    return _SCHEMA_KEY in metadata


def load_evidence(path: Path, fmt: str | None = None) -> pa.Table:
    """The operations table for ``path``: an imported Parquet file, or anything an importer reads."""
    from comminsight.importers import EvidenceError, load

    path = Path(path)
    if fmt is None and _conformed_parquet(path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        from comminsight.evidence import SCHEMA_VERSION, conform

        version = (pq.read_schema(path).metadata or {}).get(_SCHEMA_KEY, b"").decode()
        if version != SCHEMA_VERSION:
            raise EvidenceError(f"{path}: operations table schema {version!r}, this version reads {SCHEMA_VERSION!r}")
        try:
            return conform(pq.read_table(path))
        except (ValueError, pa.ArrowException) as exc:
            raise EvidenceError(f"{path}: not a readable operations table: {exc}") from exc
    return load(path, fmt)


def write_parquet(table: pa.Table, output: Path) -> None:
    """Write ``table`` to ``output`` atomically (temporary file in the same directory, then rename)."""
    import pyarrow.parquet as pq

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent)
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, output)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def import_command(
    path: Path = typer.Argument(..., help="Evidence file or directory"),
    output: Path = typer.Option(..., "-o", "--output", help="Parquet file to write"),
    fmt: str | None = typer.Option(
        None, "--format", help="Force an importer (flight_recorder, kineto, nccl_inspector, rawlog, ...)"
    ),
) -> None:
    """Import evidence into the normalised operations table (Parquet)."""
    import pyarrow.compute as pc
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from comminsight.importers import EvidenceError, detect

    err = Console(stderr=True)
    started = time.perf_counter()
    try:
        with Progress(
            SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err, transient=True
        ) as progress:
            if fmt is None and not _conformed_parquet(path):
                task = progress.add_task(f"detecting the format of {path}", total=None)
                name = detect(path).name
            else:
                task = progress.add_task("reading", total=None)
                name = fmt or "operations table"
            progress.update(task, description=f"reading {path} as {name}")
            table = load_evidence(path, fmt)
            progress.update(task, description=f"writing {table.num_rows} operations to {output}")
            write_parquet(table, output)
    except EvidenceError as exc:
        fail(exc)
    except OSError as exc:
        fail(exc)
    elapsed = time.perf_counter() - started
    ranks = pc.count_distinct(table.column("rank")).as_py() if table.num_rows else 0
    err.print(f"wrote {table.num_rows} operations from {ranks} rank(s) ({name}) to {output} in {elapsed:.2f}s")


def known_formats() -> list[str]:
    """Names of the registered importers."""
    from comminsight.importers import importers

    return [i.name for i in importers()]
