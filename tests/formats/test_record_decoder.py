"""One record decoder: the same profiler records give the same operations table on every path.

Segments are generated (every record kind and state, every data type NCCL names, flags, unknown
codes, times beyond int64, hostile names: invalid UTF-8, stale bytes after the NUL, no NUL at all,
control and bidi characters), then read

* as raw logs in a COMMINSIGHT_HOME (``comminsight import``/``analyze`` on a home),
* from the archive the agent's archiver seals from them (``comminsight analyze ARCHIVE``),
* as the site stores them (the decoder's first-step rows in Parquet, one file per archive and rank,
  finished over the whole store as ``load_operations`` does; tests/site drives the real ingest),
* from shared-memory rings through the agent's live diagnosis evidence,

and every path must give the same table.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings

from comminsight.agent.diagnosis import NodeEvidence, evidence_segments
from comminsight.agent.state import _rows as ring_batch_rows
from comminsight.formats.operations import ROWS_SCHEMA, SegmentRecords, finish, operations, segment_rows
from comminsight.formats.rawlog import segment_records
from comminsight.formats.ring import RingReader, RingWriter, create_ring
from comminsight.importers import archive as archive_importer
from comminsight.importers import load
from comminsight.importers import rawlog as rawlog_importer
from tests.formats.generated_segments import C, job, seal_archive, write_home


def site_store(home: Path, store: Path) -> pa.Table:
    """The site's layout: first-step rows per archive and rank in Parquet, finished over the whole store."""
    files = []
    for index, path in enumerate(sorted((home / "inspector_logs").iterdir())):
        hdr, records, _ = segment_records(path.read_bytes(), path)
        rows = segment_rows([SegmentRecords(hdr, records)])
        target = store / f"rank-{hdr.global_rank}" / f"archive-{index}.parquet"
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(rows, target)
        files.append(str(target))
    return finish(ds.dataset(files, format="parquet", schema=ROWS_SCHEMA).to_table())


def through_rings(home: Path, work: Path) -> pa.Table:
    """Each segment's records through a shared-memory ring, read by the agent, decoded as its live diagnosis does."""
    work.mkdir()
    evidence = []
    for path in sorted((home / "inspector_logs").iterdir()):
        hdr, records, _ = segment_records(path.read_bytes(), path)
        ring = work / f"{path.name}.ring"
        create_ring(ring, 64, pid=hdr.pid, host=hdr.host)
        writer = RingWriter(ring)
        writer.write(records)
        writer.close()
        reader = RingReader(ring)
        batch = reader.read(64)
        reader.close()
        rows = ring_batch_rows(batch.records, np.arange(len(batch.records)))
        evidence.append(NodeEvidence(hdr.host, rows, {hdr.pid: hdr.global_rank}))
    return operations(evidence_segments(evidence))


def without(table: pa.Table, *names: str) -> pa.Table:
    return table.drop_columns(list(names))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=job)
def test_every_path_gives_the_same_operations_table(tmp_path_factory, spec):
    root = tmp_path_factory.mktemp("decoder")
    home = write_home(root / "home", spec)
    archive = seal_archive(home, root / "agent")
    from_home = rawlog_importer.load(home)
    assert archive_importer.load(archive).equals(from_home)
    assert site_store(home, root / "store").equals(from_home)
    # Communicator names come from the records and tables the same way on both: the named tables agree too.
    assert load(archive).equals(load(home))
    # The agent names a ring's writer by its host alone: it carries no workload or node IP.
    from_rings = through_rings(home, root / "rings")
    assert without(from_rings, "workload", "node").equals(without(from_home, "workload", "node"))


def one_record(**fields) -> list[dict]:
    base = {
        "global_rank": 0,
        "host": b"gpu-a",
        "workload_id": b"job-1",
        "node_ip": b"",
        "records": [{"kind": C["CI_KIND_COLL"], "state": C["CI_STATE_COMPLETED"], "comm_hash": 1, **fields}],
    }
    return [base]


def test_a_reused_dtype_buffer_does_not_leak_the_previous_name_into_the_data_type(tmp_path):
    # The plugin wrote "ncclInt8\0" over "ncclInt32": the tail "32" is still in the buffer.
    table = load(write_home(tmp_path, one_record(dtype=b"ncclInt8\x0032", func=b"AllGather")))
    assert table.column("dtype").to_pylist() == ["int8"]


def test_a_timeout_snapshot_is_started_only_when_the_gpu_start_is_valid(tmp_path):
    spec = one_record(state=C["CI_STATE_TIMEOUT"], gpu_start_ns=5, flags=0)
    spec[0]["records"].append({**spec[0]["records"][0], "flags": C["CI_FLAG_GPU_TIMES"], "record_seq": 1})
    table = load(write_home(tmp_path, spec))
    assert table.column("state").to_pylist() == ["enqueued", "started"]


def test_the_enqueue_time_is_when_the_operation_was_enqueued_not_when_enqueueing_ended(tmp_path):
    table = load(write_home(tmp_path, one_record(enqueue_start_ns=100, enqueue_end_ns=250)))
    assert table.column("enqueue_ns").to_pylist() == [100]


def test_a_p2p_peer_becomes_the_global_rank_holding_that_communicator_rank(tmp_path):
    p2p = {"kind": C["CI_KIND_P2P"], "state": C["CI_STATE_COMPLETED"], "comm_hash": 9, "nranks": 2, "func": b"Send"}
    spec = [
        {
            "global_rank": 4,
            "host": b"a",
            "workload_id": b"j",
            "node_ip": b"",
            "records": [{**p2p, "rank": 0, "peer": 1}],
        },
        {
            "global_rank": 6,
            "host": b"a",
            "workload_id": b"j",
            "node_ip": b"",
            "records": [{**p2p, "rank": 1, "peer": 0}],
        },
    ]
    home = write_home(tmp_path / "home", spec)
    for table in (load(home), load(seal_archive(home, tmp_path / "agent"))):
        assert table.select(["rank", "peer"]).to_pylist() == [{"rank": 4, "peer": 6}, {"rank": 6, "peer": 4}]
