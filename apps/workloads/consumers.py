"""WebSockets: live status of one workload (``ws/workloads/<id>/``) and "the list changed" (``ws/workloads/``).

Visibility comes from ``workloads_visible_to`` like every page: a workload the user may not see (or an
anonymous socket) is closed with code 4404, indistinguishable from one that does not exist.
``live.live_record_heartbeat`` publishes to the group after its transaction commits.
"""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from .selectors import workloads_visible_to

NOT_FOUND = 4404


LIST_GROUP = "workloads"


def workload_group(workload_id: int) -> str:
    return f"workload-{workload_id}"


@database_sync_to_async
def _visible_status(user: object, workload_id: int) -> str | None:
    workload = workloads_visible_to(user).filter(pk=workload_id).first()
    return workload.status if workload else None


class WorkloadStatusConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        self.workload_id = int(self.scope["url_route"]["kwargs"]["workload_id"])
        status = await _visible_status(self.scope.get("user"), self.workload_id)
        if status is None:
            await self.close(code=NOT_FOUND)
            return
        await self.channel_layer.group_add(workload_group(self.workload_id), self.channel_name)
        await self.accept()
        await self.send_json({"type": "status", "status": status})

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(workload_group(self.workload_id), self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """Clients only listen; anything they send is ignored."""

    async def workload_status(self, event: dict[str, Any]) -> None:
        await self.send_json({"type": "status", "status": event["status"], "summary": event.get("summary")})

    async def workload_changed(self, event: dict[str, Any]) -> None:
        """Something of this workload changed (an archive ingested, an analysis finished): pages re-read it."""
        await self.send_json({"type": "changed"})


class WorkloadListConsumer(AsyncJsonWebsocketConsumer):
    """Tells signed-in list pages that some workload changed; the page re-reads the list through the same
    visibility rule as every page. The message names no workload, so nobody learns of one they cannot see."""

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=NOT_FOUND)
            return
        await self.channel_layer.group_add(LIST_GROUP, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(LIST_GROUP, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """Clients only listen."""

    async def workloads_changed(self, event: dict[str, Any]) -> None:
        await self.send_json({"type": "changed"})
