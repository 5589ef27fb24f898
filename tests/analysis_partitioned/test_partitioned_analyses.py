"""Partitioned analyses give the report of the whole table: hang over rank partitions, perf over communicators.

The whole table is read in store order (the site lists a workload's Parquet files by node, rank,
archive), so the reference here is the table sorted by rank, partitions concatenated in order.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from comminsight.analysis import analyze_hang
from comminsight.analysis.partitioned import (
    hang_merge,
    hang_reduce,
    hang_tail,
    merge_step_totals,
    nearest_index,
    perf_map,
    perf_reduce,
    perf_reduce_by_rank,
    perf_slice_map,
    seq_bucket,
    seq_bucket_width,
    seq_slices,
    slice_groups,
    slice_rows,
    step_rows,
    step_totals,
    steps_evidence,
    steps_links,
    steps_map,
    steps_merge,
    steps_reduce,
)
from comminsight.analysis.perf import analyse_perf
from comminsight.importers import load
from comminsight.semantic import recover_steps
from comminsight.semantic.roles import roles_from_shape_alone
from comminsight.simulator.tracegen import Layout as GeneratedLayout
from comminsight.simulator.tracegen import generate
from tests.analysis_partitioned.compare import canonical, settled, step_doc

TESTS = Path(__file__).resolve().parents[1]
FR_PUBLIC = TESTS.parents[0].parent / "shared" / "data" / "public" / "flight_recorder_nvrx" / "gpu_error_1st"
sys.path.insert(0, str(TESTS / "analysis_hang"))
sys.path.insert(0, str(TESTS / "semantic"))
import synthetic  # noqa: E402
from hang_simulation import Layout, fr_style, programs_for, run, swap_op  # noqa: E402


def by_rank(table: pa.Table) -> pl.DataFrame:
    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    return df.sort("rank", maintain_order=True)


def rank_partitions(df: pl.DataFrame, ranks_per_partition: int) -> list[pl.DataFrame]:
    ranks = sorted(df.get_column("rank").unique().to_list())
    groups = [ranks[i : i + ranks_per_partition] for i in range(0, len(ranks), ranks_per_partition)]
    return [df.filter(pl.col("rank").is_in(g)) for g in groups]


def hang_both_ways(table: pa.Table, ranks_per_partition: int = 3, tail_seqs: int = 1) -> tuple[dict, dict, float]:
    """(whole report, partitioned report, share of rows the tails kept)."""
    df = by_rank(table)
    tails = [hang_tail(part, tail_seqs=tail_seqs) for part in rank_partitions(df, ranks_per_partition)]
    kept = sum(t.height for t in tails) / max(df.height, 1)
    return analyze_hang(df), hang_reduce(len(tails), tails.__getitem__), kept


def hang_cases() -> dict[str, pa.Table]:
    cases: dict[str, pa.Table] = {}
    for name, layout in {"dp": Layout(1, 1, 8), "tp": Layout(4, 1, 2), "pp": Layout(2, 4, 2)}.items():
        programs = programs_for(layout, steps=12)
        rng = np.random.default_rng(len(name))
        hung = int(rng.integers(layout.world))
        position = int(rng.integers(len(programs[hung]) // 2, len(programs[hung]) - 1))
        cases[f"{name}-hung"] = run(layout, programs, hang_at={hung: position})
        cases[f"{name}-finished"] = run(layout, programs)
    layout = Layout(4, 1, 2)
    programs = programs_for(layout, steps=12)
    programs[6] = swap_op(programs[6], 40, op="broadcast")
    cases["mismatch"] = run(layout, programs)
    layout = Layout(1, 4, 1)
    programs = programs_for(layout, steps=12)
    for rank, peer in ((1, 2), (2, 1)):
        position = [i for i, op in enumerate(programs[rank]) if op.op == "recv" and op.peer == peer][5]
        programs[rank] = swap_op(programs[rank], position, op="send")
    cases["p2p-deadlock"] = run(layout, programs)
    layout = Layout(2, 2, 2)
    table = run(layout, programs_for(layout, steps=12), hang_at={5: 30})
    cases["no-evidence"] = table.filter(pc.not_equal(table["rank"], 5))
    return cases


HANG_CASES = hang_cases()


@pytest.mark.parametrize("style", ["timed", "flight_recorder"])
@pytest.mark.parametrize("case", sorted(HANG_CASES))
def test_the_hang_report_from_rank_partition_tails_equals_the_whole_tables(case, style):
    table = HANG_CASES[case] if style == "timed" else fr_style(HANG_CASES[case])
    whole, partitioned, _ = hang_both_ways(table)
    assert settled(partitioned) == settled(whole)


def test_the_tails_of_a_long_job_keep_a_small_share_of_its_rows():
    layout = Layout(2, 2, 2)
    table = run(layout, programs_for(layout, steps=12), hang_at={3: 60})
    whole, partitioned, kept = hang_both_ways(table, ranks_per_partition=2)
    assert settled(partitioned) == settled(whole)
    assert whole["root_cause_ranks"] == [3]
    assert kept < 0.25


def test_one_partition_per_rank_and_one_for_all_give_the_same_hang_report():
    table = HANG_CASES["pp-hung"]
    reports = [hang_both_ways(table, ranks_per_partition=n)[1] for n in (1, 16)]
    assert settled(reports[0]) == settled(reports[1])


def test_the_merge_keeps_of_each_tail_only_the_rows_at_or_above_its_streams_lowest_watermark():
    layout = Layout(2, 2, 2)
    table = run(layout, programs_for(layout, steps=12), hang_at={3: 60})
    df = by_rank(table)
    tails = [hang_tail(part) for part in rank_partitions(df, 2)]  # the default tail, 64 sequences
    merged = hang_merge(len(tails), tails.__getitem__)
    assert settled(analyze_hang(merged)) == settled(analyze_hang(df))
    # The ranks stopped together: below the lowest watermark of each stream nothing can block.
    assert merged.height < 0.5 * sum(t.height for t in tails)


def completions_lost(df: pl.DataFrame, rank: int, last: int) -> pl.DataFrame:
    """``df`` with ``rank``'s last ``last`` completed collectives of each communicator recorded as still started."""
    done = (pl.col("rank") == rank) & ~pl.col("is_p2p") & (pl.col("state") == "completed")
    position = pl.col("seq").rank("ordinal", descending=True).over("comm_id", "rank")
    lost = done & (pl.when(done).then(position).otherwise(None) <= last)
    return df.with_columns(
        pl.when(lost).then(pl.lit("started")).otherwise(pl.col("state")).alias("state"),
        pl.when(lost).then(None).otherwise(pl.col("end_ns")).alias("end_ns"),
    )


def test_a_rank_whose_completions_lag_its_peers_folds_to_the_whole_tables_report():
    layout = Layout(2, 2, 2)
    df = completions_lost(by_rank(run(layout, programs_for(layout, steps=12), hang_at={3: 60})), rank=5, last=3)
    whole = analyze_hang(df)
    assert 5 in whole["failures"]["stalled_completion_ranks"]
    tails = [hang_tail(part) for part in rank_partitions(df, 2)]
    merged = hang_merge(len(tails), tails.__getitem__)
    assert settled(analyze_hang(merged)) == settled(whole)


def test_real_dumps_with_a_rank_whose_completions_stalled_fold_to_the_whole_tables_report():
    if not FR_PUBLIC.is_dir():
        pytest.skip("public data not available")
    df = by_rank(load(FR_PUBLIC))
    whole = analyze_hang(df)
    # Completions lag on the broken ranks: their peers' rows at the blocking sequence completed.
    assert whole["failures"]["stalled_completion_ranks"]
    for ranks_per_partition in (1, 3):
        tails = [hang_tail(part) for part in rank_partitions(df, ranks_per_partition)]
        assert settled(hang_reduce(len(tails), tails.__getitem__)) == settled(whole)


def comm_partitions(table: pa.Table, comms_per_partition: int) -> list[pl.DataFrame]:
    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    comms = sorted(df.get_column("comm_id").unique().to_list())
    groups = [comms[i : i + comms_per_partition] for i in range(0, len(comms), comms_per_partition)]
    return [df.filter(pl.col("comm_id").is_in(g)) for g in groups]


@pytest.mark.parametrize(
    ("layout", "options"),
    [
        ("ddp", {"slow": {2: 2.0}, "seed": 1}),
        ("megatron", {"slow_comms": {"tp.d1p1": 4.0}}),
        ("megatron", {"slow_comms": {"pp.d1t1": 5.0}}),
        ("fsdp", {"seed": 3}),
    ],
)
@pytest.mark.parametrize("comms_per_partition", [1, 3])
def test_the_perf_report_from_communicator_partitions_equals_the_whole_tables(layout, options, comms_per_partition):
    table = synthetic.table(layout, **options)
    whole = analyse_perf(table)
    maps = [m for m in (perf_map(part) for part in comm_partitions(table, comms_per_partition)) if m is not None]
    partitioned = perf_reduce(maps)
    assert canonical(partitioned) == canonical(whole)
    assert whole["bandwidth"]
    # The merge holding a few ranks' samples at a time gives the same report.
    samples = pl.concat([s for _, s in maps])
    ranks = sorted(samples.get_column("rank").unique().to_list())
    chunks = (samples.filter(pl.col("rank").is_in(ranks[i : i + 3])) for i in range(0, len(ranks), 3))
    assert canonical(perf_reduce_by_rank([g for g, _ in maps], chunks)) == canonical(whole)


def test_partitions_without_payload_sizes_say_so_like_the_whole_table():
    df = pl.from_arrow(synthetic.table("ddp", seed=1))
    assert isinstance(df, pl.DataFrame)
    table = df.with_columns(bytes=pl.lit(None, dtype=pl.Int64))
    assert perf_reduce(perf_map(part) for part in comm_partitions(table.to_arrow(), 2)) == analyse_perf(table)


def steps_both_ways(table: pa.Table, ranks_per_partition: int, **options) -> tuple:
    """(whole StepReport, partitioned StepReport): stage 1 and stage 2 over rank partitions."""
    df = by_rank(table)
    parts = rank_partitions(df, ranks_per_partition)
    evidence = [steps_evidence(part) for part in parts]
    # One partition per rank: the merge also folds its instances after every partition.
    links = steps_links(len(parts), evidence.__getitem__, fold_rows=1 if ranks_per_partition == 1 else 10**9)
    mapped = [
        steps_map(
            part,
            links.roles,
            links.instances,
            links.p2p_waits.filter(pl.col("part") == i),
            links.shared,
            use_templates=options.get("use_templates", True),
            shape_alone=links.shape_alone,
        )
        for i, part in enumerate(parts)
    ]
    whole = recover_steps(df, compute_waits=True, use_templates=options.get("use_templates", True))
    return whole, steps_reduce(mapped)


@pytest.mark.parametrize(
    ("layout", "options"),
    [
        ("ddp", {"slow": {2: 2.0}, "seed": 1}),
        ("megatron", {"slow_comms": {"pp.d1t1": 5.0}}),
        ("fsdp", {"seed": 3}),
    ],
)
@pytest.mark.parametrize("ranks_per_partition", [1, 3])
@pytest.mark.parametrize("use_templates", [True, False])
def test_the_steps_from_two_stages_over_rank_partitions_equal_the_whole_tables(
    layout, options, ranks_per_partition, use_templates
):
    whole, partitioned = steps_both_ways(
        synthetic.table(layout, **options), ranks_per_partition, use_templates=use_templates
    )
    if use_templates:  # (period detection finds no steps in the FSDP layout, whole or partitioned)
        assert whole.steps
        assert any(r["exposed_wait_ms"] > 0 for s in whole.steps for r in s["ranks"].values())
    assert step_doc(partitioned) == step_doc(whole)


def test_point_to_point_waiting_crosses_partitions_like_the_whole_tables():
    layout = Layout(1, 4, 1)  # a pipeline: every rank's waits are on sends and receives to other ranks
    whole, partitioned = steps_both_ways(run(layout, programs_for(layout, steps=12)), ranks_per_partition=1)
    assert step_doc(partitioned) == step_doc(whole)


def test_whether_roles_come_from_shape_alone_is_the_whole_jobs_not_a_partitions(tmp_path):
    """A 64-GPU HSDP job without coordinates in which only rank 63's rows carry a group description (naming no
    role): the whole job's roles are not from shape alone, so no template is checked against the period (the
    megatron template cuts 8 steps per step), while ranks 0-31 alone would check it (period detection, 6 steps).
    The chord decides once for the job, so its steps are the whole table's."""
    job = generate(GeneratedLayout(dp=64, fsdp_layers=8, fsdp_shard=8), steps=6, seed=3)
    job.communication_only().drop("cp_rank", "dp_rank", "stage", "tp_rank").write_parquet(tmp_path / "comm.parquet")
    df = pl.from_arrow(load(tmp_path / "comm.parquet"))
    assert isinstance(df, pl.DataFrame)
    df = df.with_columns(
        comm_desc=pl.when(pl.col("rank") == 63).then(pl.lit("unnamed group")).otherwise(pl.col("comm_desc"))
    )
    assert roles_from_shape_alone(df.filter(pl.col("rank") < 32))
    assert not roles_from_shape_alone(df)
    whole, partitioned = steps_both_ways(df.to_arrow(), ranks_per_partition=32)
    assert len(whole.steps) == 8 * len(job.truth["step_starts_s"])
    assert step_doc(partitioned) == step_doc(whole)


def test_unlabelled_steps_agree_like_the_whole_tables():
    df = pl.from_arrow(synthetic.table("megatron"))
    assert isinstance(df, pl.DataFrame)
    whole, partitioned = steps_both_ways(df.with_columns(step=pl.lit(None, pl.Int64)).to_arrow(), 2)
    assert whole.agreement is None
    assert partitioned.agreement is None
    assert step_doc(partitioned) == step_doc(whole)


@pytest.mark.parametrize("ranks_per_partition", [1, 3])
def test_per_step_totals_merged_from_partitions_equal_the_whole_tables(ranks_per_partition):
    table = synthetic.table("megatron", slow_comms={"pp.d1t1": 5.0})
    whole, _ = steps_both_ways(table, ranks_per_partition)
    parts = rank_partitions(by_rank(table), ranks_per_partition)
    evidence = [steps_evidence(part) for part in parts]
    links = steps_links(len(parts), evidence.__getitem__)
    mapped = [
        steps_map(part, links.roles, links.instances, links.p2p_waits.filter(pl.col("part") == i), links.shared)
        for i, part in enumerate(parts)
    ]
    report, totals = steps_merge(iter(mapped), per_rank=False)
    assert report.rank_steps.height == 0  # the merge kept no (rank, step) rows
    assert report.steps == []
    assert report.methods_by_rank == whole.methods_by_rank
    assert report.agreement == whole.agreement
    assert step_rows(totals) == step_rows(step_totals(whole.rank_steps))
    # The summaries say what the per-rank details say: ranks, mean communication and waiting, the slowest rank.
    for row, step in zip(step_rows(totals), whole.steps, strict=True):
        ranks = step["ranks"]
        slowest = max(ranks, key=lambda r: ranks[r]["duration_ms"])
        assert row["step"] == step["step"]
        assert (row["start_ns"], row["end_ns"]) == (step["start_ns"], step["end_ns"])
        assert row["summary"]["ranks"] == len(ranks)
        assert row["summary"]["slowest_rank"] == int(slowest)
        comm = sum(sum(r["comm_ms"].values()) for r in ranks.values()) / len(ranks)
        assert row["summary"]["comm_ms_mean"] == pytest.approx(comm, rel=1e-12)
        wait = sum(r["exposed_wait_ms"] for r in ranks.values()) / len(ranks)
        assert row["summary"]["exposed_wait_ms_mean"] == pytest.approx(wait, rel=1e-12)
    assert any(row["summary"]["exposed_wait_ms_mean"] > 0 for row in step_rows(totals))


def test_the_slowest_rank_of_a_tie_is_the_lowest_whichever_partition_holds_it():
    frame = pl.DataFrame(
        {"rank": [5, 2, 9], "step": [0, 0, 0], "start_ns": [0, 10, 0], "end_ns": [30, 40, 20], "wait_ns": [1, 2, 3]}
    )
    parts = [step_totals(frame[i : i + 1]) for i in range(3)]
    merged = step_rows(merge_step_totals(parts))[0]
    assert merged["summary"]["slowest_rank"] == 2  # ranks 5 and 2 both took 30 ns
    assert merged == step_rows(step_totals(frame))[0]
    assert merged["summary"]["exposed_wait_ms_mean"] == pytest.approx(2e-6)


def comm_slices(df: pl.DataFrame, max_rows: int) -> tuple[list[pl.DataFrame], list[pl.DataFrame]]:
    """(partitions of whole communicators, slices of the larger ones), planned as the site plans them."""
    whole, slices = [], []
    for _, rows in sorted(df.partition_by("comm_id", as_dict=True).items()):
        if rows.height <= max_rows:
            whole.append(rows)
            continue
        low, high = rows.get_column("seq").min(), rows.get_column("seq").max()
        width = seq_bucket_width(low or 0, high or 0)
        counts = rows.select(b=seq_bucket(low or 0, width)).get_column("b").value_counts()
        for start, end in seq_slices(dict(counts.iter_rows()), low or 0, width, max_rows):
            slices.append(rows.filter(slice_rows(start, end)))
    return whole, slices


@pytest.mark.parametrize(
    ("layout", "options"),
    [
        ("ddp", {"slow": {2: 2.0}, "seed": 1}),
        ("megatron", {"slow_comms": {"tp.d1p1": 4.0}}),
        ("megatron", {"slow_comms": {"pp.d1t1": 5.0}}),
        ("fsdp", {"seed": 3}),
    ],
)
@pytest.mark.parametrize("max_rows", [20, 60])
def test_the_perf_report_with_communicators_cut_into_slices_equals_the_whole_tables(
    layout, options, max_rows, monkeypatch
):
    import comminsight.analysis.partitioned as partitioned

    # Tiny windows: the exact selection narrows by samples for several rounds before it sorts a window.
    monkeypatch.setattr(partitioned, "SELECT_LIMIT", 4)
    monkeypatch.setattr(partitioned, "SELECT_SAMPLE", 3)
    df = pl.from_arrow(synthetic.table(layout, **options))
    assert isinstance(df, pl.DataFrame)
    whole, slices = comm_slices(df, max_rows)
    assert slices
    assert sum(s.height for s in slices) + sum(w.height for w in whole) == df.height  # every row, once
    # A communicator's point-to-point rows stay together (pairing needs them all); its collectives are cut.
    assert all(s.height <= max_rows for s in slices if not s.get_column("is_p2p").any())
    maps = [m for m in map(perf_map, whole) if m is not None]
    cut = [m for m in map(perf_slice_map, slices) if m is not None]
    values = [v for v, _ in cut]
    groups = [g for g, _ in maps] + [slice_groups(len(values), values.__getitem__)]
    samples = pl.concat([s for _, s in maps] + [s for _, s in cut])
    assert canonical(perf_reduce_by_rank(groups, [samples])) == canonical(analyse_perf(df))


def test_sliced_medians_and_tenth_percentiles_are_polars_own_on_ties_and_uneven_slices(monkeypatch):
    import comminsight.analysis.partitioned as partitioned
    from comminsight.analysis.perf import GROUP_KEYS, bandwidth_groups

    monkeypatch.setattr(partitioned, "SELECT_LIMIT", 50)
    monkeypatch.setattr(partitioned, "SELECT_SAMPLE", 7)
    monkeypatch.setattr(partitioned, "SELECT_BUDGET", 300)  # several batches of selections
    rng = np.random.default_rng(12)
    for trial in range(20):
        n = int(rng.integers(1, 4000))
        values = pl.DataFrame(
            {
                "comm_id": rng.choice(["world", "dp"], n),
                "op": rng.choice(["all_reduce", "all_gather"], n),
                "bucket": rng.integers(10, 13, n),
                "n": np.full(n, 8, np.int32),
                "bytes": rng.choice([1024, 3000, 4096], n).astype(np.int64),  # few distinct values: long ties
                "algbw": np.round(rng.random(n) * 10, trial % 3),
                "busbw": rng.lognormal(0, 1, n) if trial % 2 else rng.integers(0, 4, n).astype(float),
                "transfer_ns": rng.integers(1, 100, n).astype(np.int64),
            }
        )
        cuts = np.sort(rng.integers(0, n, int(rng.integers(0, 6))))
        slices = [values[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
        merged = slice_groups(len(slices), slices.__getitem__)
        assert merged is not None
        expected = bandwidth_groups(values).sort(GROUP_KEYS).cast({"samples": pl.Int64})
        assert merged.sort(GROUP_KEYS).cast({"samples": pl.Int64}).equals(expected)


def test_the_nearest_quantile_position_is_the_one_polars_takes():
    for n in range(1, 2000):
        series = pl.Series(np.arange(n, dtype=np.float64))
        assert series.quantile(0.1, "nearest") == nearest_index(n, 0.1)
