"""PyTorch Flight Recorder dumps -> the operations table.

A Flight Recorder dump (``TORCH_NCCL_TRACE_BUFFER_SIZE`` / ``TORCH_FR_DUMP_TEMP_FILE``) is one file
per rank, named ``<prefix><rank>``, holding a pickled (or, for the JSON variant, JSON) dict:
``version``, ``pg_config`` ({pg name: {name, desc, ranks}}), ``pg_status`` ({pg id:
{last_enqueued_collective, last_started_collective, last_completed_collective}}) and ``entries``
(one dict per recorded operation). Pickles are untrusted input: they are read by an unpickler
whose ``find_class`` refuses everything, so only plain containers and scalars can come out,
and with caps on file size, entry count and tensor-list length.

The mapping onto the operations table is in docs/formats/evidence.md. Besides one row per
entry, ``pg_status`` yields a "progress" row per (rank, process group) carrying the
last-completed watermark, because dumps usually hold only operations that had not completed.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import pyarrow as pa

from comminsight.evidence import PROGRESS_OP
from comminsight.importers import EvidenceError, Importer, register
from comminsight.importers.columns import to_table
from comminsight.importers.normalise import ITEMSIZE, dtype_name, op_name, shape_text, trailing_int

NAME = "flight_recorder"
MAX_FILE_BYTES = 512 * 1024 * 1024
MAX_ENTRIES = 4_000_000
MAX_TENSORS_PER_ENTRY = 4096
MAX_DIMS = 32
MAX_FILES = 65536
_HEAD = 4096
_STATES = {"scheduled": "scheduled", "started": "started", "completed": "completed"}
_P2P_NAME = re.compile(r"(send|recv)\s+(\d+)\s*(->|<-)\s*(\d+)", re.I)


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits plain containers and scalars only: every global lookup is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: dumps may hold only plain data")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing persistent ids: dumps may hold only plain data")


def _head(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(_HEAD)
    except OSError:
        return b""


def _is_dump_file(path: Path) -> bool:
    head = _head(path)
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return any(key in head for key in (b"version", b"pg_config", b"entries", b"pg_status"))
    stripped = head.lstrip()
    # Kineto traces also carry a "pg_config" (inside distributedInfo): tell them apart by their own keys.
    kineto_keys = (b'"traceEvents"', b'"schemaVersion"', b'"distributedInfo"', b'"deviceProperties"')
    if stripped.startswith(b"{") and not any(key in head for key in kineto_keys):
        return any(key in head for key in (b'"pg_config"', b'"pg_status"', b'"entries"'))
    return False


def _dump_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = []
    for child in sorted(path.iterdir()):
        if child.name.startswith(".") or not child.is_file():
            continue
        if _is_dump_file(child):
            files.append(child)
            if len(files) > MAX_FILES:
                raise EvidenceError(f"{path}: more than {MAX_FILES} dump files")
    return files


def detect(path: Path) -> bool:
    """A dump file, or a directory holding at least one (looks at names and first bytes only)."""
    if path.is_file():
        return _is_dump_file(path)
    if path.is_dir():
        checked = 0
        for child in sorted(path.iterdir()):
            if child.is_file() and not child.name.startswith("."):
                if _is_dump_file(child):
                    return True
                checked += 1
                if checked >= 64:
                    break
    return False


def _read(path: Path) -> dict:
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise EvidenceError(f"{path}: {size} bytes is over the {MAX_FILE_BYTES}-byte limit for a dump")
    data = path.read_bytes()
    try:
        dump = _RestrictedUnpickler(io.BytesIO(data)).load() if data[:1] == b"\x80" else json.loads(data)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError) as exc:
        raise EvidenceError(f"{path}: not a readable Flight Recorder dump: {exc}") from exc
    except (RecursionError, MemoryError, OverflowError) as exc:
        raise EvidenceError(f"{path}: dump too deeply nested or too large: {type(exc).__name__}") from exc
    if not isinstance(dump, dict):
        raise EvidenceError(f"{path}: a Flight Recorder dump is a dict, found {type(dump).__name__}")
    entries = dump.get("entries", [])
    if not isinstance(entries, list):
        raise EvidenceError(f"{path}: 'entries' must be a list")
    if len(entries) > MAX_ENTRIES:
        raise EvidenceError(f"{path}: {len(entries)} entries is over the limit of {MAX_ENTRIES}")
    return dump


def _int(value: Any, what: str, path: Path, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise EvidenceError(f"{path}: {what} must be an integer, found {value!r:.60}")
    return value


def _int_field(entry: dict, key: str, index: int, path: Path) -> int | None:
    """``entry[key]`` as an integer or None; the message is only built on error (this runs per field)."""
    value = entry.get(key)
    if value is None or type(value) is int:
        return value
    raise EvidenceError(f"{path}: entry {index} {key} must be an integer, found {value!r:.60}")


@lru_cache(maxsize=4096)
def _distinct_dtypes(names: tuple[str, ...]) -> list[str]:
    return sorted({dtype_name(d) or "" for d in names} - {""})


def _ranks(value: Any, path: Path) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, str):
        if len(value) > 8 * 1024 * 1024:
            raise EvidenceError(f"{path}: pg_config ranks text too long")
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise EvidenceError(f"{path}: pg_config ranks {value[:60]!r} is not a list of ranks") from exc
    if not isinstance(value, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in value):
        raise EvidenceError(f"{path}: pg_config ranks must be a list of integers")
    return value


def _rank_of(dump: dict, path: Path, groups: dict[str, dict]) -> int:
    rank = dump.get("rank")
    if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0:
        return rank
    rank = trailing_int(path.name)
    if rank is not None:
        return rank
    # Fall back on the process groups: the one rank every listed group contains.
    common: set[int] | None = None
    for group in groups.values():
        if group["ranks"] is not None:
            common = set(group["ranks"]) if common is None else common & set(group["ranks"])
    if common is not None and len(common) == 1:
        return next(iter(common))
    raise EvidenceError(f"{path}: cannot tell which rank wrote this dump (no 'rank' key, no rank in the file name)")


def _groups(dump: dict, path: Path) -> dict[str, dict]:
    config = dump.get("pg_config", {}) or {}
    if not isinstance(config, dict):
        raise EvidenceError(f"{path}: 'pg_config' must be a dict")
    groups = {}
    for name, group in config.items():
        if not isinstance(group, dict):
            raise EvidenceError(f"{path}: pg_config[{name!r}] must be a dict")
        desc = group.get("desc")
        groups[str(name)] = {
            "desc": str(desc) if desc is not None else None,
            "ranks": _ranks(group.get("ranks"), path),
        }
    return groups


def _shape_and_count(sizes: Any, path: Path, index: int) -> tuple[str | None, int | None]:
    if sizes is None:
        return None, None
    if not isinstance(sizes, list | tuple) or len(sizes) > MAX_TENSORS_PER_ENTRY:
        raise EvidenceError(f"{path}: entry {index}: input_sizes must be a list of at most {MAX_TENSORS_PER_ENTRY}")
    count = 0
    for shape in sizes:
        if not isinstance(shape, list | tuple) or len(shape) > MAX_DIMS:
            raise EvidenceError(f"{path}: entry {index}: each input size must be a list of at most {MAX_DIMS} dims")
        for dim in shape:
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
                raise EvidenceError(f"{path}: entry {index}: tensor dimensions must be non-negative integers")
        count += math.prod(shape)
    return shape_text(sizes), count


def _load_one(path: Path, dump: dict, columns: dict[str, list]) -> int:
    groups = _groups(dump, path)
    rank = _rank_of(dump, path, groups)
    entries = dump.get("entries", []) or []
    pg_names: dict[int, str] = {}
    last_kind: dict[str, tuple[int, str]] = {}
    kind_seqs: dict[tuple[str, str], list[int]] = {}

    # Per group, once: description, members, size and this rank's place among them.
    comm_info: dict[str, tuple[str | None, list[int] | None, int | None, int | None]] = {}

    def add_comm(name: str, desc: str | None) -> None:
        info = comm_info.get(name)
        if info is None:
            group = groups.get(name, {})
            ranks = group.get("ranks")
            position = ranks.index(rank) if ranks is not None and rank in ranks else None
            info = comm_info[name] = (group.get("desc"), ranks, len(ranks) if ranks is not None else None, position)
        columns["comm_id"].append(name)
        columns["comm_name"].append(name)
        columns["comm_desc"].append(info[0] or desc)
        columns["comm_ranks"].append(info[1])
        columns["comm_size"].append(info[2])
        columns["comm_rank"].append(info[3])
        columns["rank"].append(rank)

    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise EvidenceError(f"{path}: entry {index} is not a dict")
        group = entry.get("process_group")
        if not isinstance(group, list | tuple) or not group:
            raise EvidenceError(f"{path}: entry {index} has no process_group")
        name = str(group[0])
        desc = str(group[1]) if len(group) > 1 and group[1] is not None else None
        profiling_name = entry.get("profiling_name")
        if profiling_name is not None and not isinstance(profiling_name, str):
            raise EvidenceError(f"{path}: entry {index}: profiling_name must be text")
        op = op_name(profiling_name)
        is_p2p = bool(entry.get("is_p2p", False)) or op in ("send", "recv")
        seq_key = "p2p_seq_id" if is_p2p else "collective_seq_id"
        seq = _int_field(entry, seq_key, index, path)
        state = entry.get("state", "scheduled")
        if state not in _STATES:
            raise EvidenceError(f"{path}: entry {index} has unknown state {state!r:.40}")
        shape, count = _shape_and_count(entry.get("input_sizes"), path, index)
        dtype_list = entry.get("input_dtypes") or []
        if not isinstance(dtype_list, list | tuple) or not all(type(d) is str for d in dtype_list):
            raise EvidenceError(f"{path}: entry {index}: input_dtypes must be a list of names")
        distinct = _distinct_dtypes(tuple(dtype_list))
        dtype = ",".join(distinct) if distinct else None
        peer = None
        if is_p2p and profiling_name:
            match = _P2P_NAME.search(profiling_name)
            ranks = groups.get(name, {}).get("ranks")
            if match:
                local_peer = int(match.group(4))
                peer = ranks[local_peer] if ranks is not None and local_peer < len(ranks) else local_peer
        pg_id = entry.get("pg_id")
        if isinstance(pg_id, int) and not isinstance(pg_id, bool):
            pg_names.setdefault(pg_id, name)
        kind = "p2p" if is_p2p else "comm"
        record_id = _int_field(entry, "record_id", index, path)
        if seq is not None:
            kind_seqs.setdefault((name, kind), []).append(seq)
            order = record_id if record_id is not None else index
            if name not in last_kind or order >= last_kind[name][0]:
                last_kind[name] = (order, kind)

        add_comm(name, desc)
        columns["op"].append(op)
        columns["is_p2p"].append(is_p2p)
        columns["seq"].append(seq)
        columns["seq_kind"].append(kind)
        columns["count"].append(count)
        itemsize = ITEMSIZE.get(distinct[0], 0) if len(distinct) == 1 else 0
        columns["bytes"].append(count * itemsize if count is not None and itemsize else None)
        columns["dtype"].append(dtype)
        columns["shape"].append(shape)
        columns["peer"].append(peer)
        columns["state"].append(_STATES[state])
        columns["enqueue_ns"].append(_int_field(entry, "time_created_ns", index, path))
        columns["start_ns"].append(_int_field(entry, "time_discovered_started_ns", index, path))
        columns["end_ns"].append(_int_field(entry, "time_discovered_completed_ns", index, path))
        columns["record_id"].append(record_id)

    # pg_status: keyed by the process group's local id; we can only place it for groups whose id
    # appears in the entries. It counts whichever sequence (collective or P2P) the group last used,
    # so it is trusted only when it agrees with the entries of that kind.
    status = dump.get("pg_status", {}) or {}
    if not isinstance(status, dict):
        raise EvidenceError(f"{path}: 'pg_status' must be a dict")
    for key, watermark in status.items():
        try:
            placed = pg_names.get(int(key))
        except (TypeError, ValueError):
            placed = None
        if placed is None or not isinstance(watermark, dict) or placed not in last_kind:
            continue
        name = placed
        kind = last_kind[name][1]
        seqs = kind_seqs.get((name, kind), [])
        enqueued = watermark.get("last_enqueued_collective")
        completed = watermark.get("last_completed_collective")
        if not (isinstance(enqueued, int) and isinstance(completed, int)):
            continue
        if isinstance(enqueued, bool) or isinstance(completed, bool):
            continue
        if not seqs or enqueued != max(seqs) or not (min(seqs) - 1 <= completed <= enqueued) or completed < 0:
            continue
        add_comm(name, None)
        columns["op"].append(PROGRESS_OP)
        columns["is_p2p"].append(kind == "p2p")
        columns["seq"].append(completed)
        columns["seq_kind"].append(kind)
        for column in ("count", "bytes", "dtype", "shape", "peer", "enqueue_ns", "start_ns", "end_ns", "record_id"):
            columns[column].append(None)
        columns["state"].append("completed")
    # A group this rank belongs to but has nothing recorded for: say so with a progress row
    # without a sequence, so the rank counts as present (it dumped) and its membership is known.
    for name in groups:
        if name not in last_kind:
            add_comm(name, None)
            columns["op"].append(PROGRESS_OP)
            columns["is_p2p"].append(False)
            for column in ("seq", "seq_kind", "count", "bytes", "dtype", "shape", "peer"):
                columns[column].append(None)
            for column in ("enqueue_ns", "start_ns", "end_ns", "record_id"):
                columns[column].append(None)
            columns["state"].append("completed")
    return rank


_COLUMNS = [
    "rank",
    "comm_id",
    "comm_name",
    "comm_desc",
    "comm_ranks",
    "comm_size",
    "comm_rank",
    "op",
    "is_p2p",
    "seq",
    "seq_kind",
    "count",
    "bytes",
    "dtype",
    "shape",
    "peer",
    "state",
    "enqueue_ns",
    "start_ns",
    "end_ns",
    "record_id",
]


def load(path: Path) -> pa.Table:
    """All dumps under ``path`` (a dump file or a directory of per-rank dumps) as one operations table."""
    path = Path(path)
    if not path.exists():
        raise EvidenceError(f"{path}: no such file or directory")
    files = _dump_files(path)
    if not files:
        raise EvidenceError(f"{path}: no Flight Recorder dump found")
    # One set of columns for all files, converted once: a bad file raises before anything is returned.
    columns: dict[str, list] = {name: [] for name in _COLUMNS}
    seen: dict[int, Path] = {}
    for file in files:
        dump = _read(file)
        rank = _load_one(file, dump, columns)
        if rank in seen:
            raise EvidenceError(f"{file}: rank {rank} already read from {seen[rank].name}")
        seen[rank] = file
    columns["source"] = [NAME] * len(columns["rank"])
    return to_table(columns, path)


register(Importer(NAME, detect, load))
