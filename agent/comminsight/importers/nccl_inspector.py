"""NCCL Inspector JSON-lines logs -> the operations table.

The NCCL Inspector profiler plugin (NVIDIA/nccl ext-profiler/inspector) writes one file per
process (``<host>-pid<pid>.log``), one JSON object per line and per completed operation:
``header`` (communicator ``id``, ``comm_name``, ``rank`` in it, ``n_ranks``, ``nnodes``),
``metadata`` (format version, ``hostname``, ``pid``, ``dump_timestamp_us``) and either
``coll_perf`` (``coll``, ``coll_sn``, ``coll_msg_size_bytes``, ``coll_exec_time_us``, optional
``coll_algo``/``coll_proto`` and, when verbose, ``event_trace_ts``) or ``p2p_perf`` (``p2p``,
``p2p_sn``, ``p2p_peer``, ...). Newer versions batch: a ``dump_stats`` line carries header and
metadata, and the payload lines after it hold only ``coll_perf``/``p2p_perf``/``proxy_trace``.

The logs carry no global rank: a process's global rank is taken as its rank in the largest
communicator it belongs to (the world communicator in practice). Times come from the verbose
event trace when present (microseconds); without it an operation has no timestamps.

A log is parsed whole by Arrow's JSON reader against a fixed schema of the needed keys and
mapped with compute kernels. Anything that reader cannot vouch for (a JSON null, a value of
another type, an overlong line, a payload before its header) sends the log to the careful
line-by-line reader, which reads it the same way or names the line at fault.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from comminsight.importers import EvidenceError, Importer, directory_holds, evidence_files, register
from comminsight.importers.columns import MAX_ROWS, to_table
from comminsight.importers.normalise import op_name, ops

NAME = "nccl_inspector"
# A log is parsed whole (about 2.5 times its size in memory); with the total cap, an import of logs
# stays under 1 GB of memory.
MAX_FILE_BYTES = 192 << 20
MAX_TOTAL_BYTES = 1 << 30
MAX_LINE_BYTES = 1 << 20
_HEAD = 4096
_PAYLOADS = ("coll_perf", "p2p_perf")
_I64, _STR = pa.int64(), pa.string()
# One row per operation, as both readers produce it.
_ROWS = pa.schema(
    [
        *[("host", _STR), ("pid", _I64), ("comm_id", _STR), ("comm_name", _STR), ("comm_size", _I64)],
        *[("comm_rank", _I64), ("op", _STR), ("is_p2p", pa.bool_()), ("seq", _I64), ("seq_kind", _STR)],
        *[("bytes", _I64), ("peer", _I64), ("enqueue_ns", _I64), ("start_ns", _I64), ("end_ns", _I64)],
        *[("algo", _STR), ("proto", _STR)],
    ]
)
_KERNEL_EVENTS = pa.list_(pa.struct([("kernel_start_ts", _I64), ("kernel_stop_ts", _I64)]))


def _payload(prefix: str, *extra: tuple[str, pa.DataType]) -> pa.StructType:
    trace = pa.struct([(f"{prefix}_start_ts", _I64), ("kernel_events", _KERNEL_EVENTS)])
    fields = [(prefix, _STR), (f"{prefix}_sn", _I64), (f"{prefix}_msg_size_bytes", _I64), *extra]
    return pa.struct([*fields, (f"{prefix}_algo", _STR), (f"{prefix}_proto", _STR), ("event_trace_ts", trace)])


# Only the keys the table needs; any other key is skipped by the parser, a key of another type fails it.
_LINE_SCHEMA = pa.schema(
    [
        ("header", pa.struct([("id", _STR), ("comm_name", _STR), ("rank", _I64), ("n_ranks", _I64)])),
        ("metadata", pa.struct([("hostname", _STR), ("pid", _I64)])),
        ("coll_perf", _payload("coll")),
        ("p2p_perf", _payload("p2p", ("p2p_peer", _I64))),
    ]
)
_PARSE_OPTIONS = pa_json.ParseOptions(explicit_schema=_LINE_SCHEMA, unexpected_field_behavior="ignore")
_READ_OPTIONS = pa_json.ReadOptions(block_size=4 * MAX_LINE_BYTES)


def _is_log(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.read(_HEAD)
    except OSError:
        return False
    first = head.lstrip().split(b"\n", 1)[0]
    return first.startswith(b"{") and b'"header"' in first and b'"metadata"' in first


def _logs(path: Path) -> list[Path]:
    return evidence_files(path, _is_log)


def detect(path: Path) -> bool:
    """An Inspector log (first line holds ``header`` and ``metadata``), or a directory of them."""
    if path.is_file():
        return _is_log(path)
    if path.is_dir():
        return directory_holds(path, _is_log)
    return False


def _uint(value: Any, what: str, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EvidenceError(f"{where}: {what} must be a non-negative integer, found {value!r:.40}")
    return value


def _read_lines(path: Path, data: bytes) -> pa.Table:
    """The careful reader: line by line, every value checked, errors naming the line (see ``_read``)."""
    columns: dict[str, list] = {name: [] for name in _ROWS.names}
    header: dict | None = None
    metadata: dict | None = None
    with io.BytesIO(data) as f:
        for number, line in enumerate(f, 1):
            where = f"{path}:{number}"
            if len(line) > MAX_LINE_BYTES:
                raise EvidenceError(f"{where}: line longer than {MAX_LINE_BYTES} bytes")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as exc:
                raise EvidenceError(f"{where}: not JSON: {exc}") from exc
            if not isinstance(record, dict):
                raise EvidenceError(f"{where}: each line must be a JSON object")
            if "header" in record:
                header, metadata = record.get("header"), record.get("metadata")
                if not isinstance(header, dict) or not isinstance(metadata, dict):
                    raise EvidenceError(f"{where}: 'header' and 'metadata' must be objects")
            kind = next((k for k in _PAYLOADS if k in record), None)
            if kind is None:
                continue  # dump_stats markers, proxy traces
            if header is None or metadata is None:
                raise EvidenceError(f"{where}: {kind} before any header")
            payload = record[kind]
            if not isinstance(payload, dict):
                raise EvidenceError(f"{where}: {kind} must be an object")
            prefix = "coll" if kind == "coll_perf" else "p2p"
            func = payload.get(prefix)
            if not isinstance(func, str):
                raise EvidenceError(f"{where}: {kind}.{prefix} must be the operation name")
            comm = header.get("id")
            if not isinstance(comm, str) or not comm:
                raise EvidenceError(f"{where}: header.id must be the communicator id")
            comm_rank = _uint(header.get("rank"), "header.rank", where)
            n_ranks = _uint(header.get("n_ranks"), "header.n_ranks", where)
            trace_value = payload.get("event_trace_ts")
            trace: dict = trace_value if isinstance(trace_value, dict) else {}
            kernels = [k for k in trace.get("kernel_events", []) or [] if isinstance(k, dict)]
            starts = [k["kernel_start_ts"] for k in kernels if isinstance(k.get("kernel_start_ts"), int)]
            stops = [k["kernel_stop_ts"] for k in kernels if isinstance(k.get("kernel_stop_ts"), int)]
            enqueue = trace.get(f"{prefix}_start_ts")
            name = header.get("comm_name")
            columns["host"].append(str(metadata.get("hostname")) if metadata.get("hostname") is not None else None)
            columns["pid"].append(_uint(metadata.get("pid"), "metadata.pid", where))
            columns["comm_id"].append(comm)
            columns["comm_name"].append(name if isinstance(name, str) and name != "unknown" else None)
            columns["comm_size"].append(n_ranks)
            columns["comm_rank"].append(comm_rank)
            columns["op"].append(op_name(func))
            columns["is_p2p"].append(kind == "p2p_perf")
            columns["seq"].append(_uint(payload.get(f"{prefix}_sn"), f"{prefix}_sn", where))
            # NCCL numbers collectives per function per communicator.
            columns["seq_kind"].append("func" if kind == "coll_perf" else "p2p")
            columns["bytes"].append(_uint(payload.get(f"{prefix}_msg_size_bytes"), "msg size", where))
            columns["peer"].append(_uint(payload.get("p2p_peer"), "p2p_peer", where) if kind == "p2p_perf" else None)
            columns["enqueue_ns"].append(enqueue * 1000 if isinstance(enqueue, int) and enqueue > 0 else None)
            columns["start_ns"].append(min(starts) * 1000 if starts else None)
            columns["end_ns"].append(max(stops) * 1000 if stops else None)
            algo, proto = payload.get(f"{prefix}_algo"), payload.get(f"{prefix}_proto")
            columns["algo"].append(algo if isinstance(algo, str) and algo != "unknown" else None)
            columns["proto"].append(proto if isinstance(proto, str) and proto != "unknown" else None)

    try:
        return pa.table(columns, schema=_ROWS)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
        raise EvidenceError(f"{path}: a value is out of range or of the wrong type: {exc}") from exc


def _longest_line(data: bytes) -> int:
    """Bytes in the longest line, newline included (vectorised over the whole file)."""
    ends = np.flatnonzero(np.frombuffer(data, np.uint8) == ord("\n"))
    bounds = np.concatenate(([-1], ends, [len(data) - 1]))
    return int(np.diff(bounds).max()) if len(data) else 0


def _all_nonnegative(*arrays: pa.Array) -> bool:
    minima = [pc.min(a).as_py() for a in arrays]
    return all(m is None or m >= 0 for m in minima)


def _read_columnar(data: bytes) -> pa.Table | None:
    """The whole log parsed at once by Arrow's JSON reader against a fixed schema, mapped with compute kernels.

    Returns None whenever the input is anything but plain well-formed output (a type the schema does
    not hold, a null, a negative count, a payload before its header, an overlong line): the careful
    reader then runs and either reads it or says precisely which line is wrong. So this path only
    has to be right on good input.
    """
    # Arrow cannot tell a JSON null from a missing key; the careful reader can.
    if b"null" in data or (len(data) > MAX_LINE_BYTES and _longest_line(data) > MAX_LINE_BYTES):
        return None
    try:
        table = pa_json.read_json(io.BytesIO(data), read_options=_READ_OPTIONS, parse_options=_PARSE_OPTIONS)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None
    n = table.num_rows
    if n == 0:
        return _ROWS.empty_table()
    table = table.combine_chunks()
    header, metadata, coll, p2p = (table.column(k).chunk(0) for k in ("header", "metadata", *_PAYLOADS))
    has_header = header.is_valid().to_numpy(zero_copy_only=False)
    if np.any(has_header & ~metadata.is_valid().to_numpy(zero_copy_only=False)):
        return None
    is_coll_line = coll.is_valid().to_numpy(zero_copy_only=False)
    rows = np.flatnonzero(is_coll_line | p2p.is_valid().to_numpy(zero_copy_only=False))
    # Each payload line belongs to the latest header line at or above it (batched layout).
    last_header = np.maximum.accumulate(np.where(has_header, np.arange(n), -1))[rows]
    if np.any(last_header < 0):
        return None
    h, m = header.take(pa.array(last_header)), metadata.take(pa.array(last_header))
    is_coll = pa.array(is_coll_line[rows])
    c, p = coll.take(pa.array(rows)), p2p.take(pa.array(rows))

    def either(coll_field: str | list[str], p2p_field: str | list[str]) -> pa.Array:
        return pc.if_else(is_coll, pc.struct_field(c, coll_field), pc.struct_field(p, p2p_field))

    func = either("coll", "p2p")
    comm = pc.struct_field(h, "id")
    pid, comm_rank, n_ranks = pc.struct_field(m, "pid"), pc.struct_field(h, "rank"), pc.struct_field(h, "n_ranks")
    seq, size = either("coll_sn", "p2p_sn"), either("coll_msg_size_bytes", "p2p_msg_size_bytes")
    peer = pc.if_else(is_coll, pa.scalar(None, pa.int64()), pc.struct_field(p, "p2p_peer"))
    if func.null_count or comm.null_count or pc.any(pc.equal(comm, "")).as_py():
        return None
    if not _all_nonnegative(pid, comm_rank, n_ranks, seq, size, peer):
        return None
    enqueue = pc.if_else(
        is_coll,
        pc.struct_field(c, ["event_trace_ts", "coll_start_ts"]),
        pc.struct_field(p, ["event_trace_ts", "p2p_start_ts"]),
    )
    kernels = pl.from_arrow(either(["event_trace_ts", "kernel_events"], ["event_trace_ts", "kernel_events"]))
    assert isinstance(kernels, pl.Series)
    starts = kernels.list.eval(pl.element().struct.field("kernel_start_ts")).list.min().to_arrow()
    stops = kernels.list.eval(pl.element().struct.field("kernel_stop_ts")).list.max().to_arrow()
    try:
        enqueue = pc.if_else(pc.greater(enqueue, 0), pc.multiply_checked(enqueue, 1000), pa.scalar(None, pa.int64()))
        start_ns, end_ns = pc.multiply_checked(starts, 1000), pc.multiply_checked(stops, 1000)
    except pa.ArrowInvalid:
        return None

    def known(values: pa.Array) -> pa.Array:
        # "unknown" is the Inspector's spelling of "not known".
        return pc.if_else(pc.equal(values, "unknown"), pa.scalar(None, pa.string()), values)

    columns = {
        "host": pc.struct_field(m, "hostname"),
        "pid": pid,
        "comm_id": comm,
        "comm_name": known(pc.struct_field(h, "comm_name")),
        "comm_size": n_ranks,
        "comm_rank": comm_rank,
        "op": ops(func),
        "is_p2p": pc.invert(is_coll),
        "seq": seq,
        # NCCL numbers collectives per function per communicator.
        "seq_kind": pc.if_else(is_coll, "func", "p2p"),
        "bytes": size,
        "peer": peer,
        "enqueue_ns": enqueue,
        "start_ns": start_ns,
        "end_ns": end_ns,
        "algo": known(either("coll_algo", "p2p_algo")),
        "proto": known(either("coll_proto", "p2p_proto")),
    }
    return pa.table([columns[f.name].cast(f.type) for f in _ROWS], schema=_ROWS)


def _read(path: Path) -> pa.Table:
    """One log's operations: the columnar reader, or the careful one when the columnar one declines."""
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise EvidenceError(f"{path}: {size} bytes is over the {MAX_FILE_BYTES}-byte limit for a log")
    data = path.read_bytes()
    table = _read_columnar(data)
    return table if table is not None else _read_lines(path, data)


def load(path: Path) -> pa.Table:
    """Every operation in the Inspector log(s) under ``path``."""
    path = Path(path)
    if not path.exists():
        raise EvidenceError(f"{path}: no such file or directory")
    files = _logs(path)
    if not files:
        raise EvidenceError(f"{path}: no NCCL Inspector log found")
    total = sum(file.stat().st_size for file in files)
    if total > MAX_TOTAL_BYTES:
        raise EvidenceError(f"{path}: {total} bytes of logs is over the {MAX_TOTAL_BYTES}-byte limit for one import")
    # Logs are read one at a time and counted as they come: many logs of small records would otherwise
    # make a table far larger than the memory an import may take.
    parts, count = [], 0
    for file in files:
        parts.append(_read(file))
        count += parts[-1].num_rows
        if count > MAX_ROWS:
            raise EvidenceError(f"{file}: more than {MAX_ROWS} operations in the logs read so far")
    rows = pa.concat_tables(parts)
    if rows.num_rows == 0:
        raise EvidenceError(f"{path}: no collective or P2P records in the log(s)")
    df = pl.from_arrow(rows)
    assert isinstance(df, pl.DataFrame)
    # Global rank of each process: its rank in the largest communicator it is part of.
    world = (
        df.sort(["comm_size", "comm_id"], descending=[True, False], nulls_last=True)
        .group_by("host", "pid", maintain_order=True)
        .agg(pl.col("comm_rank").first().alias("rank"))
    )
    df = df.join(world, on=["host", "pid"], how="left", nulls_equal=True)
    # P2P peers are communicator ranks: map them to global ranks where the peer's process logged.
    known = df.select("comm_id", pl.col("comm_rank").alias("peer"), pl.col("rank").alias("peer_global")).unique(
        subset=["comm_id", "peer"]
    )
    df = df.join(known, on=["comm_id", "peer"], how="left").with_columns(pl.col("peer_global").alias("peer"))
    df = df.drop("peer_global").with_columns(
        pl.lit("completed").alias("state"), pl.lit(NAME).alias("source"), pl.col("host").alias("node")
    )
    table = df.to_arrow()
    return to_table({name: table.column(name) for name in table.column_names}, path)


register(Importer(NAME, detect, load))
