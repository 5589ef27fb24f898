"""Build archives for ingest tests: valid ones through the agent's writer, hostile ones by hand."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import zstandard

from comminsight.formats import header
from comminsight.formats.archive import ArchiveMember, write_archive

COMM = 0x1234ABCD5678EF00


def segment_bytes(global_rank: int, n: int = 8, workload: str = "job-7", node_ip: str = "10.0.0.1") -> bytes:
    """A sealed raw-log segment of ``n`` completed all-reduces on one communicator."""
    consts = header.constants()
    hdr = np.zeros(1, header.struct_dtype("ci_log_header"))
    hdr["magic"] = consts["CI_LOG_MAGIC"]
    hdr["version"] = consts["CI_FORMAT_VERSION"]
    hdr["header_size"] = consts["CI_LOG_HEADER_SIZE"]
    hdr["record_size"] = consts["CI_RECORD_SIZE"]
    hdr["pid"] = 1000 + global_rank
    hdr["start_ns"] = 1_000
    hdr["global_rank"] = global_rank
    hdr["local_rank"] = global_rank % 2
    hdr["world_size"] = 4
    hdr["host"] = b"gpu-host-a"
    hdr["workload_id"] = workload.encode()
    hdr["node_ip"] = node_ip.encode()
    records = np.zeros(n, header.record_dtype())
    records["kind"] = consts["CI_KIND_COLL"]
    records["state"] = consts["CI_STATE_COMPLETED"]
    records["rank"] = global_rank
    records["nranks"] = 4
    records["nnodes"] = 2
    records["peer"] = -1
    records["pid"] = 1000 + global_rank
    records["cuda_device"] = global_rank % 2
    records["comm_hash"] = COMM
    records["seq"] = np.arange(n)
    records["count"] = 1024
    records["bytes"] = 4096
    records["enqueue_start_ns"] = 10_000 + np.arange(n) * 1000
    records["enqueue_end_ns"] = records["enqueue_start_ns"] + 10
    records["complete_ns"] = records["enqueue_end_ns"] + 500
    records["record_seq"] = np.arange(n)
    records["func"] = b"AllReduce"
    records["dtype"] = b"ncclFloat32"
    records["algo"] = b"Ring"
    records["proto"] = b"Simple"
    records["comm_name"] = b"dp"
    header.seal_records(records)
    return hdr.tobytes() + records.tobytes()


def manifest_for(workload: str = "job-7", node: str = "10.0.0.1", ranks: tuple[int, ...] = (0, 1)) -> dict:
    return {
        "workload_id": workload,
        "node": node,
        "host": "gpu-host-a",
        "node_ip": node,
        "created_ns": 2_000_000_000,
        "time_range": {"first_ns": 10_000, "last_ns": 20_000},
        "ranks": list(ranks),
        "communicators": [{"comm_hash": f"0x{COMM:016x}", "comm_name": "dp", "nranks": 4, "ranks": list(ranks)}],
        "dropped": {"ring": 0, "lost": 0},
    }


def valid_archive(
    directory: Path, workload: str = "job-7", node: str = "10.0.0.1", ranks=(0, 1), records: int = 8
) -> Path:
    members = [
        ArchiveMember(
            f"segments/host-{1000 + r}-1000-0.cilog.sealed",
            data=segment_bytes(r, n=records, workload=workload),
            records=records,
        )
        for r in ranks
    ]
    members.append(ArchiveMember("hang/timeout-0.json", data=b'{"inflight": []}'))
    name = f"ci-{workload}-{node}-10000-20000.tar.zst"
    return write_archive(directory / name, manifest_for(workload, node, ranks), members).path


def tar_zst(path: Path, entries: list[tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]]) -> Path:
    """Write a tar+zstd file from raw TarInfo entries (the hostile-archive builder)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in entries:
            info, data = entry if isinstance(entry, tuple) else (entry, None)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    path.write_bytes(zstandard.ZstdCompressor(level=3).compress(raw.getvalue()))
    return path


def regular(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def manifest_entry(manifest: dict, members: list[tuple[str, bytes]]) -> tuple[tarfile.TarInfo, bytes]:
    full = {
        **manifest,
        "schema_version": 1,
        "kind": "comminsight.archive",
        "members": [
            {"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest(), "records": 0} for n, d in members
        ],
        "record_count": 0,
    }
    return regular("manifest.json", json.dumps(full).encode())


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
