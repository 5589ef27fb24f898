"""Generated raw-log segments for the record-decoder tests: every record kind and state, every NCCL data
type, unknown codes, times beyond int64 and hostile names; written as a home and sealed by the agent."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from hypothesis import strategies as st

from comminsight.agent.archiver import Archiver
from comminsight.agent.spool import Spool
from comminsight.formats import header

C = header.constants()
NCCL_DTYPES = [
    "ncclInt8",
    "ncclChar",
    "ncclUint8",
    "ncclInt32",
    "ncclInt",
    "ncclUint32",
    "ncclInt64",
    "ncclUint64",
    "ncclFloat16",
    "ncclHalf",
    "ncclFloat32",
    "ncclFloat",
    "ncclFloat64",
    "ncclDouble",
    "ncclBfloat16",
    "ncclFloat8e4m3",
    "ncclFloat8e5m2",
]
FUNCS = ["AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "AllToAll", "Send", "Recv", "Gather"]
HOSTILE = [
    b"ncclInt8\x0032",  # a reused buffer: the tail of "ncclInt32" after the NUL
    b"\xff\xfe\xfd",  # not UTF-8
    "\u202eevil\u202c".encode(),  # bidi override
    b"\n\r\t\x1b[31m",  # control characters, an escape sequence
    b"<script>x</script>",
    "\U0001f600".encode()[:3],  # a code point cut in half
    b"x" * 80,  # longer than any field: no NUL at all once truncated
    b"",
]


def text(choices: list[str]) -> st.SearchStrategy[bytes]:
    return st.one_of(st.sampled_from([c.encode() for c in choices]), st.sampled_from(HOSTILE), st.binary(max_size=70))


uint64 = st.one_of(
    st.just(0), st.integers(1, 1 << 40), st.integers(1, (1 << 63) - 1), st.integers(1 << 63, (1 << 64) - 1)
)
record = st.fixed_dictionaries(
    {
        "kind": st.sampled_from([C["CI_KIND_COLL"], C["CI_KIND_P2P"], 0, 7]),
        "state": st.integers(0, 7),  # every CI_STATE_* and unknown codes
        "flags": st.integers(0, 7),
        "n_channels": st.integers(0, 255),
        "rank": st.integers(-1, 7),
        "nranks": st.integers(0, 8),
        "peer": st.integers(-2, 8),
        "cuda_device": st.integers(-1, 7),
        "comm_hash": st.one_of(st.sampled_from([0, 0x1111, 0xFEDC_BA98_7654_3210]), st.integers(0, (1 << 64) - 1)),
        "seq": st.integers(0, 1 << 20),
        "count": uint64,
        "bytes": uint64,
        "stream": uint64,
        "enqueue_start_ns": uint64,
        "enqueue_end_ns": uint64,
        "complete_ns": uint64,
        "gpu_start_ns": uint64,
        "gpu_end_ns": uint64,
        "record_seq": uint64,
        "func": text(FUNCS),
        "dtype": text(NCCL_DTYPES),
        "algo": text(["Ring", "Tree", "NVLS"]),
        "proto": text(["Simple", "LL", "LL128"]),
        "comm_name": text(["dp", "tp", "pp", "DATA_PARALLEL_GROUP"]),
    }
)
segment = st.fixed_dictionaries(
    {
        "global_rank": st.integers(-1, 7),
        "host": st.one_of(st.sampled_from([b"gpu-a", b"gpu-b"]), st.sampled_from(HOSTILE)),
        "workload_id": st.one_of(st.just(b"job-1"), st.sampled_from(HOSTILE)),
        "node_ip": st.one_of(st.sampled_from([b"", b"10.0.0.1"]), st.sampled_from(HOSTILE)),
        "records": st.lists(record, max_size=12),
    }
)
job = st.lists(segment, min_size=1, max_size=4)


def segment_bytes(index: int, spec: dict) -> tuple[int, bytes]:
    """(pid, bytes) of one sealed segment: a ci_log_header then the sealed records."""
    pid = 1000 + index  # one writer process per segment, as the profiler writes them
    hdr = np.zeros(1, header.struct_dtype("ci_log_header"))
    hdr["magic"] = C["CI_LOG_MAGIC"]
    hdr["version"] = C["CI_FORMAT_VERSION"]
    hdr["header_size"] = C["CI_LOG_HEADER_SIZE"]
    hdr["record_size"] = C["CI_RECORD_SIZE"]
    hdr["pid"] = pid
    hdr["start_ns"] = 1_000 + index
    hdr["global_rank"] = spec["global_rank"]
    hdr["local_rank"] = -1
    hdr["world_size"] = 8
    hdr["host"] = spec["host"][:63]
    hdr["workload_id"] = spec["workload_id"][:63]
    hdr["node_ip"] = spec["node_ip"][:63]
    records = np.zeros(len(spec["records"]), header.record_dtype())
    for i, fields in enumerate(spec["records"]):
        for name, value in fields.items():
            records[name][i] = value
    records["pid"] = pid
    header.seal_records(records)
    return pid, hdr.tobytes() + records.tobytes()


def write_home(home: Path, spec: list[dict]) -> Path:
    logs = home / "inspector_logs"
    logs.mkdir(parents=True)
    for index, item in enumerate(spec):
        pid, data = segment_bytes(index, item)
        (logs / f"gpu-{pid}-{1000 + index}-0.cilog.sealed").write_bytes(data)
    return home


def seal_archive(home: Path, work: Path, workload_id: str = "job-1") -> Path:
    """The archive the agent's archiver seals from the home's segments."""
    shutil.copytree(home / "inspector_logs", work / "logs")
    if (home / "hang_detection").is_dir():  # the profiler's hang evidence travels in the archive too
        shutil.copytree(home / "hang_detection", work / "hang")
    (work / "proc").mkdir()
    spool = Spool(work / "spool", [], max_bytes=1 << 30, max_age_s=3600)
    archiver = Archiver(
        work / "logs",
        work / "hang",
        work / "state",
        spool,
        workload_id=workload_id,
        node="n",
        host="h",
        node_ip="",
        orphan_grace_s=0.0,
        proc_root=work / "proc",
    )
    archiver.recover()
    entry = archiver.seal(final=True)
    assert entry is not None
    return entry.path
