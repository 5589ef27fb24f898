"""The operations table: the one columnar schema every importer produces and every analysis reads.

One row is one collective or point-to-point operation as seen by one rank. The spec,
with the meaning of every column, is docs/formats/evidence.md; bump SCHEMA_VERSION on
any incompatible change. Importers build whole columns (Arrow arrays) and call
``conform`` once; nothing here works row by row.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = "1"

# Normalised operation names (lower snake case). Importers map source spellings onto these.
OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "send",
    "recv",
    "barrier",
    "gather",
    "scatter",
    "coalesced",
    "other",
)

# Lifecycle states, in order of progress.
STATES = ("scheduled", "enqueued", "started", "completed", "abandoned")

SCHEMA = pa.schema(
    [
        pa.field("workload", pa.string(), doc="Workload (job) id; empty when unknown"),
        pa.field("node", pa.string(), doc="Node identity (NODE_IP/HOST_IP or host name)"),
        pa.field("host", pa.string(), doc="Host name"),
        pa.field("rank", pa.int32(), nullable=False, doc="Global rank of the process"),
        pa.field("pid", pa.int32(), doc="Process id"),
        pa.field("device", pa.int32(), doc="CUDA device index"),
        pa.field("comm_id", pa.string(), nullable=False, doc="Communicator / process-group id (commHash hex, pg name)"),
        pa.field("comm_name", pa.string(), doc="Communicator name (commName, pg name)"),
        pa.field("comm_desc", pa.string(), doc="Group description, e.g. Megatron's TENSOR_MODEL_PARALLEL_GROUP"),
        pa.field("comm_size", pa.int32(), doc="Number of ranks in the communicator"),
        pa.field("comm_ranks", pa.list_(pa.int32()), doc="Global ranks of the members, in communicator order, when known"),
        pa.field("comm_rank", pa.int32(), doc="This rank's index inside the communicator"),
        pa.field("op", pa.string(), nullable=False, doc="Normalised op, one of OPS"),
        pa.field("is_p2p", pa.bool_(), nullable=False, doc="Point-to-point (own sequence space)"),
        pa.field("seq", pa.int64(), doc="Per-communicator sequence; collectives and P2P counted apart"),
        pa.field("seq_kind", pa.string(), doc="How seq counts: 'comm' (all collectives), 'func' (per op type), 'p2p'"),
        pa.field("count", pa.int64(), doc="Element count"),
        pa.field("bytes", pa.int64(), doc="Payload bytes"),
        pa.field("dtype", pa.string(), doc="Data type, normalised lower case (float32, bfloat16, ...)"),
        pa.field("shape", pa.string(), doc="Input shape(s) as text, e.g. '[[4027, 5120]]'"),
        pa.field("peer", pa.int32(), doc="P2P peer (global rank when known) or collective root; null when none"),
        pa.field("state", pa.string(), nullable=False, doc="One of STATES"),
        pa.field("enqueue_ns", pa.int64(), doc="CPU enqueue time, ns since epoch"),
        pa.field("start_ns", pa.int64(), doc="Execution start (GPU or CPU-observed), ns since epoch"),
        pa.field("end_ns", pa.int64(), doc="Execution end, ns since epoch"),
        pa.field("stream", pa.int64(), doc="CUDA stream handle or id"),
        pa.field("algo", pa.string(), doc="NCCL algorithm"),
        pa.field("proto", pa.string(), doc="NCCL protocol"),
        pa.field("n_channels", pa.int32(), doc="NCCL channels used"),
        pa.field("step", pa.int64(), doc="Training step label when the source carries one"),
        pa.field("dp_rank", pa.int32(), doc="Data-parallel coordinate when known"),
        pa.field("pp_rank", pa.int32(), doc="Pipeline stage when known"),
        pa.field("tp_rank", pa.int32(), doc="Tensor-parallel coordinate when known"),
        pa.field("record_id", pa.int64(), doc="Source record number, for tracing back"),
        pa.field("source", pa.string(), nullable=False, doc="rawlog, archive, flight_recorder, kineto, nccl_inspector, table"),
    ],
    metadata={b"comminsight.schema_version": SCHEMA_VERSION.encode()},
)


def empty_table() -> pa.Table:
    """An operations table with no rows."""
    return SCHEMA.empty_table()


def conform(table: pa.Table) -> pa.Table:
    """Return ``table`` with exactly SCHEMA's columns, in order, cast to SCHEMA's types.

    Missing nullable columns are filled with nulls. Raises ``ValueError`` naming the
    column when a non-nullable column is missing or holds nulls, or a cast fails.
    """
    n = table.num_rows
    columns = []
    for field in SCHEMA:
        if field.name in table.column_names:
            column = table.column(field.name)
            try:
                column = column.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise ValueError(f"column {field.name!r} cannot be read as {field.type}: {exc}") from exc
        elif field.nullable:
            column = pa.nulls(n, field.type)
        else:
            raise ValueError(f"required column {field.name!r} is missing")
        if not field.nullable and column.null_count:
            raise ValueError(f"required column {field.name!r} has {column.null_count} missing values")
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=SCHEMA)
