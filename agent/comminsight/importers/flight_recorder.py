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

Unpickling makes Python objects entry by entry; everything after is columnar: the entries of
all files are gathered field by field into lists, then checked, normalised (per distinct value)
and mapped as Arrow/numpy columns, once for the whole load. A check that fails on a column is
re-run entry by entry only to name the file and entry at fault.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import re
from collections.abc import Callable
from functools import lru_cache
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from comminsight.evidence import PROGRESS_OP
from comminsight.importers import EvidenceError, Importer, directory_holds, evidence_files, register
from comminsight.importers.columns import concat, paused_gc, to_table
from comminsight.importers.normalise import ITEMSIZE, dtype_name, map_distinct, ops, shape_text, trailing_int

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
    files = evidence_files(path, _is_dump_file)
    if len(files) > MAX_FILES:
        raise EvidenceError(f"{path}: more than {MAX_FILES} dump files")
    return files


def detect(path: Path) -> bool:
    """A dump file, or a directory holding at least one (looks at names and first bytes only)."""
    if path.is_file():
        return _is_dump_file(path)
    return path.is_dir() and directory_holds(path, _is_dump_file)


def _read(path: Path) -> dict:
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise EvidenceError(f"{path}: {size} bytes is over the {MAX_FILE_BYTES}-byte limit for a dump")
    data = path.read_bytes()
    try:
        # A buffered reader lets the C unpickler read ahead (several times faster on unframed protocol-2 dumps).
        source = io.BufferedReader(io.BytesIO(data), buffer_size=1 << 16)
        dump = _RestrictedUnpickler(source).load() if data[:1] == b"\x80" else json.loads(data)
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


class _Dump(NamedTuple):
    """One file's parsed dump with what is known about it before its entries are mapped."""

    path: Path
    dump: dict
    groups: dict[str, dict]
    rank: int
    entries: list


class _Locate:
    """Entry number in the concatenation of all files -> "<file>: entry <number in that file>" (for errors)."""

    def __init__(self, dumps: list[_Dump]) -> None:
        self.paths = [d.path for d in dumps]
        self.starts = np.cumsum([0, *(len(d.entries) for d in dumps)])

    def __call__(self, index: int) -> tuple[Path, int]:
        file = int(np.searchsorted(self.starts, index, side="right") - 1)
        return self.paths[file], index - int(self.starts[file])

    def where(self, index: int) -> str:
        path, local = self(index)
        return f"{path}: entry {local}"


def _int_column(values: list, key: Callable[[int], str], locate: _Locate) -> pa.Array:
    """An int64 column of integers or None; the first other value is reported with its entry index."""
    try:
        array = pa.array(values, pa.int64())
        if set(map(type, values)) <= _INT_OR_NONE:
            return array
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
        pass
    for index, value in enumerate(values):
        if not (value is None or type(value) is int) or (value is not None and not -(1 << 63) <= value < 1 << 63):
            raise EvidenceError(f"{locate.where(index)} {key(index)} must be an integer, found {value!r:.60}")
    raise EvidenceError(f"{locate.paths[0]}: {key(0)} must be integers")


def _shapes(sizes: list, locate: _Locate) -> tuple[pa.Array, pa.Array]:
    """(shape text, element count) columns from the entries' ``input_sizes``, checked and computed vectorised.

    Anything off the plain path (a bound exceeded, a non-integer or negative dimension) is handed to
    ``_shape_and_count`` entry by entry, which names the first bad entry.
    """

    def explain() -> None:
        for index, value in enumerate(sizes):
            _shape_and_count(value, *locate(index))
        raise EvidenceError(f"{locate.paths[0]}: input_sizes must be lists of tensor shapes")

    try:
        outer = pa.array(sizes)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
        explain()
    if pa.types.is_null(outer.type):
        return pa.nulls(len(sizes), pa.string()), pa.nulls(len(sizes), pa.int64())
    if not (pa.types.is_list(outer.type) and pa.types.is_list(outer.type.value_type)):
        explain()
    if not pa.types.is_integer(outer.type.value_type.value_type) and len(outer.flatten().flatten()):
        explain()
    outer = outer.cast(pa.list_(pa.list_(pa.int64())))
    tensors = outer.flatten()
    dims = tensors.flatten()
    tensor_counts = pc.fill_null(pc.list_value_length(outer), 0).to_numpy()
    dim_counts = pc.list_value_length(tensors).to_numpy(zero_copy_only=False)
    if (
        tensors.null_count
        or dims.null_count
        or (len(tensor_counts) and tensor_counts.max() > MAX_TENSORS_PER_ENTRY)
        or (len(dim_counts) and dim_counts.max() > MAX_DIMS)
        or (len(dims) and pc.min(dims).as_py() < 0)
    ):
        explain()
    # Elements per tensor: a (tensors x widest shape) matrix padded with ones, multiplied along rows.
    values = dims.to_numpy()
    width = int(dim_counts.max()) if len(dim_counts) else 0
    starts = np.repeat(np.cumsum(dim_counts) - dim_counts, dim_counts)
    row = np.repeat(np.arange(len(dim_counts)), dim_counts)
    matrix = np.ones((len(dim_counts), max(width, 1)), np.int64)
    matrix[row, np.arange(len(values)) - starts] = values
    # The same product in floating point tells an overflow apart (math.prod would give a huge int).
    if len(values) and matrix.astype(np.float64).prod(axis=1).sum() >= 2**62:
        raise EvidenceError(f"{locate.paths[0]}: input_sizes describe tensors with too many elements")
    per_tensor = np.concatenate(([0], np.cumsum(matrix.prod(axis=1))))
    bounds = np.concatenate(([0], np.cumsum(tensor_counts)))
    count = pa.array(
        per_tensor[bounds[1:]] - per_tensor[bounds[:-1]], mask=~outer.is_valid().to_numpy(zero_copy_only=False)
    )
    texts = pl.Series(outer).list.eval(
        pl.lit("[") + pl.element().list.eval(pl.element().cast(pl.String)).list.join(", ") + pl.lit("]")
    )
    shape = pl.lit("[") + pl.col("s").list.join(", ") + pl.lit("]")
    return pl.DataFrame({"s": texts}).select(shape).to_series().to_arrow(), count


@lru_cache(maxsize=4096)
def _dtype_info(names: tuple) -> tuple[str | None, int] | None:
    """(joined distinct dtypes, item size when there is exactly one) of one entry's dtype list; None if not text."""
    if not all(type(d) is str for d in names):
        return None
    distinct = _distinct_dtypes(names)
    return (",".join(distinct) if distinct else None), (ITEMSIZE.get(distinct[0], 0) if len(distinct) == 1 else 0)


def _dtypes(dtype_lists: list, locate: _Locate) -> tuple[pa.Array, np.ndarray]:
    """(dtype column, item sizes): each distinct source name normalised once, then per entry the sorted
    distinct names joined by ',' and an item size when there is exactly one."""

    def explain() -> None:
        for index, names in enumerate(dtype_lists):
            try:
                found = _dtype_info(tuple(names)) if isinstance(names, list | tuple) else None
            except TypeError:  # an unhashable element: not a name
                found = None
            if found is None:
                raise EvidenceError(f"{locate.where(index)}: input_dtypes must be a list of names")
        raise EvidenceError(f"{locate.paths[0]}: input_dtypes must be lists of names")

    if not dtype_lists:
        return pa.array([], pa.string()), np.zeros(0, np.int64)
    lists = None
    if set(map(type, dtype_lists)) <= {list, tuple}:
        try:
            lists = pa.array(dtype_lists)  # inferred: anything but text gives another type
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
            lists = None
    if lists is None or not (pa.types.is_null(lists.type.value_type) or pa.types.is_string(lists.type.value_type)):
        explain()
    assert lists is not None
    if lists.flatten().null_count:
        explain()
    flat = lists.flatten().cast(pa.string())
    if len(flat) and pc.any(pc.match_substring(flat, _SEPARATOR)).as_py():
        explain_each = [_dtype_info(tuple(names)) for names in dtype_lists]  # a name holding the separator
        return pa.array([i[0] for i in explain_each], pa.string()), np.array([i[1] for i in explain_each], np.int64)
    # One key per distinct list (its names joined), each distinct list normalised once.
    encoded = pc.dictionary_encode(pc.binary_join(lists.cast(pa.list_(pa.string())), _SEPARATOR))
    codes = encoded.indices.to_numpy()
    _, first = np.unique(codes, return_index=True)
    info = [_dtype_info(tuple(names)) for names in lists.take(pa.array(first)).to_pylist()]
    dtype = pa.array([i[0] for i in info], pa.string()).take(encoded.indices)
    return dtype, np.array([i[1] for i in info], np.int64)[codes]


@lru_cache(maxsize=4096)
def _local_peer(profiling_name: str | None) -> int | None:
    match = _P2P_NAME.search(profiling_name) if profiling_name else None
    # A peer number no group could hold is not a peer.
    return int(match.group(4)) if match and len(match.group(4)) < 10 else None


def _comm_info(
    groups: dict[str, dict], name: str, rank: int
) -> tuple[str | None, list[int] | None, int | None, int | None]:
    group = groups.get(name, {})
    ranks = group.get("ranks")
    position = ranks.index(rank) if ranks is not None and rank in ranks else None
    return group.get("desc"), ranks, len(ranks) if ranks is not None else None, position


def _fail_at(flags: list[bool], message: str, locate: _Locate, values: list) -> None:
    if any(flags):
        index = flags.index(True)
        raise EvidenceError(f"{locate.where(index)}{message.format(value=values[index])}")


# The entry fields the table is made of, and the value of each when an entry lacks it.
_FIELDS = {
    "process_group": None,
    "profiling_name": None,
    "is_p2p": False,
    "collective_seq_id": None,
    "p2p_seq_id": None,
    "state": "scheduled",
    "input_sizes": None,
    "input_dtypes": None,
    "record_id": None,
    "time_created_ns": None,
    "time_discovered_started_ns": None,
    "time_discovered_completed_ns": None,
}
_INT_OR_NONE = {int, type(None)}
_SEPARATOR = "\x1f"  # joins an entry's dtype names into one key


def _fields(entries: list[dict]) -> dict[str, list]:
    """One list per field of ``_FIELDS`` across ``entries`` (dicts)."""
    if not entries:
        return {key: [] for key in _FIELDS}
    try:
        # Entries normally carry every field: one C-level pass picks them all, then a transpose.
        rows = map(itemgetter(*_FIELDS), entries)
        return dict(zip(_FIELDS, map(list, zip(*rows, strict=True)), strict=True))
    except KeyError:
        return {key: [e.get(key, default) for e in entries] for key, default in _FIELDS.items()}


def _entries_table(dumps: list[_Dump], locate: _Locate) -> pa.Table:
    """One row per entry of every dump, each source field gathered into one list and mapped as a column."""
    entries = [e for d in dumps for e in d.entries]
    n = len(entries)
    file = np.repeat(np.arange(len(dumps)), [len(d.entries) for d in dumps])
    _fail_at([not isinstance(e, dict) for e in entries], " is not a dict", locate, entries)
    fields = _fields(entries)
    process_group = fields["process_group"]
    _fail_at([not (isinstance(g, list | tuple) and g) for g in process_group], " has no process_group", locate, entries)
    names = [g[0] if type(g[0]) is str else str(g[0]) for g in process_group]
    descs = [str(g[1]) if len(g) > 1 and g[1] is not None else None for g in process_group]
    profiling = fields["profiling_name"]
    _fail_at(
        [p is not None and type(p) is not str for p in profiling], ": profiling_name must be text", locate, entries
    )
    profiling_arr = pa.array(profiling, pa.string())
    op = ops(profiling_arr)
    send_recv = pc.is_in(op, pa.array(["send", "recv"])).to_numpy(zero_copy_only=False)
    is_p2p = np.array(list(map(bool, fields["is_p2p"])), bool) | send_recv
    p2p_list = is_p2p.tolist()
    pairs = zip(fields["collective_seq_id"], fields["p2p_seq_id"], p2p_list, strict=True)
    seq_values = [p2p_seq if p2p else seq for seq, p2p_seq, p2p in pairs]
    seq = _int_column(seq_values, lambda i: "p2p_seq_id" if p2p_list[i] else "collective_seq_id", locate)
    states = fields["state"]
    _fail_at(
        [type(s) is not str or s not in _STATES for s in states], " has unknown state {value!r:.40}", locate, states
    )
    shape, count = _shapes(fields["input_sizes"], locate)
    dtype, itemsize = _dtypes([d or [] for d in fields["input_dtypes"]], locate)
    record_id = _int_column(fields["record_id"], lambda i: "record_id", locate)
    times = {
        column: _int_column(fields[key], lambda i, key=key: key, locate)
        for column, key in (
            ("enqueue_ns", "time_created_ns"),
            ("start_ns", "time_discovered_started_ns"),
            ("end_ns", "time_discovered_completed_ns"),
        )
    }
    try:
        bytes_ = pc.multiply_checked(count, pa.array(itemsize))
    except pa.ArrowInvalid as exc:
        raise EvidenceError(f"{locate.paths[0]}: an entry's byte size is out of range") from exc
    bytes_ = pc.if_else(pa.array(itemsize == 0), pa.scalar(None, pa.int64()), bytes_)

    # Per (file, group), once: description, members, size and the rank's place among them; spread by code.
    names_arr = pa.array(names, pa.string())
    name_code = pc.dictionary_encode(names_arr).indices.to_numpy() if n else np.zeros(0, np.int64)
    distinct_names = pc.unique(names_arr).to_pylist() if n else []
    pairs, code = np.unique(file * max(len(distinct_names), 1) + name_code, return_inverse=True)
    info = []
    for pair in pairs.tolist():
        d = dumps[pair // max(len(distinct_names), 1)]
        info.append(_comm_info(d.groups, distinct_names[pair % max(len(distinct_names), 1)], d.rank))
    take = pa.array(code.astype(np.int64))

    def spread(values: list, type_: pa.DataType) -> pa.Array:
        return pa.array(values, type_).take(take) if n else pa.array([], type_)

    # P2P peers: the "a->b" in the name is a group rank; the group's member list makes it global.
    local = map_distinct(profiling_arr, _local_peer, pa.int64()).to_numpy(zero_copy_only=False).astype(np.float64)
    local = np.where(is_p2p, local, np.nan)
    member_lists = [i[1] if i[1] is not None else [] for i in info]
    sizes = np.array([len(m) if i[1] is not None else -1 for m, i in zip(member_lists, info, strict=True)], np.int64)
    offsets = np.concatenate(([0], np.cumsum([len(m) for m in member_lists]))).astype(np.int64)
    members = np.array([r for m in member_lists for r in m] or [0], np.int64)
    known = ~np.isnan(local)
    local_int = np.nan_to_num(local).astype(np.int64)
    mapped = (local_int < sizes[code]) if n else np.zeros(0, bool)
    index = np.where(mapped, offsets[code] + local_int, 0) if n else np.zeros(0, np.int64)
    peer = np.where(mapped, members[np.clip(index, 0, len(members) - 1)], local_int)

    return to_table(
        {
            "rank": np.array([d.rank for d in dumps], np.int64)[file],
            "comm_id": names_arr,
            "comm_name": names_arr,
            "comm_desc": pc.coalesce(spread([i[0] or None for i in info], pa.string()), pa.array(descs, pa.string())),
            "comm_ranks": spread([i[1] for i in info], pa.list_(pa.int32())),
            "comm_size": spread([i[2] for i in info], pa.int32()),
            "comm_rank": spread([i[3] for i in info], pa.int32()),
            "op": op,
            "is_p2p": is_p2p,
            "seq": seq,
            "seq_kind": pc.if_else(pa.array(is_p2p), "p2p", "comm") if n else pa.array([], pa.string()),
            "count": count,
            "bytes": bytes_,
            "dtype": dtype,
            "shape": shape,
            "peer": pa.array(peer, mask=~known),
            "state": map_distinct(pa.array(states, pa.string()), _STATES.get),
            **times,
            "record_id": record_id,
            "source": pa.repeat(pa.scalar(NAME), n),
        },
        locate.paths[0].parent if len(dumps) > 1 else locate.paths[0],
    )


def _progress(dumps: list[_Dump], entries: pa.Table) -> tuple[pa.Table, np.ndarray]:
    """The progress rows of every dump (pg_status watermarks, membership of groups without entries),
    and the file each row belongs to."""
    file = np.repeat(np.arange(len(dumps)), [len(d.entries) for d in dumps])
    frame = pl.DataFrame(
        {
            "file": file,
            "name": pl.from_arrow(entries.column("comm_id")),
            "p2p": pl.from_arrow(entries.column("is_p2p")),
            "seq": pl.from_arrow(entries.column("seq")),
            "order": pl.from_arrow(
                pc.coalesce(
                    entries.column("record_id"),
                    pa.array(np.arange(len(file)) - np.cumsum([0, *(len(d.entries) for d in dumps)])[file]),
                )
            ),
        }
    ).with_row_index("row")
    frame = frame.filter(pl.col("seq").is_not_null())
    # A group's latest entry (by record id, later rows winning ties) says which sequence pg_status counts.
    last = frame.sort("order", "row").group_by("file", "name").agg(pl.col("p2p").last())
    last_kind = {(f, name): p2p for f, name, p2p in last.iter_rows()}
    bounds = frame.group_by("file", "name", "p2p").agg(pl.col("seq").min().alias("lo"), pl.col("seq").max().alias("hi"))
    seq_bounds = {(f, name, p2p): (lo, hi) for f, name, p2p, lo, hi in bounds.iter_rows()}
    rows: dict[str, list] = {k: [] for k in ("file", "rank", "comm_id", "is_p2p", "seq", "seq_kind", "comm_desc")}
    rows.update({k: [] for k in ("comm_ranks", "comm_size", "comm_rank")})
    start = 0
    for f, d in enumerate(dumps):
        names = entries.column("comm_id").slice(start, len(d.entries)).to_pylist()
        pg_ids = [e.get("pg_id") for e in d.entries]
        start += len(d.entries)
        # pg_status is keyed by the group's local id: placed on the first group seen with that id in the entries.
        pg_names = {
            pg_id: name for pg_id, name in zip(reversed(pg_ids), reversed(names), strict=True) if type(pg_id) is int
        }

        def add(name: str, p2p: bool, seq: int | None, kind: str | None, f: int = f, d: _Dump = d) -> None:
            desc, ranks, size, position = _comm_info(d.groups, name, d.rank)
            for column, value in zip(
                rows, (f, d.rank, name, p2p, seq, kind, desc or None, ranks, size, position), strict=True
            ):
                rows[column].append(value)

        status = d.dump.get("pg_status", {}) or {}
        if not isinstance(status, dict):
            raise EvidenceError(f"{d.path}: 'pg_status' must be a dict")
        for key, watermark in status.items():
            try:
                name = pg_names.get(int(key))
            except (TypeError, ValueError):
                name = None
            if name is None or not isinstance(watermark, dict) or (f, name) not in last_kind:
                continue
            p2p = last_kind[(f, name)]
            lo, hi = seq_bounds.get((f, name, p2p), (None, None))
            enqueued = watermark.get("last_enqueued_collective")
            completed = watermark.get("last_completed_collective")
            if type(enqueued) is not int or type(completed) is not int or hi is None:
                continue
            # pg_status counts whichever sequence the group last used: trusted only when it agrees with those entries.
            if enqueued != hi or not (lo - 1 <= completed <= enqueued) or completed < 0:
                continue
            add(name, p2p, completed, "p2p" if p2p else "comm")
        # A group this rank belongs to but has nothing recorded for: a progress row without a sequence,
        # so the rank counts as present (it dumped) and its membership is known.
        for name in d.groups:
            if (f, name) not in last_kind:
                add(name, False, None, None)
    m = len(rows["rank"])
    owner = np.array(rows.pop("file"), np.int64)
    columns = {
        **rows,
        "comm_name": rows["comm_id"],
        "op": [PROGRESS_OP] * m,
        "state": ["completed"] * m,
        "source": [NAME] * m,
    }
    return to_table(columns, dumps[0].path), owner


def load(path: Path) -> pa.Table:
    """All dumps under ``path`` (a dump file or a directory of per-rank dumps) as one operations table."""
    path = Path(path)
    if not path.exists():
        raise EvidenceError(f"{path}: no such file or directory")
    files = _dump_files(path)
    if not files:
        raise EvidenceError(f"{path}: no Flight Recorder dump found")
    with paused_gc():
        return _load_files(files)


def _load_files(files: list[Path]) -> pa.Table:
    # Every file is read and checked before anything is returned: a bad file fails the whole load.
    dumps: list[_Dump] = []
    seen: dict[int, Path] = {}
    for file in files:
        dump = _read(file)
        groups = _groups(dump, file)
        rank = _rank_of(dump, file, groups)
        if rank in seen:
            raise EvidenceError(f"{file}: rank {rank} already read from {seen[rank].name}")
        seen[rank] = file
        dumps.append(_Dump(file, dump, groups, rank, dump.get("entries", []) or []))
    # The entries of all files are mapped together, so the cost per file is only its unpickling.
    entries = _entries_table(dumps, _Locate(dumps))
    progress, owner = _progress(dumps, entries)
    # Rows in file order, each file's progress rows after its entries (as a per-file reader would give them).
    parts, entry_start, progress_start = [], 0, 0
    progress_counts = np.bincount(owner, minlength=len(dumps))
    for d, extra in zip(dumps, progress_counts.tolist(), strict=True):
        parts += [entries.slice(entry_start, len(d.entries)), progress.slice(progress_start, extra)]
        entry_start += len(d.entries)
        progress_start += extra
    return concat(parts)


register(Importer(NAME, detect, load))
