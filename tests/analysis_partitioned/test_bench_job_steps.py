"""Step recovery on the job that ``bench/partitioned_analysis.py`` generates (TP 8 x PP 8 x DP, no step labels).

Every rank repeats the same 64-operation step, so every rank's recovered steps must start where the generator's do:
at least 95% of the true starts within 10% of the step time. When the collectives' sizes cycled with each
communicator's count instead of the place in the step, the program repeated only every 17 steps: ranks recovered
steps of 1,088 operations or of about 64 depending on the method each chose, and collectives spanned steps.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from bench.partitioned_analysis import STEP_OPS, rank_table
from comminsight.semantic import recover_steps


@pytest.mark.parametrize("ranks", [64, 128])
def test_every_rank_of_the_bench_job_recovers_the_generators_steps(ranks: int) -> None:
    ops = 64 * STEP_OPS
    tables = [rank_table(rank, ranks, ops) for rank in range(ranks)]
    found = recover_steps(pa.concat_tables(tables)).rank_steps
    near = total = 0
    for rank, table in enumerate(tables):
        start = np.sort(table.column("start_ns").to_numpy())
        true = start[::STEP_OPS]  # each step opens with its first operation
        step_ns = float(np.median(np.diff(true)))
        got = np.sort(found.filter(pl.col("rank") == rank).get_column("start_ns").to_numpy())
        assert got.size, f"rank {rank} recovered no steps"
        at = np.searchsorted(got, true)
        before, after = got[np.clip(at - 1, 0, got.size - 1)], got[np.clip(at, 0, got.size - 1)]
        off = np.minimum(np.abs(true - before), np.abs(after - true))
        near += int((off <= 0.1 * step_ns).sum())
        total += true.size
    assert near >= 0.95 * total, f"{near} of {total} true step starts recovered within 10% of the step time"
    lengths = found.group_by("rank").agg(pl.col("n_ops").median())
    assert set(lengths.get_column("n_ops").to_list()) == {STEP_OPS}, "ranks disagree on the step length"
