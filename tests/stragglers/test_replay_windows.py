"""The what-if replay window by window of steps (``comminsight.analysis.replay``) gives the answer of one replay,
and so does the preparation before it (matching, per-rank statistics, the replay's columns) window by window.

Between windows only each rank's last replayed end (and host issue time) passes, per scenario; these tests cut
jobs into windows of one step and compare with one window holding every step: the reports must be equal, to the
bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from comminsight.analysis import replay, replay_inputs, stragglers
from comminsight.analysis.stragglers import analyse_stragglers
from comminsight.importers import load
from comminsight.simulator.tracegen import Fault, Layout, generate

RECORDED = Path(__file__).resolve().parents[1] / "data" / "kineto_gpu_lab_8rank"
SIMULATED = Path(__file__).resolve().parents[1] / "data" / "simulated_ddp_rank2_slow"


def _report_with_windows(table: pl.DataFrame, events: int, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, int]:
    """The report with windows of at most ``events`` events, and how many windows the replay planned."""
    planned = []
    levels = replay.levels

    def counted(win: dict) -> object:
        planned.append(win["steps"])
        return levels(win)

    monkeypatch.setattr(replay, "window_events", lambda: events)
    monkeypatch.setattr(replay, "levels", counted)
    return analyse_stragglers(table).to_dict(), len(planned)


def _read(path: Path) -> pl.DataFrame:
    table = pl.from_arrow(load(path))
    assert isinstance(table, pl.DataFrame)
    return table


def _generated(tmp_path: Path) -> pl.DataFrame:
    job = generate(Layout(tp=2, pp=2, dp=2), steps=6, faults=(Fault("compute", {"dp": 1}, factor=2.0),), seed=2)
    return _read(job.write(tmp_path / "job.parquet"))


def _recorded(tmp_path: Path) -> pl.DataFrame:
    return _read(RECORDED)


@pytest.mark.parametrize("source", [_generated, _recorded], ids=["generated-compute-rows", "recorded-kineto"])
def test_a_replay_cut_into_one_step_windows_gives_the_report_of_one_window(
    source, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    table = source(tmp_path)
    whole, whole_windows = _report_with_windows(table, 1 << 40, monkeypatch)
    cut, cut_windows = _report_with_windows(table, 1, monkeypatch)
    assert whole_windows == 1
    assert cut_windows == len(whole["per_step"]) > 1
    assert whole["culprits"]  # a job with a straggler: the replay's scenarios decide something
    assert whole == cut


def _two_ranks_three_steps(span_boundary: bool) -> dict:
    """Arrays of the replay for two ranks, three steps, one collective per step (and one compute before it);
    with ``span_boundary`` rank 1's collective of step 1 was labelled step 2 (recovered steps cut per rank)."""
    rank = np.repeat([0, 1], 6)
    step = np.tile([0, 0, 1, 1, 2, 2], 2)
    if span_boundary:
        step[9] = 2  # rank 1's collective of step 1
    n = rank.size
    prev = np.where(np.arange(n) % 6 == 0, -1, np.arange(n) - 1)
    collective = np.arange(n) % 2 == 1
    group = np.where(collective, (np.arange(n) % 6) // 2, 3 + np.arange(n))
    _, group = np.unique(group, return_inverse=True)
    step_ids, step_index = np.unique(step, return_inverse=True)
    order = np.argsort(step, kind="stable")
    cuts = np.flatnonzero(np.r_[True, step[order][1:] != step[order][:-1]])
    begin = np.array([0.0, 10.0, 20.0])
    return {
        "rank": rank,
        "prev": prev,
        "group_dense": group.astype(np.int64),
        "batch": np.arange(n),
        "step": step,
        "step_ids": step_ids,
        "step_index": step_index,
        "step_order": order,
        "step_cuts": cuts,
        "step_begin": begin,
        "shift": np.where(prev >= 0, begin[step_index[np.maximum(prev, 0)]] - begin[step_index], 0.0),
        "sync": np.ones(n, bool),
        "launch": np.zeros(n),
        "max_chain": np.int64(16),
        "max_chain_all": np.int64(64),
    }


@pytest.mark.parametrize("span_boundary", [False, True], ids=["steps-apart", "collective-across-steps"])
def test_windows_never_cut_a_collective_and_carry_each_ranks_end(span_boundary: bool) -> None:
    arrays = _two_ranks_three_steps(span_boundary)
    windows = replay.step_windows(arrays, max_events=1)
    assert windows is not None
    steps = [w["steps"] for w in windows]
    assert steps == ([(0, 1), (1, 3)] if span_boundary else [(0, 1), (1, 2), (2, 3)])
    rng = np.random.default_rng(0)
    n = arrays["prev"].size
    gap, work = rng.uniform(0.0, 3.0, (2, n)), rng.uniform(0.0, 3.0, (2, n))
    start = np.zeros((2, n))
    arrays["plan"] = windows
    cut = replay.replay(arrays, gap, work, start)
    arrays["plan"] = replay.step_windows(arrays, max_events=1 << 40)
    assert len(arrays["plan"]) == 1
    whole = replay.replay(arrays, gap, work, start)
    assert np.array_equal(cut, whole)
    # The members of a collective start it together, once the last has arrived: each then ends its own work later.
    members = np.flatnonzero(np.arange(n) % 6 == 5)
    assert np.allclose(whole[:, members[0]] - work[:, members[0]], whole[:, members[1]] - work[:, members[1]])


def _report_with_preparation_windows(table: pl.DataFrame, rows: int, use_labels: bool, monkeypatch) -> dict:  # type: ignore[no-untyped-def]
    """The report with the preparation (matching, statistics, the replay's columns) cut into windows of at most
    ``rows`` rows of whole steps, and the replay into windows of one step."""
    monkeypatch.setattr(stragglers, "PREPARE_ROWS", rows)
    return analyse_stragglers(table, use_labels=use_labels).to_dict()


def _generated_pipeline(tmp_path: Path) -> pl.DataFrame:
    job = generate(
        Layout(pp=2, dp=4), steps=6, faults=(Fault("compute", {"pp": 1}, factor=1.4, phase="backward"),), seed=3
    )
    return _read(job.write(tmp_path / "pipeline.parquet"))


def _simulated(tmp_path: Path) -> pl.DataFrame:
    return _read(SIMULATED)


@pytest.mark.parametrize("use_labels", [True, False], ids=["step-labels", "recovered-steps"])
@pytest.mark.parametrize(
    "source",
    [_generated, _generated_pipeline, _recorded, _simulated],
    ids=["generated-dp-compute", "generated-pp-backward", "recorded-kineto", "simulated-raw-logs"],
)
def test_a_preparation_window_by_window_of_steps_gives_the_report_of_one_window(
    source, use_labels: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    table = source(tmp_path)
    windows = []
    prepare = stragglers._prepare_window

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        windows.append(1)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(stragglers, "_prepare_window", counted)
    whole = _report_with_preparation_windows(table, 1 << 40, use_labels, monkeypatch)
    assert len(windows) == 1
    windows.clear()
    cut = _report_with_preparation_windows(table, 1, use_labels, monkeypatch)
    assert len(windows) > 1
    assert whole["culprits"]
    assert whole["waiting"]
    assert whole == cut


def test_preparation_windows_never_cut_a_collective_or_a_transfer_across_steps() -> None:
    # Two ranks, four steps; rank 1's all-reduce of step 1 was labelled step 2 (recovered steps cut per rank),
    # and rank 0's send of step 3 is received by rank 1 in step 4: steps 1-2 and steps 3-4 must share a window.
    rows = []
    for rank in (0, 1):
        for step in range(5):
            labelled = 2 if (rank, step) == (1, 1) else step
            rows.append((rank, labelled, "all_reduce", False, step, None))
    rows.append((0, 3, "send", True, None, 1))
    rows.append((1, 4, "recv", True, None, 0))
    df = pl.DataFrame(rows, schema=["rank", "_step", "op", "is_p2p", "seq", "peer"], orient="row").with_columns(
        row=pl.int_range(pl.len(), dtype=pl.Int64),
        comm_id=pl.when(pl.col("is_p2p")).then(pl.lit("p")).otherwise(pl.lit("c")),
        comm_size=pl.lit(2),
        start_ns=pl.col("_step").cast(pl.Int64) * 1000,
        end_ns=pl.col("_step").cast(pl.Int64) * 1000 + 10,
        enqueue_ns=pl.lit(None, pl.Int64),
    )
    pairs = stragglers.p2p_pairs(df)
    assert pairs.height == 1
    assert stragglers._preparation_windows(df, pairs, 1) == [(0, 0), (1, 2), (3, 4)]
    assert stragglers._preparation_windows(df, pairs.clear(), 1) == [(0, 0), (1, 2), (3, 3), (4, 4)]


def test_windows_are_prepared_alone_in_any_order(tmp_path: Path) -> None:
    # What a window needs of the others comes from the plan (pairs, roles, each rank's next start), so map tasks
    # over step windows can prepare them in any order, on any worker.
    table = _generated_pipeline(tmp_path).with_row_index("row").with_columns(pl.col("row").cast(pl.Int64))
    table = table.with_columns(_step=pl.col("step"))
    plan = stragglers.plan_preparation(table, max_rows=1)
    assert len(plan.windows) == 6
    forward = [stragglers.prepare_window(table, plan, i) for i in range(6)]
    backward = [stragglers.prepare_window(table, plan, i) for i in reversed(range(6))][::-1]
    for a, b in zip(forward, backward, strict=True):
        assert a.columns.keys() == b.columns.keys()
        # Matched groups are numbered in no particular order: the same events must form the same groups.
        assert all(np.array_equal(a.columns[k], b.columns[k], equal_nan=True) for k in a.columns if k != "group")
        pairs = np.unique(np.c_[a.columns["group"], b.columns["group"]], axis=0)
        assert np.unique(pairs[:, 0]).size == np.unique(pairs[:, 1]).size == pairs.shape[0]
        assert a.vocab == b.vocab
        assert a.per.sort("_step", "rank").equals(b.per.sort("_step", "rank"))
    # Cut into windows or not, the replay keeps the same events (each rank's next start comes from the plan).
    whole = stragglers.plan_preparation(table, max_rows=1 << 40)
    one = stragglers.prepare_window(table, whole, 0)
    assert sum(p.columns["row"].size for p in forward) == one.columns["row"].size


@pytest.mark.parametrize("rows", [1 << 40, 1], ids=["one-window", "one-step-windows"])
@pytest.mark.parametrize("steps", [1, 3])
def test_each_ranks_last_compute_row_of_the_trace_counts_in_its_step(
    steps: int, rows: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every rank ends the trace with its optimizer (a compute row, followed by nothing). It is work, not a step
    # annotation: a job whose last compute rows are 40 ms slower has a last step 40 ms longer.
    slower_ns = 40_000_000
    generate(Layout(tp=2, pp=2, dp=2), steps=steps, seed=4).write(tmp_path / "job.parquet")
    table = pl.from_arrow(load(tmp_path / "job.parquet"))
    assert isinstance(table, pl.DataFrame)
    table = table.with_row_index("i")
    last = table.sort("rank", "start_ns").group_by("rank").agg(pl.col("i").last(), pl.col("op").last())
    assert last.height == 8
    assert last.get_column("op").to_list() == ["compute"] * 8
    slow = table.with_columns(
        end_ns=pl.when(pl.col("i").is_in(last.get_column("i").implode()))
        .then(pl.col("end_ns") + slower_ns)
        .otherwise(pl.col("end_ns"))
    )
    monkeypatch.setattr(stragglers, "PREPARE_ROWS", rows)
    fast_steps = analyse_stragglers(table.drop("i")).to_dict()["per_step"]
    slow_steps = analyse_stragglers(slow.drop("i")).to_dict()["per_step"]
    assert len(fast_steps) == len(slow_steps) == steps
    durations = [[s["duration_ms"] for s in report] for report in (fast_steps, slow_steps)]
    assert durations[1][:-1] == durations[0][:-1]
    assert durations[1][-1] == pytest.approx(durations[0][-1] + slower_ns / 1e6, abs=1e-6)
    if steps == 1:
        # One step: its time is the trace's, from the first start to the last end (the optimizers' ends).
        for frame, (duration,) in zip((table, slow), durations, strict=True):
            span = frame.select(pl.col("end_ns").max() - pl.col("start_ns").min()).item()
            assert duration == pytest.approx(span / 1e6, abs=1e-6)


@pytest.mark.parametrize(
    "source", [_generated, _recorded, _simulated], ids=["generated-dp-compute", "recorded-kineto", "simulated-raw-logs"]
)
def test_the_report_from_stored_window_parts_is_the_report_of_the_table(source, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # A map task per window writes its part (frames, as Parquet); the merge reads them back in window order.
    table = source(tmp_path)
    df, facts = stragglers.prepare_table(table)
    plan = stragglers.plan_preparation(df, max_rows=1)
    assert len(plan.windows) > 1
    stored = []
    for i in reversed(range(len(plan.windows))):
        frames = stragglers.prepare_window(df, plan, i).to_frames()
        for name, frame in frames.items():
            frame.write_parquet(tmp_path / f"part-{i}-{name}.parquet")
        stored.append(i)
    parts = [
        stragglers.WindowPart.from_frames(
            {name: pl.read_parquet(tmp_path / f"part-{i}-{name}.parquet") for name in frames}
        )
        for i in sorted(stored)
    ]
    merged = stragglers.report_from_windows(facts, plan, parts).to_dict()
    whole = analyse_stragglers(table).to_dict()
    assert whole["culprits"]
    assert whole == merged


def test_planned_windows_read_back_from_their_file_equal_the_windows_held_in_memory() -> None:
    arrays = _two_ranks_three_steps(span_boundary=True)
    rng = np.random.default_rng(1)
    columns = {"work32": (rng.uniform(0.0, 3.0, arrays["prev"].size), np.float32)}
    held = replay.step_windows(arrays, max_events=1 << 40, columns=columns)
    spilled = replay.step_windows(arrays, max_events=1, columns=columns)
    assert held is not None
    assert spilled is not None
    (whole,) = list(held)
    parts = list(spilled)
    assert len(parts) == 2
    # Each window read back holds its own events' slices, as planned, and the same kind of level plan.
    events = np.concatenate([w["events"] for w in parts])
    assert np.array_equal(np.sort(events), whole["events"])
    assert np.array_equal(np.concatenate([w["work32"] for w in parts])[np.argsort(events)], whole["work32"])
    assert all(w["work32"].dtype == np.float32 and len(w["plan"]) > 0 for w in parts)
    first, again = next(iter(spilled)), parts[0]  # read again from the file
    assert first.keys() == again.keys()
    for name, value in first.items():
        if isinstance(value, np.ndarray):
            assert np.array_equal(value, again[name]), name
    for (a_general, a_fast), (b_general, b_fast) in zip(first["plan"], again["plan"], strict=True):
        assert (a_general is None) == (b_general is None)
        for x, y in zip(a_general or a_fast, b_general or b_fast, strict=True):
            assert np.array_equal(x, y)


def test_the_replay_inputs_are_prepared_one_window_at_a_time_and_nothing_per_event_is_held_once_planned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = _generated(tmp_path)
    added: list[int] = []
    held: list[dict] = []
    add, finish = replay_inputs.ReplayInputs.add, replay_inputs.ReplayInputs.finish

    def counted(self: replay_inputs.ReplayInputs, cols: dict) -> None:
        added.append(int(cols["row"].size))
        add(self, cols)

    def finished(self: replay_inputs.ReplayInputs, stage: object) -> dict:
        arrays = finish(self, stage)  # type: ignore[arg-type]
        held.append({k: v.size for k, v in arrays.items() if isinstance(v, np.ndarray) and v.ndim == 1})
        return arrays

    monkeypatch.setattr(stragglers, "PREPARE_ROWS", 1)
    monkeypatch.setattr(replay, "window_events", lambda: 1)
    monkeypatch.setattr(replay_inputs.ReplayInputs, "add", counted)
    monkeypatch.setattr(replay_inputs.ReplayInputs, "finish", finished)
    report = analyse_stragglers(table).to_dict()
    assert report["culprits"]
    # One window (here one step) of events handed over at a time, never the trace's events at once.
    assert len(added) == len(report["per_step"]) > 1
    assert max(added) <= 2 * sum(added) / len(added)
    # Once planned: per step, per rank, per atom; far fewer than the job's events; the windows hold the rest.
    (sizes,) = held
    assert sum(added) > 4 * max(sizes.values())
