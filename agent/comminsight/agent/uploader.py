"""Client of the site's ingest API (upload protocol v1, docs/formats/upload.md; agreed in PROTOCOLS.md).

``SiteProvider.deliver`` uploads one spooled archive resumably: create (or resume) an upload by
sha256, append chunks with ``Upload-Offset`` and a per-chunk sha256, finalize, and succeed only when
the site answers with the archive's own sha256. 429/503 raise ``RetryLater`` with the Retry-After
delay; a 409 re-synchronises the offset; a whole-file mismatch starts over. ``post_live`` sends the
live heartbeat (and hang suspicions) to the site or, from a slave, to the master.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import httpx

from comminsight.agent import AGENT_VERSION
from comminsight.agent.config import AgentConfig
from comminsight.agent.providers import RetryLater, SpoolEntry

log = logging.getLogger("comminsight.agent.uploader")
INGEST = "/api/v1/ingest/"


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After", "")
    try:
        return max(0.0, min(float(value), 3600.0))
    except ValueError:
        return None


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class UploadRejected(Exception):
    """The site refused the archive for a reason retrying the same bytes would not fix soon."""


class SiteProvider:
    """Resumable archive upload to ``<COMMINSIGHT_AGENT_SERVER_URL>/api/v1/ingest/``."""

    name = "site"

    def __init__(self, config: AgentConfig, client: httpx.Client | None = None) -> None:
        self.config = config
        self.base = config.server_url + INGEST
        headers = {"User-Agent": f"comminsight-agent/{AGENT_VERSION}"}
        if config.token:
            headers["Authorization"] = f"Bearer {config.token}"
        self.client = client or httpx.Client(timeout=config.upload_timeout, headers=headers)

    def _check_transient(self, response: httpx.Response, what: str) -> None:
        if response.status_code in (429, 503):
            raise RetryLater(f"{what}: site busy ({response.status_code})", _retry_after(response))
        if response.status_code >= 500:
            raise RetryLater(f"{what}: site error {response.status_code}")
        if response.status_code in (401, 403):
            raise RetryLater(f"{what}: site refused the agent token ({response.status_code})")

    def _complete(self, entry: SpoolEntry, body: dict[str, Any]) -> bool:
        if body.get("status") == "complete":
            if body.get("sha256") != entry.sha256:
                raise RetryLater(f"site confirmed sha256 {body.get('sha256')!r}, expected {entry.sha256}")
            return True
        return False

    def deliver(self, entry: SpoolEntry) -> None:
        try:
            self._deliver(entry)
        except httpx.HTTPError as exc:
            raise RetryLater(f"upload of {entry.name}: {type(exc).__name__}: {exc}") from exc

    def _deliver(self, entry: SpoolEntry) -> None:
        create = self.client.post(
            self.base + "uploads/",
            json={
                "sha256": entry.sha256,
                "size": entry.size,
                "filename": entry.name,
                "workload_id": entry.workload_id,
                "node": entry.node,
            },
        )
        self._check_transient(create, "create upload")
        if create.status_code not in (200, 201):
            raise RetryLater(f"create upload: unexpected status {create.status_code}: {create.text[:200]}")
        body = _json(create)
        if self._complete(entry, body):
            return
        upload_id = str(body.get("upload_id", ""))
        if not upload_id or "/" in upload_id or ".." in upload_id:
            raise RetryLater(f"create upload: site returned no usable upload_id ({body!r:.200})")
        offset = int(body.get("offset", 0))
        max_chunk = int(body.get("max_chunk") or self.config.upload_chunk_bytes)
        chunk = max(1, min(self.config.upload_chunk_bytes, max_chunk))
        url = f"{self.base}uploads/{upload_id}/"
        entry.extra["upload_id"] = upload_id
        with open(entry.path, "rb") as handle:
            while offset < entry.size:
                handle.seek(offset)
                data = handle.read(chunk)
                response = self.client.patch(
                    url,
                    content=data,
                    headers={
                        "Content-Type": "application/offset+octet-stream",
                        "Upload-Offset": str(offset),
                        "Upload-Checksum": f"sha256 {hashlib.sha256(data).hexdigest()}",
                    },
                )
                self._check_transient(response, "append chunk")
                if response.status_code == 204:
                    offset = int(response.headers.get("Upload-Offset", offset + len(data)))
                elif response.status_code == 409:
                    offset = int(_json(response).get("offset", offset))  # the site's offset wins
                    log.info("%s: resuming at the site's offset %d", entry.name, offset)
                elif response.status_code == 413 and chunk > 1:
                    chunk = max(1, chunk // 2)
                elif response.status_code == 404:
                    raise RetryLater(f"upload {upload_id} vanished on the site; starting over")
                else:
                    raise RetryLater(f"append chunk: unexpected status {response.status_code}: {response.text[:200]}")
        final = self.client.post(url + "finalize/")
        self._check_transient(final, "finalize")
        if final.status_code in (200, 201) and self._complete(entry, _json(final)):
            entry.extra.pop("upload_id", None)
            return
        raise RetryLater(f"finalize: status {final.status_code}: {final.text[:200]}")


class LiveReporter:
    """Posts live heartbeats: a master to the site's ``live/``, a slave to its master's cluster endpoint."""

    def __init__(self, config: AgentConfig, client: httpx.Client | None = None) -> None:
        self.config = config
        headers = {"User-Agent": f"comminsight-agent/{AGENT_VERSION}"}
        if config.token:
            headers["Authorization"] = f"Bearer {config.token}"
        self.client = client or httpx.Client(timeout=min(config.upload_timeout, 10.0), headers=headers)
        self.failures = 0
        # The workload's status as the site last answered it: a node that sees nothing wrong itself still
        # sends its diagnosis evidence while the site says the job is hung (the site merges the nodes).
        self.site_status = ""

    @property
    def target(self) -> str:
        if self.config.mode == "slave":
            return self.config.master_url + "/api/v1/cluster/report"
        if self.config.server_url:
            return self.config.server_url + INGEST + "live/"
        return ""

    def post(self, payload: dict[str, Any]) -> bool:
        if not self.target:
            return False
        try:
            response = self.client.post(self.target, json=payload)
        except httpx.HTTPError as exc:
            self.failures += 1
            log.warning("live report to %s failed: %s", self.target, exc)
            return False
        if response.status_code >= 300:
            self.failures += 1
            log.warning("live report to %s answered %d", self.target, response.status_code)
            return False
        if self.config.mode != "slave":
            try:
                answer = response.json()
            except ValueError:
                answer = None
            self.site_status = str(answer.get("status", "")) if isinstance(answer, dict) else ""
        return True
