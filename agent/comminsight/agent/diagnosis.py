"""Live root cause: the CLI's hang chain analysis run over the agent's live state.

When a hang is suspected the agent has, per stream (communicator, op, rank, peer), the record of
the highest completed operation, and the record of every operation in flight (LiveState keeps
both, bounded by the number of streams). That is exactly what ``comminsight.analysis.hang``
needs: per rank and stream the completion watermark and the pending operations. The records are
written as raw-log segments (one per writer process, with its global rank in the header) into a
temporary directory and read back by the raw-log importer, so the live answer goes through the
same decoder and the same analysis as ``comminsight analyze hang <home>`` would offline.

A master merges its slaves' evidence (each report carries its node's records) before the analysis,
so the chain crosses nodes.
"""

from __future__ import annotations

import base64
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from comminsight.analysis.hang import analyze_hang
from comminsight.formats import header
from comminsight.importers import EvidenceError
from comminsight.importers import rawlog as rawlog_importer

MAX_EVIDENCE_RECORDS = 1 << 18  # per node; a report beyond this is refused (64 MiB of records)
# What one report or heartbeat carries per node (records of 256 bytes, base64: ~460 KiB of JSON), so a
# heartbeat stays well under the site's 1 MiB limit and a slave's report under the master's 8 MiB.
SENT_EVIDENCE_RECORDS = 1024


@dataclass(frozen=True)
class NodeEvidence:
    """One node's diagnosis evidence: its records and the global rank of each writer pid."""

    node: str
    records: np.ndarray
    pid_rank: dict[int, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "records": base64.b64encode(self.records.tobytes()).decode(),
            "pid_rank": {str(k): v for k, v in self.pid_rank.items()},
        }

    def capped(self, max_records: int = SENT_EVIDENCE_RECORDS) -> NodeEvidence:
        """At most ``max_records`` records, those that name where progress stopped first.

        Operations in flight come first (the oldest first: the lowest stuck seq is where a chain starts),
        then each stream's last completion, the least advanced first: the ranks that stopped earliest are
        the ones the chain analysis must still see. What is left out is only ever ahead of what is kept.
        """
        records = self.records
        if len(records) <= max_records:
            return self
        consts = header.constants()
        inflight = np.isin(records["state"], [consts["CI_STATE_INFLIGHT"], consts["CI_STATE_TIMEOUT"]])
        # Sort key: in flight before completed, then by when the op was issued.
        order = np.lexsort((records["enqueue_end_ns"], ~inflight))
        return NodeEvidence(self.node, records[np.sort(order[:max_records])], self.pid_rank)

    @classmethod
    def from_json(cls, node: str, doc: Any) -> NodeEvidence:
        """Evidence sent by a slave; ValueError when it is malformed (records are checksum-verified)."""
        if not isinstance(doc, dict):
            raise ValueError("evidence must be an object")
        raw = base64.b64decode(str(doc.get("records", "")), validate=True)
        dtype = header.record_dtype()
        if len(raw) % dtype.itemsize or len(raw) // dtype.itemsize > MAX_EVIDENCE_RECORDS:
            raise ValueError("evidence records are not whole records or too many")
        records = np.frombuffer(raw, dtype).copy()
        records = records[header.valid_records(records)]
        pid_rank = {int(k): int(v) for k, v in dict(doc.get("pid_rank") or {}).items()}
        return cls(node, records, pid_rank)


def _segment_header(pid: int, global_rank: int, host: str) -> np.ndarray:
    consts = header.constants()
    hdr = np.zeros(1, header.struct_dtype("ci_log_header"))
    hdr["magic"] = consts["CI_LOG_MAGIC"]
    hdr["version"] = consts["CI_FORMAT_VERSION"]
    hdr["header_size"] = consts["CI_LOG_HEADER_SIZE"]
    hdr["record_size"] = consts["CI_RECORD_SIZE"]
    hdr["pid"] = pid
    hdr["local_rank"] = -1
    hdr["global_rank"] = global_rank
    hdr["world_size"] = -1
    hdr["host"] = host.encode()[:63]
    return hdr


def write_segments(evidence: list[NodeEvidence], directory: Path) -> int:
    """Write each node's records as raw-log segments, one per writer pid; returns segments written."""
    consts = header.constants()
    written = 0
    for n, item in enumerate(evidence):
        records = item.records.copy()
        if not len(records):
            continue
        # An agent-requested snapshot reads like the profiler's own timeout snapshot: an op in flight.
        records["state"][records["state"] == consts["CI_STATE_INFLIGHT"]] = consts["CI_STATE_TIMEOUT"]
        header.seal_records(records)
        for pid in np.unique(records["pid"]).tolist():
            mine = records[records["pid"] == pid]
            path = directory / f"node{n}-{pid}-0-0.cilog"
            with open(path, "wb") as handle:
                handle.write(_segment_header(pid, item.pid_rank.get(pid, -1), item.node).tobytes())
                handle.write(mine.tobytes())
            written += 1
    return written


def diagnose(evidence: list[NodeEvidence]) -> dict[str, Any] | None:
    """Root cause of a live hang: ``root_cause_ranks``, ``first_stuck`` and ``summary``; None without evidence."""
    with tempfile.TemporaryDirectory(prefix="comminsight-diagnosis-") as tmp:
        if not write_segments(evidence, Path(tmp)):
            return None
        try:
            table = rawlog_importer.load(Path(tmp))
        except EvidenceError:
            return None
    report = analyze_hang(table)
    if report["verdict"] != "hang":
        return None
    first = report["stuck_groups"][0] if report["stuck_groups"] else None
    first_stuck = None
    if first is not None:
        first_stuck = {
            "comm_hash": first["group_id"],
            "comm_desc": first.get("group_desc"),
            "op": first["op"],
            "seq": first["seq"],
            "kind": first.get("kind"),
            "ranks": sorted(set(first["missing_ranks"]) | set(first.get("lagging_ranks") or []))
            or list(report["root_cause_ranks"]),
        }
    return {
        "root_cause_ranks": list(report["root_cause_ranks"]),
        "first_stuck": first_stuck,
        "summary": report["summary"],
    }
