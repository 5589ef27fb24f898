"""Planning a stragglers run batch by batch of whole ranks (the site's chord: the store is laid out by rank) gives
what planning over the whole table gives: the same facts, plan, windows and, prepared and merged, the same report."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from comminsight.analysis import stragglers
from comminsight.analysis.straggler_plan import PLAN_COLUMNS, LocalScratch, plan_in_batches, window_frame
from tests.stragglers.test_replay_windows import _generated, _generated_pipeline, _recorded, _simulated


def _pipeline_without_coordinates(tmp_path: Path) -> pl.DataFrame:
    # No coordinate columns given (raw profiler logs): the coordinates are inferred from the send/receive chains.
    table = _generated_pipeline(tmp_path)
    return table.with_columns(pl.lit(None, table.schema[c]).alias(c) for c in stragglers.COORDS if c in table.columns)


def _same(a: pl.DataFrame | None, b: pl.DataFrame | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.sort("rank").equals(b.sort("rank"))


@pytest.mark.parametrize("use_labels", [True, False], ids=["step-labels", "recovered-steps"])
@pytest.mark.parametrize(
    "source",
    [_generated, _generated_pipeline, _pipeline_without_coordinates, _recorded, _simulated],
    ids=[
        "generated-compute-rows",
        "generated-pipeline",
        "inferred-coordinates",
        "recorded-kineto",
        "simulated-raw-logs",
    ],
)
def test_planning_batch_by_batch_of_ranks_gives_the_whole_tables_plan_and_report(  # type: ignore[no-untyped-def]
    source, use_labels: bool, tmp_path: Path
) -> None:
    table = source(tmp_path).sort("rank", maintain_order=True)  # the store's order: rank by rank
    ranks = sorted(table.get_column("rank").unique().to_list())
    groups = [ranks[i : i + 3] for i in range(0, len(ranks), 3)]
    loads: list[int] = []

    def load(i: int) -> pl.DataFrame:
        loads.append(i)
        columns = [c for c in PLAN_COLUMNS if c in table.columns]  # planning needs no other column
        return table.filter(pl.col("rank").is_in(groups[i])).select(columns)

    max_rows = max(table.height // 5, 1)
    df, facts = stragglers.prepare_table(table, use_labels)
    plan = stragglers.plan_preparation(df, prepare=facts.evidence is None, max_rows=max_rows)
    scratch = LocalScratch(tmp_path / "scratch")
    planned = plan_in_batches(len(groups), load, scratch, use_labels, max_rows=max_rows)

    assert loads == [*range(len(groups)), *range(len(groups))]  # two passes, a batch at a time, never the table
    # (Steps recovered without coordinates cut this pipeline's transfers at every boundary there: one window.)
    assert len(plan.windows) > 1 or (source is _pipeline_without_coordinates and not use_labels)
    assert planned.plan.windows == plan.windows
    assert planned.plan.roles == plan.roles
    assert (planned.plan.issue_model, planned.plan.prepare) == (plan.issue_model, plan.prepare)
    assert planned.plan.next_starts.equals(plan.next_starts)
    assert planned.plan.pairs.sort("row").equals(plan.pairs.sort("row"))
    got, want = planned.facts, facts
    assert (got.evidence, got.step_source, got.coords, got.infer) == (
        want.evidence,
        want.step_source,
        want.coords,
        want.infer,
    )
    assert _same(got.rank_coord, want.rank_coord)
    assert _same(got.inferred, want.inferred)
    if source is _pipeline_without_coordinates:
        assert got.inferred is not None
        assert "pp_rank" in got.inferred.columns
    windows = [window_frame(scratch, planned, i) for i in range(len(plan.windows))]
    assert all(w.equals(stragglers.window_rows(df, plan, i)) for i, w in enumerate(windows))

    parts = [stragglers.prepare_window(w, planned.plan, i) for i, w in enumerate(windows)]
    merged = stragglers.report_from_windows(planned.facts, planned.plan, parts).to_dict()
    assert merged == stragglers.analyse_stragglers(table, use_labels).to_dict()


def test_batches_without_rows_are_no_operations_to_analyse(tmp_path: Path) -> None:
    empty = _generated(tmp_path).clear()
    with pytest.raises(ValueError, match="no operations to analyse"):
        plan_in_batches(2, lambda i: empty, LocalScratch(tmp_path / "scratch"))
