"""Partitioned analysis jobs on the site: a chord of map tasks over the store's partitions and a reduce.

Runs the hang and perf jobs with small partitions (several map tasks) on the local directory and
on a real S3 server, and checks the stored result against the whole-table run of the same store;
progress counts finished map tasks over Channels; a map task that fails is retried alone.
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from asgiref.sync import async_to_sync
from celery import signals
from channels.layers import get_channel_layer
from django.test import Client
from django.urls import reverse

from apps.analysis import services
from apps.analysis.models import AnalysisJob, JobState
from apps.workloads.ingest import path_part, store_prefix, workload_metadata_dir, workload_parquet_files
from apps.workloads.names import operations_named
from comminsight_site.objectstore import object_store
from tests.analysis_partitioned.compare import canonical, settled
from tests.site.analysis_tables import hung_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "semantic"))
import synthetic

pytestmark = pytest.mark.django_db(transaction=True)


def put_store(workload_id: int, table: pa.Table, tmp_path: Path) -> list[str]:
    """The table in the workload's store as ingest lays it out: one Parquet object per node and rank."""
    store = object_store()
    nodes = table.column("node").to_pylist() if "node" in table.column_names else [None] * table.num_rows
    ranks = table.column("rank").to_pylist()
    written = []
    for node, rank in sorted({(n or "unknown", r) for n, r in zip(nodes, ranks, strict=True)}):
        mask = pa.array([(n or "unknown") == node and r == rank for n, r in zip(nodes, ranks, strict=True)])
        local = tmp_path / f"part-{path_part(node)}-{rank}.parquet"
        pq.write_table(table.filter(mask), local)
        key = f"{store_prefix(workload_id)}/node-{path_part(node)}/rank-{rank}/s.parquet"
        written.append(store.put_file(local, key))
    return written


def whole_table_result(job: AnalysisJob) -> dict:
    """What the unpartitioned analysis says of the same store (all its rows in one table)."""
    files = workload_parquet_files(job.workload)
    with workload_metadata_dir(job.workload) as tables:
        table = operations_named(services.load_operations(files), tables)
    return services.json_safe(services.RUNNERS[job.kind](table, dict(job.parameters)))


def megatron_table() -> pa.Table:
    table = synthetic.table("megatron", slow_comms={"tp.d1p1": 4.0})
    return table.set_column(table.schema.get_field_index("node"), "node", pa.array(["n0"] * table.num_rows))


HANG = {"silence_s": 60.0}
TABLES = {"hung": lambda: hung_table(ranks=8, stuck_rank=5), "megatron": megatron_table}


@pytest.mark.parametrize("table_name", sorted(TABLES))
@pytest.mark.parametrize("kind", ["hang", "perf", "steps"])
def test_a_partitioned_run_stores_the_whole_table_result(
    each_storage_backend, personas, settings, tmp_path, kind, table_name
):
    settings.ANALYSIS_PARTITION_ROWS = 25 if table_name == "hung" else 400  # several map tasks each
    put_store(personas.workload.pk, TABLES[table_name](), tmp_path)
    job = services.analysis_request(personas.workload, kind, personas.alice).job
    job.refresh_from_db()
    assert job.state == JobState.DONE, job.error
    assert job.partitions > 1 or (kind, table_name) == ("perf", "hung")  # one communicator: one partition
    assert job.partitions_done == job.partitions
    same = settled if kind == "hang" else canonical
    assert same(job.result) == same(whole_table_result(job))
    if kind == "steps" and table_name == "megatron":  # the stored report is one a user reads: steps and waits
        assert len(job.result["steps"]) > 5
        assert any(step["summary"]["exposed_wait_ms_mean"] > 0 for step in job.result["steps"])
    # the run's summaries are removed once merged
    assert object_store().list(f"analysis-runs/job-{job.pk}") == []


def test_a_communicator_larger_than_a_partition_is_cut_into_slices_with_the_whole_tables_perf_result(
    each_storage_backend, personas, settings, tmp_path, monkeypatch
):
    from apps.analysis import partitions
    from apps.analysis.partitions import plan_partitions

    settings.ANALYSIS_PARTITION_ROWS = 60  # a tensor-parallel group's 144 rows: three slices or more
    monkeypatch.setattr(partitions, "READ_FILES", 3)  # a map task reads its files a few at a time
    table = megatron_table()
    put_store(personas.workload.pk, table, tmp_path)
    plan = plan_partitions("perf", workload_parquet_files(personas.workload))
    rows = pl.from_arrow(table.select(["comm_id"])).get_column("comm_id").value_counts()
    large = {comm for comm, n in rows.iter_rows() if n > 60}
    sliced = [p.comm_ids[0] for p in plan if p.seq_range is not None]
    assert set(sliced) == large
    assert all(sliced.count(comm) >= 3 for comm in large if comm.startswith("tp"))  # collectives: cut by sequence
    job = services.analysis_request(personas.workload, "perf", personas.alice).job
    job.refresh_from_db()
    assert job.state == JobState.DONE, job.error
    assert job.partitions == len(plan)
    assert canonical(job.result) == canonical(whole_table_result(job))
    assert job.result["slow_communicators"]  # the slow tensor-parallel group is still found
    assert object_store().list(f"analysis-runs/job-{job.pk}") == []


def test_the_hung_rank_is_found_by_the_partitioned_run(personas, settings, tmp_path):
    settings.ANALYSIS_PARTITION_ROWS = 1  # one rank per partition
    put_store(personas.workload.pk, hung_table(ranks=8, stuck_rank=5), tmp_path)
    job = services.analysis_request(personas.workload, "hang", personas.alice).job
    job.refresh_from_db()
    assert job.result["root_cause_ranks"] == [5]
    assert job.partitions == 8
    client = Client()
    client.force_login(personas.bob)  # shared with: sees the job and how far its map tasks got
    url = reverse("api-analysis-detail", kwargs={"workload_id": personas.workload.pk, "job_id": job.pk})
    shown = client.get(url).json()
    assert (shown["partitions_done"], shown["partitions"]) == (8, 8)


def test_progress_over_channels_counts_the_map_tasks_done(personas, settings, tmp_path):
    settings.ANALYSIS_PARTITION_ROWS = 1  # one rank per partition
    put_store(personas.workload.pk, hung_table(ranks=4, stuck_rank=1), tmp_path)
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(services.analysis_group(personas.workload.pk), channel)
    services.analysis_request(personas.workload, "hang", personas.alice)
    counts = []
    while True:
        message = async_to_sync(layer.receive)(channel)["job"]
        counts.append((message["partitions_done"], message["partitions"]))
        if message["state"] in (JobState.DONE, JobState.FAILED):
            break
    assert message["state"] == JobState.DONE
    done = [d for d, total in counts if total == 4]
    assert done[:4] == [1, 2, 3, 4]
    assert counts[-1] == (4, 4)


def finished(job: AnalysisJob) -> AnalysisJob:
    """The job once a worker finished it (bounded wait: a broken chord fails the test, it does not hang it)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job.refresh_from_db()
        if job.state in (JobState.DONE, JobState.FAILED):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job still {job.state} after 120 s")


@pytest.mark.slow
def test_a_failing_map_task_is_retried_alone(real_celery_worker, personas, settings, tmp_path):
    settings.STORAGE_URL = ""
    settings.ANALYSIS_PARTITION_ROWS = 1  # one rank per partition
    files = put_store(personas.workload.pk, hung_table(ranks=4, stuck_rank=1), tmp_path)
    # Rank 2's object is away when its map task first reads it (a store that hiccups), back for the retry.
    away = Path(files[2])
    hidden = away.with_name(".away")
    runs: list[int] = []

    def count(sender=None, args=None, **_):
        if sender is not None and sender.name.endswith("map_partition"):
            runs.append(args[2])
            if runs.count(2) == 1 and args[2] == 2:
                away.rename(hidden)

    def restore(sender=None, **_):
        if hidden.exists():
            hidden.rename(away)

    signals.task_prerun.connect(count, weak=False)
    signals.task_retry.connect(restore, weak=False)
    try:
        job = finished(services.analysis_request(personas.workload, "hang", personas.alice).job)
    finally:
        signals.task_prerun.disconnect(count)
        signals.task_retry.disconnect(restore)
    assert job.state == JobState.DONE, job.error
    assert sorted(runs) == [0, 1, 2, 2, 3], (runs, job.state, job.error, job.partitions)
    assert job.result["root_cause_ranks"] == [1]


@pytest.mark.slow
def test_a_partition_that_keeps_failing_fails_the_job_saying_so(real_celery_worker, personas, settings, tmp_path):
    settings.STORAGE_URL = ""
    settings.ANALYSIS_PARTITION_ROWS = 1
    files = put_store(personas.workload.pk, hung_table(ranks=4, stuck_rank=1), tmp_path)

    def lose_rank_3(sender=None, args=None, **_):  # gone for good after the plan listed it
        if sender is not None and sender.name.endswith("map_partition") and args[2] == 3:
            Path(files[3]).unlink(missing_ok=True)

    signals.task_prerun.connect(lose_rank_3, weak=False)
    try:
        job = finished(services.analysis_request(personas.workload, "hang", personas.alice).job)
    finally:
        signals.task_prerun.disconnect(lose_rank_3)
    assert job.state == JobState.FAILED
    assert job.error.startswith("partition 3 gave up after 4 attempts")
    assert job.result is None


@pytest.mark.django_db(transaction=False)
def test_the_shared_limit_counts_a_chord_in_flight_as_one_running_job(
    personas, settings, tmp_path, django_capture_on_commit_callbacks
):
    from apps.workloads.models import SystemSettings

    settings.ANALYSIS_PARTITION_ROWS = 1
    put_store(personas.workload.pk, hung_table(ranks=4, stuck_rank=1), tmp_path)
    SystemSettings.objects.update_or_create(pk=1, defaults={"max_running_analyses": 1})
    first = AnalysisJob.objects.create(workload=personas.workload, kind="hang", parameters_key="a", parameters=HANG)
    second = AnalysisJob.objects.create(workload=personas.workload, kind="hang", parameters_key="b", parameters=HANG)
    with django_capture_on_commit_callbacks() as chords:  # the first job's chord: planned, not run yet
        assert services.analysis_run(first.pk) == JobState.RUNNING
    first.refresh_from_db()
    assert first.partitions == 4
    assert services.analysis_run(second.pk) == services.DEFERRED  # four map tasks, one job
    for start in chords:
        start()  # the map tasks and the reduce run
    first.refresh_from_db()
    assert first.state == JobState.DONE
    assert services.analysis_run(second.pk) == JobState.RUNNING


def test_a_perf_partition_reads_only_the_files_of_its_communicators_members(personas, settings, tmp_path):
    from apps.analysis.partitions import communicator_partitions

    table = megatron_table()
    files = put_store(personas.workload.pk, table, tmp_path)
    listed = workload_parquet_files(personas.workload)
    assert sorted(listed) == sorted(files)
    frame = pl.from_arrow(table)
    for part in communicator_partitions(listed, max_rows=400):
        ranks = frame.filter(pl.col("comm_id").is_in(part.comm_ids)).get_column("rank").unique().sort().to_list()
        assert [listed[i] for i in part.files] == [
            f for f in listed if int(f.split("/rank-")[1].split("/")[0]) in ranks
        ]
    assert min(len(p.files) for p in communicator_partitions(listed, max_rows=400)) < len(listed)


def test_the_perf_merge_reads_the_samples_a_range_of_ranks_at_a_time(each_storage_backend, settings):
    from apps.analysis.partitions import _samples_by_rank

    store = object_store()
    samples = pl.DataFrame({"rank": list(range(40)) * 5, "busbw": [1.0] * 200}).cast({"rank": pl.Int32})
    locations = []
    for i, part in enumerate((samples[:120], samples[120:])):
        buffer = io.BytesIO()
        part.write_parquet(buffer)
        locations.append(
            store.write_bytes(f"analysis-runs/job-0/attempt-1/part-{i}-samples.parquet", buffer.getvalue())
        )
    settings.ANALYSIS_PARTITION_ROWS = 50
    chunks = list(_samples_by_rank(locations))
    assert len(chunks) == 4
    ranks = [set(c.get_column("rank").to_list()) for c in chunks]
    assert all(not (a & b) for i, a in enumerate(ranks) for b in ranks[i + 1 :])  # disjoint
    assert sum(c.height for c in chunks) == 200
    assert all(c.height <= 50 for c in chunks)


@pytest.mark.parametrize("params", [{}, {"ignore_labels": True, "period_only": True}])
def test_a_steps_run_maps_in_two_stages_and_stores_the_whole_table_result(personas, settings, tmp_path, params):
    settings.ANALYSIS_PARTITION_ROWS = 1  # one rank per partition
    table = megatron_table()
    put_store(personas.workload.pk, table, tmp_path)
    job = services.analysis_request(personas.workload, "steps", personas.alice, params).job
    job.refresh_from_db()
    assert job.state == JobState.DONE, job.error
    ranks = len(set(table.column("rank").to_pylist()))
    assert (job.partitions_done, job.partitions) == (2 * ranks, 2 * ranks)  # the map tasks of both stages
    assert canonical(job.result) == canonical(whole_table_result(job))
    assert ("agreement" in job.result) == (not params)


def test_a_large_partitioned_steps_run_stores_the_whole_tables_per_step_summaries(
    personas, settings, tmp_path, monkeypatch
):
    from apps.analysis import partitions

    settings.ANALYSIS_PARTITION_ROWS = 400  # several map tasks
    monkeypatch.setattr(partitions, "MAX_STEP_RANK_DETAILS", 10)  # every step x rank count is "large" here
    put_store(personas.workload.pk, megatron_table(), tmp_path)
    job = services.analysis_request(personas.workload, "steps", personas.alice).job
    job.refresh_from_db()
    assert job.state == JobState.DONE, job.error
    assert job.partitions > 2
    assert job.result["per_rank_details"] is False
    assert all("ranks" not in step for step in job.result["steps"])
    assert canonical(job.result) == canonical(whole_table_result(job))
    assert any(step["summary"]["exposed_wait_ms_mean"] > 0 for step in job.result["steps"])


def wider_megatron_table() -> pa.Table:
    # 16 ranks: the store lists rank-10 .. rank-15 before rank-2, the whole table is read in rank order.
    table = synthetic.table("megatron", slow_comms={"tp.d1p1": 4.0}, dp=4, steps=4)
    return table.set_column(table.schema.get_field_index("node"), "node", pa.array(["n0"] * table.num_rows))


@pytest.mark.parametrize("table", [megatron_table, wider_megatron_table], ids=["8-ranks", "16-ranks"])
@pytest.mark.parametrize("params", [{}, {"ignore_labels": True}], ids=["step-labels", "recovered-steps"])
def test_a_stragglers_run_maps_step_windows_and_stores_the_whole_table_result(
    each_storage_backend, personas, settings, tmp_path, params, table
):
    settings.ANALYSIS_PARTITION_ROWS = 400  # windows of whole steps: several map tasks
    put_store(personas.workload.pk, table(), tmp_path)
    job = services.analysis_request(personas.workload, "stragglers", personas.alice, params).job
    job.refresh_from_db()
    assert job.state == JobState.DONE, job.error
    assert job.partitions > 2
    assert job.partitions_done == job.partitions
    whole = whole_table_result(job)
    assert job.result["culprit_groups"]  # the slow tensor-parallel group: the merge decides something
    assert job.result == whole  # to the bit: the rows' order is no input
    assert object_store().list(f"analysis-runs/job-{job.pk}") == []


@pytest.mark.parametrize("kind", ["steps", "stragglers"])
def test_a_partitioned_run_of_an_empty_store_fails_like_the_whole_table(personas, settings, kind):
    job = services.analysis_request(personas.workload, kind, personas.alice).job
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.error == "ValueError: no operations have been ingested for this workload yet"


@pytest.mark.slow
def test_a_failing_stragglers_map_task_is_retried_alone(real_celery_worker, personas, settings, tmp_path):
    settings.STORAGE_URL = ""
    settings.ANALYSIS_PARTITION_ROWS = 400
    put_store(personas.workload.pk, megatron_table(), tmp_path)
    runs: list[int] = []
    hidden: list[tuple[Path, Path]] = []

    def count(sender=None, args=None, **_):
        # Window 1's object is away when its map task first reads it (a store that hiccups), back for the retry.
        if sender is not None and sender.name.endswith("map_partition"):
            runs.append(args[2])
            if runs.count(1) == 1 and args[2] == 1:
                key = f"analysis-runs/job-{args[0]}/attempt-{args[1]}/window-000001.parquet"
                away = Path(object_store().path(key))
                hidden.append((away, away.with_name(".away")))
                away.rename(hidden[0][1])

    def restore(sender=None, **_):
        for away, moved in hidden:
            if moved.exists():
                moved.rename(away)

    signals.task_prerun.connect(count, weak=False)
    signals.task_retry.connect(restore, weak=False)
    try:
        job = finished(services.analysis_request(personas.workload, "stragglers", personas.alice).job)
    finally:
        signals.task_prerun.disconnect(count)
        signals.task_retry.disconnect(restore)
    assert job.state == JobState.DONE, job.error
    assert hidden  # window 1 was away once
    assert sorted(runs) == sorted([*range(job.partitions), 1]), (runs, job.partitions)
    assert job.result == whole_table_result(job)
