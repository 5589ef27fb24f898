"""WebSocket: new points of one workload (``ws/monitoring/workloads/<id>/``), so open dashboards refresh.

Visibility comes from ``workloads_visible_to`` like every page: a workload the user may not see (or an
anonymous socket) is closed with code 4404. Messages name the metrics that got points; the page fetches
its charts again from the API (downsampled there), so a socket never carries raw points.
"""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from apps.workloads.selectors import workloads_visible_to

from .services import monitoring_group

NOT_FOUND = 4404


@database_sync_to_async
def _visible(user: object, workload_id: int) -> bool:
    return workloads_visible_to(user).filter(pk=workload_id).exists()


class MonitoringConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        self.group = monitoring_group(int(self.scope["url_route"]["kwargs"]["workload_id"]))
        if not await _visible(self.scope.get("user"), int(self.scope["url_route"]["kwargs"]["workload_id"])):
            self.group = ""
            await self.close(code=NOT_FOUND)
            return
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        if self.group:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """Clients only listen; anything they send is ignored."""

    async def monitoring_points(self, event: dict[str, Any]) -> None:
        await self.send_json({"type": "points", "metrics": event.get("metrics") or []})
