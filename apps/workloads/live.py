"""Live state from agent heartbeats: the latest per node, and the workload's status across nodes.

Status rules (documented in docs/formats/upload.md):
- ``finished``: every node heard from recently said ``finished``;
- ``hung``: some node reports hang suspicion; the workload's ``live_summary`` names the lagging ranks
  across all nodes — per communicator, the ranks reported lagging by the nodes at the lowest
  ``last_completed_seq`` (those that stopped first);
- ``running``: otherwise;
- ``lost``: no heartbeat for ``COMMINSIGHT_WORKLOAD_LOST_AFTER_S`` (set by the periodic task).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.accounts.models import AgentToken

from .models import Node, Workload, WorkloadStatus

logger = logging.getLogger(__name__)


def live_summary(heartbeats: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Cross-node view of the latest heartbeat per node (``{node name: heartbeat}``)."""
    per_comm: dict[str, list[tuple[int, list[int], str]]] = {}
    hung_nodes = []
    for node, beat in sorted(heartbeats.items()):
        if beat.get("hang"):
            hung_nodes.append(node)
        for comm in beat.get("communicators") or []:
            per_comm.setdefault(comm["comm_hash"], []).append(
                (int(comm.get("last_completed_seq", 0)), list(comm.get("lagging_ranks") or []), node)
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
    return {
        "nodes": len(heartbeats),
        "hung_nodes": hung_nodes,
        "lagging_ranks": sorted(lagging_all),
        "communicators": communicators,
    }


def _status(heartbeats: dict[str, dict[str, Any]], summary: dict[str, Any]) -> str:
    if heartbeats and all(beat.get("finished") for beat in heartbeats.values()):
        return WorkloadStatus.FINISHED
    if summary["hung_nodes"]:
        return WorkloadStatus.HUNG
    return WorkloadStatus.RUNNING


def live_record_heartbeat(*, token: AgentToken, heartbeat: dict[str, Any]) -> Workload:
    """Keep ``heartbeat`` as its node's latest and recompute the workload's status. ``heartbeat`` is validated."""
    now = timezone.now()
    fresh_since = now - timedelta(seconds=settings.WORKLOAD_LOST_AFTER_S)
    with transaction.atomic():
        workload, _ = Workload.objects.get_or_create(
            owner=token.owner,
            external_id=heartbeat["workload_id"],
            defaults={"name": heartbeat["workload_id"], "first_seen_at": now},
        )
        # No row lock on the workload: 50 nodes' heartbeats would queue behind it. Each heartbeat sees its
        # own node's latest and every committed other; a concurrent one is counted at the next beat.
        node, _ = Node.objects.get_or_create(workload=workload, name=heartbeat["node"])
        node.host = heartbeat.get("host") or node.host
        node.agent_version = heartbeat.get("agent_version") or node.agent_version
        node.last_heartbeat = heartbeat
        node.last_heartbeat_at = now
        node.save(update_fields=["host", "agent_version", "last_heartbeat", "last_heartbeat_at", "last_seen_at"])
        latest = {
            n.name: n.last_heartbeat
            for n in workload.nodes.filter(last_heartbeat_at__gte=fresh_since).exclude(last_heartbeat=None)
        }
        summary = live_summary(latest)
        workload.live_summary = summary
        workload.status = _status(latest, summary)
        workload.first_seen_at = workload.first_seen_at or now
        workload.last_seen_at = now
        # Only the live fields: ingest updates the time range of the same row concurrently.
        workload.save(update_fields=["live_summary", "status", "first_seen_at", "last_seen_at", "updated_at"])
        transaction.on_commit(lambda: publish_status(workload))
    return workload


def publish_status(workload: Workload) -> None:
    """Tell open pages (WebSocket group of the workload) its new status; never fails the caller."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    from .consumers import workload_group

    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(
            workload_group(workload.pk),
            {"type": "workload.status", "status": workload.status, "summary": workload.live_summary},
        )
    except Exception:  # a broken channel layer must not lose the heartbeat
        logger.exception("could not publish the status of workload %s", workload.pk)


def mark_lost_workloads() -> int:
    """Workloads still marked running or hung whose last heartbeat is older than the limit become lost."""
    cutoff = timezone.now() - timedelta(seconds=settings.WORKLOAD_LOST_AFTER_S)
    return Workload.objects.filter(
        status__in=[WorkloadStatus.RUNNING, WorkloadStatus.HUNG], last_seen_at__lt=cutoff
    ).update(status=WorkloadStatus.LOST)
