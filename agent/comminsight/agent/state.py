"""Live state of one node (or, on a master, of the job): progress per communicator and rank, in-flight
operations, lagging ranks, and the live hang detector.

Batches of records arrive as numpy structured arrays and are reduced with polars group-bys, so the
work per batch is a handful of vector operations; Python touches only the aggregates (one entry per
communicator x op x rank), never one object per event. In-flight operations are the profiler's
TIMEOUT snapshots (state 4: "an op in flight past the profiler's threshold"), removed when a later
record of the same communicator, op and rank completes.

Ranks here are ranks inside a communicator (``ci_op_record.rank``); the global rank of a writer
process is known from its raw-log segment header and attached where known.
"""

from __future__ import annotations

import base64
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from comminsight.evidence.process_groups import Observation
from comminsight.formats import header
from comminsight.formats.ring import Columns

# A batch of records: a structured array (segments) or its columnar form (rings); both index by field name.
Batch = np.ndarray | Columns

# Bus bandwidth factor (DESIGN §6) by op name as the profiler writes it; n is the communicator size.
_BUS_FACTOR = {
    "AllReduce": lambda n: 2.0 * (n - 1) / n,
    "AllGather": lambda n: (n - 1) / n,
    "ReduceScatter": lambda n: (n - 1) / n,
}
_EWMA = 0.2


def bus_factor(func: str, nranks: int) -> float:
    factor = _BUS_FACTOR.get(func)
    return factor(max(nranks, 1)) if factor and nranks > 0 else 1.0


def comm_id(comm_hash: int) -> str:
    return f"0x{comm_hash:016x}"


@dataclass
class OpStats:
    """Totals of one op type on one communicator (all ranks on this node)."""

    count: int = 0
    bytes: int = 0
    busbw: float = 0.0  # bytes/s of the last batch that had durations
    normal_ns: float = 0.0  # EWMA of the batch p95 duration: "this op's normal duration"
    latency_ns: float = 0.0  # EWMA of the batch p95 enqueue-to-completion time: what an in-flight age compares to


@dataclass
class RankProgress:
    pid: int = 0
    global_rank: int = -1
    last_enqueued: tuple[str, int] = ("", -1)
    last_enqueue_ns: int = 0
    last_completed: tuple[str, int] = ("", -1)
    last_complete_ns: int = 0
    completed_seq: dict[str, int] = field(default_factory=dict)  # highest completed seq per op
    ops: int = 0


@dataclass
class Communicator:
    comm_hash: int
    name: str = ""
    nranks: int = 0
    ranks: dict[int, RankProgress] = field(default_factory=dict)
    ops: dict[str, OpStats] = field(default_factory=dict)
    node: str = ""
    first_seen_ns: int = 0
    group: dict[str, Any] = field(default_factory=dict)  # the process-group join: name, desc, ranks, source, note

    @property
    def display_name(self) -> str:
        """NCCL's commName, else ``"<group_desc>:<group_name>"`` from the process-group join, else empty."""
        if self.name or not self.group:
            return self.name
        return f"{self.group.get('desc') or 'undefined'}:{self.group.get('name', '')}"

    def group_view(self) -> dict[str, Any]:
        """The joined group fields every view shows beside the hash."""
        return {
            "group_name": self.group.get("name", ""),
            "group_desc": self.group.get("desc", ""),
            "group_ranks": self.group.get("ranks", []),
            "name_source": self.group.get("source", "comm_name" if self.name else ""),
            "name_note": self.group.get("note", ""),
        }


@dataclass
class InFlight:
    comm_hash: int
    func: str
    seq: int
    rank: int
    pid: int
    enqueue_ns: int
    bytes: int


class LiveState:
    """Thread-safe aggregate state; the daemon's loop writes, the HTTP handlers read snapshots."""

    def __init__(
        self,
        hang_threshold_s: float = 0.0,
        hang_floor_s: float = 10.0,
        hang_factor: float = 20.0,
        hang_cold_s: float = 60.0,
    ) -> None:
        self.lock = threading.RLock()
        self.comms: dict[int, Communicator] = {}
        self.inflight: dict[tuple[int, str, int, int], InFlight] = {}
        self.writer_seq: dict[str, int] = {}  # writer key -> highest record_seq applied (dedupe ring vs log)
        self.pid_global_rank: dict[int, int] = {}
        self.records_applied = 0
        self.newest_record_ns = 0
        self.hang_threshold_s = hang_threshold_s
        self.hang_floor_s = hang_floor_s
        self.hang_factor = hang_factor
        self.suspicions: dict[tuple[int, str, int], dict[str, Any]] = {}
        self.hang_cold_s = hang_cold_s
        # Evidence for the live chain analysis (comminsight.agent.diagnosis): per (comm, func, rank, peer)
        # the record of the highest completed seq, and the record of every op in flight. Bounded by the
        # number of streams, not of events.
        self.last_records: dict[tuple[int, str, int, int], np.void] = {}
        self.inflight_records: dict[tuple[int, str, int, int], np.void] = {}

    # ---- ingest -------------------------------------------------------------------------------
    def fresh(self, writer: str, records: Batch) -> Batch:
        """The records of ``writer`` not applied yet (by record_seq), so ring and log never double count."""
        if len(records) == 0:
            return records
        seen = self.writer_seq.get(writer, -1)
        if seen >= 0:
            records = records[records["record_seq"].astype(np.int64) > seen]
        return records

    def apply(self, writer: str, records: Batch) -> int:
        """Fold a batch of verified records from one writer into the state; returns records applied."""
        records = self.fresh(writer, records)
        n = len(records)
        if n == 0:
            return 0
        consts = header.constants()
        func_values, func_codes = np.unique(records["func"], return_inverse=True)
        func_names = [bytes(v).split(b"\0", 1)[0].decode("utf-8", "replace") for v in func_values]
        state = records["state"]
        gpu = (records["flags"] & consts["CI_FLAG_GPU_TIMES"]) != 0
        gpu_dur = records["gpu_end_ns"].astype(np.int64) - records["gpu_start_ns"].astype(np.int64)
        cpu_dur = records["complete_ns"].astype(np.int64) - records["enqueue_end_ns"].astype(np.int64)
        frame = pl.DataFrame(
            {
                "comm": records["comm_hash"],
                "func": func_codes.astype(np.int32),
                "rank": records["rank"],
                "nranks": records["nranks"],
                "pid": records["pid"],
                "seq": records["seq"].astype(np.int64),
                "bytes": records["bytes"].astype(np.int64),
                "state": state,
                "enq": records["enqueue_end_ns"].astype(np.int64),
                "done": records["complete_ns"].astype(np.int64),
                "dur": np.where(gpu, gpu_dur, cpu_dur),
            }
        )
        snapshot_states = [consts["CI_STATE_TIMEOUT"], consts["CI_STATE_INFLIGHT"]]
        frame = frame.with_row_index("_i")
        timeouts = frame.filter(pl.col("state").is_in(snapshot_states))
        done = frame.filter(~pl.col("state").is_in(snapshot_states))
        # An op still in flight when its communicator finalized (an aborted job) was recorded, not completed:
        # it must not advance the rank's progress, or a job aborted while hung would look as if it recovered.
        completed = done.filter(pl.col("state") != consts["CI_STATE_ABANDONED"])
        # The record at each stream's highest completed seq (peer too: P2P seqs count per peer).
        last_idx = (
            completed.with_columns(peer=pl.Series(records["peer"]).gather(completed.get_column("_i")))
            .sort("seq")
            .group_by("comm", "func", "rank", "peer")
            .agg(pl.col("_i").last())
            .get_column("_i")
            .to_numpy()
        )
        last_rows = _rows(records, last_idx)
        snap_rows = _rows(records, timeouts.get_column("_i").to_numpy())
        per_rank = completed.group_by("comm", "func", "rank").agg(
            pl.len().alias("n"),
            pl.col("seq").max().alias("seq_max"),
            pl.col("done").max().alias("done_max"),
            pl.col("enq").max().alias("enq_max"),
            pl.col("pid").last().alias("pid"),
            pl.col("nranks").last().alias("nranks"),
        )
        per_op = done.group_by("comm", "func").agg(
            pl.len().alias("n"),
            pl.col("bytes").sum().alias("bytes"),
            pl.col("bytes").filter(pl.col("dur") > 0).sum().alias("timed_bytes"),
            pl.col("dur").filter(pl.col("dur") > 0).sum().alias("dur_sum"),
            pl.col("dur").filter(pl.col("dur") > 0).quantile(0.95).alias("dur_p95"),
            (pl.col("done") - pl.col("enq"))
            .filter((pl.col("done") > 0) & (pl.col("enq") > 0))
            .quantile(0.95)
            .alias("lat_p95"),
        )
        names = {}
        uniq_comm, first_idx, comm_inverse = np.unique(records["comm_hash"], return_index=True, return_inverse=True)
        enqueued = records["enqueue_end_ns"].astype(np.int64)
        firsts = np.full(len(uniq_comm), np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(firsts, comm_inverse, np.where(enqueued > 0, enqueued, np.iinfo(np.int64).max))
        for comm, index, first in zip(uniq_comm.tolist(), first_idx.tolist(), firsts.tolist(), strict=True):
            names[comm] = (
                bytes(records["comm_name"][index]).split(b"\0", 1)[0].decode("utf-8", "replace"),
                int(records["nranks"][index]),
                first if first != np.iinfo(np.int64).max else 0,
            )
        with self.lock:
            for comm, (name, nranks, first) in names.items():
                c = self.comms.setdefault(comm, Communicator(comm))
                c.name = c.name or name
                c.nranks = max(c.nranks, nranks)
                if first and (not c.first_seen_ns or first < c.first_seen_ns):
                    c.first_seen_ns = first
            for row in per_rank.iter_rows(named=True):
                c = self.comms[row["comm"]]
                func = func_names[row["func"]]
                rp = c.ranks.setdefault(row["rank"], RankProgress())
                rp.pid = row["pid"]
                rp.global_rank = self.pid_global_rank.get(rp.pid, rp.global_rank)
                rp.ops += row["n"]
                if row["seq_max"] >= rp.completed_seq.get(func, -1):
                    rp.completed_seq[func] = row["seq_max"]
                if row["done_max"] >= rp.last_complete_ns:
                    rp.last_complete_ns = row["done_max"]
                    rp.last_completed = (func, row["seq_max"])
                if row["enq_max"] >= rp.last_enqueue_ns:
                    rp.last_enqueue_ns = row["enq_max"]
                    rp.last_enqueued = (func, row["seq_max"])
            for row in per_op.iter_rows(named=True):
                c = self.comms[row["comm"]]
                func = func_names[row["func"]]
                stats = c.ops.setdefault(func, OpStats())
                stats.count += row["n"]
                stats.bytes += row["bytes"]
                if row["dur_sum"]:
                    stats.busbw = row["timed_bytes"] * bus_factor(func, c.nranks) / (row["dur_sum"] / 1e9)
                    p95 = float(row["dur_p95"] or 0.0)
                    stats.normal_ns = p95 if stats.normal_ns == 0 else (1 - _EWMA) * stats.normal_ns + _EWMA * p95
                lat = float(row["lat_p95"] or 0.0)
                if lat > 0:
                    stats.latency_ns = lat if stats.latency_ns == 0 else (1 - _EWMA) * stats.latency_ns + _EWMA * lat
            for row in timeouts.iter_rows(named=True):
                func = func_names[row["func"]]
                key = (row["comm"], func, row["seq"], row["rank"])
                c = self.comms[row["comm"]]
                rp = c.ranks.setdefault(row["rank"], RankProgress(pid=row["pid"]))
                if rp.completed_seq.get(func, -1) >= row["seq"]:
                    continue  # completed meanwhile
                self.inflight[key] = InFlight(
                    row["comm"], func, row["seq"], row["rank"], row["pid"], row["enq"], row["bytes"]
                )
                if row["enq"] >= rp.last_enqueue_ns:
                    rp.last_enqueue_ns = row["enq"]
                    rp.last_enqueued = (func, row["seq"])
            for rec in last_rows:
                key = (int(rec["comm_hash"]), _text(rec["func"]), int(rec["rank"]), int(rec["peer"]))
                old = self.last_records.get(key)
                if old is None or int(rec["seq"]) >= int(old["seq"]):
                    self.last_records[key] = rec
            for rec in snap_rows:
                key = (int(rec["comm_hash"]), _text(rec["func"]), int(rec["seq"]), int(rec["rank"]))
                if key in self.inflight:
                    self.inflight_records.setdefault(key, rec)
            # An op is no longer in flight once its rank completed that seq (or a later one) of that op.
            for key in [k for k, v in self.inflight.items() if self._completed(v)]:
                del self.inflight[key]
                self.inflight_records.pop(key, None)
            self.writer_seq[writer] = max(self.writer_seq.get(writer, -1), int(records["record_seq"].max()))
            self.records_applied += n
            self.newest_record_ns = max(self.newest_record_ns, int(records["complete_ns"].max()))
        return n

    def _completed(self, op: InFlight) -> bool:
        c = self.comms.get(op.comm_hash)
        rp = c.ranks.get(op.rank) if c else None
        return bool(rp and rp.completed_seq.get(op.func, -1) >= op.seq)

    def set_global_rank(self, pid: int, global_rank: int) -> None:
        if global_rank < 0:
            return
        with self.lock:
            self.pid_global_rank[pid] = global_rank
            for c in self.comms.values():
                for rp in c.ranks.values():
                    if rp.pid == pid:
                        rp.global_rank = global_rank

    # ---- hang detection ------------------------------------------------------------------------
    def threshold_s(self, comm_hash: int, func: str) -> float:
        if self.hang_threshold_s > 0:
            return self.hang_threshold_s
        c = self.comms.get(comm_hash)
        stats = c.ops.get(func) if c else None
        if stats is None or not stats.latency_ns:
            # No completed history of this op on this communicator (first call, warm-up): no "normal" yet.
            return max(self.hang_floor_s, self.hang_cold_s)
        return max(self.hang_floor_s, self.hang_factor * stats.latency_ns / 1e9)

    def min_threshold_s(self) -> float:
        """The smallest threshold any op can get: the in-flight report age the profiler is asked for derives from it."""
        return self.hang_threshold_s if self.hang_threshold_s > 0 else self.hang_floor_s

    def evidence_records(self) -> np.ndarray:
        """Records for the live chain analysis: each stream's last completion plus every op in flight."""
        with self.lock:
            return self.evidence_records_locked()

    def detect_hangs(self, now_ns: int | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Re-evaluate suspicions; returns (all current, sorted by communicator and seq; the new or changed ones)."""
        now_ns = now_ns or time.time_ns()
        with self.lock:
            groups: dict[tuple[int, str, int], list[InFlight]] = {}
            for op in self.inflight.values():
                groups.setdefault((op.comm_hash, op.func, op.seq), []).append(op)
            current: dict[tuple[int, str, int], dict[str, Any]] = {}
            for key, ops in groups.items():
                comm_hash, func, seq = key
                oldest = min(op.enqueue_ns for op in ops)
                age = (now_ns - oldest) / 1e9
                threshold = self.threshold_s(comm_hash, func)
                if age < threshold:
                    continue
                c = self.comms[comm_hash]
                inside = {op.rank: op for op in ops}
                completed = sorted(r for r, rp in c.ranks.items() if rp.completed_seq.get(func, -1) >= seq)
                observed = set(c.ranks)
                never = sorted(observed - set(inside) - set(completed))
                previous = self.suspicions.get(key)
                current[key] = {
                    "comm_hash": comm_id(comm_hash),
                    "comm_name": c.display_name,
                    **c.group_view(),
                    "nranks": c.nranks,
                    "op": func,
                    "seq": seq,
                    "threshold_s": round(threshold, 3),
                    "oldest_age_s": round(age, 3),
                    "detected_ns": previous["detected_ns"] if previous else now_ns,
                    "entered": [
                        {
                            "rank": r,
                            "global_rank": c.ranks[r].global_rank if r in c.ranks else -1,
                            "pid": op.pid,
                            "age_s": round((now_ns - op.enqueue_ns) / 1e9, 3),
                        }
                        for r, op in sorted(inside.items())
                    ],
                    "completed": completed,
                    "never_entered": never,
                    "never_entered_global": [c.ranks[r].global_rank for r in never],
                    "not_observed": sorted(set(range(c.nranks)) - observed) if c.nranks else [],
                    "last_completed": {str(r): list(c.ranks[r].last_completed) for r in sorted(never)},
                }
            # Per communicator, the lowest stuck seq is where progress stopped; later ones queue behind it.
            lowest: dict[int, int] = {}
            for comm_hash, _, seq in current:
                lowest[comm_hash] = min(seq, lowest.get(comm_hash, seq))
            for (comm_hash, _, seq), suspicion in current.items():
                suspicion["earliest_on_communicator"] = seq == lowest[comm_hash]
            # New, or changed membership: ranks' in-flight snapshots arrive a little apart, so a rank
            # first listed as never entered may turn out to have entered; the evidence is re-issued.
            new = [
                v
                for k, v in current.items()
                if k not in self.suspicions or self.suspicions[k]["never_entered"] != v["never_entered"]
            ]
            self.suspicions = dict(sorted(current.items()))
            return list(self.suspicions.values()), new

    def observations(self) -> list[Observation]:
        """What the live state knows of each communicator, for the process-group join."""
        with self.lock:
            return [
                Observation(
                    comm_id=comm_id(c.comm_hash),
                    size=c.nranks,
                    positions={rp.global_rank: r for r, rp in c.ranks.items() if rp.global_rank >= 0},
                    first_seen_ns=c.first_seen_ns,
                    comm_name=c.name,
                )
                for c in self.comms.values()
            ]

    def set_group_names(self, names: dict[str, dict[str, Any]]) -> None:
        """Attach the join's result (``{comm_id: {...}}``) to the communicators."""
        with self.lock:
            for c in self.comms.values():
                c.group = names.get(comm_id(c.comm_hash), {})
            by_id = {comm_id(c.comm_hash): c for c in self.comms.values()}
            for suspicion in self.suspicions.values():
                named = by_id.get(suspicion["comm_hash"])
                if named is not None:
                    suspicion.update(comm_name=named.display_name, **named.group_view())

    # ---- views ---------------------------------------------------------------------------------
    def lagging_ranks(self, c: Communicator) -> list[int]:
        """Ranks whose last completion is behind the communicator's most advanced rank, per op."""
        lagging: set[int] = set()
        funcs = {f for rp in c.ranks.values() for f in rp.completed_seq}
        for func in funcs:
            seqs = {r: rp.completed_seq.get(func, -1) for r, rp in c.ranks.items()}
            top = max(seqs.values())
            lagging.update(r for r, s in seqs.items() if s < top)
        return sorted(lagging)

    def communicators_view(self, now_ns: int | None = None) -> list[dict[str, Any]]:
        now_ns = now_ns or time.time_ns()
        with self.lock:
            out = []
            for c in sorted(self.comms.values(), key=lambda c: c.comm_hash):
                inflight = [op for op in self.inflight.values() if op.comm_hash == c.comm_hash]
                out.append(
                    {
                        "comm_hash": comm_id(c.comm_hash),
                        "comm_name": c.display_name,
                        **c.group_view(),
                        "nranks": c.nranks,
                        "node": c.node,
                        "ops": {
                            f: {
                                "count": s.count,
                                "bytes": s.bytes,
                                "busbw_bytes_per_s": s.busbw,
                                "normal_duration_s": s.normal_ns / 1e9,
                            }
                            for f, s in sorted(c.ops.items())
                        },
                        "last_completed_seq": max(
                            (s for rp in c.ranks.values() for s in rp.completed_seq.values()), default=-1
                        ),
                        "lagging_ranks": self.lagging_ranks(c),
                        "inflight": len(inflight),
                        "ranks": {
                            str(r): {
                                "pid": rp.pid,
                                "global_rank": rp.global_rank,
                                "ops": rp.ops,
                                "last_enqueued": {
                                    "op": rp.last_enqueued[0],
                                    "seq": rp.last_enqueued[1],
                                    "age_s": _age(now_ns, rp.last_enqueue_ns),
                                },
                                "last_completed": {
                                    "op": rp.last_completed[0],
                                    "seq": rp.last_completed[1],
                                    "age_s": _age(now_ns, rp.last_complete_ns),
                                },
                                "completed_seq": dict(rp.completed_seq),
                            }
                            for r, rp in sorted(c.ranks.items())
                        },
                    }
                )
            return out

    def inflight_view(self, now_ns: int | None = None) -> list[dict[str, Any]]:
        now_ns = now_ns or time.time_ns()
        with self.lock:
            return [
                {
                    "comm_hash": comm_id(op.comm_hash),
                    "comm_name": self.comms[op.comm_hash].display_name if op.comm_hash in self.comms else "",
                    "op": op.func,
                    "seq": op.seq,
                    "rank": op.rank,
                    "pid": op.pid,
                    "bytes": op.bytes,
                    "age_s": round((now_ns - op.enqueue_ns) / 1e9, 3),
                    "threshold_s": round(self.threshold_s(op.comm_hash, op.func), 3),
                }
                for op in sorted(self.inflight.values(), key=lambda o: o.enqueue_ns)
            ]

    def oldest_inflight_age_s(self, now_ns: int | None = None) -> float:
        now_ns = now_ns or time.time_ns()
        with self.lock:
            if not self.inflight:
                return 0.0
            return (now_ns - min(op.enqueue_ns for op in self.inflight.values())) / 1e9

    # ---- checkpoint ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        with self.lock:
            return {
                "writer_seq": dict(self.writer_seq),
                "pid_global_rank": {str(k): v for k, v in self.pid_global_rank.items()},
                "records_applied": self.records_applied,
                "newest_record_ns": self.newest_record_ns,
                "comms": [
                    {
                        "comm_hash": c.comm_hash,
                        "name": c.name,
                        "nranks": c.nranks,
                        "first_seen_ns": c.first_seen_ns,
                        "ops": {f: [s.count, s.bytes, s.busbw, s.normal_ns, s.latency_ns] for f, s in c.ops.items()},
                        "ranks": {
                            str(r): [
                                rp.pid,
                                rp.global_rank,
                                list(rp.last_enqueued),
                                rp.last_enqueue_ns,
                                list(rp.last_completed),
                                rp.last_complete_ns,
                                rp.completed_seq,
                                rp.ops,
                            ]
                            for r, rp in c.ranks.items()
                        },
                    }
                    for c in self.comms.values()
                ],
                "inflight": [
                    [op.comm_hash, op.func, op.seq, op.rank, op.pid, op.enqueue_ns, op.bytes]
                    for op in self.inflight.values()
                ],
                # Diagnosis evidence, raw records as base64 (ci_op_record layout).
                "evidence": base64.b64encode(self.evidence_records_locked().tobytes()).decode(),
            }

    def evidence_records_locked(self) -> np.ndarray:
        rows = [*self.last_records.values(), *self.inflight_records.values()]
        return np.array(rows, dtype=header.record_dtype()) if rows else np.empty(0, header.record_dtype())

    def restore(self, saved: dict[str, Any]) -> None:
        with self.lock:
            self.writer_seq = {str(k): int(v) for k, v in saved.get("writer_seq", {}).items()}
            self.pid_global_rank = {int(k): int(v) for k, v in saved.get("pid_global_rank", {}).items()}
            self.records_applied = int(saved.get("records_applied", 0))
            self.newest_record_ns = int(saved.get("newest_record_ns", 0))
            self.comms = {}
            for item in saved.get("comms", []):
                c = Communicator(int(item["comm_hash"]), item["name"], int(item["nranks"]))
                c.first_seen_ns = int(item.get("first_seen_ns", 0))
                c.ops = {
                    f: OpStats(int(v[0]), int(v[1]), float(v[2]), float(v[3]), float(v[4]) if len(v) > 4 else 0.0)
                    for f, v in item["ops"].items()
                }
                for r, v in item["ranks"].items():
                    c.ranks[int(r)] = RankProgress(
                        int(v[0]),
                        int(v[1]),
                        (v[2][0], int(v[2][1])),
                        int(v[3]),
                        (v[4][0], int(v[4][1])),
                        int(v[5]),
                        {k: int(s) for k, s in v[6].items()},
                        int(v[7]),
                    )
                self.comms[c.comm_hash] = c
            self.inflight = {}
            for v in saved.get("inflight", []):
                op = InFlight(int(v[0]), v[1], int(v[2]), int(v[3]), int(v[4]), int(v[5]), int(v[6]))
                self.inflight[(op.comm_hash, op.func, op.seq, op.rank)] = op
            self.last_records, self.inflight_records = {}, {}
            consts = header.constants()
            raw = base64.b64decode(saved.get("evidence", ""), validate=True)
            dtype = header.record_dtype()
            for rec in np.frombuffer(raw[: len(raw) // dtype.itemsize * dtype.itemsize], dtype).copy():
                func = _text(rec["func"])
                if int(rec["state"]) in (consts["CI_STATE_TIMEOUT"], consts["CI_STATE_INFLIGHT"]):
                    key = (int(rec["comm_hash"]), func, int(rec["seq"]), int(rec["rank"]))
                    if key in self.inflight:
                        self.inflight_records[key] = rec
                else:
                    self.last_records[(int(rec["comm_hash"]), func, int(rec["rank"]), int(rec["peer"]))] = rec


def _text(value: Any) -> str:
    return bytes(value).split(b"\0", 1)[0].decode("utf-8", "replace")


def _rows(records: Batch, idx: np.ndarray) -> np.ndarray:
    """Records ``idx`` of a batch as a ci_op_record structured array (copies: batches are transient)."""
    if isinstance(records, np.ndarray):
        return records[idx].copy()
    out = np.zeros(len(idx), header.record_dtype())
    for name in records.names:
        out[name] = records[name][idx]
    header.seal_records(out)
    return out


def _age(now_ns: int, then_ns: int) -> float | None:
    return round((now_ns - then_ns) / 1e9, 3) if then_ns else None
