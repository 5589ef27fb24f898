"""PyTorch profiler (Kineto) JSON traces -> the operations table.

A Kineto trace is one JSON object per rank (plain or gzip): ``distributedInfo`` (rank, world
size, process groups) and ``traceEvents`` (Chrome trace events, ``ts``/``dur`` in microseconds
on a clock that ``baseTimeNanoseconds`` turns into Unix time). Each NCCL GPU kernel carrying
collective args (``Collective name``, ``In msg nelems``, ``dtype``, ``Process Group Name`` /
``Description`` / ``Ranks``, ``Seq`` in newer PyTorch) becomes one row; the CPU
``record_param_comms`` op with the same ``External id`` gives the enqueue time (and ``Seq`` when
the kernel lacks it). Without ``Seq`` the sequence is the op's ordinal in its process group
within the trace (collectives and P2P counted apart). ``ProfilerStep#N`` spans label the ops
enqueued inside them with step N and are kept as "compute" rows carrying the span.

JSON has to be decoded event by event; the columns are then built in one pass and the step
labels assigned with one vectorised search.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from comminsight.importers import EvidenceError, Importer, register
from comminsight.importers.columns import concat, to_table
from comminsight.importers.normalise import ITEMSIZE, dtype_name, op_name

NAME = "kineto"
MAX_FILE_BYTES = 1 << 30
MAX_JSON_BYTES = 4 << 30
MAX_EVENTS = 50_000_000
_HEAD = 4096
_KEYS = (b'"traceEvents"', b'"schemaVersion"', b'"distributedInfo"', b'"deviceProperties"')
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_KERNEL_FUNC = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)")
_ALGO = re.compile(r"_(RING|TREE|COLLNET_DIRECT|COLLNET_CHAIN|COLLNET|NVLS_TREE|NVLS|PAT)(?:_|\b|\()", re.I)
_PROTO = re.compile(r"_(LL128|LL|SIMPLE)(?:_|\b|\()", re.I)
_PEER_KEYS = ("Peer", "peer", "Dst Rank", "Src Rank", "dst_rank", "src_rank")


def _head(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            head = f.read(_HEAD)
    except OSError:
        return b""
    if head[:2] == b"\x1f\x8b":
        try:
            return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, _HEAD)
        except zlib.error:
            return b""
    return head


def _is_trace(path: Path) -> bool:
    name = path.name.lower()
    if not (name.endswith(".json") or name.endswith(".json.gz")):
        return False
    head = _head(path).lstrip()
    return head.startswith(b"{") and any(key in head for key in _KEYS) and b'"pg_status"' not in head


def _trace_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [p for p in sorted(path.iterdir()) if p.is_file() and not p.name.startswith(".") and _is_trace(p)]


def detect(path: Path) -> bool:
    """A Kineto JSON trace (.json / .json.gz), or a directory holding one (names and first bytes only)."""
    if path.is_file():
        return _is_trace(path)
    if path.is_dir():
        return any(_is_trace(p) for p in sorted(path.iterdir())[:256] if p.is_file())
    return False


def _read(path: Path) -> dict:
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise EvidenceError(f"{path}: {size} bytes is over the {MAX_FILE_BYTES}-byte limit for a trace")
    try:
        with path.open("rb") as raw:
            magic = raw.read(2)
        if magic == b"\x1f\x8b":
            with gzip.open(path, "rb") as f:
                data = f.read(MAX_JSON_BYTES + 1)
        else:
            data = path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise EvidenceError(f"{path}: cannot read trace: {exc}") from exc
    if len(data) > MAX_JSON_BYTES:
        raise EvidenceError(f"{path}: decompressed trace is over the {MAX_JSON_BYTES}-byte limit")
    try:
        trace = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise EvidenceError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise EvidenceError(f"{path}: not a Kineto trace (no 'traceEvents' list)")
    if len(trace["traceEvents"]) > MAX_EVENTS:
        raise EvidenceError(f"{path}: more than {MAX_EVENTS} events")
    return trace


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _int_arg(args: dict, key: str) -> int | None:
    value = args.get(key)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _ranks(value: Any) -> list[int] | None:
    """A process group's member list, from a list or its JSON text; None when it is neither."""
    if isinstance(value, str):
        return _ranks_text(value)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


@lru_cache(maxsize=4096)
def _ranks_text(text: str) -> list[int] | None:
    # Every kernel of a group repeats the same text: parse it once (callers never mutate the list).
    if len(text) >= (1 << 20):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _ranks(value) if isinstance(value, list) else None


@lru_cache(maxsize=4096)
def _kernel_traits(name: str) -> tuple[str | None, str | None, str | None]:
    """(NCCL function, algorithm, protocol) from a kernel name, parsed once per distinct name."""
    func, algo, proto = _KERNEL_FUNC.search(name), _ALGO.search(name), _PROTO.search(name)
    return (
        func.group(1) if func else None,
        algo.group(1).upper() if algo else None,
        proto.group(1).upper() if proto else None,
    )


def _rank_of(trace: dict, path: Path) -> int:
    info = trace.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int) and not isinstance(info["rank"], bool):
        return info["rank"]
    match = re.search(r"rank[_-]?(\d+)", path.name, re.I)
    if match:
        return int(match.group(1))
    raise EvidenceError(f"{path}: cannot tell the rank (no distributedInfo.rank, no 'rank<N>' in the file name)")


def _load_one(path: Path, trace: dict) -> pa.Table:
    rank = _rank_of(trace, path)
    base = trace.get("baseTimeNanoseconds")
    base_ns = int(base) if isinstance(base, int) and not isinstance(base, bool) else 0
    info_value = trace.get("distributedInfo")
    info: dict = info_value if isinstance(info_value, dict) else {}
    pg_desc: dict[str, tuple[Any, list[int] | None]] = {}
    for pg in info.get("pg_config", []) or []:
        if isinstance(pg, dict) and "pg_name" in pg:
            pg_desc[str(pg["pg_name"])] = (pg.get("pg_desc"), _ranks(pg.get("ranks")))

    cpu_comms: dict[Any, dict] = {}
    kernels: list[dict] = []
    steps: list[tuple[float, float, int]] = []
    for event in trace["traceEvents"]:
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue
        name = event.get("name")
        if not isinstance(name, str):
            continue
        category = event.get("cat")
        event_args = event.get("args")
        args: dict = event_args if isinstance(event_args, dict) else {}
        if category == "kernel":
            if "Collective name" in args or name.startswith(("nccl", "ncclDev")):
                kernels.append(event)
        elif name == "record_param_comms":
            external = args.get("External id")
            if external is not None:
                cpu_comms[external] = event
        elif category == "user_annotation":
            match = _STEP.match(name)
            ts, dur = _number(event.get("ts")), _number(event.get("dur"))
            if match and ts is not None and dur is not None:
                steps.append((ts, ts + dur, int(match.group(1))))

    columns: dict[str, list] = {
        k: []
        for k in [
            "rank",
            "pid",
            "device",
            "comm_id",
            "comm_name",
            "comm_desc",
            "comm_size",
            "comm_ranks",
            "op",
            "is_p2p",
            "seq",
            "seq_kind",
            "count",
            "bytes",
            "dtype",
            "peer",
            "state",
            "enqueue_ns",
            "start_ns",
            "end_ns",
            "stream",
            "algo",
            "proto",
            "record_id",
        ]
    }
    enqueue_us: list[float] = []
    for kernel in kernels:
        args_value = kernel.get("args")
        args = args_value if isinstance(args_value, dict) else {}
        cpu = cpu_comms.get(args.get("External id"))
        cpu_args_value = cpu.get("args") if cpu else None
        cpu_args: dict = cpu_args_value if isinstance(cpu_args_value, dict) else {}
        merged = {**cpu_args, **args}
        raw_op = merged.get("Collective name")
        kernel_func, algo, proto = _kernel_traits(kernel["name"])
        if not isinstance(raw_op, str):
            raw_op = kernel_func
        op = op_name(raw_op)
        is_p2p = op in ("send", "recv")
        group = merged.get("Process Group Name")
        group = str(group) if group is not None else "unknown"
        desc, listed = pg_desc.get(group, (None, None))
        ranks = _ranks(merged.get("Process Group Ranks")) or listed
        dtype = dtype_name(merged.get("dtype")) if isinstance(merged.get("dtype"), str) else None
        count = _int_arg(merged, "In msg nelems")
        ts, dur = _number(kernel.get("ts")), _number(kernel.get("dur"))
        if ts is None:
            continue
        cpu_ts = _number(cpu.get("ts")) if cpu else None
        seq = _int_arg(merged, "Seq")
        if seq is None:
            seq = _int_arg(merged, "seq")
        peer = None
        for key in _PEER_KEYS:
            peer = _int_arg(merged, key)
            if peer is not None:
                break
        size = _int_arg(merged, "Group size")

        columns["rank"].append(rank)
        columns["pid"].append(cpu.get("pid") if cpu and isinstance(cpu.get("pid"), int) else None)
        columns["device"].append(_int_arg(args, "device"))
        columns["comm_id"].append(group)
        columns["comm_name"].append(group)
        columns["comm_desc"].append(merged.get("Process Group Description") or desc)
        columns["comm_size"].append(size if size is not None else (len(ranks) if ranks else None))
        columns["comm_ranks"].append(ranks)
        columns["op"].append(op)
        columns["is_p2p"].append(is_p2p)
        columns["seq"].append(seq)
        columns["seq_kind"].append("p2p" if is_p2p else "comm")
        columns["count"].append(count)
        itemsize = ITEMSIZE.get(dtype or "", 0)
        columns["bytes"].append(count * itemsize if count is not None and itemsize else None)
        columns["dtype"].append(dtype)
        columns["peer"].append(peer)
        columns["state"].append("completed")
        columns["enqueue_ns"].append(base_ns + round(cpu_ts * 1000) if cpu_ts is not None else None)
        columns["start_ns"].append(base_ns + round(ts * 1000))
        columns["end_ns"].append(base_ns + round((ts + (dur or 0.0)) * 1000))
        columns["stream"].append(_int_arg(args, "stream"))
        columns["algo"].append(algo)
        columns["proto"].append(proto)
        columns["record_id"].append(_int_arg(args, "External id"))
        enqueue_us.append(cpu_ts if cpu_ts is not None else ts)

    n = len(columns["rank"])
    enqueue = np.asarray(enqueue_us, dtype=np.float64)
    if n and np.any(np.diff(enqueue) < 0):
        # Kernels are listed by GPU stream; sequences and steps follow the CPU enqueue order.
        order = np.argsort(enqueue, kind="stable")
        columns = {k: [v[i] for i in order] for k, v in columns.items()}
        enqueue = enqueue[order]

    # Sequences the trace does not carry: ordinal per (process group, collective|p2p) in enqueue order.
    if n and any(s is None for s in columns["seq"]):
        counters: dict[tuple[str, bool], int] = {}
        for i in range(n):
            group_key = (columns["comm_id"][i], columns["is_p2p"][i])
            counters[group_key] = counters.get(group_key, -1) + 1
            if columns["seq"][i] is None:
                columns["seq"][i] = counters[group_key]

    # Step labels: the ProfilerStep span the op was enqueued in (one vectorised search).
    step: list[int | None] = [None] * n
    if steps and n:
        steps.sort()
        starts = np.array([s[0] for s in steps])
        ends = np.array([s[1] for s in steps])
        labels = np.array([s[2] for s in steps])
        index = np.searchsorted(starts, enqueue, side="right") - 1
        inside = (index >= 0) & (enqueue <= ends[np.clip(index, 0, None)])
        step = [int(labels[i]) if ok else None for i, ok in zip(index, inside, strict=True)]
    columns["step"] = step
    columns["source"] = [NAME] * n
    ops = to_table(columns, path)

    # The step spans themselves, as "compute" rows: step boundaries are ground truth for step recovery.
    span_columns = {
        "rank": [rank] * len(steps),
        "comm_id": [""] * len(steps),
        "op": ["compute"] * len(steps),
        "is_p2p": [False] * len(steps),
        "state": ["completed"] * len(steps),
        "step": [s[2] for s in steps],
        "start_ns": [base_ns + round(s[0] * 1000) for s in steps],
        "end_ns": [base_ns + round(s[1] * 1000) for s in steps],
        "source": [NAME] * len(steps),
    }
    return concat([ops, to_table(span_columns, path)])


def load(path: Path) -> pa.Table:
    """The NCCL operations (and ProfilerStep spans) of every trace under ``path``."""
    path = Path(path)
    if not path.exists():
        raise EvidenceError(f"{path}: no such file or directory")
    files = _trace_files(path)
    if not files:
        raise EvidenceError(f"{path}: no Kineto trace found")
    tables: list[pa.Table] = []
    seen: dict[int, Path] = {}
    for file in files:
        trace = _read(file)
        table = _load_one(file, trace)
        rank = _rank_of(trace, file)
        if rank in seen:
            raise EvidenceError(f"{file}: rank {rank} already read from {seen[rank].name}")
        seen[rank] = file
        tables.append(table)
    result = concat(tables)
    if result.num_rows == 0:
        raise EvidenceError(f"{path}: no NCCL operations or ProfilerStep spans in the trace(s)")
    return result


register(Importer(NAME, detect, load))
