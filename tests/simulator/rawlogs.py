"""Reading what the plugin wrote back, for the simulator tests: raw-log segments per global rank.

Uses the project's raw-log reader (comminsight.formats.rawlog) when it is there, else the
contract bindings (comminsight.formats.header) directly: CI_LOG_HEADER_SIZE bytes of header,
then 256-byte records, keeping those whose magic and checksum verify. Either way a record is
something indexable by field name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from comminsight.formats import header

try:
    from comminsight.formats import rawlog
except ImportError:  # the reader is written by another part of the project
    rawlog = None


def _read_with_header(segment: Path) -> tuple[dict[str, Any], list[Any]]:
    consts = header.constants()
    header_size, record_size = consts["CI_LOG_HEADER_SIZE"], consts["CI_RECORD_SIZE"]
    raw = segment.read_bytes()
    head = np.frombuffer(raw[:header_size], dtype=header.struct_dtype("ci_log_header"))[0]
    body = raw[header_size:]
    records = np.frombuffer(body[: len(body) // record_size * record_size], dtype=header.record_dtype())
    fields = {k: int(head[k]) for k in ("global_rank", "local_rank")} | {"node_ip": text(head["node_ip"])}
    return fields, list(records[header.valid_records(records)])


def _read_with_rawlog(segment: Path) -> tuple[dict[str, Any], list[Any]]:
    read = rawlog.read_segment(segment)
    fields = {k: int(read.header[k]) for k in ("global_rank", "local_rank")} | {"node_ip": text(read.header["node_ip"])}
    return fields, read.table.to_pylist()


def read_home(home: Path) -> dict[int, dict]:
    """Per global rank (RANK in the segment header): its valid records in file order and its segment names."""
    reader = _read_with_rawlog if rawlog is not None else _read_with_header
    out: dict[int, dict] = {}
    for segment in sorted((home / "inspector_logs").iterdir()):
        fields, records = reader(segment)
        entry = out.setdefault(fields["global_rank"], {"records": [], "segments": []})
        entry["records"] += records
        entry["segments"].append(segment.name)
        entry["node_ip"], entry["local_rank"] = fields["node_ip"], fields["local_rank"]
    return out


def text(value: Any) -> str:
    """A record's char field as str (bytes from numpy, str from Arrow)."""
    if isinstance(value, str):
        return value.split("\0")[0]
    return bytes(value).split(b"\0")[0].decode()
