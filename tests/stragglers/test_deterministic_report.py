"""The straggler report is a function of the operations alone: the same trace gives the same JSON, to the bit,
however often it is analysed and in whatever order its rows are stored (one table, one file per rank as the
partitioned run reads them, shuffled). Near-equal costs must not trade places from one run to the next.
"""

from __future__ import annotations

import json

import polars as pl
import pytest

from comminsight.analysis.stragglers import analyse_stragglers
from comminsight.importers import load
from comminsight.simulator.tracegen import Fault, Layout, generate


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> pl.DataFrame:
    job = generate(Layout(tp=2, pp=2, dp=2), steps=5, faults=(Fault("compute", {"rank": 1}, factor=1.3),), seed=0)
    table = pl.from_arrow(load(job.write(tmp_path_factory.mktemp("job") / "trace.parquet")))
    assert isinstance(table, pl.DataFrame)
    return table


def _json(table: pl.DataFrame) -> str:
    return json.dumps(analyse_stragglers(table).to_dict())


def _by_rank_reversed(table: pl.DataFrame) -> pl.DataFrame:
    return pl.concat([part for _, part in sorted(table.group_by("rank"), key=lambda kv: -kv[0][0])])


@pytest.mark.parametrize(
    "reorder",
    [
        lambda t: t,
        lambda t: t.sample(fraction=1.0, shuffle=True, seed=1),
        lambda t: t.sample(fraction=1.0, shuffle=True, seed=2),
        _by_rank_reversed,
    ],
    ids=["again", "shuffled", "shuffled-again", "one-part-per-rank-last-rank-first"],
)
def test_the_report_is_the_same_json_whatever_the_order_of_the_rows(reorder, table: pl.DataFrame) -> None:  # type: ignore[no-untyped-def]
    first = _json(table)
    assert json.loads(first)["culprits"] == [1]
    assert _json(reorder(table)) == first
