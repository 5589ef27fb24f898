"""``comminsight logs show``: what a user sees for segments, rings and bad files."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from comminsight.cli import app

REQUIRED = ["comm_hash", "comm_name", "rank", "nranks", "func", "seq", "count", "bytes", "dtype", "peer", "root"]
REQUIRED += ["enqueue_ns", "gpu_start_ns", "gpu_end_ns", "state"]
runner = CliRunner()


def test_show_prints_one_json_object_per_operation(drive, home):
    drive("ops", "--ops", "3", "--name", "dp")
    result = runner.invoke(app, ["logs", "show", str(home / "inspector_logs")])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert all(key in row for key in REQUIRED)
        assert row["state"] == "completed"
        assert row["comm_name"] == "dp"
        assert row["root"] is None  # AllReduce has no root
        assert row["gpu_end_ns"] > row["gpu_start_ns"]


def test_show_reads_a_ring_file_too(drive, home):
    drive("ops", "--ops", "2")
    (ring,) = (home / "shms").glob("*.ring")
    result = runner.invoke(app, ["logs", "show", str(ring), "--format", "jsonl"])
    assert result.exit_code == 0, result.output
    assert len(result.stdout.splitlines()) == 2


def test_show_as_a_table_names_the_operations(drive, home):
    drive("ops", "--ops", "2")
    result = runner.invoke(app, ["logs", "show", str(home / "inspector_logs"), "--format", "table"])
    assert result.exit_code == 0, result.output
    assert "AllReduce" in result.stdout
    assert "completed" in result.stdout


def test_show_names_the_problem_with_a_file_that_is_not_a_segment(tmp_path):
    bad = tmp_path / "x.cilog"
    bad.write_bytes(b"\x00" * 600)
    result = runner.invoke(app, ["logs", "show", str(bad)])
    assert result.exit_code == 2
    assert "bad magic" in result.output


def test_show_of_a_missing_path_fails_cleanly(tmp_path):
    result = runner.invoke(app, ["logs", "show", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "nope" in result.output
