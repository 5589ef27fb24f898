"""Master/slave: the cross-node live view of a multi-node job.

Slaves post their live report (communicators, in-flight, hang suspicions) to the master's
``POST /api/v1/cluster/report`` every live interval; the master keeps the latest report per node,
merges them with its own view (ranks of one communicator spread over nodes), recomputes lagging ranks
and never-entered ranks across nodes, and is the only agent that reports live state to the site.
Reports are untrusted input: size-capped by the HTTP layer, shape-checked here, bounded in number.
"""

from __future__ import annotations

import threading
import time
from typing import Any

MAX_NODES = 4096
STALE_S = 300.0


class ReportError(ValueError):
    """A slave report with the wrong shape."""


def validate_report(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ReportError("report must be a JSON object")
    node = body.get("node")
    if not isinstance(node, str) or not 0 < len(node) <= 256:
        raise ReportError("report.node must be a non-empty string")
    comms = body.get("communicators")
    if not isinstance(comms, list) or len(comms) > 100_000:
        raise ReportError("report.communicators must be a list")
    for c in comms:
        if not isinstance(c, dict) or not isinstance(c.get("comm_hash"), str) or not isinstance(c.get("ranks"), dict):
            raise ReportError("each communicator needs comm_hash (string) and ranks (object)")
    hang = body.get("hang", [])
    if not isinstance(hang, list):
        raise ReportError("report.hang must be a list")
    return body


class ClusterView:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reports: dict[str, dict[str, Any]] = {}

    def accept(self, report: dict[str, Any]) -> None:
        report = validate_report(report)
        with self.lock:
            if report["node"] not in self.reports and len(self.reports) >= MAX_NODES:
                raise ReportError("too many nodes")
            report["received"] = time.time()
            self.reports[report["node"]] = report

    def nodes(self) -> list[dict[str, Any]]:
        now = time.time()
        with self.lock:
            return [
                {
                    "node": n,
                    "host": r.get("host", ""),
                    "advertise_url": r.get("advertise_url", ""),
                    "age_s": round(now - r["received"], 3),
                    "stale": now - r["received"] > STALE_S,
                    "communicators": len(r["communicators"]),
                    "hang": bool(r.get("hang")),
                }
                for n, r in sorted(self.reports.items())
            ]

    def merge(
        self, local_node: str, local_comms: list[dict[str, Any]], local_hang: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(communicators merged across nodes, hang suspicions re-evaluated across nodes)."""
        with self.lock:
            sources = [(local_node, local_comms, local_hang)] + [
                (n, r["communicators"], r.get("hang", [])) for n, r in self.reports.items() if n != local_node
            ]
        merged: dict[str, dict[str, Any]] = {}
        for node, comms, _ in sources:
            for c in comms:
                m = merged.setdefault(
                    c["comm_hash"],
                    {
                        "comm_hash": c["comm_hash"],
                        "comm_name": c.get("comm_name", ""),
                        "nranks": 0,
                        "ranks": {},
                        "inflight": 0,
                        "nodes": [],
                    },
                )
                m["nranks"] = max(m["nranks"], int(c.get("nranks", 0) or 0))
                m["inflight"] += int(c.get("inflight", 0) or 0)
                m["nodes"].append(node)
                for r, progress in c["ranks"].items():
                    if isinstance(progress, dict):
                        m["ranks"][str(r)] = {**progress, "node": node}
        for m in merged.values():
            completed: dict[str, dict[str, int]] = {}
            for r, p in m["ranks"].items():
                for func, seq in (p.get("completed_seq") or {}).items():
                    if isinstance(seq, int):
                        completed.setdefault(func, {})[r] = seq
            lagging: set[str] = set()
            for seqs in completed.values():
                top = max(seqs.values())
                lagging.update(r for r, s in seqs.items() if s < top)
            m["lagging_ranks"] = sorted(int(r) for r in lagging if r.lstrip("-").isdigit())
            m["last_completed_seq"] = max((s for seqs in completed.values() for s in seqs.values()), default=-1)
        hangs: dict[tuple[str, str, int], dict[str, Any]] = {}
        for _, _, suspicions in sources:
            for h in suspicions:
                if not isinstance(h, dict):
                    continue
                key = (str(h.get("comm_hash")), str(h.get("op")), int(h.get("seq", -1)))
                agg = hangs.setdefault(key, {**h, "entered": []})
                agg["entered"] = agg["entered"] + [e for e in h.get("entered", []) if isinstance(e, dict)]
                agg["oldest_age_s"] = max(agg.get("oldest_age_s", 0), h.get("oldest_age_s", 0))
        for (comm, func, seq), h in hangs.items():
            found = merged.get(comm)
            if not found:
                continue
            m = found
            entered = {int(e.get("rank", -1)) for e in h["entered"]}
            done = {int(r) for r, p in m["ranks"].items() if (p.get("completed_seq") or {}).get(func, -1) >= seq}
            observed = {int(r) for r in m["ranks"]}
            h["completed"] = sorted(done)
            h["never_entered"] = sorted(observed - entered - done)
            h["never_entered_nodes"] = {str(r): m["ranks"][str(r)]["node"] for r in h["never_entered"]}
            h["not_observed"] = sorted(set(range(m["nranks"])) - observed) if m["nranks"] else []
        return list(merged.values()), list(hangs.values())
