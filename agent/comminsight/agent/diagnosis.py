"""Live root cause: the CLI's hang chain analysis run over the agent's live state.

When a hang is suspected the agent has, per stream (communicator, op, rank, peer), the record of
the highest completed operation, and the record of every operation in flight (LiveState keeps
both, bounded by the number of streams). That is exactly what ``comminsight.analysis.hang``
needs: per rank and stream the completion watermark and the pending operations. The records are
grouped as raw-log segments would be (one per writer process, with its global rank in the header)
and decoded by the one record decoder (``comminsight.formats.operations``), so the live answer goes
through the same decoder and the same analysis as ``comminsight analyze hang <home>`` would offline.

A master merges its slaves' evidence (each report carries its node's records) before the analysis,
so the chain crosses nodes.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from comminsight.analysis.hang import analyze_hang
from comminsight.formats import header
from comminsight.formats.operations import SegmentRecords, operations
from comminsight.formats.rawlog import SegmentHeader

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


def evidence_segments(evidence: list[NodeEvidence]) -> list[SegmentRecords]:
    """Each node's records as segments, one per writer pid (with its global rank), as a home would hold them."""
    parts = []
    for item in evidence:
        records = item.records  # an agent-requested INFLIGHT snapshot decodes like the plugin's TIMEOUT one
        for pid in np.unique(records["pid"]).tolist():
            hdr = SegmentHeader(
                pid=pid,
                start_ns=0,
                segment_index=0,
                local_rank=-1,
                global_rank=item.pid_rank.get(pid, -1),
                world_size=-1,
                host=item.node,
                workload_id="",
                node_ip="",
            )
            parts.append(SegmentRecords(hdr, records[records["pid"] == pid]))
    return parts


def diagnose(evidence: list[NodeEvidence]) -> dict[str, Any] | None:
    """Root cause of a live hang: ``root_cause_ranks``, ``first_stuck`` and ``summary``; None without evidence."""
    parts = evidence_segments(evidence)
    if not parts:
        return None
    table = operations(parts)
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
