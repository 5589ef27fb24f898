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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa

from comminsight.importers import EvidenceError, Importer, register
from comminsight.importers.columns import to_table
from comminsight.importers.normalise import op_name

NAME = "nccl_inspector"
MAX_FILE_BYTES = 8 << 30
MAX_LINE_BYTES = 1 << 20
_HEAD = 4096
_PAYLOADS = ("coll_perf", "p2p_perf")


def _is_log(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.read(_HEAD)
    except OSError:
        return False
    first = head.lstrip().split(b"\n", 1)[0]
    return first.startswith(b"{") and b'"header"' in first and b'"metadata"' in first


def _logs(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [p for p in sorted(path.iterdir()) if p.is_file() and not p.name.startswith(".") and _is_log(p)]


def detect(path: Path) -> bool:
    """An Inspector log (first line holds ``header`` and ``metadata``), or a directory of them."""
    if path.is_file():
        return _is_log(path)
    if path.is_dir():
        return any(_is_log(p) for p in sorted(path.iterdir())[:256] if p.is_file())
    return False


def _uint(value: Any, what: str, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EvidenceError(f"{where}: {what} must be a non-negative integer, found {value!r:.40}")
    return value


def _read(path: Path, columns: dict[str, list]) -> None:
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise EvidenceError(f"{path}: {size} bytes is over the {MAX_FILE_BYTES}-byte limit for a log")
    header: dict | None = None
    metadata: dict | None = None
    with path.open("rb") as f:
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


def load(path: Path) -> pa.Table:
    """Every operation in the Inspector log(s) under ``path``."""
    path = Path(path)
    if not path.exists():
        raise EvidenceError(f"{path}: no such file or directory")
    files = _logs(path)
    if not files:
        raise EvidenceError(f"{path}: no NCCL Inspector log found")
    names = "host pid comm_id comm_name comm_size comm_rank op is_p2p seq seq_kind bytes peer enqueue_ns start_ns"
    columns: dict[str, list] = {k: [] for k in (names + " end_ns algo proto").split()}
    for file in files:
        _read(file, columns)
    if not columns["comm_id"]:
        raise EvidenceError(f"{path}: no collective or P2P records in the log(s)")
    integer = {k: pl.Int64 for k in ("pid", "comm_size", "comm_rank", "seq", "bytes", "peer", "enqueue_ns", "start_ns")}
    df = pl.DataFrame(columns, schema_overrides={**integer, "end_ns": pl.Int64}, strict=False)
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
