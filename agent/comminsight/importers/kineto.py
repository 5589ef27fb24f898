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

The trace is read as a stream of 8 MiB pieces (bounded memory). Inside ``traceEvents`` each
piece's run of complete events is decoded by one msgspec call into typed structs of the members
used (every other member, and the args, are skipped or kept as raw text without being built);
the few events that matter keep their args. What msgspec does not read as the standard parser
would (NaN, numbers past the float range, very deep nesting) goes to a bracket scanner (numpy)
that parses only the events whose text could matter (orjson, the standard parser as the last
word). Each needed field is then gathered as one column (a C-level ``map`` over the selected
events), and every mapping (op and dtype spellings, kernel traits, sizes, sequence ordinals,
step labels) runs on whole columns: per distinct value, or as numpy/Arrow kernels.
bench/kineto_readers.py compares the JSON readers this choice was made from.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator
from functools import lru_cache
from itertools import chain, compress, repeat
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import msgspec
import numpy as np
import orjson
import pyarrow as pa

from comminsight.evidence import compute as pc
from comminsight.importers import EvidenceError, Importer, directory_holds, evidence_files, register
from comminsight.importers.columns import MAX_ROWS, concat, paused_gc, to_table
from comminsight.importers.normalise import dtypes, itemsizes, map_distinct, ops

_inflate: ModuleType
try:
    # ISA-L's inflate: the zlib module's interface, about 4 times as fast on traces (gzip checks included).
    from isal import isal_zlib as _inflate
except ModuleNotFoundError:  # a checkout set up before isal was pinned: the standard zlib, same results
    _inflate = zlib
_INFLATE_ERRORS: tuple[type[Exception], ...] = (zlib.error, _inflate.error)

NAME = "kineto"
MAX_FILE_BYTES = 1 << 30
# The decompressed document: read as a stream, so this bounds time, not memory.
MAX_JSON_BYTES = 4 << 30
# gzip shrinks a trace 10-30 times; past this ratio (and this size) the input is a compression bomb.
MAX_RATIO = 200
RATIO_FLOOR_BYTES = 64 << 20
CHUNK_BYTES = 8 << 20
# One event, or one top-level member other than traceEvents, is held whole while it is read.
MAX_PIECE_BYTES = 64 << 20
MAX_DEPTH = 128
MAX_EVENTS = 50_000_000
# Events kept for the table (NCCL kernels, record_param_comms ops, step spans) per trace; with the
# row cap of a load, this keeps an import's memory under 1 GB whatever the input.
MAX_KEPT_EVENTS = 400_000
# Selected events of several traces built into the table together (see ``load``).
BATCH_EVENTS = 100_000
_HEAD = 4096
_KEYS = (b'"traceEvents"', b'"schemaVersion"', b'"distributedInfo"', b'"deviceProperties"')
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_KERNEL_FUNC = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)")
_ALGO = re.compile(r"_(RING|TREE|COLLNET_DIRECT|COLLNET_CHAIN|COLLNET|NVLS_TREE|NVLS|PAT)(?:_|\b|\()", re.I)
_PROTO = re.compile(r"_(LL128|LL|SIMPLE)(?:_|\b|\()", re.I)
_PEER_KEYS = ("Peer", "peer", "Dst Rank", "Src Rank", "dst_rank", "src_rank")
_NUMBER = (int, float)  # exact types: a JSON true/false is a bool, not a number
_KEY = (int, str, float)  # External ids that can key a lookup
_NO_ARGS: dict = {}
_INT_OR_NONE = {int, type(None)}
_FLOAT_OR_INT = {float, int}
_STR_OR_NONE = {str, type(None)}


def _head(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            head = f.read(_HEAD)
    except OSError:
        return b""
    if head[:2] == b"\x1f\x8b":
        try:
            return _inflate.decompressobj(16 + zlib.MAX_WBITS).decompress(head, _HEAD)
        except _INFLATE_ERRORS:
            return b""
    return head


def _is_trace(path: Path) -> bool:
    name = path.name.lower()
    if not (name.endswith(".json") or name.endswith(".json.gz")):
        return False
    head = _head(path).lstrip()
    return head.startswith(b"{") and any(key in head for key in _KEYS) and b'"pg_status"' not in head


def _trace_files(path: Path) -> list[Path]:
    return evidence_files(path, _is_trace)


def detect(path: Path) -> bool:
    """A Kineto JSON trace (.json / .json.gz), or a directory holding one (names and first bytes only)."""
    if path.is_file():
        return _is_trace(path)
    if path.is_dir():
        return directory_holds(path, _is_trace)
    return False


def _read(path: Path) -> dict:
    """The trace's used top-level members and its selected events (compacted), read as a stream."""
    return _TraceReader(path).read()


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


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


def _args_column(events: list) -> list[dict]:
    """Each event's ``args`` (an empty dict for a missing event, missing or non-object args)."""
    args = [e.get("args") if e is not None else None for e in events]
    if set(map(type, args)) <= {dict}:
        return args
    return [a if type(a) is dict else _NO_ARGS for a in args]


def _ranks_column(values: list, groups: list, listed: dict) -> list:
    """Member lists per kernel: the args' list (its text parsed once per distinct text), else the list
    ``listed`` gives for the kernel's group (its trace's pg_config)."""
    if set(map(type, values)) <= {str}:
        parsed = {text: _ranks_text(text) for text in set(values)}
        ranks = list(map(parsed.__getitem__, values))
    else:
        ranks = [_ranks(v) for v in values]
    if all(ranks):
        return ranks
    return [r or listed.get(g) for r, g in zip(ranks, groups, strict=True)]


def _ints(values: list) -> pa.Array:
    """``_int_arg`` on a whole column: ints as they are, integral floats as ints, anything else null."""
    if set(map(type, values)) <= _INT_OR_NONE:
        return pa.array(values, pa.int64())  # the usual case, converted in one call
    return pa.array(
        [v if type(v) is int else (int(v) if type(v) is float and v.is_integer() else None) for v in values],
        pa.int64(),
    )


def _floats(values: list) -> np.ndarray:
    """``_number`` on a whole column: ints and floats as float64, anything else (bools, text, missing) NaN."""
    if set(map(type, values)) <= _FLOAT_OR_INT:
        return np.array(values, dtype=np.float64)
    return np.array([v if type(v) is float or type(v) is int else np.nan for v in values], dtype=np.float64)


def _texts(values: list) -> pa.Array:
    """Strings as they are, anything else null."""
    if set(map(type, values)) <= _STR_OR_NONE:
        return pa.array(values, pa.string())
    return pa.array([v if type(v) is str else None for v in values], pa.string())


def _ns(us: np.ndarray, base_ns: np.ndarray, path: Path) -> np.ndarray:
    """Microseconds on the trace clock -> int64 ns since the epoch (NaN gives ``base_ns``: callers mask it)."""
    finite = ~np.isnan(us)
    if np.any(finite) and not np.all(np.abs(us[finite]) * 1000 + np.abs(base_ns[finite]) < 9.2e18):
        raise EvidenceError(f"{path}: a timestamp is out of range")
    # np.rint rounds half to even, as Python's round() did.
    return np.rint(np.nan_to_num(us) * 1000).astype(np.int64) + base_ns


class _Trace(NamedTuple):
    """What one rank's trace gives the table, before any column is built."""

    path: Path
    rank: int
    base_ns: int
    groups: dict[str, tuple[Any, list[int] | None]]  # pg_config: process group name -> (description, ranks)
    events: list[dict]  # the selected events (NCCL kernels, record_param_comms ops, step spans)


def _trace(path: Path, trace: dict) -> _Trace:
    rank = _rank_of(trace, path)
    base = trace.get("baseTimeNanoseconds")
    base_ns = int(base) if isinstance(base, int) and not isinstance(base, bool) else 0
    if abs(base_ns) >= 1 << 62:
        raise EvidenceError(f"{path}: baseTimeNanoseconds {base_ns} is out of range")
    info_value = trace.get("distributedInfo")
    info: dict = info_value if isinstance(info_value, dict) else {}
    groups: dict[str, tuple[Any, list[int] | None]] = {}
    for pg in info.get("pg_config", []) or []:
        if isinstance(pg, dict) and "pg_name" in pg:
            groups[str(pg["pg_name"])] = (pg.get("pg_desc"), _ranks(pg.get("ranks")))
    events = trace["traceEvents"]
    if not set(map(type, events)) <= {dict}:
        events = [e for e in events if type(e) is dict]
    return _Trace(path, rank, base_ns, groups, events)


def _load_one(path: Path, trace: dict) -> pa.Table:
    """The table of one trace (what ``load`` gives for a file holding it)."""
    return _table([_trace(path, trace)])


def _table(traces: list[_Trace]) -> pa.Table:
    """The operations table of several ranks' traces, built in one pass over all their events: each
    column is one Arrow/numpy call for every rank at once (a few hundred rows per rank would otherwise
    pay each call's fixed cost once per rank). Rows are ordered as for one trace after another: a
    rank's operations in enqueue order, then its step spans."""
    if len(traces) == 1:
        return _table_of(traces)
    try:
        return _table_of(traces)
    except EvidenceError:
        for trace in traces:  # the first trace at fault, named as when each is built alone
            _table_of([trace])
        raise


def _table_of(traces: list[_Trace]) -> pa.Table:
    fault = traces[0].path if len(traces) == 1 else Path(", ".join(str(t.path) for t in traces))
    # The keys that select events are gathered as columns (one C-level pass each) and matched with
    # Arrow kernels; only the few selected events are then looked at one by one.
    events = list(chain.from_iterable(t.events for t in traces))
    owner = np.repeat(np.arange(len(traces)), [len(t.events) for t in traces])  # each event's trace
    names = _texts(list(map(dict.get, events, repeat("name"))))
    categories = _texts(list(map(dict.get, events, repeat("cat"))))
    is_kernel = pc.fill_null(pc.and_(pc.equal(categories, "kernel"), pc.is_valid(names)), False)
    is_comm = pc.and_(pc.fill_null(pc.equal(names, "record_param_comms"), False), pc.invert(is_kernel))
    is_step = pc.fill_null(
        pc.and_(pc.equal(categories, "user_annotation"), pc.starts_with(names, "ProfilerStep#")), False
    )

    def spans(mask: pa.Array) -> tuple[list[dict], list[int]]:
        # Complete ("X") events only, with the trace each comes from.
        picked = np.flatnonzero(mask.to_numpy(zero_copy_only=False))
        complete = [e.get("ph") == "X" for e in map(events.__getitem__, picked)]
        return list(compress(map(events.__getitem__, picked), complete)), owner[picked][complete].tolist()

    kernels, kernel_owner = spans(is_kernel)
    kernel_args = _args_column(kernels)
    keep = [
        ("Collective name" in a or e["name"].startswith("nccl")) and type(t := e.get("ts")) in _NUMBER and t == t
        for e, a in zip(kernels, kernel_args, strict=True)
    ]
    kernels, kernel_args = list(compress(kernels, keep)), list(compress(kernel_args, keep))
    kernel_owner = list(compress(kernel_owner, keep))
    comm_events, comm_owner = spans(is_comm)
    comm_ids = map(dict.get, _args_column(comm_events), repeat("External id"))
    # The CPU op of a kernel: same trace, same External id.
    cpu_comms = {(o, x): e for e, o, x in zip(comm_events, comm_owner, comm_ids, strict=True) if type(x) in _KEY}
    steps: list[list[tuple[float, float, int]]] = [[] for _ in traces]
    for event, o in zip(*spans(is_step), strict=True):
        match = _STEP.match(event["name"])
        ts, dur = _number(event.get("ts")), _number(event.get("dur"))
        if match and ts is not None and dur is not None:
            steps[o].append((ts, ts + dur, int(match.group(1))))
    for trace_steps in steps:
        trace_steps.sort()

    kernel_ids = map(dict.get, kernel_args, repeat("External id"))
    cpu = [cpu_comms.get((o, x)) if type(x) in _KEY else None for o, x in zip(kernel_owner, kernel_ids, strict=True)]
    cpu_args = _args_column(cpu)

    # Kernel args win over those of the CPU op; each column is then one C-level pass over the merged args.
    merged_args = [{**c, **a} if c else a for a, c in zip(kernel_args, cpu_args, strict=True)]

    def merged(key: str) -> list:
        return list(map(dict.get, merged_args, repeat(key)))

    def kernel(key: str) -> list:
        return list(map(dict.get, kernel_args, repeat(key)))

    owners = np.array(kernel_owner, np.int64)
    base_ns = np.array([t.base_ns for t in traces], np.int64)
    try:
        names = pa.array([e["name"] for e in kernels], pa.string())
        raw_op = pc.coalesce(_texts(merged("Collective name")), map_distinct(names, lambda n: _kernel_traits(n)[0]))
        op = ops(raw_op)
        is_p2p = pc.is_in(op, pa.array(["send", "recv"]))
        group = merged("Process Group Name")
        if not set(map(type, group)) <= {str}:
            group = [g if type(g) is str else ("unknown" if g is None else str(g)) for g in group]
        group_arr = pa.array(group, pa.string())
        # A process group is known by its name within one trace's pg_config.
        group_keys = list(zip(kernel_owner, group, strict=True))
        config = {key: traces[key[0]].groups.get(key[1], (None, None)) for key in set(group_keys)}
        listed = {key: value[1] for key, value in config.items()}
        ranks = _ranks_column(merged("Process Group Ranks"), group_keys, listed)
        size = _ints(merged("Group size"))
        size_from_ranks = pa.array([len(r) if r else None for r in ranks], pa.int64())
        dtype = dtypes(_texts(merged("dtype")))
        count = _ints(merged("In msg nelems"))
        itemsize = pa.array(itemsizes(dtype))
        seq = pc.coalesce(_ints(merged("Seq")), _ints(merged("seq")))
        peer = pc.coalesce(*[_ints(merged(key)) for key in _PEER_KEYS])
        descs = _texts(merged("Process Group Description"))
        descs = pc.if_else(pc.equal(descs, ""), pa.scalar(None, pa.string()), descs)  # empty: not given
        pg_descs = pa.array([config[key][0] for key in group_keys], pa.string())
        ts = _floats([e["ts"] for e in kernels])
        dur = np.nan_to_num(_floats([e.get("dur") for e in kernels]))
        cpu_ts = _floats([c.get("ts") if c is not None else None for c in cpu])
        pid = [p if c is not None and type(p := c.get("pid")) is int else None for c in cpu]
        bytes_ = pc.if_else(pc.equal(itemsize, 0), pa.scalar(None, pa.int64()), pc.multiply_checked(count, itemsize))
        has_cpu = ~np.isnan(cpu_ts)
        enqueue = np.where(has_cpu, cpu_ts, ts)
        kernel_base = base_ns[owners]
        columns: dict[str, Any] = {
            "pid": pa.array(pid, pa.int64()),
            "device": _ints(kernel("device")),
            "comm_id": group_arr,
            "comm_name": group_arr,
            "comm_desc": pc.coalesce(descs, pg_descs),
            "comm_size": pc.coalesce(size, size_from_ranks),
            "comm_ranks": pa.array(ranks, pa.list_(pa.int32())),
            "op": op,
            "is_p2p": is_p2p,
            "seq": seq,
            "count": count,
            "bytes": bytes_,
            "dtype": dtype,
            "peer": peer,
            "enqueue_ns": pa.array(_ns(cpu_ts, kernel_base, fault), mask=~has_cpu),
            "start_ns": _ns(ts, kernel_base, fault),
            "end_ns": _ns(ts + dur, kernel_base, fault),
            "stream": _ints(kernel("stream")),
            "algo": map_distinct(names, lambda n: _kernel_traits(n)[1] if n else None),
            "proto": map_distinct(names, lambda n: _kernel_traits(n)[2] if n else None),
            "record_id": _ints(kernel("External id")),
        }
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
        raise EvidenceError(f"{fault}: a kernel argument has a value out of range or of the wrong type: {exc}") from exc
    n = len(kernels)
    if n and np.any((np.diff(enqueue) < 0) & (np.diff(owners) == 0)):
        # Kernels are listed by GPU stream; sequences and steps follow each rank's CPU enqueue order.
        order = np.argsort(enqueue, kind="stable")
        order = order[np.argsort(owners[order], kind="stable")]  # each trace's rows stay together
        columns = {k: pc.take(v, order) if isinstance(v, pa.Array) else v[order] for k, v in columns.items()}
        enqueue = enqueue[order]

    # Sequences the trace does not carry: ordinal per (trace, process group, collective|p2p) in enqueue order.
    if n and columns["seq"].null_count:
        group_code = pc.dictionary_encode(columns["comm_id"]).indices.to_numpy().astype(np.int64)
        codes = (owners * (int(group_code.max()) + 1) + group_code) * 2 + columns["is_p2p"].to_numpy(
            zero_copy_only=False
        )
        order = np.argsort(codes, kind="stable")
        sorted_codes = codes[order]
        starts = np.flatnonzero(np.r_[True, sorted_codes[1:] != sorted_codes[:-1]])
        first_of_group = np.repeat(starts, np.diff(np.r_[starts, n]))
        ordinal = np.empty(n, np.int64)
        ordinal[order] = np.arange(n) - first_of_group
        columns["seq"] = pc.coalesce(columns["seq"], pa.array(ordinal))

    # Step labels: the ProfilerStep span of its trace the op was enqueued in (one vectorised search per trace).
    bounds = np.searchsorted(owners, np.arange(len(traces) + 1))
    if n and any(steps):
        label = np.zeros(n, np.int64)
        inside = np.zeros(n, bool)
        for o, trace_steps in enumerate(steps):
            lo, hi = bounds[o], bounds[o + 1]
            if not trace_steps or lo == hi:
                continue
            starts = np.array([s[0] for s in trace_steps])
            ends = np.array([s[1] for s in trace_steps])
            labels = np.array([s[2] for s in trace_steps], dtype=np.int64)
            index = np.searchsorted(starts, enqueue[lo:hi], side="right") - 1
            inside[lo:hi] = (index >= 0) & (enqueue[lo:hi] <= ends[np.clip(index, 0, None)])
            label[lo:hi] = labels[np.clip(index, 0, None)]
        columns["step"] = pa.array(label, mask=~inside)
    rank_of_trace = np.array([t.rank for t in traces], np.int64)
    columns["rank"] = rank_of_trace[owners]
    columns["seq_kind"] = pc.if_else(columns["is_p2p"], "p2p", "comm") if n else pa.array([], pa.string())
    columns["state"] = pa.repeat(pa.scalar("completed"), n)
    columns["source"] = pa.repeat(pa.scalar(NAME), n)
    ops_table = to_table(columns, fault)

    # The step spans themselves, as "compute" rows: step boundaries are ground truth for step recovery.
    spans_per_trace = [len(s) for s in steps]
    all_steps = list(chain.from_iterable(steps))
    span_owner = np.repeat(np.arange(len(traces)), spans_per_trace)
    m = len(all_steps)
    span_columns = {
        "rank": rank_of_trace[span_owner],
        "comm_id": [""] * m,
        "op": ["compute"] * m,
        "is_p2p": [False] * m,
        "state": ["completed"] * m,
        "step": [s[2] for s in all_steps],
        "start_ns": _ns(np.array([s[0] for s in all_steps], np.float64), base_ns[span_owner], fault),
        "end_ns": _ns(np.array([s[1] for s in all_steps], np.float64), base_ns[span_owner], fault),
        "source": [NAME] * m,
    }
    table = concat([ops_table, to_table(span_columns, fault)])
    if len(traces) == 1:
        return table
    # One trace after another: its operations, then its spans.
    span_bounds = np.r_[0, np.cumsum(spans_per_trace)] + n
    rows = np.concatenate(
        [np.r_[bounds[o] : bounds[o + 1], span_bounds[o] : span_bounds[o + 1]] for o in range(len(traces))]
    )
    return pc.take(table, rows)


# ---- the trace as a stream of pieces -----------------------------------------------------------

# Bytes that structure a JSON document: string delimiters and escapes, brackets and separators.
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_TOKEN_BYTES = bytes(1 if chr(c) in '"\\{}[]' else 0 for c in range(256))
_KEY_TAIL = 4096  # a member name longer than this is not "traceEvents", however it is escaped
_DELTA = np.zeros(256, np.int32)
_DELTA[list(b"{[")] = 1
_DELTA[list(b"}]")] = -1
# An event can matter only if its text holds one of these (or a \u escape, which could spell any of
# them): NCCL kernels carry "nccl" in their name or a "Collective name" argument, the CPU op is
# record_param_comms, step spans are ProfilerStep#N.
_NEEDLES = (b"nccl", b"Collective name", b"record_param_comms", b"ProfilerStep#", b"\\u")
# The parts of an event (and of its args) the table is made of.
_EVENT_KEYS = ("ph", "cat", "name", "ts", "dur", "pid", "args")
_ARG_KEYS = frozenset(
    (
        "External id",
        "Collective name",
        "Process Group Name",
        "Process Group Ranks",
        "Process Group Description",
        "Group size",
        "dtype",
        "In msg nelems",
        "Seq",
        "seq",
        "device",
        "stream",
        *_PEER_KEYS,
    )
)


def _chunks(path: Path) -> Iterator[bytes]:
    """The trace's bytes, decompressed as they are read, at most CHUNK_BYTES at a time.

    The decompressed size and the expansion ratio are checked after every step, so a compression
    bomb is refused after a few chunks, long before its expansion could fill memory.
    """
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise EvidenceError(f"{path}: {size} bytes is over the {MAX_FILE_BYTES}-byte limit for a trace")
    with path.open("rb") as raw:
        if raw.read(2) != b"\x1f\x8b":
            raw.seek(0)
            while chunk := raw.read(CHUNK_BYTES):
                yield chunk
            return
        raw.seek(0)
        read = produced = 0
        member: Any = _inflate.decompressobj(16 + zlib.MAX_WBITS)
        while data := raw.read(1 << 20):
            read += len(data)
            while data:
                if member is None:  # between gzip members: zero padding, then another member or the end
                    data = data.lstrip(b"\0")
                    if not data:
                        break
                    member = _inflate.decompressobj(16 + zlib.MAX_WBITS)
                try:
                    out = member.decompress(data, CHUNK_BYTES)
                except _INFLATE_ERRORS as exc:
                    raise EvidenceError(f"{path}: cannot read trace: corrupt gzip data: {exc}") from exc
                produced += len(out)
                if produced > MAX_JSON_BYTES:
                    raise EvidenceError(f"{path}: decompressed trace is over the {MAX_JSON_BYTES}-byte limit")
                consumed = read - len(member.unconsumed_tail) - len(member.unused_data)
                if produced > RATIO_FLOOR_BYTES and produced > MAX_RATIO * consumed:
                    raise EvidenceError(
                        f"{path}: expands over {MAX_RATIO} times its compressed size, far beyond any trace;"
                        " refused as a compression bomb"
                    )
                if out:
                    yield out
                if member.eof:
                    data, member = member.unused_data, None
                else:
                    data = member.unconsumed_tail
        if member is not None and not member.eof:
            raise EvidenceError(f"{path}: cannot read trace: the compressed stream ends before its end marker")


def _parse(piece: bytes) -> Any:
    """orjson (several times faster); the standard parser for what only it admits (NaN, huge integers)."""
    try:
        return orjson.loads(piece)
    except orjson.JSONDecodeError:
        return json.loads(piece)


def _compact(event: Any) -> Any:
    """The parts of a selected event the table is made of (a trace's args carry dozens of others)."""
    if type(event) is not dict:
        return event
    kept = {key: event[key] for key in _EVENT_KEYS if key in event}
    args = kept.get("args")
    if type(args) is dict:
        kept["args"] = {key: value for key, value in args.items() if key in _ARG_KEYS}
    return kept


# ---- the fast path: whole runs of events decoded by msgspec into typed structs -----------------

_UNSET: Any = msgspec.UNSET


def _arg(key: str) -> Any:
    return msgspec.field(default=_UNSET, name=key)


class _Args(msgspec.Struct, gc=False):
    """The args the table is made of; msgspec skips every other key without building it."""

    external_id: Any = _arg("External id")
    collective: Any = _arg("Collective name")
    pg_name: Any = _arg("Process Group Name")
    pg_ranks: Any = _arg("Process Group Ranks")
    pg_desc: Any = _arg("Process Group Description")
    group_size: Any = _arg("Group size")
    dtype: Any = _arg("dtype")
    nelems: Any = _arg("In msg nelems")
    seq_upper: Any = _arg("Seq")
    seq: Any = _arg("seq")
    device: Any = _arg("device")
    stream: Any = _arg("stream")
    peer: Any = _arg("Peer")
    peer_lower: Any = _arg("peer")
    dst_rank: Any = _arg("Dst Rank")
    src_rank: Any = _arg("Src Rank")
    dst_rank_lower: Any = _arg("dst_rank")
    src_rank_lower: Any = _arg("src_rank")


class _Event(msgspec.Struct, gc=False):
    """The members of an event the table is made of. Its args stay raw text (a slice of the input),
    decoded only for the few events selected."""

    ph: Any = _UNSET
    cat: Any = _UNSET
    name: Any = _UNSET
    ts: Any = _UNSET
    dur: Any = _UNSET
    pid: Any = _UNSET
    args: msgspec.Raw | msgspec.UnsetType = _UNSET


_ARG_NAMES = tuple(f.encode_name for f in msgspec.structs.fields(_Args))
assert set(_ARG_NAMES) == _ARG_KEYS
assert _Event.__struct_fields__ == _EVENT_KEYS
# Elements that are not objects (which the table skips) send their run to the scanner.
_DECODER = msgspec.json.Decoder(list[_Event])
_OPEN = ord("{")
# Events are 100 bytes or more (a Kineto flow event, the smallest, is about 110). A run with one
# "{" per fewer bytes goes to the scanner: a piece of tiny objects would build a struct per few bytes.
_MIN_BYTES_PER_OBJECT = 48
_ARGS_DECODER = msgspec.json.Decoder(_Args)
# Where one event ends and the next begins, in the text any JSON writer produces: "}" "," "{".
_BOUNDARY = re.compile(rb"\}\s*,\s*\{")
_BOUNDARY_TAIL = 1 << 20
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_BLANKS = re.compile(rb"\s*")


class _NotTaken(Exception):
    """A run msgspec does not read as the whole-document parse would: it goes to the bracket scanner."""


def _args(raw: Any) -> Any:
    """An event's raw args as ``_compact`` keeps them: the used keys of an object; anything else as is."""
    try:
        args = _ARGS_DECODER.decode(raw)
    except msgspec.ValidationError:
        value = msgspec.json.decode(raw)  # not an object (the table ignores it), or a number out of range
        if type(value) is dict:
            raise _NotTaken from None
        return value
    return msgspec.to_builtins(args)  # the members present, by their names in the trace (unset ones left out)


def _selected(items: list) -> list[dict]:
    """The events the table could use (a superset of those ``_load_one`` takes), each as ``_compact``
    gives it from the whole-object parse."""
    kept = []
    for event in items:
        if type(event) is not _Event or type(name := event.name) is not str:
            continue
        args = _UNSET
        if event.cat == "kernel":
            if not name.startswith("nccl"):
                # A compute kernel, unless its args name a collective (the text must say so, or escape it).
                text = bytes(event.args) if isinstance(event.args, msgspec.Raw) else b""
                if b"Collective name" not in text and b"\\u" not in text:
                    continue
                args = _args(event.args)
                if type(args) is not dict or "Collective name" not in args:
                    continue
        elif name != "record_param_comms" and not name.startswith("ProfilerStep#"):
            continue
        # The members present (one C call; msgspec.Raw is not a builtin, so args is added after).
        compact = msgspec.to_builtins(msgspec.structs.replace(event, args=_UNSET))
        if event.args is not _UNSET:
            compact["args"] = _args(event.args) if args is _UNSET else args
        kept.append(compact)
    return kept


class _Tokens(NamedTuple):
    """The brackets of a buffer that lie outside strings: offsets, the bytes, the nesting after each."""

    pos: np.ndarray
    char: np.ndarray
    depth: np.ndarray


def _tokens(buf: bytes, depth0: int, path: Path) -> _Tokens:
    """The bracket structure of ``buf`` (which starts outside any string, at nesting ``depth0``), vectorised.

    A quote after an odd run of backslashes is escaped; any other quote opens or closes a string;
    a bracket after an odd number of quotes lies inside a string and is not structure.
    """
    data = np.frombuffer(buf, np.uint8)
    at = np.flatnonzero(np.frombuffer(buf.translate(_TOKEN_BYTES), bool))
    chars = data[at]
    quote = chars == _QUOTE
    if b"\\" in buf:
        slash = chars == _BACKSLASH
        slashes = at[slash]
        run_start = np.r_[True, slashes[1:] != slashes[:-1] + 1]
        starts = slashes[run_start]
        lengths = np.diff(np.r_[np.flatnonzero(run_start), len(slashes)])
        escaped = (starts + lengths)[lengths % 2 == 1]
        quote &= ~np.isin(at, escaped)
        keep = ~slash
        at, chars, quote = at[keep], chars[keep], quote[keep]
    outside = ~quote & ((np.cumsum(quote, dtype=np.int64) & 1) == 0)
    at, chars = at[outside], chars[outside]
    depth = np.cumsum(_DELTA[chars]) + depth0
    if len(depth):
        if depth.max() > MAX_DEPTH:
            raise EvidenceError(f"{path}: JSON nested deeper than {MAX_DEPTH} levels, which no trace is")
        if depth.min() < 0:
            raise EvidenceError(f"{path}: not valid JSON: a bracket closes what was never opened")
    return _Tokens(at, chars, depth)


def _ends_with_key(text: bytes) -> str | None:
    """The member name that ``text`` (the document so far, at nesting 1) ends with, as in ``"name":``."""
    text = text.rstrip()
    if not text.endswith(b":"):
        return None
    text = text[:-1].rstrip()
    if not text.endswith(b'"'):
        return None
    at = len(text) - 1
    while (at := text.rfind(b'"', 0, at)) >= 0:
        slashes = len(text[:at]) - len(text[:at].rstrip(b"\\"))
        if slashes % 2 == 0:
            try:
                key = orjson.loads(text[at:])
            except orjson.JSONDecodeError:
                return None
            return key if type(key) is str else None
    return None


class _TraceReader:
    """A trace read as a stream of pieces: ``traceEvents`` element by element, everything else as the
    document's skeleton (the document with that array emptied), parsed whole at the end.

    Only the events whose text could matter (``_NEEDLES``) are parsed, and only their useful parts
    kept; the others are checked for structure (balanced brackets, closed strings, nesting depth)
    and skipped. Memory holds a chunk, the event it ends in, the skeleton and the selected events.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.in_events = False
        self.skeleton = bytearray()
        self.events: list = []
        self.seen = 0  # elements of the current traceEvents array

    def read(self) -> dict:
        carry, depth = b"", 0
        for chunk in _chunks(self.path):
            carry, depth = self._take(carry + chunk if carry else chunk, depth)
            if len(carry) > MAX_PIECE_BYTES or len(self.skeleton) > MAX_PIECE_BYTES:
                what = "an event" if self.in_events else "the trace outside its events"
                raise EvidenceError(f"{self.path}: {what} is over the {MAX_PIECE_BYTES}-byte limit")
        if self.in_events and carry:  # the events the fast path left for the next chunk: there is none
            keep, depth = self._feed(carry, depth)
            carry = carry[keep:]
        self.skeleton += carry
        try:
            trace = _parse(bytes(self.skeleton))
        except (ValueError, RecursionError) as exc:
            raise EvidenceError(f"{self.path}: not valid JSON: {exc}") from exc
        if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
            raise EvidenceError(f"{self.path}: not a Kineto trace (no 'traceEvents' list)")
        trace["traceEvents"] = self.events
        return trace

    def _feed(self, buf: bytes, depth0: int) -> tuple[int, int]:
        """Take in the complete pieces of ``buf``; returns where the rest begins and the nesting there."""
        tokens = _tokens(buf, depth0, self.path)
        pos, char, depth = tokens
        if not len(pos):
            return 0, depth0
        # The top level: brackets leaving nesting <= 1, and the openings of top-level values.
        top = np.flatnonzero((depth <= 1) | ((depth == 2) & (_DELTA[char] > 0)))
        mark, first = 0, 0
        if self.in_events:
            close = int(top[0]) if len(top) else None
            mark = self._elements(buf, tokens, 0, close)
            if close is None:
                return mark, 2
            self._close(char[close])
            mark, first = int(pos[close]) + 1, 1
        for index in top[first:].tolist():
            p = int(pos[index])
            if self.in_events:  # the closing bracket of traceEvents
                self._close(char[index])
                mark = p + 1
            elif char[index] == ord("[") and depth[index] == 2:
                self.skeleton += buf[mark:p]
                if _ends_with_key(self.skeleton[-_KEY_TAIL:]) == "traceEvents":
                    # Another traceEvents replaces the first, as when the whole document is parsed.
                    self.skeleton += b"[]"
                    self.in_events, self.events, self.seen = True, [], 0
                    following = top[np.searchsorted(top, index) + 1 :]
                    close = int(following[0]) if len(following) else None
                    mark = self._elements(buf, tokens, index + 1, close)
                    if close is None:
                        return mark, 2
                else:
                    mark = p
        # Outside traceEvents: up to the last bracket into the skeleton, the rest (which may end in
        # a string cut in two) carried over.
        last = int(pos[-1]) + 1
        self.skeleton += buf[mark:last]
        return last, int(depth[-1])

    def _take(self, buf: bytes, depth: int) -> tuple[bytes, int]:
        """Take in the complete pieces of ``buf``; returns the rest and the nesting where it begins.

        Outside traceEvents the bracket scanner reads up to where the array seems to open (a plain
        ``"traceEvents": [``; the scanner decides whether it does); inside, runs of events are
        decoded by msgspec, and what it does not take goes to the scanner.
        """
        at = 0
        while not self.in_events:
            opening = _EVENTS_KEY.search(buf, at)
            if opening is None:
                keep, depth = self._feed(buf[at:] if at else buf, depth)
                return buf[at + keep :], depth
            keep, depth = self._feed(buf[at : opening.end()], depth)
            at += keep
            if at != opening.end():  # the scanner kept a rest: not the place to switch
                return buf[at:], depth
        taken = self._decode_run(buf, at)
        if taken is None:
            rest = buf[at:] if at else buf
            taken, depth = self._feed(rest, depth)
            return rest[taken:], depth
        return buf[taken:], 2

    def _decode_run(self, buf: bytes, at: int = 0) -> int | None:
        """Decode the complete events of ``buf[at:]`` (which starts between two events of traceEvents) in
        one msgspec call; returns where the rest begins in ``buf``, or None to leave ``buf[at:]`` to the
        bracket scanner.

        The run is cut after the last "}" followed by "," and "{". If that "}" does not end an event
        (it closes an object inside one, or sits in a string), ``[`` + run + ``]`` is not valid JSON:
        a parser reads a prefix of the document the same way whatever follows, so it can close the
        added array only where the real array is between two elements. What msgspec does not take
        as the whole-document parse would (NaN, numbers past the float range, nesting deeper than
        its recursion limit), elements that are not objects, runs of tiny objects (memory) and
        pieces with no boundary in their last MiB go to the scanner.
        """
        end = len(buf)
        floor = max(at, end - _BOUNDARY_TAIL)
        while (end := buf.rfind(b"}", floor, end)) >= 0 and not _BOUNDARY.match(buf, end):
            pass
        if end < 0:
            return None
        end += 1
        blanks = _BLANKS.match(buf, at)
        start = blanks.end() if blanks else at
        if buf[start : start + 1] == b",":
            if not self.seen:
                return None  # "[," is not JSON: the scanner's parse says so
            start += 1
        # numpy compares bytes several times faster than bytes.count does with one character
        if np.count_nonzero(np.frombuffer(buf, np.uint8, end - start, start) == _OPEN) * _MIN_BYTES_PER_OBJECT > (
            end - start
        ):
            return None
        try:
            # One copy of the run, brackets included (a megabyte copied costs page faults as well).
            items = _DECODER.decode(b"".join((b"[", memoryview(buf)[start:end], b"]")))
            wanted = _selected(items)
        except (msgspec.DecodeError, RecursionError, _NotTaken):
            return None
        self.seen += len(items)
        if self.seen > MAX_EVENTS:
            raise EvidenceError(f"{self.path}: more than {MAX_EVENTS} events")
        if len(self.events) + len(wanted) > MAX_KEPT_EVENTS:
            raise EvidenceError(
                f"{self.path}: more than {MAX_KEPT_EVENTS} NCCL, record_param_comms and ProfilerStep events"
            )
        self.events += wanted
        return end

    def _close(self, char: int) -> None:
        if char != ord("]"):
            raise EvidenceError(f"{self.path}: not valid JSON: traceEvents closes with a '}}'")
        self.in_events = False

    def _elements(self, buf: bytes, tokens: _Tokens, first: int, close: int | None) -> int:
        """Select and parse the complete elements of traceEvents in tokens ``first`` up to ``close`` (its
        ``]``; None: beyond this buffer). Returns where the first incomplete element starts."""
        pos, char, depth = tokens
        region = slice(first, len(pos) if close is None else close)
        delta = _DELTA[char[region]]
        opens = pos[region][(depth[region] == 3) & (delta > 0)]
        ends = pos[region][(depth[region] == 2) & (delta < 0)] + 1
        complete = len(ends)
        self.seen += complete
        if self.seen > MAX_EVENTS:
            raise EvidenceError(f"{self.path}: more than {MAX_EVENTS} events")
        if close is not None:
            rest = int(pos[close])
        elif complete < len(opens):
            rest = int(opens[complete])
        else:
            rest = int(pos[region.stop - 1]) + 1 if region.stop else 0  # after the last bracket (or the '[')
        if not complete:
            return rest
        lo, hi = int(opens[0]), int(ends[complete - 1])
        hits = []
        for needle in _NEEDLES:
            at = buf.find(needle, lo, hi)
            while at >= 0:
                hits.append(at)
                at = buf.find(needle, at + len(needle), hi)
        if hits:
            found = np.array(hits)
            index = np.searchsorted(opens[:complete], found, side="right") - 1
            selected = np.unique(index[found < ends[index]])
            if len(self.events) + len(selected) > MAX_KEPT_EVENTS:
                raise EvidenceError(
                    f"{self.path}: more than {MAX_KEPT_EVENTS} NCCL, record_param_comms and ProfilerStep events"
                )
            for i in selected.tolist():
                try:
                    self.events.append(_compact(_parse(buf[opens[i] : ends[i]])))
                except (ValueError, RecursionError) as exc:
                    where = f"event {self.seen - complete + i}"
                    raise EvidenceError(f"{self.path}: not valid JSON: {where}: {exc}") from exc
        return rest


def load(path: Path) -> pa.Table:
    """The NCCL operations (and ProfilerStep spans) of every trace under ``path``."""
    path = Path(path)
    if not path.exists():
        raise EvidenceError(f"{path}: no such file or directory")
    files = _trace_files(path)
    if not files:
        raise EvidenceError(f"{path}: no Kineto trace found")
    tables: list[pa.Table] = []
    pending: list[_Trace] = []
    seen: dict[int, Path] = {}
    rows = 0

    def build() -> None:
        nonlocal rows
        table = _table(pending)
        ranks, counts = np.unique(table.column("rank").to_numpy(), return_counts=True)
        per_rank = dict(zip(ranks.tolist(), counts.tolist(), strict=True))
        for trace in pending:
            rows += per_rank.get(trace.rank, 0)
            if rows > MAX_ROWS:
                raise EvidenceError(f"{trace.path}: more than {MAX_ROWS} operations in the traces read so far")
        tables.append(table)
        pending.clear()

    # Traces are read one by one and built into the table in batches of up to BATCH_EVENTS selected
    # events: few Arrow calls for many small traces, bounded memory for large ones.
    for file in files:
        with paused_gc():
            trace = _trace(file, _read(file))
        if trace.rank in seen:
            raise EvidenceError(f"{file}: rank {trace.rank} already read from {seen[trace.rank].name}")
        seen[trace.rank] = file
        pending.append(trace)
        if sum(len(t.events) for t in pending) >= BATCH_EVENTS:
            with paused_gc():
                build()
    if pending:
        with paused_gc():
            build()
    result = concat(tables)
    if result.num_rows == 0:
        raise EvidenceError(f"{path}: no NCCL operations or ProfilerStep spans in the trace(s)")
    return result


register(Importer(NAME, detect, load))
