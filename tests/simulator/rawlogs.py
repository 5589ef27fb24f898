"""Reading what the plugin wrote back, for the simulator tests: raw-log segments per global rank.

Uses the contract bindings (comminsight.formats.header) directly: CI_LOG_HEADER_SIZE bytes of
header, then 256-byte records; only records whose magic and checksum verify are kept.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from comminsight.formats import header


def read_home(home: Path) -> dict[int, dict]:
    """Per global rank (RANK in the segment header): its records (valid ones, in file order) and segment names."""
    consts = header.constants()
    header_size = consts["CI_LOG_HEADER_SIZE"]
    record_size = consts["CI_RECORD_SIZE"]
    out: dict[int, dict] = {}
    for segment in sorted((home / "inspector_logs").iterdir()):
        raw = segment.read_bytes()
        head = np.frombuffer(raw[:header_size], dtype=header.struct_dtype("ci_log_header"))[0]
        body = raw[header_size:]
        records = np.frombuffer(body[: len(body) // record_size * record_size], dtype=header.record_dtype())
        records = records[header.valid_records(records)]
        entry = out.setdefault(int(head["global_rank"]), {"records": [], "segments": [], "node_ip": ""})
        entry["records"].append(records)
        entry["segments"].append(segment.name)
        entry["node_ip"] = bytes(head["node_ip"]).split(b"\0")[0].decode()
    for entry in out.values():
        entry["records"] = np.concatenate(entry["records"]) if entry["records"] else np.empty(0, header.record_dtype())
    return out


def text(value: bytes) -> str:
    """A record's char field as str."""
    return bytes(value).split(b"\0")[0].decode()


def record_keys(records: np.ndarray) -> list[tuple]:
    """(comm_hash, func, seq, rank, peer) of every record."""
    return [
        (f"{int(r['comm_hash']):#018x}", text(r["func"]), int(r["seq"]), int(r["rank"]), int(r["peer"]))
        for r in records
    ]
