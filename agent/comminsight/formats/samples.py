"""The device and NIC counter samples table an archive carries (``metrics/samples-<ns>.parquet``).

One long table, specified in docs/formats/archive.md: ``time_ns`` (epoch ns), ``kind`` (``gpu`` or ``nic``),
``device`` (GPU UUID or NIC device name), ``port`` (GPU index for GPUs), ``metric`` (a key of the heartbeat's
``devices``/``nics`` objects, e.g. ``util_pct``, ``rx_bytes_per_s``) and ``value``. The agent's samplers
write it with ``samples_parquet``; the site reads it with ``read_samples``, which checks what it relies on.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

SCHEMA = pa.schema(
    [
        ("time_ns", pa.int64()),
        ("kind", pa.string()),
        ("device", pa.string()),
        ("port", pa.int32()),
        ("metric", pa.string()),
        ("value", pa.float64()),
    ]
)
KINDS = ("gpu", "nic")
MAX_ROWS = 1 << 22  # a table beyond this is refused (the agent keeps at most 200,000 rows per archive)


class SamplesError(ValueError):
    """A samples table that cannot be used (not Parquet, missing or mistyped columns, too large)."""


def samples_parquet(rows: Sequence[tuple[int, str, str, int, str, float]]) -> bytes:
    """Rows (time_ns, kind, device, port, metric, value) as the archive's Parquet table (zstd)."""
    columns = list(zip(*rows, strict=True)) if rows else [[] for _ in SCHEMA]
    table = pa.table({f.name: pa.array(col, f.type) for f, col in zip(SCHEMA, columns, strict=True)})
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def read_samples(data: bytes) -> pa.Table:
    """The samples table of an archive member, with exactly ``SCHEMA``'s columns; rows with an unknown kind,
    a null or a non-finite value are dropped. Raises ``SamplesError`` when the table is unusable."""
    try:
        parquet = pq.ParquetFile(io.BytesIO(data))
        if parquet.metadata.num_rows > MAX_ROWS:
            raise SamplesError(f"{parquet.metadata.num_rows} rows (at most {MAX_ROWS})")
        table = parquet.read()
    except (pa.ArrowException, OSError) as exc:
        raise SamplesError(f"not a Parquet table: {exc}") from exc
    missing = [f.name for f in SCHEMA if f.name not in table.column_names]
    if missing:
        raise SamplesError(f"missing column(s) {', '.join(missing)}")
    try:
        table = pa.table({f.name: table.column(f.name).cast(f.type) for f in SCHEMA})
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise SamplesError(f"a column has the wrong type: {exc}") from exc
    value = table.column("value")
    keep = pc.and_(
        pc.is_in(table.column("kind"), value_set=pa.array(KINDS)),
        pc.and_(pc.is_valid(value), pc.is_finite(pc.fill_null(value, math.nan))),
    )
    keep = pc.and_(keep, pc.and_(pc.is_valid(table.column("time_ns")), pc.is_valid(table.column("device"))))
    return table.filter(pc.fill_null(keep, False))
