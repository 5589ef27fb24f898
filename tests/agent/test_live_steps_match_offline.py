"""The agent's live steps are the steps the CLI and the site recover from the same node's sealed archive.

A node's records reach the live engine in batches of one writer each, interleaved across the node's GPUs in
whatever order the rings are drained; the same records, sealed into the node's archive, are decoded by the one
record decoder (``comminsight.formats.operations``) and read by ``recover_steps``. What must be equal, per rank:
every step the live engine has closed (its summary written) has the step id, start, end and operation count of
the offline step with that id. The live engine may lag: a step is closed only once ``window`` later steps have
opened on its GPU, so before the end of the job it has written a prefix of each rank's offline steps; at the end
(``flush``) it has written all of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from comminsight.agent.steps import LiveSteps
from comminsight.formats import header
from comminsight.formats.operations import SegmentRecords, operations
from comminsight.formats.rawlog import SegmentHeader
from comminsight.importers import load
from comminsight.semantic.steps import recover_steps
from comminsight.simulator.tracegen import Layout, generate

C = header.constants()
NCCL_FUNC = {
    "all_reduce": "AllReduce",
    "all_gather": "AllGather",
    "reduce_scatter": "ReduceScatter",
    "broadcast": "Broadcast",
    "send": "Send",
    "recv": "Recv",
}
# Megatron's group descriptions, by the generator's communicator kind (its comm_id says which group it is).
GROUP_NAMES = {
    "tp": "TENSOR_MODEL_PARALLEL_GROUP",
    "dp": "DATA_PARALLEL_GROUP",
    "dpr": "DATA_PARALLEL_GROUP",
    "cp": "CONTEXT_PARALLEL_GROUP",
    "pp": "PIPELINE_MODEL_PARALLEL_GROUP",
    "emb": "EMBEDDING_GROUP",
}
NODE = range(8)
PID = 1000  # writer pid = PID + global rank


def node_records(table: pl.DataFrame, ranks: range, named: bool) -> np.ndarray:
    """The plugin's records of ``ranks`` for a generated job, in the order the plugin writes them: as operations
    complete. Data-parallel operations run asynchronously, each overlapping the next four operations of its GPU
    (as gradient reductions overlap the backward pass), so records do not come in start order. P2P peers are
    communicator ranks, grouped operations (a send and a receive started at one instant) are issued one after
    another, communicators are named only when ``named``."""
    members = (
        table.group_by("comm_id")
        .agg(pl.col("rank").unique().sort())
        .with_columns(nranks=pl.col("rank").list.len(), comm_rank=pl.int_ranges(pl.col("rank").list.len()))
        .explode("rank", "comm_rank")
    )
    peers = members.select("comm_id", peer="rank", peer_comm_rank="comm_rank")
    ops = (
        table.drop("comm_rank", strict=False)
        .filter(pl.col("rank").is_in(list(ranks)))
        .join(members, on=["comm_id", "rank"])
        .join(peers, on=["comm_id", "peer"], how="left")
        .sort("rank", "start_ns", maintain_order=True)
        .with_columns(
            end_ns=pl.when(pl.col("comm_id").str.starts_with("dp:"))
            .then(pl.max_horizontal("end_ns", pl.col("start_ns").shift(-4).over("rank") + 1))
            .otherwise("end_ns"),
            comm_hash=pl.col("comm_id").hash(7),
            seq=pl.col("start_ns").cum_count().over("rank", "comm_id") - 1,
            issued=pl.col("start_ns").cum_count().over("rank", "start_ns") - 1,
        )
        .with_columns(record_seq=pl.struct("end_ns", "start_ns").rank("ordinal").over("rank") - 1)
        .sort("rank", "record_seq")
    )
    p2p = ops["is_p2p"].to_numpy()
    rec = np.zeros(ops.height, header.record_dtype())
    rec["kind"] = np.where(p2p, C["CI_KIND_P2P"], C["CI_KIND_COLL"])
    rec["state"] = C["CI_STATE_COMPLETED"]
    rec["flags"] = C["CI_FLAG_GPU_TIMES"]
    rec["rank"] = ops["comm_rank"].to_numpy()
    rec["nranks"] = ops["nranks"].to_numpy()
    rec["peer"] = np.where(p2p, ops["peer_comm_rank"].fill_null(-1).to_numpy(), -1)
    rec["pid"] = PID + ops["rank"].to_numpy()
    rec["comm_hash"] = ops["comm_hash"].to_numpy()
    rec["seq"] = ops["seq"].to_numpy()
    rec["bytes"] = 1 << 20
    rec["gpu_start_ns"] = ops["start_ns"].to_numpy()
    rec["gpu_end_ns"] = ops["end_ns"].to_numpy()
    rec["enqueue_start_ns"] = rec["gpu_start_ns"] - 20_000 + ops["issued"].to_numpy()
    rec["enqueue_end_ns"] = rec["enqueue_start_ns"] + 5_000
    rec["complete_ns"] = rec["gpu_end_ns"] + 10_000
    rec["record_seq"] = ops["record_seq"].to_numpy()
    rec["func"] = [NCCL_FUNC[op].encode() for op in ops["op"]]
    if named:
        rec["comm_name"] = [GROUP_NAMES[c.split(":")[0]].encode() for c in ops["comm_id"]]
    header.seal_records(rec)
    return rec


def archive_steps(rec: np.ndarray, ranks: range) -> pl.DataFrame:
    """What the CLI and the site recover from the node's archive: its segments' rows, decoded, then recover_steps."""
    parts = [
        SegmentRecords(
            SegmentHeader(
                pid=PID + r,
                start_ns=0,
                segment_index=0,
                local_rank=r,
                global_rank=r,
                world_size=len(ranks),
                host="node-a",
                workload_id="",
                node_ip="",
            ),
            rec[rec["pid"] == PID + r],
        )
        for r in ranks
    ]
    rank_steps = recover_steps(pl.from_arrow(operations(parts))).rank_steps
    return rank_steps.filter(pl.col("step") >= 0).select(
        pl.col("rank").cast(pl.Int64), "step", "start_ns", "end_ns", ops="n_ops"
    )


def arrival(rec: np.ndarray, ranks: range, batch_sizes: list[int], seed: int) -> list[tuple[str, np.ndarray]]:
    """The node's records as the agent drains its rings: per GPU in record order, batches of varying size, the
    GPUs' batches interleaved at random."""
    rng = np.random.default_rng(seed)
    left = {r: rec[rec["pid"] == PID + r] for r in ranks}
    batches = []
    while left:
        r = int(rng.choice(sorted(left)))
        n = int(rng.choice(batch_sizes))
        batches.append((str(PID + r), left[r][:n]))
        left[r] = left[r][n:]
        if not len(left[r]):
            del left[r]
    return batches


def live_steps(directory: Path, batches: list[tuple[str, np.ndarray]], ranks: range, flush: bool) -> pl.DataFrame:
    steps = LiveSteps(directory, "node-a", lambda: {PID + r: r for r in ranks})
    for writer, batch in batches:
        steps.feed(writer, batch)
    if flush:
        steps.flush()
    steps.write_pending()
    return written_steps(directory)


def written_steps(directory: Path) -> pl.DataFrame:
    """The step summaries the agent has written (docs/formats/steps.md): rank, step, start, end, operations."""
    rows = [json.loads(line) for path in sorted(directory.glob("*.jsonl")) for line in path.read_text().splitlines()]
    return pl.DataFrame(rows, schema=dict.fromkeys(("rank", "step", "start_ns", "end_ns", "ops"), pl.Int64)).select(
        "rank", "step", "start_ns", "end_ns", "ops"
    )


def _table(layout: Layout, tmp_path: Path, steps: int = 12) -> pl.DataFrame:
    job = generate(layout, steps=steps, seed=3)
    job.communication_only().drop("cp_rank", "dp_rank", "stage", "tp_rank").write_parquet(tmp_path / "job.parquet")
    table = pl.from_arrow(load(tmp_path / "job.parquet"))
    assert isinstance(table, pl.DataFrame)
    return table


JOBS = {
    "pipeline with P2P, TP2xPP2xDP2, no names": (Layout(tp=2, pp=2, dp=2), False),
    "pipeline with P2P, TP2xPP2xDP2, Megatron names": (Layout(tp=2, pp=2, dp=2), True),
    "HSDP, shard groups of 4, no names": (Layout(dp=16, fsdp_layers=4, fsdp_shard=4), False),
    "context parallel PP2xDP8xCP2, no names (peers off the node)": (Layout(pp=2, dp=8, cp=2), False),
    "DP-only stages DP8xPP2, no names": (Layout(pp=2, dp=8), False),
}
ARRIVALS = {
    "one batch per GPU": ([1 << 30], 0),
    "batches of 7 to 300": ([7, 50, 300], 1),
    "batches of 1 to 1000": ([1, 3, 1000], 2),
}
CASES = [pytest.param(j, a, id=f"{j}, {a}") for j in JOBS for a in ARRIVALS]


@pytest.mark.parametrize(("job", "order"), CASES)
def test_live_steps_at_the_end_of_the_job_are_the_steps_recovered_from_the_nodes_archive(
    job: str, order: str, tmp_path: Path
) -> None:
    layout, named = JOBS[job]
    rec = node_records(_table(layout, tmp_path), NODE, named)
    offline = archive_steps(rec, NODE).sort("rank", "step")
    sizes, seed = ARRIVALS[order]
    live = live_steps(tmp_path / "steps", arrival(rec, NODE, sizes, seed), NODE, flush=True).sort("rank", "step")
    # Steps on every GPU (else the comparison says little). Not always the job's 12: from this node's archive the
    # context-parallel job reads as 21 steps per GPU offline too (reported to step recovery, not the live path's).
    assert offline.get_column("rank").unique().sort().to_list() == list(NODE)
    assert offline.filter(pl.col("rank") == NODE[0]).height >= 12
    assert live.equals(offline)


# The live engine chooses each GPU's method on its first 512 operations (``LIVE_WARMUP``, so steps appear early),
# offline recovery on its first 4096. Where those agree (every job here but one) the closed steps are equal. From
# this node's archive the context-parallel job's period is ambiguous (offline finds 60 steps on some GPUs, 240 on
# others) and the two warm-ups pick different anchors on four of the eight GPUs.
WARMUP_DEPENDENT = {"context parallel PP2xDP8xCP2, no names (peers off the node)"}
WARMUPS_DIFFER = pytest.mark.xfail(strict=True, reason="live and offline warm-ups differ")
EARLY_CASES = [pytest.param(j, marks=[WARMUPS_DIFFER] if j in WARMUP_DEPENDENT else []) for j in JOBS]


@pytest.mark.parametrize("job", EARLY_CASES)
def test_live_steps_before_the_end_are_the_first_steps_recovered_from_the_nodes_archive(
    job: str, tmp_path: Path
) -> None:
    # 60 steps: every GPU passes the live warm-up (512 operations) long before the end, so steps close while
    # the job runs.
    layout, named = JOBS[job]
    rec = node_records(_table(layout, tmp_path, steps=60), NODE, named)
    offline = archive_steps(rec, NODE)
    live = live_steps(tmp_path / "steps", arrival(rec, NODE, [7, 50, 300], 4), NODE, flush=False)
    closed = live.group_by("rank").agg(pl.len().alias("n")).sort("rank")
    # Each rank's closed steps are its first offline steps. Still open: the last ``window`` (2) steps, and the
    # newest one's opening operations while they may still turn out to open nothing.
    first = offline.join(closed, on="rank").filter(pl.col("step") < pl.col("n")).drop("n")
    assert live.sort("rank", "step").equals(first.sort("rank", "step"))
    assert closed.get_column("rank").to_list() == list(NODE)
    assert min(closed.get_column("n")) >= 60 - 3


# Names the archive path does not read. The plugin records a communicator's name; the decoder keeps it as
# ``comm_name`` and the offline role inference reads descriptions (``comm_desc``) only, so from the archive a
# DP-only stage of consecutive ranks reads as TP by shape and its steps open 234 ms off the generated ones. The
# live engine reads the name as the description ("DATA_PARALLEL_GROUP") and its steps are exact. The two paths
# disagree until the decoder (or the role inference) reads record names the same way on both.
@pytest.mark.xfail(strict=True, reason="the archive path ignores communicator names the live engine reads")
def test_live_and_archive_steps_agree_when_communicators_are_named(tmp_path: Path) -> None:
    rec = node_records(_table(Layout(pp=2, dp=8), tmp_path), NODE, named=True)
    offline = archive_steps(rec, NODE).sort("rank", "step")
    live = live_steps(tmp_path / "steps", arrival(rec, NODE, [7, 50, 300], 1), NODE, flush=True).sort("rank", "step")
    assert live.equals(offline)


def test_a_restarted_agent_keeps_the_records_it_held_back_and_still_matches_the_archive(tmp_path: Path) -> None:
    # The held records (waiting for their place in start order, or for the roles) live in the step checkpoint:
    # the ring replays only what the ingest checkpoint had not taken, and the records held are not among them.
    rec = node_records(_table(Layout(tp=2, pp=2, dp=2), tmp_path, steps=60), NODE, named=False)
    batches = arrival(rec, NODE, [7, 50, 300], 5)
    ranks = {PID + r: r for r in NODE}
    first = LiveSteps(tmp_path / "steps", "node-a", lambda: ranks)
    cut = len(batches) // 2
    for writer, batch in batches[:cut]:
        first.feed(writer, batch)
    assert any(len(held) for held in first.held.values())
    first.checkpoint()
    del first  # killed after its checkpoint; the ingest checkpoint had taken the same batches
    second = LiveSteps(tmp_path / "steps", "node-a", lambda: ranks)
    second.restore()
    for writer, batch in batches[cut - 3 :]:  # and a few again: the step checkpoint may be ahead of the ingest one
        second.feed(writer, batch)
    second.flush()
    live = written_steps(tmp_path / "steps").sort("rank", "step")
    assert live.equals(archive_steps(rec, NODE).sort("rank", "step"))


def test_a_checkpoint_of_the_previous_version_still_resumes(tmp_path: Path) -> None:
    # Version 1 held no records and fixed each communicator's role at first sight: its roles are kept as settled.
    rec = node_records(_table(Layout(tp=2, pp=2, dp=2), tmp_path, steps=60), NODE, named=False)
    batches = arrival(rec, NODE, [50, 300], 6)
    ranks = {PID + r: r for r in NODE}
    first = LiveSteps(tmp_path / "steps", "node-a", lambda: ranks)
    for writer, batch in batches[: len(batches) // 2]:
        first.feed(writer, batch)
    first.checkpoint()
    saved = json.loads(first.checkpoint_path.read_text())
    for key in ("held", "watermark", "late_records", "catalogue", "settled"):
        del saved[key]
    first.checkpoint_path.write_text(json.dumps({**saved, "version": 1}))
    second = LiveSteps(tmp_path / "steps", "node-a", lambda: ranks)
    second.restore()
    assert second.settled
    assert second.roles == first.roles
    assert second.fed_seq == first.fed_seq
    for writer, batch in batches[len(batches) // 2 :]:
        second.feed(writer, batch)
    assert second.flush() > 0
