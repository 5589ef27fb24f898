"""Writers of realistic evidence files for importer tests (seeded, small).

- ``write_segment``: a raw-log segment as the profiler writes it (ci_log_header + ci_op_records).
- ``write_inspector_log``: an NCCL Inspector JSON-lines log, in the one-object-per-line form
  (``header`` + ``metadata`` + ``coll_perf``/``p2p_perf``) and the batched form (a
  ``dump_stats`` line carrying header/metadata, followed by bare ``coll_perf`` lines), with the
  field names of NVIDIA/nccl ext-profiler/inspector.
- ``fr_dump``: a Flight Recorder dump dict (to pickle or JSON-encode).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from comminsight.formats.header import constants, record_dtype, seal_records, struct_dtype

FUNCS = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast")


def write_segment(
    path: Path,
    *,
    global_rank: int,
    comm_rank: int,
    nranks: int,
    comm_hash: int = 0xABCDEF0123456789,
    n: int = 8,
    seed: int = 0,
    states: list[int] | None = None,
    p2p_peer: int | None = None,
    torn_tail: bool = False,
    host: str = "node-a",
) -> np.ndarray:
    """Write a segment of ``n`` records; returns the records written."""
    c = constants()
    rng = np.random.default_rng(seed)
    header = np.zeros(1, dtype=struct_dtype("ci_log_header"))
    header["magic"] = c["CI_LOG_MAGIC"]
    header["version"] = c["CI_FORMAT_VERSION"]
    header["header_size"] = c["CI_LOG_HEADER_SIZE"]
    header["record_size"] = c["CI_RECORD_SIZE"]
    header["pid"] = 4242 + global_rank
    header["start_ns"] = 1_700_000_000_000_000_000
    header["local_rank"] = global_rank % 8
    header["global_rank"] = global_rank
    header["world_size"] = nranks
    header["host"] = host.encode()
    header["workload_id"] = b"job-7"
    header["node_ip"] = b"10.0.0.1"
    records = np.zeros(n, dtype=record_dtype())
    t0 = 1_700_000_000_000_000_000 + np.arange(n, dtype=np.int64) * 1_000_000
    records["kind"] = c["CI_KIND_COLL"]
    records["state"] = states if states is not None else c["CI_STATE_COMPLETED"]
    records["flags"] = c["CI_FLAG_GPU_TIMES"]
    records["n_channels"] = 4
    records["rank"] = comm_rank
    records["nranks"] = nranks
    records["nnodes"] = 1
    records["peer"] = -1
    records["pid"] = 4242 + global_rank
    records["cuda_device"] = global_rank % 8
    records["comm_hash"] = comm_hash
    funcs = [FUNCS[i % len(FUNCS)] for i in range(n)]
    per_func: dict[str, int] = {}
    for i, f in enumerate(funcs):
        records["seq"][i] = per_func.get(f, 0)
        per_func[f] = per_func.get(f, 0) + 1
        records["func"][i] = f.encode()
    records["count"] = rng.integers(1, 1 << 20, n)
    records["bytes"] = records["count"] * 2
    records["dtype"] = b"ncclBfloat16"
    records["algo"] = b"Ring"
    records["proto"] = b"Simple"
    records["comm_name"] = b"dp"
    records["enqueue_start_ns"] = t0
    records["enqueue_end_ns"] = t0 + 1000
    records["gpu_start_ns"] = t0 + 5000
    records["gpu_end_ns"] = t0 + 50_000
    records["complete_ns"] = t0 + 60_000
    records["record_seq"] = np.arange(n)
    if p2p_peer is not None:
        records["kind"][-1] = c["CI_KIND_P2P"]
        records["func"][-1] = b"Send"
        records["peer"][-1] = p2p_peer
    seal_records(records)
    data = header.tobytes() + records.tobytes()
    if torn_tail:
        data += records[:1].tobytes()[:100]
    path.write_bytes(data)
    return records


def inspector_lines(
    *, rank: int, n_ranks: int, comm: str = "0x7f8c496ae9f661", n: int = 5, seed: int = 0, batched: bool = False
) -> list[str]:
    """JSON lines an NCCL Inspector would write for one communicator of one process."""
    rng = np.random.default_rng(seed)
    header = {"id": comm, "comm_name": "dp", "rank": rank, "n_ranks": n_ranks, "nnodes": 1}
    metadata = {
        "inspector_output_format_version": "v4.0",
        "git_rev": "",
        "rec_mechanism": "nccl_profiler_interface",
        "dump_timestamp_us": 1_748_030_377_748_202,
        "hostname": f"host{rank // 8}",
        "pid": 1000 + rank,
    }
    payloads = []
    for sn in range(n):
        start = 1_748_030_377_000_000 + sn * 1000
        payloads.append(
            {
                "coll_perf": {
                    "coll": ("AllReduce", "AllGather")[sn % 2],
                    "coll_sn": sn,
                    "coll_msg_size_bytes": int(rng.integers(1, 1 << 30)),
                    "coll_exec_time_us": 300,
                    "coll_timing_source": "kernel_gpu",
                    "coll_algobw_gbs": 277.2,
                    "coll_busbw_gbs": 485.1,
                    "event_trace_ts": {
                        "coll_start_ts": start,
                        "coll_stop_ts": start + 5,
                        "kernel_events": [
                            {"channel_id": 0, "kernel_start_ts": start + 20, "kernel_stop_ts": start + 320}
                        ],
                    },
                }
            }
        )
    payloads.append(
        {
            "p2p_perf": {
                "p2p": "Send",
                "p2p_sn": 0,
                "p2p_peer": (rank + 1) % n_ranks,
                "p2p_msg_size_bytes": 524288,
                "p2p_exec_time_us": 50,
                "p2p_timing_source": "kernel_gpu",
                "p2p_algobw_gbs": 30.0,
                "p2p_busbw_gbs": 30.0,
            }
        }
    )
    if batched:
        stats = {"coll_records": n, "p2p_records": 1, "proxy_records": 0}
        metadata = {**metadata, "inspector_output_format_version": "v4.3"}
        lines = [json.dumps({"header": header, "metadata": metadata, "dump_stats": stats})]
        lines += [json.dumps(p) for p in payloads]
        return lines
    return [json.dumps({"header": header, "metadata": metadata, **p}) for p in payloads]


def fr_dump(rank: int, ranks: list[int], seqs: range, *, p2p: bool = False, completed: int | None = None) -> dict:
    """A Flight Recorder dump of one rank in one process group named "7"."""
    entries = []
    for i, seq in enumerate(seqs):
        entries.append(
            {
                "record_id": 100 + i,
                "pg_id": 3,
                "process_group": ["7", "DATA_PARALLEL_GROUP"],
                "collective_seq_id": seq,
                "p2p_seq_id": 0,
                "op_id": seq,
                "profiling_name": "nccl:all_reduce",
                "time_created_ns": 1_000 + i,
                "input_sizes": [[128, 4]],
                "input_dtypes": ["Float"],
                "output_sizes": [[128, 4]],
                "output_dtypes": ["Float"],
                "state": "scheduled",
                "time_discovered_started_ns": None,
                "time_discovered_completed_ns": None,
                "retired": False,
                "timeout_ms": 600000,
                "is_p2p": False,
            }
        )
    if p2p:
        entries.append(
            {
                **entries[-1],
                "record_id": 999,
                "profiling_name": f"nccl:send {ranks.index(rank)}->{(ranks.index(rank) + 1) % len(ranks)}",
                "p2p_seq_id": 5,
                "is_p2p": True,
            }
        )
    status = {}
    if completed is not None:
        status["3"] = {
            "last_enqueued_collective": max(seqs),
            "last_started_collective": -1,
            "last_completed_collective": completed,
        }
    return {
        "version": "2.9",
        "pg_config": {"7": {"name": "7", "desc": "DATA_PARALLEL_GROUP", "ranks": json.dumps(ranks)}},
        "pg_status": status,
        "nccl_version": "2.27.3",
        "entries": entries,
    }


def kineto_trace(rank: int, ranks: int, events: int, *, seed: int = 0, nccl_every: int = 20) -> dict:
    """A Kineto trace of ``rank`` with about ``events`` events shaped like a profiled training step:
    mostly CPU ops, their runtime calls, compute kernels and flow events, one NCCL all-reduce
    (record_param_comms + kernel) every ``nccl_every`` ops, ProfilerStep spans around each 200 ops."""
    rng = np.random.default_rng(seed + rank)
    out: list[dict] = []
    ts, ext, step = 1_000_000.0, 0, 0
    members = json.dumps(list(range(ranks)))
    names = ("aten::mm", "aten::add_", "aten::copy_", "aten::empty", "aten::linear", "aten::view")
    while len(out) < events:
        step_start = ts
        for k in range(200):
            ext += 1
            cpu_args = {
                "External id": ext,
                "Record function id": 0,
                "Ev Idx": ext,
                "Sequence number": ext,
                "Input Dims": [[1024, 1024], [1024]],
                "Input type": ["float", "float"],
                "Input Strides": [[1024, 1], [1]],
            }
            name = names[int(rng.integers(len(names)))]
            out += [
                {
                    "ph": "X",
                    "cat": "cpu_op",
                    "name": name,
                    "pid": 100 + rank,
                    "tid": 7,
                    "ts": ts,
                    "dur": 3.5,
                    "args": cpu_args,
                },
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel",
                    "pid": 100 + rank,
                    "tid": 7,
                    "ts": ts + 1,
                    "dur": 2.0,
                    "args": {"External id": ext, "cbid": 211, "correlation": 2 * ext},
                },
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": "ampere_sgemm_128x64_tn",
                    "pid": 0,
                    "tid": 7,
                    "ts": ts + 5,
                    "dur": 20.0,
                    "args": {"External id": ext, "device": 0, "stream": 7, "correlation": 2 * ext},
                },
                {"ph": "f", "id": 2 * ext, "pid": 0, "tid": 7, "ts": ts + 5, "cat": "ac2g", "name": "ac2g", "bp": "e"},
            ]
            ts += 25.0
            if k % nccl_every == 0:
                ext += 1
                args = {
                    "External id": ext,
                    "Collective name": "allreduce",
                    "In msg nelems": int(rng.integers(1, 1 << 22)),
                    "Group size": ranks,
                    "dtype": "Float",
                    "Process Group Name": "0",
                    "Process Group Description": "default_pg",
                    "Process Group Ranks": members,
                    "In split size": "[]",
                }
                out.append(
                    {
                        "ph": "X",
                        "cat": "cpu_op",
                        "name": "record_param_comms",
                        "pid": 100 + rank,
                        "tid": 7,
                        "ts": ts,
                        "dur": 4.0,
                        "args": {**args, "Rank": rank},
                    }
                )
                out.append(
                    {
                        "ph": "X",
                        "cat": "kernel",
                        "pid": 0,
                        "tid": 20,
                        "ts": ts + 6,
                        "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                        "dur": 30.0 + float(rng.random()),
                        "args": {**args, "device": 0, "stream": 20},
                    }
                )
                ts += 10
        out.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{step}",
                "pid": 100 + rank,
                "tid": 7,
                "ts": step_start - 0.5,
                "dur": ts - step_start + 1,
            }
        )
        step += 1
    return {
        "schemaVersion": 1,
        "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}],
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": ranks},
        "baseTimeNanoseconds": 1_700_000_000_000_000_000,
        "traceEvents": out,
        "traceName": f"rank{rank}",
    }
