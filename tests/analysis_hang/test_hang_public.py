"""Hang analysis on public Flight Recorder dumps (flight_recorder_nvrx/gpu_error_1st).

Ground truth: gpu_error_1st_reference.txt names the stuck group and its missing rank;
fault_injection.log names the ranks whose GPUs were broken. The tests read both files rather
than repeating their contents, so the expectations come from the data's own answer key.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from comminsight.analysis import analyze_hang
from comminsight.cli import app
from comminsight.importers import load
from comminsight.importers.normalise import op_name, shape_display

FR_PUBLIC = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "public" / "flight_recorder_nvrx"


def _reference() -> dict:
    lines = (FR_PUBLIC / "gpu_error_1st_reference.txt").read_text().splitlines()
    fields = [f.strip() for f in lines[1].split("|")]
    return {
        "group_id": fields[0],
        "group_desc": fields[1].split(",")[0],
        "op": op_name(fields[2]),
        "shape": fields[3],
        "dtype": fields[4].lower(),
        "missing": [int(r) for r in re.findall(r"\d+", fields[5])],
    }


def _fault_ranks(directory: Path) -> list[int]:
    text = (directory / "fault_injection.log").read_text()
    return [int(r) for r in re.findall(r"\d+", text.split("Fault ranks:")[1].splitlines()[0])]


def test_gpu_error_1st_first_stuck_group_is_the_reference_group_with_its_missing_rank(gpu_error_1st):
    report = analyze_hang(load(gpu_error_1st))
    expected = _reference()
    assert report["verdict"] == "hang"
    first = report["stuck_groups"][0]
    assert first["group_id"] == expected["group_id"]
    assert first["group_desc"] == expected["group_desc"]
    assert first["op"] == expected["op"]
    assert shape_display(first["shape"]) == expected["shape"]
    assert first["dtype"] == expected["dtype"]
    assert first["missing_ranks"] == expected["missing"]


def test_gpu_error_1st_root_causes_are_the_fault_injected_ranks(gpu_error_1st):
    report = analyze_hang(load(gpu_error_1st))
    faults = _fault_ranks(gpu_error_1st)
    # Both faulty ranks, and they come first: one stopped entering, the other stopped completing.
    assert sorted(report["root_cause_ranks"][: len(faults)]) == sorted(faults)
    assert report["root_cause_ranks"][0] in _reference()["missing"]
    assert set(faults) <= set(report["failures"]["stalled_completion_ranks"])


def test_gpu_error_1st_chain_starts_at_a_root_cause_and_names_the_waiting_ranks(gpu_error_1st):
    report = analyze_hang(load(gpu_error_1st))
    head = report["chain"][0]
    assert head["rank"] == report["root_cause_ranks"][0]
    blocked = {b["group_id"]: b["waiting_ranks"] for b in head["blocks"]}
    assert _reference()["group_id"] in blocked
    assert blocked[_reference()["group_id"]]


def test_analyze_hang_cli_prints_the_verdict_first_then_the_evidence(gpu_error_1st):
    result = CliRunner().invoke(app, ["analyze", "hang", str(gpu_error_1st)])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[0].startswith("Verdict: hang")
    assert _reference()["group_desc"] in result.output
    assert "Dependency chain" in result.output


def test_analyze_hang_cli_json_has_the_documented_keys(gpu_error_1st):
    result = CliRunner().invoke(app, ["analyze", "hang", str(gpu_error_1st), "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["verdict"] == "hang"
    assert all(isinstance(r, int) for r in report["root_cause_ranks"])
    for key in ("group_id", "group_desc", "op", "seq", "shape", "dtype", "entered_ranks", "missing_ranks"):
        assert key in report["stuck_groups"][0]
    assert set(report["evidence"]) == {str(r) for r in range(16)}
