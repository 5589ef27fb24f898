"""The agent's live step engine: per-GPU step summaries on disk, exactly once across a crash and restart."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import polars as pl

from comminsight.agent.server import _step_metrics
from comminsight.agent.steps import LiveSteps
from comminsight.formats import header
from comminsight.importers import load
from comminsight.simulator.tracegen import Layout, generate

C = header.constants()
BUCKET = 24 << 20


def ddp_records(
    pid: int, steps: int, *, step_ns: int = 50_000_000, t0: int = 1_700_000_000_000_000_000, buckets: int = 4
) -> np.ndarray:
    """A DDP-like GPU: per step ``buckets`` gradient all-reduces then a tiny loss all-reduce, one step every step_ns."""
    per_step = buckets + 1
    n = steps * per_step
    rec = np.zeros(n, header.record_dtype())
    i = np.arange(n)
    step, k = i // per_step, i % per_step
    spacing = min(5_000_000, (step_ns - 12_000_000) // per_step)
    start = t0 + step * step_ns + 10_000_000 + k * spacing
    rec["kind"] = C["CI_KIND_COLL"]
    rec["state"] = C["CI_STATE_COMPLETED"]
    rec["flags"] = C["CI_FLAG_GPU_TIMES"]
    rec["rank"] = pid % 4
    rec["nranks"] = 4
    rec["peer"] = -1
    rec["pid"] = pid
    rec["comm_hash"] = 0x1234
    rec["seq"] = i
    rec["bytes"] = np.where(k < buckets, BUCKET, 4)
    rec["enqueue_end_ns"] = start - 1000
    rec["gpu_start_ns"] = start
    rec["gpu_end_ns"] = start + spacing * 2 // 5
    rec["complete_ns"] = start + spacing * 2 // 5 + 100_000
    rec["record_seq"] = i
    rec["func"] = b"AllReduce"
    rec["comm_name"] = b"world"
    header.seal_records(rec)
    return rec


def summaries(directory: Path) -> list[dict]:
    rows = []
    for path in sorted(directory.glob("*.jsonl")):
        rows.extend(json.loads(line) for line in path.read_text().splitlines())
    return sorted(rows, key=lambda r: (r["pid"], r["step"]))


def fed(directory: Path, batches: list[tuple[str, np.ndarray]], ranks: dict[int, int]) -> LiveSteps:
    steps = LiveSteps(directory, "node-a", lambda: ranks)
    for writer, batch in batches:
        steps.feed(writer, batch)
    steps.write_pending()  # what the agent's next checkpoint does
    return steps


def batches_of(records: dict[int, np.ndarray], size: int) -> list[tuple[str, np.ndarray]]:
    out = []
    longest = max(len(r) for r in records.values())
    for lo in range(0, longest, size):
        for pid, rec in records.items():
            if lo < len(rec):
                out.append((str(pid), rec[lo : lo + size]))
    return out


def test_live_steps_are_written_per_gpu_with_duration_ops_bytes_and_comm_time(tmp_path: Path) -> None:
    records = {101: ddp_records(101, 300), 102: ddp_records(102, 300)}
    steps = fed(tmp_path, batches_of(records, 400), {101: 0, 102: 1})
    rows = summaries(tmp_path)
    assert {r["rank"] for r in rows} == {0, 1}
    assert sorted(p.name for p in tmp_path.glob("*.jsonl")) == ["node-a-101.jsonl", "node-a-102.jsonl"]
    body = [r for r in rows if 5 <= r["step"] < 250]
    assert body, "steps in the middle of the run are final"
    for r in body:
        assert abs(r["duration_s"] - 0.05) < 1e-6
        assert r["ops"] == 5
        assert r["bytes"] == 4 * BUCKET + 4
        assert abs(r["comm_s"] - 5 * 0.002) < 1e-6
    latest = {s["rank"]: s for s in steps.latest_steps()}
    assert set(latest) == {0, 1}
    assert latest[0]["step"] == max(r["step"] for r in rows if r["rank"] == 0)


def test_a_killed_and_restarted_engine_neither_loses_nor_repeats_a_step(tmp_path: Path) -> None:
    records = {101: ddp_records(101, 300), 102: ddp_records(102, 300)}
    batches = batches_of(records, 250)
    ranks = {101: 0, 102: 1}
    fed(tmp_path / "once", batches, ranks)
    expected = summaries(tmp_path / "once")

    # First life: feed, checkpoint at some point, feed on (lines written after the checkpoint), then die.
    crash = tmp_path / "crash"
    first = LiveSteps(crash, "node-a", lambda: ranks)
    for writer, batch in batches[:5]:
        first.feed(writer, batch)
    first.checkpoint()
    for writer, batch in batches[5:8]:
        first.feed(writer, batch)
    first.write_pending()  # the next checkpoint began: its lines are on disk, its checkpoint file is not
    assert len(summaries(crash)) > 0
    del first  # SIGKILL: nothing else reaches the disk

    # Second life: the ingest checkpoint may lag the step checkpoint, so records come again from earlier.
    second = LiveSteps(crash, "node-a", lambda: ranks)
    second.restore()
    for writer, batch in batches[3:]:
        second.feed(writer, batch)
    second.write_pending()
    assert summaries(crash) == expected


def test_restore_after_a_corrupt_checkpoint_starts_afresh_without_crashing(tmp_path: Path) -> None:
    (tmp_path / "checkpoint.json").write_text("{not json")
    steps = LiveSteps(tmp_path, "node-a", dict)
    steps.restore()
    assert steps.feed("7", ddp_records(7, 200)) > 0


def test_step_summaries_not_yet_archived_are_handed_out_once(tmp_path: Path) -> None:
    steps = fed(tmp_path, [("9", ddp_records(9, 200))], {9: 3})
    lines, upto = steps.unarchived()
    assert lines.count(b"\n") == len(summaries(tmp_path))
    steps.mark_archived(upto)
    assert steps.unarchived()[0] == b""
    steps.feed("9", ddp_records(9, 400)[1000:])
    more, _ = steps.unarchived()
    assert more
    assert all(json.loads(line)["step"] > 0 for line in more.splitlines())


def test_live_steps_are_found_when_a_step_holds_hundreds_of_identical_operations(tmp_path: Path) -> None:
    # 600 equal gradient all-reduces per step: more than the live warm-up, and a step that read as
    # "every operation is a step" to period detection. Each step lasts 2 s.
    records = {101: ddp_records(101, 14, step_ns=2_000_000_000, buckets=600)}
    fed(tmp_path, batches_of(records, 700), {101: 0})
    rows = summaries(tmp_path)
    assert len(rows) >= 10
    for r in rows[1:-1]:
        assert r["ops"] == 601
        assert abs(r["duration_s"] - 2.0) < 1e-6


NCCL_FUNC = {"all_reduce": "AllReduce", "all_gather": "AllGather", "reduce_scatter": "ReduceScatter"}


def unnamed_records(table: pl.DataFrame, ranks: range) -> np.ndarray:
    """The plugin's records of ``ranks`` for an imported trace, as a job without communicator names leaves them."""
    members = (
        table.group_by("comm_id")
        .agg(pl.col("rank").unique().sort())
        .with_columns(nranks=pl.col("rank").list.len(), comm_rank=pl.int_ranges(pl.col("rank").list.len()))
        .explode("rank", "comm_rank")
    )
    ops = (
        table.drop("comm_rank")
        .filter(pl.col("rank").is_in(list(ranks)))
        .join(members, on=["comm_id", "rank"])
        .sort("rank", "start_ns")
        .with_columns(
            comm_hash=pl.col("comm_id").hash(7),
            seq=pl.col("start_ns").cum_count().over("rank", "comm_id") - 1,
            record_seq=pl.col("start_ns").cum_count().over("rank") - 1,
        )
    )
    rec = np.zeros(ops.height, header.record_dtype())
    rec["kind"] = C["CI_KIND_COLL"]
    rec["state"] = C["CI_STATE_COMPLETED"]
    rec["flags"] = C["CI_FLAG_GPU_TIMES"]
    rec["rank"] = ops["comm_rank"].to_numpy()
    rec["nranks"] = ops["nranks"].to_numpy()
    rec["peer"] = -1
    rec["pid"] = 1000 + ops["rank"].to_numpy()
    rec["comm_hash"] = ops["comm_hash"].to_numpy()
    rec["seq"] = ops["seq"].to_numpy()
    rec["bytes"] = 1 << 20
    rec["gpu_start_ns"] = ops["start_ns"].to_numpy()
    rec["gpu_end_ns"] = ops["end_ns"].to_numpy()
    rec["enqueue_end_ns"] = rec["gpu_start_ns"] - 10_000
    rec["complete_ns"] = rec["gpu_end_ns"] + 10_000
    rec["record_seq"] = ops["record_seq"].to_numpy()
    rec["func"] = [NCCL_FUNC[op].encode() for op in ops["op"]]
    rec["comm_name"] = b""
    header.seal_records(rec)
    return rec


def test_live_steps_of_an_hsdp_job_without_communicator_names_follow_each_gpus_period(tmp_path: Path) -> None:
    # HSDP, 64 GPUs, parameters sharded over groups of 8 consecutive ranks; no communicator names, so roles
    # come from the communicators' shape alone. A node's batch holding two shard groups' GPUs reads the shard
    # groups as TP and the cross-group all-reduces as DP: the megatron template then matches and, unchecked,
    # opened a step at every layer's all-reduce (96 steps for 12). It must agree with the GPU's own period.
    job = generate(Layout(dp=64, fsdp_layers=8, fsdp_shard=8), steps=12, seed=3)
    job.communication_only().drop("cp_rank", "dp_rank", "stage", "tp_rank").write_parquet(tmp_path / "job.parquet")
    table = pl.from_arrow(load(tmp_path / "job.parquet"))
    assert isinstance(table, pl.DataFrame)
    node = range(16)
    fed(tmp_path / "steps", [("node", unnamed_records(table, node))], {1000 + r: r for r in node}).flush()
    rows = pl.DataFrame(summaries(tmp_path / "steps"))
    true = job.table.group_by("rank", "step").agg(true_ns=(pl.col("start_ts").min() * 1e9).cast(pl.Int64))
    step_ns = float(np.diff(job.truth["step_starts_s"]).mean() * 1e9)
    assert rows.group_by("rank").len()["len"].to_list() == [12] * len(node)  # one summary per step per GPU
    for rank in node:
        starts = rows.filter(pl.col("rank") == rank)["start_ns"].to_numpy()
        truth = np.sort(true.filter(pl.col("rank") == rank)["true_ns"].to_numpy())
        assert np.abs(starts[:, None] - truth[None, :]).min(axis=1).max() <= 0.10 * step_ns


def test_a_record_that_comes_behind_the_watermark_is_counted_on_the_steps_view_and_metrics(tmp_path: Path) -> None:
    records = {101: ddp_records(101, 600), 102: ddp_records(102, 600)}
    # One all-reduce of GPU 101, well after the warm-up, lasts 100 steps: longer than any before it. The plugin
    # writes records in completion order, so it comes after the 500 records that completed before it.
    rec = records[101]
    long_one = 1500
    rec["gpu_end_ns"][long_one] = rec["gpu_start_ns"][long_one] + 100 * 50_000_000
    rec["complete_ns"][long_one] = rec["gpu_end_ns"][long_one] + 100_000
    rec = rec[np.argsort(rec["complete_ns"], kind="stable")]
    assert rec["seq"][long_one] != long_one  # it moved
    rec["record_seq"] = np.arange(len(rec))
    header.seal_records(rec)
    records[101] = rec
    steps = fed(tmp_path, batches_of(records, 400), {101: 0, 102: 1})
    assert steps.view()["late_records"] == 1
    families = {f.name: f for f in _step_metrics(SimpleNamespace(steps=steps))}
    assert [s.value for s in families["comminsight_steps_late_records"].samples] == [1]

    on_time = fed(tmp_path / "on-time", batches_of({101: ddp_records(101, 300)}, 400), {101: 0})
    assert on_time.view()["late_records"] == 0
