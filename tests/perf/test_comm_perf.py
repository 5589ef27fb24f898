"""Communication performance: bus bandwidth, the best-observed reference, slow communicators and links."""

from __future__ import annotations

import json

import pytest
import synthetic
from typer.testing import CliRunner

from comminsight.analysis.perf import analyse_perf, bus_factor
from comminsight.cli import app


@pytest.mark.parametrize(
    ("op", "n", "factor"),
    [
        ("all_reduce", 8, 1.75),
        ("all_gather", 4, 0.75),
        ("reduce_scatter", 2, 0.5),
        ("broadcast", 8, 1.0),
        ("all_reduce", 1, 1.0),
    ],
)
def test_bus_factors_follow_nccl(op: str, n: int, factor: float) -> None:
    assert bus_factor(op, n) == pytest.approx(factor)


def test_bus_bandwidth_is_measured_from_the_last_arrival_not_from_waiting() -> None:
    fast = analyse_perf(synthetic.table("ddp", slow={}, seed=1))
    late = analyse_perf(synthetic.table("ddp", slow={2: 2.0}, seed=1))  # a straggler makes others wait

    def big(report):
        return next(r for r in report["bandwidth"] if r["op"] == "all_reduce" and r["bytes"] == 25 << 20)

    # 25 MiB at 50 GB/s plus 20 us, all-reduce on 8 ranks: busbw = algbw * 1.75.
    assert big(fast)["busbw_gbs"] == pytest.approx(big(late)["busbw_gbs"], rel=0.01)
    assert big(fast)["busbw_gbs"] == pytest.approx((25 << 20) / ((25 << 20) / 50 + 20_000) * 1.75, rel=0.01)
    assert late["slow_communicators"] == []


def test_a_slow_communicator_is_flagged_with_its_evidence() -> None:
    report = analyse_perf(synthetic.table("megatron", slow_comms={"tp.d1p1": 4.0}))
    flagged = {(r["comm_id"], r["op"]) for r in report["slow_communicators"]}
    assert flagged == {("tp.d1p1", "all_reduce")}
    row = report["slow_communicators"][0]
    assert row["efficiency"] < 0.5
    assert row["reference_busbw_gbs"] > row["busbw_gbs"]


def test_a_slow_pipeline_link_is_flagged() -> None:
    report = analyse_perf(synthetic.table("megatron", slow_comms={"pp.d1t1": 5.0}))
    links = {(r["src"], r["dst"]) for r in report["slow_links"]}
    assert links == {(3, 7), (7, 3)}  # d1 t1 across the two stages, both directions


def test_evidence_without_sizes_says_so() -> None:
    import polars as pl

    table = pl.from_arrow(synthetic.table("ddp", seed=1)).with_columns(bytes=pl.lit(None, dtype=pl.Int64))
    assert analyse_perf(table)["bandwidth"] == []


def test_perf_command_prints_json_and_text(tmp_path) -> None:
    import pyarrow.parquet as pq

    path = tmp_path / "ops.parquet"
    pq.write_table(synthetic.table("megatron", slow_comms={"tp.d1p1": 4.0}), path)
    result = CliRunner().invoke(app, ["analyze", "perf", str(path), "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["slow_communicators"][0]["comm_id"] == "tp.d1p1"
    text = CliRunner().invoke(app, ["analyze", "perf", str(path)])
    assert text.exit_code == 0
    assert "slow communicators" in text.stdout
