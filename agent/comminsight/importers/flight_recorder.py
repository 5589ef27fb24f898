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

Two readers give the same table. The compiled decoder (``_frdecode``, built by ``make setup``)
runs a pickle's opcodes straight into columns: integer fields as int64 arrays, every other field
as codes into its distinct values, so that checks and mappings run once per distinct value and
no Python object is made per entry. Anything outside the plain subset it knows, and any check
that fails, goes to the Python reader, which also serves where the decoder is not built: the
restricted unpickler makes Python objects entry by entry, then the entries of all files are
gathered field by field into lists, checked, normalised (per distinct value) and mapped as
Arrow/numpy columns. A check that fails on a column is re-run entry by entry only to name the
file and entry at fault, so errors read the same whichever reader met the dump first.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import resource
import sys
from collections.abc import Callable
from contextlib import suppress
from functools import lru_cache
from itertools import chain, repeat
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import polars as pl
import pyarrow as pa

from comminsight.evidence import PROGRESS_OP
from comminsight.evidence import compute as pc
from comminsight.importers import EvidenceError, Importer, directory_holds, evidence_files, register
from comminsight.importers.columns import MAX_ROWS, concat, paused_gc, to_table
from comminsight.importers.normalise import (
    ITEMSIZE,
    dtype_name,
    map_distinct,
    op_name,
    ops,
    shape_text,
    trailing_int,
)

try:
    from comminsight.importers import _frdecode
except ImportError:  # not built (no C compiler at set-up): the Python reader reads every dump
    _frdecode = None

NAME = "flight_recorder"
MAX_FILE_BYTES = 256 << 20
MAX_ENTRIES = 4_000_000
# Memory the unpickled objects of one dump may take; with the per-load row cap, an import stays under 1 GB.
MAX_UNPICKLED_BYTES = 256 << 20
# The fewest bytes one entry takes in a pickle (a dozen memoised keys and their values).
MIN_ENTRY_BYTES = 24
_CHECK_EVERY = 64 << 10
# Dumps mapped together, at most: entries, or memory taken since the batch began.
BATCH_ENTRIES = 250_000
BATCH_BYTES = 256 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
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


def _resident_bytes() -> int:
    """This process's resident memory (Linux), else its peak so far: what the unpickling guard watches."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class _TooLarge(Exception):
    pass


class _WatchedInput:
    """The dump's bytes as the unpickler's input file, checking the memory the unpickled objects take.

    The C unpickler asks for input every frame (protocol 4+) or every 128 KiB it prefetches; each
    time, the growth of resident memory since the start is held to MAX_UNPICKLED_BYTES. A pickle can
    expand 70 times (a one-byte opcode makes a 64-byte dict), so file size alone cannot bound memory.
    """

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0
        self.checked = 0
        self.start = _resident_bytes()

    def _check(self) -> None:
        if self.at - self.checked >= _CHECK_EVERY or self.at == 0:
            self.checked = self.at
            if _resident_bytes() - self.start > MAX_UNPICKLED_BYTES:
                raise _TooLarge

    def peek(self, n: int = 1) -> bytes:
        self._check()
        return self.data[self.at : self.at + max(n, 1)]

    def read(self, n: int = -1) -> bytes:
        self._check()
        end = len(self.data) if n is None or n < 0 else self.at + n
        chunk = self.data[self.at : end]
        self.at += len(chunk)
        return chunk

    def readinto(self, buffer: Any) -> int:
        chunk = self.read(len(buffer))
        buffer[: len(chunk)] = chunk
        return len(chunk)

    def readline(self) -> bytes:
        self._check()
        end = self.data.find(b"\n", self.at)
        end = len(self.data) if end < 0 else end + 1
        chunk = self.data[self.at : end]
        self.at = end
        return chunk


def _json_footprint(data: bytes) -> int:
    """An upper estimate of the memory a JSON dump's objects take, from its brackets, quotes and commas."""
    containers = data.count(b"{") + data.count(b"[")
    return 232 * containers + 40 * data.count(b'"') + 40 * data.count(b",") + len(data)


def _file_bytes(path: Path) -> bytes:
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise EvidenceError(f"{path}: {size} bytes is over the {MAX_FILE_BYTES}-byte limit for a dump")
    return path.read_bytes()


def _read(path: Path, data: bytes | None = None) -> dict:
    """The dump as the restricted unpickler (or the JSON reader) makes it, with its checks."""
    if data is None:
        data = _file_bytes(path)
    try:
        if data[:1] == b"\x80":
            dump = _RestrictedUnpickler(_WatchedInput(data)).load()
        elif _json_footprint(data) > MAX_UNPICKLED_BYTES:
            raise _TooLarge
        else:
            dump = json.loads(data)
    except _TooLarge:
        raise EvidenceError(
            f"{path}: expands to over {MAX_UNPICKLED_BYTES >> 20} MiB in memory, far more than a dump of its size"
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError) as exc:
        raise EvidenceError(f"{path}: not a readable Flight Recorder dump: {_one_line(exc)}") from exc
    except (RecursionError, MemoryError, OverflowError) as exc:
        raise EvidenceError(f"{path}: dump too deeply nested or too large: {type(exc).__name__}") from exc
    if not isinstance(dump, dict):
        raise EvidenceError(f"{path}: a Flight Recorder dump is a dict, found {type(dump).__name__}")
    entries = dump.get("entries", [])
    if not isinstance(entries, list):
        raise EvidenceError(f"{path}: 'entries' must be a list")
    if len(entries) > MAX_ENTRIES:
        raise EvidenceError(f"{path}: {len(entries)} entries is over the limit of {MAX_ENTRIES}")
    # Every entry of a real dump is its own dict of a dozen fields or more, so it takes tens of bytes,
    # and each of its names and dimensions takes at least one; more than that means objects referred
    # to again and again (a hand-made pickle), which would multiply in the table.
    if len(entries) > max(len(data), 1) // MIN_ENTRY_BYTES:
        raise EvidenceError(
            f"{path}: {len(entries)} entries in {len(data)} bytes must share objects, which no dump does"
        )
    return dump


def _length(value: Any) -> int:
    return len(value) if type(value) is str or type(value) is list or type(value) is tuple else 0


_SIZED = {str, list, tuple}


def _total_length(values: list) -> int:
    if set(map(type, values)) <= _SIZED:
        return sum(map(len, values))
    return sum(map(_length, values))


def _check_shared(fields: dict[str, list], dumps: list[_Dump]) -> None:
    """Refuse entries whose names and lists add up to more values than their files have bytes: each
    value a dump writes takes at least one byte, so more means objects referred to again and again
    (a hand-made pickle), which the table would multiply."""
    size = sum(d.size for d in dumps)
    for key in ("profiling_name", "process_group", "input_sizes", "input_dtypes"):
        values = fields[key]
        total = _total_length(values)
        if key != "profiling_name":
            if set(map(type, values)) <= {list, tuple}:
                inner = list(chain.from_iterable(values))
            else:
                inner = [v for value in values if type(value) is list or type(value) is tuple for v in value]
            total += _total_length(inner)
        if total > size:
            where = dumps[0].path if len(dumps) == 1 else dumps[0].path.parent
            raise EvidenceError(
                f"{where}: the entries' {key} add up to {total} values in {size} bytes:"
                " shared objects, which no dump holds"
            )


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


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


class _Decoded(NamedTuple):
    """One dump's entries as the compiled decoder gives them (see _frdecode.c)."""

    ints: np.ndarray  # (len(_INT_FIELDS), n) int64
    valid: np.ndarray  # (len(_INT_FIELDS), n) bool: the value is an integer (not None, not absent)
    codes: np.ndarray  # (len(_CODED_FIELDS), n) int32 into distinct[field]; -1: absent
    distinct: tuple[list, ...]  # per coded field, its distinct values as the unpickler makes them


# The decoder's fields, in its order (_frdecode.c, INT_FIELDS and CODED_FIELDS).
_INT_FIELDS = (
    "record_id",
    "pg_id",
    "collective_seq_id",
    "p2p_seq_id",
    "time_created_ns",
    "time_discovered_started_ns",
    "time_discovered_completed_ns",
)
_CODED_FIELDS = ("process_group", "profiling_name", "is_p2p", "state", "input_sizes", "input_dtypes")


def _decode(data: bytes, path: Path) -> tuple[dict, _Decoded] | None:
    """(the dump without its entries, its entries as columns) from the compiled decoder; None for the
    Python reader to read (no decoder, not a pickle, outside the decoder's subset, a check failed)."""
    if _frdecode is None or data[:1] != b"\x80":
        return None
    out = _frdecode.decode(data, MAX_UNPICKLED_BYTES)
    if out is None:
        return None
    if isinstance(out, int):  # the C unpickler would zero 16 bytes per index at once: refused here
        raise EvidenceError(
            f"{path}: not a readable Flight Recorder dump: memo index {out} in a pickle of {len(data)} bytes"
        )
    top, n, ints, valid, codes, distinct = out
    if n > MAX_ENTRIES or n > max(len(data), 1) // MIN_ENTRY_BYTES:
        return None  # the Python reader refuses it, naming the problem
    decoded = _Decoded(
        np.frombuffer(ints, np.int64).reshape(len(_INT_FIELDS), n),
        np.frombuffer(valid, np.bool_).reshape(len(_INT_FIELDS), n),
        np.frombuffer(codes, np.int32).reshape(len(_CODED_FIELDS), n),
        distinct,
    )
    return top, decoded


class _Dump(NamedTuple):
    """One file's parsed dump with what is known about it before its entries are mapped."""

    path: Path
    dump: dict
    groups: dict[str, dict]
    rank: int
    entries: list | None  # the unpickled entries (the Python reader), else
    size: int  # bytes in the file
    decoded: _Decoded | None = None  # the entries as columns (the compiled decoder)

    @property
    def n(self) -> int:
        return len(self.entries) if self.entries is not None else self.decoded.ints.shape[1]


class _Locate:
    """Entry number in the concatenation of all files -> "<file>: entry <number in that file>" (for errors)."""

    def __init__(self, dumps: list[_Dump]) -> None:
        self.paths = [d.path for d in dumps]
        self.starts = np.cumsum([0, *(d.n for d in dumps)])

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


def _by_text(values: list) -> tuple[list[str], dict[str, Any], pa.DictionaryArray]:
    """Entries' values keyed by their text: (texts, one value per distinct text, the texts encoded).

    Python's text of a list of lists of integers or of names determines its structure and types
    (a bool prints True, a float 1.0, a tuple with parentheses), so a check or a mapping of the one
    value per distinct text holds for every entry that prints the same. Dumps repeat few shapes.
    """
    texts = list(map(repr, values))
    return texts, dict(zip(texts, values, strict=True)), pc.dictionary_encode(pa.array(texts, pa.string()))


def _shapes(sizes: list, locate: _Locate) -> tuple[pa.Array, pa.Array]:
    """(shape text, element count) columns from the entries' ``input_sizes``, each distinct value checked
    and mapped once; a bad one is named by the first entry holding it."""
    texts, distinct, encoded = _by_text(sizes)
    mapped: dict[str, tuple[str | None, int | None]] = {}
    for text, value in distinct.items():
        try:
            shape, count = _shape_and_count(value, Path(), 0)
            if count is not None and count >= 1 << 62:
                raise EvidenceError("too many elements")
        except EvidenceError:
            path, index = locate(texts.index(text))
            shape, count = _shape_and_count(value, path, index)
            if count is not None and count >= 1 << 62:
                raise EvidenceError(
                    f"{path}: entry {index}: input_sizes describe tensors with too many elements"
                ) from None
        mapped[text] = (shape, count)
    keys = encoded.dictionary.to_pylist()
    shape_col = pc.take(pa.array([mapped[k][0] for k in keys], pa.string()), encoded.indices)
    count_col = pc.take(pa.array([mapped[k][1] for k in keys], pa.int64()), encoded.indices)
    return shape_col, count_col


@lru_cache(maxsize=4096)
def _dtype_info(names: tuple) -> tuple[str | None, int] | None:
    """(joined distinct dtypes, item size when there is exactly one) of one entry's dtype list; None if not text."""
    if not all(type(d) is str for d in names):
        return None
    distinct = _distinct_dtypes(names)
    return (",".join(distinct) if distinct else None), (ITEMSIZE.get(distinct[0], 0) if len(distinct) == 1 else 0)


def _dtypes(dtype_lists: list, locate: _Locate) -> tuple[pa.Array, np.ndarray]:
    """(dtype column, item sizes): per entry the sorted distinct normalised names joined by ',' and an
    item size when there is exactly one; each distinct list mapped once."""
    if not dtype_lists:
        return pa.array([], pa.string()), np.zeros(0, np.int64)
    texts, distinct, encoded = _by_text(dtype_lists)
    mapped: dict[str, tuple[str | None, int]] = {}
    for text, names in distinct.items():
        try:
            found = _dtype_info(tuple(names)) if isinstance(names, list | tuple) else None
        except TypeError:  # an unhashable element: not a name
            found = None
        if found is None:
            raise EvidenceError(f"{locate.where(texts.index(text))}: input_dtypes must be a list of names")
        mapped[text] = found
    keys = encoded.dictionary.to_pylist()
    codes = encoded.indices.to_numpy()
    dtype = pc.take(pa.array([mapped[k][0] for k in keys], pa.string()), encoded.indices)
    return dtype, np.array([mapped[k][1] for k in keys], np.int64)[codes]


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
_STR_OR_NONE = {str, type(None)}
_LIST_OR_NONE = {list, type(None)}
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
    # Each check runs on the whole column at C speed; only a failing one looks entry by entry (to name it).
    if not set(map(type, entries)) <= {dict}:
        _fail_at([not isinstance(e, dict) for e in entries], " is not a dict", locate, entries)
    fields = _fields(entries)
    _check_shared(fields, dumps)
    process_group = fields["process_group"]
    if not (set(map(type, process_group)) <= {tuple, list} and all(process_group)):
        missing = [not (isinstance(g, list | tuple) and g) for g in process_group]
        _fail_at(missing, " has no process_group", locate, entries)
    names = list(map(itemgetter(0), process_group))
    if not set(map(type, names)) <= {str}:
        names = [g[0] if type(g[0]) is str else str(g[0]) for g in process_group]
    descs = None
    if min(map(len, process_group), default=2) >= 2:
        descs = list(map(itemgetter(1), process_group))
    if descs is None or not set(map(type, descs)) <= _STR_OR_NONE:
        descs = [str(g[1]) if len(g) > 1 and g[1] is not None else None for g in process_group]
    profiling = fields["profiling_name"]
    if not set(map(type, profiling)) <= _STR_OR_NONE:
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
    if not (set(map(type, states)) <= {str} and set(states) <= _STATES.keys()):
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
    columns = _Columns(
        pa.array(names, pa.string()),
        pa.array(descs, pa.string()),
        profiling_arr,
        op,
        is_p2p,
        seq,
        map_distinct(pa.array(states, pa.string()), _STATES.get),
        shape,
        count,
        dtype,
        itemsize,
        record_id,
        times,
    )
    return _assemble(dumps, locate, columns)


class _Fallback(Exception):
    """A decoded batch holds a value the Python reader must judge (to refuse it with its own words)."""


def _merged(dumps: list[_Dump], field: str) -> tuple[np.ndarray, list]:
    """(code per entry, values): one field's codes across the decoded dumps into one list of values,
    an absent field coded as the value the Python reader takes for it (``_FIELDS``)."""
    f = _CODED_FIELDS.index(field)
    values: list = []
    parts = []
    for d in dumps:
        codes = d.decoded.codes[f].astype(np.int64)
        parts.append(np.where(codes < 0, -1, codes + len(values)))
        values += d.decoded.distinct[f]
    codes = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    absent = codes < 0
    if absent.any():
        codes[absent] = len(values)
        values.append(_FIELDS[field])
    return codes, values


def _int_field(dumps: list[_Dump], field: str) -> tuple[np.ndarray, np.ndarray]:
    """(int64 values, validity) of one integer field across the decoded dumps."""
    f = _INT_FIELDS.index(field)
    if not dumps:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    return np.concatenate([d.decoded.ints[f] for d in dumps]), np.concatenate([d.decoded.valid[f] for d in dumps])


def _spread(values: list, codes: np.ndarray, type_: pa.DataType) -> pa.Array:
    return pc.take(pa.array(values, type_), pa.array(codes)) if len(codes) else pa.array([], type_)


def _decoded_table(dumps: list[_Dump], locate: _Locate) -> pa.Table:
    """The Python reader's table from decoded dumps: each check and mapping of ``_entries_table`` made
    once per distinct value and spread by code. Raises _Fallback where a check fails."""
    merged = {field: _merged(dumps, field) for field in _CODED_FIELDS}
    size = sum(d.size for d in dumps)
    for key in ("profiling_name", "process_group", "input_sizes", "input_dtypes"):
        codes, values = merged[key]
        if key == "profiling_name":
            lengths = [_length(v) for v in values]
        else:
            lengths = [_length(v) + (_total_length(v) if type(v) is list or type(v) is tuple else 0) for v in values]
        if int(np.dot(np.bincount(codes, minlength=len(values)), lengths)) > size:
            raise _Fallback
    codes, groups = merged["process_group"]
    if not all(type(g) in (list, tuple) and g for g in groups):
        raise _Fallback
    names = _spread([g[0] if type(g[0]) is str else str(g[0]) for g in groups], codes, pa.string())
    descs = _spread([str(g[1]) if len(g) > 1 and g[1] is not None else None for g in groups], codes, pa.string())
    codes, profiling = merged["profiling_name"]
    if not all(p is None or type(p) is str for p in profiling):
        raise _Fallback
    profiling_arr = _spread(profiling, codes, pa.string())
    ops_of = [op_name(p) for p in profiling]
    op = _spread(ops_of, codes, pa.string())
    send_recv = np.array([o in ("send", "recv") for o in ops_of], bool)[codes]
    p2p_codes, p2p_flags = merged["is_p2p"]
    is_p2p = np.array(list(map(bool, p2p_flags)), bool)[p2p_codes] | send_recv
    collective, collective_valid = _int_field(dumps, "collective_seq_id")
    p2p_seq, p2p_valid = _int_field(dumps, "p2p_seq_id")
    seq = pa.array(np.where(is_p2p, p2p_seq, collective), mask=~np.where(is_p2p, p2p_valid, collective_valid))
    codes, states = merged["state"]
    if not all(type(s) is str and s in _STATES for s in states):
        raise _Fallback
    state = _spread(states, codes, pa.string())
    codes, sizes = merged["input_sizes"]
    mapped = []
    for value in sizes:
        try:
            shape_count = _shape_and_count(value, Path(), 0)
        except EvidenceError:
            raise _Fallback from None
        if shape_count[1] is not None and shape_count[1] >= 1 << 62:
            raise _Fallback
        mapped.append(shape_count)
    shape = _spread([m[0] for m in mapped], codes, pa.string())
    count = _spread([m[1] for m in mapped], codes, pa.int64())
    codes, dtype_lists = merged["input_dtypes"]
    infos = []
    for value in dtype_lists:
        value = value or []
        try:
            found = _dtype_info(tuple(value)) if isinstance(value, list | tuple) else None
        except TypeError:  # an unhashable element: not a name
            found = None
        if found is None:
            raise _Fallback
        infos.append(found)
    dtype = _spread([i[0] for i in infos], codes, pa.string())
    itemsize = np.array([i[1] for i in infos], np.int64)[codes]

    def ints(field: str) -> pa.Array:
        values, valid = _int_field(dumps, field)
        return pa.array(values, mask=~valid)

    times = {
        "enqueue_ns": ints("time_created_ns"),
        "start_ns": ints("time_discovered_started_ns"),
        "end_ns": ints("time_discovered_completed_ns"),
    }
    columns = _Columns(
        names, descs, profiling_arr, op, is_p2p, seq, state, shape, count, dtype, itemsize, ints("record_id"), times
    )
    return _assemble(dumps, locate, columns)


class _Columns(NamedTuple):
    """The entries' fields checked and mapped, one value per entry: what the table is assembled from."""

    names: pa.Array  # process_group[0]
    descs: pa.Array  # process_group[1]
    profiling: pa.Array
    op: pa.Array
    is_p2p: np.ndarray
    seq: pa.Array
    state: pa.Array
    shape: pa.Array
    count: pa.Array
    dtype: pa.Array
    itemsize: np.ndarray
    record_id: pa.Array
    times: dict[str, pa.Array]


def _assemble(dumps: list[_Dump], locate: _Locate, columns: _Columns) -> pa.Table:
    """The table's rows from the entries' mapped fields and each dump's groups (the same for both readers)."""
    n = len(columns.is_p2p)
    file = np.repeat(np.arange(len(dumps)), [d.n for d in dumps])
    names_arr, profiling_arr, op, is_p2p = columns.names, columns.profiling, columns.op, columns.is_p2p
    count, itemsize = columns.count, columns.itemsize
    try:
        bytes_ = pc.multiply_checked(count, pa.array(itemsize))
    except pa.ArrowInvalid as exc:
        raise EvidenceError(f"{locate.paths[0]}: an entry's byte size is out of range") from exc
    bytes_ = pc.if_else(pa.array(itemsize == 0), pa.scalar(None, pa.int64()), bytes_)

    # Per (file, group), once: description, members, size and the rank's place among them; spread by code.
    name_code = pc.dictionary_encode(names_arr).indices.to_numpy() if n else np.zeros(0, np.int64)
    distinct_names = pc.unique(names_arr).to_pylist() if n else []
    pairs, code = np.unique(file * max(len(distinct_names), 1) + name_code, return_inverse=True)
    info = []
    for pair in pairs.tolist():
        d = dumps[pair // max(len(distinct_names), 1)]
        info.append(_comm_info(d.groups, distinct_names[pair % max(len(distinct_names), 1)], d.rank))
    take = pa.array(code.astype(np.int64))

    def spread(values: list, type_: pa.DataType) -> pa.Array:
        return pc.take(pa.array(values, type_), take) if n else pa.array([], type_)

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
            "comm_desc": pc.coalesce(spread([i[0] or None for i in info], pa.string()), columns.descs),
            "comm_ranks": spread([i[1] for i in info], pa.list_(pa.int32())),
            "comm_size": spread([i[2] for i in info], pa.int32()),
            "comm_rank": spread([i[3] for i in info], pa.int32()),
            "op": op,
            "is_p2p": is_p2p,
            "seq": columns.seq,
            "seq_kind": pc.if_else(pa.array(is_p2p), "p2p", "comm") if n else pa.array([], pa.string()),
            "count": count,
            "bytes": bytes_,
            "dtype": columns.dtype,
            "shape": columns.shape,
            "peer": pa.array(peer, mask=~known),
            "state": columns.state,
            **columns.times,
            "record_id": columns.record_id,
            "source": pa.repeat(pa.scalar(NAME), n),
        },
        locate.paths[0].parent if len(dumps) > 1 else locate.paths[0],
    )


def _first_names(pg_ids: list, status: dict, comm_ids: pa.ChunkedArray, start: int) -> dict[int, str]:
    """For each pg_status key (a local group id), the name of the first entry's group with that id."""
    found = {}
    for key in status:
        try:
            pg_id = int(key)
        except (TypeError, ValueError):
            continue
        at = 0
        while True:
            try:
                at = pg_ids.index(pg_id, at)
            except ValueError:
                break
            if type(pg_ids[at]) is int:  # not a bool or float that equals it
                found[pg_id] = comm_ids[start + at].as_py()
                break
            at += 1
    return found


def _progress(dumps: list[_Dump], entries: pa.Table) -> tuple[pa.Table, np.ndarray]:
    """The progress rows of every dump (pg_status watermarks, membership of groups without entries),
    and the file each row belongs to."""
    file = np.repeat(np.arange(len(dumps)), [d.n for d in dumps])
    frame = pl.DataFrame(
        {
            "file": file,
            "name": pl.from_arrow(entries.column("comm_id")),
            "p2p": pl.from_arrow(entries.column("is_p2p")),
            "seq": pl.from_arrow(entries.column("seq")),
            "order": pl.from_arrow(
                pc.coalesce(
                    entries.column("record_id"),
                    pa.array(np.arange(len(file)) - np.cumsum([0, *(d.n for d in dumps)])[file]),
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
    comm_ids = entries.column("comm_id")
    for f, d in enumerate(dumps):
        status = d.dump.get("pg_status", {}) or {}
        # pg_status is keyed by the group's local id: placed on the first group seen with that id in the entries.
        if d.decoded is not None:  # every pg_id an integer or None
            values, valid = d.decoded.ints[_INT_FIELDS.index("pg_id")], d.decoded.valid[_INT_FIELDS.index("pg_id")]
            at = np.flatnonzero(valid)
            pg_ids, first = np.unique(values[at], return_index=True)
            names = pc.take(comm_ids, pa.array(start + at[first])).to_pylist()
            pg_names = dict(zip(pg_ids.tolist(), names, strict=True))
        else:
            pg_ids = list(map(dict.get, d.entries, repeat("pg_id")))
            if isinstance(status, dict) and len(status) <= 64:
                pg_names = _first_names(pg_ids, status, comm_ids, start)
            else:
                names = comm_ids.slice(start, len(d.entries)).to_pylist()
                pg_names = {
                    pg_id: name
                    for pg_id, name in zip(reversed(pg_ids), reversed(names), strict=True)
                    if type(pg_id) is int
                }
        start += d.n

        def add(name: str, p2p: bool, seq: int | None, kind: str | None, f: int = f, d: _Dump = d) -> None:
            desc, ranks, size, position = _comm_info(d.groups, name, d.rank)
            for column, value in zip(
                rows, (f, d.rank, name, p2p, seq, kind, desc or None, ranks, size, position), strict=True
            ):
                rows[column].append(value)

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
    # Files are read in batches: a batch's entries are mapped together (so the cost per file is only
    # its unpickling), then turned into Arrow columns, and its Python objects freed.
    parts: list[pa.Table] = []
    batch: list[_Dump] = []
    seen: dict[int, Path] = {}
    rows = entries = 0
    start = _resident_bytes()
    for file in files:
        data = _file_bytes(file)
        decoded = _decode(data, file)
        if decoded is not None:
            dump, columns = decoded
        else:
            dump, columns = _read(file, data), None
        del data
        groups = _groups(dump, file)
        rank = _rank_of(dump, file, groups)
        if rank in seen:
            raise EvidenceError(f"{file}: rank {rank} already read from {seen[rank].name}")
        seen[rank] = file
        entry_list = None if columns is not None else dump.get("entries", []) or []
        batch.append(_Dump(file, dump, groups, rank, entry_list, file.stat().st_size, columns))
        entries += batch[-1].n
        if entries >= BATCH_ENTRIES or _resident_bytes() - start > BATCH_BYTES:
            rows += _flush(batch, parts)
            batch, entries, start = [], 0, _resident_bytes()
        if rows > MAX_ROWS:
            raise EvidenceError(f"{file}: more than {MAX_ROWS} operations in the dumps read so far")
    rows += _flush(batch, parts)
    if rows > MAX_ROWS:
        raise EvidenceError(f"{files[-1]}: more than {MAX_ROWS} operations in the dumps")
    return concat(parts)


def _flush(dumps: list[_Dump], parts: list[pa.Table]) -> int:
    """Map a batch of dumps into ``parts``: rows in file order, each file's progress rows after its entries."""
    if not dumps:
        return 0
    entries = None
    if all(d.decoded is not None for d in dumps):
        with suppress(_Fallback):
            entries = _decoded_table(dumps, _Locate(dumps))
    if entries is None:  # the Python reader maps the batch (again), to refuse it as it always has
        dumps = [
            d if d.decoded is None else d._replace(entries=_read(d.path).get("entries", []) or [], decoded=None)
            for d in dumps
        ]
        entries = _entries_table(dumps, _Locate(dumps))
    progress, owner = _progress(dumps, entries)
    entry_start, progress_start = 0, 0
    progress_counts = np.bincount(owner, minlength=len(dumps))
    for d, extra in zip(dumps, progress_counts.tolist(), strict=True):
        parts += [entries.slice(entry_start, d.n), progress.slice(progress_start, extra)]
        entry_start += d.n
        progress_start += extra
    return entries.num_rows + progress.num_rows


register(Importer(NAME, detect, load))
