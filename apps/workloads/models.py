"""Workloads (one training job) and who may see them."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class WorkloadStatus(models.TextChoices):
    UNKNOWN = "unknown", "No live data"
    RUNNING = "running", "Running"
    HUNG = "hung", "Hung"
    FINISHED = "finished", "Finished"
    LOST = "lost", "Lost"


class Workload(models.Model):
    """One distributed training job, identified by its external workload id (identical on every node)."""

    name = models.CharField(max_length=200)
    external_id = models.CharField(max_length=200)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="workloads")
    status = models.CharField(max_length=16, choices=WorkloadStatus.choices, default=WorkloadStatus.UNKNOWN)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    first_seen_at = models.DateTimeField(null=True, blank=True)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    # Cross-node live view from the latest heartbeats: lagging ranks per communicator (see services.live_*).
    live_summary = models.JSONField(null=True, blank=True)
    first_ns = models.BigIntegerField(null=True, blank=True)
    last_ns = models.BigIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-updated_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["owner", "external_id"], name="workloads_external_id_per_owner"),
        ]

    def __str__(self) -> str:
        return self.name


class ShareLevel(models.TextChoices):
    READ = "read", "Read"
    MANAGE = "manage", "Manage"


class WorkloadShare(models.Model):
    """A workload shared with one user: ``read`` sees it; ``manage`` may also share, unshare and delete it."""

    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="shares")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="workload_shares")
    level = models.CharField(max_length=8, choices=ShareLevel.choices, default=ShareLevel.READ)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["workload", "user"], name="workloads_one_share_per_user")]

    def __str__(self) -> str:
        return f"{self.workload} shared with {self.user} ({self.level})"


# --- What ingest learns about a workload ------------------------------------------------------------------------


class Node(models.Model):
    """One machine of a workload (``node`` in the archive manifest: NODE_IP/HOST_IP or the host name)."""

    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="nodes")
    name = models.CharField(max_length=200)
    host = models.CharField(max_length=200, blank=True, default="")
    node_ip = models.CharField(max_length=64, blank=True, default="")
    first_seen_at = models.DateTimeField(auto_now_add=True)
    last_seen_at = models.DateTimeField(auto_now=True)
    # Latest live heartbeat from this node's agent (the whole JSON body, bounded by the endpoint).
    agent_version = models.CharField(max_length=64, blank=True, default="")
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    last_heartbeat = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["workload", "name"], name="workloads_node_per_workload")]

    def __str__(self) -> str:
        return self.name


class Rank(models.Model):
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="ranks")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="ranks")
    rank = models.IntegerField()

    class Meta:
        ordering = ["rank"]
        constraints = [models.UniqueConstraint(fields=["workload", "rank"], name="workloads_rank_per_workload")]

    def __str__(self) -> str:
        return f"rank {self.rank}"


class Communicator(models.Model):
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="communicators")
    comm_hash = models.CharField(max_length=18)
    comm_name = models.CharField(max_length=200, blank=True, default="")
    nranks = models.IntegerField(default=0)
    ranks = models.JSONField(default=list)  # global ranks seen as members, sorted
    # What the evidence says about membership, for the process-group join (comminsight.evidence.process_groups).
    positions = models.JSONField(default=dict)  # {"<global rank>": rank in the communicator}
    first_ns = models.BigIntegerField(null=True, blank=True)  # first operation seen on it
    # The join's result: the PyTorch process group this communicator belongs to.
    group_name = models.CharField(max_length=200, blank=True, default="")
    group_desc = models.CharField(max_length=200, blank=True, default="")  # e.g. TENSOR_MODEL_PARALLEL_GROUP
    member_ranks = models.JSONField(default=list)  # the group's global ranks, in group-rank order
    name_source = models.CharField(max_length=32, blank=True, default="")  # comm_name, process_groups, p2p, ...
    name_note = models.CharField(max_length=300, blank=True, default="")  # e.g. ambiguous, paired by creation order

    class Meta:
        ordering = ["comm_hash"]
        constraints = [
            models.UniqueConstraint(fields=["workload", "comm_hash"], name="workloads_communicator_per_workload")
        ]

    def __str__(self) -> str:
        return self.display_name

    @property
    def display_name(self) -> str:
        """The group's description (and name) when the join found it, else NCCL's commName, else the hash."""
        if self.group_desc:
            return f"{self.group_desc} ({self.group_name})" if self.group_name else self.group_desc
        return self.comm_name or self.comm_hash


class ArchiveState(models.TextChoices):
    STORED = "stored", "Stored, waiting for ingest"
    INGESTED = "ingested", "Ingested"
    QUARANTINED = "quarantined", "Quarantined"


class ArchiveSource(models.TextChoices):
    UPLOAD = "upload", "Uploaded by an agent"
    DISCOVERY = "discovery", "Found in the archive path"


class Archive(models.Model):
    """One owner's archive, identified by the sha256 of its bytes. The bytes are stored once whoever sends them
    (``path`` is shared); each owner who sent them has a row of its own, ingested into that owner's workload."""

    sha256 = models.CharField(max_length=64, db_index=True)
    size = models.BigIntegerField()
    filename = models.CharField(max_length=255)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="archives")
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, null=True, blank=True, related_name="archives")
    source = models.CharField(max_length=16, choices=ArchiveSource.choices, default=ArchiveSource.UPLOAD)
    path = models.CharField(max_length=1024)  # where the bytes are: under the data dir, or the discovered file
    state = models.CharField(max_length=16, choices=ArchiveState.choices, default=ArchiveState.STORED)
    reason = models.TextField(blank=True, default="")  # why it was quarantined, shown to its owner
    node = models.CharField(max_length=200, blank=True, default="")
    record_count = models.BigIntegerField(default=0)
    first_ns = models.BigIntegerField(null=True, blank=True)
    last_ns = models.BigIntegerField(null=True, blank=True)
    file_mtime = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    ingested_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)  # ingest attempts begun, counted in a committed transaction
    # The ingest lease (apps.workloads.ingest): which attempt holds the archive and until when. A worker that
    # dies leaves a lease that expires; the periodic requeue then hands the archive to a live worker. With no
    # owner, ``lease_until`` is the earliest time the requeue tries a failed archive again.
    lease_owner = models.CharField(max_length=32, blank=True, default="")
    lease_until = models.DateTimeField(null=True, blank=True)
    # The last administrator who put a quarantined (or cancelled) archive back in the ingest queue, and when.
    requeued_by = models.CharField(max_length=150, blank=True, default="")
    requeued_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [models.UniqueConstraint(fields=["owner", "sha256"], name="workloads_archive_once_per_owner")]

    def __str__(self) -> str:
        return self.filename


class UploadState(models.TextChoices):
    OPEN = "open", "Open"
    COMPLETE = "complete", "Complete"


class Upload(models.Model):
    """A resumable upload in progress (docs/formats/upload.md); its bytes are in ``<data dir>/uploads/<id>.part``."""

    id = models.UUIDField(primary_key=True)
    token = models.ForeignKey("accounts.AgentToken", on_delete=models.CASCADE, related_name="uploads")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="uploads")
    sha256 = models.CharField(max_length=64)
    size = models.BigIntegerField()
    offset = models.BigIntegerField(default=0)
    filename = models.CharField(max_length=255)
    workload_external_id = models.CharField(max_length=200, blank=True, default="")
    node = models.CharField(max_length=200, blank=True, default="")
    state = models.CharField(max_length=16, choices=UploadState.choices, default=UploadState.OPEN)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            # Two racing creates by one token for one archive end with one open upload.
            models.UniqueConstraint(
                fields=["token", "sha256"], condition=models.Q(state="open"), name="workloads_one_open_upload"
            )
        ]

    def __str__(self) -> str:
        return f"upload {self.id} ({self.offset}/{self.size})"


class SystemSettings(models.Model):
    """Site-wide settings root and administrators change in a page (a single row, id=1)."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    archive_path = models.CharField(
        max_length=1024,
        blank=True,
        default="",
        help_text="the shared mount; the site scans <path>/comminsight/02_archives",
    )
    discovery_owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    # Shared concurrency: at most this many analysis jobs run at once across every worker (0: no limit).
    # Enforced in the database (a row lock on this row), so it holds for any number of worker hosts.
    max_running_analyses = models.PositiveIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return "system settings"

    @classmethod
    def load(cls) -> SystemSettings:
        return cls.objects.get_or_create(id=1)[0]
