"""Parallel coordinates read from structure when the input has no coordinate columns (raw profiler logs).

``comminsight.simulator.tracegen`` writes jobs with their true coordinates; the coordinate columns
(and the compute rows) are removed, and what ``infer_coordinates`` reads from the send/receive chains
and the communicators' member sets must be the generator's: the pipeline stage, the data-parallel
replica, the tensor- and context-parallel index. The straggler attribution uses them as its
coordinate groups, and says so.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import polars as pl
import pytest

from comminsight.analysis.stragglers import analyse_stragglers
from comminsight.importers import load
from comminsight.semantic.roles import infer_coordinates
from comminsight.simulator.tracegen import Fault, GeneratedJob, Layout, generate

LAYOUTS = {
    "16 GPUs TP2xPP4xDP2": Layout(tp=2, pp=4, dp=2),
    "64 GPUs TP4xPP4xDP4": Layout(tp=4, pp=4, dp=4),
    "128 GPUs TP4xPP2xDP8xCP2": Layout(tp=4, pp=2, dp=8, cp=2),
    # Without TP the context-parallel groups are consecutive ranks, shaped like TP groups: read as TP,
    # they made each rank its own DP replica (a slow DP group was named as two half-groups).
    "32 GPUs PP2xDP8xCP2": Layout(pp=2, dp=8, cp=2),
    "32 GPUs PP2xDP4xCP4": Layout(pp=2, dp=4, cp=4),
    # Megatron's plain data-parallel group (one CP index, every replica) inside the DP-with-CP group: two
    # kinds of group nested in one DP group. Read both as CP, each rank was in two CP groups, CP was
    # undecided and each rank became its own replica.
    "32 GPUs PP2xDP8xCP2, plain DP beside CP": Layout(pp=2, dp=8, cp=2, plain_dp=True),
    "32 GPUs TP2xPP2xDP4xCP2, plain DP beside CP": Layout(tp=2, pp=2, dp=4, cp=2, plain_dp=True),
}
COORDINATE_COLUMNS = ("cp_rank", "dp_rank", "stage", "tp_rank")


@cache
def _job(name: str) -> GeneratedJob:
    layout = LAYOUTS[name]
    slow_stage = Fault("compute", {"pp": 1}, factor=1.4, phase="backward")
    return generate(layout, steps=4, faults=(slow_stage,), seed=3)


def _raw(job: GeneratedJob, tmp_path: Path, keep_coordinates: bool = False) -> pl.DataFrame:
    path = tmp_path / "comm.parquet"
    table = job.communication_only()
    (table if keep_coordinates else table.drop(COORDINATE_COLUMNS)).write_parquet(path)
    df = pl.from_arrow(load(path))
    assert isinstance(df, pl.DataFrame)
    return df


def _truth(job: GeneratedJob) -> pl.DataFrame:
    return job.table.group_by("rank").agg(
        pl.col("stage").first().alias("pp_rank"), *(pl.col(c).first() for c in ("dp_rank", "tp_rank", "cp_rank"))
    )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_inferred_coordinates_are_the_generators_for_a_job_without_coordinate_columns(
    name: str, tmp_path: Path
) -> None:
    job, layout = _job(name), LAYOUTS[name]
    raw = _raw(job, tmp_path)
    assert raw.get_column("pp_rank").null_count() == raw.height  # nothing to read them from
    inferred = infer_coordinates(raw)
    assert inferred is not None
    expected = {"pp_rank": layout.pp, "dp_rank": layout.dp, "tp_rank": layout.tp, "cp_rank": layout.cp}
    axes = [c for c, n in expected.items() if n > 1]
    assert sorted(c for c in inferred.columns if c != "rank") == sorted(axes)
    both = _truth(job).join(inferred, on="rank", suffix="_inferred")
    assert both.height == layout.tp * layout.pp * layout.dp * layout.cp
    for c in axes:
        wrong = both.filter(pl.col(c) != pl.col(f"{c}_inferred"))
        assert wrong.is_empty(), f"{c}: {wrong.head(4).to_dicts()}"


def test_stages_are_counted_from_the_rank_that_sends_first_whatever_the_rank_numbers(tmp_path: Path) -> None:
    job = _job("16 GPUs TP2xPP4xDP2")
    raw = _raw(job, tmp_path)
    last = raw.get_column("rank").max()
    # Number the ranks backwards: stage 0 now holds the highest rank numbers.
    flipped = raw.with_columns(
        rank=last - pl.col("rank"),
        peer=last - pl.col("peer"),
        comm_ranks=pl.col("comm_ranks").list.eval(last - pl.element()),
    )
    inferred = infer_coordinates(flipped)
    assert inferred is not None
    truth = _truth(job).select((last - pl.col("rank")).alias("rank"), "pp_rank")
    both = truth.join(inferred.select("rank", "pp_rank"), on="rank", suffix="_inferred")
    assert (both.get_column("pp_rank") == both.get_column("pp_rank_inferred")).all()
    assert inferred.filter(pl.col("pp_rank") == 0).get_column("rank").min() >= 12


def test_point_to_point_traffic_that_is_not_a_chain_gives_no_stage() -> None:
    # Rank 0 exchanges with three peers (a parameter server, not a pipeline).
    rows = [
        {
            "comm_id": f"c{p}",
            "comm_desc": None,
            "comm_size": 2,
            "comm_ranks": [0, p],
            "rank": r,
            "op": op,
            "is_p2p": True,
            "peer": peer,
            "start_ns": t,
        }
        for t, p in enumerate((1, 2, 3))
        for r, op, peer in ((0, "send", p), (p, "recv", 0))
    ]
    assert infer_coordinates(pl.DataFrame(rows)) is None


def test_the_attribution_names_a_slow_stage_from_inferred_coordinates_and_says_they_are_inferred(
    tmp_path: Path,
) -> None:
    job = _job("16 GPUs TP2xPP4xDP2")
    given = analyse_stragglers(_raw(job, tmp_path, keep_coordinates=True))
    inferred = analyse_stragglers(_raw(job, tmp_path))
    assert given.coordinates == "input"
    assert inferred.coordinates == "inferred"
    assert inferred.to_dict()["coordinates"] == "inferred"
    assert [g["group"] for g in inferred.culprit_groups] == ["pp=1"] == [g["group"] for g in given.culprit_groups]
    stage1 = sorted(_truth(job).filter(pl.col("pp_rank") == 1).get_column("rank").to_list())
    assert inferred.by_coordinate["pp"]["1"]["ranks"] == stage1


def test_a_job_without_a_pipeline_gets_no_inferred_coordinates(tmp_path: Path) -> None:
    # TP2 x DP4 without pipeline stages: its consecutive TP pairs and strided DP groups could as well be the
    # other way round, so nothing is inferred and the attribution makes no coordinate groups of guesses
    # (a real DDP job's two half-groups once became "tp=1" = ranks 1 and 5, named together as a culprit).
    job = generate(Layout(tp=2, pp=1, dp=4), steps=4, seed=3)
    raw = _raw(job, tmp_path)
    assert infer_coordinates(raw) is None
    report = analyse_stragglers(raw)
    assert report.coordinates == "none"
    assert not any(report.by_coordinate.get(kind) for kind in ("dp", "pp", "tp", "cp"))


def test_a_slow_dp_replica_with_context_parallelism_and_no_tp_is_named_as_one_group(tmp_path: Path) -> None:
    # Both context-parallel ranks of DP replica 1 compute x2: one replica, so one `dp` group of four ranks
    # (two stages x CP2), not two half-groups of the replica.
    layout = LAYOUTS["32 GPUs PP2xDP8xCP2"]
    job = generate(layout, steps=4, faults=(Fault("compute", {"dp": 1}, factor=2.0),), seed=3)
    report = analyse_stragglers(_raw(job, tmp_path))
    assert report.coordinates == "inferred"
    assert [g["group"] for g in report.culprit_groups] == ["dp=1"]
    assert sorted(report.culprits) == job.truth["culprits"]


@pytest.mark.parametrize("name", [n for n in LAYOUTS if "plain DP" in n])
def test_a_slow_dp_replica_and_a_slow_plain_dp_link_beside_context_parallelism_are_named(
    name: str, tmp_path: Path
) -> None:
    # Before, with the plain DP group beside the CP groups, replica 1 computing x2 was named as two
    # inferred "replicas" (dp=2, dp=3) or as its single ranks.
    layout = LAYOUTS[name]
    job = generate(layout, steps=4, faults=(Fault("compute", {"dp": 1}, factor=2.0),), seed=1)
    report = analyse_stragglers(_raw(job, tmp_path))
    assert report.coordinates == "inferred"
    assert [g["group"] for g in report.culprit_groups] == ["dp=1"]
    assert sorted(report.culprits) == job.truth["culprits"]
    # The plain DP group of stage 0, TP 0, CP 0 transfers 20x slower: named as that communicator.
    link = Fault("comm", {"pp": 0, "tp": 0, "cp": 0}, factor=20.0, group="dpo")
    job = generate(layout, steps=4, faults=(link,), seed=1)
    report = analyse_stragglers(_raw(job, tmp_path))
    assert len(report.culprit_groups) == 1
    assert report.culprit_groups[0]["group"].startswith("comm=")
    assert sorted(report.culprits) == job.truth["culprits"]
