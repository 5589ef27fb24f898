"""The operations table: the one columnar schema every importer produces and every analysis reads.

One row is one collective or point-to-point operation as seen by one rank. The spec,
with the meaning of every column, is docs/formats/evidence.md; bump SCHEMA_VERSION on
any incompatible change. Importers build whole columns (Arrow arrays) and call
``conform`` once; nothing here works row by row.
"""

from __future__ import annotations

import pyarrow as pa

from comminsight.evidence import compute

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
    "compute",
    "other",
    "progress",
)
# "compute" rows carry non-communication spans (forward/backward/optimizer) when a source has
# them, e.g. per-operation tables; analyses that only need communication filter them out.
# "progress" rows are not operations but watermarks a source reported about a sequence
# ("this rank has completed everything up to seq N on this communicator", e.g. Flight
# Recorder's pg_status); their state says which watermark. Only progress/hang analyses use
# them; everything else should drop them (see PROGRESS_OP).
PROGRESS_OP = "progress"

# Lifecycle states, in order of progress.
STATES = ("scheduled", "enqueued", "started", "completed", "abandoned")


def _field(name: str, type_: pa.DataType, doc: str, nullable: bool = True) -> pa.Field:
    return pa.field(name, type_, nullable=nullable, metadata={b"doc": doc.encode()})


SCHEMA = pa.schema(
    [
        _field("workload", pa.string(), doc="Workload (job) id; empty when unknown"),
        _field("node", pa.string(), doc="Node identity (NODE_IP/HOST_IP or host name)"),
        _field("host", pa.string(), doc="Host name"),
        _field("rank", pa.int32(), nullable=False, doc="Global rank of the process"),
        _field("pid", pa.int32(), doc="Process id"),
        _field("device", pa.int32(), doc="CUDA device index"),
        _field("comm_id", pa.string(), nullable=False, doc="Communicator / process-group id (commHash hex, pg name)"),
        _field("comm_name", pa.string(), doc="Communicator name (commName, pg name)"),
        _field("comm_desc", pa.string(), doc="Group description, e.g. Megatron's TENSOR_MODEL_PARALLEL_GROUP"),
        _field("comm_size", pa.int32(), doc="Number of ranks in the communicator"),
        _field("comm_ranks", pa.list_(pa.int32()), doc="Global ranks of members, in communicator order, if known"),
        _field("comm_rank", pa.int32(), doc="This rank's index inside the communicator"),
        _field("op", pa.string(), nullable=False, doc="Normalised op, one of OPS"),
        _field("is_p2p", pa.bool_(), nullable=False, doc="Point-to-point (own sequence space)"),
        _field("seq", pa.int64(), doc="Per-communicator sequence; collectives and P2P counted apart"),
        _field("seq_kind", pa.string(), doc="How seq counts: 'comm' (all collectives), 'func' (per op type), 'p2p'"),
        _field("count", pa.int64(), doc="Element count"),
        _field("bytes", pa.int64(), doc="Payload bytes"),
        _field("dtype", pa.string(), doc="Data type, normalised lower case (float32, bfloat16, ...)"),
        _field("shape", pa.string(), doc="Input shape(s) as text, e.g. '[[4027, 5120]]'"),
        _field("peer", pa.int32(), doc="P2P peer (global rank when known) or collective root; null when none"),
        _field("state", pa.string(), nullable=False, doc="One of STATES"),
        _field("enqueue_ns", pa.int64(), doc="CPU enqueue time, ns since epoch"),
        _field("start_ns", pa.int64(), doc="Execution start (GPU or CPU-observed), ns since epoch"),
        _field("end_ns", pa.int64(), doc="Execution end, ns since epoch"),
        _field("stream", pa.int64(), doc="CUDA stream handle or id"),
        _field("algo", pa.string(), doc="NCCL algorithm"),
        _field("proto", pa.string(), doc="NCCL protocol"),
        _field("n_channels", pa.int32(), doc="NCCL channels used"),
        _field("step", pa.int64(), doc="Training step label when the source carries one"),
        _field("dp_rank", pa.int32(), doc="Data-parallel coordinate when known"),
        _field("pp_rank", pa.int32(), doc="Pipeline stage when known"),
        _field("tp_rank", pa.int32(), doc="Tensor-parallel coordinate when known"),
        _field("cp_rank", pa.int32(), doc="Context-parallel (DSP) coordinate when known"),
        _field("record_id", pa.int64(), doc="Source record number, for tracing back"),
        _field("source", pa.string(), nullable=False, doc="Importer: rawlog, archive, flight_recorder, kineto, ..."),
    ],
    metadata={b"comminsight.schema_version": SCHEMA_VERSION.encode()},
)


_FIELDS = tuple(SCHEMA)  # built once: iterating the schema makes a Field object per column each time


def empty_table() -> pa.Table:
    """An operations table with no rows."""
    return SCHEMA.empty_table()


def conform(table: pa.Table) -> pa.Table:
    """Return ``table`` with exactly SCHEMA's columns, in order, cast to SCHEMA's types.

    Missing nullable columns are filled with nulls. Raises ``ValueError`` naming the
    column when a non-nullable column is missing or holds nulls, or a cast fails.
    """
    n = table.num_rows
    present = frozenset(table.column_names)
    columns = []
    for field in _FIELDS:
        if field.name in present:
            column = table.column(field.name)
            try:
                if column.type != field.type:
                    column = compute.cast(column, field.type)
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
