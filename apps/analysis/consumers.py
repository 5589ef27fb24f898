"""WebSocket: live progress of a workload's analysis jobs (``ws/workloads/<id>/analyses/``).

Visibility comes from ``workloads_visible_to``, like every page: a hidden workload (or an anonymous socket) is
closed with 4404. On connect the socket gets every job of the workload once, then one message per change
(``services.publish_job``): ``{"type": "job", "id", "kind", "state", "progress", "error"}``.
"""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from apps.workloads.consumers import NOT_FOUND
from apps.workloads.selectors import workloads_visible_to

from .models import AnalysisJob
from .services import analysis_group, job_message


@database_sync_to_async
def _visible_jobs(user: object, workload_id: int) -> list[dict[str, Any]] | None:
    if not workloads_visible_to(user).filter(pk=workload_id).exists():
        return None
    return [job_message(job) for job in AnalysisJob.objects.filter(workload_id=workload_id)[:200]]


class AnalysisProgressConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        self.workload_id = int(self.scope["url_route"]["kwargs"]["workload_id"])
        self.joined = False
        jobs = await _visible_jobs(self.scope.get("user"), self.workload_id)
        if jobs is None:
            await self.close(code=NOT_FOUND)
            return
        await self.channel_layer.group_add(analysis_group(self.workload_id), self.channel_name)
        self.joined = True
        await self.accept()
        for job in jobs:
            await self.send_json(job)

    async def disconnect(self, code: int) -> None:
        if self.joined:
            await self.channel_layer.group_discard(analysis_group(self.workload_id), self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """Clients only listen; anything they send is ignored."""

    async def analysis_job(self, event: dict[str, Any]) -> None:
        await self.send_json(event["job"])
