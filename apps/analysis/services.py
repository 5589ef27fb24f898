"""State changes of the analysis app: request a job, run it, publish its progress, Step calibration, trace export.

The analyses themselves are pure functions of the ``comminsight`` library; this module loads a
workload's Parquet store (pyarrow.dataset, whole columns), calls one of them and stores its JSON
report. Re-run semantics are described in ``models``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import IntegrityError, InterfaceError, OperationalError, transaction
from django.utils import timezone

from apps.accounts.models import User
from apps.workloads.ingest import workload_metadata_dir, workload_parquet_files, workload_table_files
from apps.workloads.live import publish_workload_changed
from apps.workloads.models import SystemSettings, Workload
from apps.workloads.names import operations_named
from apps.workloads.selectors import workload_can_manage
from comminsight.evidence.schema import empty_table
from comminsight.formats.operations import ROWS_SCHEMA, finish
from comminsight_site.objectstore import object_store

from . import partitions
from .models import AnalysisJob, AnalysisKind, JobState, StepCalibration

logger = logging.getLogger(__name__)

# Infrastructure trouble worth retrying (the task's autoretry list); anything else fails the job with its reason.
RETRYABLE = (OperationalError, InterfaceError, OSError)
MAX_ERROR_CHARS = 2000


class AnalysisParameterError(ValueError):
    """Parameters that cannot be used; ``errors`` maps each field to what is wrong with it."""

    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


class AnalysisPermissionDenied(PermissionError):
    pass


# --- Parameters ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Number:
    default: float
    low: float
    high: float
    help: str

    def parse(self, value: Any) -> float:
        if isinstance(value, bool):
            raise ValueError("must be a number")
        if isinstance(value, str) and len(value) <= 32:
            try:
                value = float(value)
            except ValueError:
                raise ValueError("must be a number") from None
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError("must be a finite number")
        if not self.low <= value <= self.high:
            raise ValueError(f"must be between {self.low:g} and {self.high:g}")
        return float(value)


@dataclass(frozen=True)
class Flag:
    default: bool
    help: str

    def parse(self, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        # HTML forms send strings; accept the usual spellings and nothing else.
        if isinstance(value, str) and value.lower() in ("true", "1", "on", "yes", "false", "0", "off", "no"):
            return value.lower() in ("true", "1", "on", "yes")
        raise ValueError("must be true or false")


PARAMETERS: dict[str, dict[str, Number | Flag]] = {
    AnalysisKind.HANG: {
        "silence_s": Number(60.0, 0.001, 7 * 86400, "a rank silent this long before the last event stopped reporting"),
    },
    AnalysisKind.STEPS: {
        "period_only": Flag(False, "skip the layout templates; use period detection"),
        "ignore_labels": Flag(False, "do not compare with the input's step labels"),
    },
    AnalysisKind.STRAGGLERS: {
        "min_gain": Number(0.005, 0.0, 1.0, "resolution: no culprit saving less than this share of the step"),
        "ignore_labels": Flag(False, "use recovered steps even when labels exist"),
    },
    AnalysisKind.PERF: {
        "slow_fraction": Number(0.5, 0.01, 1.0, "flag below this share of the best observed bus bandwidth"),
    },
}


def analysis_parameters(kind: Any, params: Any) -> dict[str, Any]:
    """Validate ``params`` for ``kind``; return them with defaults filled. Raises AnalysisParameterError."""
    if not isinstance(kind, str) or kind not in AnalysisKind.values:
        raise AnalysisParameterError({"kind": f"must be one of {', '.join(AnalysisKind.values)}"})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise AnalysisParameterError({"parameters": "must be an object"})
    spec = PARAMETERS[kind]
    errors: dict[str, str] = {}
    unknown = [str(k)[:40] for k in params if k not in spec]
    if unknown:
        errors["parameters"] = f"unknown for {kind}: {', '.join(sorted(unknown)[:10])}"
    clean: dict[str, Any] = {}
    for name, field in spec.items():
        if name not in params or params[name] is None:
            clean[name] = field.default
            continue
        try:
            clean[name] = field.parse(params[name])
        except ValueError as exc:
            errors[name] = str(exc)
    if errors:
        raise AnalysisParameterError(errors)
    return clean


def _parameters_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


# --- The store -------------------------------------------------------------------------------------------------


def store_fingerprint(files: list[str]) -> str:
    """Identity of what the store holds now (names, sizes, modification times): changes when ingest adds data."""
    digest = hashlib.sha256()
    for location, size, mtime_ns in object_store().infos(files):
        digest.update(f"{location}\0{size}\0{mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def load_operations(files: list[str]) -> pa.Table:
    """The workload's operations table: every Parquet object of its store read as one dataset (whole columns).

    Archive ingest stores the record decoder's first-step rows; its second step (P2P peers to global
    ranks, canonical order) runs here over the whole workload, exactly as the CLI runs it over a home.
    """
    if not files:
        return empty_table()
    return finish(object_store().dataset(files, schema=ROWS_SCHEMA).to_table())


# --- Requesting and running ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AnalysisRequestOutcome:
    job: AnalysisJob
    created: bool  # a new job row
    queued: bool  # a run was queued (False: the existing job answers the request as it is)


def analysis_request(
    workload: Workload, kind: str, user: User | None, params: Any = None, force: bool = False
) -> AnalysisRequestOutcome:
    """Ask for an analysis of ``workload`` (already checked visible to ``user``); queue it when needed.

    Raises AnalysisParameterError for bad ``kind``/``params``, before anything is written.
    """
    clean = analysis_parameters(kind, params)
    key = _parameters_key(clean)
    fingerprint = store_fingerprint(workload_parquet_files(workload) + workload_table_files(workload))
    try:
        job, created, queued = _claim(workload, kind, clean, key, fingerprint, user, force)
    except IntegrityError:  # a concurrent request created the row first: now it exists
        job, created, queued = _claim(workload, kind, clean, key, fingerprint, user, force)
    if queued:
        job_id = job.pk
        # After commit, in this order: pages hear "queued" before an (eager) run publishes its own progress.
        transaction.on_commit(lambda: publish_job(job))
        transaction.on_commit(lambda: _enqueue(job_id))
    return AnalysisRequestOutcome(job=job, created=created, queued=queued)


@transaction.atomic
def _claim(
    workload: Workload,
    kind: str,
    clean: dict[str, Any],
    key: str,
    fingerprint: str,
    user: User | None,
    force: bool,
) -> tuple[AnalysisJob, bool, bool]:
    """Find or create the job row (locked) and decide whether it must run: (job, created, queued)."""
    job = AnalysisJob.objects.select_for_update().filter(workload=workload, kind=kind, parameters_key=key).first()
    if job is None:
        job = AnalysisJob.objects.create(
            workload=workload, kind=kind, parameters=clean, parameters_key=key, created_by=user
        )
        return job, True, True
    busy = job.state in (JobState.QUEUED, JobState.RUNNING)
    current = job.state == JobState.DONE and job.store_fingerprint == fingerprint and not force
    if busy or current:
        return job, False, False
    job.state, job.progress, job.error = JobState.QUEUED, 0, ""
    # "Requested by" stays who asked for this analysis first: a re-run (by anyone who can see the workload,
    # read shares included) refreshes the result, it does not take the request over.
    job.created_by = job.created_by or user
    job.save(update_fields=["state", "progress", "error", "created_by", "updated_at"])
    return job, False, True


def _enqueue(job_id: int) -> None:
    from .tasks import run_analysis

    run_analysis.delay(job_id)


def _progress(job: AnalysisJob, percent: int) -> None:
    job.progress = percent
    job.save(update_fields=["progress", "updated_at"])
    publish_job(job)


def _run_hang(table: pa.Table, p: dict[str, Any]) -> dict[str, Any]:
    from comminsight.analysis.hang import analyze_hang

    return analyze_hang(table, silence_s=p["silence_s"])


def _frame(table: pa.Table) -> pl.DataFrame:
    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    if df.height == 0:
        raise ValueError(partitions.NO_OPERATIONS)
    return df


def _run_steps(table: pa.Table, p: dict[str, Any]) -> dict[str, Any]:
    from comminsight.semantic import recover_steps

    df = _frame(table)
    if p["ignore_labels"]:
        df = df.with_columns(step=pl.lit(None, dtype=pl.Int64))
    # Results stay uncalibrated: the workload's calibration is applied when they are shown.
    return partitions.steps_document(recover_steps(df, use_templates=not p["period_only"], compute_waits=True))


def _run_stragglers(table: pa.Table, p: dict[str, Any]) -> dict[str, Any]:
    from comminsight.analysis.stragglers import analyse_stragglers

    return analyse_stragglers(_frame(table), use_labels=not p["ignore_labels"], min_gain=p["min_gain"]).to_dict()


def _run_perf(table: pa.Table, p: dict[str, Any]) -> dict[str, Any]:
    from comminsight.analysis.perf import analyse_perf

    return analyse_perf(_frame(table), slow_fraction=p["slow_fraction"])


RUNNERS: dict[str, Callable[[pa.Table, dict[str, Any]], dict[str, Any]]] = {
    AnalysisKind.HANG: _run_hang,
    AnalysisKind.STEPS: _run_steps,
    AnalysisKind.STRAGGLERS: _run_stragglers,
    AnalysisKind.PERF: _run_perf,
}


def json_safe(value: Any) -> Any:
    """The report as plain JSON: numpy scalars to Python, NaN/inf to null (PostgreSQL's jsonb refuses them)."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "item"):  # numpy scalar
        return json_safe(value.item())
    if hasattr(value, "tolist"):  # numpy array
        return json_safe(value.tolist())
    return str(value)


DEFERRED = "deferred"


def _concurrency_slot_free(job: AnalysisJob) -> bool:
    """Whether ``job`` may start under the site-wide limit on running analyses (System Settings).

    Called inside the transaction that marks the job running. Every worker locks the one settings row first,
    so on PostgreSQL the count-then-start is serialised across processes and hosts; the lock ends with the
    transaction, once this job is marked running and counted by the next worker.
    """
    row = SystemSettings.objects.select_for_update().filter(pk=1).first()
    limit = row.max_running_analyses if row else 0
    if not limit:
        return True
    running = AnalysisJob.objects.filter(state=JobState.RUNNING).exclude(pk=job.pk).count()
    return running < limit


def analysis_run(job_id: int, force: bool = False, enforce_limit: bool = True) -> str:
    """Run one job (what the Celery task calls); return its final state, or 'missing'.

    Idempotent: a done job is left alone unless ``force``. Infrastructure errors (RETRYABLE) propagate so
    the task retries; an analysis that cannot run on this data fails the job with the reason.
    """
    with transaction.atomic():
        job = AnalysisJob.objects.select_for_update().select_related("workload").filter(pk=job_id).first()
        if job is None:
            return "missing"
        if job.state == JobState.DONE and not force:
            return job.state
        if job.state == JobState.FAILED and job.error.startswith(CANCELLED):
            return job.state  # cancelled while it waited in the queue
        if enforce_limit and not _concurrency_slot_free(job):
            return DEFERRED  # the task asks again shortly
        job.state, job.progress, job.error = JobState.RUNNING, 5, ""
        job.attempts += 1
        job.started_at, job.finished_at = timezone.now(), None
        job.save()
    publish_job(job)
    files = workload_parquet_files(job.workload)
    fingerprint = store_fingerprint(files + workload_table_files(job.workload))
    if job.kind in partitions.PARTITIONED_KINDS:
        try:
            count = partitions.partitioned_start(job, files, fingerprint)
        except (*RETRYABLE, SoftTimeLimitExceeded):
            raise
        except Exception as exc:  # a store object that is not Parquet, say
            return _refused(job.pk, exc)
        attempt = job.attempts
        transaction.on_commit(lambda: _enqueue_partitioned(job_id, attempt, count))
        return JobState.RUNNING  # the chord's reduce finishes the job
    try:
        with workload_metadata_dir(job.workload) as tables:
            table = operations_named(load_operations(files), tables)
        _progress(job, 30)
        result = json_safe(RUNNERS[job.kind](table, dict(job.parameters)))
    except (*RETRYABLE, SoftTimeLimitExceeded):  # the task retries these, or fails the job saying why
        raise
    except Exception as exc:  # the library refused this data: say why on the job
        return _refused(job.pk, exc)
    _progress(job, 90)
    return _finish(job, result, fingerprint)


def _refused(job_id: int, exc: Exception) -> str:
    """Fail a job whose data the library (or Parquet reader) refused, saying why."""
    logger.info("analysis job %s failed: %s", job_id, exc)
    analysis_fail(job_id, f"{type(exc).__name__}: {exc}")
    return JobState.FAILED


def _finish(job: AnalysisJob, result: dict[str, Any], fingerprint: str) -> str:
    """Store a run's result unless the job was cancelled meanwhile; its final state."""
    with transaction.atomic():
        current = AnalysisJob.objects.select_for_update().filter(pk=job.pk).values_list("state", "error").first()
        if current is None or (current[0] == JobState.FAILED and current[1].startswith(CANCELLED)):
            return JobState.FAILED  # cancelled while it ran: the result is dropped
        job.result, job.store_fingerprint = result, fingerprint
        job.state, job.progress, job.finished_at = JobState.DONE, 100, timezone.now()
        job.save()
    publish_job(job)
    return job.state


# --- Partitioned runs (apps.analysis.partitions): one chord of map tasks and a reduce ---------------------------


def _enqueue_partitioned(job_id: int, attempt: int, count: int, stage: int = 1) -> None:
    from celery import chord

    from .tasks import map_partition, reduce_partitions

    maps = (map_partition.s(job_id, attempt, i, stage) for i in range(count))
    chord(maps)(reduce_partitions.s(job_id, attempt, stage))


def analysis_map(job_id: int, attempt: int, index: int, stage: int = 1) -> bool:
    """Summarise one partition of a running job for ``stage`` (a map task); publish the count of map tasks
    done. Infrastructure errors (RETRYABLE) propagate: the task retries this partition alone."""
    try:
        if not partitions.partition_map(job_id, attempt, index, stage):
            return False
    except (*RETRYABLE, SoftTimeLimitExceeded):
        raise
    except Exception as exc:  # the library refused this partition's data: the job fails saying why
        _refused(job_id, exc)
        return False
    job = AnalysisJob.objects.filter(pk=job_id).first()
    if job is not None:
        job.progress = 5 + 85 * job.partitions_done // max(job.partitions, 1)
        AnalysisJob.objects.filter(pk=job_id, attempts=attempt, state=JobState.RUNNING).update(progress=job.progress)
        publish_job(job)
    return True


def analysis_reduce(job_id: int, attempt: int, stage: int = 1) -> str:
    """Merge a partitioned run's summaries of ``stage`` (a chord's last task): into what the next stage's map
    tasks read, then queue them; after the last stage, into the job's result. The job's state."""
    job = AnalysisJob.objects.filter(pk=job_id).first()
    if job is not None and stage < partitions.stages(job.kind):
        try:
            if not partitions.partition_link(job_id, attempt):
                return job.state  # the run was cancelled, failed or superseded
        except (*RETRYABLE, SoftTimeLimitExceeded):
            raise
        except Exception as exc:  # the library refused this data: say why on the job
            return _refused(job_id, exc)
        count = job.partitions // partitions.stages(job.kind)
        _enqueue_partitioned(job_id, attempt, count, stage + 1)
        return JobState.RUNNING
    try:
        result = partitions.partition_reduce(job_id, attempt)
    except (*RETRYABLE, SoftTimeLimitExceeded):
        raise
    except Exception as exc:  # the library refused this data: say why on the job
        return _refused(job_id, exc)
    job = AnalysisJob.objects.select_related("workload").filter(pk=job_id).first()
    if result is None or job is None:
        return job.state if job is not None else "missing"  # the run was cancelled, failed or superseded
    fingerprint = partitions.run_fingerprint(job_id, attempt)
    state = _finish(job, json_safe(result), fingerprint)
    partitions.run_cleanup(job_id, attempt)
    return state


CANCELLED = "Cancelled by "


def analysis_cancel(actor: User, job: AnalysisJob) -> bool:
    """Cancel a queued or running job (administrators, from System Settings): a queued one never runs, a
    running one's result is dropped when it finishes. False when the job had already finished."""
    if not actor.is_site_admin:
        raise AnalysisPermissionDenied("Only administrators cancel background jobs.")
    updated = AnalysisJob.objects.filter(pk=job.pk, state__in=[JobState.QUEUED, JobState.RUNNING]).update(
        state=JobState.FAILED, error=f"{CANCELLED}{actor.username}.", finished_at=timezone.now()
    )
    if updated:
        job.refresh_from_db()
        publish_job(job)
    return bool(updated)


def analysis_fail(job_id: int, reason: str) -> None:
    """Mark a job failed with ``reason`` (also used by the task when retries or time run out)."""
    job = AnalysisJob.objects.filter(pk=job_id).first()
    if job is None:
        return
    job.state, job.error, job.finished_at = JobState.FAILED, reason[:MAX_ERROR_CHARS], timezone.now()
    job.save(update_fields=["state", "error", "finished_at", "updated_at"])
    publish_job(job)


# --- Live progress ---------------------------------------------------------------------------------------------


def analysis_group(workload_id: int) -> str:
    """Channels group of a workload's analysis jobs (``ws/workloads/<id>/analyses/``)."""
    return f"analysis-workload-{workload_id}"


def job_message(job: AnalysisJob) -> dict[str, Any]:
    return {
        "type": "job",
        "id": job.pk,
        "kind": job.kind,
        "state": job.state,
        "progress": job.progress,
        "error": job.error,
        # partitioned runs: map tasks finished of all (0 and 0 for a run in one task)
        "partitions": job.partitions,
        "partitions_done": job.partitions_done,
    }


def publish_job(job: AnalysisJob) -> None:
    """Tell open pages about a job's state and progress; never fails the caller."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(
            analysis_group(job.workload_id), {"type": "analysis.job", "job": job_message(job)}
        )
    except Exception:  # progress is a courtesy: a broken channel layer must not fail the analysis
        logger.exception("could not publish progress of analysis job %s", job.pk)
    # The workload list shows Step and Hang counts from results; the workload page lists queued jobs.
    if job.finished or job.state == JobState.QUEUED:
        publish_workload_changed(job.workload_id)


# --- Step calibration ------------------------------------------------------------------------------------------


MAX_STEP = 1 << 53


def _step_number(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise AnalysisParameterError({name: "must be a whole number"})
    try:
        number = int(str(value).strip()) if isinstance(value, str) and len(value) <= 20 else value
    except ValueError:
        raise AnalysisParameterError({name: "must be a whole number"}) from None
    if not isinstance(number, int) or not 0 <= number <= MAX_STEP:
        raise AnalysisParameterError({name: f"must be a whole number between 0 and {MAX_STEP}"})
    return number


def calibration_apply(actor: User, workload: Workload, recovered: Any, framework: Any) -> StepCalibration:
    """Persist "recovered step k is framework step n" for ``workload`` (manage level or administrator)."""
    k, n = _step_number(recovered, "recovered"), _step_number(framework, "framework")
    if not workload_can_manage(actor, workload):
        raise AnalysisPermissionDenied("You need the manage level on this workload to calibrate its steps.")
    calibration, _ = StepCalibration.objects.update_or_create(
        workload=workload, defaults={"recovered": k, "framework": n, "set_by": actor}
    )
    return calibration


def calibration_clear(actor: User, workload: Workload) -> bool:
    if not workload_can_manage(actor, workload):
        raise AnalysisPermissionDenied("You need the manage level on this workload to calibrate its steps.")
    deleted, _ = StepCalibration.objects.filter(workload=workload).delete()
    return bool(deleted)


@dataclass(frozen=True)
class ResultsDeleted:
    deleted: int  # finished jobs removed with their results
    kept_busy: int  # queued or running jobs left alone (they finish, or fail, on their own)


def analysis_results_delete(actor: User, workload: Workload) -> ResultsDeleted:
    """Delete a workload's analysis results ("semantic data": recovered steps, hang, straggler and performance
    reports) and its cached trace exports; the evidence (archives, columnar store) stays, so every analysis can
    be run again. Jobs still queued or running are kept. Manage level (owner, manage share, administrators)."""
    if not workload_can_manage(actor, workload):
        raise AnalysisPermissionDenied("You need the manage level on this workload to delete its results.")
    busy = AnalysisJob.objects.filter(workload=workload, state__in=[JobState.QUEUED, JobState.RUNNING])
    kept = busy.count()
    with transaction.atomic():
        deleted, _ = (
            AnalysisJob.objects.filter(workload=workload)
            .exclude(state__in=[JobState.QUEUED, JobState.RUNNING])
            .delete()
        )
        prefix = exports_prefix(workload.pk)
        transaction.on_commit(lambda: object_store().delete_prefix(prefix))
    logger.info("%s deleted %d analysis results of workload %s", actor.username, deleted, workload.pk)
    transaction.on_commit(lambda: publish_workload_changed(workload.pk))
    return ResultsDeleted(deleted, kept)


def calibrated_steps(result: dict[str, Any], calibration: StepCalibration | None) -> list[dict[str, Any]]:
    """The per-step rows of a steps result, with the workload's calibration applied for display."""
    offset = calibration.offset if calibration else 0
    rows = []
    for step in result.get("steps", []):
        summary = step.get("summary") or partitions.step_summary(step)
        recovered = step.get("step")
        rows.append(
            {
                "recovered": recovered,
                "step": recovered + offset if isinstance(recovered, int) and recovered >= 0 else recovered,
                "start_ns": step.get("start_ns"),
                "end_ns": step.get("end_ns"),
                "duration_ms": step.get("duration_ms"),
                "ranks": summary["ranks"],
                "comm_ms": summary["comm_ms_mean"],
                "exposed_wait_ms": summary["exposed_wait_ms_mean"],
                "slowest_rank": summary["slowest_rank"],
            }
        )
    return rows


# --- Trace export ----------------------------------------------------------------------------------------------


def exports_prefix(workload_id: int) -> str:
    """Where a workload's trace exports are cached in the object store: ``exports/workload-<id>/``."""
    return f"exports/workload-{workload_id}"


def trace_export(workload: Workload) -> str:
    """A Chrome JSON trace (Perfetto opens it) of the workload's operations, cached per store state; its location.

    Written locally to a temporary name, then put into the object store whole, so a concurrent download
    never sees half a file; older traces of the workload are removed.
    """
    from comminsight.export.perfetto import write_trace

    store = object_store()
    files = workload_parquet_files(workload)
    fingerprint = store_fingerprint(files + workload_table_files(workload))
    key = f"{exports_prefix(workload.pk)}/trace-{fingerprint}.json"
    target = store.location(key)
    if store.exists(target):
        return target
    scratch = Path(settings.DATA_DIR) / "tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    partial = scratch / f"trace-{workload.pk}-{fingerprint}.{os.getpid()}.part"
    try:
        with workload_metadata_dir(workload) as tables:
            write_trace(operations_named(load_operations(files), tables), partial)
        store.put_file(partial, key)
    finally:
        partial.unlink(missing_ok=True)
    for old in store.list(exports_prefix(workload.pk), suffix=".json"):
        if old != target:
            store.delete(old)
    return target
