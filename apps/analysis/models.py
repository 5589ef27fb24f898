"""Analysis jobs (one analysis of one workload's columnar store) and per-workload Step calibration.

Re-run semantics: a job is identified by (workload, kind, parameters). Asking again for the same
analysis returns the existing job: while it is queued or running nothing new is queued; when it is
done and the workload's store has not changed since (``store_fingerprint``), nothing is queued either.
A failed job, a store that changed, or an explicit ``force`` queues the same row again (its result is
replaced when the new run finishes). The task itself is idempotent: a done job is left alone unless
the task is told to force, and a re-delivered running job (a worker died) simply runs again.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from apps.workloads.models import Workload


class AnalysisKind(models.TextChoices):
    HANG = "hang", "Hang / failure"
    STEPS = "steps", "Steps"
    STRAGGLERS = "stragglers", "Stragglers"
    PERF = "perf", "Communication performance"


class JobState(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"


class AnalysisJob(models.Model):
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="analysis_jobs")
    kind = models.CharField(max_length=16, choices=AnalysisKind.choices)
    # Normalised (validated, defaults filled) parameters and their canonical JSON, the identity key.
    parameters = models.JSONField(default=dict)
    parameters_key = models.CharField(max_length=512)
    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.QUEUED)
    progress = models.PositiveSmallIntegerField(default=0)  # 0-100
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    # What the store held when the result was computed (files, bytes, newest mtime): a changed store re-runs.
    store_fingerprint = models.CharField(max_length=64, blank=True, default="")
    attempts = models.PositiveIntegerField(default=0)
    # A partitioned run (apps.analysis.partitions): its map tasks, and how many of them have finished.
    partitions = models.PositiveIntegerField(default=0)
    partitions_done = models.PositiveIntegerField(default=0)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="analysis_jobs"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["workload", "kind", "parameters_key"], name="analysis_one_job_per_request")
        ]

    def __str__(self) -> str:
        return f"{self.get_kind_display()} of {self.workload} ({self.state})"

    @property
    def finished(self) -> bool:
        return self.state in (JobState.DONE, JobState.FAILED)


class StepCalibration(models.Model):
    """The user's mapping of recovered step ``recovered`` onto framework step ``framework`` for one workload.

    Applied when step results are rendered (framework = recovered + offset); results stay uncalibrated.
    """

    workload = models.OneToOneField(Workload, on_delete=models.CASCADE, related_name="step_calibration")
    recovered = models.BigIntegerField()
    framework = models.BigIntegerField()
    set_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"step {self.recovered} is framework step {self.framework}"

    @property
    def offset(self) -> int:
        return self.framework - self.recovered
