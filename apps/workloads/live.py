"""Live state from agent heartbeats: the latest per node, and the workload's status across nodes.

Status rules (documented in docs/formats/upload.md):
- ``hung``: some node reports hang suspicion, or the workload was hung and no communicator has completed
  an operation since (a job aborted while hung stays hung); ``live_summary`` names the lagging ranks
  (global ranks) across all nodes — per communicator, the ranks reported lagging by the nodes at the lowest
  ``last_completed_seq`` (those that stopped first) — and, once an agent's live chain analysis named it,
  the root cause (``root_cause_ranks`` and the first stuck operation);
- ``finished``: every node heard from recently said ``finished``;
- ``running``: otherwise;
- ``lost``: no heartbeat for ``COMMINSIGHT_WORKLOAD_LOST_AFTER_S`` (set by the periodic task).

Root cause across nodes that report separately (each its own master): while the workload is hung, each
agent sends its nodes' diagnosis evidence (``evidence``: raw records, capped by the agent) with its
heartbeat. The site keeps the latest per node in the cache (never in the heartbeat row, which every
heartbeat re-reads) and ``live_root_cause_merge`` runs the agent's chain analysis over all of them in a
worker; the merged answer (``root_cause.merged``) then stands for the workload until it stops being hung.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgspec
from django.conf import settings
from django.core.cache import cache
from django.db import connection, transaction
from django.dispatch import Signal
from django.utils import timezone

from apps.accounts.models import AgentToken
from comminsight_site import rows

from .models import Node, Workload, WorkloadStatus

logger = logging.getLogger(__name__)

# Sent after a heartbeat is stored (outside its transaction): workload, node, heartbeat, at. apps.monitoring listens.
heartbeat_recorded = Signal()


def _global_ranks(comm: dict[str, Any], local: list[int]) -> list[int]:
    """Global ranks of communicator-local indices ``local``, through the heartbeat's ``ranks`` table.

    Agents report lagging ranks as indices inside the communicator; each entry of ``ranks`` (keyed by that
    index) names the member's global rank. An index without an entry is kept as given (older agents sent
    global ranks).
    """
    members = comm.get("ranks") if isinstance(comm.get("ranks"), dict) else {}
    out = []
    for index in local:
        member = members.get(str(index))
        global_rank = member.get("global_rank") if isinstance(member, dict) else None
        out.append(int(global_rank) if isinstance(global_rank, int) and global_rank >= 0 else int(index))
    return out


def live_summary(heartbeats: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Cross-node view of the latest heartbeat per node (``{node name: heartbeat}``)."""
    per_comm: dict[str, list[tuple[int, list[int], str]]] = {}
    hung_nodes = []
    root_cause: dict[str, Any] | None = None
    for node, beat in sorted(heartbeats.items()):
        if beat.get("hang"):
            hung_nodes.append(node)
            root_cause = _root_cause(beat["hang"], node) or root_cause
        for comm in beat.get("communicators") or []:
            per_comm.setdefault(comm["comm_hash"], []).append(
                (int(comm.get("last_completed_seq", 0)), _global_ranks(comm, comm.get("lagging_ranks") or []), node)
            )
    communicators = []
    lagging_all: set[int] = set()
    for comm_hash, reports in sorted(per_comm.items()):
        low = min(seq for seq, _, _ in reports)
        high = max(seq for seq, _, _ in reports)
        lagging = sorted({r for seq, ranks, _ in reports if seq == low for r in ranks})
        behind_nodes = sorted({node for seq, _, node in reports if seq == low and low < high})
        communicators.append(
            {
                "comm_hash": comm_hash,
                "min_seq": low,
                "max_seq": high,
                "lagging_ranks": lagging,
                "behind_nodes": behind_nodes,
            }
        )
        lagging_all.update(lagging)
    summary: dict[str, Any] = {
        "nodes": len(heartbeats),
        "hung_nodes": hung_nodes,
        "lagging_ranks": sorted(lagging_all),
        "communicators": communicators,
    }
    if root_cause:
        summary["root_cause"] = root_cause
    return summary


def _root_cause(hang: Any, node: str) -> dict[str, Any] | None:
    """The root cause an agent named in its heartbeat's ``hang`` object (older agents send a list: none)."""
    if not isinstance(hang, dict) or not hang.get("root_cause_ranks"):
        return None
    ranks = [r for r in hang["root_cause_ranks"] if isinstance(r, int)]
    first = hang.get("first_stuck") if isinstance(hang.get("first_stuck"), dict) else None
    return {
        "ranks": ranks,
        "node": node,
        "first_stuck": {k: first.get(k) for k in ("comm_hash", "comm_desc", "op", "seq", "ranks")} if first else None,
        "summary": str(hang.get("summary") or "")[:500],
    }


def _kept_root_cause(summary: dict[str, Any], previous: dict[str, Any] | None, status: str) -> None:
    """A root cause merged across nodes stands while the workload stays hung (a heartbeat names its node's)."""
    merged = (previous or {}).get("root_cause")
    if status == WorkloadStatus.HUNG and isinstance(merged, dict) and merged.get("merged"):
        summary["root_cause"] = merged


def _progressed(previous: dict[str, Any] | None, summary: dict[str, Any]) -> bool:
    """Whether some communicator completed an operation since the ``previous`` summary."""
    before = {c["comm_hash"]: c.get("max_seq", -1) for c in (previous or {}).get("communicators") or []}
    return any(c["max_seq"] > before.get(c["comm_hash"], -1) for c in summary["communicators"])


def _status(
    heartbeats: dict[str, dict[str, Any]], summary: dict[str, Any], previous: str, previous_summary: dict | None
) -> str:
    if summary["hung_nodes"]:
        return WorkloadStatus.HUNG
    # A hung job stays hung until it makes progress again: processes that end (or suspicions that clear
    # because the launcher aborted the job) without completing anything mean the job did not recover.
    if previous == WorkloadStatus.HUNG and not _progressed(previous_summary, summary):
        return WorkloadStatus.HUNG
    if heartbeats and all(beat.get("finished") for beat in heartbeats.values()):
        return WorkloadStatus.FINISHED
    return WorkloadStatus.RUNNING


def live_record_heartbeat(
    *, token: AgentToken, heartbeat: dict[str, Any], publish: Callable[[Workload], None] | None = None
) -> Workload:
    """Keep ``heartbeat`` as its node's latest and recompute the workload's status. ``heartbeat`` is validated.

    Open pages are told with ``publish_status`` once the heartbeat committed; a caller with a better way
    passes ``publish`` instead (the agents' path ahead of Django: ``HeartbeatPublisher`` on its event loop).

    Its ``evidence`` (diagnosis records) goes to the cache, not the heartbeat row; once the workload is hung
    and two or more nodes sent evidence, the root cause is merged across them in a worker.

    A node heard from before costs three statements on a bare cursor (``comminsight_site.rows``): keep the
    heartbeat and read the workload (one statement; two on SQLite), read the nodes' fresh heartbeats, write the
    workload's status and summary. The first heartbeat of a workload or node creates them through the ORM."""
    now = timezone.now()
    heartbeat = dict(heartbeat)
    evidence = heartbeat.pop("evidence", None)
    fresh_since = now - timedelta(seconds=settings.WORKLOAD_LOST_AFTER_S)
    # No transaction and no row lock on the workload: each statement commits on its own, so the workload row is
    # locked only while its UPDATE runs, not while this thread waits for the CPU between statements (50 nodes'
    # heartbeats would queue behind it). Each heartbeat sees its own node's latest and every committed other; a
    # concurrent one is counted at the next beat, and a heartbeat that fails halfway is mended by the next.
    workload = _known_node_keep_heartbeat(token.owner_id, heartbeat, now)
    if workload is None:  # SQLite, or the workload's or the node's first heartbeat
        workload = rows.select_one(
            Workload,
            f"t.{rows.column(Workload, 'owner')} = %s AND t.{rows.column(Workload, 'external_id')} = %s",
            [token.owner_id, heartbeat["workload_id"]],
        )
        if workload is None:
            workload, _ = Workload.objects.get_or_create(
                owner=token.owner,
                external_id=heartbeat["workload_id"],
                defaults={"name": heartbeat["workload_id"], "first_seen_at": now},
            )
        _node_keep_heartbeat(workload, heartbeat, now)
    latest = _fresh_heartbeats(workload.pk, fresh_since)
    summary = live_summary(latest)
    workload.status = _status(latest, summary, workload.status, workload.live_summary)
    _kept_root_cause(summary, workload.live_summary, workload.status)
    workload.live_summary = summary
    workload.first_seen_at = workload.first_seen_at or now
    workload.last_seen_at = now
    workload.updated_at = now
    # Only the live fields: ingest updates the time range of the same row concurrently.
    _workload_keep_live(workload)
    tell = publish or publish_status
    transaction.on_commit(lambda: tell(workload))
    if evidence:
        _evidence_keep(workload, heartbeat["node"], evidence)
    heartbeat_recorded.send_robust(Workload, workload=workload, node=heartbeat["node"], heartbeat=heartbeat, at=now)
    return workload


def _heartbeat_fields(heartbeat: dict[str, Any], now: Any) -> dict[str, Any]:
    """The node's fields a heartbeat sets; an empty host or version keeps the old one."""
    fields: dict[str, Any] = {"last_heartbeat": heartbeat, "last_heartbeat_at": now, "last_seen_at": now}
    for name in ("host", "agent_version"):
        if heartbeat.get(name):
            fields[name] = heartbeat[name]
    return fields


def _known_node_keep_heartbeat(owner_id: int, heartbeat: dict[str, Any], now: Any) -> Workload | None:
    """On PostgreSQL, store ``heartbeat`` as the latest of a node heard from before and read its workload, in one
    statement (``UPDATE node … FROM workload … RETURNING`` the workload's row as it was; only the node's row is
    locked); None when there is no such node yet, or on SQLite (whose RETURNING cannot name the FROM table)."""
    if connection.vendor != "postgresql":
        return None
    fields = _heartbeat_fields(heartbeat, now)
    assignments = ", ".join(f"{rows.column(Node, name)} = %s" for name in fields)
    sql = (
        f"UPDATE {rows.table(Node)} AS n SET {assignments} FROM {rows.table(Workload)} AS t "  # noqa: S608
        f"WHERE n.{rows.column(Node, 'workload')} = t.{rows.column(Workload, 'id')} "
        f"AND t.{rows.column(Workload, 'owner')} = %s AND t.{rows.column(Workload, 'external_id')} = %s "
        f"AND n.{rows.column(Node, 'name')} = %s RETURNING {rows.columns(Workload, 't')}"
    )
    params = [rows.param(Node, name, value) for name, value in fields.items()]
    with rows.cursor() as cursor:
        cursor.execute(sql, [*params, owner_id, heartbeat["workload_id"], heartbeat["node"]])
        found = cursor.fetchone()
    return None if found is None else rows.row(Workload, found)


def _node_keep_heartbeat(workload: Workload, heartbeat: dict[str, Any], now: Any) -> None:
    """Store ``heartbeat`` as its node's latest: one bare UPDATE for a known node (the node's old heartbeat is
    never read back), the node created (or, raced, updated) by one statement on its first heartbeat."""
    fields = _heartbeat_fields(heartbeat, now)
    assignments = ", ".join(f"{rows.column(Node, name)} = %s" for name in fields)
    sql = (
        f"UPDATE {rows.table(Node)} SET {assignments} "  # noqa: S608 (names from the models)
        f"WHERE {rows.column(Node, 'workload')} = %s AND {rows.column(Node, 'name')} = %s"
    )
    params = [rows.param(Node, name, value) for name, value in fields.items()]
    with rows.cursor() as cursor:
        cursor.execute(sql, [*params, workload.pk, heartbeat["node"]])
        if cursor.rowcount:
            return
    # The node's first heartbeat: one INSERT … ON CONFLICT (a concurrent first heartbeat of the same node makes it
    # an update), not the ORM's SELECT, savepoint, INSERT and UPDATE (about a fifth of the heartbeats' server time
    # in the bench's crowd, whose 50 nodes are new each run). No signal listens to nodes.
    Node.objects.bulk_create(
        [Node(workload=workload, name=heartbeat["node"], **fields)],
        update_conflicts=True,
        unique_fields=["workload", "name"],
        update_fields=[*fields],
    )


def _fresh_heartbeats(workload_id: int, fresh_since: Any) -> dict[str, dict[str, Any]]:
    """``{node name: heartbeat}`` of the workload's nodes heard from since ``fresh_since`` (names and heartbeats
    only: model instances of every node cost more than the rest of the heartbeat)."""
    heartbeat_column = rows.column(Node, "last_heartbeat")
    sql = (
        f"SELECT {rows.column(Node, 'name')}, {heartbeat_column} FROM {rows.table(Node)} "  # noqa: S608
        f"WHERE {rows.column(Node, 'workload')} = %s AND {rows.column(Node, 'last_heartbeat_at')} >= %s "
        f"AND {heartbeat_column} IS NOT NULL"
    )
    with rows.cursor() as cursor:
        cursor.execute(sql, [workload_id, rows.param(Node, "last_heartbeat_at", fresh_since)])
        found = cursor.fetchall()
    convert = rows.converter(Node, "last_heartbeat")
    return {name: _heartbeat_loads(beat, convert) for name, beat in found}


_JSON = msgspec.json.Decoder()


def _heartbeat_loads(raw: Any, convert: Callable[[Any], Any]) -> Any:
    """A stored heartbeat as the JSON field reads it, decoded by msgspec where it can: every heartbeat reads each of
    its job's fresh nodes' heartbeats, and the field's ``json.loads`` costs about twice msgspec's (3.2 against 1.5 µs
    for the bench's heartbeat, 46 against 24 µs for one with eight communicators; 50 nodes: 2.3 against 1.2 ms per
    heartbeat). msgspec reads JSON to the same values (integers beyond 64 bits exactly; orjson would make them
    floats); what it refuses (SQLite's ``NaN``) goes through the field's own decoder."""
    if isinstance(raw, str):
        try:
            return _JSON.decode(raw)
        except msgspec.DecodeError:
            pass
    return convert(raw)


def _workload_keep_live(workload: Workload) -> None:
    """``workload.save(update_fields=[live fields])`` as one bare UPDATE (no model signal listens to workloads)."""
    names = ("live_summary", "status", "first_seen_at", "last_seen_at", "updated_at")
    assignments = ", ".join(f"{rows.column(Workload, name)} = %s" for name in names)
    params = [rows.param(Workload, name, getattr(workload, name)) for name in names]
    with rows.cursor() as cursor:
        cursor.execute(
            f"UPDATE {rows.table(Workload)} SET {assignments} WHERE {rows.column(Workload, 'id')} = %s",  # noqa: S608
            [*params, workload.pk],
        )


def _group_send(*messages: tuple[str, dict[str, Any]]) -> None:
    """Send each (group, message) to its WebSocket group, all in one trip to the event loop; never fails the
    caller (a broken channel layer must not lose data)."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    if layer is None:
        return

    async def send_all() -> None:
        for group, message in messages:
            try:
                await layer.group_send(group, message)
            except Exception:
                logger.exception("could not publish to %s", group)

    try:
        async_to_sync(send_all)()
    except Exception:  # no usable event loop for the layer
        logger.exception("could not publish to %s", ", ".join(group for group, _ in messages))


def publish_status(workload: Workload) -> None:
    """Tell open pages (WebSocket group of the workload, and list pages) its new status."""
    from .consumers import LIST_GROUP, workload_group

    message = {"type": "workload.status", "status": workload.status, "summary": workload.live_summary}
    _group_send((workload_group(workload.pk), message), (LIST_GROUP, {"type": "workloads.changed"}))


class HeartbeatPublisher:
    """Tells open pages of the heartbeats answered on an event loop, coalesced per workload.

    Every heartbeat of a job's nodes recomputes the same workload's status and summary; telling the pages of
    each one cost more server time than storing it (a channel-layer round trip per group, two groups, from a
    thread: a new event loop each time) and had every open list page re-read the list ten times a second for
    a job of 50 nodes. Here a workload's page is told at once when nothing was sent for it in the last
    ``interval_s`` seconds (``COMMINSIGHT_LIVE_PUBLISH_INTERVAL_S``) or when its status changed, else once at
    the end of that interval with the latest status and summary (never older than ``interval_s``); the list
    pages are told the same way, at most once per interval for all workloads. Sends happen on the loop (the
    server's, where the channel layer keeps its connections), one after the other in the order decided.
    State is per event loop (a new loop starts afresh) and per process: with
    several workers each coalesces its own heartbeats."""

    def __init__(self, interval_s: float | None = None) -> None:
        self._interval_s = interval_s
        self._start(None)

    @property
    def interval_s(self) -> float:
        """Seconds; by default ``COMMINSIGHT_LIVE_PUBLISH_INTERVAL_S``."""
        return settings.LIVE_PUBLISH_INTERVAL_S if self._interval_s is None else self._interval_s

    def _start(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._loop = loop
        self._sent: dict[int, tuple[float, str]] = {}  # workload -> (loop time sent, status sent)
        self._pending: dict[int, dict[str, Any]] = {}  # workload -> latest message not yet sent
        self._list_sent = float("-inf")
        self._list_pending = False
        self._sending = asyncio.Lock()  # sends in the order decided (the lock wakes its waiters first come)
        self._flushes: set[asyncio.Task[None]] = set()  # held until done (the loop keeps only weak references)

    async def heartbeat(self, workload_id: int, status: str, summary: Any) -> None:
        """A heartbeat of ``workload_id`` left it with ``status`` and ``summary`` (call on the loop)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._start(loop)  # a new loop: nothing of the old one's holds (its timers are gone)
        now = loop.time()
        self._forget_old(now)
        message = {"type": "workload.status", "status": status, "summary": summary}
        sent = self._sent.get(workload_id)
        changed = sent is None or sent[1] != status
        if changed or now - sent[0] >= self.interval_s:
            self._pending.pop(workload_id, None)
            self._sent[workload_id] = (now, status)
            await self._send(self._workload_messages(workload_id, message, now, urgent=changed))
            return
        if workload_id not in self._pending:
            loop.call_at(sent[0] + self.interval_s, self._flush, workload_id)
        self._pending[workload_id] = message

    def _workload_messages(
        self, workload_id: int, message: dict[str, Any], now: float, *, urgent: bool
    ) -> list[tuple[str, dict[str, Any]]]:
        from .consumers import LIST_GROUP, workload_group

        out = [(workload_group(workload_id), message)]
        if urgent or now - self._list_sent >= self.interval_s:
            self._list_sent, self._list_pending = now, False
            out.append((LIST_GROUP, {"type": "workloads.changed"}))
        elif not self._list_pending:
            self._list_pending = True
            asyncio.get_running_loop().call_at(self._list_sent + self.interval_s, self._flush_list)
        return out

    def _flush(self, workload_id: int) -> None:
        message = self._pending.pop(workload_id, None)
        if message is None:  # sent meanwhile (a status change)
            return
        now = asyncio.get_running_loop().time()
        self._sent[workload_id] = (now, message["status"])
        self._chain(self._workload_messages(workload_id, message, now, urgent=False))

    def _flush_list(self) -> None:
        from .consumers import LIST_GROUP

        if self._list_pending:
            self._list_sent, self._list_pending = asyncio.get_running_loop().time(), False
            self._chain([(LIST_GROUP, {"type": "workloads.changed"})])

    def _chain(self, messages: list[tuple[str, dict[str, Any]]]) -> None:
        task = asyncio.get_running_loop().create_task(self._send(messages))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _send(self, messages: list[tuple[str, dict[str, Any]]]) -> None:
        """Send after whatever was decided before (never fails: a broken channel layer must not lose data)."""
        from channels.layers import get_channel_layer

        layer = get_channel_layer()
        if layer is None:
            return
        async with self._sending:
            for group, message in messages:
                try:
                    await layer.group_send(group, message)
                except Exception:
                    logger.exception("could not publish to %s", group)

    def _forget_old(self, now: float) -> None:
        """Drop what was sent for workloads not heard from for a while (bounded memory on a long-lived server)."""
        if len(self._sent) > 1024:
            horizon = now - max(60.0, 10 * self.interval_s)
            self._sent = {w: s for w, s in self._sent.items() if s[0] >= horizon or w in self._pending}


def publish_workload_changed(workload_id: int) -> None:
    """Tell open pages that a workload changed other than by a heartbeat (archive ingested, analysis done)."""
    from .consumers import LIST_GROUP, workload_group

    _group_send(
        (workload_group(workload_id), {"type": "workload.changed"}), (LIST_GROUP, {"type": "workloads.changed"})
    )


def mark_lost_workloads() -> int:
    """Workloads still marked running or hung whose last heartbeat is older than the limit become lost."""
    cutoff = timezone.now() - timedelta(seconds=settings.WORKLOAD_LOST_AFTER_S)
    return Workload.objects.filter(
        status__in=[WorkloadStatus.RUNNING, WorkloadStatus.HUNG], last_seen_at__lt=cutoff
    ).update(status=WorkloadStatus.LOST)


# --- Root cause across nodes that report separately -------------------------------------------------------

EVIDENCE_NODES_MAX = 4096  # per workload, like a master's slaves


def _evidence_key(workload_id: int, node: str) -> str:
    return f"live-evidence:{workload_id}:{hashlib.sha256(node.encode()).hexdigest()[:32]}"


def _evidence_keep(workload: Workload, node: str, evidence: list[dict[str, Any]]) -> None:
    """Keep a node's latest evidence (as long as a heartbeat counts as fresh) and, while the workload is hung,
    have a worker merge the root cause across nodes once the heartbeat's transaction committed."""
    cache.set(_evidence_key(workload.pk, node), evidence, timeout=settings.WORKLOAD_LOST_AFTER_S)
    if workload.status == WorkloadStatus.HUNG:
        from .tasks import merge_live_root_cause

        workload_id = workload.pk
        transaction.on_commit(lambda: merge_live_root_cause.delay(workload_id), robust=True)


def _node_evidence(name: str, items: Any) -> list[Any]:
    """Parsed evidence of one heartbeat: ``[{"node", "records", "pid_rank"}, ...]``; bad entries skipped."""
    from comminsight.agent.diagnosis import NodeEvidence

    out = []
    for item in items if isinstance(items, list) else []:
        node = item.get("node") if isinstance(item, dict) else None
        try:
            out.append(NodeEvidence.from_json(str(node or name)[:200], item))
        except (ValueError, TypeError) as exc:
            logger.warning("evidence of node %s (from %s) unusable: %s", node, name, exc)
    return out


def live_root_cause_merge(workload_id: int) -> dict[str, Any] | None:
    """Run the chain analysis over the evidence of every fresh node of a hung workload (one answer across
    nodes that report separately); store it in ``live_summary.root_cause`` and tell open pages. Returns it,
    or None when there is nothing to merge (fewer than two nodes sent evidence, or nothing changed)."""
    from comminsight.agent.diagnosis import diagnose

    fresh_since = timezone.now() - timedelta(seconds=settings.WORKLOAD_LOST_AFTER_S)
    names = list(
        Node.objects.filter(workload_id=workload_id, last_heartbeat_at__gte=fresh_since)
        .order_by("name")
        .values_list("name", flat=True)[:EVIDENCE_NODES_MAX]
    )
    stored = cache.get_many([_evidence_key(workload_id, n) for n in names])
    evidence, digest, senders = [], hashlib.sha256(), []
    for name in names:
        items = stored.get(_evidence_key(workload_id, name))
        if not items:
            continue
        parsed = _node_evidence(name, items)
        if parsed:
            senders.append(name)
            evidence.extend(parsed)
            for e in parsed:
                digest.update(e.node.encode() + b"\0" + e.records.tobytes())
    if len(senders) < 2:
        return None  # one node's own diagnosis (in its heartbeat) is already the whole answer
    fingerprint = digest.hexdigest()[:32]
    current = (Workload.objects.filter(pk=workload_id).values_list("live_summary", flat=True).first()) or {}
    if (current.get("root_cause") or {}).get("fingerprint") == fingerprint:
        return None
    result = diagnose(evidence)
    if result is None:
        return None
    root_cause = {
        "ranks": [int(r) for r in result["root_cause_ranks"]],
        "node": None,
        "nodes": senders,
        "first_stuck": result["first_stuck"],
        "summary": str(result["summary"])[:500],
        "merged": True,
        "fingerprint": fingerprint,
    }
    with transaction.atomic():
        workload = Workload.objects.select_for_update().filter(pk=workload_id).first()
        if workload is None or workload.status != WorkloadStatus.HUNG:
            return None
        workload.live_summary = {**(workload.live_summary or {}), "root_cause": root_cause}
        workload.save(update_fields=["live_summary", "updated_at"])
        transaction.on_commit(lambda: publish_status(workload))
    logger.error("workload %s: hang root cause across %d nodes: %s", workload_id, len(senders), root_cause["summary"])
    return root_cause
