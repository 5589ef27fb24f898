"""Step recovery from communication alone: synthetic layouts, the public ByteDance trace, streaming."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import synthetic
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from comminsight.cli import app
from comminsight.importers import load
from comminsight.semantic import (
    CheckpointError,
    StepCalibration,
    StepEngine,
    load_calibration,
    prepare_events,
    recover_steps,
    save_calibration,
)
from comminsight.semantic.engine import summaries_frame
from comminsight.semantic.steps import run_engine
from comminsight.simulator.tracegen import Layout, generate
from tests.analysis_partitioned.compare import step_doc


def _unlabelled(layout: str, **kwargs) -> tuple[pl.DataFrame, np.ndarray]:
    df = pl.from_arrow(synthetic.table(layout, **kwargs))
    return df.with_columns(step=pl.lit(None, dtype=pl.Int64)), df.get_column("step").to_numpy()


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "megatron"])
def test_recovered_steps_match_the_true_boundaries_exactly(layout: str) -> None:
    df, truth = _unlabelled(layout, slow={1: 1.3}, seed=3)
    report = recover_steps(df)
    assert report.method == layout
    recovered = np.full(df.height, -2)
    recovered[report.event_rows] = report.event_steps
    assert np.array_equal(recovered, truth)  # every operation lands in its own step, numbered from 0
    # Job-level step starts are the first operation of each true step.
    starts = df.with_columns(step=pl.Series(truth)).group_by("step").agg(pl.col("start_ns").min()).sort("step")
    assert [s["start_ns"] for s in report.steps] == starts.get_column("start_ns").to_list()


def test_period_detection_finds_the_step_when_no_template_fits() -> None:
    df, truth = _unlabelled("ddp", seed=5)
    report = recover_steps(df, use_templates=False)
    assert report.method == "period"
    labelled = df.with_columns(step=pl.Series(truth))
    agreement = recover_steps(labelled, use_templates=False).agreement
    assert agreement["one_to_one"]
    assert agreement["event_agreement"] >= 0.95


def test_bytedance_steps_recovered_without_labels_agree_with_the_true_labels(bytedance_dir) -> None:
    table = pl.from_arrow(load(bytedance_dir / "trace-ST.parquet"))
    truth = table.get_column("step").to_numpy()
    report = recover_steps(table.with_columns(step=pl.lit(None, dtype=pl.Int64)))
    assert report.method == "megatron"
    from comminsight.semantic import agreement_with_labels

    agreement = agreement_with_labels(truth[report.event_rows], report.event_steps)
    assert agreement["one_to_one"]
    assert agreement["steps_recovered"] == np.unique(truth).size
    assert agreement["event_agreement"] == 1.0


@pytest.mark.parametrize("buckets", [150, 200, 600])
@pytest.mark.parametrize("use_templates", [True, False])
def test_steps_of_hundreds_of_identical_operations_are_found(buckets: int, use_templates: bool) -> None:
    # Hundreds of equal gradient buckets per step: rated per event, the sequence matched itself at
    # lag 1 almost everywhere, so period detection took every operation for a step and gave up.
    df, truth = _unlabelled("ddp", ranks=2, steps=8, buckets=buckets, seed=2)
    report = recover_steps(df, use_templates=use_templates)
    assert report.method == ("ddp" if use_templates else "period")
    recovered = np.full(df.height, -2)
    recovered[report.event_rows] = report.event_steps
    assert np.array_equal(recovered, truth)


@pytest.mark.parametrize("use_templates", [True, False])
def test_a_step_longer_than_the_warm_up_is_found_when_streamed(use_templates: bool) -> None:
    # 601 operations per step against a 256-event warm-up (the live agent's is short too): the engine
    # looks again at more events instead of deciding on less than one step.
    df, truth = _unlabelled("ddp", ranks=2, steps=10, buckets=600, seed=4)
    events = prepare_events(df)
    engine = StepEngine(warmup=256, use_templates=use_templates)
    rows, steps = [], []
    for lo in range(0, len(events["rank"]), 97):
        out = engine.feed({k: v[lo : lo + 97] for k, v in events.items()})
        rows.append(out["rows"])
        steps.append(out["steps"])
        engine = StepEngine.resume(engine.checkpoint())  # the retry survives a restart
    out = engine.flush()
    rows.append(out["rows"])
    steps.append(out["steps"])
    recovered = np.full(df.height, -2)
    recovered[np.concatenate(rows)] = np.concatenate(steps)
    assert np.array_equal(recovered, truth)


def test_a_sequence_that_never_repeats_is_given_up_after_a_bounded_buffer() -> None:
    rng = np.random.default_rng(0)
    n = 5000
    engine = StepEngine(warmup=64)
    start = np.arange(n, dtype=np.int64) * 1000
    sig = rng.integers(0, 2000, n)
    out = engine.feed(
        {
            "rank": np.zeros(n, np.int64),
            "row": np.arange(n),
            "sig": sig,
            "role": np.zeros(n, np.int64),
            "start_ns": start,
            "end_ns": start + 10,
        }
    )
    assert engine.ranks[0].method == "none"
    assert len(out["rows"]) == n  # answered, not held forever
    assert np.all(out["steps"] == -1)  # in no step


def _events(seed: int = 11) -> dict[str, np.ndarray]:
    df = pl.from_arrow(synthetic.table("megatron", steps=6, seed=seed))
    return prepare_events(df)


def _summaries(blocks: list[dict]) -> list[tuple]:
    return summaries_frame(blocks).sort("rank", "step").rows()


def _one_pass(events: dict[str, np.ndarray]) -> tuple[np.ndarray, list[tuple]]:
    rows, steps, final = run_engine(events, StepEngine(warmup=64), None)
    order = np.argsort(rows)
    return steps[order], _summaries(final)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cuts=st.lists(st.integers(min_value=1, max_value=400), min_size=1, max_size=12), stop_every=st.integers(1, 4))
def test_resuming_from_checkpoints_after_any_chunking_equals_one_pass(cuts: list[int], stop_every: int) -> None:
    events = _EVENTS
    expected_steps, expected_final = _ONE_PASS
    n = len(events["rank"])
    bounds = sorted({min(c * 7, n) for c in cuts} | {0, n})
    engine = StepEngine(warmup=64)
    rows, steps, final = [], [], []
    for i, (lo, hi) in enumerate(pairwise(bounds)):
        out = engine.feed({k: v[lo:hi] for k, v in events.items()})
        rows.append(out["rows"])
        steps.append(out["steps"])
        final.extend(out["final"])
        if i % stop_every == 0:  # stop here and resume from the serialised state
            engine = StepEngine.resume(engine.checkpoint())
    out = engine.flush()
    rows.append(out["rows"])
    steps.append(out["steps"])
    final.extend(out["final"])
    rows_a, steps_a = np.concatenate(rows), np.concatenate(steps)
    assert np.array_equal(np.sort(rows_a), np.sort(events["row"]))  # every event answered once
    assert np.array_equal(steps_a[np.argsort(rows_a)], expected_steps)
    assert _summaries(final) == expected_final


_EVENTS = _events()
_ONE_PASS = _one_pass(_EVENTS)


def test_only_steps_older_than_the_stable_window_are_final() -> None:
    events = _EVENTS
    engine = StepEngine(warmup=64, window=2)
    out = engine.feed(events)
    per_rank_open = {r: st.step for r, st in engine.ranks.items()}
    early = summaries_frame(out["final"])
    assert early.height > 0
    for rank, step in early.select("rank", "step").iter_rows():
        assert step <= per_rank_open[rank] - 2
    rest = summaries_frame(engine.flush()["final"])
    assert set(rest.select("rank", "step").rows()).isdisjoint(early.select("rank", "step").rows())


def test_memory_of_the_engine_does_not_grow_with_the_number_of_steps() -> None:
    short = prepare_events(pl.from_arrow(synthetic.table("ddp", steps=8, seed=1)))
    long = prepare_events(pl.from_arrow(synthetic.table("ddp", steps=40, seed=1)))
    sizes = []
    for events in (short, long):
        engine = StepEngine(warmup=32)
        for lo in range(0, len(events["rank"]), 50):
            engine.feed({k: v[lo : lo + 50] for k, v in events.items()})
        sizes.append(len(engine.checkpoint()))
    assert sizes[1] <= sizes[0] * 1.2


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"not json",
        b"[]",
        b'{"version": 99}',
        b'{"version": 1, "templates": [], "warmup": 1, "window": 1}',
        json.dumps(
            {"version": 1, "templates": ["nope"], "warmup": 1, "window": 1, "min_fit": 0.5, "ranks": {}}
        ).encode(),
        json.dumps(
            {
                "version": 1,
                "templates": [],
                "warmup": 1,
                "window": 1,
                "min_fit": 0.5,
                "ranks": {
                    "0": {
                        "method": "period",
                        "anchor": 10**9,
                        "after_end": True,
                        "step": 0,
                        "buffer": None,
                        "open_steps": {},
                    }
                },
            }
        ).encode(),
        json.dumps(
            {
                "version": 1,
                "templates": [],
                "warmup": 1,
                "window": 1,
                "min_fit": 0.5,
                "ranks": {
                    "0": {
                        "method": "period",
                        "anchor": 1,
                        "after_end": True,
                        "step": 0,
                        "buffer": {"row": "!!!", "sig": "", "role": "", "start_ns": "", "end_ns": "", "wait_ns": ""},
                        "open_steps": {},
                    }
                },
            }
        ).encode(),
        b"{" * 100_000,
    ],
)
def test_a_damaged_checkpoint_is_refused_with_a_clear_error(blob: bytes) -> None:
    with pytest.raises(CheckpointError):
        StepEngine.resume(blob)


def test_step_calibration_renumbers_steps_and_clearing_restores_them(tmp_path) -> None:
    df, _ = _unlabelled("fsdp", seed=2)
    plain = recover_steps(df)
    path = tmp_path / "semantics" / "step" / "calibration.json"
    save_calibration(path, StepCalibration.from_pair(recovered=0, framework=1000))
    calibrated = recover_steps(df, calibration=load_calibration(path))
    assert [s["step"] for s in calibrated.steps] == [s["step"] + 1000 for s in plain.steps]
    save_calibration(path, None)
    assert load_calibration(path) is None
    path.write_text('{"offset": "ten"}')
    with pytest.raises(ValueError, match="whole number"):
        load_calibration(path)


def test_steps_command_reports_json_with_agreement_when_labels_exist(bytedance_dir) -> None:
    result = CliRunner().invoke(app, ["analyze", "steps", str(bytedance_dir / "trace-ST.parquet"), "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["method"] == "megatron"
    assert doc["agreement"]["event_agreement"] == 1.0
    first = doc["steps"][0]
    assert {"step", "start_ns", "end_ns", "duration_ms", "ranks"} <= set(first)
    assert set(first["ranks"]["0"]) >= {"comm_ms", "exposed_wait_ms", "duration_ms"}


def test_steps_command_text_names_the_method(bytedance_dir) -> None:
    result = CliRunner().invoke(app, ["analyze", "steps", str(bytedance_dir / "trace-ST.parquet"), "--ignore-labels"])
    assert result.exit_code == 0, result.output
    assert "method: megatron" in result.stdout
    assert "agreement" not in result.stdout


def test_steps_command_rejects_a_bad_template_file_without_running(tmp_path, bytedance_dir) -> None:
    bad = tmp_path / "t.toml"
    bad.write_text('name = "x"\n[[tokens]]\nname = "a"\nclass = "sometimes"\n')
    result = CliRunner().invoke(
        app, ["analyze", "steps", str(bytedance_dir / "trace-ST.parquet"), "--template", str(bad)]
    )
    assert result.exit_code == 2
    assert "class" in result.output


def _steps_document(df: pl.DataFrame, **options) -> dict:
    """What a user reads of the steps of ``df`` (whose ``_id`` names each row): the report, and each row's step."""
    report = recover_steps(df, **options)
    ids = df.get_column("_id").to_numpy()[report.event_rows]
    return step_doc(report) | {"row_steps": sorted(zip(ids.tolist(), report.event_steps.tolist(), strict=True))}


def _generated(layout: Layout, tmp_path: Path) -> pl.DataFrame:
    """A generated job's communication without coordinates (roles from the communicators' shape)."""
    path = tmp_path / "comm.parquet"
    job = generate(layout, steps=6, seed=3)
    job.communication_only().drop("cp_rank", "dp_rank", "stage", "tp_rank").write_parquet(path)
    df = pl.from_arrow(load(path))
    assert isinstance(df, pl.DataFrame)
    return df


SOURCES = {
    **{f"{layout}, labelled": (layout, True) for layout in ("ddp", "fsdp", "megatron")},
    **{f"{layout}, unlabelled": (layout, False) for layout in ("ddp", "fsdp", "megatron")},
    # Read in the input's own order, these once gave other roles and steps when their rows were shuffled.
    "generated DP8xPP8, 8 micro-batches": (Layout(pp=8, dp=8, microbatches=8), False),
    "generated TP2xPP8xDP2 interleaved": (Layout(tp=2, pp=8, dp=2, microbatches=8, virtual=2), False),
}


@pytest.mark.parametrize("source", SOURCES)
def test_shuffled_rows_and_rows_in_reverse_rank_order_give_the_same_steps(source: str, tmp_path: Path) -> None:
    layout, labelled = SOURCES[source]
    if isinstance(layout, Layout):
        df = _generated(layout, tmp_path)
    else:
        df = pl.from_arrow(synthetic.table(layout, slow={1: 1.3}, seed=3))
        assert isinstance(df, pl.DataFrame)
    df = df.with_row_index("_id")
    if not labelled:
        df = df.with_columns(step=pl.lit(None, dtype=pl.Int64))
    expected = _steps_document(df, compute_waits=True)
    assert expected["steps"]
    for seed in (7, 8):
        assert _steps_document(df.sample(fraction=1.0, shuffle=True, seed=seed), compute_waits=True) == expected
    assert _steps_document(df.sort("rank", descending=True, maintain_order=True), compute_waits=True) == expected
    # Waiting given in the input's own order goes with its rows.
    wait = np.arange(df.height, dtype=np.int64) % 5_000
    expected = _steps_document(df, wait_ns=wait)
    shuffled = df.sample(fraction=1.0, shuffle=True, seed=7)
    assert _steps_document(shuffled, wait_ns=wait[shuffled.get_column("_id").to_numpy()]) == expected
